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
    check_exact_run,
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
    at batch 1 and concurrently, and the strict leak checks ran and passed."""
    assert engine.backend_name == backend
    assert engine.kv.ops.name == "triton"
    check_exact_run(engine, prompts, expected, MAX_NEW)
    assert metric_value(engine, "specd_leak_checks_total", result="fail") == 0


def run_case(pair, backend, case, expected, prompts, **extra):
    target, eagle, eagle3 = pair
    if case["spec"] is None:
        engine = start_engine(
            target,
            kvCache={"pageSize": case["page"], "maxTokens": 4096},
            scheduler={"chunkedPrefillSize": 16},
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


def case(page, spec=None, marks=()):
    """spec: (steps, topk, algorithm, overlap) or None for plain decode."""
    name = f"page{page}-" + ("plain" if spec is None else "S{}-k{}-{}-{}".format(*spec))
    name = name.replace("-True", "-overlap").replace("-False", "-sync")
    return pytest.param({"page": page, "spec": spec}, id=name, marks=marks)


# -- Triton through its interpreter (CPU) ------------------------------------------------

INTERPRETER_CASES = [
    case(16),
    case(1, (3, 1, "EAGLE", True)),
    case(4, (3, 4, "EAGLE", False)),  # the paged tree layout (seed 002)
    case(16, (3, 4, "EAGLE3", True), marks=pytest.mark.slow),
    case(1, (5, 4, "EAGLE", False), marks=pytest.mark.slow),
    case(16, (1, 1, "EAGLE", False), marks=pytest.mark.slow),
    case(4, (5, 1, "EAGLE3", True), marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def cpu_reference(pair):
    prompts = random_prompts(4, 300, seed=11)
    return prompts, reference_outputs(pair[0], prompts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests below cover CUDA")
@pytest.mark.parametrize("case", INTERPRETER_CASES)
def test_triton_in_the_interpreter_is_lossless(pair, cpu_reference, case):
    prompts, expected = cpu_reference
    run_case(pair, "triton", case, expected, prompts)


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
    + [case(page) for page in (1, 16)]
    + [
        case(page, (3, topk, "EAGLE3", overlap))
        for page in (1, 16)
        for topk in (1, 4)
        for overlap in (False, True)
    ]
)


def cuda_backend(name: str) -> str:
    if name not in available_backends():
        pytest.skip(f"{name} is not installed")
    return name


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def gpu_reference(request, pair):
    """(dtype, prompts, torch-backend greedy outputs on the GPU in that dtype)."""
    prompts = random_prompts(6, 300, seed=13)
    model = {"dtype": request.param}
    return request.param, prompts, reference_outputs(pair[0], prompts, device="cuda", model=model)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("case", GPU_MATRIX)
def test_cuda_backend_is_lossless(pair, gpu_reference, backend, case):
    dtype, prompts, expected = gpu_reference
    caps = available_backends().get(cuda_backend(backend))
    if getattr(torch, dtype) not in caps.dtypes:
        pytest.skip(f"{backend} does not compute in {dtype}")
    run_case(pair, backend, case, expected, prompts, device="cuda", model={"dtype": dtype})


@pytest.mark.gpu
def test_auto_picks_a_cuda_backend(pair):
    """``attentionBackend: auto`` on CUDA: flashinfer when installed, else Triton."""
    want = "flashinfer" if "flashinfer" in available_backends() else "triton"
    engine = start_engine(pair[0], device="cuda", model={"dtype": "bfloat16"})
    try:
        assert engine.backend_name == want
    finally:
        engine.shutdown()
