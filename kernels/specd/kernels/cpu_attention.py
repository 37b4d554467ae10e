"""Paged attention on the CPU in C: ``csrc/paged_attention.c``, compiled on first use.

The torch reference gathers every request's K/V into a padded copy per layer and runs
SDPA on it; at batch 32 on a 2-core VM that copy and SDPA's per-head overhead took
1.26 ms a layer of the demo target, a third of the step.  The C kernel reads each
request's K/V rows in place through its slot list (one task per request, or per kv head
when there are few requests) and took 0.52 ms.  vLLM's and SGLang's CPU builds hand-write
this kernel too; no maintained package offers one for a torch-owned paged pool.

The library is compiled with the machine's C compiler (``$CC``, else ``cc``) at
``-O3 -march=native -fopenmp`` into the kernel cache (``$SPECD_KERNEL_CACHE``, else
``~/.cache/specd/kernels``, else the temp dir), keyed by the source, the flags and this
CPU's feature flags, so each machine builds it once (about half a second).  It links the
``libgomp.so.1`` that torch has already loaded, so its threads are torch's threads: it is
used only when torch's OpenMP is that libgomp (`unavailable_reason` says why not).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
DTYPES = (torch.float32, torch.bfloat16)
MAX_QUERIES = 64  # per request: longer ones (prefill chunks) run as GEMMs in SDPA


class KernelUnavailable(RuntimeError):
    """The C kernel cannot run in this process (the message says why and the fix)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dirs() -> list[Path]:
    if env := os.environ.get("SPECD_KERNEL_CACHE"):
        return [Path(env)]
    return [
        Path.home() / ".cache" / "specd" / "kernels",
        Path(tempfile.gettempdir()) / "specd-kernels",
    ]


def _loaded_openmp() -> set[str]:
    """The OpenMP runtimes mapped into this process (paths)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    names = ("libgomp", "libiomp", "libomp")
    return {line.split()[-1] for line in maps.splitlines() if any(n in line for n in names)}


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, *FLAGS, "-o", str(partial), str(SOURCE), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise KernelUnavailable(f"{' '.join(cmd)} failed: {done.stderr.strip()[-400:]}")
    os.replace(partial, target)  # atomic: a concurrent build of the same key is identical


def _library_path() -> Path:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise KernelUnavailable(
            f"no C compiler ({compiler!r} not found): install gcc (or set CC) for the CPU "
            "attention kernel"
        )
    parts = [" ".join(FLAGS), compiler, _cpu_flags(), platform.machine()]
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), *(p.encode() for p in parts)]))
    key = key.hexdigest()[:16]
    errors = []
    for folder in _cache_dirs():
        target = folder / f"paged_attention-{key}.so"
        if target.exists():
            return target
        try:
            _build(compiler, target)
            return target
        except OSError as err:  # a cache folder that cannot be written: try the next
            errors.append(f"{folder}: {err}")
    raise KernelUnavailable("no writable kernel cache: " + "; ".join(errors))


def _open_library() -> ctypes.CDLL:
    before = _loaded_openmp()
    if not any("libgomp" in path for path in before):
        raise KernelUnavailable(
            f"torch's OpenMP runtime here is not libgomp ({sorted(before) or 'none loaded'}): "
            "the kernel would start a second thread pool; the torch backend runs instead"
        )
    lib = ctypes.CDLL(str(_library_path()))
    if len(_loaded_openmp()) > len(before):
        raise KernelUnavailable(
            "the kernel loaded a second OpenMP runtime beside torch's; the torch backend runs "
            "instead"
        )
    fn = lib.specd_paged_attention
    fn.restype = ctypes.c_int
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr] + [i64] * 8  # dtype, tensors, sizes
    fn.argtypes += [ptr, ptr, ptr, i64, ptr, i64, ptr, i64, ctypes.c_float, ctypes.c_int]
    return lib


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, str | None]:
    """The library, or why there is none: built and opened once per process."""
    try:
        return _open_library(), None
    except (KernelUnavailable, OSError, subprocess.SubprocessError) as err:
        return None, str(err)


def _library() -> ctypes.CDLL:
    lib, reason = _loaded()
    if lib is None:
        raise KernelUnavailable(reason)
    return lib


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (builds it if need be); None when it can."""
    return _loaded()[1]


def _check(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
    if q.dtype not in DTYPES or k_buffer.dtype != q.dtype or v_buffer.dtype != q.dtype:
        raise ValueError(f"the CPU kernel computes {DTYPES} with K/V of the query's dtype")
    if q.device.type != "cpu" or q.dim() != 3 or q.stride(2) != 1:
        raise ValueError("q must be a CPU [tokens, heads, head_dim] tensor, unit stride last")
    if k_buffer.shape != v_buffer.shape or not (
        k_buffer.is_contiguous() and v_buffer.is_contiguous()
    ):
        raise ValueError("K/V buffers must be contiguous [slots, kv_heads, head_dim] of one shape")
    if q.shape[1] % k_buffer.shape[1] or q.shape[2] != k_buffer.shape[2]:
        raise ValueError("query heads must be a multiple of kv heads, with one head size")


def paged_attention(
    q: torch.Tensor,  # [N, H, D]
    k_buffer: torch.Tensor,  # [slots, Hkv, D]
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,  # [B + 1] int64
    kv_indptr: torch.Tensor,  # [B + 1] int64
    kv_indices: torch.Tensor,  # [nnz] int64 pool slots
    custom_mask: torch.Tensor | None,  # [sum qo_i * kv_i] bool, or None: causal
    requests: torch.Tensor,  # [R] int64: the requests to compute
    scale: float,
    out: torch.Tensor,  # [N, H, D] contiguous, q's dtype: their rows are written
) -> torch.Tensor:
    """Attention of ``requests`` over the paged pool, in the layout of `AttentionMetadata`
    (``csrc/paged_attention.c``); other requests' rows of ``out`` are left as they are."""
    _check(q, k_buffer, v_buffer)
    index = [t.contiguous() for t in (qo_indptr, kv_indptr, kv_indices, requests)]
    if any(t.dtype != torch.int64 for t in index):
        raise ValueError("indices must be int64")
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("out must be contiguous, with q's shape and dtype")
    mask = None if custom_mask is None else custom_mask.contiguous()
    if mask is not None and mask.dtype not in (torch.bool, torch.uint8):
        raise ValueError("custom_mask must be bool")
    (tokens, heads, dim), (qo, kv, slots, reqs) = q.shape, index
    status = _library().specd_paged_attention(
        int(q.dtype == torch.bfloat16),
        q.data_ptr(), k_buffer.data_ptr(), v_buffer.data_ptr(), out.data_ptr(),
        tokens, heads, k_buffer.shape[1], dim, q.stride(0), q.stride(1), len(k_buffer),
        len(qo) - 1, qo.data_ptr(), kv.data_ptr(), slots.data_ptr(), len(slots),
        0 if mask is None else mask.data_ptr(), 0 if mask is None else mask.numel(),
        reqs.data_ptr(), len(reqs), scale, torch.get_num_threads(),
    )  # fmt: skip
    if status == 2:
        raise IndexError("paged attention: an index or the mask does not fit its tensors")
    if status:
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
    return out
