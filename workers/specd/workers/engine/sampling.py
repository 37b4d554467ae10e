"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

import random

import torch

from specd.workers.engine.types import SamplingParams
from specd.workers.scheduler.request import Req


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
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)  # no boolean indexing: no sync
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs /= probs.sum(-1, keepdim=True)
    return probs


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] int64: the first index of each row's maximum, as ``argmax``
    gives it (ties included); ``max(-1).indices`` is 2-6x faster on CPU (measured on
    8192-wide rows at 1, 6 and 32 rows)."""
    return logits.max(dim=-1).indices


def sample_next_tokens(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """logits [len(reqs), V] float32 -> one token id per request, int64 [len(reqs)] on
    the logits' device (no device sync: the caller copies the ids to the host once)."""
    tokens = greedy_ids(logits)
    for i, req in enumerate(reqs):
        p = req.params
        if not p.greedy:
            probs = filtered_probs(logits[i], p)
            generator = request_generator(req, logits.device)
            tokens[i : i + 1] = torch.multinomial(probs, 1, generator=generator)
    return tokens
