"""The CUDA attention backends (Triton, flashinfer) and the Triton kernel ops in the engine:
greedy output equal, token for token, to the torch reference backend, with and without
speculation, strict leak checks on.

Without a GPU the Triton backend runs through Triton's interpreter (``TRITON_INTERPRET=1``,
set by the repository's conftest): the same kernels on CPU tensors, slow, so the default
suite runs a few layouts and ``slow`` the rest.  The ``gpu`` tests run the lossless matrix
of DESIGN §7 on every CUDA backend installed, in bfloat16 against the torch backend on the
same GPU, and in float32 where the backend computes in it.
"""

from __future__ import annotations

import pytest
import torch

from specd.kernels import available_backends
from specd.workers.config import ConfigError
from specd.workers.testing import (
    DEMO_MODELS,
    check_exact_run,
    demo_prompts,
    metric_value,
    random_prompts,
    run_all,
    start_engine,
    start_spec_engine,
)

MAX_NEW = 12
CUDA_BACKENDS = ("triton", "flashinfer")


def reference_outputs(target, prompts, **extra):
    engine = start_engine(target, kvCache={"pageSize": 1}, attentionBackend="torch", **extra)
    try:
        return [r[0] for r in run_all(engine, prompts, max_tokens=MAX_NEW, ignore_eos=True)]
    finally:
        engine.shutdown()


def check_backend_run(engine, backend, prompts, expected):
    """The engine really runs ``backend`` with the Triton ops, outputs equal ``expected``
    at batch 1 and concurrently, and the strict (busy) leak checks ran and passed."""
    assert engine.backend_name == backend
    assert engine.kv.ops.name == "triton"
    check_exact_run(engine, prompts, expected, MAX_NEW)
    assert metric_value(engine, "specd_leak_checks_total", mode="busy", result="ok") > 0
    assert metric_value(engine, "specd_leak_checks_total", result="fail") == 0


def run_case(pair, backend, case, expected, prompts, **extra):
    target, eagle, eagle3 = pair
    extra.setdefault("cudaGraph", {"enabled": case["graphs"]})
    if case["spec"] is None:
        engine = start_engine(
            target,
            kvCache={"pageSize": case["page"], "maxTokens": 4096},
            scheduler={"chunkedPrefillSize": 16, "overlap": case["overlap"]},
            attentionBackend=backend,
            debug={"strictMemCheck": 1},
            **extra,
        )
    else:
        steps, topk, algorithm, overlap = case["spec"]
        draft = eagle if algorithm == "EAGLE" else eagle3
        engine = start_spec_engine(
            target,
            draft,
            case["page"],
            steps,
            topk,
            algorithm=algorithm,
            overlap=overlap,
            attentionBackend=backend,
            **extra,
        )
    check_backend_run(engine, backend, prompts, expected)
    if case["spec"] is None and case["graphs"]:
        # every decode batch, scheduled ahead (most of them under overlap) or not, replays
        ahead = metric_value(engine, "specd_engine_steps_launched_ahead_total")
        assert (ahead > 0) == case["overlap"]
        assert engine.graphs.replays >= max(ahead, 1)


def case(page, spec=None, graphs=True, overlap=False, marks=()):
    """spec: (steps, topk, algorithm, overlap) or None for plain decode (then ``overlap``
    is the plain engine's); graphs: CUDA graphs (on CPU: the same padded graph batches,
    in emulated graphs)."""
    if spec is None:
        name = f"page{page}-plain-{overlap}"
    else:
        name = f"page{page}-" + "S{}-k{}-{}-{}".format(*spec)
    name = name.replace("-True", "-overlap").replace("-False", "-sync")
    name += "" if graphs else "-nographs"
    params = {"page": page, "spec": spec, "graphs": graphs, "overlap": overlap}
    return pytest.param(params, id=name, marks=marks)


# -- Triton through its interpreter (CPU) ------------------------------------------------

INTERPRETER_CASES = [
    case(16, graphs=False),
    case(4, overlap=True),  # decode scheduled ahead, its input ids gathered into graphs
    case(1, (3, 1, "EAGLE", True), graphs=False),
    case(4, (3, 4, "EAGLE", False)),  # the paged tree layout (seed 002), graph batches
    case(16, (3, 4, "EAGLE3", True), marks=pytest.mark.slow),
    case(1, (5, 4, "EAGLE", False), graphs=False, marks=pytest.mark.slow),
    case(16, (1, 1, "EAGLE", False), marks=pytest.mark.slow),
    case(4, (5, 1, "EAGLE3", True), marks=pytest.mark.slow),
    case(4, (3, 4, "EAGLE", True), graphs=False, marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def cpu_reference(pair):
    prompts = random_prompts(4, 300, seed=11)
    return prompts, reference_outputs(pair[0], prompts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests below cover CUDA")
@pytest.mark.parametrize("case", INTERPRETER_CASES)
def test_triton_in_the_interpreter_is_lossless(pair, cpu_reference, case):
    prompts, expected = cpu_reference
    graphs = {"enabled": case["graphs"], "maxBatchSize": 4}  # 4 prompts: buckets 1, 2, 4
    run_case(pair, "triton", case, expected, prompts, cudaGraph=graphs)


def graph_engine(target, device="cpu", **extra):
    """A plain engine on the Triton backend whose decode batches of up to 4 requests run in
    graph buckets (1, 2, 4): captured on CUDA, emulated (``EmulatedGraph``) elsewhere."""
    return start_engine(
        target,
        device=device,
        kvCache={"pageSize": 4, "maxTokens": 4096},
        attentionBackend="triton",
        cudaGraph={"maxBatchSize": 4},
        debug={"strictMemCheck": 1},
        **extra,
    )


def check_graph_runs(engine, prompts, expected, mode):
    """3 requests (bucket 4, one pad row), then 1 and 4 (``check_exact_run``): outputs
    exact, every decode step replayed, and the pad row wrote only to the pad slot."""
    status = engine.status()["cuda_graphs"]
    assert (status["mode"], status["sizes"]) == (mode, [1, 2, 4])
    three = run_all(engine, prompts[:3], max_tokens=MAX_NEW, ignore_eos=True)
    assert [r[0] for r in three] == expected[:3]
    assert engine.graphs.bucket(4).out_loc.tolist()[3] == engine.kv_pool.pad_slot
    replays = engine.graphs.replays
    assert replays >= MAX_NEW - 1  # every decode step of the three
    check_exact_run(engine, prompts, expected, MAX_NEW)
    assert engine.graphs.replays >= replays + 2 * (MAX_NEW - 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests below cover CUDA")
def test_decode_graph_buckets_are_exact_in_the_interpreter(pair, cpu_reference):
    prompts, expected = cpu_reference
    check_graph_runs(graph_engine(pair[0]), prompts, expected, "emulated")


DEMO_CHAIN = {"numSteps": 4, "topk": 1, "numDraftTokens": 5}
DEMO_TREE = {"numSteps": 3, "topk": 4, "numDraftTokens": 8}


def demo_run(graphs, speculative, page, device="cpu", dtype="float32", backend="triton"):
    """The shipped trained pair (real acceptance) on Python source: outputs, each
    request's (verify steps, accepted drafts), and the graph status."""
    engine = start_engine(
        str(DEMO_MODELS / "demo-target"),
        device=device,
        model={"dtype": dtype},
        attentionBackend=backend,
        kvCache={"pageSize": page, "maxTokens": 4096},
        draft={"path": str(DEMO_MODELS / "demo-eagle")},
        speculative=speculative,
        cudaGraph={"enabled": graphs, "maxBatchSize": 4},
        debug={"strictMemCheck": 1},
    )
    try:
        results = run_all(engine, demo_prompts(3), max_tokens=20, ignore_eos=True)
        status = engine.status()
    finally:
        engine.shutdown()
    assert status["leak_check_failures"] == 0
    usage = [(r[2].usage.spec_verify_steps, r[2].usage.spec_accepted_tokens) for r in results]
    return [r[0] for r in results], usage, status["cuda_graphs"]


def check_graphs_draft_like_eager(speculative, page, mode, **device):
    """Graph batches (padded, static buffers, in-graph KV gathers) give the same tokens
    and the same acceptance as eager steps, and every step part ran in a graph."""
    eager_out, eager_usage, off = demo_run(False, speculative, page, **device)
    graph_out, graph_usage, graphs = demo_run(True, speculative, page, **device)
    assert off["mode"] == "off" and graphs["mode"] == mode
    assert all(n > 0 for n in graphs["replays"].values()), graphs
    assert graph_out == eager_out
    assert graph_usage == eager_usage
    assert sum(accepted for _, accepted in eager_usage) > 20  # the trained draft at work


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests below cover CUDA")
@pytest.mark.parametrize(
    "speculative,page",
    [
        pytest.param(DEMO_CHAIN, 1, id="chain"),
        pytest.param(DEMO_TREE, 16, id="paged-tree", marks=pytest.mark.slow),
    ],
)
def test_graph_batches_draft_like_eager_ones_in_the_interpreter(speculative, page):
    check_graphs_draft_like_eager(speculative, page, "emulated")


def test_engine_refuses_a_backend_that_cannot_run_here(pair):
    """flashinfer is CUDA-only (and not installed on CPU machines): the engine does not
    start, and the error names the field."""
    with pytest.raises(ConfigError, match=r"spec.attentionBackend: .*flashinfer"):
        start_engine(pair[0], attentionBackend="flashinfer")


def test_status_names_the_backend_and_the_ops(pair):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: compiled or interpreted
    engine = start_engine(pair[0], device=device, attentionBackend="triton")
    try:
        status = engine.status()
        assert (status["attention_backend"], status["kernel_ops"]) == ("triton", "triton")
        assert status["device"] == device
    finally:
        engine.shutdown()


# -- CUDA ---------------------------------------------------------------------------------

GPU_MATRIX = (
    [
        case(page, (steps, topk, "EAGLE", overlap))
        for page in (1, 4, 16)
        for topk in (1, 4)
        for steps in (1, 3, 5)
        for overlap in (False, True)
    ]
    + [
        case(page, graphs=graphs, overlap=overlap)
        for page in (1, 16)
        for graphs in (True, False)
        for overlap in (False, True)
    ]
    + [
        case(page, (3, topk, "EAGLE3", overlap))
        for page in (1, 16)
        for topk in (1, 4)
        for overlap in (False, True)
    ]
    + [case(page, (3, 4, "EAGLE", True), graphs=False) for page in (1, 16)]
)


def cuda_backend(name: str) -> str:
    if name not in available_backends():
        pytest.skip(f"{name} is not installed")
    return name


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def gpu_reference(request, gpu_pair):
    """(dtype, prompts, torch-backend greedy outputs on the GPU in that dtype)."""
    prompts = random_prompts(6, 300, seed=13)
    model = {"dtype": request.param}
    target = gpu_pair[0]
    return request.param, prompts, reference_outputs(target, prompts, device="cuda", model=model)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("case", GPU_MATRIX)
def test_cuda_backend_is_lossless(gpu_pair, gpu_reference, backend, case):
    dtype, prompts, expected = gpu_reference
    caps = available_backends().get(cuda_backend(backend))
    if getattr(torch, dtype) not in caps.dtypes:
        pytest.skip(f"{backend} does not compute in {dtype}")
    run_case(gpu_pair, backend, case, expected, prompts, device="cuda", model={"dtype": dtype})


@pytest.mark.gpu
def test_decode_graphs_are_captured_and_exact(gpu_pair, gpu_reference):
    dtype, prompts, expected = gpu_reference
    engine = graph_engine(gpu_pair[0], device="cuda", model={"dtype": dtype})
    check_graph_runs(engine, prompts[:4], expected[:4], "captured")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("speculative,page", [(DEMO_CHAIN, 1), (DEMO_TREE, 16)])
def test_captured_speculative_graphs_draft_like_eager_steps(backend, speculative, page):
    check_graphs_draft_like_eager(
        speculative,
        page,
        "captured",
        device="cuda",
        dtype="bfloat16",
        backend=cuda_backend(backend),
    )


@pytest.mark.gpu
def test_auto_picks_a_cuda_backend(gpu_pair, pair):
    """``attentionBackend: auto`` on CUDA: flashinfer when installed and the heads are a
    size it runs, else Triton."""
    want = "flashinfer" if "flashinfer" in available_backends() else "triton"
    for target, expected in ((gpu_pair[0], want), (pair[0], "triton")):  # heads of 64, 16
        engine = start_engine(target, device="cuda", model={"dtype": "bfloat16"})
        try:
            assert engine.backend_name == expected
        finally:
            engine.shutdown()
