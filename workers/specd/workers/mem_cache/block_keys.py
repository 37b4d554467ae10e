"""Chained block keys of a token sequence: the one keying shared by the engine's prefix
cache (each block-ending page as it is inserted) and the gateway's prefix affinity
(`specd.workers.pool.prefix_affinity`, each prompt it routes), so an evicted key names the
same block on both sides.

A block is the smallest multiple of the page size that holds at least `MIN_BLOCK_TOKENS`
tokens, so a page size of 1 does not cost one key per token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

MIN_BLOCK_TOKENS = 16


def block_tokens_for(page_size: int) -> int:
    """Tokens per block for pages of ``page_size``."""
    return page_size * -(-MIN_BLOCK_TOKENS // page_size)


def next_key(previous: int, block: Sequence[int]) -> int:
    """A block's key: its tokens chained to the key of the block before it (0 first)."""
    return hash((previous, *block))


class EvictedBlocks:
    """Engine side: the keys of blocks whose last page the prefix cache evicted (the
    trie keys its block-ending pages with `next_key` as they are inserted), for the
    gateway: the newest ``keep``, and how many ever (it takes those it has not seen)."""

    def __init__(self, page_size: int, keep: int = 256):
        self.block_tokens = block_tokens_for(page_size)
        self.keys: deque[int] = deque(maxlen=keep)
        self.total = 0

    def evicted(self, key: int) -> None:
        self.keys.append(key)
        self.total += 1

    def snapshot(self) -> dict:
        return {"total": self.total, "keys": list(self.keys)}
