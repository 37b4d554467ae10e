"""Prefix cache: the KV of finished requests, kept in a trie of whole pages and lent to
later requests whose tokens start the same way (SGLang's radix cache, at the page
granularity of vLLM's block hashing).

Each node holds one full page: its ``page_size`` tokens are the edge from its parent,
and its KV is that of those tokens after everything above it, so a path from the root
is a prefix.  A request that starts on a cached prefix borrows the path's pages
(``lock``: they cannot be evicted while it runs) and computes from the first token
after it; when it ends, its own whole pages of final KV are inserted (``insert``;
pages the trie already has come back to be freed).  Pages nobody borrows are
``evictable``; ``evict`` frees the least recently used leaves when the pool runs dry.

The evictable leaves wait in a heap as they come to be (``_offer``), so an eviction
costs the log of the trie's size, not a walk of it: at page size 1 a full pool is one
node per token, and each decode step's allocations evict (a walk took 3.1 ms per
one-page eviction at 32k cached tokens, and a plain engine held at 32 made 303.5 tok/s
against 1,405.5 with the heap).

Only the target's KV is exact for a lent page.  A speculative engine's draft KV at a
prefix's last position was made with the next token of the request that inserted it;
a new request whose next token differs drafts from it slightly worse, never wrongly
(verify decides every token).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from specd.workers.mem_cache.allocator import PagedTokenAllocator
from specd.workers.mem_cache.block_keys import next_key


@dataclass(eq=False, slots=True)
class _Node:
    key: tuple[int, ...]  # the page's tokens (empty at the root)
    page: int
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    lock_ref: int = 0  # requests borrowing this page (and every page below it they use)
    last_used: int = 0
    block_key: int | None = None  # set where the page ends a block (``block_tokens``)


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """A path of cached pages from the root, as ``match`` found it."""

    nodes: tuple[_Node, ...] = ()

    @property
    def pages(self) -> list[int]:
        return [node.page for node in self.nodes]

    def __len__(self) -> int:
        return len(self.nodes)


class PrefixCache:
    """With ``block_tokens`` (a multiple of the page size), each page that ends a block
    of that many tokens is keyed as the gateway keys prompts (`block_keys.next_key`,
    computed once, on insertion), and ``on_evict(key)`` hears of its eviction."""

    def __init__(
        self,
        allocator: PagedTokenAllocator,
        on_evict: Callable[[int], None] | None = None,
        block_tokens: int = 0,
    ):
        self.allocator = allocator
        self.on_evict = on_evict
        self.block_tokens = block_tokens
        self.page_size = allocator.page_size
        self._root = _Node((), -1, None)
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages the trie holds
        self.num_locked_pages = 0  # of those, pages some request borrows
        # (last_used, order, node) of leaves nobody borrows, as offered; an entry is
        # stale once its node is gone, grew a child, was borrowed or was used again
        self._evictable: list[tuple[int, int, _Node]] = []
        self._order = itertools.count()

    @property
    def evictable_tokens(self) -> int:
        return (self.num_pages - self.num_locked_pages) * self.page_size

    @property
    def protected_tokens(self) -> int:
        return self.num_locked_pages * self.page_size

    def _keys(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        """``tokens`` cut into whole pages (a partial last page is dropped)."""
        p = self.page_size
        return [tuple(tokens[i : i + p]) for i in range(0, len(tokens) - p + 1, p)]

    def match(self, tokens: Sequence[int]) -> CachedPrefix:
        """The longest cached path of whole pages that ``tokens`` starts with."""
        node, path, now = self._root, [], next(self._clock)
        for key in self._keys(tokens):
            node = node.children.get(key)
            if node is None:
                break
            node.last_used = now
            path.append(node)
        if path:
            self._offer(path[-1])  # used again: it moves in the LRU order
        return CachedPrefix(tuple(path))

    def lock(self, prefix: CachedPrefix) -> None:
        for node in prefix.nodes:
            node.lock_ref += 1
            self.num_locked_pages += node.lock_ref == 1

    def unlock(self, prefix: CachedPrefix) -> None:
        for node in prefix.nodes:
            if node.lock_ref <= 0:
                raise AssertionError(f"page {node.page} unlocked more often than locked")
            node.lock_ref -= 1
            self.num_locked_pages -= node.lock_ref == 0
            self._offer(node)

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Keep ``pages`` (the KV of ``tokens``, one page per ``page_size`` tokens) ->
        the pages not kept, because the trie holds those tokens in another page already
        (the caller frees them)."""
        keys = self._keys(tokens)
        if len(keys) != len(pages):
            raise ValueError(f"{len(pages)} pages for {len(tokens)} tokens")
        node, now, duplicates = self._root, next(self._clock), []
        block, last_block_key = self.block_tokens, 0
        for end, (key, page) in enumerate(zip(keys, pages, strict=True), 1):
            end *= self.page_size  # tokens from the root to this page's end
            child = node.children.get(key)
            if child is None:
                child = _Node(key, page, node)
                if block and end % block == 0:
                    child.block_key = next_key(last_block_key, tokens[end - block : end])
                node.children[key] = child
                self.num_pages += 1
            elif child.page != page:
                duplicates.append(page)
            child.last_used = now
            last_block_key = child.block_key if child.block_key is not None else last_block_key
            node = child
        self._offer(node)
        return duplicates

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages, least recently used leaves first (a parent
        becomes a leaf once its children are gone); borrowed pages stay -> freed."""
        freed = []
        while self._evictable and len(freed) < num_pages:
            used, _, node = heapq.heappop(self._evictable)
            if node.last_used != used or not self._is_evictable(node):
                continue  # stale: a newer entry, or none, stands for it
            if self.on_evict is not None and node.block_key is not None:
                self.on_evict(node.block_key)
            parent = node.parent
            del parent.children[node.key]
            node.parent = None  # out of the trie: its other entries are stale
            freed.append(node.page)
            self.num_pages -= 1
            self._offer(parent)
        self.allocator.free(freed)
        return len(freed)

    def _is_evictable(self, node: _Node) -> bool:
        """In the trie and not its root, a leaf, and borrowed by nobody."""
        return node.parent is not None and not node.children and not node.lock_ref

    def _offer(self, node: _Node) -> None:
        """Put ``node`` in the eviction heap at its last use if it is evictable now.
        Once stale entries make the heap twice the trie's size it is rebuilt from the
        trie (a walk per that many offers)."""
        if not self._is_evictable(node):
            return
        if len(self._evictable) > 2 * self.num_pages + 64:
            self._evictable = [
                (n.last_used, next(self._order), n) for n in self._nodes() if self._is_evictable(n)
            ]
            heapq.heapify(self._evictable)  # ``node`` is among them
            return
        heapq.heappush(self._evictable, (node.last_used, next(self._order), node))

    def pages(self) -> list[int]:
        """Every page the trie holds."""
        return [n.page for n in self._nodes()]

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def check_integrity(self) -> None:
        """The counters match the trie, no page is in it twice, a borrowed page's parent
        is borrowed at least as often (requests borrow whole paths), and every leaf
        nobody borrows waits in the eviction heap at its last use."""
        nodes = list(self._nodes())
        pages = [n.page for n in nodes]
        if len(pages) != len(set(pages)) or len(pages) != self.num_pages:
            raise AssertionError(
                f"prefix cache: {len(pages)} nodes, {len(set(pages))} distinct pages, "
                f"counted {self.num_pages}"
            )
        locked = sum(1 for n in nodes if n.lock_ref)
        if locked != self.num_locked_pages:
            raise AssertionError(
                f"prefix cache: {locked} borrowed pages, counted {self.num_locked_pages}"
            )
        for n in nodes:
            if n.parent is not self._root and n.parent.lock_ref < n.lock_ref:
                raise AssertionError(f"prefix cache: page {n.page} borrowed without its parent")
        waiting = {id(n) for used, _, n in self._evictable if used == n.last_used}
        for n in nodes:
            if self._is_evictable(n) and id(n) not in waiting:
                raise AssertionError(f"prefix cache: evictable page {n.page} is not in the heap")

    def check_locks(self, borrowed: Iterable[CachedPrefix]) -> None:
        """Each page is locked exactly as often as the ``borrowed`` paths (every live
        holder's: requests' and sessions') hold it: a lock nobody holds would pin the
        page for good, a missing one would let it be evicted under its borrower."""
        holders = Counter(id(node) for prefix in borrowed for node in prefix.nodes)
        for node in self._nodes():
            if node.lock_ref != holders[id(node)]:
                raise AssertionError(
                    f"prefix cache: page {node.page} locked {node.lock_ref} times, "
                    f"borrowed by {holders[id(node)]} live requests and sessions"
                )
