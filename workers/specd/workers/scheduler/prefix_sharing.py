"""The prefix cache at admission: a waiting request borrows the longest cached prefix of
its tokens, and waits while a running request is still prefilling the pages they share
(so it borrows them instead of computing them a second time)."""

from __future__ import annotations

from collections.abc import Sequence

from specd.workers.mem_cache.kv_manager import KVManager
from specd.workers.requests.request import Req

# the least shared prompt, in tokens, worth waiting for another request's prefill
MIN_SHARED_PREFILL_TOKENS = 32


def may_borrow(kv: KVManager, req: Req, running: bool = False) -> bool:
    """Whether the prefix cache applies to ``req``: not to prompt scoring (it needs
    every prompt row), nor to a waiting request that still holds a row, e.g. a
    session turn whose history is its KV (``running``: one that does)."""
    if kv.cache is None:
        return False
    return req.params.prompt_logprobs is None and (running or req.kv.row is None)


def awaits_shared_prefill(kv: KVManager, running: Sequence[Req], req: Req) -> bool:
    """Whether ``req`` should wait: a running request is prefilling a prompt that
    opens like ``req``'s and has not yet computed the shared whole pages (at least
    `MIN_SHARED_PREFILL_TOKENS`).  Once it has, they are in the prefix cache for
    ``req`` to borrow.  The wait is bounded: the shared part is the other prompt's
    head, computed in its first chunks (a retracted request stops blocking)."""
    if not may_borrow(kv, req):
        return False
    page = kv.page_size
    tokens = req.fill_ids[: req.cacheable_len]
    for other in running:
        if other.tokens_to_compute == 0 or not may_borrow(kv, other, running=True):
            continue
        shared = shared_prefix_len(tokens, other.fill_ids[: other.cacheable_len])
        shared -= shared % page
        if shared >= MIN_SHARED_PREFILL_TOKENS and other.kv.committed < shared:
            return True
    return False


def start_on_cached_prefix(kv: KVManager, req: Req) -> int | None:
    """Let ``req`` (holding no KV) borrow the longest cached prefix of its tokens, all
    but the last (whose row gives the next token's logits; a later session turn:
    of its history, `Req.cacheable_len`) -> tokens borrowed, or None where the cache
    does not apply to it (`may_borrow`)."""
    if not may_borrow(kv, req):
        return None
    prefix = kv.cache.match(req.fill_ids[: req.cacheable_len])
    if not prefix or not kv.borrow(req.kv, prefix):
        return 0
    return req.kv.committed


def shared_prefix_len(a: Sequence[int], b: Sequence[int], stride: int = 64) -> int:
    """How many leading tokens ``a`` and ``b`` have in common (compared ``stride`` at a
    time, then one by one: every step may ask this of long prompts)."""
    n, i = min(len(a), len(b)), 0
    while i + stride <= n and a[i : i + stride] == b[i : i + stride]:
        i += stride
    while i < n and a[i] == b[i]:
        i += 1
    return i
