"""Every KV allocation size rule lives here (DESIGN §5, seed 000).

Notation: P = page size, k = topk, S = draft steps, T = max draft tokens per verify.
No other module multiplies the per-decode allocation by two or recomputes row
headroom; call these functions instead.

A request row of ``req_to_token`` (one per running request)::

    | prompt + output (committed) | bonus | draft reserve ...     | headroom |
    0                        committed    committed + reserve          width
    |<-------------- context length ---------------->|<- extra_context_len ->|
"""

from __future__ import annotations

from dataclasses import dataclass

from specd.workers.config import ConfigError
from specd.workers.debug_toggles import reverted


@dataclass(frozen=True, slots=True)
class SpecShape:
    """The speculative layout that KV sizing depends on (None anywhere = no speculation)."""

    num_steps: int  # S
    topk: int  # k
    max_draft_tokens: int  # T, already widened for the widest adaptive rung

    @classmethod
    def from_spec(cls, speculative) -> SpecShape | None:
        """From ``DeploymentSpec.speculative`` (None when not speculating): the max S, k
        and T over the adaptive ladder (seed 003), so every allocation sized from this
        fits the widest rung while a narrower one is active (each rule here grows with
        S, k and T)."""
        if speculative is None:
            return None
        ladder = speculative.ladder
        return cls(
            max(r.steps for r in ladder),
            max(r.topk for r in ladder),
            speculative.max_draft_tokens,
        )


def ceil_page(length: int, page_size: int) -> int:
    """Round ``length`` up to a whole number of pages (in tokens)."""
    return -(-length // page_size) * page_size


def alloc_len_per_decode(spec: SpecShape | None, page_size: int) -> int:
    """Worst-case KV positions one decode step needs per request."""
    if spec is None:
        return 1
    steps, topk, tokens = spec.num_steps, spec.topk, spec.max_draft_tokens
    if page_size == 1 or topk == 1:
        return max(steps * topk, tokens)
    # Paged tree: each branch owns page-aligned space for the prefix tail + S drafts.
    pages_per_branch = ((page_size - 1) + steps + page_size - 1) // page_size
    return max(pages_per_branch * page_size * topk, tokens)


def alloc_reserve_per_decode(spec: SpecShape | None, page_size: int) -> int:
    """Positions kept allocated beyond committed: a double buffer for overlap scheduling
    (step N+1 is prepared before step N's accept lengths are known)."""
    factor = 1 if reverted("reserve-single") else 2
    return factor * alloc_len_per_decode(spec, page_size)


def extra_context_len(spec: SpecShape | None, page_size: int) -> int:
    """Row headroom beyond the context length; never narrower than the reserve."""
    extra = 4 + (spec.max_draft_tokens if spec is not None else 0)
    if spec is not None and not reverted("row-headroom"):
        extra = max(extra, alloc_reserve_per_decode(spec, page_size))
    return extra


def row_width(context_length: int, spec: SpecShape | None, page_size: int) -> int:
    """Width of a ``req_to_token`` row, page aligned so whole-page frees stay in the row."""
    return ceil_page(context_length + extra_context_len(spec, page_size), page_size)


def check_widest_rung_fits_context(spec: SpecShape, page_size: int, context_length: int) -> None:
    """Adaptive speculation: refuse a ladder whose widest rung reserves as many KV
    positions per decode as the context holds (every request would hold that reserve,
    sized for the widest rung, whichever rung is active)."""
    reserve = alloc_reserve_per_decode(spec, page_size)
    if reserve >= context_length:
        raise ConfigError(
            f"spec.speculative.adaptive.candidateSteps: the widest rung (steps "
            f"{spec.num_steps}, topk {spec.topk}, numDraftTokens {spec.max_draft_tokens}) "
            f"reserves {reserve} KV positions per decode at page size {page_size}, not "
            f"below the context length {context_length}; drop or narrow the widest rung"
        )


def decode_alloc_target(
    committed: int, allocated: int, spec: SpecShape | None, page_size: int
) -> int:
    """Allocated length a request needs before its next decode step (seeds 002, 004):
    ``max(allocated, committed + reserve)``; rejected slots of earlier rounds are reused."""
    if spec is None:
        return max(allocated, committed + 1)
    return max(allocated, committed + alloc_reserve_per_decode(spec, page_size))


def admission_headroom(spec: SpecShape | None, page_size: int) -> int:
    """KV tokens to keep free per running request when admitting new ones (its next
    decode's growth), so admission does not force an immediate retraction."""
    if spec is None:
        return page_size
    return ceil_page(alloc_reserve_per_decode(spec, page_size), page_size)


DEFAULT_CPU_KV_TOKENS = 32768


def kv_pool_tokens(
    kv_cache, bytes_per_token: int, free_device_bytes: int | None, context_length: int
) -> int:
    """Token slots in the KV pool, page aligned.

    ``kvCache.maxTokens`` wins; else ``memFraction`` of free device memory (GPU);
    else a fixed default on CPU.  Never fewer than one full-context request.
    """
    page = kv_cache.page_size
    if kv_cache.max_tokens is not None:
        tokens = kv_cache.max_tokens
    elif free_device_bytes is not None:
        tokens = int(free_device_bytes * (kv_cache.mem_fraction or 0.85)) // bytes_per_token
    else:
        tokens = max(DEFAULT_CPU_KV_TOKENS, ceil_page(context_length, page))
    if kv_cache.max_tokens is None:
        tokens = max(tokens, ceil_page(context_length, page))
    return max(page, tokens // page * page)
