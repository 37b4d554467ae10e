"""Log-probabilities of generated tokens (the OpenAI ``logprobs`` option).

Values come from the target's raw distribution, ``log_softmax`` of its float32 logits
before temperature, top-k and top-p (vLLM's default ``raw_logprobs``).  So a token's
log-prob does not depend on how it was chosen: sampled, greedy, or accepted as a draft
by a verify, where the target's row at the path node before it gives the same
distribution as a plain decode step would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specd.kernels.ops import host_tensor
from specd.workers.requests.request import Req
from specd.workers.types import TokenLogprob

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat ``top_logprobs``; vLLM's default too


@dataclass(frozen=True, slots=True)
class LogprobTensors:
    """Per row: the chosen token's log-prob [n, ...] and the ``width`` most likely
    (ids, log-probs) [n, ..., width] (device tensors, or their host copies)."""

    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_values: torch.Tensor

    def pinned(self) -> LogprobTensors:
        """Non-blocking copies to pinned host memory (CUDA): ready once the stream
        reaches this point, like a launched step's sampled ids."""
        copies = []
        for t in (self.chosen, self.top_ids, self.top_values):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            copies.append(host.copy_(t, non_blocking=True))
        return LogprobTensors(*copies)

    def token_logprobs(self, widths: list[int]) -> list[list[TokenLogprob]]:
        """Host values, one list per row (one value for a row of single tokens, one per
        token for a row of a path), row i with its top ``widths[i]``: one copy per field."""
        chosen = self.chosen.tolist()
        ids, values = self.top_ids.tolist(), self.top_values.tolist()
        if self.chosen.dim() == 1:  # rows of single tokens: one-token paths
            chosen, ids, values = [[c] for c in chosen], [[i] for i in ids], [[v] for v in values]
        rows = []
        for row_chosen, row_ids, row_values, w in zip(chosen, ids, values, widths, strict=True):
            rows.append(
                [
                    TokenLogprob(c, tuple(zip(i[:w], v[:w], strict=True)))
                    for c, i, v in zip(row_chosen, row_ids, row_values, strict=True)
                ]
            )
        return rows


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, width: int) -> LogprobTensors:
    """logits [..., V], tokens [...] -> the tokens' log-probs and each row's top ``width``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, tokens.long().clamp(min=0).unsqueeze(-1)).squeeze(-1)
    top = logp.topk(width, dim=-1)
    return LogprobTensors(chosen, top.indices, top.values)


def asking_rows(reqs: list[Req]) -> list[int]:
    """Indices of the requests that asked for log-probs."""
    return [i for i, r in enumerate(reqs) if r.params.logprobs is not None]


@dataclass(frozen=True, slots=True)
class SampledLogprobs:
    """A batch's sampled tokens' log-probs, for the sampled requests that asked."""

    rows: list[int]  # indices into the batch's sampled requests
    widths: list[int]
    tensors: LogprobTensors

    def pinned(self) -> SampledLogprobs:
        return SampledLogprobs(self.rows, self.widths, self.tensors.pinned())

    def per_request(self, count: int) -> tuple[TokenLogprob | None, ...]:
        """Host values in sampled-request order (None for a request that did not ask)."""
        out: list[TokenLogprob | None] = [None] * count
        for row, (value,) in zip(self.rows, self.tensors.token_logprobs(self.widths), strict=True):
            out[row] = value
        return tuple(out)


def sampled_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, reqs: list[Req]
) -> SampledLogprobs | None:
    """logits [len(reqs), V] and the ids sampled from them -> the log-probs of the
    requests that asked (device tensors, no sync), or None if none did."""
    rows = asking_rows(reqs)
    if not rows:
        return None
    widths = [reqs[i].params.logprobs for i in rows]
    if len(rows) < len(reqs):
        index = host_tensor(rows, logits.device)
        logits, tokens = logits[index], tokens[index]
    return SampledLogprobs(rows, widths, logprob_tensors(logits, tokens, max(widths)))


def path_logprobs(
    reqs: list[Req],
    logits: torch.Tensor,
    accept_index: torch.Tensor,
    tokens: list[list[int]],
) -> tuple[tuple[TokenLogprob, ...] | None, ...]:
    """A verify's new tokens' log-probs, per request (None where it did not ask).

    logits [bs, T, V] at the tree nodes; accept_index [bs, S+1]: the accepted path's
    nodes, root first (PAD-padded); tokens[b]: the tokens appended, where token i was
    predicted at path node i.  Copies to the host (the verify has synced already)."""
    rows = asking_rows(reqs)
    if not rows:
        return (None,) * len(reqs)
    index = host_tensor(rows, logits.device)
    longest = max(len(tokens[b]) for b in rows)
    nodes = accept_index[index, :longest].clamp(min=0)  # [m, longest]
    path_rows = logits[index.unsqueeze(1), nodes]  # [m, longest, V]
    padded = [tokens[b] + [0] * (longest - len(tokens[b])) for b in rows]
    widths = [reqs[b].params.logprobs for b in rows]
    got = logprob_tensors(path_rows, host_tensor(padded, logits.device), max(widths))
    out: list[tuple[TokenLogprob, ...] | None] = [None] * len(reqs)
    for b, values in zip(rows, got.token_logprobs(widths), strict=True):
        out[b] = tuple(values[: len(tokens[b])])
    return tuple(out)


def prompt_targets(
    reqs: Sequence[Req], starts: Sequence[int], lens: Sequence[int]
) -> list[tuple[int, int, int]]:
    """The prompt tokens an extend batch scores for the first time, for requests that
    asked for prompt log-probs: (batch index, the batch token row whose logits predict
    it, the token).  Row ``p`` predicts prompt token ``p + 1``; the prompt's first token
    has no log-prob, and tokens scored before a retraction are not scored again."""
    targets, row0 = [], 0
    for i, (req, start, n) in enumerate(zip(reqs, starts, lens, strict=True)):
        if req.params.prompt_logprobs is not None:
            first = len(req.prompt_logprobs)  # rows before it were scored already
            for p in range(max(start, first), min(start + n, len(req.prompt_ids) - 1)):
                targets.append((i, row0 + p - start, req.prompt_ids[p + 1]))
        row0 += n
    return targets


def score_prompt_rows(
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    targets: list[tuple[int, int, int]],
    reqs: Sequence[Req],
) -> tuple[list[TokenLogprob], ...]:
    """Per batch request, the log-probs of the prompt tokens ``targets`` names (on the
    host: scoring requests wait for their step)."""
    out: tuple[list[TokenLogprob], ...] = tuple([] for _ in reqs)
    if not targets:
        return out
    batch_index, rows, tokens = zip(*targets, strict=True)
    logits = compute_logits(hidden[host_tensor(rows, hidden.device)])
    widths = [reqs[i].params.prompt_logprobs for i in batch_index]
    got = logprob_tensors(logits, host_tensor(tokens, hidden.device), max(widths))
    for i, (value,) in zip(batch_index, got.token_logprobs(widths), strict=True):
        out[i].append(value)
    return out
