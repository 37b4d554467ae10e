"""Plain, torch-free values that cross the engine / actor / gateway boundary."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # client disconnect, explicit abort, replica shutdown
    ERROR = "error"  # rejected request or engine failure (see GenerateDelta.error)


@dataclass(frozen=True, slots=True)
class Grammar:
    """What the output's text must follow (structured output, ``structured_output.py``).

    kind: ``json_object`` (any JSON object), ``json_schema`` (``source``: the schema as JSON
    text), ``regex`` or ``ebnf`` (``source``: the pattern or the grammar), or
    ``structural_tag`` (``source``: xgrammar's structural tag as JSON text).  ``field``:
    the request field it came from, which errors name.  ``thinking``: the grammar holds
    after the model's thinking block (``thinking_gate.py``): ``"first"`` (the output
    thinks until ``</think>``), ``"optional"`` (it may open with ``<think>``), or None
    (from the first token)."""

    kind: str
    source: str = ""
    field: str = "grammar"
    thinking: str | None = None


SAMPLING_EPS = 1e-5  # temperatures below are greedy (vLLM's rule): logits / T overflows
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # logits / 0.01 and * 100 stay finite in float32
MAX_TOP_K = 2**31 - 1  # top-k cuts are int32 on some backends; above the vocab it is off


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: each token's log-prob and the top n
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo)
    # logits processors (engine/logits_processors.py) and min-p (sampling.py)
    min_p: float = 0.0  # drop tokens below min_p * the most likely token's probability
    min_tokens: int = 0  # hold back EOS and stop_token_ids until this many are generated
    repetition_penalty: float = 1.0  # 1: off; > 1 discourages prompt and output tokens
    frequency_penalty: float = 0.0  # subtracted per time a token was generated
    presence_penalty: float = 0.0  # subtracted once a token was generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    grammar: Grammar | None = None  # structured output: the text the output must follow
    speculative: bool = True  # False: a speculative engine runs this request's batches plain

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability under the target model, and the most likely
    (token id, log-probability) pairs at its position, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    session_id: str | None = None  # a turn of this streaming session (``prompt_ids`` appended)
    priority: int = 0  # lower is served first (``scheduler.policy: priority`` only)
    owner: str | None = None  # the API key's id (SUFFIX drafts only from its outputs)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    spec_verify_steps: int = 0
    spec_accepted_tokens: int = 0


@dataclass(frozen=True, slots=True)
class GenerateDelta:
    """New output since the previous delta of the same request."""

    rid: str
    token_ids: tuple[int, ...] = ()
    # one per token, if the request asked (None: an echoed prompt's first token, gateway)
    logprobs: tuple[TokenLogprob | None, ...] | None = None
    # the first delta of a request that asked: one per prompt token (None for the first)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    error_code: int | None = None  # HTTP status a gateway should answer with

    def then(self, later: GenerateDelta) -> GenerateDelta:
        """This delta and the ``later`` one of the same request as one delta (a consumer
        that fell behind takes what waited at once)."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (*(self.logprobs or ()), *(later.logprobs or ()))
        return dataclasses.replace(
            later,
            token_ids=self.token_ids + later.token_ids,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            text=self.text + later.text,
        )


class InvalidRequest(ValueError):
    """A request the engine refuses before admitting it (maps to HTTP 400)."""


class SessionError(InvalidRequest):
    """A session call the engine refuses: ``code`` is the HTTP status (400 sessions
    disabled, 404 unknown id, 409 a turn already in flight or the session cannot move
    here, 410 closed or expired, 429 full)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class SessionSnapshot:
    """An idle streaming session leaving a draining replica for another one.

    ``vocabulary`` names the tokenizer its ``history`` is written in and ``kv_layout``
    what its KV was computed by (model, dtype, draft): a replica takes the history only
    with the same vocabulary, and the KV (``kv``: one ``[2 * layers, len(history) - 1,
    kv_heads * head_dim]`` host tensor per KV pool, target then draft; empty when the
    source no longer held it) only with the same layout.
    """

    session_id: str
    history: tuple[int, ...]
    idle_s: float
    vocabulary: str
    kv_layout: str
    kv: tuple[Any, ...] = field(default=(), repr=False)
