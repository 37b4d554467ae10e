"""Pack what specd's GPU checks need on an offline CUDA host whose image already has
PyTorch and Triton (a stock PyTorch image), small enough for a size-limited copy:

    python scripts/offline_gpu_bundle.py OUT_DIR [--no-flashinfer] [--models]
        [--python-version 3.12]
    # on the host:  SPECD_BUNDLE=OUT_DIR bash scripts/gpu_check.sh tests
    # (which runs: python scripts/offline_gpu_bundle.py OUT_DIR --unpack-to SITE)

``OUT_DIR/site.tar.xz``: the wheels such an image lacks (pydantic and its parts, xgrammar
and apache-tvm-ffi, jsonschema and its parts for the structured-output tests, a recent
typing-extensions, and flashinfer-python), unpacked as one site-packages folder;
gpu_check.sh puts it on PYTHONPATH.  flashinfer's wheel is 62 MB of Python and CUDA
sources for every kernel family it JIT-compiles; ``trim_flashinfer`` keeps the modules
``import flashinfer`` loads (its module-level import closure, read statically), all of
``flashinfer.jit``, and the sources the attention modules are generated from: 12 MB of
xz for the whole folder with flashinfer 0.7.2.post1, which JIT-builds and runs the batch
decode and FA2 paged-prefill kernels on an H100.  The other hard requirements flashinfer
declares (cuda-tile, nccl4py, nvidia-cudnn-frontend, nvidia-cutlass-dsl, ...) are not
needed for that.

``--models``: ``OUT_DIR/models/<name>.safetensors.xz``, the shipped demo checkpoints'
weights (60 MiB raw, 42 MiB packed), which gpu_check.sh restores into
``examples/models/<name>/`` where they are missing: for a copy of the repository that
must leave the raw files out to fit.
"""

from __future__ import annotations

import argparse
import ast
import lzma
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE = [
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions>=4.16",
    "xgrammar>=0.2.8,<0.3",
    "apache-tvm-ffi>=0.1.11,<0.2",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
]
FLASHINFER = ["flashinfer-python>=0.7.2,<0.8"]
# what ``specd serve`` adds (bench_gpu_served.py): the gateway's web stack, its C event
# loop and HTTP parser, and Ray core (no ``[default]`` extras: the local Ray starts
# without its dashboard)
SERVING = [
    "ray",
    "fastapi",
    "starlette",
    "uvicorn",
    "uvloop",
    "httptools",
    "annotated-doc",
    "opentelemetry-api",
]
# never loaded by a local Ray's driver, raylet or workers: the Java jars, the dashboard's
# web client and the libraries on top of Ray core
RAY_DROPPED = ("jars", "dashboard/client/build", "rllib", "tune", "train", "data", "serve", "llm")
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",  # the same as 2_17, but pip matches the name (ray's wheel)
]
# under flashinfer/data: what the JIT's include paths and the attention modules' generated
# sources read (flashinfer/jit/env.py); csrc keeps its top-level files only
DATA_KEPT = (
    "include",
    "csrc",
    "spdlog",
    "cutlass/include",
    "cutlass/tools/util/include",
    "cccl/cub",
    "cccl/libcudacxx/include",
    "cccl/thrust",
)
ALWAYS_KEPT_PACKAGES = ("flashinfer.jit",)  # imported inside functions when a kernel is built


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(source: str, module: str, is_package: bool) -> set[str]:
    """Absolute names a module imports when it is loaded: its top-level import statements,
    those inside top-level if/try/with blocks included, not those inside functions or
    classes.  ``from X import y`` yields X and X.y (y may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(statements):
        for node in statements:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")
                base = base[: len(base) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(source).body)
    return found


def import_closure(root: Path, start: str) -> set[str]:
    """Modules under ``root`` that loading ``start`` loads, with their parent packages."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in files:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        path = files[name]
        todo += module_level_imports(path.read_text(), name, path.name == "__init__.py")
    return seen


def trim_flashinfer(site: Path) -> int:
    """Delete from the unpacked ``site/flashinfer`` what the attention path never loads
    or builds from; returns the bytes removed."""
    package = site / "flashinfer"
    kept = import_closure(site, "flashinfer")
    kept_dirs = {package.parent.joinpath(*m.split(".")) for m in kept}
    removed = 0
    for path in sorted(p for p in package.rglob("*") if p.is_file()):
        in_data = path.relative_to(package).parts[0] == "data"
        if in_data:
            rel = path.relative_to(package / "data").as_posix()
            keep = any(rel.startswith(prefix + "/") for prefix in DATA_KEPT)
            keep = keep and not (rel.startswith("csrc/") and rel.count("/") > 1)
        elif path.suffix == ".py":
            name = module_name(path, site)
            keep = name in kept or name.startswith(ALWAYS_KEPT_PACKAGES)
        else:  # data files beside modules (configs, kernel sources): where a kept module is
            keep = path.parent in kept_dirs or module_name(path, site).startswith(
                ALWAYS_KEPT_PACKAGES
            )
        if not keep:
            removed += path.stat().st_size
            path.unlink()
    return removed


def trim_ray(site: Path) -> int:
    """Delete ``RAY_DROPPED`` from the unpacked ``site/ray``; returns the bytes removed."""
    removed = 0
    for rel in RAY_DROPPED:
        folder = site / "ray" / rel
        if folder.is_dir():
            removed += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            shutil.rmtree(folder)
    return removed


def download(out: Path, requirements: list[str], python_version: str) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--python-version", python_version, "--implementation", "cp", *platforms,
         "-d", str(out), *requirements],
        check=True,
    )  # fmt: skip


def extract_wheel(wheel: Path, site: Path) -> None:
    """Unpack ``wheel`` into ``site``, keeping its executables' mode (Ray's raylet and GCS
    server), which ``ZipFile.extractall`` drops."""
    with zipfile.ZipFile(wheel) as z:
        for member in z.infolist():
            path = Path(z.extract(member, site))
            mode = member.external_attr >> 16
            if mode & 0o111:
                path.chmod(mode & 0o777)


def pack_site(out: Path, requirements: list[str], python_version: str) -> Path:
    """Download, unpack and trim the wheels; write ``out/site.tar.xz``."""
    with tempfile.TemporaryDirectory() as tmp:
        wheels, site = Path(tmp) / "wheels", Path(tmp) / "site"
        download(wheels, requirements, python_version)
        for wheel in sorted(wheels.glob("*.whl")):
            extract_wheel(wheel, site)
        if (site / "flashinfer").is_dir():
            print(f"flashinfer: trimmed {trim_flashinfer(site) / 2**20:.0f} MiB")
        if (site / "ray").is_dir():
            print(f"ray: trimmed {trim_ray(site) / 2**20:.0f} MiB")
        archive = out / "site.tar.xz"
        with tarfile.open(archive, "w:xz", preset=9) as tar:
            tar.add(site, arcname=".")
    return archive


def pack_models(out: Path) -> list[Path]:
    """``out/models/<name>.safetensors.xz`` for each shipped demo checkpoint."""
    (out / "models").mkdir(parents=True, exist_ok=True)
    packed = []
    for weights in sorted((REPO / "examples" / "models").glob("*/model.safetensors")):
        target = out / "models" / f"{weights.parent.name}.safetensors.xz"
        with weights.open("rb") as src, lzma.open(target, "wb", preset=9) as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
        packed.append(target)
    return packed


def unpack(bundle: Path, site: Path) -> list[Path]:
    """On the host: ``bundle``'s site folder into ``site``, and its packed weights into
    the checkpoints of ``examples/models/`` that lack them; returns the weights restored."""
    with tarfile.open(bundle / "site.tar.xz") as tar:
        tar.extractall(site, filter="data")
    restored = []
    for packed in sorted((bundle / "models").glob("*.safetensors.xz")):
        name = packed.name.removesuffix(".safetensors.xz")
        weights = REPO / "examples" / "models" / name / "model.safetensors"
        if not weights.exists():
            with lzma.open(packed) as src, weights.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 24)
            restored.append(weights)
    return restored


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--no-flashinfer", action="store_true", help="Triton backend only")
    ap.add_argument("--models", action="store_true", help="also the demo weights, packed")
    ap.add_argument(
        "--serving", action="store_true",
        help="also Ray core and the web stack, for bench_gpu_served.py",
    )  # fmt: skip
    ap.add_argument("--python-version", default="3.12", help="the host's Python")
    ap.add_argument("--unpack-to", type=Path, help="on the host: unpack the bundle OUT here")
    args = ap.parse_args()
    if args.unpack_to is not None:
        for weights in unpack(args.out, args.unpack_to):
            print(f"restored {weights}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    requirements = BASE + ([] if args.no_flashinfer else FLASHINFER)
    if args.serving:
        # the versions installed here: the host gets what the tests here ran
        requirements += [f"{name}=={version(name)}" for name in SERVING]
    files = [pack_site(args.out, requirements, args.python_version)]
    if args.models:
        files += pack_models(args.out)
    for f in files:
        print(f"{f}: {f.stat().st_size / 2**20:.1f} MiB")
    print(f"total {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
