"""Wheels for running specd's GPU checks on an offline CUDA host whose image already has
PyTorch and Triton (a stock PyTorch image): pydantic and its parts, xgrammar and its
runtime (apache-tvm-ffi), and with ``--flashinfer`` flashinfer-python.

    python scripts/offline_gpu_wheels.py OUT_DIR [--flashinfer] [--python-version 3.12]
    # on the host:  SPECD_WHEELS=OUT_DIR bash scripts/gpu_check.sh tests

flashinfer's wheel (62 MB) carries the CUDA sources of every kernel family it JIT-compiles;
``trim_flashinfer`` keeps its Python package, headers and the top-level CUDA sources the
attention modules are generated from (batch decode / prefill), and drops the per-family
source folders under ``flashinfer/data/csrc/`` (MoE, sampling, Blackwell kernels, ...):
31 MB for 0.7.2.post1, which still imports and plans.  The other hard requirements it
declares (cuda-tile, nccl4py, nvidia-cudnn-frontend, nvidia-cutlass-dsl, ...) are not
needed for ``import flashinfer`` or the paged attention wrappers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

BASE = [
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "xgrammar>=0.2.8,<0.3",
    "apache-tvm-ffi>=0.1.11,<0.2",
]
FLASHINFER = ["flashinfer-python>=0.7.2,<0.8"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64"]


def trim_flashinfer(wheel: Path) -> Path:
    """Rewrite ``wheel`` without the subfolders of ``flashinfer/data/csrc/``."""
    trimmed = wheel.with_suffix(".trimmed")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            parts = info.filename.split("/")
            if parts[:3] == ["flashinfer", "data", "csrc"] and len(parts) > 4:
                continue  # flashinfer/data/csrc/<family>/...: kernels specd never builds
            dst.writestr(info, src.read(info.filename), compress_type=zipfile.ZIP_DEFLATED)
    trimmed.replace(wheel)
    return wheel


def download(out: Path, requirements: list[str], python_version: str) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--python-version", python_version, "--implementation", "cp", *platforms,
         "-d", str(out), *requirements],
        check=True,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--flashinfer", action="store_true", help="also flashinfer, trimmed")
    ap.add_argument("--python-version", default="3.12", help="the host's Python")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    download(args.out, BASE + (FLASHINFER if args.flashinfer else []), args.python_version)
    for wheel in args.out.glob("flashinfer_python-*.whl"):
        trim_flashinfer(wheel)
    total = sum(w.stat().st_size for w in args.out.glob("*.whl"))
    print(f"{args.out}: {total / 2**20:.1f} MiB of wheels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
