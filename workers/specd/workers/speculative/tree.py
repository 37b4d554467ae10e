"""Draft trees: top-k drafting steps, best-(T-1) node selection, tree masks, positions.

Notation: bs requests, k = topk, S = draft steps, T = num_draft_tokens (tree size with the
root), V = vocab.  Node 0 of every tree is the root: the last bonus token, whose KV is not
written yet, so it sits at position ``seq_len``; the other nodes are draft tokens sorted
so that parents precede children.

The engine calls the steps between draft forwards (chain drafting is ``k == 1``)::

    step = first_step(draft_logprobs_after_root, k)           # [bs, V] -> k nodes
    steps = [step]
    for _ in range(S - 1):
        step = expand_step(step, draft_logprobs_after(step.tokens), k)  # [bs, k, V]
        steps.append(step)
    tree = build_tree(root_tokens, steps, T)

Everything is batched over requests and runs on CPU or CUDA with no host sync; the
structure from parent links and the verify mask come from the engine's ``KernelOps``
(torch, or one Triton launch each).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specd.kernels.ops import TORCH_OPS, KernelOps


@dataclass(frozen=True, slots=True)
class StepOut:
    """The k nodes one drafting step keeps.

    tokens [bs, k] int64; scores [bs, k] float32: cumulative draft log-prob from the root,
    best first; parents [bs, k] int64: index into the previous step's k nodes (-1 in step 0,
    whose parent is the root).
    """

    tokens: torch.Tensor
    scores: torch.Tensor
    parents: torch.Tensor


def first_step(logprobs: torch.Tensor, k: int) -> StepOut:
    """logprobs [bs, V]: draft log-probs after the root -> the root's top-k children."""
    scores, tokens = torch.topk(logprobs, k, dim=-1)  # [bs, k]
    return StepOut(tokens, scores.float(), torch.full_like(tokens, -1))


def expand_step(prev: StepOut, child_logprobs: torch.Tensor, k: int) -> StepOut:
    """Best k of the k x k candidates (each of prev's nodes' top-k children) by score.

    child_logprobs [bs, k, V]: draft log-probs after each of ``prev``'s nodes.  Ties keep
    the lower parent-major candidate index, so the choice does not depend on sort internals.
    """
    child_scores, child_tokens = torch.topk(child_logprobs, k, dim=-1)  # [bs, k_prev, k]
    cand = (prev.scores[:, :, None] + child_scores.float()).flatten(1)  # [bs, k_prev * k]
    keep = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, :k]  # [bs, k]
    return StepOut(
        tokens=child_tokens.flatten(1).gather(1, keep),
        scores=cand.gather(1, keep),
        parents=keep // k,
    )


@dataclass(frozen=True, slots=True)
class DraftTree:
    """T verify tokens per request with their tree structure (all int64 unless noted).

    tokens [bs, T]: node 0 = root (last bonus token), then draft tokens, parents first.
    parents [bs, T]: parent node index, -1 for the root.  depths [bs, T]: root 0.
    tree_mask [bs, T, T] bool: node i sees node j iff j is i or an ancestor of i.
    retrieve_next_token / retrieve_next_sibling [bs, T]: first child / next sibling (by
    node index, so the best-scored child comes first), -1 if none.
    num_steps: S, a bound on the depth (host int: sizes verify outputs without a sync).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    tree_mask: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    num_steps: int
    # per request, its first n nodes are its tree; the rest are padding that the walks
    # never try and a verify need not compute (``ragged``); None: all T are the tree
    node_counts: tuple[int, ...] | None = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    def positions(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """seq_lens [bs] (tokens before the root) -> [bs, T] positions ``seq_len + depth``."""
        return seq_lens.to(self.depths)[:, None] + self.depths

    @classmethod
    def from_parents(
        cls,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        num_steps: int | None = None,
        ops: KernelOps = TORCH_OPS,
    ) -> DraftTree:
        """Build depths, mask and retrieve arrays from tokens/parents [bs, T].

        Requires ``parents[:, 0] == -1`` and ``0 <= parents[:, i] < i`` (see
        ``check_invariants``).  ``num_steps`` defaults to the max depth (a device sync).
        """
        tokens, parents = tokens.long(), parents.long()
        structure = ops.tree_structure(parents)
        return cls(
            tokens=tokens,
            parents=parents,
            depths=structure.depths,
            tree_mask=structure.tree_mask,
            retrieve_next_token=structure.next_token,
            retrieve_next_sibling=structure.next_sibling,
            num_steps=int(structure.depths.max()) if num_steps is None else num_steps,
        )

    def walk_tokens(self) -> torch.Tensor:
        """[bs, T] the tokens a verify walk compares, -1 at padding (never a match)."""
        if self.node_counts is None:
            return self.tokens
        counts = torch.tensor(self.node_counts, device=self.tokens.device)[:, None]
        node = torch.arange(self.num_tokens, device=self.tokens.device)
        return self.tokens.masked_fill(node >= counts, -1)

    def ragged(self, node_counts: Sequence[int]) -> DraftTree:
        """This tree with request b's nodes past ``node_counts[b]`` cut off: padding nodes,
        last in node order, are unlinked from the walks (a link always points to a later
        node) and match no token (``walk_tokens``), so no verify accepts them and the
        verify forward may skip them."""
        if all(n == self.num_tokens for n in node_counts):
            return self  # no padding
        counts = torch.tensor(node_counts, device=self.tokens.device)[:, None]  # [bs, 1]
        return dataclasses.replace(
            self,
            retrieve_next_token=self.retrieve_next_token.masked_fill(
                self.retrieve_next_token >= counts, -1
            ),
            retrieve_next_sibling=self.retrieve_next_sibling.masked_fill(
                self.retrieve_next_sibling >= counts, -1
            ),
            node_counts=tuple(node_counts),
        )

    def check_invariants(self) -> None:
        """Raise ValueError unless the root is node 0 and every parent precedes its child."""
        node = torch.arange(self.num_tokens, device=self.parents.device)
        if not bool((self.parents[:, 0] == -1).all()):
            raise ValueError("node 0 must be the root (parent -1)")
        inner = self.parents[:, 1:]
        if not bool(((inner >= 0) & (inner < node[1:])).all()):
            raise ValueError("every draft node needs a parent that precedes it")
        if not bool((self.depths <= self.num_steps).all()):
            raise ValueError(f"a node is deeper than num_steps={self.num_steps}")


def build_tree(
    root_tokens: torch.Tensor,
    steps: Sequence[StepOut],
    num_draft_tokens: int,
    ops: KernelOps = TORCH_OPS,
) -> DraftTree:
    """Keep the best ``T - 1`` of the S*k drafted nodes, parents first, after the root.

    root_tokens [bs]; steps: S step outputs (each k nodes); no steps and T = 1 gives the
    root-only tree of the plain rung.  A node's rank score is the
    min of its own and its ancestors' scores (equal to its cumulative log-prob, which never
    exceeds its parent's); ties go to the lower candidate index ``s*k + j``, which is
    shallower, so a node is only kept if its parent is.  Kept nodes are sorted by
    candidate index, i.e. by (depth, rank within the step).

    Worked example, k=2, S=2, T=4, root token r (probabilities, scores are their logs)::

        step 0: a .6, b .3                      (parents: root, root)
        step 1: children of a: c .6 -> .36, d .2 -> .12
                children of b: e .9 -> .27, f .1 -> .03
                best 2 of 4: c .36 (parent 0 = a), e .27 (parent 1 = b)
        candidates s*k+j: 0:a .6  1:b .3  2:c .36  3:e .27
        best T-1 = 3: a, c, b -> sorted by index: a, b, c

        node     0  1  2  3         tree_mask   r a b c
        token    r  a  b  c                  r  1 0 0 0
        parent  -1  0  0  1                  a  1 1 0 0
        depth    0  1  1  2                  b  1 0 1 0
        next_token    1 3 -1 -1              c  1 1 0 1
        next_sibling -1 2 -1 -1
    """
    if not steps:  # the plain rung (steps 0): the root alone, verified like plain decode
        if num_draft_tokens != 1:
            raise ValueError(
                f"num_draft_tokens={num_draft_tokens} without drafting steps: the tree is "
                f"the root alone (1)"
            )
        root = root_tokens.long()[:, None]  # [bs, 1]
        return DraftTree.from_parents(root, torch.full_like(root, -1), num_steps=0, ops=ops)
    k, num_cand = steps[0].tokens.shape[1], len(steps) * steps[0].tokens.shape[1]
    if not 1 <= num_draft_tokens <= num_cand + 1:
        raise ValueError(
            f"num_draft_tokens={num_draft_tokens} must be in [1, steps*topk + 1 = {num_cand + 1}]"
        )
    tokens = torch.cat([s.tokens for s in steps], 1)  # [bs, S*k], candidate c = s*k + j
    parent_cand = torch.cat(
        [steps[0].parents] + [s.parents + (i - 1) * k for i, s in enumerate(steps) if i], 1
    )  # [bs, S*k], -1 = root
    rank_scores = _ancestor_min_scores(steps)
    best = torch.sort(rank_scores, dim=1, descending=True, stable=True).indices
    kept = torch.sort(best[:, : num_draft_tokens - 1], dim=1).values  # [bs, T-1]

    # candidate -> tree node, shifted by one so the root (candidate -1) maps to node 0
    bs = tokens.shape[0]
    node_of = torch.full((bs, num_cand + 1), -1, dtype=torch.long, device=tokens.device)
    node_of[:, 0] = 0
    node_ids = torch.arange(1, num_draft_tokens, device=tokens.device).expand(bs, -1)
    node_of.scatter_(1, kept + 1, node_ids)
    parents = node_of.gather(1, parent_cand.gather(1, kept) + 1)
    return DraftTree.from_parents(
        tokens=torch.cat([root_tokens.long()[:, None], tokens.gather(1, kept)], 1),
        parents=torch.cat([torch.full_like(parents[:, :1], -1), parents], 1),
        num_steps=len(steps),
        ops=ops,
    )


def _ancestor_min_scores(steps: Sequence[StepOut]) -> torch.Tensor:
    """[bs, S*k] min of each node's score and its ancestors' (monotone along every path)."""
    out = [steps[0].scores]
    for step in steps[1:]:
        out.append(torch.minimum(step.scores, out[-1].gather(1, step.parents)))
    return torch.cat(out, 1)


def tree_attention_mask_for_verify(
    tree: DraftTree, prefix_lens: torch.Tensor | Sequence[int], ops: KernelOps = TORCH_OPS
) -> torch.Tensor:
    """Flat bool verify mask in ``AttentionMetadata.custom_mask`` layout.

    Per request: ``[T, prefix_len + T]`` row-major, the prefix fully visible, then the tree
    mask, assuming the request's KV order is the prefix followed by the T nodes in node
    order; requests concatenated.  ``prefix_lens`` are host values (a tensor is read back).
    """
    lens = prefix_lens.tolist() if isinstance(prefix_lens, torch.Tensor) else list(prefix_lens)
    return ops.verify_mask(tree.tree_mask, lens)


def ragged_verify_mask(
    tree: DraftTree, prefix_lens: Sequence[int], node_counts: Sequence[int]
) -> torch.Tensor:
    """``tree_attention_mask_for_verify`` for a verify of each request's first
    ``node_counts[b]`` nodes only: per request ``[n, prefix_len + n]``, concatenated."""
    blocks = []
    for b, (prefix, n) in enumerate(zip(prefix_lens, node_counts, strict=True)):
        block = torch.ones(n, prefix + n, dtype=torch.bool, device=tree.tree_mask.device)
        block[:, prefix:] = tree.tree_mask[b, :n, :n]
        blocks.append(block.flatten())
    return torch.cat(blocks)
