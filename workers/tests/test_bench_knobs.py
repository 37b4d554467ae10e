"""Benchmark-only knobs (engine/bench_knobs.py): dummy weights, forced acceptance, and the
GPU benchmark's CPU smoke run."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specd.devtools.testing import (
    check_exact_run,
    check_leak_free,
    collect,
    hf_greedy,
    metric_value,
    pinned_speculation,
    random_prompts,
    run_all,
)
from specd.workers.bench_knobs import BenchKnobs
from specd.workers.config import spec_for_model
from specd.workers.engine.engine import Engine
from specd.workers.model.config import ModelLoadError
from specd.workers.model.llama import RMSNorm
from specd.workers.model.loader import load_model
from specd.workers.speculative.forced_accept import forced_accept
from specd.workers.speculative.tree import DraftTree
from specd.workers.types import FinishReason

REPO = Path(__file__).resolve().parents[2]
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".index.json")


def config_only(src: str, dst: Path) -> str:
    """A copy of a model folder without its weight files (config and tokenizer only)."""
    dst.mkdir()
    for f in Path(src).iterdir():
        if not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy(f, dst / f.name)
    return str(dst)


@pytest.fixture(scope="module")
def bare_pair(pair, tmp_path_factory):
    """(target, EAGLE, EAGLE-3) folders holding no weights."""
    root = tmp_path_factory.mktemp("bare")
    return tuple(
        config_only(src, root / name) for src, name in zip(pair, ("t", "e", "e3"), strict=True)
    )


def knob_engine(
    target, knobs, draft=None, algorithm="EAGLE", steps=5, topk=1, tokens=6, device="cpu"
):
    fields = dict(
        model={"dtype": "float32"},
        kvCache={"pageSize": 4, "maxTokens": 4096},
        scheduler={"chunkedPrefillSize": 16},
        debug={"strictMemCheck": 1},
    )
    if draft is not None:
        fields["draft"] = {"path": draft, "algorithm": algorithm}
        fields["speculative"] = pinned_speculation(
            {"numSteps": steps, "topk": topk, "numDraftTokens": tokens}
        )
    engine = Engine(spec_for_model(target, **fields), device=device, knobs=knobs)
    engine.start()
    return engine


# -- dummy weights ------------------------------------------------------------------------
def test_weightless_folder_needs_the_knob(bare_pair):
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(bare_pair[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_target_is_small_random_on_device(bare_pair, dtype):
    model, _ = load_model(bare_pair[0], dtype=dtype, inference_layout=False, dummy=True)
    for name, t in model.state_dict().items():
        assert t.dtype == dtype and t.device.type == "cpu", name
        if name.endswith("norm.weight"):
            assert bool((t == 1).all()), name
        else:
            assert 0 < float(t.abs().max()) <= 1.01e-3, name


@pytest.mark.parametrize("algorithm", [None, "EAGLE", "EAGLE3"])
def test_dummy_weights_load_and_generate(bare_pair, algorithm):
    target, eagle, eagle3 = bare_pair
    draft = {None: None, "EAGLE": eagle, "EAGLE3": eagle3}[algorithm]
    engine = knob_engine(target, BenchKnobs(dummy_weights=True), draft, algorithm or "EAGLE")
    try:
        results = run_all(engine, random_prompts(3, 300, seed=1), max_tokens=8, ignore_eos=True)
        assert all(len(r[0]) == 8 and r[2].finish_reason is FinishReason.LENGTH for r in results)
        check_leak_free(engine)
        if algorithm == "EAGLE3":  # the identity vocab map: draft id i -> target id i
            head = engine.draft_head.model
            assert not head.d2t.any()
            assert head.t2d.nonzero().flatten().tolist() == list(range(len(head.d2t)))
    finally:
        engine.shutdown()


# -- forced acceptance ----------------------------------------------------------------------
def chain_and_branch_tree() -> DraftTree:
    """root -> a -> c -> d and root -> b: the first-child chain is root, a, c, d."""
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    parents = torch.tensor([[-1, 0, 0, 1, 3]])  # a=1, b=2, c=3 (child of a), d=4 (child of c)
    return DraftTree.from_parents(tokens, parents, num_steps=3)


@pytest.mark.parametrize(
    ("mean_len", "path", "bonus"),
    [
        pytest.param(1.0, [0], 100, id="nothing-accepted"),
        pytest.param(3.0, [0, 1, 3], 103, id="two-along-first-children"),
        pytest.param(9.0, [0, 1, 3, 4], 104, id="clamped-to-chain-depth"),
    ],
)
def test_forced_accept_walks_first_children(mean_len, path, bonus):
    tree = chain_and_branch_tree()
    argmax = torch.arange(100, 105)[None, :]  # the target's argmax at node i is 100 + i
    result = forced_accept(tree, argmax, mean_len, torch.Generator().manual_seed(0))
    n = len(path) - 1
    drafts = tree.tokens[0, path[1:]].tolist()
    assert result.accept_index[0, : n + 1].tolist() == path
    assert int(result.accept_len[0]) == n
    assert result.accepted_tokens[0, : n + 1].tolist() == [*drafts, bonus]


def test_forced_accept_mean_over_draws():
    tokens = torch.arange(6)[None, :].repeat(4096, 1)  # a chain of 5 drafts per request
    parents = torch.arange(-1, 5)[None, :].repeat(4096, 1)
    tree = DraftTree.from_parents(tokens, parents, num_steps=5)
    result = forced_accept(tree, tokens, 2.3, torch.Generator().manual_seed(0))
    assert set(result.accept_len.tolist()) == {1, 2}
    assert float(result.accept_len.double().mean()) == pytest.approx(1.3, abs=0.03)


def greedy_and_sampled(engine, prompts, max_tokens):
    """Every other request samples (temperature 0.7), all in one run."""

    async def go():
        return await asyncio.gather(
            *(
                collect(engine, f"r{i}", p, max_tokens=max_tokens, ignore_eos=True, temperature=t)
                for i, (p, t) in enumerate(zip(prompts, itertools.cycle([0.0, 0.7])))
            )
        )

    return asyncio.run(go())


SHAPES = {"chain": (5, 1, 6), "tree": (5, 4, 16)}  # steps, topk, numDraftTokens


@pytest.mark.parametrize("mean_len", [1.0, 2.5, 4.0])
@pytest.mark.parametrize("shape", SHAPES)
def test_forced_mean_accept_length(bare_pair, shape, mean_len):
    """Usage and metrics count the forced acceptance; KV stays balanced (strict checks).
    A tree accepts along its first-child chain, which random drafts keep 3 deep here."""
    steps, topk, tokens = SHAPES[shape]
    target, _, eagle3 = bare_pair
    knobs = BenchKnobs(dummy_weights=True, force_accept_len=mean_len)
    engine = knob_engine(target, knobs, eagle3, "EAGLE3", steps, topk, tokens)
    try:
        results = greedy_and_sampled(engine, random_prompts(8, 300, seed=3), max_tokens=40)
        verifies = sum(r[2].usage.spec_verify_steps for r in results)
        accepted = sum(r[2].usage.spec_accepted_tokens for r in results)
        assert metric_value(engine, "specd_spec_verify_steps_total") == verifies
        assert metric_value(engine, "specd_spec_accepted_tokens_total") == accepted
        band = 0 if mean_len.is_integer() and shape == "chain" else 0.15
        assert abs((verifies + accepted) / verifies - mean_len) <= band
        check_leak_free(engine)
    finally:
        engine.shutdown()


def test_knobs_are_off_by_default(pair):
    assert BenchKnobs() == BenchKnobs(
        dummy_weights=False, force_accept_len=None, eager_elementwise=False
    )
    with pytest.raises(ValueError, match=">= 1"):
        BenchKnobs(force_accept_len=0.5)
    target, eagle, _ = pair
    prompts = random_prompts(4, 300, seed=5)
    spec = spec_for_model(
        target,
        model={"dtype": "float32"},
        draft={"path": eagle},
        speculative={"numSteps": 3, "topk": 1, "numDraftTokens": 4},
    )
    engine = Engine(spec, device="cpu")
    engine.start()
    assert engine.knobs == BenchKnobs() and engine.spec_decoder.force_accept_len is None
    check_exact_run(engine, prompts, hf_greedy(target, prompts, 12), 12)


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["fused", "eager"])
def test_eager_elementwise_knob_keeps_eager_ops_on_cuda(pair, eager):
    """The fused elementwise kernels' A/B: on CUDA the target's and the draft's norms
    launch the Triton kernel unless the knob keeps them eager; both generate."""
    target, eagle, _ = pair
    engine = knob_engine(target, BenchKnobs(eager_elementwise=eager), eagle, device="cuda")
    try:
        models = (engine.model, engine.draft_head.model)
        norms = [m for model in models for m in model.modules() if isinstance(m, RMSNorm)]
        assert norms and all((norm.fused is None) == eager for norm in norms)
        results = run_all(engine, random_prompts(2, 300, seed=3), max_tokens=8, ignore_eos=True)
        assert all(r[2].finish_reason is FinishReason.LENGTH for r in results)
        check_leak_free(engine)
    finally:
        engine.shutdown()


# -- the GPU benchmark, on CPU ----------------------------------------------------------------
@pytest.mark.slow
def test_bench_gpu_smoke(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "benchmarks/bench_gpu.py", "--shape", "tiny", "--device", "cpu"]
    cmd += ["--batch", "1", "2", "--new-tokens", "8", "--backends", "torch", "--json", str(out)]
    cmd += ["--elementwise", "eager"]  # the A/B's other side (a no-op on CPU)
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["errors"] == {}
    assert [(r["backend"], r["batch"]) for r in report["rows"]] == [("torch", 1), ("torch", 2)]
    for row in report["rows"]:
        assert row["plain_tok_s"] > 0 and row["spec_tok_s"] > 0 and row["speedup"] > 0
        assert row["accept_len"] == 4.0  # steps 3, forced 4: every draft accepted
        assert row["plain"]["accept_len"] is None
    assert [g["backend"] for g in report["goals"]] == ["torch"]
    assert report["floor_ms"] > 0 and report["weight_bytes"] > 0
    assert "floor" in done.stdout and "| torch | 2 |" in done.stdout
    assert report["args"]["elementwise"] == "eager" and "elementwise eager" in done.stdout


@pytest.mark.slow
def test_bench_gpu_fp8_plain_smoke(tmp_path):
    """``--dtype fp8 --spec off``: a block-wise FP8 target (dummy FP8 weights and scales),
    plain decode only, its floor counting one byte per decoder weight."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "benchmarks/bench_gpu.py", "--shape", "tiny", "--device", "cpu"]
    cmd += ["--batch", "1", "--new-tokens", "8", "--backends", "torch", "--json", str(out)]
    done = subprocess.run(
        [*cmd, "--dtype", "fp8", "--spec", "off"], cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["errors"] == {} and [r["batch"] for r in report["rows"]] == [1]
    row = report["rows"][0]
    assert row["plain_tok_s"] > 0 and row["spec"] is None and row["speedup"] is None
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_gpu
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    shape = bench_gpu.SHAPES["tiny"]
    bf16_folder, _ = bench_gpu.write_folders(tmp_path / "bf16", shape, "bfloat16")
    assert report["weight_bytes"] < bench_gpu.decode_weight_bytes(bf16_folder, "bfloat16")

    """The decode profile's wall time per step on CPU (no kernels there), and its kernel
    families read off the names of real cuBLAS, Triton and flashinfer kernels."""
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "benchmarks/profile_decode.py", "--shape", "tiny", "--device", "cpu"]
    cmd += ["--backend", "torch", "--short", "4", "--long", "12", "--json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["backend"] == "torch" and report["wall_ms_per_step"] > 0
    assert report["floor_ms"] > 0 and report["kernel_ms_per_step"] == 0
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from profile_decode import family
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    names = {
        "nvjet_tst_64x8_64x16_4x1_v_bz_TNT": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": "gemm",
        "BatchDecodeWithPagedKVCacheKernel": "attention",
        "_decode_grouped_att_m_fwd": "attention",
        "_rms_norm_kernel": "elementwise",
        "void at::native::reduce_kernel<512, 1>": "sampling",
        "void at::native::index_elementwise_kernel<128, 4>": "copies",
        "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>": "other",
    }
    assert {name: family(name) for name in names} == names


def test_bench_gpu_default_backends_leave_out_one_that_cannot_run_the_heads(monkeypatch):
    import importlib.util

    from specd.kernels import registry
    from specd.kernels.registry import BackendCapabilities
    from specd.kernels.torch_backend import TorchAttentionBackend

    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "benchmarks/bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu", bench)  # its dataclasses look it up
    spec.loader.exec_module(bench)
    caps = BackendCapabilities(
        "flashinfer", ("cuda",), True, True, (torch.bfloat16,), head_dims=(64, 128, 256)
    )
    monkeypatch.setitem(registry._CAPABILITIES, "flashinfer", caps)
    monkeypatch.setitem(registry._FACTORIES, "flashinfer", TorchAttentionBackend)
    eight_b, tiny = bench.SHAPES["8b"].head_dim, bench.SHAPES["tiny"].head_dim
    assert "flashinfer" in bench.default_backends("cuda", torch.bfloat16, eight_b)
    assert "flashinfer" not in bench.default_backends("cuda", torch.bfloat16, tiny)
    on_cpu = bench.default_backends("cpu", torch.float32, eight_b)
    assert "torch" in on_cpu and "flashinfer" not in on_cpu


@pytest.mark.slow
@pytest.mark.parametrize("sessions", [False, True], ids=["requests", "sessions"])
def test_bench_prefix_cache_smoke(sessions):
    """The prefix-cache benchmark runs, checks outputs equal with the cache on and off,
    and the cache-on engine reports every request's shared prefix cached; as sessions'
    first turns too, whose idle sessions then hold the shared pages once."""
    cmd = [sys.executable, "benchmarks/bench_prefix_cache.py", "--prefix-len", "64"]
    cmd += ["--requests", "2", "--new-tokens", "4", "--repeats", "1"]
    cmd += ["--sessions"] if sessions else []
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cached prompt tokens 128" in done.stdout  # 2 x 64 (page 16)
    assert "cached prompt tokens 0" in done.stdout and "cache on vs off" in done.stdout
    if sessions:  # 64 + 16 + 4 tokens each: 6 pages, the prefix's 4 shared with the cache
        assert "cached prompt tokens 128   KV held by the idle sessions 128" in done.stdout
        assert "cached prompt tokens 0   KV held by the idle sessions 192" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("sessions", [False, True], ids=["requests", "sessions"])
def test_bench_routing_smoke(sessions):
    """The routing benchmark serves both policies over HTTP from one pool; cache-aware
    routing finds the groups' prefixes cached (the first request of a group cannot); as
    sessions' first turns too, which then hold KV."""
    cmd = [sys.executable, "benchmarks/bench_routing.py", "--groups", "2", "--prefix-len", "64"]
    cmd += ["--requests", "6", "--clients", "2", "--new-tokens", "2", "--repeats", "1"]
    cmd += ["--sessions"] if sessions else []
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    hits = dict(re.findall(r"(cacheAware|leastLoad) +prefix-cache hits +([0-9.]+)%", done.stdout))
    assert set(hits) == {"cacheAware", "leastLoad"}, done.stdout
    assert float(hits["cacheAware"]) > 0 and "cacheAware vs leastLoad" in done.stdout
    held = re.findall(r"sessions hold (\d+) KV tokens", done.stdout)
    assert len(held) == (2 if sessions else 0) and all(int(h) > 0 for h in held), done.stdout


@pytest.mark.slow
def test_bench_structured_smoke():
    """The structured-output benchmark runs its four contenders in their own processes;
    all emit the same valid JSON, and guided drafts accept more than unguided ones."""
    cmd = [sys.executable, "benchmarks/bench_structured.py", "--batch", "1", "--repeats", "1"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = re.findall(
        r"(\w+) +median .* tokens/verify +([0-9.-]+) +same as plain (\d)/1 +valid JSON (\d+)%",
        done.stdout,
    )
    assert {r[0] for r in rows} == {"plain", "unguided", "guided", "transformers"}, done.stdout
    assert all(same == "1" and valid == "100" for _, _, same, valid in rows), done.stdout
    per_verify = {name: float(v) for name, v, _, _ in rows if v != "-"}
    assert per_verify["guided"] > per_verify["unguided"] + 1, done.stdout


@pytest.mark.slow
def test_bench_priority_smoke():
    """The priority benchmark runs both policies on the same flood, checks their outputs
    equal, and only the priority policy preempts (the urgent requests start first)."""
    cmd = [sys.executable, "benchmarks/bench_priority.py", "--background", "4"]
    cmd += ["--background-len", "32", "--background-tokens", "24", "--urgent", "1"]
    cmd += ["--urgent-tokens", "4", "--max-running", "2", "--repeats", "1"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    preempted = re.search(r"preemptions +fcfs (\d+) +priority (\d+)", done.stdout)
    assert preempted is not None, done.stdout
    assert preempted[1] == "0" and int(preempted[2]) >= 1, done.stdout
    assert "outputs identical" in done.stdout
