"""The ``cpu`` backend's C kernel against the torch reference and dense attention: decode,
mixed prefill, tree masks, GQA ratios, bfloat16, strided queries, bad indices, and a
machine without a C compiler."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from specd.kernels import build_attention_metadata, get_backend
from specd.kernels.cpu_attention import MAX_QUERIES, paged_attention
from specd.kernels.testing import dense_attention, make_case


def both_backends(q, k_buf, v_buf, meta, scale):
    cpu, ref = get_backend("cpu"), get_backend("torch")
    return (
        cpu.forward(q, k_buf, v_buf, cpu.plan(meta), scale),
        ref.forward(q, k_buf, v_buf, ref.plan(meta), scale),
    )


@pytest.mark.parametrize(
    "qo_lens,kv_lens,heads,kv_heads",
    [
        pytest.param([1] * 3, [5, 9, 1], 4, 2, id="decode-few-requests"),
        pytest.param([1] * 12, [3 + 7 * i for i in range(12)], 8, 2, id="decode-whole-requests"),
        pytest.param([1] * 9, [40] * 9, 4, 4, id="decode-no-gqa"),
        pytest.param([1, 6, 1, 4], [12, 6, 3, 9], 8, 1, id="mixed-short-queries"),
        pytest.param([1, 70, 1], [20, 90, 5], 4, 2, id="a-prefill-chunk-beside-decodes"),
    ],
)
def test_causal_matches_the_torch_reference(qo_lens, kv_lens, heads, kv_heads):
    q, k_buf, v_buf, r2t = make_case(qo_lens, kv_lens, heads, kv_heads, dim=16, slots=800)
    meta = build_attention_metadata(r2t, list(range(len(kv_lens))), qo_lens, kv_lens)
    out, ref = both_backends(q, k_buf, v_buf, meta, 1 / math.sqrt(16))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert get_backend("cpu").plan(meta).extends == () or max(qo_lens) > MAX_QUERIES


@pytest.mark.parametrize(
    "qo_lens,kv_lens",
    [
        pytest.param([5], [9], id="one-tree"),
        pytest.param([6, 1, 4, 6, 2], [20, 9, 13, 30, 2], id="ragged-verify-batch"),
        pytest.param([6] * 10, [33] * 10, id="whole-request-tasks"),
    ],
)
def test_tree_masks_are_used_as_given(qo_lens, kv_lens):
    q, k_buf, v_buf, r2t = make_case(qo_lens, kv_lens, seed=3, slots=400)
    g = torch.Generator().manual_seed(4)
    masks = [torch.rand(ql, kl, generator=g) > 0.4 for ql, kl in zip(qo_lens, kv_lens, strict=True)]
    for m in masks:
        m[:, 0] = True
    flat = torch.cat([m.flatten() for m in masks])
    meta = build_attention_metadata(r2t, list(range(len(qo_lens))), qo_lens, kv_lens, flat)
    out, ref = both_backends(q, k_buf, v_buf, meta, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    start = 0
    for i, (ql, kl) in enumerate(zip(qo_lens, kv_lens, strict=True)):
        slots = r2t[i, :kl]
        dense = dense_attention(q[start : start + ql], k_buf[slots], v_buf[slots], masks[i], 0.3)
        torch.testing.assert_close(out[start : start + ql], dense, atol=1e-5, rtol=1e-5)
        start += ql


def test_bfloat16_and_a_strided_query_view():
    """bfloat16 computes in float32 and rounds once, as the reference's SDPA; a query that
    is a view of a fused qkv output (row stride past its heads) is read in place."""
    qo_lens, kv_lens = [1] * 10, [17 + 3 * i for i in range(10)]
    q, k_buf, v_buf, r2t = make_case(qo_lens, kv_lens, 4, 2, dim=32, slots=600)
    meta = build_attention_metadata(r2t, list(range(10)), qo_lens, kv_lens)
    fused = torch.cat([q, torch.randn(10, 2, 32)], dim=1)  # [N, q heads | k heads, D]
    strided = fused[:, :4]
    assert not strided.is_contiguous()
    out, ref = both_backends(strided, k_buf, v_buf, meta, 0.2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    half = [t.bfloat16() for t in (q, k_buf, v_buf)]
    out16, _ = both_backends(*half, meta, 0.2)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), ref, atol=3e-2, rtol=3e-2)


def test_a_dtype_the_kernel_does_not_compute_runs_the_reference():
    q, k_buf, v_buf, r2t = make_case([1, 1], [4, 7])
    meta = build_attention_metadata(r2t, [0, 1], [1, 1], [4, 7])
    half = [t.half() for t in (q, k_buf, v_buf)]
    out, ref = both_backends(*half, meta, 0.5)
    torch.testing.assert_close(out, ref)


def test_an_index_outside_the_pool_is_an_error_not_a_crash():
    q, k_buf, v_buf, r2t = make_case([1, 1], [4, 7], slots=20)
    meta = build_attention_metadata(r2t, [0, 1], [1, 1], [4, 7])
    bad = meta.kv_indices.clone()
    bad[3] = len(k_buf)
    everyone = torch.arange(2)
    with pytest.raises(IndexError, match="does not fit"):
        paged_attention(
            q, k_buf, v_buf, meta.qo_indptr, meta.kv_indptr, bad, None, everyone, 0.5,
            torch.empty_like(q),
        )  # fmt: skip
    with pytest.raises(ValueError, match="of one shape"):  # V with fewer slots than K
        paged_attention(
            q, k_buf, v_buf[:-1], meta.qo_indptr, meta.kv_indptr, meta.kv_indices, None,
            everyone, 0.5, torch.empty_like(q),
        )  # fmt: skip
    short_mask = torch.ones(5, dtype=torch.bool)  # the batch needs 4 + 7
    with pytest.raises(IndexError, match="does not fit"):
        paged_attention(
            q, k_buf, v_buf, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, short_mask,
            everyone, 0.5, torch.empty_like(q),
        )  # fmt: skip


def test_without_a_c_compiler_auto_is_torch_and_cpu_names_the_fix(tmp_path):
    """A fresh kernel cache and no compiler: the backend is missing with the reason, auto
    falls back to the torch reference with a warning, and asking for it names the field
    and the fix."""
    probe = (
        "import torch\n"
        "from specd.kernels.registry import missing_backends, resolve_backend_name\n"
        "assert resolve_backend_name('auto', 'cpu', torch.float32) == 'torch'\n"
        "print(missing_backends()['cpu'])\n"
        "try:\n"
        "    resolve_backend_name('cpu', 'cpu')\n"
        "except ValueError as err:\n"
        "    print(err)\n"
    )
    env = {**os.environ, "CC": "no-such-compiler", "SPECD_KERNEL_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    reason, error = done.stdout.strip().splitlines()
    assert "no C compiler ('no-such-compiler' not found)" in reason and "gcc" in reason
    assert error.startswith("spec.attentionBackend: backend 'cpu' is not available")
    assert "CPU attention runs on the torch reference" in done.stderr  # said once, with why
    assert done.stderr.count("no-such-compiler") == 1
    assert not list(tmp_path.iterdir())


def test_the_kernel_runs_on_torchs_openmp_threads():
    """One OpenMP runtime in the process after the kernel is loaded: its team is torch's."""
    from specd.kernels.cpu_attention import _loaded_openmp

    get_backend("cpu")
    assert len(_loaded_openmp()) == 1, _loaded_openmp()
