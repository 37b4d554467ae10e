"""The torch reference backend against dense per-request attention."""

import math

import pytest
import torch

from specd.kernels import build_attention_metadata, get_backend, resolve_backend_name
from specd.kernels.testing import dense_attention, make_case


@pytest.mark.parametrize(
    "qo_lens,kv_lens",
    [
        pytest.param([1, 1, 1], [5, 9, 1], id="decode"),
        pytest.param([1, 1], [6, 6], id="decode-equal-lengths-unmasked"),
        pytest.param([1, 4, 1], [8, 5, 8], id="mixed-equal-decode-lengths"),
        pytest.param([7, 3], [7, 10], id="prefill-with-cached-prefix"),
        pytest.param([1, 6, 1, 4], [12, 6, 3, 9], id="mixed"),
    ],
)
def test_causal_matches_dense(qo_lens, kv_lens):
    q, k_buf, v_buf, r2t = make_case(qo_lens, kv_lens)
    meta = build_attention_metadata(r2t, list(range(len(kv_lens))), qo_lens, kv_lens)
    scale = 1 / math.sqrt(q.shape[-1])
    backend = get_backend("torch")
    out = backend.forward(q, k_buf, v_buf, backend.plan(meta), scale)
    start = 0
    for i, (ql, kl) in enumerate(zip(qo_lens, kv_lens, strict=True)):
        slots = r2t[i, :kl]
        mask = torch.arange(kl)[None, :] <= torch.arange(kl - ql, kl)[:, None]
        ref = dense_attention(q[start : start + ql], k_buf[slots], v_buf[slots], mask, scale)
        torch.testing.assert_close(out[start : start + ql], ref, atol=1e-5, rtol=1e-5)
        start += ql


@pytest.mark.parametrize(
    "qo_lens,kv_lens",
    [
        pytest.param([5], [9], id="one-request-alone"),
        pytest.param([3, 1], [6, 4], id="two-padded-into-one-batch"),
        pytest.param([6, 1, 4, 6, 2], [20, 9, 13, 30, 2], id="ragged-verify-batch"),
        pytest.param([4, 4, 4], [11, 11, 11], id="equal-shapes"),
    ],
)
def test_custom_mask_is_used_as_given(qo_lens, kv_lens):
    """Tree masks (random here, each query seeing the first position at least), alone or
    several requests padded into one batch, against dense attention per request."""
    q, k_buf, v_buf, r2t = make_case(qo_lens, kv_lens, seed=1)
    g = torch.Generator().manual_seed(2)
    masks = [torch.rand(ql, kl, generator=g) > 0.4 for ql, kl in zip(qo_lens, kv_lens, strict=True)]
    for m in masks:
        m[:, 0] = True
    flat = torch.cat([m.flatten() for m in masks])
    rows = list(range(len(qo_lens)))
    meta = build_attention_metadata(r2t, rows, qo_lens, kv_lens, custom_mask=flat)
    backend = get_backend("torch")
    plan = backend.plan(meta)
    assert (plan.masked is not None) == (len(qo_lens) > 1)
    out = backend.forward(q, k_buf, v_buf, plan, 0.3)
    refs, start = [], 0
    for i, (ql, kl) in enumerate(zip(qo_lens, kv_lens, strict=True)):
        slots = r2t[i, :kl]
        refs.append(
            dense_attention(q[start : start + ql], k_buf[slots], v_buf[slots], masks[i], 0.3)
        )
        start += ql
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=1e-5)


def test_backend_resolution_names_the_field():
    assert resolve_backend_name("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="spec.attentionBackend.*available"):
        resolve_backend_name("nope", "cpu")


def test_metadata_reads_each_requests_row_prefix_in_batch_order():
    r2t = torch.arange(40).view(4, 10)
    meta = build_attention_metadata(r2t, [2, 0, 3], [1, 2, 1], [3, 4, 1])
    assert meta.kv_indices.tolist() == [20, 21, 22, 0, 1, 2, 3, 30]
    assert meta.kv_indices.dtype == torch.int64
    assert meta.qo_indptr.tolist() == [0, 1, 3, 4] and meta.kv_indptr.tolist() == [0, 3, 7, 8]
    empty = build_attention_metadata(r2t, [], [], [])
    assert empty.batch_size == 0 and empty.kv_indices.numel() == 0
    with pytest.raises(ValueError, match="one entry per request"):
        build_attention_metadata(r2t, [0, 1], [1], [1])


def test_query_longer_than_kv_is_refused():
    with pytest.raises(ValueError, match="exceeds kv length"):
        build_attention_metadata(torch.zeros(1, 4, dtype=torch.int64), [0], [3], [2])
