"""NGRAM drafting (prompt lookup): propose what followed earlier occurrences of a
request's last tokens in its own tokens (prompt, session history and output).

``TokenHistory`` keeps one request's tokens in a growing array.  ``NgramProposer``
finds, per request, the earlier positions whose preceding tokens equal the request's
suffix, for the longest suffix length in ``[min_match, max_match]`` (the most recent
occurrence first), and turns what followed them into a draft tree: a trie of up to
``topk`` children per node and ``steps`` deep, of which the ``T - 1`` nodes most
continuations pass through are kept (a parent always before its children).  A request
with fewer proposals pads its tree with copies of the root token under the root: they
are verified like any draft and only accepted where the target agrees, so the output
never changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specd.kernels.ops import TORCH_OPS, KernelOps, host_tensor
from specd.workers.requests.request import Req
from specd.workers.speculative.tree import DraftTree

# continuations read per request: enough to fill a topk-wide tree from distinct matches
CONTINUATIONS_PER_BRANCH = 4


class TokenHistory:
    """One request's tokens, appended in place (amortized doubling)."""

    def __init__(self, tokens: list[int]):
        self._buf = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self._len = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self._len

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[: self._len]

    def extend(self, tokens: list[int] | tuple[int, ...]) -> None:
        end = self._len + len(tokens)
        if end > len(self._buf):
            grown = np.empty(max(end, 2 * len(self._buf)), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : end] = tokens
        self._len = end


@dataclass(frozen=True, slots=True)
class RequestTokens:
    """A drafting request's tokens up to its root (the last one), and whose they are:
    NGRAM's and SUFFIX's drafting state, and the hybrid's beside the draft model's."""

    history: TokenHistory
    owner: str | None  # the API key's id it came with (SUFFIX's cache is per owner)
    output_start: int  # where its output begins in ``history``

    @classmethod
    def at_prompt_end(cls, req: Req, root: int, token: int) -> RequestTokens:
        """``req``'s tokens once positions ``[0, root)`` are in the KV and ``token``
        was sampled after them (the prompt's session history included)."""
        return cls(TokenHistory([*req.fill_ids[:root], token]), req.owner, len(req.prompt_ids))

    @classmethod
    def of_completed_prompts(
        cls,
        reqs: Sequence[Req],
        starts: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        complete: Sequence[bool],
    ) -> dict[str, RequestTokens]:
        """An extend's chunks (``SpecDecoder.after_extend``'s arguments) -> by rid, the
        tokens of each request whose prompt it completed, up to its sampled token."""
        return {
            req.rid: cls.at_prompt_end(req, start + len(ids), ids[-1])
            for req, start, ids, done in zip(reqs, starts, token_ids, complete, strict=True)
            if done
        }

    @property
    def root_position(self) -> int:
        return len(self.history) - 1

    @property
    def root_token(self) -> int:
        return int(self.history.tokens[-1])


def match_continuations(
    tokens: np.ndarray, min_match: int, max_match: int, length: int, limit: int
) -> list[np.ndarray]:
    """Up to ``limit`` continuations (each at most ``length`` tokens) of earlier
    occurrences of the suffix of ``tokens``: the longest matching suffix length in
    ``[min_match, max_match]`` first, then the most recent occurrence."""
    n = len(tokens)
    if n < min_match + 1:
        return []
    last = n - 1
    # occurrence ends e < last with tokens[e] == the last token; grown backwards below
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    if len(ends) == 0:
        return []
    matched = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_match, last)):
        prev = ends - back
        ok = alive & (prev >= 0)
        ok[ok] = tokens[prev[ok]] == tokens[last - back]
        matched += ok
        alive = ok
        if not alive.any():
            break
    keep = matched >= min_match
    if not keep.any():
        return []
    ends, matched = ends[keep], matched[keep]
    order = np.lexsort((-ends, -matched))[:limit]  # longest match, then most recent
    return [tokens[e + 1 : e + 1 + length] for e in ends[order]]


@dataclass(slots=True)
class _Node:
    token: int
    parent: int  # index in the trie, -1 for the root's children
    depth: int
    count: int = 1  # continuations through this node
    children: int = 0


@dataclass(frozen=True, slots=True)
class Proposal:
    """One request's draft nodes, parents first (``parents`` index ``tokens``, -1 for
    the root), and ``score``: the drafts a verify is expected to accept (the sum of the
    nodes' estimated probabilities)."""

    tokens: list[int]
    parents: list[int]
    score: float = 0.0


def continuation_tree(continuations: list[np.ndarray], topk: int, num_nodes: int) -> Proposal:
    """A trie of ``continuations`` (at most ``topk`` children per node) -> its best
    ``num_nodes`` nodes; a node's probability is the share of the continuations through
    it."""
    trie: list[_Node] = []
    child_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    root_children = 0
    for cont in continuations:
        parent = -1
        for token in cont.tolist():
            node = child_of.get((parent, token))
            if node is None:
                width = root_children if parent < 0 else trie[parent].children
                if width >= topk:
                    break
                node = len(trie)
                depth = 1 if parent < 0 else trie[parent].depth + 1
                trie.append(_Node(token, parent, depth, count=0))
                child_of[(parent, token)] = node
                if parent < 0:
                    root_children += 1
                else:
                    trie[parent].children += 1
            trie[node].count += 1
            parent = node
    # a child never has more continuations than its parent, and is deeper: sorting by
    # (count desc, depth, insertion) keeps every kept node's parent ahead of it
    order = sorted(range(len(trie)), key=lambda i: (-trie[i].count, trie[i].depth, i))
    kept = order[:num_nodes]
    slot = {node: i for i, node in enumerate(kept)}
    tokens = [trie[i].token for i in kept]
    parents = [-1 if trie[i].parent < 0 else slot[trie[i].parent] for i in kept]
    score = sum(trie[i].count for i in kept) / max(len(continuations), 1)
    return Proposal(tokens, parents, score)


def padded_tree(
    proposals: list[Proposal],
    roots: list[int],
    steps: int,
    num_tokens: int,
    device: torch.device,
    ops: KernelOps = TORCH_OPS,
) -> DraftTree:
    """The ``num_tokens``-node verify trees of ``proposals`` (root = each request's last
    token): node i + 1 is proposal node i; the rest are padding (copies of the root
    token under the root), cut off (``DraftTree.ragged``): a verify computes and tries
    only each request's own nodes, the root alone where it proposes nothing."""
    all_tokens, all_parents = [], []
    for proposal, root in zip(proposals, roots, strict=True):
        pad = num_tokens - 1 - len(proposal.tokens)
        all_tokens.append([root, *proposal.tokens] + [root] * pad)
        all_parents.append([-1] + [p + 1 for p in proposal.parents] + [0] * pad)
    tree = DraftTree.from_parents(
        host_tensor(all_tokens, device), host_tensor(all_parents, device), steps, ops
    )
    return tree.ragged([1 + len(p.tokens) for p in proposals])


@dataclass(slots=True)
class ShadowDraft:
    """The draft a speculating step would have verified at a root where the engine
    decoded plainly instead; the plain tokens that follow walk it as a verify would
    (greedy, or sampled: a sampled token equals a proposal as often as target-only
    verification accepts it), which measures NGRAM's acceptance on plain steps."""

    children: dict[tuple[int, int], int]  # (node, token) -> child node; the root is -1
    steps: int
    node: int = -1
    accepted: int = 0

    @classmethod
    def of(cls, proposal: Proposal, steps: int) -> ShadowDraft:
        nodes = enumerate(zip(proposal.tokens, proposal.parents, strict=True))
        return cls({(parent, token): i for i, (token, parent) in nodes}, steps)

    def follow(self, token: int) -> int | None:
        """The next plain token -> the drafts accepted once the walk ends (this token
        was the verify's bonus), else None."""
        if self.accepted < self.steps:
            child = self.children.get((self.node, token))
            if child is not None:
                self.node, self.accepted = child, self.accepted + 1
                return None
        return self.accepted


class NgramProposer:
    """Proposals from a request's own tokens (``TokenHistory``)."""

    def __init__(self, min_match: int, max_match: int):
        self.min_match = min_match
        self.max_match = max_match

    def propose(self, history: TokenHistory, steps: int, topk: int, num_nodes: int) -> Proposal:
        """At most ``num_nodes`` drafts, ``steps`` deep and ``topk`` wide, from the
        request's earlier matches of its suffix."""
        found = match_continuations(
            history.tokens,
            self.min_match,
            self.max_match,
            steps,
            topk * CONTINUATIONS_PER_BRANCH,
        )
        return continuation_tree(found, topk, num_nodes)
