"""KernelOps: the Triton kernels against the torch implementation, on random inputs.

Without CUDA the Triton kernels run in Triton's interpreter (the repo's conftest.py sets
``TRITON_INTERPRET=1``), which is slow: shapes stay small here; the production-sized
check is the ``gpu`` test at the end.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from specd.kernels.ops import TorchOps
from specd.kernels.ops_choice import get_ops

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TORCH = TorchOps()
TRITON = get_ops("triton")
OPS = [pytest.param(TORCH, id="torch"), pytest.param(TRITON, id="triton")]


def random_parents(gen: torch.Generator, bs: int, t: int) -> torch.Tensor:
    """[bs, t] valid trees: parents[:, i] uniform in [0, i), the root's -1."""
    node = torch.arange(t)
    parents = (torch.rand(bs, t, generator=gen) * node).long()
    parents[:, 0] = -1
    return parents.to(DEVICE)


def chain_parents(bs: int, t: int) -> torch.Tensor:
    return (torch.arange(t) - 1).expand(bs, t).to(DEVICE)  # k = 1: node i's parent is i - 1


def wide_parents(bs: int, t: int) -> torch.Tensor:
    parents = torch.zeros(bs, t, dtype=torch.long)  # every draft is a child of the root
    parents[:, 0] = -1
    return parents.to(DEVICE)


def assert_same_structure(parents: torch.Tensor) -> None:
    ref, got = TORCH.tree_structure(parents), TRITON.tree_structure(parents)
    for field in ("depths", "tree_mask", "next_token", "next_sibling"):
        want, have = getattr(ref, field), getattr(got, field)
        assert have.dtype == want.dtype, field
        assert torch.equal(have, want), field


# -- tree_structure ----------------------------------------------------------------------


@pytest.mark.parametrize("ops", OPS)
def test_tree_structure_worked_example(ops):
    """build_tree's docstring example: r a b c with parents -1 0 0 1."""
    st = ops.tree_structure(torch.tensor([[-1, 0, 0, 1]], device=DEVICE))
    assert st.depths.tolist() == [[0, 1, 1, 2]]
    assert st.next_token.tolist() == [[1, 3, -1, -1]]
    assert st.next_sibling.tolist() == [[-1, 2, -1, -1]]
    assert st.tree_mask.int().tolist() == [[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda g: random_parents(g, 3, 1), id="root-only"),
        pytest.param(lambda g: chain_parents(2, 9), id="chain"),
        pytest.param(lambda g: wide_parents(2, 9), id="wide"),
        pytest.param(lambda g: random_parents(g, 4, 13), id="random-13"),
        pytest.param(lambda g: random_parents(g, 2, 64), id="random-64"),
        pytest.param(lambda g: random_parents(g, 1, 70), id="random-70-row-blocks"),
    ],
)
def test_tree_structure_triton_matches_torch(make):
    assert_same_structure(make(torch.Generator().manual_seed(0)))


# -- greedy_walk -------------------------------------------------------------------------


def walk_both(tokens, parents, target_argmax, num_steps):
    st = TORCH.tree_structure(parents)
    args = (tokens, parents, st.next_token, st.next_sibling, target_argmax, num_steps)
    return TORCH.greedy_walk(*args), TRITON.greedy_walk(*args)


@pytest.mark.parametrize("ops", OPS)
def test_greedy_walk_takes_the_lowest_matching_sibling(ops):
    """Nodes 1 and 2 both carry the root's argmax 5: node 1 wins, then its child 4."""
    parents = torch.tensor([[-1, 0, 0, 0, 1, 2]], device=DEVICE)
    tokens = torch.tensor([[9, 5, 5, 7, 1, 1]], device=DEVICE)
    target_argmax = torch.tensor([[5, 1, 1, 0, 0, 0]], device=DEVICE)
    st = ops.tree_structure(parents)
    for num_steps, last in [(0, 0), (1, 1), (2, 4), (5, 4)]:
        walk = ops.greedy_walk(
            tokens, parents, st.next_token, st.next_sibling, target_argmax, num_steps
        )
        assert walk.tolist() == [last], num_steps


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param("root-only", id="root-only"),
        pytest.param("chain", id="chain"),
        pytest.param("wide", id="wide"),
        pytest.param("random", id="random"),
    ],
)
@pytest.mark.parametrize("num_steps", [0, 1, 3, 16])
def test_greedy_walk_triton_matches_torch(shape, num_steps):
    gen = torch.Generator().manual_seed(num_steps)
    bs, t = 6, 1 if shape == "root-only" else 16
    parents = {
        "chain": lambda: chain_parents(bs, t),
        "wide": lambda: wide_parents(bs, t),
    }.get(shape, lambda: random_parents(gen, bs, t))()
    # two token values: matches and repeated sibling tokens are common
    tokens = torch.randint(2, (bs, t), generator=gen).to(DEVICE)
    target_argmax = torch.randint(2, (bs, t), generator=gen).to(DEVICE)
    ref, got = walk_both(tokens, parents, target_argmax, num_steps)
    assert torch.equal(got, ref)


def test_greedy_walk_full_chain_stops_at_num_steps():
    """Every draft matches: the walk runs to the end of the chain, or num_steps."""
    t = 8
    tokens = torch.arange(t, device=DEVICE)[None]
    target_argmax = tokens + 1  # node i predicts node i + 1's token
    for num_steps in (3, t - 1, t + 2):
        ref, got = walk_both(tokens, chain_parents(1, t), target_argmax, num_steps)
        assert ref.tolist() == got.tolist() == [min(num_steps, t - 1)]


# -- verify_mask ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prefix_lens,t",
    [
        pytest.param([], 4, id="no-requests"),
        pytest.param([0], 1, id="root-only-no-prefix"),
        pytest.param([5, 0, 17], 6, id="ragged"),
        pytest.param([1100, 3], 5, id="row-spans-blocks"),
    ],
)
def test_verify_mask_triton_matches_torch(prefix_lens, t):
    gen = torch.Generator().manual_seed(len(prefix_lens))
    tree_mask = (torch.rand(len(prefix_lens), t, t, generator=gen) < 0.5).to(DEVICE)
    ref = TORCH.verify_mask(tree_mask, prefix_lens)
    assert ref.dtype == torch.bool
    assert ref.numel() == sum(t * (n + t) for n in prefix_lens)
    assert torch.equal(TRITON.verify_mask(tree_mask, prefix_lens), ref)
    if prefix_lens:  # the last request's last row ends with tree_mask[-1, -1]
        assert torch.equal(ref[-t:], tree_mask[-1, -1])


# -- gather_row_slots ---------------------------------------------------------------------


def random_reads(gen, n, num_ranges, num_extras, width, max_len):
    """Random groups of reads: ranges [n, R, 2] (some empty), extras [n, E] (-1 trailing),
    and the host kv_lens."""
    a = torch.randint(width - max_len, (n, num_ranges), generator=gen)
    length = torch.randint(max_len + 1, (n, num_ranges), generator=gen)
    length[torch.rand(n, num_ranges, generator=gen) < 0.25] = 0
    ranges = torch.stack([a, a + length], -1)
    extras = torch.randint(width, (n, num_extras), generator=gen)
    keep = torch.randint(num_extras + 1, (n, 1), generator=gen)
    extras[torch.arange(num_extras)[None, :] >= keep] = -1
    kv_lens = (length.sum(1) + keep[:, 0]).tolist()
    return ranges.to(DEVICE), extras.to(DEVICE), kv_lens


@pytest.mark.parametrize(
    "n,num_ranges,num_extras,max_len",
    [
        pytest.param(0, 1, 0, 4, id="no-groups"),
        pytest.param(5, 1, 0, 40, id="prefix-reads"),
        pytest.param(6, 2, 3, 12, id="branch-reads-with-ancestors"),
        pytest.param(3, 2, 0, 1500, id="groups-span-blocks"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_gather_row_slots_triton_matches_torch(n, num_ranges, num_extras, max_len, dtype):
    gen = torch.Generator().manual_seed(n)
    width = 2 * max_len + 8
    req_to_token = torch.randint(1 << 30, (7, width), generator=gen).to(DEVICE, dtype)
    rows = torch.randint(7, (n,), generator=gen).to(DEVICE)
    ranges, extras, kv_lens = random_reads(gen, n, num_ranges, num_extras, width, max_len)
    ref = TORCH.gather_row_slots(req_to_token, rows, ranges, extras, kv_lens)
    assert ref.dtype == torch.int64 and ref.numel() == sum(kv_lens)
    assert torch.equal(TRITON.gather_row_slots(req_to_token, rows, ranges, extras, kv_lens), ref)


def prefix_slots(req_to_token, rows, kv_lens):
    """Positions [0, kv_len) of each row, concatenated (a plain loop)."""
    parts = [req_to_token[r, :n] for r, n in zip(rows.tolist(), kv_lens, strict=True)]
    return torch.cat(parts).long()


@pytest.mark.parametrize("ops", OPS)
def test_gather_row_slots_prefix_reads(ops):
    """R = 1 from position 0, no extras: the metadata's prefix gather."""
    req_to_token = torch.randperm(4 * 30).view(4, 30).to(DEVICE)
    rows, kv_lens = torch.tensor([2, 0, 3], device=DEVICE), [7, 0, 30]
    ranges = torch.tensor([[[0, n]] for n in kv_lens], device=DEVICE)
    extras = torch.zeros(3, 0, dtype=torch.long, device=DEVICE)
    got = ops.gather_row_slots(req_to_token, rows, ranges, extras, kv_lens)
    assert torch.equal(got, prefix_slots(req_to_token, rows, kv_lens))


# -- move_kv -------------------------------------------------------------------------------


def gather_then_scatter(planes, src, dst):
    out = planes.clone()
    out[:, dst] = planes[:, src]
    return out


def in_order(planes, src, dst):
    out = planes.clone()
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        out[:, d] = out[:, s]
    return out


MOVES = {
    "none": ([], []),
    # accepted path at offsets 0 2 5 7 of two requests: src >= dst, src 2 is a later dst
    "path-compaction": ([2, 5, 7, 12, 13], [1, 2, 3, 11, 12]),
    "src-is-later-dst": ([5, 7], [3, 5]),
    "tail-copies": ([8, 9, 10, 8, 9, 10], [20, 21, 22, 30, 31, 32]),
}


@pytest.mark.parametrize("moves", list(MOVES))
@pytest.mark.parametrize(
    "dtype,features",
    [(torch.float32, 24), (torch.bfloat16, 64), (torch.float16, 1100), (torch.uint8, 5)],
)
def test_move_kv_triton_matches_torch(moves, dtype, features):
    gen = torch.Generator().manual_seed(features)
    planes = (torch.rand(3, 40, features, generator=gen) * 100).to(DEVICE, dtype)
    src, dst = (torch.tensor(x, dtype=torch.long, device=DEVICE) for x in MOVES[moves])
    want = gather_then_scatter(planes, src, dst)
    assert torch.equal(in_order(planes, src, dst), want)  # the contract holds for these
    for ops in (TORCH, TRITON):
        got = planes.clone()
        ops.move_kv(got, src, dst)
        assert torch.equal(got, want), ops.name


def test_move_kv_strided_planes():
    """Planes as a view (every other slot of a bigger buffer): the kernels use the strides."""
    base = torch.arange(2 * 30 * 8, dtype=torch.float32, device=DEVICE).view(2, 30, 8)
    src, dst = torch.tensor([4, 6], device=DEVICE), torch.tensor([1, 2], device=DEVICE)
    want = base.clone()
    want[:, ::2] = gather_then_scatter(base[:, ::2], src, dst)
    got = base.clone()
    TRITON.move_kv(got[:, ::2], src, dst)
    assert torch.equal(got, want)


# -- write_req_to_token --------------------------------------------------------------------


@pytest.mark.parametrize(
    "lens",
    [
        pytest.param([], id="none"),
        pytest.param([3, 0, 5, 1], id="ragged"),
        pytest.param([1500, 2], id="spans-blocks"),
        pytest.param([1, 1, 1], id="a-slot-per-row"),
    ],
)
def test_write_req_to_token_triton_matches_torch(lens):
    gen = torch.Generator().manual_seed(len(lens))
    width, num_rows = 1600, 6
    table = torch.randint(1000, (num_rows, width), generator=gen).to(DEVICE)
    rows = torch.randperm(num_rows, generator=gen)[: len(lens)].to(DEVICE)
    starts = torch.tensor(
        [int(torch.randint(width - n + 1, (), generator=gen)) for n in lens], dtype=torch.long
    )
    slots = torch.randint(1 << 40, (sum(lens),), generator=gen).to(DEVICE)
    want = table.clone()
    for r, s, seg in zip(rows.tolist(), starts.tolist(), slots.split(lens), strict=True):
        want[r, s : s + seg.numel()] = seg
    for ops in (TORCH, TRITON):
        got = table.clone()
        ops.write_req_to_token(got, rows, starts.to(DEVICE), slots, lens)
        assert torch.equal(got, want), ops.name


# -- get_ops -------------------------------------------------------------------------------


def test_get_ops_names_and_errors(monkeypatch):
    assert get_ops("torch").name == "torch" and get_ops("triton").name == "triton"
    with pytest.raises(ValueError, match="choose one of"):
        get_ops("cuda")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    with pytest.raises(RuntimeError, match="triton package"):
        get_ops("triton")


# -- longer sweeps and production sizes ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_random_trees_sweep(seed):
    gen = torch.Generator().manual_seed(seed)
    t = int(torch.randint(2, 130, (), generator=gen))
    parents = random_parents(gen, 4, t)
    assert_same_structure(parents)
    tokens = torch.randint(3, (4, t), generator=gen).to(DEVICE)
    target_argmax = torch.randint(3, (4, t), generator=gen).to(DEVICE)
    ref, got = walk_both(tokens, parents, target_argmax, t)
    assert torch.equal(got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_production_sizes_on_gpu():
    """bs 32, T 64; 32k-token prefixes; a 64 x 200k x 1024 bf16 KV (26 GB: offsets > 2^31)."""
    gen = torch.Generator().manual_seed(0)
    bs, t = 32, 64
    parents = random_parents(gen, bs, t)
    assert_same_structure(parents)
    tokens = torch.randint(4, (bs, t), generator=gen).to(DEVICE)
    target_argmax = torch.randint(4, (bs, t), generator=gen).to(DEVICE)
    ref, got = walk_both(tokens, parents, target_argmax, 8)
    assert torch.equal(got, ref)

    prefix_lens = torch.randint(1, 32_768, (bs,), generator=gen).tolist()
    tree_mask = TORCH.tree_structure(parents).tree_mask
    assert torch.equal(
        TRITON.verify_mask(tree_mask, prefix_lens), TORCH.verify_mask(tree_mask, prefix_lens)
    )

    req_to_token = torch.randint(200_000, (bs, 33_000), generator=gen).to(DEVICE)
    ranges = torch.tensor([[[0, n]] for n in prefix_lens], device=DEVICE)
    extras = torch.zeros(bs, 0, dtype=torch.long, device=DEVICE)
    rows = torch.arange(bs, device=DEVICE)
    assert torch.equal(
        TRITON.gather_row_slots(req_to_token, rows, ranges, extras, prefix_lens),
        prefix_slots(req_to_token, rows, prefix_lens),
    )

    planes = torch.empty(64, 200_000, 1024, dtype=torch.bfloat16, device=DEVICE)
    src = torch.tensor([199_990, 199_995, 199_999, 3], device=DEVICE)
    dst = torch.tensor([199_980, 199_990, 199_995, 199_998], device=DEVICE)
    planes[:, src] = torch.randn(64, 4, 1024, device=DEVICE).to(torch.bfloat16)
    want = planes[:, src].clone()
    TRITON.move_kv(planes, src, dst)
    assert torch.equal(planes[:, dst], want)
