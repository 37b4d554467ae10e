"""scripts/offline_gpu_wheels.py: the trimmed flashinfer wheel keeps what the attention
JIT builds from and drops the other kernel families' sources."""

import importlib.util
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "offline_gpu_wheels.py"


def _script():
    spec = importlib.util.spec_from_file_location("offline_gpu_wheels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trim_keeps_python_headers_and_top_level_sources(tmp_path):
    kept = [
        "flashinfer/__init__.py",
        "flashinfer/fused_moe/core.py",  # imported by flashinfer/__init__.py: stays
        "flashinfer/data/csrc/batch_decode.cu",
        "flashinfer/data/csrc/batch_prefill_customize_config.jinja",
        "flashinfer/data/include/flashinfer/attention/decode.cuh",
        "flashinfer/data/cutlass/include/cute/tensor.hpp",
        "flashinfer_python-0.7.2.dist-info/METADATA",
    ]
    dropped = [
        "flashinfer/data/csrc/cake_sampling/generated/part1.cuh",
        "flashinfer/data/csrc/fused_moe/kernel.cu",
    ]
    wheel = tmp_path / "flashinfer_python-0.7.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in kept + dropped:
            z.writestr(name, f"// {name}\n" * 50)
    _script().trim_flashinfer(wheel)
    with zipfile.ZipFile(wheel) as z:
        assert sorted(z.namelist()) == sorted(kept)
        assert z.read("flashinfer/data/csrc/batch_decode.cu").startswith(b"// flashinfer/")
    assert not list(tmp_path.glob("*.trimmed"))
