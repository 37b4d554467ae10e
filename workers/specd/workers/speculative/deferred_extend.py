"""Deferred draft extends: plain steps the policy chose leave the draft behind, and it
catches up later in one batched extend (DESIGN §5).

On the plain rung a speculative engine normally has the draft re-read each new token at
once (a one-token draft forward per step), so the next verify drafts from a current
state.  When the policy runs a batch plain for cost or load, that forward buys nothing
until the request speculates again, and it is what makes a plain step in a speculative
engine slower than plain decode.  Instead each request keeps a ``Backlog``: the tokens the
plain steps appended and the target's features at the positions before them (draft
position ``p`` pairs token ``p + 1`` with the target's feature at ``p``)::

    row:  ... | read by the draft | backlog: start .. root-1 | root | ...
                                  ^ start                     ^ start + len(tokens)

The draft reads a backlog in one extend over all its positions (``SpecDecoder.catch_up``):
before the request's next step that drafts or probes, and, once any backlog in a batch
holds ``CATCH_UP_AT`` tokens, every backlog of that batch (so catch-ups stay aligned and
rare).  The draft KV it writes is what the step-by-step extends would have written.  A
request that ends with a backlog leaves those positions' draft KV unwritten: a later
reuse of them (a session's next turn, a cached prefix) may accept less, never differs in
output, since the target verifies every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CATCH_UP_AT = 64  # backlog tokens per request that trigger a batch's catch-up


@dataclass(frozen=True, slots=True)
class Backlog:
    """A request's positions the draft has not read: ``start`` onwards, one per token."""

    start: int  # the first position the draft has not read
    tokens: tuple[int, ...]  # token p + 1 for each position p of the backlog
    features: tuple[torch.Tensor, ...]  # [H] each: the target's features at p

    @property
    def root_position(self) -> int:
        """The root (the newest token) sits here; its KV is not written yet."""
        return self.start + len(self.tokens)

    @property
    def root_token(self) -> int:
        return self.tokens[-1]

    def extended(self, token: int, feature: torch.Tensor) -> Backlog:
        """One more plain step: ``token`` follows the old root, ``feature`` is at the root."""
        return Backlog(self.start, (*self.tokens, token), (*self.features, feature))

    @property
    def full(self) -> bool:
        return len(self.tokens) >= CATCH_UP_AT
