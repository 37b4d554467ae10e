"""The fused Triton MoE (``triton_moe``) against the torch reference ``moe_torch``:
float32 results on odd shapes and routings (on CPU through Triton's interpreter), capture
and replay in a graph, and bf16 on a GPU.  The expert alignment: ``test_moe_align``."""

import math

import pytest
import torch

pytest.importorskip("triton")

from specd.kernels.emulated_graph import EmulatedGraph  # noqa: E402
from specd.kernels.moe import moe_torch, route_topk  # noqa: E402
from specd.kernels.triton_backend import triton_devices  # noqa: E402
from specd.kernels.triton_moe import choose_block_m, fused_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

if DEVICE == "cpu" and DEVICE not in triton_devices():
    pytest.skip("Triton on CPU needs TRITON_INTERPRET=1", allow_module_level=True)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _routing(kind: str, n: int, e: int, k: int, seed: int = 0):
    """(weights [n, k] float32, ids [n, k] int64) on DEVICE: ``random``; ``unchosen``: the
    last two experts never chosen; ``one-expert``: every token's slot 0 to expert 2 (its
    other slots to 0, 1, ...)."""
    logits = torch.randn(n, e, generator=_generator(seed))
    if kind == "unchosen":
        logits[:, -2:] = -1e4
    weights, ids = route_topk(logits, k, renormalize=True)
    if kind == "one-expert":
        ids = torch.tensor([2] + [s - 1 if s <= 2 else s for s in range(1, k)]).repeat(n, 1)
    return weights.to(DEVICE), ids.to(DEVICE)


def _experts(e: int, hidden: int, inter: int, dtype=torch.float32, seed: int = 1):
    """x-independent expert weights scaled so each projection's output is O(1)."""
    g = _generator(seed)
    w13 = torch.randn(e, 2 * inter, hidden, generator=g) / math.sqrt(hidden)
    w2 = torch.randn(e, hidden, inter, generator=g) / math.sqrt(inter)
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def _tokens(n: int, hidden: int, dtype=torch.float32, seed: int = 2):
    return torch.randn(n, hidden, generator=_generator(seed)).to(DEVICE, dtype)


MOE_CASES = {  # (N, E, k, routing); H and I below are multiples of no block
    "one-token": (1, 4, 1, "random"),
    "k2": (3, 8, 2, "random"),
    "17-tokens": (17, 4, 2, "random"),
    "unchosen-experts": (17, 8, 2, "unchosen"),
    "one-expert": (17, 4, 1, "one-expert"),
    "large-tiles": (40, 4, 2, "random"),  # 80 pairs > 16 per expert: 64-row tiles
}


@pytest.mark.parametrize("case", MOE_CASES.values(), ids=MOE_CASES.keys())
def test_fused_moe_matches_torch_in_float32(case):
    n, e, k, kind = case
    hidden, inter = 70, 40
    weights, ids = _routing(kind, n, e, k)
    w13, w2 = _experts(e, hidden, inter)
    x = _tokens(n, hidden)
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.shape == (n, hidden) and got.dtype == torch.float32
    torch.testing.assert_close(got, moe_torch(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_large_batches_use_large_tiles():
    assert choose_block_m(2 * 3, 8) == 16
    assert choose_block_m(2 * 300, 8) == 64


def test_strided_tokens_and_an_empty_batch():
    hidden, inter, e = 48, 20, 4
    w13, w2 = _experts(e, hidden, inter)
    wide = _tokens(5, hidden + 6)
    x = wide[:, 3 : 3 + hidden]  # rows strided, as a slice of a wider activation
    weights, ids = _routing("random", 5, e, 2)
    torch.testing.assert_close(
        fused_moe(x, w13, w2, weights, ids),
        moe_torch(x, w13, w2, weights, ids),
        atol=1e-5,
        rtol=1e-5,
    )
    empty = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, hidden)


def test_replays_in_an_emulated_graph_with_new_routing():
    """No host reads: a capture holds the whole layer, and a replay with new tokens and a
    new routing in the same buffers computes the new result."""
    n, e, k, hidden, inter = 6, 4, 2, 40, 24
    w13, w2 = _experts(e, hidden, inter)
    x = _tokens(n, hidden)
    weights, ids = _routing("random", n, e, k)
    graph = EmulatedGraph()
    with torch.inference_mode(), graph.capture():
        out = fused_moe(x, w13, w2, weights, ids)
    new_weights, new_ids = _routing("one-expert", n, e, k, seed=5)
    x.copy_(_tokens(n, hidden, seed=6))
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(out, moe_torch(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n", [1, 32, 300])
def test_fused_moe_in_bf16_is_as_close_to_float32_as_the_torch_path(n):
    """Both bf16 paths round the same intermediates; the fused one may differ from torch's
    in accumulation order only, so its error from the float32 result stays within twice
    the torch path's own."""
    e, k, hidden, inter = 8, 2, 256, 512
    weights, ids = _routing("random", n, e, k)
    w13, w2 = _experts(e, hidden, inter, torch.bfloat16)
    x = _tokens(n, hidden, torch.bfloat16)
    reference = moe_torch(x.float(), w13.float(), w2.float(), weights, ids)
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    torch_error = (moe_torch(x, w13, w2, weights, ids).float() - reference).abs()
    fused_error = (got.float() - reference).abs()
    assert fused_error.max() <= 2 * torch_error.max() + 1e-6
    assert fused_error.mean() <= 2 * torch_error.mean() + 1e-6


GRAPH_CASES = {  # (N, E, k): both take the one-launch alignment on CUDA
    "32-tokens-8-experts": (32, 8, 2),
    "qwen3-moe-decode": (1, 128, 8),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GRAPH_CASES.values(), ids=GRAPH_CASES.keys())
def test_fused_moe_replays_in_a_cuda_graph(case):
    n, e, k = case
    hidden, inter = 256, 512
    w13, w2 = _experts(e, hidden, inter, torch.bfloat16)
    x = _tokens(n, hidden, torch.bfloat16)
    weights, ids = _routing("random", n, e, k)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    new_weights, new_ids = _routing("unchosen", n, e, k, seed=7)
    x.copy_(_tokens(n, hidden, torch.bfloat16, seed=8))
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe(x, w13, w2, weights, ids))
