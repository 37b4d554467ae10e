"""The speculative decoder with SUFFIX drafting (suffix decoding): NGRAM's own-token
proposals, or the replica's recent outputs' when those score higher.

Each step, per request, two proposals compete: NGRAM's from its own tokens, and the
output cache's (``SuffixCache``) from what followed its last tokens in the finished
outputs of its owner (or of every request, when the deployment shares them).  The one
whose drafts the verify is expected to accept more of (``Proposal.score``) is verified.
A request that finishes without an error adds its output to the cache, under its owner.
"""

from __future__ import annotations

from typing import Any

from specd.workers.speculative.ngram import Proposal
from specd.workers.speculative.ngram_decoder import NgramDecoder, NgramState
from specd.workers.speculative.suffix import SuffixCache


class SuffixDecoder(NgramDecoder):
    def __init__(
        self,
        *args: Any,
        cache: SuffixCache,
        min_token_prob: float,
        max_spec_factor: float,
        **kwargs: Any,
    ):
        """``NgramDecoder``'s arguments, and the output cache with its proposal bounds."""
        super().__init__(*args, **kwargs)
        self.algorithm = "SUFFIX"
        self.cache = cache
        self.min_token_prob = min_token_prob
        self.max_spec_factor = max_spec_factor

    def propose(self, state: NgramState, steps: int, topk: int, num_nodes: int) -> Proposal:
        own = super().propose(state, steps, topk, num_nodes)
        index = self.cache.index_of(state.owner)
        if index is None:
            return own
        tail = tuple(state.history.tokens[-index.max_depth :].tolist())
        cached = index.propose(
            tail, steps, topk, num_nodes, self.min_token_prob, self.max_spec_factor
        )
        return cached if cached.score > own.score else own

    def drop(self, rids: list[str], finished: bool = False) -> None:
        """A finished request's output joins the cache, after the tokens before it."""
        for rid in rids if finished else ():
            state = self.states.get(rid)
            if isinstance(state, NgramState):
                tokens, start = state.history.tokens, state.output_start
                lead = tokens[max(0, start - self.cache.max_depth) : start]
                self.cache.insert(state.owner, tuple(tokens[start:].tolist()), tuple(lead.tolist()))
        super().drop(rids, finished)
