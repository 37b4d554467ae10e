"""The speculative decoder with SUFFIX drafting (suffix decoding): NGRAM's own-token
proposals, or the replica's recent outputs' when those score higher (``SuffixDrafting``).

Each step, per request, two proposals compete: NGRAM's from its own tokens, and the
output cache's (``SuffixCache``) from what followed its last tokens in the finished
outputs of its owner (or of every request, when the deployment shares them).  The one
whose drafts the verify is expected to accept more of (``Proposal.score``) is verified.
A request that finishes without an error adds its output to the cache, under its owner.
"""

from __future__ import annotations

from typing import Any

from specd.workers.speculative.ngram import Proposal, RequestTokens
from specd.workers.speculative.ngram_decoder import NgramDecoder
from specd.workers.speculative.suffix import SuffixDrafting


class SuffixDecoder(NgramDecoder):
    algorithm = "SUFFIX"

    def __init__(self, *args: Any, drafting: SuffixDrafting, **kwargs: Any):
        """``NgramDecoder``'s arguments, and the proposals with the output cache."""
        super().__init__(*args, **kwargs)
        self.drafting = drafting

    def propose(self, state: RequestTokens, steps: int, topk: int, num_nodes: int) -> Proposal:
        return self.drafting.propose(state, steps, topk, num_nodes)

    def drop(self, rids: list[str], finished: bool = False) -> None:
        """A finished request's output joins the cache."""
        for rid in rids if finished else ():
            state = self.states.get(rid)
            if state is not None:
                self.drafting.record(state)
        super().drop(rids, finished)
