"""Triton attention over paged KV: an extend kernel, a split-KV decode kernel and its reduce.

Both attention kernels pack (query token, head within the GQA group) into the M rows of one
program, so every K/V block gathered from the pool (through ``kv_indices``) is loaded once
and serves the whole group.  Worked example, 8 q heads over 2 kv heads (GROUP 4), a request
with qo_len 3, BLOCK_M 16, the program for kv head 1 (q heads 4..7)::

    row m:      0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 .. 15
    token m//4: 0  0  0  0 | 1  1  1  1 | 2  2  2  2 |  3 (>= qo_len: padding, masked)
    head:       4  5  6  7 | 4  5  6  7 | 4  5  6  7 |

Decode has qo_len 1, so its rows are just the group's heads.  Scores use base 2
(``qk_scale = scale * log2(e)``, ``exp2``); softmax state and accumulators are float32.
Launchers take only host values fixed when the batch was planned, so a forward can be
captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specd.kernels.triton_launch import launch

LOG2E = math.log2(math.e)

MASK_NONE = tl.constexpr(0)  # every KV position of the range is visible (decode)
MASK_CAUSAL = tl.constexpr(1)  # query j of a request sits at position kv_len - qo_len + j
MASK_CUSTOM = tl.constexpr(2)  # per-request [qo_len, kv_len] bool mask, taken as given


@triton.jit
def _dot(a, b):
    """a @ b accumulated in float32; float32 inputs stay exact (no tf32)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _packed_rows(m_block, kv_head, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """(query token within the request, q head) of each packed row: two [BLOCK_M]."""
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows // GROUP, kv_head * GROUP + rows % GROUP


@triton.jit
def _load_q_rows(q_ptr, n, head, row_ok, stride_qn, stride_qh, offs_d, d_ok):
    """[BLOCK_M, BLOCK_D] queries (flat index n, q head) of the packed rows; padding reads 0."""
    ptrs = q_ptr + n[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :]
    return tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _attend_kv_range(
    q,  # [BLOCK_M, BLOCK_D]
    k_ptr,
    v_ptr,
    slots_ptr,  # kv_indices + kv_start: this request's slots in position order
    kv_head,
    lo,
    hi,  # KV positions [lo, hi) are read, in BLOCK_N chunks
    q_pos,  # [BLOCK_M] causal position of each row (MASK_CAUSAL)
    mask_rows_ptr,  # [BLOCK_M] pointers to each row's custom mask row (MASK_CUSTOM)
    row_ok,  # [BLOCK_M]
    qk_scale,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    offs_d,
    d_ok,
    MASK_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Online softmax over KV positions [lo, hi): returns (acc, m, l), all float32.

    acc [BLOCK_M, BLOCK_D] is the unnormalised output, m [BLOCK_M] the running row max
    (base-2 scores, -inf while nothing was visible), l [BLOCK_M] the running row sum."""
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        slots = tl.load(slots_ptr + offs_n, mask=n_ok, other=0).to(tl.int64)
        k_t = tl.load(  # [BLOCK_D, BLOCK_N]: K gathered through the slots, transposed
            k_ptr + slots[None, :] * stride_kn + kv_head * stride_kh + offs_d[:, None],
            mask=d_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        s = _dot(q, k_t.to(q.dtype)) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = n_ok[None, :]
        if MASK_MODE == MASK_CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
        elif MASK_MODE == MASK_CUSTOM:
            allowed = tl.load(
                mask_rows_ptr[:, None] + offs_n[None, :],
                mask=row_ok[:, None] & n_ok[None, :],
                other=0,
            )
            visible = visible & (allowed != 0)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + slots[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _extend_kernel(
    q_ptr,  # [N, H, D]
    k_ptr,  # [num_slots, H_kv, D]
    v_ptr,
    out_ptr,  # [N, H, D]
    qo_indptr,  # [bs + 1]
    kv_indptr,  # [bs + 1]
    kv_indices,  # [sum(kv_len)]
    custom_mask,  # [sum(qo_len * kv_len)] uint8, or None
    mask_indptr,  # [bs + 1] start of each request's mask, or None
    qk_scale,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_on,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASK_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid (bs, H_kv, cdiv(max_qo_len * GROUP, BLOCK_M)): one block of packed rows."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    m_block = tl.program_id(2)
    qo_start = tl.load(qo_indptr + req)
    qo_len = tl.load(qo_indptr + req + 1) - qo_start
    first_tok = m_block * BLOCK_M // GROUP
    if first_tok >= qo_len:  # past this request's queries (also every qo_len 0 request)
        return
    kv_start = tl.load(kv_indptr + req)
    kv_len = tl.load(kv_indptr + req + 1) - kv_start

    tok, head = _packed_rows(m_block, kv_head, GROUP, BLOCK_M)  # [BLOCK_M] each
    row_ok = tok < qo_len
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n = qo_start + tok  # [BLOCK_M] flat query index
    q = _load_q_rows(q_ptr, n, head, row_ok, stride_qn, stride_qh, offs_d, d_ok)

    q_pos = kv_len - qo_len + tok  # [BLOCK_M]
    hi = kv_len
    if MASK_MODE == MASK_CAUSAL:  # KV past the block's last query is hidden from every row
        last_tok = tl.minimum((m_block * BLOCK_M + BLOCK_M - 1) // GROUP, qo_len - 1)
        hi = kv_len - qo_len + last_tok + 1
    mask_rows = None  # only MASK_CUSTOM reads mask rows
    if MASK_MODE == MASK_CUSTOM:
        mask_rows = custom_mask + tl.load(mask_indptr + req) + tok * kv_len
    acc, m_i, l_i = _attend_kv_range(
        q, k_ptr, v_ptr, kv_indices + kv_start, kv_head, 0, hi, q_pos, mask_rows, row_ok,
        qk_scale, stride_kn, stride_kh, stride_vn, stride_vh, offs_d, d_ok,
        MASK_MODE, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a fully masked row gives 0
    out_ptrs = out_ptr + n[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [bs, H, D]: one query per request
    k_ptr,  # [num_slots, H_kv, D]
    v_ptr,
    part_out,  # [bs, H, num_splits, D] float32: each split's normalised output
    part_lse,  # [bs, H, num_splits] float32: each split's log2-sum-exp2 (-inf when empty)
    qo_indptr,  # [bs + 1]
    kv_indptr,  # [bs + 1]
    kv_indices,  # [sum(kv_len)]
    qk_scale,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid (bs, H_kv, num_splits): one split of one request's KV for one GQA group.

    Request ``req`` cuts its KV into ``num_splits`` chunks of ``cdiv(kv_len, num_splits)``
    rounded up to BLOCK_N; trailing splits of a short request are empty."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    kv_start = tl.load(kv_indptr + req)
    kv_len = tl.load(kv_indptr + req + 1) - kv_start
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)

    tok, head = _packed_rows(0, kv_head, GROUP, BLOCK_M)  # qo_len 1: rows past GROUP pad
    row_ok = tok == 0
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    qo_start = tl.load(qo_indptr + req)
    q = _load_q_rows(q_ptr, qo_start + tok, head, row_ok, stride_qn, stride_qh, offs_d, d_ok)
    acc, m_i, l_i = _attend_kv_range(
        q, k_ptr, v_ptr, kv_indices + kv_start, kv_head, lo, hi, None, None, row_ok,
        qk_scale, stride_kn, stride_kh, stride_vn, stride_vh, offs_d, d_ok,
        MASK_NONE, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))

    base = (req * tl.num_programs(1) * GROUP + head) * num_splits + split  # [BLOCK_M]
    tl.store(part_lse + base, lse, mask=row_ok)
    tl.store(
        part_out + base[:, None] * HEAD_DIM + offs_d[None, :],
        out,
        mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _decode_reduce_kernel(
    part_out,  # [bs, H, num_splits, D] float32
    part_lse,  # [bs, H, num_splits] float32
    out_ptr,  # [bs, H, D]
    qo_indptr,
    stride_on,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid (bs, H): merge the splits of one (request, head) by their log-sum-exp."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    base = (req * tl.num_programs(1) + head) * num_splits
    lse = tl.load(part_lse + base + offs_s, mask=s_ok, other=float("-inf"))  # [BLOCK_S]
    lse_max = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # empty -> 0
    parts = tl.load(
        part_out + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    row = tl.load(qo_indptr + req)
    out_ptrs = out_ptr + row * stride_on + head * stride_oh + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def pow2_block(n: int, floor: int = 16) -> int:
    """Smallest power of two >= n and >= floor (tl.dot wants every side >= 16)."""
    return max(floor, triton.next_power_of_2(max(n, 1)))


def kv_block_size(block_d: int, elem_size: int) -> int:
    """KV positions per loop step: 64, fewer for wide rows so K/V tiles fit shared memory."""
    row_bytes = block_d * elem_size
    return 64 if row_bytes <= 256 else 32 if row_bytes <= 512 else 16


def _group_size(q: torch.Tensor, k_buffer: torch.Tensor, *others: torch.Tensor) -> int:
    """q heads per kv head, after checking every tensor is [rows, heads, head_dim] with a
    unit head_dim stride (rows and heads may be strided, e.g. q sliced out of a fused qkv)."""
    for t in (q, k_buffer, *others):
        if t.dim() != 3 or t.stride(2) != 1:
            raise ValueError(
                "attention tensors must be [rows, heads, head_dim], head_dim contiguous"
            )
    if q.shape[1] % k_buffer.shape[1] != 0:
        raise ValueError(f"{q.shape[1]} q heads do not split over {k_buffer.shape[1]} kv heads")
    return q.shape[1] // k_buffer.shape[1]


def extend_attention(
    q: torch.Tensor,  # [N, H, D]
    k_buffer: torch.Tensor,  # [num_slots, H_kv, D]
    v_buffer: torch.Tensor,
    out: torch.Tensor,  # [N, H, D], written
    qo_indptr: torch.Tensor,  # [bs + 1]
    kv_indptr: torch.Tensor,  # [bs + 1]
    kv_indices: torch.Tensor,  # [sum(kv_len)]
    max_qo_len: int,
    scale: float,
    custom_mask: torch.Tensor | None = None,  # [sum(qo_len * kv_len)] uint8
    mask_indptr: torch.Tensor | None = None,  # [bs + 1]
) -> None:
    """Causal (or custom-masked) attention of ragged queries over paged KV."""
    group = _group_size(q, k_buffer, v_buffer, out)
    head_dim = q.shape[2]
    bs = qo_indptr.shape[0] - 1
    block_d = pow2_block(head_dim)
    block_m = min(64, pow2_block(max_qo_len * group))
    num_m_blocks = triton.cdiv(max_qo_len * group, block_m)
    if bs == 0 or num_m_blocks == 0:
        return
    mode = (MASK_CUSTOM if custom_mask is not None else MASK_CAUSAL).value
    launch(
        _extend_kernel, (bs, k_buffer.shape[1], num_m_blocks),
        q, k_buffer, v_buffer, out, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
        scale * LOG2E, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, MASK_MODE=mode, BLOCK_M=block_m,
        BLOCK_N=kv_block_size(block_d, q.element_size()), BLOCK_D=block_d,
        num_warps=4, num_stages=2,
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,  # [bs, H, D]
    k_buffer: torch.Tensor,  # [num_slots, H_kv, D]
    v_buffer: torch.Tensor,
    out: torch.Tensor,  # [bs, H, D], written
    qo_indptr: torch.Tensor,  # [bs + 1], qo_len 1 each
    kv_indptr: torch.Tensor,  # [bs + 1]
    kv_indices: torch.Tensor,  # [sum(kv_len)]
    part_out: torch.Tensor,  # [bs, H, num_splits, D] float32 scratch
    part_lse: torch.Tensor,  # [bs, H, num_splits] float32 scratch
    num_splits: int,
    scale: float,
) -> None:
    """Causal decode (one query per request) with split KV, then the merge of the splits."""
    group = _group_size(q, k_buffer, v_buffer, out)
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], k_buffer.shape[1]
    bs = qo_indptr.shape[0] - 1
    if bs == 0:
        return
    block_d = pow2_block(head_dim)
    launch(
        _decode_split_kernel, (bs, kv_heads, num_splits),
        q, k_buffer, v_buffer, part_out, part_lse, qo_indptr, kv_indptr, kv_indices,
        scale * LOG2E, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=pow2_block(group),
        BLOCK_N=kv_block_size(block_d, q.element_size()), BLOCK_D=block_d,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    launch(
        _decode_reduce_kernel, (bs, heads),
        part_out, part_lse, out, qo_indptr, out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        num_warps=2,
    )  # fmt: skip
