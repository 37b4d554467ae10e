"""A rung of the adaptive speculation ladder: how one verify step drafts (DESIGN §5).

Plain Python (the config imports it, and the operator imports the config).  A rung is
(S, k, T) = (draft steps, topk, verify tokens with the root).  ``steps == 0`` is the
plain rung: the verify runs the root alone (T = 1), i.e. one target token per request,
exactly like plain decode.  KV is never sized by the active rung, always by the widest
one (``SpeculativeSpec.max_draft_tokens``, ``SpecShape.from_spec``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True, slots=True)
class Rung:
    steps: int  # S; 0 = plain decode
    topk: int  # k; 1 = chain
    draft_tokens: int  # T, the root included (1 on the plain rung)

    @property
    def speculates(self) -> bool:
        return self.steps > 0

    def label(self) -> str:
        return f"steps={self.steps} topk={self.topk} T={self.draft_tokens}"


PLAIN = Rung(0, 1, 1)


class PlainReason(StrEnum):
    """Why a speculative engine's verify batch ran the plain rung
    (``specd_spec_plain_steps_total{reason}``)."""

    RUNG = "rung"  # the active rung is plain (steps 0)
    LOAD = "load"  # the batch has more requests than policy.maxBatchForSpec
    COST = "cost"  # the cost model predicts more tokens/s from plain decode, or explores it
    END = "end"  # the batch's requests end before a verify's extra tokens pay for it
    LOCKSTEP = "lockstep"  # its requests decode in lockstep, and speculation's lead is small
    REQUEST = "request"  # a request of the batch asked for none (``speculative: false``)
