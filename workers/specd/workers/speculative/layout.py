"""Where a request's draft tree lives in its ``req_to_token`` row (seed 002, DESIGN §5).

All offsets are row positions of one request; ``prefix_len`` is the number of positions
whose draft KV is real (the target's committed length before the bonus pre-claim, since
draft position ``p`` pairs token ``p + 1`` with target hidden ``p``).  Draft step
``s = 1 .. S-1`` feeds the k nodes chosen by step ``s - 1`` (node ``j`` = the j-th best).

* Flat layout (page size 1, or topk 1): step ``s`` node ``j`` at
  ``prefix_len + (s - 1) * k + j``; every query reads the prefix in place.
* Paged tree layout (page size P > 1 and topk k > 1): ``tail = prefix_len % P``,
  ``base = prefix_len - tail``, ``span = pages * P`` with
  ``pages = (tail + S + P - 1) // P``.  Branch ``j`` owns ``[base + j*span,
  base + (j+1)*span)``; its node of step ``s`` sits at ``base + j*span + tail + s - 1``.
  Branch 0's first page is the prefix's own tail page; branches 1..k-1 start with a copy
  of the prefix tail (``prefix_tail_copies``), and a query of branch ``j`` reads the
  prefix as whole pages ``[0, base)`` plus its own branch's tail copy.

Everything lies in ``[prefix_len - tail, prefix_len + alloc_len_per_decode)``, inside
the allocation the decode step made (``sizing.decode_alloc_target``).  The target's
verify writes the T tree nodes contiguously at ``[prefix_len, prefix_len + T)`` in its
own pool, so verify never reads a branch copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from specd.workers.debug_toggles import reverted


@dataclass(frozen=True, slots=True)
class TreeLayout:
    """The draft-tree placement rule for one engine configuration."""

    page_size: int
    topk: int
    num_steps: int

    @property
    def paged(self) -> bool:
        return self.page_size > 1 and self.topk > 1

    @property
    def num_ranges(self) -> int:
        """How many row ranges a draft query reads as its prefix (``prefix_ranges``)."""
        return 2 if self.paged else 1

    def _region(self, prefix_len: int) -> tuple[int, int, int]:
        """(base, tail, span) of the paged layout for this prefix."""
        tail = prefix_len % self.page_size
        pages = (tail + self.num_steps + self.page_size - 1) // self.page_size
        return prefix_len - tail, tail, pages * self.page_size

    def node_position(self, prefix_len: int, step: int, node: int) -> int:
        """Row position of the draft KV that step ``step`` (>= 1) writes for node ``node``."""
        if not self.paged:
            return prefix_len + (step - 1) * self.topk + node
        base, tail, span = self._region(prefix_len)
        return base + node * span + tail + step - 1

    def node_positions(self, prefix_lens: list[int], step: int) -> list[int]:
        """``node_position`` of every node of ``step`` for each prefix, request-major."""
        return [self.node_position(n, step, j) for n in prefix_lens for j in range(self.topk)]

    def prefix_ranges(self, prefix_len: int, branch: int) -> list[tuple[int, int]]:
        """Half-open row-position ranges a query of branch ``branch`` reads as the prefix."""
        if not self.paged:
            return [(0, prefix_len)]
        base, tail, span = self._region(prefix_len)
        start = base + branch * span
        return [(0, base), (start, start + tail)]

    def prefix_tail_copies(self, prefix_len: int) -> list[tuple[int, int]]:
        """``duplicate_prefix_tail_to_draft_branches``: (src, dst) row positions whose draft
        KV must be copied before drafting, so every branch sees the prefix's tail page."""
        if not self.paged or reverted("tail-duplication"):
            return []
        base, tail, span = self._region(prefix_len)
        return [(base + o, base + b * span + o) for b in range(1, self.topk) for o in range(tail)]

    def end(self, prefix_len: int) -> int:
        """One past the last row position drafting touches."""
        if not self.paged:
            return prefix_len + max(0, self.num_steps - 1) * self.topk
        base, _, span = self._region(prefix_len)
        return base + self.topk * span
