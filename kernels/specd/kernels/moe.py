"""Mixture-of-experts routing and expert computation: the torch reference path.

A sparse MoE layer sends each token to ``top_k`` of ``E`` experts (each a SiLU-gated
MLP) and sums their outputs weighted by the router.  Expert weights are held stacked,
as serving engines hold them: ``w13 [E, 2I, H]`` (gate rows, then up rows) and
``w2 [E, H, I]``.

``moe_torch`` groups the tokens by expert and runs each expert that was chosen at least
once over all of its tokens (grouped matmuls where torch has them on CPU); its
arithmetic is that of ``transformers``' experts (an expert's output is scaled by its
routing weight, then added into the result in the activation dtype), so it is the
exactness reference for the fused kernels.  It sizes groups on the host, so it is not
CUDA-graph capturable; the Triton path is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [N, E] -> (weights [N, top_k] float32, expert ids [N, top_k] int64).

    Softmax over all experts in float32, the ``top_k`` largest, and, if ``renormalize``,
    divided by their sum (Qwen3-MoE's ``norm_topk_prob``; always for Mixtral, where it
    equals a softmax over the chosen logits)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x [N, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights/ids [N, k] -> [N, H] in x's dtype.

    The (token, slot) pairs are grouped by expert with one sort.  On CPU, where this torch
    has ``torch._grouped_mm``, the experts run as two grouped matmuls over the sorted
    rows (1.8x the loop's speed for 32 experts at batch 32 on a 2-core VM, and the same
    bits); otherwise each expert chosen by some token runs once over all of its tokens.
    The outputs are added into the result in expert order either way."""
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0])
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order, None]
    if _grouped_mm_runs(x, w2):
        rows = _experts_grouped(x[token_of], w13, w2, counts)
    else:
        rows = _experts_looped(x[token_of], w13, w2, counts.tolist())
    scaled = rows * weight_of  # in the weights' dtype, as the caller chose
    return out.index_add_(0, token_of, scaled.to(out.dtype))


def _grouped_mm_runs(x: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands on CPU: it needs every row
    stride a multiple of 16 bytes (hidden and intermediate widths)."""
    if x.device.type != "cpu" or not hasattr(torch, "_grouped_mm"):
        return False
    hidden, inter = w2.shape[1], w2.shape[2]
    return (hidden * x.element_size()) % 16 == 0 and (inter * x.element_size()) % 16 == 0


def _experts_grouped(
    rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """rows [P, H] sorted by expert, ``counts[e]`` of them for expert e -> [P, H]."""
    ends = torch.cumsum(counts, 0).to(torch.int32)
    gate, up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=ends)


def _experts_looped(
    rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    """The same, one matmul pair per expert that has rows."""
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            gate, up = F.linear(rows[start : start + count], w13[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(F.silu(gate) * up, w2[expert]))
            start += count
    return torch.cat(outputs)
