"""The Triton backend against dense attention and the torch backend on scattered paged KV
(and, on a GPU, every CUDA backend against the torch one).

On CPU the kernels run in Triton's interpreter (the root conftest sets TRITON_INTERPRET=1),
so shapes stay small; bf16 and production shapes are in the GPU class.  The interpreter
keeps bf16 as raw uint16 and its ``tl.dot`` multiplies the bit patterns (a 16x16 product
comes out near 1e10; triton-lang/triton#11584, "not supported yet"), so float16 stands in
for the half-precision path on CPU: the same kernel code, only the element type differs."""

import math

import pytest
import torch

pytest.importorskip("triton")

from specd.kernels import build_attention_metadata, build_metadata_from_slots  # noqa: E402
from specd.kernels.torch_backend import TorchAttentionBackend  # noqa: E402
from specd.kernels.triton_backend import (  # noqa: E402
    Kernel,
    TritonAttentionBackend,
    choose_num_splits,
    triton_devices,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}

if DEVICE == "cpu" and DEVICE not in triton_devices():
    pytest.skip("Triton on CPU needs TRITON_INTERPRET=1", allow_module_level=True)


def make_pool(num_slots, kv_heads, dim, dtype=torch.float32, seed=0):
    """Random K/V pool [num_slots, kv_heads, dim] each, and a generator for what follows."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_slots, kv_heads, dim, generator=g)
    v = torch.randn(num_slots, kv_heads, dim, generator=g)
    return k.to(DEVICE, dtype), v.to(DEVICE, dtype), g


def scattered_slots(kv_lens, num_slots, g):
    """One [kv_len] list of distinct, permuted pool slots per request."""
    if sum(kv_lens) > num_slots:
        raise ValueError(f"{sum(kv_lens)} slots asked of a pool of {num_slots}")
    perm = torch.randperm(num_slots, generator=g)
    starts = [sum(kv_lens[:i]) for i in range(len(kv_lens))]
    return [perm[s : s + n].to(DEVICE) for s, n in zip(starts, kv_lens, strict=True)]


def causal_masks(qo_lens, kv_lens):
    """[qo_len, kv_len] bool per request: query j at position kv_len - qo_len + j."""
    return [
        torch.arange(k)[None, :] <= torch.arange(k - q, k)[:, None]
        for q, k in zip(qo_lens, kv_lens, strict=True)
    ]


def random_tree_masks(qo_lens, kv_lens, g):
    masks = []
    for q, k in zip(qo_lens, kv_lens, strict=True):
        m = torch.rand(q, k, generator=g) > 0.5
        m[:, 0] = True  # the first prefix token is always visible
        masks.append(m)
    return masks


def flat_tree_mask(qo_lens, kv_lens, g):
    """``random_tree_masks`` as a backend reads them: flattened, concatenated, on DEVICE."""
    return torch.cat([m.flatten() for m in random_tree_masks(qo_lens, kv_lens, g)]).to(DEVICE)


def dense_reference(q, k_buf, v_buf, slot_lists, masks, scale):
    """Explicit float32 softmax attention per request: q [N, H, D] -> [N, H, D]."""
    out, start = [], 0
    for slots, mask in zip(slot_lists, masks, strict=True):
        qi = q[start : start + mask.shape[0]].float()
        k, v = k_buf[slots].float(), v_buf[slots].float()
        rep = qi.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        scores = scores.masked_fill(~mask.to(q.device)[None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += mask.shape[0]
    return torch.cat(out).to(q.dtype)


def run_triton(q, k_buf, v_buf, meta, scale, **backend_args):
    backend = TritonAttentionBackend(**backend_args)
    plan = backend.plan(meta)
    return backend.forward(q, k_buf, v_buf, plan, scale), plan


def run_torch(q, k_buf, v_buf, meta, scale):
    backend = TorchAttentionBackend()
    return backend.forward(q, k_buf, v_buf, backend.plan(meta), scale)


CAUSAL_CASES = [
    pytest.param([1, 1, 1], [5, 9, 1], id="decode"),
    pytest.param([7, 3], [7, 10], id="prefill-with-cached-prefix"),
    pytest.param([1, 6, 1, 4], [12, 6, 3, 9], id="mixed"),
    pytest.param([0, 5, 0, 1], [4, 8, 0, 3], id="with-empty-queries"),
    pytest.param([40, 2], [150, 70], id="several-row-and-kv-blocks"),
]


@pytest.mark.parametrize("qo_lens,kv_lens", CAUSAL_CASES)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_causal_matches_dense(qo_lens, kv_lens, group, dtype):
    kv_heads, dim = 2, 16
    k_buf, v_buf, g = make_pool(400, kv_heads, dim, dtype)
    slots = scattered_slots(kv_lens, 400, g)
    q = torch.randn(sum(qo_lens), kv_heads * group, dim, generator=g).to(DEVICE, dtype)
    meta = build_metadata_from_slots(slots, qo_lens)
    out, _ = run_triton(q, k_buf, v_buf, meta, 0.25)
    ref = dense_reference(q, k_buf, v_buf, slots, causal_masks(qo_lens, kv_lens), 0.25)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_custom_tree_mask_matches_dense_and_torch(group, dtype):
    qo_lens, kv_lens = [4, 1, 0, 6], [21, 9, 5, 80]
    k_buf, v_buf, g = make_pool(300, 2, 16, dtype, seed=1)
    slots = scattered_slots(kv_lens, 300, g)
    masks = random_tree_masks(qo_lens, kv_lens, g)
    flat = torch.cat([m.flatten() for m in masks]).to(DEVICE)
    q = torch.randn(sum(qo_lens), 2 * group, 16, generator=g).to(DEVICE, dtype)
    meta = build_metadata_from_slots(slots, qo_lens, custom_mask=flat)
    out, plan = run_triton(q, k_buf, v_buf, meta, 0.3)
    assert plan.kernel is Kernel.EXTEND
    torch.testing.assert_close(
        out, dense_reference(q, k_buf, v_buf, slots, masks, 0.3), **TOL[dtype]
    )
    if dtype == torch.float32:
        keep = [0, 1, 3]  # the torch backend has no qo_len 0 entries to compare
        sub = build_metadata_from_slots(
            [slots[i] for i in keep],
            [qo_lens[i] for i in keep],
            custom_mask=torch.cat([masks[i].flatten() for i in keep]).to(DEVICE),
        )
        torch.testing.assert_close(out, run_torch(q, k_buf, v_buf, sub, 0.3), **TOL[dtype])


def branch_slot_lists(row, base, span, tail, topk, extra_ancestors, g):
    """Per-branch reads of a holey row: the shared prefix [0, base), a few ancestor slots
    from the prefix, then the branch's own region [base + b*span, base + b*span + tail).

        row: | prefix 0..base | branch 0 (span) | branch 1 (span) | ...
    """
    lists = []
    for b in range(topk):
        ancestors = row[torch.randperm(base, generator=g)[:extra_ancestors].to(row.device)]
        own = row[base + b * span : base + b * span + tail]
        lists.append(torch.cat([row[:base], ancestors, own]))
    return lists


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("reads", ["branch-extend", "node-decode"])
def test_holey_per_branch_layout_matches_torch(group, reads):
    base, span, tail, topk = 37, 16, 5, 3
    k_buf, v_buf, g = make_pool(500, 2, 16, seed=2)
    row = torch.randperm(500, generator=g)[: base + topk * span].to(DEVICE)
    lists = branch_slot_lists(row, base, span, tail, topk, extra_ancestors=3, g=g)
    if reads == "node-decode":  # one group per tree node: prefix, ancestors, itself
        lists = [s[: len(s) - tail + j + 1] for s in lists for j in range(tail)]
        qo_lens = [1] * len(lists)
    else:
        qo_lens = [tail] * topk
    q = torch.randn(sum(qo_lens), 2 * group, 16, generator=g).to(DEVICE)
    meta = build_metadata_from_slots(lists, qo_lens)
    out, plan = run_triton(q, k_buf, v_buf, meta, 0.25)
    assert plan.kernel is (Kernel.DECODE if reads == "node-decode" else Kernel.EXTEND)
    torch.testing.assert_close(out, run_torch(q, k_buf, v_buf, meta, 0.25), **TOL[torch.float32])


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_split_kv_decode_matches_torch(group, dtype):
    kv_lens = [300, 700, 45]
    k_buf, v_buf, g = make_pool(1200, 2, 16, dtype, seed=3)
    slots = scattered_slots(kv_lens, 1200, g)
    q = torch.randn(3, 2 * group, 16, generator=g).to(DEVICE, dtype)
    meta = build_metadata_from_slots(slots, [1, 1, 1])
    out, plan = run_triton(q, k_buf, v_buf, meta, 0.25)
    assert plan.kernel is Kernel.DECODE and plan.decode.num_splits > 1
    ref = dense_reference(q, k_buf, v_buf, slots, causal_masks([1] * 3, kv_lens), 0.25)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_decode_with_more_splits_than_kv_blocks():
    """Forced 12 splits: the short requests leave whole splits empty, merged with weight 0."""
    kv_lens = [3, 64, 250]
    k_buf, v_buf, g = make_pool(400, 2, 16, seed=4)
    slots = scattered_slots(kv_lens, 400, g)
    q = torch.randn(3, 4, 16, generator=g).to(DEVICE)
    meta = build_metadata_from_slots(slots, [1, 1, 1])
    out, plan = run_triton(q, k_buf, v_buf, meta, 0.25, num_splits=12)
    assert plan.decode.num_splits == 12
    torch.testing.assert_close(out, run_torch(q, k_buf, v_buf, meta, 0.25), **TOL[torch.float32])


@pytest.mark.parametrize("dim", [24, 80])
@pytest.mark.parametrize("qo_lens", [[1, 1], [3, 1]], ids=["decode", "extend"])
def test_head_dim_not_a_power_of_two(dim, qo_lens):
    kv_lens = [140, 20]
    k_buf, v_buf, g = make_pool(200, 2, dim, seed=5)
    slots = scattered_slots(kv_lens, 200, g)
    q = torch.randn(sum(qo_lens), 4, dim, generator=g).to(DEVICE)
    meta = build_metadata_from_slots(slots, qo_lens)
    out, _ = run_triton(q, k_buf, v_buf, meta, 1 / math.sqrt(dim), num_splits=2)
    ref = run_torch(q, k_buf, v_buf, meta, 1 / math.sqrt(dim))
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("qo_lens", [[1, 1], [4, 2]], ids=["decode", "extend"])
def test_large_logits_stay_finite(qo_lens):
    """Scores in the hundreds: exp2 of an unshifted score or log-sum-exp would overflow."""
    kv_lens = [300, 150]
    k_buf, v_buf, g = make_pool(500, 2, 16, seed=7)
    slots = scattered_slots(kv_lens, 500, g)
    q = 30 * torch.randn(sum(qo_lens), 4, 16, generator=g).to(DEVICE)
    meta = build_metadata_from_slots(slots, qo_lens)
    out, _ = run_triton(q, k_buf, v_buf, meta, 1.0, num_splits=4)
    ref = dense_reference(q, k_buf, v_buf, slots, causal_masks(qo_lens, kv_lens), 1.0)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_heads_must_split_over_kv_heads():
    k_buf, v_buf, g = make_pool(20, 2, 16)
    meta = build_metadata_from_slots(scattered_slots([4], 20, g), [2])
    with pytest.raises(ValueError, match="3 q heads do not split over 2 kv heads"):
        run_triton(torch.zeros(2, 3, 16, device=DEVICE), k_buf, v_buf, meta, 0.25)


def test_strided_q_and_layers_share_one_plan():
    """q sliced out of a fused qkv projection; two layers reuse one plan and its scratch."""
    k_buf, v_buf, g = make_pool(300, 2, 16, seed=6)
    kv_lens = [200, 33]
    slots = scattered_slots(kv_lens, 300, g)
    meta = build_metadata_from_slots(slots, [1, 1])
    backend = TritonAttentionBackend()
    plan = backend.plan(meta)
    for layer in range(2):
        qkv = torch.randn(2, (4 + 2 * 2) * 16, generator=g).to(DEVICE)
        q = qkv[:, : 4 * 16].view(2, 4, 16)  # [bs, H, D], row stride (4 + 2 * 2) * 16
        k_l, v_l = k_buf * (layer + 1), v_buf - layer
        out = backend.forward(q, k_l, v_l, plan, 0.25)
        torch.testing.assert_close(out, run_torch(q, k_l, v_l, meta, 0.25), **TOL[torch.float32])
        if layer == 0:
            scratch = plan.decode.part_out
    assert plan.decode.part_out is scratch


def test_batch_without_queries_writes_nothing():
    k_buf, v_buf, g = make_pool(50, 2, 16)
    meta = build_metadata_from_slots(scattered_slots([4, 6], 50, g), [0, 0])
    out, plan = run_triton(torch.zeros(0, 4, 16, device=DEVICE), k_buf, v_buf, meta, 0.25)
    assert plan.max_qo_len == 0 and out.shape == (0, 4, 16)


@pytest.mark.parametrize(
    "qo_lens,custom,kernel",
    [
        pytest.param([1, 1, 1], False, Kernel.DECODE, id="all-decode"),
        pytest.param([1, 3, 1], False, Kernel.EXTEND, id="mixed"),
        pytest.param([1, 1], True, Kernel.EXTEND, id="custom-mask-single-queries"),
        pytest.param([1, 0], False, Kernel.EXTEND, id="decode-with-empty-entry"),
    ],
)
def test_plan_picks_the_kernel(qo_lens, custom, kernel):
    kv_lens = [5] * len(qo_lens)
    mask = torch.ones(sum(q * k for q, k in zip(qo_lens, kv_lens, strict=True)), dtype=torch.bool)
    r2t = torch.arange(5 * len(qo_lens)).view(len(qo_lens), 5)
    meta = build_attention_metadata(
        r2t, list(range(len(qo_lens))), qo_lens, kv_lens, mask if custom else None
    )
    plan = TritonAttentionBackend().plan(meta)
    assert plan.kernel is kernel and plan.max_qo_len == max(qo_lens)
    assert (plan.mask_indptr is not None) == custom


@pytest.mark.parametrize(
    "batch,max_kv,splits",
    [
        pytest.param(1, 100, 1, id="short-context"),
        pytest.param(1, 4096, 16, id="one-long-request"),
        pytest.param(3, 700, 6, id="small-batch"),
        pytest.param(32, 4096, 2, id="large-batch"),
        pytest.param(256, 4096, 1, id="huge-batch"),
    ],
)
def test_choose_num_splits(batch, max_kv, splits):
    assert choose_num_splits(batch, max_kv) == splits


def test_devices_follow_the_interpreter_flag(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_devices() == ("cuda", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert triton_devices() == ("cuda",)


def test_registered_with_capabilities():
    from specd.kernels.registry import get_backend

    backend = get_backend("triton", DEVICE)
    assert isinstance(backend, TritonAttentionBackend)
    caps = backend.capabilities
    assert caps.supports_custom_mask and caps.supports_paged_tree and "cuda" in caps.devices


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(24))
def test_random_batches_sweep(seed):
    """Random mixed batches, causal and tree-masked, several GQA ratios, both kernels."""
    g = torch.Generator().manual_seed(100 + seed)
    bs = int(torch.randint(1, 6, (1,), generator=g))
    group = [1, 2, 4][seed % 3]
    kv_lens = torch.randint(1, 700, (bs,), generator=g).tolist()
    decode = seed % 2 == 0
    qo_lens = [1 if decode else int(torch.randint(0, k + 1, (1,), generator=g)) for k in kv_lens]
    k_buf, v_buf, g2 = make_pool(sum(kv_lens) + 50, 2, 16, seed=seed)
    slots = scattered_slots(kv_lens, sum(kv_lens) + 50, g2)
    q = torch.randn(sum(qo_lens), 2 * group, 16, generator=g2).to(DEVICE)
    masks = causal_masks(qo_lens, kv_lens)
    flat = None
    if seed % 3 == 1:
        masks = random_tree_masks(qo_lens, kv_lens, g2)
        flat = torch.cat([m.flatten() for m in masks]).to(DEVICE)
    meta = build_metadata_from_slots(slots, qo_lens, custom_mask=flat)
    out, _ = run_triton(q, k_buf, v_buf, meta, 0.2)
    ref = dense_reference(q, k_buf, v_buf, slots, masks, 0.2)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestProductionShapesOnGpu:
    """bf16 and production shapes: head_dim 128, 32 q heads over 8 kv heads."""

    HEADS, KV_HEADS, DIM = 32, 8, 128

    def _case(self, qo_lens, kv_lens, dtype=torch.bfloat16, seed=0):
        num_slots = sum(kv_lens) + 1000
        k_buf, v_buf, g = make_pool(num_slots, self.KV_HEADS, self.DIM, dtype, seed)
        slots = scattered_slots(kv_lens, num_slots, g)
        q = torch.randn(sum(qo_lens), self.HEADS, self.DIM, generator=g).to(DEVICE, dtype)
        return q, k_buf, v_buf, slots, g

    def test_decode_batch_32_long_context(self):
        g = torch.Generator().manual_seed(0)
        kv_lens = torch.randint(1, 4097, (32,), generator=g).tolist()
        q, k_buf, v_buf, slots, _ = self._case([1] * 32, kv_lens)
        meta = build_metadata_from_slots(slots, [1] * 32)
        out, plan = run_triton(q, k_buf, v_buf, meta, self.DIM**-0.5)
        assert plan.kernel is Kernel.DECODE
        ref = run_torch(q, k_buf, v_buf, meta, self.DIM**-0.5)
        torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])

    def test_small_batch_decode_uses_many_splits(self):
        q, k_buf, v_buf, slots, _ = self._case([1, 1], [4096, 3000])
        meta = build_metadata_from_slots(slots, [1, 1])
        out, plan = run_triton(q, k_buf, v_buf, meta, self.DIM**-0.5)
        assert plan.decode.num_splits == 16
        ref = run_torch(q, k_buf, v_buf, meta, self.DIM**-0.5)
        torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])

    def test_prefill_and_mixed(self):
        qo_lens, kv_lens = [1000, 1, 300, 7], [1000, 2000, 4000, 512]
        q, k_buf, v_buf, slots, _ = self._case(qo_lens, kv_lens)
        meta = build_metadata_from_slots(slots, qo_lens)
        out, _ = run_triton(q, k_buf, v_buf, meta, self.DIM**-0.5)
        ref = run_torch(q, k_buf, v_buf, meta, self.DIM**-0.5)
        torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])

    def test_tree_verify(self):
        qo_lens, kv_lens = [64, 8, 16], [1064, 4008, 116]
        q, k_buf, v_buf, slots, g = self._case(qo_lens, kv_lens)
        meta = build_metadata_from_slots(
            slots, qo_lens, custom_mask=flat_tree_mask(qo_lens, kv_lens, g)
        )
        out, _ = run_triton(q, k_buf, v_buf, meta, self.DIM**-0.5)
        ref = run_torch(q, k_buf, v_buf, meta, self.DIM**-0.5)
        torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])

    @pytest.mark.parametrize("qo_lens", [[1] * 4, [3, 1, 0, 5]], ids=["decode", "extend"])
    def test_float32_stays_exact(self, qo_lens):
        kv_lens = [700, 90, 8, 300]
        q, k_buf, v_buf, slots, _ = self._case(qo_lens, kv_lens, torch.float32)
        meta = build_metadata_from_slots(slots, qo_lens)
        out, _ = run_triton(q, k_buf, v_buf, meta, self.DIM**-0.5)
        ref = dense_reference(
            q, k_buf, v_buf, slots, causal_masks(qo_lens, kv_lens), self.DIM**-0.5
        )
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)

    @pytest.mark.parametrize("qo_lens", [[1] * 8, [4] * 8], ids=["decode", "extend"])
    def test_forward_replays_in_a_cuda_graph(self, qo_lens):
        kv_lens = [2048 + 100 * i for i in range(8)]
        q, k_buf, v_buf, slots, _ = self._case(qo_lens, kv_lens)
        meta = build_metadata_from_slots(slots, qo_lens)
        backend = TritonAttentionBackend()
        plan = backend.plan(meta)
        backend.forward(q, k_buf, v_buf, plan, 0.1)  # compile and allocate outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = backend.forward(q, k_buf, v_buf, plan, 0.1)
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.testing.assert_close(
            out, run_torch(q, k_buf, v_buf, meta, 0.1), **TOL[torch.bfloat16]
        )


def installed_cuda_backend(name: str):
    """A new bf16 instance of CUDA backend ``name``; the test is skipped where it is not
    installed (flashinfer is optional)."""
    from specd.kernels import available_backends, get_backend

    if name not in available_backends():
        pytest.skip(f"{name} is not installed")
    return get_backend(name, "cuda", torch.bfloat16)


def production_cases(g, heads_dim=128):
    """(name, qo_lens, slot lists, custom masks or None) at production sizes: long decode
    at batch 32, prefill mixed with decode, tree verify, and holey per-branch draft reads."""
    decode = torch.randint(1, 4097, (32,), generator=g).tolist()
    row = torch.randperm(9000, generator=g)[: 2000 + 8 * 64]
    holey = branch_slot_lists(row, 2000, 64, 9, 8, extra_ancestors=4, g=g)
    holey = [s[: len(s) - 9 + j + 1] for s in holey for j in range(9)]  # one node per group
    return [
        ("decode-32", [1] * 32, decode, False),
        ("mixed", [1000, 1, 300, 7], [1000, 2000, 4000, 512], False),
        ("tree-verify", [64, 8, 16], [1064, 4008, 116], True),
        ("holey-branches", [1] * len(holey), holey, False),
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("case", ["decode-32", "mixed", "tree-verify", "holey-branches"])
@pytest.mark.parametrize("graph", [False, True], ids=["plan", "graph-plan"])
def test_every_cuda_backend_matches_torch_in_bf16(backend, case, graph):
    """Each CUDA backend against the torch reference, bf16, 32 q / 8 kv heads of 128, on
    scattered slots (holey per-branch reads included); ``graph``: through a graph plan
    (padded to 2 more requests than the batch, the pad slot last) replayed in a graph."""
    from specd.kernels.metadata import GraphBuffers, GraphShape, pad_metadata

    impl = installed_cuda_backend(backend)
    g = torch.Generator().manual_seed(7)
    _, qo_lens, lens_or_lists, masked = next(c for c in production_cases(g) if c[0] == case)
    lens = lens_or_lists if isinstance(lens_or_lists[0], int) else []
    num_slots = max(20000, sum(lens))  # decode-32's 32 contexts of up to 4096 slots each
    k_buf, v_buf, g = make_pool(num_slots + 1, 8, 128, torch.bfloat16, 3)
    slots = (
        scattered_slots(lens_or_lists, num_slots, g)
        if isinstance(lens_or_lists[0], int)
        else [s.to(DEVICE) for s in lens_or_lists]
    )
    kv_lens = [len(s) for s in slots]
    mask = flat_tree_mask(qo_lens, kv_lens, g) if masked else None
    q = torch.randn(sum(qo_lens), 32, 128, generator=g).to(DEVICE, torch.bfloat16)
    meta = build_metadata_from_slots(slots, qo_lens, custom_mask=mask)
    ref = run_torch(q, k_buf, v_buf, meta, 128**-0.5)
    if not graph:
        out = impl.forward(q, k_buf, v_buf, impl.plan(meta), 128**-0.5)
        torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])
        return
    if len(set(qo_lens)) != 1:
        pytest.skip("graph batches have one query count")
    bs = len(qo_lens) + 2
    shape = GraphShape(bs, qo_lens[0], max(kv_lens), masked, 32, 8, 128, torch.bfloat16)
    plan = impl.graph_plan(shape, q.device, GraphBuffers([impl.graph_buffer_needs(shape)], "cuda"))
    impl.update_graph_plan(plan, pad_metadata(meta, shape, num_slots))
    q_static = torch.zeros(bs * qo_lens[0], 32, 128, dtype=torch.bfloat16, device=DEVICE)
    q_static[: q.shape[0]] = q
    impl.forward(q_static, k_buf, v_buf, plan, 128**-0.5)  # compile outside the capture
    torch.cuda.synchronize()
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        out = impl.forward(q_static, k_buf, v_buf, plan, 128**-0.5)
    cuda_graph.replay()
    torch.testing.assert_close(out[: q.shape[0]], ref, **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_one_backend_instance_runs_every_batch_kind_in_turn(backend):
    """As in an engine, whose target and draft share one backend: a causal prefill, then a
    tree verify with a custom mask, then decodes with GQA groups of 2 and 4, on the same
    instance, each against the torch reference (bf16, heads of 128).  A flashinfer
    prefill wrapper that fixed its kernel family at the causal plan, or a decode wrapper
    whose tensor-core choice was made for the other group, fails here."""
    impl = installed_cuda_backend(backend)
    num_slots = 6000
    k_buf, v_buf, g = make_pool(num_slots, 8, 128, torch.bfloat16, 5)
    batches = [  # (query lens, kv lens, custom mask, query heads)
        ([300, 7, 1], [1300, 7, 40], False, 32),
        ([8, 8], [1008, 208], True, 32),
        ([1, 1, 1], [900, 33, 2], False, 16),
        ([1, 1], [1500, 64], False, 32),
    ]
    for qo_lens, kv_lens, masked, heads in batches:
        slots = scattered_slots(kv_lens, num_slots, g)
        mask = flat_tree_mask(qo_lens, kv_lens, g) if masked else None
        q = torch.randn(sum(qo_lens), heads, 128, generator=g).to(DEVICE, torch.bfloat16)
        meta = build_metadata_from_slots(slots, qo_lens, custom_mask=mask)
        out = impl.forward(q, k_buf, v_buf, impl.plan(meta), 128**-0.5)
        ref = run_torch(q, k_buf, v_buf, meta, 128**-0.5)
        torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])
