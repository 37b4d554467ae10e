"""Triton implementation of ``KernelOps`` (see ``ops.py`` for each operation's contract).

One launch per operation and no device -> host sync: output sizes come from the shapes
and from the host lengths the caller passes.  Offsets that can pass 2^31 (the KV planes,
large request tables, long verify masks) are computed in int64.  Without CUDA the same
kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, see the repo's conftest.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specd.kernels.ops import TreeStructure, exclusive_cumsum, host_tensor
from specd.kernels.triton_launch import launch

# elements one program handles along a ragged dimension (verify-mask row, group's slots)
_BLOCK = 1024
# tree_structure keeps a [rows, T] tile of ancestor flags in registers
_TREE_TILE = 4096


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


@triton.jit
def _tree_structure_kernel(
    parents_ptr,  # [bs, T] int64
    depths_ptr,  # [bs, T] int64 out
    mask_ptr,  # [bs, T, T] uint8 out
    next_token_ptr,  # [bs, T] int64 out
    next_sibling_ptr,  # [bs, T] int64 out
    T,
    BLOCK_I: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Program (b, block): rows i of request b (T <= BLOCK_I: the whole tree)."""
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # node i
    cols = tl.arange(0, BLOCK_T)  # node j
    row_ok, col_ok = rows < T, cols < T
    tree = parents_ptr + b * T
    parent_i = tl.load(tree + rows, mask=row_ok, other=-1)
    parent_j = tl.load(tree + cols, mask=col_ok, other=-2)  # -2: padding matches nothing

    # walk up from every row at once: after s steps ``up`` is the s-th ancestor (-1 above
    # the root); parents are read-only, so re-reading them needs no barrier
    up = tl.where(row_ok, rows.to(tl.int64), -1)
    seen = up[:, None] == cols[None, :]  # [BLOCK_I, BLOCK_T] ancestor-or-self
    depth = tl.zeros([BLOCK_I], dtype=tl.int64)
    for _ in range(T - 1):
        up = tl.load(tree + up, mask=up >= 0, other=-1)
        seen = seen | (up[:, None] == cols[None, :])
        depth += (up >= 0).to(tl.int64)

    child = parent_j[None, :] == rows[:, None]
    sibling = (parent_j[None, :] == parent_i[:, None]) & (cols[None, :] > rows[:, None])
    first_child = tl.min(tl.where(child, cols[None, :], BLOCK_T), axis=1)
    first_sibling = tl.min(tl.where(sibling, cols[None, :], BLOCK_T), axis=1)

    out = b * T + rows  # [BLOCK_I] int64
    tl.store(depths_ptr + out, depth, mask=row_ok)
    tl.store(next_token_ptr + out, tl.where(first_child < BLOCK_T, first_child, -1), mask=row_ok)
    tl.store(
        next_sibling_ptr + out, tl.where(first_sibling < BLOCK_T, first_sibling, -1), mask=row_ok
    )
    tl.store(
        mask_ptr + out[:, None] * T + cols[None, :],
        seen.to(tl.uint8),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _greedy_walk_kernel(
    tokens_ptr,  # [bs, T] int64
    next_token_ptr,  # [bs, T] int64
    next_sibling_ptr,  # [bs, T] int64
    argmax_ptr,  # [bs, T] int64
    last_ptr,  # [bs] int64 out
    T,
    num_steps,
):
    """Program b: try children in index order (first child, then next siblings); every
    try moves to a higher node index, so T - 1 tries cover any walk."""
    base = tl.program_id(0).to(tl.int64) * T
    cur = tl.full([], 0, tl.int64)  # last accepted node
    moves = tl.full([], 0, tl.int32)
    c = tl.load(next_token_ptr + base)  # child being tried, -1 when none is left
    for _ in range(T - 1):
        trying = (c >= 0) & (moves < num_steps)
        token = tl.load(tokens_ptr + base + c, mask=trying, other=-1)
        accept = trying & (token == tl.load(argmax_ptr + base + cur))
        child = tl.load(next_token_ptr + base + c, mask=accept, other=-1)
        sibling = tl.load(next_sibling_ptr + base + c, mask=trying & ~accept, other=-1)
        cur = tl.where(accept, c, cur)
        moves += accept.to(tl.int32)
        c = tl.where(accept, child, tl.where(trying, sibling, c))
    tl.store(last_ptr + tl.program_id(0), cur)


@triton.jit
def _verify_mask_kernel(
    tree_mask_ptr,  # [bs, T, T] uint8
    info_ptr,  # [2, bs] int64: output start, prefix_len
    out_ptr,  # [sum(T * (prefix_len + T))] uint8 out
    bs,
    T,
    BLOCK: tl.constexpr,
):
    """Program (column block, row i, request b) writes its piece of row i."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    i = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    start = tl.load(info_ptr + b)
    n = tl.load(info_ptr + bs + b)
    width = n + T
    in_row = cols < width
    tree = tl.load(tree_mask_ptr + (b * T + i) * T + (cols - n), mask=in_row & (cols >= n), other=0)
    tl.store(
        out_ptr + start + i * width + cols, tl.where(cols < n, 1, tree).to(tl.uint8), mask=in_row
    )


@triton.jit
def _gather_row_slots_kernel(
    table_ptr,  # [num_rows, width] req_to_token
    row_stride,
    rows_ptr,  # [n] int64
    ranges_ptr,  # [n, R, 2] int64
    extras_ptr,  # [n, E] int64
    indptr_ptr,  # [n + 1] int64 output offsets
    out_ptr,  # [sum(kv_lens)] out: int64 (or int32, flashinfer's page indices)
    R: tl.constexpr,
    E: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (group g, block): output entries ``at`` of group g, mapped to row positions."""
    g = tl.program_id(0).to(tl.int64)
    out_start = tl.load(indptr_ptr + g)
    length = tl.load(indptr_ptr + g + 1) - out_start
    at = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    pos = tl.zeros([BLOCK], dtype=tl.int64)
    seg = 0  # where range r starts in the group's output (unrolled: may change type)
    for r in tl.static_range(R):
        a = tl.load(ranges_ptr + (g * R + r) * 2)
        n = tl.load(ranges_ptr + (g * R + r) * 2 + 1) - a
        pos = tl.where((at >= seg) & (at < seg + n), a + at - seg, pos)
        seg = seg + n
    if E > 0:
        e = at - seg
        is_extra = (at >= seg) & (at < length) & (e < E)
        pos = tl.where(is_extra, tl.load(extras_ptr + g * E + e, mask=is_extra, other=0), pos)
    valid = at < length
    row = tl.load(rows_ptr + g)
    slot = tl.load(table_ptr + row * row_stride + pos, mask=valid, other=0)
    tl.store(out_ptr + out_start + at, slot.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _move_kv_kernel(
    planes_ptr,  # [P, num_slots, F], viewed as same-width ints
    src_ptr,  # [n] int64
    dst_ptr,  # [n] int64
    n,
    plane_stride,
    slot_stride,
    F,
    BLOCK: tl.constexpr,
):
    """Program (plane, feature block) applies the n moves in order.  The same thread loads
    and stores a given feature, so a src that a later move overwrites is read first."""
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    plane = planes_ptr + tl.program_id(0).to(tl.int64) * plane_stride + cols
    for i in range(n):
        src = tl.load(src_ptr + i)
        dst = tl.load(dst_ptr + i)
        x = tl.load(plane + src * slot_stride, mask=ok)
        tl.store(plane + dst * slot_stride, x, mask=ok)


@triton.jit
def _write_req_to_token_kernel(
    table_ptr,  # [num_rows, width] req_to_token
    row_stride,
    rows_ptr,  # [b] int64
    starts_ptr,  # [b] int64
    slots_ptr,  # [sum(lens)] int64
    indptr_ptr,  # [b + 1] int64 offsets into slots
    BLOCK: tl.constexpr,
):
    """Program (request i, block) writes its piece of ``slots[off_i : off_i + lens[i]]``."""
    g = tl.program_id(0).to(tl.int64)
    off = tl.load(indptr_ptr + g)
    length = tl.load(indptr_ptr + g + 1) - off
    at = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = at < length
    slot = tl.load(slots_ptr + off + at, mask=valid, other=0)
    dst = table_ptr + tl.load(rows_ptr + g) * row_stride + tl.load(starts_ptr + g) + at
    tl.store(dst, slot.to(table_ptr.dtype.element_ty), mask=valid)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _long(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()


def _check_unit_last_stride(name: str, t: torch.Tensor) -> None:
    """Kernels address ``name`` through its leading strides; the last one must be 1."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension, got strides {t.stride()}")


class TritonOps:
    """Each operation is one Triton launch (none when the output is empty)."""

    name = "triton"

    def tree_structure(self, parents: torch.Tensor) -> TreeStructure:
        bs, t = parents.shape
        parents = _long(parents)
        depths, next_token, next_sibling = (torch.empty_like(parents) for _ in range(3))
        mask = torch.empty(bs, t, t, dtype=torch.uint8, device=parents.device)
        block_t = _pow2(t)
        block_i = min(block_t, _pow2(_TREE_TILE // block_t))
        if bs:
            launch(
                _tree_structure_kernel,
                (bs, triton.cdiv(t, block_i)),
                parents,
                depths,
                mask,
                next_token,
                next_sibling,
                t,
                BLOCK_I=block_i,
                BLOCK_T=block_t,
            )
        return TreeStructure(depths, mask.view(torch.bool), next_token, next_sibling)

    def greedy_walk(self, tokens, parents, next_token, next_sibling, target_argmax, num_steps):
        bs, t = tokens.shape
        last = torch.empty(bs, dtype=torch.int64, device=tokens.device)
        if bs:
            launch(
                _greedy_walk_kernel,
                (bs,),
                _long(tokens),
                _long(next_token),
                _long(next_sibling),
                _long(target_argmax),
                last,
                t,
                num_steps,
            )
        return last

    def verify_mask(self, tree_mask, prefix_lens):
        bs, t, _ = tree_mask.shape
        starts = exclusive_cumsum([t * (n + t) for n in prefix_lens])
        out = torch.empty(starts[-1], dtype=torch.uint8, device=tree_mask.device)
        if starts[-1]:
            info = host_tensor(starts[:-1] + list(prefix_lens), tree_mask.device)
            block = min(_BLOCK, _pow2(max(prefix_lens) + t))
            grid = (triton.cdiv(max(prefix_lens) + t, block), t, bs)
            launch(
                _verify_mask_kernel,
                grid,
                tree_mask.contiguous().view(torch.uint8),
                info,
                out,
                bs,
                t,
                BLOCK=block,
            )
        return out.view(torch.bool)

    def gather_row_slots(self, req_to_token, rows, ranges, extras, kv_lens):
        indptr = exclusive_cumsum(kv_lens)
        out = torch.empty(indptr[-1], dtype=torch.int64, device=req_to_token.device)
        if indptr[-1]:
            self.gather_row_slots_into(
                out,
                host_tensor(indptr, req_to_token.device),
                req_to_token,
                rows,
                ranges,
                extras,
                max(kv_lens),
            )
        return out

    def gather_row_slots_into(self, out, indptr, req_to_token, rows, ranges, extras, max_len):
        _check_unit_last_stride("req_to_token", req_to_token)
        if not rows.numel() or not max_len:
            return
        block = min(_BLOCK, _pow2(max_len))
        launch(
            _gather_row_slots_kernel,
            (rows.numel(), triton.cdiv(max_len, block)),
            req_to_token,
            req_to_token.stride(0),
            _long(rows),
            _long(ranges),
            _long(extras),
            _long(indptr),
            out,
            R=ranges.shape[1],
            E=extras.shape[1],
            BLOCK=block,
        )

    def move_kv(self, planes, src, dst):
        _check_unit_last_stride("planes", planes)
        num_planes, _, f = planes.shape
        if not src.numel() or not num_planes or not f:
            return
        bits = planes.view(_INT_OF_SIZE[planes.element_size()])  # a bit-exact copy of any dtype
        block = min(_BLOCK, _pow2(f))
        launch(
            _move_kv_kernel,
            (num_planes, triton.cdiv(f, block)),
            bits,
            _long(src),
            _long(dst),
            src.numel(),
            bits.stride(0),
            bits.stride(1),
            f,
            BLOCK=block,
        )

    def write_req_to_token(self, req_to_token, rows, starts, slots, lens):
        _check_unit_last_stride("req_to_token", req_to_token)
        indptr = exclusive_cumsum(lens)
        if not indptr[-1]:
            return
        block = min(_BLOCK, _pow2(max(lens)))
        launch(
            _write_req_to_token_kernel,
            (len(lens), triton.cdiv(max(lens), block)),
            req_to_token,
            req_to_token.stride(0),
            _long(rows),
            _long(starts),
            _long(slots),
            host_tensor(indptr, req_to_token.device),
            BLOCK=block,
        )
