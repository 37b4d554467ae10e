"""Per-request logits processors: ``logit_bias``, ``min_tokens`` and the repetition,
frequency and presence penalties, applied to the target's float32 logits before
temperature, top-k, top-p and min-p (vLLM's order and formulas).

* ``logit_bias``: add each listed token's bias.
* ``min_tokens``: while fewer tokens were generated, EOS (unless ``ignore_eos``) and the
  ``stop_token_ids`` get -inf.
* ``repetition_penalty`` (transformers' rule): a token seen in the prompt or the output
  has its logit divided by the penalty when positive, else multiplied by it.
* ``frequency_penalty`` / ``presence_penalty`` (OpenAI's rule, over output tokens):
  subtract ``frequency * count + presence * (count > 0)``.

Each request's output counts live on the compute side (``LogitsState``) and are updated
from the tokens each step emits, so they are current even where the host lags a step
behind (overlap).  A verify scores T tree nodes at once: node i's row predicts the token
after the path root..i, so its counts add the drafts on that path (``path_counts``)
and its output length adds the node's depth.  A request's grammar (structured output,
``structured_output.py``) masks its rows last, each row with the state its path leads to.
Requests that ask for none of these pay nothing; log-probs stay those of the raw logits
(``logprobs.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specd.kernels.ops import host_tensor
from specd.workers.requests.faults import contained
from specd.workers.requests.request import Req
from specd.workers.requests.stop import stop_token_ids
from specd.workers.runner.structured_output import GrammarState, mask_rows
from specd.workers.types import REPETITION_PENALTY_RANGE, InvalidRequest, SamplingParams


@dataclass(slots=True, eq=False)
class LogitsState:
    """A request's processor inputs on its logits' device (``Req.logits_state``)."""

    output_counts: torch.Tensor  # [V] float32: how often each token was generated
    prompt_seen: torch.Tensor | None  # [V] bool: the prompt's tokens (repetition penalty)
    held_back: torch.Tensor | None  # token ids ``min_tokens`` holds back
    bias_ids: torch.Tensor | None  # logit_bias token ids [n] ...
    bias_values: torch.Tensor | None  # ... and their biases [n] float32
    generated: int = 0  # output tokens counted so far


class VerifyTree(Protocol):
    """What a verify's tree must give its rows' processing (`speculative.tree.DraftTree`)."""

    tokens: torch.Tensor  # [bs, T] node tokens, root first
    parents: torch.Tensor  # [bs, T] parent index, -1 at the root
    tree_mask: torch.Tensor  # [bs, T, T] node i attends to its ancestors
    depths: torch.Tensor  # [bs, T] depth below the root

    @property
    def num_tokens(self) -> int: ...



def processes_logits(params: SamplingParams) -> bool:
    """Whether ``params`` asks for any processor here."""
    return bool(
        params.logit_bias
        or params.min_tokens > 0
        or params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def check_processor_params(params: SamplingParams, vocab: int) -> None:
    """Raise ``InvalidRequest`` naming the field of a value the processors cannot take."""
    lo, hi = REPETITION_PENALTY_RANGE
    if not lo <= params.repetition_penalty <= hi:
        raise InvalidRequest(f"repetition_penalty: must be in [{lo:g}, {hi:g}] (1: off)")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2 <= getattr(params, name) <= 2:
            raise InvalidRequest(f"{name}: must be in [-2, 2]")
    if not 0 <= params.min_p <= 1:
        raise InvalidRequest("min_p: must be in [0, 1]")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise InvalidRequest(
            f"min_tokens: must be in [0, max_tokens] (max_tokens is {params.max_tokens})"
        )
    for token, bias in params.logit_bias:
        if not 0 <= token < vocab:
            raise InvalidRequest(f"logit_bias: token id {token} is not in [0, {vocab})")
        if not -100 <= bias <= 100:
            raise InvalidRequest(f"logit_bias: bias {bias} of token {token} is not in [-100, 100]")
    if len({token for token, _ in params.logit_bias}) != len(params.logit_bias):
        raise InvalidRequest("logit_bias: a token id is listed twice")


def path_counts(tree_mask: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[T, V] float32: row i counts the draft tokens on the path root..i of one tree
    (``tree_mask`` [T, T]: i sees itself and its ancestors; ``tokens`` [T]).  The root is
    left out: it is the last emitted token, already in the output counts."""
    t = tokens.shape[0]
    on_path = tree_mask.to(torch.float32)
    on_path[:, 0] = 0.0
    counts = torch.zeros(t, vocab, dtype=torch.float32, device=tokens.device)
    return counts.scatter_add_(1, tokens[None, :].expand(t, t), on_path)


def process_rows(
    logits: torch.Tensor,
    params: SamplingParams,
    state: LogitsState,
    counts: torch.Tensor,
    generated: torch.Tensor,
) -> torch.Tensor:
    """logits [R, V] of one request -> processed [R, V] (a new tensor).

    counts [R, V]: each row's output counts; generated [R]: output tokens before each
    row's token (``min_tokens``)."""
    out = logits.float().clone()
    if state.bias_ids is not None:
        out[:, state.bias_ids] += state.bias_values
    if state.held_back is not None:
        hold = (generated < params.min_tokens)[:, None]
        out[:, state.held_back] = out[:, state.held_back].masked_fill(hold, float("-inf"))
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if state.prompt_seen is not None:
            seen |= state.prompt_seen
        p = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / p, out * p), out)
    if params.frequency_penalty != 0.0:
        out -= params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        out -= params.presence_penalty * (counts > 0).float()
    return out


class LogitsProcessors:
    """Applies every request's processors (plain rows or verify trees) and counts the
    tokens it emits.  ``eos_token_ids``: what ``min_tokens`` holds back besides the
    request's stop token ids."""

    def __init__(self, eos_token_ids: Sequence[int]):
        self.eos_token_ids = tuple(eos_token_ids)

    def state(self, req: Req, vocab: int, device: torch.device) -> LogitsState:
        """``req``'s state, made on first use from its prompt and output so far."""
        if req.logits_state is None:
            p = req.params
            counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            if req.output_ids:
                out_ids = host_tensor(req.output_ids, device)
                counts.index_add_(0, out_ids, _ones(len(req.output_ids), device))
            seen = None
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool, device=device)
                seen[host_tensor(req.prompt_ids, device)] = True
            held = [i for i in stop_token_ids(p, self.eos_token_ids) if i < vocab]  # min_tokens
            bias_ids = bias_values = None
            if p.logit_bias:
                bias_ids = host_tensor([t for t, _ in p.logit_bias], device)
                bias_values = torch.tensor([b for _, b in p.logit_bias], device=device)
            req.logits_state = LogitsState(
                counts,
                seen,
                host_tensor(held, device) if p.min_tokens > 0 and held else None,
                bias_ids,
                bias_values,
                generated=len(req.output_ids),
            )
        return req.logits_state

    def apply(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        """logits [n, V], one row per request -> the rows to sample from (a view of
        ``logits``, no copy, when no request asks for a processor)."""

        def plain_row(st: LogitsState, _: int) -> tuple[torch.Tensor, torch.Tensor]:
            return st.output_counts[None], torch.full((1,), st.generated, device=logits.device)

        def plain_mask(grammar: GrammarState, _: int) -> torch.Tensor:
            bitmask = grammar.new_bitmask(1)
            grammar.fill_row(bitmask, 0)
            return bitmask

        return self._process_each(logits[:, None], reqs, plain_row, plain_mask)[:, 0]

    def apply_tree(
        self, logits: torch.Tensor, reqs: Sequence[Req], tree: VerifyTree
    ) -> torch.Tensor:
        """logits [bs, T, V] of a verify of ``tree`` -> the rows to verify against; node i
        of request b is processed as plain decode would be after the path root..i."""
        vocab = logits.shape[-1]
        host: list[tuple[list[int], list[int]]] = []  # (tokens, parents) per request

        def tree_rows(st: LogitsState, b: int) -> tuple[torch.Tensor, torch.Tensor]:
            path = path_counts(tree.tree_mask[b], tree.tokens[b], vocab)
            return st.output_counts[None] + path, st.generated + tree.depths[b]

        def tree_masks(grammar: GrammarState, b: int) -> torch.Tensor:
            if not host:  # one copy of the tree for every constrained request
                host.extend(zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True))
            bitmask = grammar.new_bitmask(tree.num_tokens)
            grammar.fill_tree(bitmask, *host[b])
            return bitmask

        return self._process_each(logits, reqs, tree_rows, tree_masks)

    def _process_each(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Req],
        counts_of: Callable[[LogitsState, int], tuple[torch.Tensor, torch.Tensor]],
        masks_of: Callable[[GrammarState, int], torch.Tensor],
    ) -> torch.Tensor:
        """logits [bs, R, V] -> processed where a request asks (a copy) or ``logits``;
        ``counts_of(state, b)``: request b's rows' counts [R, V] and lengths [R];
        ``masks_of(grammar, b)``: its rows' allowed tokens (a bitmask [R, W])."""
        asking = [
            b for b, r in enumerate(reqs) if processes_logits(r.params) or r.grammar is not None
        ]
        if not asking:
            return logits
        out = logits.clone() if logits.dtype == torch.float32 else logits.float()
        for b in asking:
            req = reqs[b]
            if processes_logits(req.params):
                with contained(req, "logits processors"):
                    st = self.state(req, logits.shape[-1], logits.device)
                    counts, generated = counts_of(st, b)
                    out[b] = process_rows(logits[b], req.params, st, counts, generated)
        constrained, masks = [], []
        for b in asking:
            if (grammar := reqs[b].grammar) is not None and reqs[b].fault is None:
                with contained(reqs[b], "structured output"):
                    masks.append(masks_of(grammar, b))
                    constrained.append(b)
        if constrained:
            mask_rows(out, constrained, masks)
        return out

    def record(self, reqs: Sequence[Req], tokens: torch.Tensor | Sequence[Sequence[int]]) -> None:
        """Count the tokens a step emitted: ``tokens`` [n] (one per request, on the
        device) or, per request, a list of them (a verify's accepted path)."""
        host = None  # a grammar's matcher takes host ids (a sync, for such batches only)
        for i, req in enumerate(reqs):
            if req.grammar is not None:
                if host is None:
                    one_each = isinstance(tokens, torch.Tensor)
                    host = [[t] for t in tokens.tolist()] if one_each else tokens
                if req.fault is None:  # a faulted request's token is a stand-in
                    with contained(req, "structured output"):
                        req.grammar.advance(host[i])
            st = req.logits_state
            if st is None:
                continue
            device = st.output_counts.device
            if isinstance(tokens, torch.Tensor):
                new = tokens[i : i + 1]
            else:
                new = host_tensor(tokens[i], device)
            st.output_counts.index_add_(0, new, _ones(new.shape[0], device))
            st.generated += new.shape[0]


def _ones(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float32, device=device)
