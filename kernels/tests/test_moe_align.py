"""Pairs sorted by expert into tiles (``moe_align``): the torch reference's invariants,
the one-launch Triton kernel equal to it array for array (on CPU through Triton's
interpreter), capture and replay with a new routing, and the same on a GPU."""

import pytest
import torch

pytest.importorskip("triton")

from specd.kernels import moe_align  # noqa: E402
from specd.kernels.emulated_graph import EmulatedGraph  # noqa: E402
from specd.kernels.moe_align import (  # noqa: E402
    align_pairs,
    align_pairs_by_expert,
    align_pairs_by_expert_triton,
    max_padded_pairs,
    one_launch_fits,
)
from specd.kernels.triton_backend import triton_devices  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

if DEVICE == "cpu" and DEVICE not in triton_devices():
    pytest.skip("Triton on CPU needs TRITON_INTERPRET=1", allow_module_level=True)


def _expert_ids(kind: str, n: int, e: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, k] int64 on DEVICE.  ``random``: k distinct experts a token, as a router picks;
    ``unchosen``: the same from all but the last two experts (and the first stays out too,
    when k leaves room); ``one-expert``: every pair to expert ``e // 2`` (no router does
    this; the alignment takes it)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "one-expert":
        return torch.full((n, k), e // 2, dtype=torch.int64, device=DEVICE)
    choosable = list(range(1 if e - 3 >= k else 0, e - 2)) if kind == "unchosen" else list(range(e))
    picks = torch.rand(n, len(choosable), generator=g).argsort(dim=1)[:, :k]
    return torch.tensor(choosable)[picks].to(DEVICE)


def _assert_same_alignment(got, want) -> None:
    for field in ("sorted_pair_ids", "block_expert", "num_used_blocks"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and a.shape == b.shape, field
        assert torch.equal(a, b), f"{field}: {a.tolist()} != {b.tolist()}"
    assert got.block_m == want.block_m


INVARIANT_CASES = {  # (N, E, k, kind)
    "one-token": (1, 4, 1, "random"),
    "random": (17, 8, 2, "random"),
    "unchosen-experts": (9, 8, 2, "unchosen"),
    "one-expert": (21, 4, 1, "one-expert"),
}


@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize("case", INVARIANT_CASES.values(), ids=INVARIANT_CASES.keys())
def test_alignment_puts_every_pair_once_in_tiles_of_one_expert(case, block_m):
    n, e, k, kind = case
    ids = _expert_ids(kind, n, e, k)
    num_pairs = n * k
    aligned = align_pairs_by_expert(ids, e, block_m)
    max_padded = max_padded_pairs(num_pairs, e, block_m)
    assert aligned.sorted_pair_ids.shape == (max_padded,)  # static: from the sizes alone
    assert aligned.block_expert.shape == (max_padded // block_m,)
    sorted_ids = aligned.sorted_pair_ids.cpu()
    assert sorted(sorted_ids[sorted_ids < num_pairs].tolist()) == list(range(num_pairs))
    assert (sorted_ids[sorted_ids >= num_pairs] == num_pairs).all()  # pads: the sentinel
    expert_of_pair = ids.reshape(-1).cpu()
    block_expert = aligned.block_expert.cpu().tolist()
    used = int(aligned.num_used_blocks.item())
    assert all(x >= 0 for x in block_expert[:used]) and set(block_expert[used:]) <= {-1}
    assert block_expert[:used] == sorted(block_expert[:used])  # experts in order
    for tile, expert in zip(sorted_ids.view(-1, block_m), block_expert, strict=True):
        real = tile[tile < num_pairs]
        if expert < 0:
            assert real.numel() == 0
            continue
        assert real.numel() > 0 and (expert_of_pair[real] == expert).all()
        assert torch.equal(tile[: real.numel()], real)  # pads only after a run's pairs
        assert real.tolist() == sorted(real.tolist())  # pair order within a run
    counts = torch.bincount(expert_of_pair, minlength=e).tolist()
    for expert, count in enumerate(counts):
        assert block_expert.count(expert) == -(-count // block_m)


@pytest.mark.parametrize("align", [align_pairs_by_expert, align_pairs_by_expert_triton])
def test_alignment_worked_example(align):
    """The example in ``moe_align``'s docstring."""
    ids = torch.tensor([[2, 0], [0, 2], [2, 1]], device=DEVICE)
    aligned = align(ids, 3, 4)
    pad = 6
    assert (
        aligned.sorted_pair_ids.tolist()
        == [1, 2, pad, pad, 5, pad, pad, pad, 0, 3, 4, pad] + [pad] * 4
    )
    assert aligned.block_expert.tolist() == [0, 1, 2, -1]
    assert aligned.num_used_blocks.tolist() == [3]


EXACT_CASES = {  # (N, k, E, block_m, kind)
    "qwen3-moe-decode": (1, 8, 128, 16, "random"),
    "qwen3-moe-300-tokens": (300, 8, 128, 16, "random"),
    # 36000 pairs: several counting and placing steps (wider in the interpreter than on a
    # GPU), each carrying the counts before it
    "many-steps": (9000, 4, 4, 64, "random"),
    "large-tiles": (40, 2, 8, 64, "random"),
    "unchosen-experts": (9, 2, 8, 4, "unchosen"),
    "all-to-one-expert": (33, 4, 16, 16, "one-expert"),
    "one-pair": (1, 1, 4, 16, "random"),
    "experts-not-a-power-of-two": (7, 3, 12, 4, "random"),
    "no-tokens": (0, 8, 16, 16, "random"),
}


@pytest.mark.parametrize("case", EXACT_CASES.values(), ids=EXACT_CASES.keys())
def test_triton_alignment_equals_the_torch_alignment(case):
    n, k, e, block_m, kind = case
    ids = _expert_ids(kind, n, e, k)
    want = align_pairs_by_expert(ids, e, block_m)
    _assert_same_alignment(align_pairs_by_expert_triton(ids, e, block_m), want)


def test_triton_alignment_refuses_a_tile_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        align_pairs_by_expert_triton(_expert_ids("random", 2, 4, 2), 4, 12)


def test_triton_alignment_replays_in_an_emulated_graph_with_new_routing():
    """One launch, no host reads, every output slot written: a replay over new routing in
    the same buffer gives the new routing's alignment, not stale or uninitialized slots."""
    n, e, k, block_m = 6, 8, 2, 4
    ids = _expert_ids("random", n, e, k)
    graph = EmulatedGraph()
    with torch.inference_mode(), graph.capture():
        aligned = align_pairs_by_expert_triton(ids, e, block_m)
    ids.copy_(_expert_ids("one-expert", n, e, k))
    graph.replay()
    _assert_same_alignment(aligned, align_pairs_by_expert(ids, e, block_m))
    ids.copy_(_expert_ids("unchosen", n, e, k, seed=3))
    graph.replay()
    _assert_same_alignment(aligned, align_pairs_by_expert(ids, e, block_m))


FIT_CASES = {  # (pairs, experts, one launch?)
    "qwen3-moe-decode": (1 * 8, 128, True),
    "qwen3-moe-verify-32x8": (32 * 8 * 8, 128, True),
    "qwen3-moe-prefill-4096": (4096 * 8, 128, False),
    "512-experts-decode": (8 * 10, 512, True),
    "512-experts-verify-64": (64 * 10, 512, False),
    "mixtral-prefill-8192": (8192 * 2, 8, True),
    "the-largest-at-128-experts": (2048, 128, True),
    "one-more": (2049, 128, False),
}


@pytest.mark.parametrize("case", FIT_CASES.values(), ids=FIT_CASES.keys())
def test_one_launch_takes_decode_and_verify_batches_not_large_prefills(case):
    num_pairs, num_experts, fits = case
    assert one_launch_fits(num_pairs, num_experts) is fits


def test_align_pairs_off_cuda_is_the_torch_alignment():
    ids = _expert_ids("random", 5, 8, 2)
    if ids.is_cuda:
        pytest.skip("the CPU dispatch")
    _assert_same_alignment(align_pairs(ids, 8, 16), align_pairs_by_expert(ids, 8, 16))


GPU_CASES = {  # (N, k, E, block_m, kind)
    "qwen3-moe-decode": (1, 8, 128, 16, "random"),
    "qwen3-moe-verify": (32, 8, 128, 16, "random"),
    "qwen3-moe-prefill-tiles": (300, 8, 128, 64, "random"),
    "many-counting-steps": (4096, 8, 128, 64, "random"),
    "512-experts-decode": (1, 10, 512, 16, "random"),
    "512-experts-verify": (64, 10, 512, 16, "random"),
    "mixtral": (17, 2, 8, 16, "random"),
    "unchosen-experts": (50, 8, 128, 16, "unchosen"),
    "all-to-one-expert": (50, 8, 128, 16, "one-expert"),
    "no-tokens": (0, 8, 128, 16, "random"),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_triton_alignment_equals_the_torch_alignment_on_cuda(case):
    n, k, e, block_m, kind = case
    ids = _expert_ids(kind, n, e, k)
    want = align_pairs_by_expert(ids, e, block_m)
    _assert_same_alignment(align_pairs_by_expert_triton(ids, e, block_m), want)
    _assert_same_alignment(align_pairs_by_expert_triton(ids.int(), e, block_m), want)


@pytest.mark.gpu
@needs_cuda
def test_align_pairs_takes_the_one_launch_at_decode_on_cuda(monkeypatch):
    def torch_ops(*args):
        raise AssertionError("the torch alignment ran")

    ids = _expert_ids("random", 4, 128, 8)
    want = align_pairs_by_expert(ids, 128, 16)
    monkeypatch.setattr(moe_align, "align_pairs_by_expert", torch_ops)
    _assert_same_alignment(align_pairs(ids, 128, 16), want)


def _graph_of(body) -> tuple[torch.cuda.CUDAGraph, object]:
    body()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    return graph, out


def _replay_us(graph: torch.cuda.CUDAGraph, replays: int = 200) -> float:
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays


REPLAY_CASES = {  # (N, k, E, block_m)
    "qwen3-moe-decode": (1, 8, 128, 16),
    "largest-one-launch-at-128-experts": (256, 8, 128, 64),
    "largest-one-launch-at-512-experts": (12, 10, 512, 16),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", REPLAY_CASES.values(), ids=REPLAY_CASES.keys())
def test_triton_alignment_replays_in_a_cuda_graph_with_new_routing(case):
    """Captured, a replay with new routing gives the new alignment: at Qwen3-30B-A3B's
    batch 1, and at the largest batches ``align_pairs`` gives it.  The replay times of
    both versions are printed (``-rP``), not asserted: if the one launch is not the
    faster at the cutoffs, lower ONE_LAUNCH_MAX_COMPARISONS."""
    n, k, e, block_m = case
    assert one_launch_fits(n * k, e)
    ids = _expert_ids("random", n, e, k)
    triton_graph, aligned = _graph_of(lambda: align_pairs_by_expert_triton(ids, e, block_m))
    torch_graph, _ = _graph_of(lambda: align_pairs_by_expert(ids, e, block_m))
    ids.copy_(_expert_ids("random", n, e, k, seed=9))
    triton_graph.replay()
    _assert_same_alignment(aligned, align_pairs_by_expert(ids, e, block_m))
    triton_us, torch_us = _replay_us(triton_graph), _replay_us(torch_graph)
    print(
        f"alignment replay, N {n} top-{k} E {e}: triton {triton_us:.1f} us, torch {torch_us:.1f} us"
    )
