"""Structured output: the output's text follows a grammar (any JSON, a JSON schema, a
regex, an EBNF grammar or an xgrammar structural tag), enforced with xgrammar's token masks on the target's logits.

``Grammars`` compiles a request's grammar for the model's tokenizer (compiled grammars
are cached by source) and gives the request a ``GrammarState``: an xgrammar matcher that
lives on the compute side and is advanced by the tokens each step emits, as the logits
processors' counts are, so it is current under overlap.

* Plain decode masks a request's row with the matcher's state.
* A verify masks each tree node's row with the state after the node's path (a walk from
  the root that accepts each node's token and rolls it back on the way up), so the
  target's choice at every node is the constrained one and the greedy walk or tree
  speculative sampling emits exactly what constrained decoding emits.  A node whose
  token its parent's mask refuses can never be accepted, so its subtree's rows stay open.

Drafts are guided by the same grammar (``speculative/guided_draft.py``), which only
raises acceptance: the masked target decides what is emitted.  Once the
matcher accepted a stop token (EOS or a ``stop_token_ids`` id) its rows stay open: the
request ends on that token.  On a thinking model the grammar may wait for the thinking
block to end (``Grammar.thinking``, ``thinking_gate.py``).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from specd.workers.requests.stop import stop_token_ids
from specd.workers.runner.thinking_gate import ThinkingGate, thinking_tag_ids
from specd.workers.types import Grammar, InvalidRequest, SamplingParams

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")
COMPILE_CACHE_BYTES = 64 << 20  # compiled grammars kept per replica
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (?:Check failed: .*? is false: )?")


def xgrammar_message(err: Exception) -> str:
    """xgrammar's error without its C++ log prefix (time, source file, failed check)."""
    return _LOG_PREFIX.sub("", str(err)).strip()


def compile_json(compiler: xgr.GrammarCompiler, grammar: Grammar) -> xgr.CompiledGrammar:
    """JSON on one line with ``", "`` and ``": "`` between items: free whitespace lets a
    model loop on blank lines (small ones do) and costs tokens.  ``json_object``: any
    object (OpenAI's JSON mode); ``json_schema``: one that validates against the schema,
    extra properties refused unless it allows them."""
    if grammar.kind == "json_object":
        return compiler.compile_json_schema(
            {"type": "object"}, any_whitespace=False, strict_mode=False
        )
    return compiler.compile_json_schema(json.loads(grammar.source), any_whitespace=False)


def check_grammar_params(params: SamplingParams) -> None:
    """Raise ``InvalidRequest`` for options a grammar cannot be combined with: it ends
    the output with a stop token once complete, so neither may hold that token back."""
    g = params.grammar
    if g is None:
        return
    if g.kind not in GRAMMAR_KINDS:
        raise InvalidRequest(
            f"{g.field}: unknown grammar kind {g.kind!r} ({', '.join(GRAMMAR_KINDS)})"
        )
    if g.thinking not in (None, "first", "optional"):
        raise InvalidRequest(f"{g.field}: thinking must be first, optional or None")
    if params.ignore_eos:
        raise InvalidRequest(
            f"ignore_eos: cannot be combined with {g.field} (the grammar ends the output "
            "with EOS once complete); leave ignore_eos out"
        )
    if params.min_tokens:
        raise InvalidRequest(
            f"min_tokens: cannot be combined with {g.field} (the grammar decides where the "
            "output ends); leave min_tokens out"
        )


@dataclass(slots=True, eq=False)
class GrammarState:
    """One request's matcher (``Req.grammar``), used on the compute side only.

    Rows filled since the last emitted token are kept by path (``_rows``): a verify's
    tree rows are mostly the paths its draft loop already masked, and a fill costs far
    more than a copy."""

    matcher: xgr.GrammarMatcher | ThinkingGate
    vocab_size: int
    _rows: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """[rows, ceil(V / 32)] int32, every token allowed."""
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill_row(self, bitmask: torch.Tensor, row: int, path: tuple[int, ...] = ()) -> None:
        """Row ``row``: the tokens allowed next, the matcher being at the emitted tokens
        plus ``path`` (left open once a stop token ended it)."""
        if (known := self._rows.get(path)) is not None:
            bitmask[row] = known
        elif not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)
            self._rows[path] = bitmask[row].clone()

    def fill_tree(
        self, bitmask: torch.Tensor, tokens: Sequence[int], parents: Sequence[int]
    ) -> None:
        """Rows 0..T-1: node i's allowed tokens after the path root..i (``tokens`` and
        ``parents`` of one draft tree, parents first; the root is already emitted)."""
        children: list[list[int]] = [[] for _ in tokens]
        for node in range(1, len(tokens)):
            children[parents[node]].append(node)

        def visit(node: int, path: tuple[int, ...]) -> None:
            self.fill_row(bitmask, node, path)
            if self.matcher.is_terminated():
                return
            for child in children[node]:
                if self._allows(bitmask, node, tokens[child]):
                    self.matcher.accept_token(tokens[child])
                    visit(child, (*path, tokens[child]))
                    self.matcher.rollback(1)

        visit(0, ())

    def fill_paths(self, bitmask: torch.Tensor, paths: Sequence[Sequence[int]]) -> None:
        """Row j: the tokens allowed after ``paths[j]`` (tokens past the emitted ones);
        a path the grammar refuses leaves its row open.  The state is kept."""
        for row, path in enumerate(paths):
            key = tuple(path)
            if key in self._rows:
                bitmask[row] = self._rows[key]
                continue
            accepted = 0
            for token in path:
                if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                    break
                accepted += 1
            else:
                self.fill_row(bitmask, row, key)
            self.matcher.rollback(accepted)

    def _allows(self, bitmask: torch.Tensor, row: int, token: int) -> bool:
        return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)

    def advance(self, tokens: Sequence[int]) -> None:
        """Accept the tokens a step emitted (those after a stop token are dropped by the
        scheduler, so they are skipped here too)."""
        if tokens:
            self._rows.clear()  # they were relative to the tokens emitted so far
        for token in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"structured output: the grammar refused emitted token {token}")


def allowed_tokens(
    bitmasks: Sequence[torch.Tensor], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Bitmasks [R_i, W] -> bool [sum R_i, vocab_size] on ``device``: which tokens each
    row allows (the packed masks are moved, then unpacked there)."""
    bitmask = torch.cat(list(bitmasks)).to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def mask_rows(logits: torch.Tensor, rows: Sequence[int], bitmasks: Sequence[torch.Tensor]) -> None:
    """Set to -inf, in place, the logits [B, R, V] of request ``rows[i]`` that
    ``bitmasks[i]`` [R, W] disallows (one unpack and one fill for the whole batch)."""
    allowed = allowed_tokens(bitmasks, logits.shape[-1], logits.device)
    index = torch.tensor(list(rows), device=logits.device)
    picked = logits[index]
    logits[index] = picked.masked_fill(~allowed.view(picked.shape), float("-inf"))


class Grammars:
    """Compiles requests' grammars for one model and makes their matchers.

    The tokenizer's vocabulary is read on the first grammar (a second or so for large
    vocabularies), so replicas that never see one pay nothing."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int]
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=list(self.eos_token_ids),
                )
                self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=COMPILE_CACHE_BYTES)
            return self._compiler

    @functools.cached_property
    def thinking_tags(self) -> tuple[int, int] | None:
        """The tokenizer's ``<think>`` and ``</think>`` ids (``thinking_tag_ids``), read once."""
        return thinking_tag_ids(self.tokenizer)

    def compile(self, grammar: Grammar) -> xgr.CompiledGrammar:
        """The compiled grammar (``InvalidRequest`` naming the field when it is bad).
        Blocking: compiling a large schema takes milliseconds to seconds."""
        compiler = self.compiler()
        try:
            if grammar.kind in ("json_object", "json_schema"):
                return compile_json(compiler, grammar)
            if grammar.kind == "regex":
                return compiler.compile_regex(grammar.source)
            if grammar.kind == "structural_tag":
                return compiler.compile_structural_tag(grammar.source)
            return compiler.compile_grammar(grammar.source)
        except (RuntimeError, ValueError, TypeError) as err:
            raise InvalidRequest(f"{grammar.field}: {xgrammar_message(err)}") from err

    def state_for(self, params: SamplingParams) -> GrammarState:
        """A new matcher for ``params.grammar``; the request's stop tokens end it.  With
        ``grammar.thinking`` it waits behind a ``ThinkingGate``."""
        grammar = params.grammar
        compiled = self.compile(grammar)
        stops = stop_token_ids(params, self.eos_token_ids)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        if grammar.thinking is not None:
            if (tags := self.thinking_tags) is None:
                raise InvalidRequest(
                    f"{grammar.field}: this model's tokenizer has no single-token <think> "
                    "and </think>, so the grammar cannot wait for the thinking to end"
                )
            matcher = ThinkingGate(matcher, *tags, thinks_first=grammar.thinking == "first")
        state = GrammarState(matcher, self.vocab_size)
        check_can_start(state, grammar)
        return state


def check_can_start(state: GrammarState, grammar: Grammar) -> None:
    """Raise ``InvalidRequest`` naming the field when no token of the model's vocabulary
    can start the output (e.g. a regex that matches nothing): the first row's mask would
    refuse every token."""
    bitmask = state.new_bitmask(1)
    if not state.matcher.is_terminated():
        state.matcher.fill_next_token_bitmask(bitmask, 0)
    if not bool(bitmask.any()):
        raise InvalidRequest(
            f"{grammar.field}: no token of this model's vocabulary can start text that "
            "matches it (does it match anything at all?)"
        )
