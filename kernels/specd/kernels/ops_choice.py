"""Which `KernelOps` an engine runs: torch, or Triton beside a CUDA attention backend
(Triton is imported only when asked for)."""

from __future__ import annotations

import importlib.util

from specd.kernels.ops import TORCH_OPS, KernelOps

_OPS = ("torch", "triton")


def get_ops(name: str) -> KernelOps:
    """The ``torch`` or ``triton`` implementation (Triton is imported only when asked for)."""
    if name == "torch":
        return TORCH_OPS
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError(
                "kernel ops 'triton' need the triton package, which is not installed "
                "(pip install 'specd[gpu]'); use 'torch' instead"
            )
        from specd.kernels.triton_ops import TritonOps

        return TritonOps()
    raise ValueError(f"unknown kernel ops {name!r}; choose one of {list(_OPS)}")


def ops_for_backend(backend: str) -> KernelOps:
    """The ops an engine on attention ``backend`` runs: Triton beside a CUDA backend
    (``triton``, ``flashinfer``) when it is installed, torch otherwise."""
    if backend in ("triton", "flashinfer") and importlib.util.find_spec("triton") is not None:
        return get_ops("triton")
    return TORCH_OPS
