"""The request fields completions and chat completions share (`GenerationRequest`),
checked to ranges, and turned into the engine's `SamplingParams` and `Grammar`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Self

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from specd.workers.gateway.protocol.shared import (
    MAX_CHOICES,
    MAX_STOP_SEQUENCES,
    MAX_TOKEN_ID_DIGITS,
    MAX_TOKENS,
    Lenient,
    TokenId,
)
from specd.workers.model.config import GENERATION_SAMPLING_KEYS  # what defaults can fill
from specd.workers.types import (
    MAX_TOP_K,
    REPETITION_PENALTY_RANGE,
    SEED_RANGE,
    Grammar,
    SamplingParams,
)


class StreamOptions(Lenient):
    include_usage: bool = False


class JsonSchemaFormat(Lenient):
    """``response_format.json_schema``: OpenAI's shape (``name`` and ``strict`` are
    accepted; the output always follows the schema)."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormatParam(Lenient):
    """The request's ``response_format``: ``text`` (no constraint), ``json_object`` (any
    JSON object), ``json_schema``, or ``structural_tag`` (xgrammar's, as vLLM and SGLang
    take it: ``format`` is its tree of free text, tags, schemas...)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    format: dict[str, Any] | None = None
    json_schema: JsonSchemaFormat | None = Field(None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _schema_with_its_type(
        cls, value: JsonSchemaFormat | None, info: ValidationInfo
    ) -> JsonSchemaFormat | None:
        if (value is None) == (info.data.get("type") == "json_schema"):
            raise ValueError(
                'send json_schema (with its "schema") exactly when type is "json_schema"'
            )
        if (info.data.get("format") is None) == (info.data.get("type") == "structural_tag"):
            raise ValueError('send format exactly when type is "structural_tag"')
        return value


# chat template arguments the server sets itself
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "chat_template", "add_generation_prompt", "tokenize",
     "return_dict", "continue_final_message", "documents"}
)  # fmt: skip


def checked_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs`` that leave the server's own arguments alone."""
    taken = sorted(_RESERVED_TEMPLATE_KWARGS & set(value or ()))
    if taken:
        raise ValueError(f"{', '.join(taken)} cannot be set here: the server sets them")
    return value


def output_constraints(fields: Mapping[str, Any]) -> list[str]:
    """Which of a request's grammar fields ask for one (``fields``: its values by name)."""
    fmt = fields.get("response_format")
    return [
        name
        for name, on in (
            ("response_format", fmt is not None and fmt.type != "text"),
            ("regex", fields.get("regex") is not None),
            ("ebnf", fields.get("ebnf") is not None),
        )
        if on
    ]


class GenerationRequest(Lenient):
    """Fields shared by completions and chat completions."""

    # field -> values that ask for nothing; any other value of the field is refused
    _NO_OP: ClassVar[dict[str, tuple[Any, ...]]] = {}

    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(
        -1, ge=-1, le=MAX_TOP_K, description="Extension: sample from the k most likely (-1, 0: off)"
    )
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[TokenId, ...] = Field(
        (), description="Extension: token ids that end the output"
    )
    ignore_eos: bool = Field(False, description="Extension: keep going past end-of-sequence")
    session_id: str | None = Field(
        None, description="Extension: append this request as a turn of the session"
    )
    priority: int = Field(
        0,
        ge=-(2**31),
        lt=2**31,
        description="Extension (vLLM's): lower starts first under spec.scheduler.policy: "
        "priority, preempting running requests of a higher value; 0 elsewhere",
    )
    speculative: bool = Field(
        True,
        description="Extension: false decodes this request without speculation (a "
        "speculative replica runs the batches it is in plain); no effect without a draft",
    )
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit"
    )
    repetition_penalty: float = Field(
        1.0,
        ge=REPETITION_PENALTY_RANGE[0],
        le=REPETITION_PENALTY_RANGE[1],
        description="Extension: > 1 discourages prompt and output tokens (1: off)",
    )
    min_p: float = Field(
        0.0, ge=0, le=1, description="Extension: drop tokens below min_p * the top probability"
    )
    min_tokens: int = Field(
        0,
        ge=0,
        le=MAX_TOKENS,
        description="Extension: hold back EOS and stop_token_ids until this many",
    )
    response_format: ResponseFormatParam | None = None
    regex: str | None = Field(
        None, description="Extension (SGLang's): the output matches this regular expression"
    )
    ebnf: str | None = Field(
        None, description="Extension (SGLang's): the output follows this EBNF grammar (root rule)"
    )

    @model_validator(mode="after")
    def _one_grammar(self) -> Self:
        asked = output_constraints(vars(self))
        if len(asked) > 1:
            raise ValueError(f"send one output constraint, not {' and '.join(asked)}")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            # ASCII digits only: str.isdigit() also takes "²" and "١٢", which int() refuses
            if not (key.isascii() and key.isdigit()) or len(key) > MAX_TOKEN_ID_DIGITS:
                raise ValueError(f'key {key!r} is not a token id (send ids as strings: "1234")')
            if not -100 <= bias <= 100:
                raise ValueError(f"bias {bias} of token {key} is not in [-100, 100]")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):  # else the field's type check names what it is
            if len(value) > MAX_STOP_SEQUENCES:
                raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
            if "" in value:  # it would match before any output
                raise ValueError(
                    "an empty stop sequence would end the output at once; leave it out"
                )
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _null_is_empty(cls, value: Any) -> Any:
        return () if value is None else value

    @field_validator("n")
    @classmethod
    def _one_choice_per_turn(cls, value: int, info: ValidationInfo) -> int:
        if value > 1 and info.data.get("session_id") is not None:
            raise ValueError("a session turn continues one conversation; send n=1")
        seed = info.data.get("seed")  # choice i samples with seed + i (`parallel_choices`)
        if seed is not None and seed + value - 1 > SEED_RANGE[1]:
            raise ValueError(f"choice i samples with seed + i, which must be <= {SEED_RANGE[1]}")
        return value

    def out_of_vocab(self, vocab: int) -> str | None:
        """``"field: ..."`` for the first token id outside [0, vocab) (the model's ids),
        if any; the engine indexes its tensors with them."""
        for token in self.stop_token_ids:
            if token >= vocab:
                return f"stop_token_ids: token id {token} is not in [0, {vocab})"
        for key in self.logit_bias or {}:
            if int(key) >= vocab:
                return f"logit_bias: token id {key} is not in [0, {vocab})"
        return None

    @field_validator("*")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = cls._NO_OP.get(info.field_name or "")
        if allowed is not None and value is not None and value not in allowed:
            ok = " or ".join(json.dumps(v) for v in (*allowed, None))
            raise ValueError(f"not supported by this server (send {ok})")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """How many top log-probs per token the engine returns (None: no log-probs)."""
        return None

    def requested_prompt_logprobs(self) -> int | None:
        """The same for the prompt's tokens (completions' ``echo``)."""
        return None

    def sampling_params(
        self,
        default_max_tokens: int,
        defaults: Mapping[str, float] | None = None,
        tool_parser: str | None = None,
    ) -> SamplingParams:
        """The engine's parameters; ``defaults`` (the deployment's sampling defaults)
        fill the sampling fields this request left out."""
        chosen = {key: getattr(self, key) for key in GENERATION_SAMPLING_KEYS}
        for key, value in (defaults or {}).items():
            if key in chosen and key not in self.model_fields_set:
                chosen[key] = value
        return SamplingParams(
            max_tokens=self.requested_max_tokens() or default_max_tokens,
            temperature=chosen["temperature"],
            top_p=chosen["top_p"],
            top_k=chosen["top_k"] if chosen["top_k"] > 0 else -1,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
            prompt_logprobs=self.requested_prompt_logprobs(),
            min_p=chosen["min_p"],
            min_tokens=self.min_tokens,
            repetition_penalty=chosen["repetition_penalty"],
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            logit_bias=tuple((int(t), b) for t, b in (self.logit_bias or {}).items()),
            grammar=self.grammar(tool_parser),
            speculative=self.speculative,
        )

    def grammar(self, tool_parser: str | None = None) -> Grammar | None:
        """The output constraint asked for (structured output), if any (``tool_parser``:
        the call format of chat's ``tool_choice: auto``)."""
        if self.regex is not None:
            return Grammar("regex", self.regex, "regex")
        if self.ebnf is not None:
            return Grammar("ebnf", self.ebnf, "ebnf")
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Grammar("json_object", field="response_format")
        if fmt.type == "structural_tag":
            tag = json.dumps({"type": "structural_tag", "format": fmt.format})
            return Grammar("structural_tag", tag, "response_format.format")
        schema = json.dumps(fmt.json_schema.schema_)
        return Grammar("json_schema", schema, "response_format.json_schema.schema")
