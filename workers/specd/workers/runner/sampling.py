"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

import random

import torch

from specd.workers.requests.faults import contained, unusable_rows
from specd.workers.requests.request import Req
from specd.workers.types import (
    MAX_TOP_K,
    SEED_RANGE,
    InvalidRequest,
    SamplingParams,
)


def check_sampling_params(params: SamplingParams, vocab: int) -> None:
    """Raise ``InvalidRequest`` naming the field of a value sampling cannot take: each
    range keeps the math finite and every id inside the tensors it indexes."""
    if not 0.0 <= params.temperature < float("inf"):
        raise InvalidRequest("temperature: must be a finite number >= 0 (0: greedy)")
    if not 0.0 < params.top_p <= 1.0:
        raise InvalidRequest("top_p: must be in (0, 1]")
    if not -1 <= params.top_k <= MAX_TOP_K:
        raise InvalidRequest(f"top_k: must be -1 or 0 (off), or in [1, {MAX_TOP_K}]")
    lo, hi = SEED_RANGE
    if params.seed is not None and not lo <= params.seed <= hi:
        raise InvalidRequest(f"seed: must be in [{lo}, {hi}]")
    if params.grammar is not None and any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise InvalidRequest(f"stop_token_ids: token ids must be in [0, {vocab})")


def request_generator(req: Req, device: torch.device) -> torch.Generator:
    """The request's own RNG, created once so a seed reproduces its whole output."""
    if req.sampler_state is None:
        seed = req.params.seed if req.params.seed is not None else random.getrandbits(63)
        req.sampler_state = torch.Generator(device=device).manual_seed(seed)
    return req.sampler_state


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] probabilities after temperature, then the top-k, min-p and top-p
    (nucleus) cuts.  Top-k and min-p commute (both keep tokens by their ratio to the
    most likely one), so this is vLLM's order: min-p before top-k / top-p."""
    logits = logits / params.temperature
    top_k, top_p = params.top_k, params.top_p
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        floor = params.min_p * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs /= probs.sum(-1, keepdim=True)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = torch.cumsum(sorted_probs, -1) - sorted_probs >= top_p
        drop[..., 0] = False  # even a top_p that rounds to 0 in float32 (5e-324) keeps it
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)  # no boolean indexing: no sync
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs /= probs.sum(-1, keepdim=True)
    return probs


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] int64: the first index of each row's maximum, as ``argmax``
    gives it (ties included); ``max(-1).indices`` is 2-6x faster on CPU (measured on
    8192-wide rows at 1, 6 and 32 rows)."""
    return logits.max(dim=-1).indices


def usable_probs(probs: torch.Tensor, fallback: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [..., V] -> each row as it is if it is a distribution (finite, some mass),
    else one-hot at its ``fallback`` id [...]; and bool [...] of the rows replaced.  No
    sync, and ``torch.multinomial`` never sees NaN (a device-side assert on CUDA)."""
    ok = torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)
    one_hot = torch.zeros_like(probs).scatter_(-1, fallback[..., None], 1.0)
    return torch.where(ok[..., None], probs, one_hot), ~ok


def sample_next_tokens(logits: torch.Tensor, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [len(reqs), V] float32 -> one token id per request, int64 [len(reqs)] on
    the logits' device, and which rows were unusable (bool [len(reqs)], ``request_faults``:
    such a row's token is the greedy stand-in).  No device sync: the caller copies both
    to the host once."""
    tokens = greedy_ids(logits)
    unusable = unusable_rows(logits)
    for i, req in enumerate(reqs):
        p = req.params
        if p.greedy:
            continue
        with contained(req, "sampling"):
            probs, bad = usable_probs(filtered_probs(logits[i], p), tokens[i])
            generator = request_generator(req, logits.device)
            tokens[i : i + 1] = torch.multinomial(probs, 1, generator=generator)
            unusable[i] |= bad
    return tokens, unusable
