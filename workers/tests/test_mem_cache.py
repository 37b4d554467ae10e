"""KV sizing rules, the paged allocator and per-request KV bookkeeping."""

import pytest
import torch

from specd.devtools.testing import RecordingOps
from specd.workers.mem_cache.allocator import PagedTokenAllocator
from specd.workers.mem_cache.kv_manager import KVManager, RequestKV, RowWidthExceeded
from specd.workers.mem_cache.req_to_token import ReqToTokenPool
from specd.workers.mem_cache.sizing import (
    SpecShape,
    alloc_len_per_decode,
    alloc_reserve_per_decode,
    ceil_page,
    extra_context_len,
    row_width,
)


@pytest.mark.parametrize(
    "spec,page,alloc,reserve,extra",
    [
        pytest.param(None, 1, 1, 2, 4, id="no-spec"),
        pytest.param(None, 16, 1, 2, 4, id="no-spec-paged"),
        pytest.param(SpecShape(3, 1, 4), 1, 4, 8, 8, id="chain-P1"),
        pytest.param(SpecShape(5, 8, 32), 1, 40, 80, 80, id="tree-P1"),
        pytest.param(SpecShape(5, 8, 32), 64, 1024, 2048, 2048, id="seed000-P64-k8-S5-T32"),
        pytest.param(SpecShape(3, 4, 8), 4, 32, 64, 64, id="tree-P4"),
        pytest.param(SpecShape(3, 1, 4), 16, 4, 8, 8, id="chain-P16"),
    ],
)
def test_sizing_worked_examples(spec, page, alloc, reserve, extra):
    assert alloc_len_per_decode(spec, page) == alloc
    assert alloc_reserve_per_decode(spec, page) == reserve
    assert extra_context_len(spec, page) == extra
    assert extra_context_len(spec, page) >= alloc_reserve_per_decode(spec, page) or spec is None


def test_row_width_is_page_aligned_and_covers_headroom():
    assert row_width(100, None, 16) == 112
    assert row_width(100, SpecShape(5, 8, 32), 64) == ceil_page(100 + 2048, 64)


def make_manager(pages=8, page_size=4, rows=3, width=40):
    return KVManager(ReqToTokenPool(rows, width), PagedTokenAllocator(pages, page_size))


def test_grow_maps_positions_to_page_slots():
    m = make_manager()
    kv = RequestKV()
    assert m.grow(kv, 6)
    assert len(kv.pages) == 2 and kv.allocated == 6
    slots = m.slots(kv, 0, 6)
    assert slots.tolist() == [kv.pages[0] * 4 + i for i in range(4)] + [
        kv.pages[1] * 4 + i for i in range(2)
    ]
    assert m.grow(kv, 8)  # fills the partial page without a new one
    assert len(kv.pages) == 2
    m.check_integrity()


def test_free_tail_rounds_up_to_page_boundary():
    m = make_manager()
    kv = RequestKV()
    m.grow(kv, 11)  # 3 pages
    kv.committed = 5
    m.free_tail(kv, 5)  # keeps ceil_page(5) = 8 positions -> 2 pages
    assert len(kv.pages) == 2 and kv.allocated == 5
    assert m.allocator.used_tokens == 8
    m.check_integrity()
    m.release(kv)
    assert m.allocator.used_tokens == 0 and kv.row is None
    m.check_integrity()


def test_exhaustion_returns_false_and_changes_nothing():
    m = make_manager(pages=2)
    a, b = RequestKV(), RequestKV()
    assert m.grow(a, 8)
    assert not m.grow(b, 1)
    assert b.row is None and b.pages == [] and m.req_pool.num_free == 2
    m.check_integrity()


def test_row_width_overflow_is_a_clear_error():
    m = make_manager(width=12)
    with pytest.raises(RowWidthExceeded, match="12 wide"):
        m.grow(RequestKV(), 13)


def test_integrity_catches_a_leaked_page():
    m = make_manager()
    m.grow(RequestKV(), 4)
    m._live.clear()  # forget the holder: its page is now leaked
    with pytest.raises(AssertionError, match="leak"):
        m.check_integrity()


def test_double_free_is_refused():
    alloc = PagedTokenAllocator(4, 2)
    pages = alloc.alloc_pages(2)
    alloc.free(pages)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(pages[:1])


def test_req_to_token_is_int64_table_with_a_pad_row():
    pool = ReqToTokenPool(2, 8, pad_slot=99)
    assert pool.req_to_token.dtype == torch.int64 and pool.req_to_token.shape == (3, 8)
    assert pool.pad_row == 2 and pool.req_to_token[2].tolist() == [99] * 8
    assert sorted(pool.alloc() for _ in range(2)) == [0, 1] and pool.alloc() is None


def recording_manager(**kw):
    m = make_manager(**kw)
    m.ops = RecordingOps()
    return m


def test_batched_writes_go_out_as_one_op_at_the_end():
    m, eager = recording_manager(pages=16), make_manager(pages=16)
    kvs, eager_kvs = [RequestKV() for _ in range(3)], [RequestKV() for _ in range(3)]
    before = m.req_pool.req_to_token.clone()
    with m.batched_writes():
        with m.batched_writes():  # re-entrant: the outer one writes
            for kv, n in zip(kvs, (5, 1, 9), strict=True):
                assert m.grow(kv, n)
        assert m.ops.writes == []
        assert torch.equal(m.req_pool.req_to_token, before)  # nothing written yet
    assert len(m.ops.writes) == 1 and len(m.ops.writes[0]) == 15
    for kv, n in zip(eager_kvs, (5, 1, 9), strict=True):
        eager.grow(kv, n)
    assert torch.equal(m.req_pool.req_to_token, eager.req_pool.req_to_token)
    m.grow(kvs[1], 2)  # outside: at once
    assert len(m.ops.writes) == 2 and m.slots(kvs[1], 1, 2).item() == kvs[1].pages[0] * 4 + 1


@pytest.mark.parametrize("free", ["release", "free_tail"])
def test_positions_freed_and_regrown_in_one_batch_are_written_once(free):
    """A batch that frees positions and grows them again (a retraction and an admission
    reusing the row, or a trimmed tail grown back) writes each position once, with the
    new slot: one op with a position twice would leave either value on a GPU."""
    m = recording_manager(pages=16, rows=1)
    first, second = RequestKV(), RequestKV()
    with m.batched_writes():
        m.grow(first, 11)
        if free == "release":
            m.release(first)
            m.grow(second, 7)  # the only row again
            owner, end = second, 7
        else:
            first.committed = 5
            m.free_tail(first, 5)  # keeps 2 pages: positions 5..7 keep their slots
            m.allocator.alloc_pages(1)  # the freed page goes elsewhere
            m.grow(first, 11)
            owner, end = first, 11
    (pairs,) = m.ops.writes
    assert len(pairs) == len(set(pairs))
    expected = [owner.pages[p // 4] * 4 + p % 4 for p in range(end)]
    assert m.slots(owner, 0, end).tolist() == expected
