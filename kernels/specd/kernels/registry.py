"""Attention backend registry.

Each backend declares what it supports (devices, dtypes, custom masks, the paged tree
layout with page_size > 1 and topk > 1); the engine asks the registry instead of
branching on names, and config validation refuses combinations a backend cannot run.

Backends whose package is missing (``triton``, ``flashinfer``), or whose kernel cannot be
built here (``cpu``: no C compiler), are not registered; the registry remembers why, so
asking for one names the install step.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Iterable

import torch

from specd.kernels.backend import (  # noqa: F401  (re-exported: the registry's public names)
    ALL_DTYPES,
    AttentionBackend,
    BackendCapabilities,
    register_backend,
)
from specd.kernels.backend import CAPABILITIES as _CAPABILITIES
from specd.kernels.backend import FACTORIES as _FACTORIES

log = logging.getLogger(__name__)

# ``auto``: the first of these that is installed and runs the model's dtype.
CUDA_PREFERENCE = ("flashinfer", "triton", "torch")
CPU_PREFERENCE = ("cpu", "torch")


_MISSING: dict[str, str] = {}  # backend -> why it is not registered
_OPTIONAL = {
    "triton": ("specd.kernels.triton_backend", "pip install triton (or specd[gpu])"),
    "flashinfer": ("specd.kernels.flashinfer_backend", "pip install 'specd[gpu]' on a CUDA host"),
    "cpu": ("specd.kernels.cpu_backend", "install a C compiler (gcc), or use 'torch'"),
}


def _load_builtin_backends() -> None:
    from specd.kernels import torch_backend  # noqa: F401  (registers itself)

    for name, (module, hint) in _OPTIONAL.items():
        if name in _CAPABILITIES or name in _MISSING:
            continue
        try:
            importlib.import_module(module)  # registers itself
        except (ImportError, OSError, RuntimeError) as err:  # package or CUDA runtime absent
            _MISSING[name] = f"{err}; {hint}"


def available_backends() -> dict[str, BackendCapabilities]:
    _load_builtin_backends()
    return dict(_CAPABILITIES)


def missing_backends() -> dict[str, str]:
    """Built-in backends that could not be registered here -> why (and the fix)."""
    _load_builtin_backends()
    return dict(_MISSING)


@functools.cache
def _warn_cpu_fallback(reason: str) -> None:
    log.warning(
        "CPU attention runs on the torch reference: the C kernel cannot run here (%s)", reason
    )


def _pick_auto(
    device: str, dtype: torch.dtype | None, paged_tree: bool, head_dims: tuple[int, ...]
) -> str:
    backends = available_backends()
    if device != "cuda" and "cpu" in _MISSING:
        _warn_cpu_fallback(_MISSING["cpu"])
    for name in CUDA_PREFERENCE if device == "cuda" else CPU_PREFERENCE:
        caps = backends.get(name)
        if (
            caps
            and device in caps.devices
            and (dtype is None or dtype in caps.dtypes)
            and (caps.supports_paged_tree or not paged_tree)
            and caps.runs_head_dims(head_dims)
        ):
            return name
    return "torch"


def resolve_backend_name(
    name: str,
    device: str,
    dtype: torch.dtype | None = None,
    paged_tree: bool = False,
    head_dims: Iterable[int] = (),
) -> str:
    """Map ``auto`` to a concrete backend for ``device`` (the model's ``dtype``, the
    paged tree layout when the spec needs it, the head sizes of the target and draft)
    and check the backend is installed and runs there."""
    backends = available_backends()
    head_dims = tuple(sorted(set(head_dims)))
    if name == "auto":
        return _pick_auto(device, dtype, paged_tree, head_dims)
    if name not in backends:
        why = f" ({_MISSING[name]})" if name in _MISSING else ""
        raise ValueError(
            f"spec.attentionBackend: backend {name!r} is not available in this build{why}; "
            f"available: {sorted(backends)}"
        )
    caps = backends[name]
    if device not in caps.devices:
        raise ValueError(
            f"spec.attentionBackend: backend {name!r} does not run on {device}; "
            f"backends for {device}: {sorted(n for n, c in backends.items() if device in c.devices)}"
        )
    if dtype is not None and dtype not in caps.dtypes:
        able = sorted(str(d).removeprefix("torch.") for d in caps.dtypes)
        raise ValueError(
            f"spec.model.dtype: backend {name!r} does not compute in "
            f"{str(dtype).removeprefix('torch.')}; use one of {able} or another "
            f"spec.attentionBackend"
        )
    if not caps.runs_head_dims(head_dims):
        raise ValueError(
            f"spec.attentionBackend: backend {name!r} runs head sizes {list(caps.head_dims)}; "
            f"this model has {list(head_dims)}: use 'triton' or 'torch' (or 'auto')"
        )
    return name


def get_backend(
    name: str, device: str = "cpu", dtype: torch.dtype | None = None
) -> AttentionBackend:
    name = resolve_backend_name(name, device, dtype)
    return _FACTORIES[name]()
