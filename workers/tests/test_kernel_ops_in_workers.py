"""The workers' speculative code on ``specd.kernels.ops``: the same results with the torch
and the Triton implementation, and with plain-Python references of each rule.

Tree structure, the greedy verify, the verify mask, a draft step's KV reads, request-row
writes and the accepted-path KV moves, on random trees and batches.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from specd.kernels.metadata import build_metadata_from_slots
from specd.kernels.ops import TORCH_OPS
from specd.kernels.ops_choice import get_ops
from specd.workers.mem_cache.allocator import PagedTokenAllocator
from specd.workers.mem_cache.kv_manager import KVManager, RequestKV
from specd.workers.mem_cache.req_to_token import ReqToTokenPool
from specd.workers.speculative.draft_loop import DraftInputs, grow_ancestors
from specd.workers.speculative.layout import TreeLayout
from specd.workers.speculative.tree import (
    DraftTree,
    build_tree,
    expand_step,
    first_step,
    tree_attention_mask_for_verify,
)
from specd.workers.speculative.verify import accepted_path_positions, verify_greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(
    params=[
        "torch",
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("triton") is None, reason="triton not installed"
            ),
        ),
    ]
)
def ops(request):
    return get_ops(request.param)


def random_parents(gen: torch.Generator, bs: int, t: int) -> torch.Tensor:
    parents = (torch.rand(bs, t, generator=gen) * torch.arange(t)).long()
    parents[:, 0] = -1
    return parents


def random_tree(gen, bs, t, vocab, ops=TORCH_OPS) -> DraftTree:
    """Parents uniform in [0, i); a small vocab makes matches and repeated siblings common."""
    parents = random_parents(gen, bs, t)
    tokens = torch.randint(vocab, (bs, t), generator=gen)
    return DraftTree.from_parents(tokens.to(DEVICE), parents.to(DEVICE), ops=ops)


def drafted_tree(gen, bs, k, steps, t, vocab, ops=TORCH_OPS) -> DraftTree:
    """A tree as the drafter builds it: top-k steps, best T-1 nodes, parents first."""
    step = first_step(torch.log_softmax(2 * torch.randn(bs, vocab, generator=gen), -1), k)
    out = [step]
    for _ in range(steps - 1):
        child = torch.log_softmax(2 * torch.randn(bs, k, vocab, generator=gen), -1)
        out.append(expand_step(out[-1], child, k))
    tree = build_tree(torch.randint(vocab, (bs,), generator=gen), out, t)
    return DraftTree.from_parents(tree.tokens.to(DEVICE), tree.parents.to(DEVICE), steps, ops)


TREES = [
    pytest.param(lambda g, o: random_tree(g, 3, 1, 2, o), id="root-only"),
    pytest.param(lambda g, o: random_tree(g, 4, 12, 2, o), id="random"),
    pytest.param(lambda g, o: random_tree(g, 2, 64, 3, o), id="random-64"),
    pytest.param(lambda g, o: drafted_tree(g, 3, 1, 5, 6, 3, o), id="chain"),
    pytest.param(lambda g, o: drafted_tree(g, 3, 4, 4, 16, 4, o), id="drafted-topk4"),
    pytest.param(lambda g, o: drafted_tree(g, 2, 8, 2, 17, 8, o), id="drafted-wide"),
]


def python_structure(parents: list[int]):
    """Depths, ancestor-or-self sets, first child, next sibling by plain loops."""
    t = len(parents)
    depths, ancestors = [0] * t, [{i} for i in range(t)]
    for i in range(1, t):
        depths[i] = depths[parents[i]] + 1
        ancestors[i] |= ancestors[parents[i]]
    first_child = [next((j for j in range(t) if parents[j] == i), -1) for i in range(t)]
    sibling = [next((j for j in range(i + 1, t) if parents[j] == parents[i]), -1) for i in range(t)]
    return depths, ancestors, first_child, sibling


@pytest.mark.parametrize("make", TREES)
def test_draft_tree_structure_is_the_python_rule(ops, make):
    tree = make(torch.Generator().manual_seed(0), ops)
    for b, parents in enumerate(tree.parents.tolist()):
        depths, ancestors, first_child, sibling = python_structure(parents)
        assert tree.depths[b].tolist() == depths
        t = len(parents)
        assert tree.tree_mask[b].tolist() == [
            [j in ancestors[i] for j in range(t)] for i in range(t)
        ]
        assert tree.retrieve_next_token[b].tolist() == first_child
        assert tree.retrieve_next_sibling[b].tolist() == sibling


def python_greedy_last(tokens: list[int], parents: list[int], argmax: list[int], steps: int):
    """The last accepted node: the lowest-index child matching the argmax, step by step."""
    cur = 0
    for _ in range(steps):
        match = [c for c in range(len(parents)) if parents[c] == cur and tokens[c] == argmax[cur]]
        if not match:
            break
        cur = match[0]
    return cur


@pytest.mark.parametrize("make", TREES)
@pytest.mark.parametrize("seed", range(3))
def test_verify_greedy_is_the_python_walk(ops, make, seed):
    gen = torch.Generator().manual_seed(seed)
    tree = make(gen, ops)
    vocab = int(tree.tokens.max()) + 1
    target_argmax = torch.randint(vocab, tree.tokens.shape, generator=gen).to(DEVICE)
    result = verify_greedy(tree, target_argmax, ops)
    last = result.accept_index.gather(1, result.accept_len[:, None])[:, 0]
    want = [
        python_greedy_last(tok, par, am, tree.num_steps)
        for tok, par, am in zip(
            tree.tokens.tolist(), tree.parents.tolist(), target_argmax.tolist(), strict=True
        )
    ]
    assert last.tolist() == want
    assert torch.equal(result.bonus_tokens, target_argmax.gather(1, last[:, None])[:, 0])


@pytest.mark.parametrize("prefix_lens", [[0, 3, 40], [1100, 7, 0]])
def test_verify_mask_is_prefix_then_tree(ops, prefix_lens):
    tree = random_tree(torch.Generator().manual_seed(2), len(prefix_lens), 9, 2, ops)
    parts = [
        torch.cat([torch.ones(9, n, dtype=torch.bool, device=DEVICE), tree.tree_mask[b]], 1)
        for b, n in enumerate(prefix_lens)
    ]
    got = tree_attention_mask_for_verify(tree, prefix_lens, ops)
    assert torch.equal(got, torch.cat([p.flatten() for p in parts]))


@pytest.mark.parametrize(
    "page_size,topk", [pytest.param(1, 3, id="flat"), pytest.param(4, 3, id="paged")]
)
def test_draft_step_reads_are_prefix_then_ancestors(ops, page_size, topk):
    """The draft loop's reads (``DraftInputs`` ranges and lengths, ``grow_ancestors``'s
    device lists, gathered eagerly and into a graph's buffer) against slot lists built by
    host loops: each node reads its branch's prefix ranges, then its ancestors' draft
    rows and its own (one per step so far); it writes at its own."""
    gen = torch.Generator().manual_seed(page_size)
    num_steps, width = 4, 160
    layout = TreeLayout(page_size, topk, num_steps)
    roots = [1, 13, 46]
    bs = len(roots)
    table = torch.randperm(bs * width, generator=gen).view(bs, width).to(DEVICE)
    ints, kv_lens = DraftInputs.pack(layout, list(range(bs)), roots, [0] * bs)
    x = DraftInputs.view(torch.tensor(ints, device=DEVICE), layout, bs, None, None, kv_lens)
    node_rows = x.rows.repeat_interleave(topk)
    host_lists: list[list[list[int]]] = [[[] for _ in range(topk)] for _ in roots]
    device_lists = torch.zeros(bs, topk, 0, dtype=torch.long, device=DEVICE)
    for s in range(1, num_steps):
        parents = torch.randint(topk, (bs, topk), generator=gen)
        host_lists = [
            [anc[p if s > 1 else 0] + [layout.node_position(root, s, j)] for j, p in enumerate(ps)]
            for anc, root, ps in zip(host_lists, roots, parents.tolist(), strict=True)
        ]
        device_lists = grow_ancestors(device_lists, parents.to(DEVICE), x.own[s - 1])
        slot_lists, writes = [], []
        for b, (root, anc) in enumerate(zip(roots, host_lists, strict=True)):
            for j in range(topk):
                prefix = [table[b, a:e] for a, e in layout.prefix_ranges(root, j)]
                slot_lists.append(torch.cat([*prefix, table[b, anc[j]]]))
                writes.append(int(table[b, anc[j][-1]]))
        want = build_metadata_from_slots(slot_lists, [1] * len(slot_lists))
        assert x.kv_lens[s - 1] == list(want.kv_lens), s
        extras = device_lists.view(bs * topk, s)
        args = (table, node_rows, x.ranges[s - 1], extras)
        assert torch.equal(ops.gather_row_slots(*args, x.kv_lens[s - 1]), want.kv_indices), s
        into = torch.full((bs * topk * width,), -1, dtype=torch.long, device=DEVICE)
        ops.gather_row_slots_into(into, x.kv_indptr[s - 1], *args, width)
        assert torch.equal(into[: want.kv_indices.numel()], want.kv_indices), s
        assert table[node_rows, device_lists[:, :, -1].flatten()].tolist() == writes


def test_kv_manager_rows_are_the_page_rule(ops):
    """Position p of a request lives in slot ``pages[p // P] * P + p % P``, written by the
    ops over several interleaved grows."""
    gen = torch.Generator().manual_seed(3)
    page = 4
    m = KVManager(ReqToTokenPool(5, 48, DEVICE), PagedTokenAllocator(60, page), ops)
    kvs = [RequestKV() for _ in range(4)]
    for _ in range(3):  # interleaved growth: pages of different requests alternate
        for kv in kvs:
            assert m.grow(kv, min(48, kv.allocated + int(torch.randint(0, 15, (), generator=gen))))
        for kv in kvs:
            want = [kv.pages[p // page] * page + p % page for p in range(kv.allocated)]
            assert m.slots(kv, 0, kv.allocated).tolist() == want
    m.check_integrity()


def test_padded_accepted_path_moves_equal_the_needed_ones(ops):
    """The decoder's sync-free moves (every depth, unused ones onto the root itself) leave
    the KV as the gather-then-scatter of only the needed moves does."""
    gen = torch.Generator().manual_seed(4)
    roots, width = [3, 10, 21], 40
    tree = drafted_tree(gen, len(roots), 2, 4, 8, 2, ops)
    result = verify_greedy(tree, torch.randint(2, tree.tokens.shape, generator=gen).to(DEVICE))
    moves = accepted_path_positions(result)
    table = torch.randperm(128, generator=gen)[: len(roots) * width].view(len(roots), width)
    table, base = table.to(DEVICE), torch.tensor(roots, device=DEVICE)
    planes = torch.randn(6, 128, 8, generator=gen).to(DEVICE)

    want = planes.clone()
    b, src, dst = moves.needed()
    assert src.numel()  # the case really moves something
    want[:, table[b, base[b] + dst]] = want[:, table[b, base[b] + src]]

    src, dst = moves.padded()
    rows = torch.arange(len(roots), device=DEVICE)[:, None]
    ops.move_kv(
        planes,
        table[rows, base[:, None] + src].flatten(),
        table[rows, base[:, None] + dst].flatten(),
    )
    assert torch.equal(planes, want)
