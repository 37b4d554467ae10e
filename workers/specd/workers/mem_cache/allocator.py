"""Paged token-pool allocator: a free list of pages of ``page_size`` slots.

Slot ``s`` belongs to page ``s // page_size``.  Allocation and freeing work in whole
pages; callers round tail frees up to a page boundary (see ``KVManager``).
"""

from __future__ import annotations

from collections.abc import Iterable


class PagedTokenAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._owned: set[int] = set()

    @property
    def total_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.page_size

    @property
    def used_tokens(self) -> int:
        return len(self._owned) * self.page_size

    def alloc_pages(self, count: int) -> list[int] | None:
        """``count`` pages, or None (nothing taken) when not enough are free."""
        if count > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(count)]
        self._owned.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for page in pages:
            if page not in self._owned:
                raise RuntimeError(f"page {page} freed but not allocated (double free?)")
            self._owned.remove(page)
            self._free.append(page)

    def check_integrity(self) -> None:
        """free + owned == total, and no page is both free and owned."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page appears twice in the free list")
        if free & self._owned:
            raise AssertionError(f"pages both free and owned: {sorted(free & self._owned)[:8]}")
        if len(free) + len(self._owned) != self.num_pages:
            raise AssertionError(
                f"pages lost: free {len(free)} + owned {len(self._owned)} != total {self.num_pages}"
            )
