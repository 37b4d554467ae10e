"""Hybrid drafting: the draft model's tree, or SUFFIX's where it promises more.

An EAGLE or EAGLE-3 deployment with ``speculative.suffix`` set keeps, beside the draft
model's state, each request's tokens (``RequestTokens``) and the replica's output cache
(``SuffixDrafting``).  Every speculating step the draft model drafts for the whole batch
as usual; then each request whose SUFFIX proposal expects at least
``suffix.hybridThreshold`` accepted drafts verifies that tree in its row instead.  The
draft model's state does not depend on which tree was verified: it re-reads the
accepted tokens with the target's features either way (``SpecDecoder._advance``).
"""

from __future__ import annotations

from typing import Any

import torch

from specd.kernels.ops import host_tensor
from specd.workers.requests.request import Req
from specd.workers.rung import Rung
from specd.workers.speculative.decoder import AcceptedPaths, DraftState, SpecDecoder
from specd.workers.speculative.guided_draft import DraftGuide
from specd.workers.speculative.layout import TreeLayout
from specd.workers.speculative.ngram import RequestTokens, padded_tree
from specd.workers.speculative.suffix import SuffixDrafting
from specd.workers.speculative.tree import DraftTree


class HybridDecoder(SpecDecoder):
    def __init__(self, *args: Any, drafting: SuffixDrafting, threshold: float, **kwargs: Any):
        """``SpecDecoder``'s arguments, SUFFIX's proposals and the score a SUFFIX tree
        needs to be verified instead of the draft model's."""
        super().__init__(*args, **kwargs)
        self.drafting = drafting
        self.threshold = threshold
        self.tracked: dict[str, RequestTokens] = {}  # compute side, as the draft states
        self._suffix_trees = 0

    def after_extend(
        self,
        reqs: list[Req],
        starts: list[int],
        token_ids: list[list[int]],
        features: list[torch.Tensor],
        complete: list[bool],
    ) -> None:
        super().after_extend(reqs, starts, token_ids, features, complete)
        self.tracked.update(RequestTokens.of_completed_prompts(reqs, starts, token_ids, complete))

    def defer(
        self, reqs: list[Req], roots: list[int], tokens: list[int], root_features: torch.Tensor
    ) -> tuple[float, int]:
        for req, token in zip(reqs, tokens, strict=True):
            self.tracked[req.rid].history.extend((token,))
        return super().defer(reqs, roots, tokens, root_features)

    def _advance(
        self, reqs: list[Req], new_roots: list[int], rung: Rung, accepted: AcceptedPaths
    ) -> None:
        super()._advance(reqs, new_roots, rung, accepted)
        for req, tokens in zip(reqs, accepted.tokens, strict=True):
            self.tracked[req.rid].history.extend(tokens)

    def drop(self, rids: list[str], finished: bool = False) -> None:
        """A finished request's output joins the cache."""
        for rid in rids:
            tracked = self.tracked.pop(rid, None)
            if finished and tracked is not None:
                self.drafting.record(tracked)
        super().drop(rids, finished)

    def _draft_tree(
        self,
        reqs: list[Req],
        rows: list[int],
        states: list[DraftState],
        layout: TreeLayout,
        rung: Rung,
        guide: DraftGuide | None,
    ) -> DraftTree:
        """The draft model's trees, with SUFFIX's in the rows where it scores enough."""
        tree = super()._draft_tree(reqs, rows, states, layout, rung, guide)
        nodes = rung.draft_tokens - 1
        chosen, proposals = [], []
        for i, req in enumerate(reqs):
            proposal = self.drafting.propose(self.tracked[req.rid], rung.steps, rung.topk, nodes)
            if proposal.tokens and proposal.score >= self.threshold:
                chosen.append(i)
                proposals.append(proposal)
        if not chosen:
            return tree
        self._suffix_trees += len(chosen)
        roots = [states[i].root_token for i in chosen]
        suffix = padded_tree(proposals, roots, rung.steps, rung.draft_tokens, self.device, self.ops)
        at = host_tensor(chosen, self.device)
        tokens, parents = tree.tokens.clone(), tree.parents.clone()
        tokens[at], parents[at] = suffix.tokens, suffix.parents
        return DraftTree.from_parents(tokens, parents, tree.num_steps, self.ops)

    def suffix_trees_taken(self) -> int:
        taken, self._suffix_trees = self._suffix_trees, 0
        return taken
