"""scripts/offline_gpu_bundle.py: the trimmed flashinfer keeps the modules ``import
flashinfer`` loads, its JIT package and the sources the attention modules are built from,
and drops the rest; the demo weights pack and unpack bit for bit, and the host side
restores only what is missing."""

import importlib.util
import lzma
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "offline_gpu_bundle.py"


def _script():
    spec = importlib.util.spec_from_file_location("offline_gpu_bundle", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FILES = {  # path -> (source, kept)
    "flashinfer/__init__.py": (
        "from .decode import wrapper\ntry:\n    from . import moe\nexcept ImportError:\n"
        "    pass\nif True:\n    import flashinfer.utils.env\n",
        True,
    ),
    "flashinfer/decode.py": (
        "from .jit import build\ndef plan():\n    from .experimental import fast\n",
        True,
    ),
    "flashinfer/moe/__init__.py": ("from .core import run\n", True),
    "flashinfer/moe/core.py": ("run = 1\n", True),
    "flashinfer/moe/tuning.json": ("{}", True),  # beside a kept module
    "flashinfer/utils/__init__.py": ("", True),  # a parent package of a kept module
    "flashinfer/utils/env.py": ("", True),
    "flashinfer/utils/unused.py": ("", False),
    "flashinfer/jit/__init__.py": ("", True),
    "flashinfer/jit/attention/modules.py": ("", True),  # flashinfer.jit: always kept
    "flashinfer/experimental/__init__.py": ("", False),  # imported inside a function only
    "flashinfer/experimental/fast.py": ("", False),
    "flashinfer/experimental/kernels/fast.cu": ("", False),
    "flashinfer/data/csrc/batch_decode.cu": ("", True),
    "flashinfer/data/csrc/batch_prefill_customize_config.jinja": ("", True),
    "flashinfer/data/csrc/fused_moe/kernel.cu": ("", False),
    "flashinfer/data/include/flashinfer/attention/decode.cuh": ("", True),
    "flashinfer/data/cutlass/include/cute/tensor.hpp": ("", True),
    "flashinfer/data/cutlass/examples/00_basic/main.cu": ("", False),
    "flashinfer/data/cccl/libcudacxx/include/cuda/std/cstddef": ("", True),
    "flashinfer/data/cccl/docs/index.rst": ("", False),
}


def test_trim_keeps_the_import_closure_the_jit_and_attention_sources(tmp_path):
    for name, (source, _) in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    removed = _script().trim_flashinfer(tmp_path)
    left = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert left == {name for name, (_, kept) in FILES.items() if kept}
    assert removed == sum(len(src) for src, kept in FILES.values() if not kept)


def test_module_level_imports_resolve_relative_names():
    imports = _script().module_level_imports(
        "from ..jit import env\nimport os\ndef f():\n    import json\n", "pkg.sub.mod", False
    )
    assert imports == {"pkg.jit", "pkg.jit.env", "os"}


def test_demo_weights_pack_losslessly_and_unpack_where_missing(tmp_path, monkeypatch):
    script = _script()
    models = tmp_path / "repo" / "examples" / "models"
    (models / "tiny").mkdir(parents=True)
    weights = bytes(range(256)) * 1000
    (models / "tiny" / "model.safetensors").write_bytes(weights)
    monkeypatch.setattr(script, "REPO", tmp_path / "repo")
    [packed] = script.pack_models(tmp_path / "out")
    assert packed.name == "tiny.safetensors.xz" and packed.stat().st_size < len(weights)
    assert lzma.decompress(packed.read_bytes()) == weights
    # on the host: the site folder unpacked, missing weights restored, present ones kept
    (tmp_path / "site-src" / "pkg").mkdir(parents=True)
    (tmp_path / "site-src" / "pkg" / "__init__.py").write_text("x = 1\n")
    with tarfile.open(tmp_path / "out" / "site.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "site-src", arcname=".")
    target = models / "tiny" / "model.safetensors"
    target.unlink()
    assert script.unpack(tmp_path / "out", tmp_path / "site") == [target]
    assert target.read_bytes() == weights
    assert (tmp_path / "site" / "pkg" / "__init__.py").read_text() == "x = 1\n"
    assert script.unpack(tmp_path / "out", tmp_path / "site") == []
