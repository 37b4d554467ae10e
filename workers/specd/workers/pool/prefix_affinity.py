"""The gateway's guess of which replica holds a prompt's KV: cache-aware routing's index.

Each engine keeps finished prompts' KV pages in its prefix cache
(`specd.workers.mem_cache.prefix_cache`).  The gateway sees every request it routes,
so it mirrors those caches without asking the engines: a prompt's leading tokens are
cut into blocks, each block's key chains its tokens to the previous block's key (as
vLLM's block hashes do), and the keys of a prompt go on record for the replica it was
sent to.  A replica's record is an LRU bounded by its KV pool; a prompt's deepest
blocks are the first of it to go, as the engine evicts leaves first.

A block is the smallest multiple of the replica's page size that holds at least
`MIN_BLOCK_TOKENS` tokens, so a page size of 1 does not cost one key per token.

The guess is corrected by the engines' evictions: an engine that evicts the cached page
ending a block puts that block's key in its status (`EvictedBlocks`: its prefix cache
keys each block-ending page with the same `next_key` chain when inserting it), and the
gateway takes it off the replica's record at its next probe.  An engine
may still evict between two probes, or more than its status keeps; a wrong guess costs
a prefill, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specd.workers.contracts import PrefixCacheShape, ReplicaInfo
from specd.workers.mem_cache.block_keys import block_tokens_for, next_key


@dataclass(frozen=True, slots=True)
class CacheShape:
    """What a replica's engine reports of its prefix cache (`EngineActor.info`)."""

    page_size: int
    capacity_tokens: int  # its KV pool: the most it can keep

    @property
    def block_tokens(self) -> int:
        return block_tokens_for(self.page_size)

    @property
    def capacity_blocks(self) -> int:
        return max(1, self.capacity_tokens // self.block_tokens)

    @classmethod
    def of(cls, shape: PrefixCacheShape | None) -> CacheShape | None:
        """The shape an engine reports; None when it caches no prefix."""
        return None if shape is None else cls(shape.page_size, shape.capacity_tokens)

    @classmethod
    def from_info(cls, info: ReplicaInfo | None) -> CacheShape | None:
        """The shape in an ``info()`` answer; None before it, or with no prefix cache."""
        return None if info is None else cls.of(info.prefix_cache)


def block_keys(prompt: Sequence[int], block_tokens: int) -> list[int]:
    """Chained keys of ``prompt``'s whole blocks that a request could start on: the
    engine lends every cached page but the one holding the prompt's last token."""
    keys, key = [], 0
    for start in range(0, (len(prompt) - 1) // block_tokens * block_tokens, block_tokens):
        key = next_key(key, prompt[start : start + block_tokens])
        keys.append(key)
    return keys


class PromptBlocks:
    """One prompt's `block_keys`, computed once per block size (a pool in a rolling
    update may mix page sizes) for both `PrefixAffinity.predicted_hits` and `record`."""

    def __init__(self, prompt: Sequence[int]):
        self.prompt = prompt
        self._keys: dict[int, list[int]] = {}

    def keys(self, block_tokens: int) -> list[int]:
        keys = self._keys.get(block_tokens)
        if keys is None:
            keys = self._keys[block_tokens] = block_keys(self.prompt, block_tokens)
        return keys


class PrefixAffinity:
    """Per replica: the block keys of the prompts sent there, least recently used first."""

    def __init__(self) -> None:
        self._records: dict[str, OrderedDict[int, None]] = {}

    def predicted_hits(
        self, prompt: PromptBlocks, shapes: Mapping[str, CacheShape | None]
    ) -> dict[str, int]:
        """Per replica in ``shapes``: how many of the prompt's tokens it likely has cached."""
        hits = {}
        for name, shape in shapes.items():
            record = self._records.get(name)
            if shape is None or not record:
                hits[name] = 0
                continue
            keys = prompt.keys(shape.block_tokens)
            matched = next((i for i, key in enumerate(keys) if key not in record), len(keys))
            hits[name] = matched * shape.block_tokens
        return hits

    def record(self, name: str, prompt: PromptBlocks, shape: CacheShape | None) -> None:
        """The prompt was sent to replica ``name``: its blocks are now its most recent."""
        if shape is None:
            return
        record = self._records.setdefault(name, OrderedDict())
        for key in reversed(prompt.keys(shape.block_tokens)):  # the first block last:
            record[key] = None  # it is evicted last
            record.move_to_end(key)
        while len(record) > shape.capacity_blocks:
            record.popitem(last=False)

    def discard(self, name: str, keys: Sequence[int]) -> None:
        """Replica ``name`` evicted these blocks (a prompt's deeper blocks went first)."""
        record = self._records.get(name)
        for key in keys if record else ():
            record.pop(key, None)

    def tracked_tokens(self, name: str, shape: CacheShape | None) -> int:
        """How many tokens of cache the index credits replica ``name`` with."""
        record = self._records.get(name)
        return 0 if shape is None or not record else len(record) * shape.block_tokens

    def forget(self, name: str) -> None:
        """Replica ``name`` left the pool (its names are never reused)."""
        self._records.pop(name, None)
