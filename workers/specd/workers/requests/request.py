"""A request as the scheduler sees it: tokens, sampling params, KV holdings, state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from specd.workers.mem_cache.kv_manager import RequestKV
from specd.workers.types import FinishReason, SamplingParams, TokenLogprob


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # if params.logprobs
    # params.prompt_logprobs: prompt tokens 1, 2, ... scored so far (by prefill chunks)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    kv: RequestKV = field(default_factory=RequestKV)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    # what went wrong while handling only this request (engine/request_faults.py); set on
    # the compute side, the loop then finishes the request with this error
    fault: str | None = None
    error_code: int | None = None  # the HTTP status of ``error`` (400: the request's own)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower is served first under the priority policy (policy.py)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_retractions: int = 0
    sampler_state: Any = None  # per-request torch.Generator, owned by the sampler
    logits_state: Any = None  # penalties' counts etc., owned by LogitsProcessors
    grammar: Any = None  # structured output's GrammarState (matcher), advanced on compute
    detok_state: Any = None  # incremental detokenizer state, owned by the engine
    spec_ready: bool = False  # prompt cached and first token sampled: verify steps can run
    inflight_steps: int = 0  # steps scheduled for it whose results are not processed yet
    release_deferred: bool = False  # finished while a step was in flight: free KV after it
    spec_verify_steps: int = 0
    spec_accepted_tokens: int = 0
    session: Any = None  # the streaming session this request is a turn of (sessions.py)
    cached_tokens: int = 0  # prompt tokens whose KV was reused (usage.cached_tokens)
    owner: str | None = None  # the API key's id it came with (``GenerateRequest.owner``)

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs: prompt, then output so far."""
        return self.prompt_ids + self.output_ids

    def append_output(self, token: int, logprob: TokenLogprob | None) -> None:
        """Append a generated token, and its log-prob when the request asked for them."""
        self.output_ids.append(token)
        if logprob is not None:
            self.output_logprobs.append(logprob)

    def truncate_output(self, length: int) -> None:
        """Drop generated tokens (and their log-probs) past ``length``."""
        del self.output_ids[length:]
        del self.output_logprobs[length:]

    @property
    def num_fill(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def final_kv_tokens(self) -> list[int]:
        """The tokens of the positions whose KV is computed and final: every one but the
        last (whose KV the next step would write), at most the committed ones."""
        return self.fill_ids[: min(self.kv.committed, self.num_fill - 1)]

    @property
    def cacheable_len(self) -> int:
        """How many leading positions may hold prefix-cache pages while the request
        runs: all but the last token's; for a session turn after the first, only its
        history's (less the last token): a rolled-back turn keeps exactly that much KV,
        and a borrowed page cannot be handed back in part."""
        if self.session is not None and self.session.history:
            return len(self.session.history) - 1
        return self.num_fill - 1

    @property
    def tokens_to_compute(self) -> int:
        """Tokens not yet in the KV cache (1 while decoding, more while prefilling)."""
        return self.num_fill - self.kv.committed

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
