"""The small speculative-decoding kernels behind one interface, in torch and in Triton.

Draft-tree structure, the greedy verify walk, the verify mask, KV index gathers and
writes, and KV moves.  ``TorchOps`` (here) and ``TritonOps`` (``triton_ops.py``) give
identical results; ``ops_choice.get_ops(name)`` picks one.  All tensors of a call live on one device
and are int64 unless noted; arguments typed ``Sequence[int]`` are host values that size
the output, so no implementation needs a device -> host sync.

Tree notation: bs requests of T nodes each; node 0 is the root (``parents[:, 0] == -1``)
and every parent precedes its child (``0 <= parents[:, i] < i``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class TreeStructure:
    """What a draft tree's parent links imply, per request.

    depths [bs, T]: root 0.  tree_mask [bs, T, T] bool: ``[b, i, j]`` iff node j is node i
    or one of its ancestors.  next_token [bs, T]: lowest-index child, -1 if none.
    next_sibling [bs, T]: lowest index j > i with the same parent, -1 if none.
    """

    depths: torch.Tensor
    tree_mask: torch.Tensor
    next_token: torch.Tensor
    next_sibling: torch.Tensor


class KernelOps(Protocol):
    """One implementation of the speculative-decoding kernels (see the module docstring)."""

    name: str

    def tree_structure(self, parents: torch.Tensor) -> TreeStructure:
        """parents [bs, T] -> depths, ancestor-or-self mask, first child, next sibling."""
        ...

    def greedy_walk(
        self,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        next_token: torch.Tensor,
        next_sibling: torch.Tensor,
        target_argmax: torch.Tensor,
        num_steps: int,
    ) -> torch.Tensor:
        """All [bs, T] -> [bs] the last node the greedy verify accepts.

        From node 0, at node ``cur`` move to its lowest-index child ``c`` with
        ``tokens[c] == target_argmax[cur]``; stop when there is none or after
        ``num_steps`` moves.  ``parents`` and the first-child / next-sibling links describe
        the same tree; each implementation reads the form that suits it.
        """
        ...

    def verify_mask(self, tree_mask: torch.Tensor, prefix_lens: Sequence[int]) -> torch.Tensor:
        """tree_mask [bs, T, T] -> flat bool ``[sum(T * (prefix_len + T))]``.

        Per request ``[T, prefix_len + T]`` row-major: the prefix columns all True, then
        ``tree_mask[b]``; requests concatenated (``AttentionMetadata.custom_mask``).
        """
        ...

    def gather_row_slots(
        self,
        req_to_token: torch.Tensor,
        rows: torch.Tensor,
        ranges: torch.Tensor,
        extras: torch.Tensor,
        kv_lens: Sequence[int],
    ) -> torch.Tensor:
        """KV slots read by ``n`` query groups, concatenated -> [sum(kv_lens)] int64.

        req_to_token [num_rows, width]; rows [n]; ranges [n, R, 2] half-open row-position
        ranges (``a == b`` is empty, R >= 1); extras [n, E] single row positions, -1 = padding
        (trailing only).  Group g reads ``req_to_token[rows[g], a:b]`` for each range, then
        ``req_to_token[rows[g], p]`` for each ``p >= 0`` of ``extras[g]``; ``kv_lens[g]``
        is that count.  Prefix reads are R=1, E=0; a paged-tree branch's draft step reads
        R=2 (whole prefix pages, its tail copy) with its ancestors as extras.
        """
        ...

    def gather_row_slots_into(
        self,
        out: torch.Tensor,
        indptr: torch.Tensor,
        req_to_token: torch.Tensor,
        rows: torch.Tensor,
        ranges: torch.Tensor,
        extras: torch.Tensor,
        max_len: int,
    ) -> None:
        """``gather_row_slots`` written into ``out`` (int64 or int32) at the device offsets
        ``indptr`` [n + 1], no group longer than ``max_len``: a launch shape fixed by
        ``max_len`` alone, so a CUDA graph can capture it (Triton; the torch version reads
        ``indptr`` back)."""
        ...

    def move_kv(self, planes: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """For every plane, ``planes[:, dst[i]] = planes[:, src[i]]``, i in order.

        planes [P, num_slots, F] (the KV pool as ``[2 * num_layers, slots, heads * dim]``,
        one call moves every layer's K and V); src, dst [n] slots.  An entry with
        ``src == dst`` is a no-op (callers pad with them to avoid a host sync).  Contract
        for the others: their dst are distinct and no src equals an earlier entry's dst; then in-order copies and
        gather-then-scatter agree, so implementations may use either.  Both callers meet
        it: the accepted-path compaction (src >= dst, both increasing along a request's
        path; a src may equal a later entry's dst) and the prefix-tail copies (src and dst
        disjoint).
        """
        ...

    def write_req_to_token(
        self,
        req_to_token: torch.Tensor,
        rows: torch.Tensor,
        starts: torch.Tensor,
        slots: torch.Tensor,
        lens: Sequence[int],
    ) -> None:
        """``req_to_token[rows[i], starts[i] : starts[i] + lens[i]] = slots[off_i : off_i +
        lens[i]]`` with ``off_i = sum(lens[:i])``; rows, starts [b], slots [sum(lens)]."""
        ...


def host_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host ints -> int64 tensor on ``device`` without a device sync (pinned, non-blocking)."""
    t = torch.tensor(list(values), dtype=torch.int64)
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def exclusive_cumsum(lens: Sequence[int]) -> list[int]:
    """[3, 0, 2] -> [0, 3, 3, 5]: start offsets of ragged segments, and the total last."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


class TorchOps:
    """Vectorized torch: a handful of batched ops per call, loops only over log2(T)."""

    name = "torch"

    def tree_structure(self, parents: torch.Tensor) -> TreeStructure:
        bs, t = parents.shape
        node = torch.arange(t, device=parents.device)
        # reach[b, i, j]: j is i or i's parent; squaring k times spans paths of length 2^k
        reach = (parents[:, :, None] == node) | torch.eye(t, dtype=torch.bool, device=node.device)
        reach = reach.float()
        for _ in range((t - 1).bit_length()):  # 2^k > t - 1 >= every depth
            reach = torch.bmm(reach, reach).clamp_(max=1)
        tree_mask = reach > 0  # [bs, T, T]
        same_parent = parents[:, :, None] == parents[:, None, :]  # [bs, i, j]
        later = torch.ones(t, t, dtype=torch.bool, device=node.device).triu(1)  # j > i
        return TreeStructure(
            depths=tree_mask.sum(-1) - 1,
            tree_mask=tree_mask,
            next_token=_lowest_child(parents, torch.ones_like(tree_mask[:, 0])),
            next_sibling=first_true(same_parent & later),
        )

    def greedy_walk(self, tokens, parents, next_token, next_sibling, target_argmax, num_steps):
        predicted = tokens == target_argmax.gather(1, parents.clamp(min=0))  # [bs, T]
        step = _lowest_child(parents, predicted)  # [bs, T] where the walk goes from each node
        last = torch.zeros_like(tokens[:, 0])
        for _ in range(num_steps):  # a stopped walk stays put
            nxt = step.gather(1, last[:, None])[:, 0]
            last = torch.where(nxt >= 0, nxt, last)
        return last

    def verify_mask(self, tree_mask, prefix_lens):
        bs, t, _ = tree_mask.shape
        starts = exclusive_cumsum([t * (n + t) for n in prefix_lens])
        out = torch.ones(starts[-1], dtype=torch.bool, device=tree_mask.device)
        if bs == 0:
            return out
        info = host_tensor(starts[:-1] + list(prefix_lens), tree_mask.device).view(2, bs)
        start, n = info[0], info[1]  # [bs] each
        node = torch.arange(t, device=tree_mask.device)
        # flat index of tree_mask[b, i, j] = start[b] + i * (n[b] + t) + n[b] + j
        at = (
            start[:, None, None]
            + node[:, None] * (n + t)[:, None, None]
            + (n[:, None, None] + node)
        )
        out[at.flatten()] = tree_mask.flatten()
        return out

    def gather_row_slots(self, req_to_token, rows, ranges, extras, kv_lens):
        device = req_to_token.device
        group, local = _segments(kv_lens, device)  # [L] each
        lengths = ranges[..., 1] - ranges[..., 0]  # [n, R]
        ends = lengths.cumsum(1)  # [n, R] end of each range in the group's output
        g_ends = ends[group]  # [L, R]
        seg = (local[:, None] >= g_ends).sum(1)  # [L] range index, R = past the ranges
        in_range = seg < ranges.shape[1]
        r = seg.clamp(max=ranges.shape[1] - 1)[:, None]
        seg_start = (g_ends - lengths[group]).gather(1, r)[:, 0]
        from_range = ranges[group, r[:, 0], 0] + local - seg_start
        if extras.shape[1]:
            e = (local - g_ends[:, -1]).clamp(0, extras.shape[1] - 1)
            from_extra = extras[group, e]
        else:
            from_extra = torch.zeros_like(local)
        pos = torch.where(in_range, from_range, from_extra)
        return req_to_token[rows[group], pos].long()

    def gather_row_slots_into(self, out, indptr, req_to_token, rows, ranges, extras, max_len):
        starts = indptr.tolist()
        lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        got = self.gather_row_slots(req_to_token, rows, ranges, extras, lens)
        out[starts[0] : starts[0] + got.numel()] = got.to(out.dtype)

    def move_kv(self, planes, src, dst):
        if src.numel():
            planes[:, dst] = planes[:, src]

    def write_req_to_token(self, req_to_token, rows, starts, slots, lens):
        if all(n == 1 for n in lens):  # a slot per row (decode): no segments to expand
            req_to_token[rows, starts] = slots.to(req_to_token.dtype)
            return
        group, local = _segments(lens, req_to_token.device)
        req_to_token[rows[group], starts[group] + local] = slots.to(req_to_token.dtype)


def _segments(lens: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged segments of host lengths -> (segment id [L], index within it [L]), L = sum."""
    starts = exclusive_cumsum(lens)
    info = host_tensor(list(lens) + starts[:-1], device).view(2, len(lens))
    group = torch.repeat_interleave(
        torch.arange(len(lens), device=device), info[0], output_size=starts[-1]
    )
    return group, torch.arange(starts[-1], device=device) - info[1][group]


def first_true(m: torch.Tensor) -> torch.Tensor:
    """m [..., T] bool -> [...] index of the first True along the last dim, -1 if none."""
    t = m.shape[-1]
    idx = torch.where(m, torch.arange(t, device=m.device), t).amin(-1)
    return torch.where(idx == t, -1, idx)


def _lowest_child(parents: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """parents, keep [bs, T] -> [bs, T]: node p's lowest-index child i with ``keep[i]``, or -1."""
    bs, t = parents.shape
    node = torch.arange(t, device=parents.device).expand(bs, t)
    to = torch.where(keep & (parents >= 0), parents, t)  # column t collects the rest
    low = torch.full((bs, t + 1), t, dtype=torch.long, device=parents.device)
    low = low.scatter_reduce(1, to, node, "amin")[:, :t]
    return torch.where(low == t, -1, low)


TORCH_OPS: KernelOps = TorchOps()
