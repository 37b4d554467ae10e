"""Grammar-guided drafting: a constrained request drafts only what its grammar allows.

The target's rows are masked at verify (``structured_output.py``), so a draft token the
grammar refuses can never be accepted.  Masking the draft's log-probs the same way spends
the tree on tokens that can be: a forced token (a JSON key, a brace) is drafted with
certainty, since the mask's renormalized log-prob of a lone allowed token is 0.  Output is
unchanged (verify decides), only acceptance rises.

Each draft step needs the paths its nodes extend on the host (one small sync per step),
so batches with a constrained request draft eagerly instead of replaying a graph.
Drafts of an EAGLE-3 head with a reduced vocabulary are masked through its
draft-to-target id map.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd.workers.requests.request import Req
from specd.workers.runner.structured_output import GrammarState, allowed_tokens
from specd.workers.speculative.tree import StepOut


def mask_logprobs(logprobs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logprobs [R, V] renormalized over ``allowed`` [R, V]; a row allowing none of the
    draft's tokens is left as it is (bit for bit: renormalizing a normalized row moves
    its last bits in about 1 row of 20)."""
    some = allowed.any(-1, keepdim=True)
    renormalized = torch.log_softmax(logprobs.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.where(some, renormalized, logprobs)


class DraftGuide:
    """Masks one draft loop's log-probs for the batch's constrained requests.

    ``draft_to_target`` [V_draft]: the target id of each draft token (None: the same)."""

    def __init__(
        self,
        grammars: Sequence[tuple[int, GrammarState]],
        draft_to_target: torch.Tensor | None,
    ):
        self.rows = [b for b, _ in grammars]  # batch index of each constrained request
        self.grammars = [g for _, g in grammars]
        self.draft_to_target = draft_to_target
        self.paths: list[list[list[int]]] = []  # per constrained request: each kept node's path

    @classmethod
    def for_batch(
        cls, reqs: Sequence[Req], draft_to_target: torch.Tensor | None
    ) -> DraftGuide | None:
        grammars = [(b, r.grammar) for b, r in enumerate(reqs) if r.grammar is not None]
        return cls(grammars, draft_to_target) if grammars else None

    def roots(self, logprobs: torch.Tensor) -> torch.Tensor:
        """logprobs [B, V_draft] after each root -> masked where constrained."""
        bitmasks = []
        for grammar in self.grammars:
            bitmasks.append(grammar.new_bitmask(1))
            grammar.fill_row(bitmasks[-1], 0)
        return self._masked(logprobs, bitmasks)

    def children(self, logprobs: torch.Tensor) -> torch.Tensor:
        """logprobs [B, k, V_draft] after each node the last step kept -> masked."""
        bitmasks = []
        for grammar, paths in zip(self.grammars, self.paths, strict=True):
            bitmasks.append(grammar.new_bitmask(len(paths)))
            grammar.fill_paths(bitmasks[-1], paths)
        return self._masked(logprobs, bitmasks)

    def kept(self, step: StepOut) -> None:
        """Record the paths of the nodes a step kept (``step.tokens`` in target ids)."""
        tokens, parents = step.tokens.tolist(), step.parents.tolist()
        before = self.paths or [None] * len(self.rows)
        self.paths = [
            [
                ([] if prev is None else prev[p]) + [t]
                for t, p in zip(tokens[b], parents[b], strict=True)
            ]
            for b, prev in zip(self.rows, before, strict=True)
        ]

    def _masked(self, logprobs: torch.Tensor, bitmasks: list[torch.Tensor]) -> torch.Tensor:
        """logprobs [B, ..., V_draft] with each constrained request's rows masked by its
        bitmask (one row per trailing row of its logprobs)."""
        out = logprobs.clone()
        index = torch.tensor(self.rows, device=logprobs.device)
        picked = out[index]  # [n, ..., V_draft]
        vocab = picked.shape[-1]
        allowed = allowed_tokens(bitmasks, int(bitmasks[0].shape[1]) * 32, logprobs.device)
        allowed = (
            allowed[:, self.draft_to_target]
            if self.draft_to_target is not None
            else allowed[:, :vocab]
        )
        out[index] = mask_logprobs(picked.reshape(-1, vocab), allowed).view(picked.shape)
        return out
