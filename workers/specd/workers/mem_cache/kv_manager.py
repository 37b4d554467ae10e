"""Per-request KV bookkeeping: rows, pages, committed and allocated lengths.

A request owns one ``req_to_token`` row and a list of pages.  Position ``p`` of the
request lives in slot ``pages[p // P] * P + p % P``.  ``kv_committed_len`` counts
positions that are really its sequence; ``kv_allocated_len >= kv_committed_len``
counts positions that have slots (the gap is decode reserve / speculative
over-allocation).  Frees are rounded up to page boundaries.

With a prefix cache (``prefix_cache.py``) a request may start on borrowed pages: its
first ``borrowed`` pages belong to the cache (shared, never written), the rest are its
own.  When it is released its final whole pages go to the cache instead of the pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specd.kernels.ops import TORCH_OPS, KernelOps, host_tensor
from specd.workers.mem_cache.allocator import PagedTokenAllocator
from specd.workers.mem_cache.prefix_cache import CachedPrefix, PrefixCache
from specd.workers.mem_cache.req_to_token import ReqToTokenPool
from specd.workers.mem_cache.sizing import ceil_page


@dataclass(slots=True)
class RequestKV:
    """The KV a request holds: its row, its pages and its two lengths."""

    row: int | None = None
    pages: list[int] = field(default_factory=list)
    committed: int = 0
    allocated: int = 0
    prefix: CachedPrefix | None = None  # the cached pages it borrows (``pages``' first)

    @property
    def borrowed(self) -> int:
        """Pages at the front of ``pages`` that the prefix cache lends it."""
        return len(self.prefix) if self.prefix is not None else 0

    def assert_lengths(self, width: int) -> None:
        if not 0 <= self.committed <= self.allocated <= width:
            raise AssertionError(
                f"KV lengths out of order: committed {self.committed}, "
                f"allocated {self.allocated}, row width {width}"
            )


def held_slots(holders: Iterable[RequestKV], page_size: int) -> int:
    """Token slots ``holders`` own: whole pages, ``ceil_page(allocated)`` each, less the
    pages they borrow from the prefix cache."""
    return sum(ceil_page(kv.allocated, page_size) - kv.borrowed * page_size for kv in holders)


class RowWidthExceeded(RuntimeError):
    """An allocation would write past the end of a request row."""


def check_row_width(needed: int, width: int) -> None:
    """Always-on host check before writing ``req_to_token``: never past the row's end."""
    if needed > width:
        raise RowWidthExceeded(
            f"KV allocation needs {needed} positions but req_to_token rows are {width} wide "
            f"(context length + extra_context_len); the row headroom must cover the "
            f"speculative reserve: lower spec.speculative numSteps/topk/numDraftTokens or "
            f"spec.kvCache.pageSize, or unset SPECD_DEBUG_REVERT=row-headroom"
        )


class KVManager:
    def __init__(
        self,
        req_pool: ReqToTokenPool,
        allocator: PagedTokenAllocator,
        ops: KernelOps = TORCH_OPS,
        cache: PrefixCache | None = None,
    ):
        self.req_pool = req_pool
        self.ops = ops  # writes slots into req_to_token
        self.allocator = allocator
        self.cache = cache
        self.page_size = allocator.page_size
        self._live: dict[int, RequestKV] = {}  # row -> holder
        # (row, start, slots) writes ``grow`` queued inside ``batched_writes``; None: none open
        self._queued: list[tuple[int, int, list[int]]] | None = None

    @property
    def row_width(self) -> int:
        return self.req_pool.width

    def pages_needed(self, kv: RequestKV, new_allocated: int) -> int:
        """Pages to take from the pool to grow ``kv`` to ``new_allocated`` positions."""
        have = ceil_page(kv.allocated, self.page_size) // self.page_size
        need = ceil_page(new_allocated, self.page_size) // self.page_size
        return max(0, need - have)

    def grow(self, kv: RequestKV, new_allocated: int) -> bool:
        """Give ``kv`` slots for positions ``[allocated, new_allocated)``.

        Takes a row on first use.  Returns False, changing nothing, when the pool or
        the row pool is exhausted.  Raises ``RowWidthExceeded`` past the row width.
        """
        if new_allocated <= kv.allocated:
            return True
        check_row_width(new_allocated, self.row_width)
        took_row = kv.row is None
        if took_row:
            kv.row = self.req_pool.alloc()
            if kv.row is None:
                return False
        pages = self._alloc_pages(self.pages_needed(kv, new_allocated))
        if pages is None:
            if took_row:
                self.req_pool.free(kv.row)
                kv.row = None
            return False
        kv.pages.extend(pages)
        self._live[kv.row] = kv
        self._write_row(kv, kv.allocated, new_allocated)
        kv.allocated = new_allocated
        kv.assert_lengths(self.row_width)
        return True

    def _alloc_pages(self, count: int) -> list[int] | None:
        """``count`` pages from the pool, evicting cached pages nobody borrows if needed."""
        pages = self.allocator.alloc_pages(count)
        if pages is None and self.cache is not None:
            self.cache.evict(count - self.allocator.num_free_pages)
            pages = self.allocator.alloc_pages(count)
        return pages

    @property
    def available_tokens(self) -> int:
        """Slots a request could get now: free ones and evictable cached ones."""
        cached = self.cache.evictable_tokens if self.cache is not None else 0
        return self.allocator.free_tokens + cached

    def borrow(self, kv: RequestKV, prefix: CachedPrefix) -> bool:
        """Start ``kv`` (holding nothing yet) on the cached pages of ``prefix``: a row
        whose first positions point at them, committed.  False if no row is free."""
        if kv.row is not None or kv.pages:
            raise AssertionError("only a request holding no KV can borrow a cached prefix")
        kv.row = self.req_pool.alloc()
        if kv.row is None:
            return False
        self.cache.lock(prefix)
        kv.prefix = prefix
        kv.pages = prefix.pages
        self._live[kv.row] = kv
        kv.committed = kv.allocated = len(prefix) * self.page_size
        self._write_row(kv, 0, kv.allocated)
        kv.assert_lengths(self.row_width)
        return True

    def share_computed(self, kv: RequestKV, final_tokens: Sequence[int]) -> None:
        """Put ``kv``'s whole pages of final KV (``final_tokens``, as for ``release``)
        in the prefix cache while it still runs, and borrow them back, so requests
        admitted from now on can start on them.  Where the cache holds those tokens in
        another page already (another request computed them too), the row is pointed
        at the cached page and the own copy is freed."""
        page = self.page_size
        for i in self._cache_final_pages(kv, final_tokens):
            self._write_row(kv, i * page, (i + 1) * page)

    def _cache_final_pages(self, kv: RequestKV, final_tokens: Sequence[int]) -> list[int]:
        """Insert ``kv``'s whole pages of ``final_tokens`` into the prefix cache and borrow
        the cached path back (``kv.pages`` now lists the cache's pages) -> the indices of
        pages the cache held another copy of: that own copy is freed, the row not yet
        pointed at the cached one."""
        count = min(len(final_tokens) // self.page_size, len(kv.pages))
        if self.cache is None or count <= kv.borrowed:
            return []
        tokens = final_tokens[: count * self.page_size]
        self.cache.insert(tokens, kv.pages[:count])
        prefix = self.cache.match(tokens)
        self.cache.lock(prefix)
        if kv.prefix is not None:
            self.cache.unlock(kv.prefix)
        replaced = [i for i in range(kv.borrowed, count) if kv.pages[i] != prefix.pages[i]]
        self.allocator.free([kv.pages[i] for i in replaced])
        kv.prefix = prefix
        kv.pages[:count] = prefix.pages
        return replaced

    @contextmanager
    def uncached(self) -> Iterator[None]:
        """Requests run meanwhile neither borrow from nor fill the prefix cache (made-up
        prompts: the load's calibration).  Only while no request holds KV, so that none
        borrows pages across it."""
        if self._live:
            raise AssertionError(
                f"{len(self._live)} requests hold KV: the cache cannot be set aside"
            )
        cache, self.cache = self.cache, None
        try:
            yield
        finally:
            self.cache = cache

    @contextmanager
    def batched_writes(self) -> Iterator[None]:
        """Inside, ``grow`` queues its ``req_to_token`` writes and they go out as one op at
        the end (one launch per scheduled batch instead of one per request).  Nothing may
        read the rows it grew before then.  Re-entrant: the outermost one writes."""
        if self._queued is not None:
            yield
            return
        self._queued = []
        try:
            yield
        finally:
            queued, self._queued = self._queued, None
            self._write_rows(queued)

    def _write_row(self, kv: RequestKV, start: int, end: int) -> None:
        """Slots of positions ``[start, end)`` (from the pages, on the host) into the row,
        now or, inside ``batched_writes``, with the batch."""
        page = self.page_size
        slots = [kv.pages[p // page] * page + p % page for p in range(start, end)]
        if self._queued is None:
            self._write_rows([(kv.row, start, slots)])
        else:
            self._queued.append((kv.row, start, slots))

    def _write_rows(self, writes: list[tuple[int, int, list[int]]]) -> None:
        """One ``write_req_to_token`` for every ``(row, start, slots)`` in ``writes``."""
        writes = [w for w in writes if w[2]]
        if not writes:
            return
        rows, starts, slots = zip(*writes, strict=True)
        device = self.req_pool.req_to_token.device
        packed = host_tensor([*rows, *starts, *(s for row in slots for s in row)], device)
        n = len(writes)
        self.ops.write_req_to_token(
            self.req_pool.req_to_token,
            packed[:n],
            packed[n : 2 * n],
            packed[2 * n :],
            [len(row) for row in slots],
        )

    def _drop_queued(self, row: int, keep: int = 0) -> None:
        """Forget queued writes to ``row`` at positions ``>= keep`` (they were freed), so a
        later grow of the same positions in this batch is the only write to them."""
        if not self._queued:
            return
        self._queued = [
            (r, start, slots[: max(0, keep - start)] if r == row else slots)
            for r, start, slots in self._queued
        ]

    def free_tail(self, kv: RequestKV, keep: int) -> None:
        """Shrink the allocation to ``keep`` positions, freeing whole pages past it."""
        keep_pages = ceil_page(keep, self.page_size) // self.page_size
        if keep_pages < kv.borrowed:
            raise AssertionError(f"row {kv.row}: freeing borrowed cache pages")
        self._drop_queued(kv.row, keep)
        self.allocator.free(kv.pages[keep_pages:])
        del kv.pages[keep_pages:]
        kv.allocated = min(kv.allocated, keep)
        kv.committed = min(kv.committed, keep)

    def release(self, kv: RequestKV, final_tokens: Sequence[int] = ()) -> None:
        """Free every page and the row; lengths go back to zero.  With a prefix cache,
        ``final_tokens`` (the tokens of ``kv``'s first positions, whose KV is final)
        keeps their whole pages cached; borrowed pages go back to the cache."""
        self._cache_final_pages(kv, final_tokens)  # the row is freed: no repointing
        self.allocator.free(kv.pages[kv.borrowed :])
        if kv.prefix is not None:
            self.cache.unlock(kv.prefix)
            kv.prefix = None
        kv.pages = []
        if kv.row is not None:
            self._drop_queued(kv.row)
            del self._live[kv.row]
            self.req_pool.free(kv.row)
        kv.row = None
        kv.committed = kv.allocated = 0

    def slots(self, kv: RequestKV, start: int, end: int) -> torch.Tensor:
        """Pool slots of positions ``[start, end)`` of ``kv`` (must be allocated)."""
        return self.req_pool.req_to_token[kv.row, start:end]

    @property
    def reserved_tokens(self) -> int:
        """Allocated beyond committed, summed over live requests."""
        return sum(kv.allocated - kv.committed for kv in self._live.values())

    def check_integrity(self) -> None:
        """Pages and rows balance: each page in use belongs to exactly one live request
        or to the prefix cache, every borrowed page is a cached one, and every cached
        page is locked exactly by its live borrowers."""
        self.allocator.check_integrity()
        owned = [p for kv in self._live.values() for p in kv.pages[kv.borrowed :]]
        cached = []
        if self.cache is not None:
            self.cache.check_integrity()
            cached = self.cache.pages()
            borrowed = {p for kv in self._live.values() for p in kv.pages[: kv.borrowed]}
            if not borrowed <= set(cached):
                raise AssertionError("a request borrows a page the prefix cache does not hold")
            self.cache.check_locks(kv.prefix for kv in self._live.values() if kv.prefix)
        owned += cached
        if len(owned) != len(set(owned)):
            raise AssertionError("a page is held by two requests (or a request and the cache)")
        if len(owned) != self.allocator.num_pages - self.allocator.num_free_pages:
            raise AssertionError(
                f"leak: {self.allocator.num_pages - self.allocator.num_free_pages} pages in use "
                f"but live requests and the prefix cache hold {len(owned)}"
            )
        if len(self._live) + self.req_pool.num_free != self.req_pool.num_rows:
            raise AssertionError(
                f"row leak: {len(self._live)} live + {self.req_pool.num_free} free "
                f"!= {self.req_pool.num_rows} rows"
            )
        for kv in self._live.values():
            kv.assert_lengths(self.row_width)
            if len(kv.pages) != ceil_page(kv.allocated, self.page_size) // self.page_size:
                raise AssertionError(
                    f"row {kv.row}: {len(kv.pages)} pages for {kv.allocated} positions"
                )
