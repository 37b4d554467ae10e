"""Attention backend registry.

Each backend declares what it supports (devices, dtypes, custom masks, the paged tree
layout with page_size > 1 and topk > 1); the engine asks the registry instead of
branching on names, and config validation refuses combinations a backend cannot run.

Backends whose package is missing (``triton``, ``flashinfer``) are not registered; the
registry remembers why, so asking for one names the install step.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from specd.kernels.metadata import AttentionMetadata

ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# ``auto`` on CUDA: the first of these that is installed and runs the model's dtype.
CUDA_PREFERENCE = ("flashinfer", "triton", "torch")


@dataclass(frozen=True, slots=True)
class BackendCapabilities:
    name: str
    devices: tuple[str, ...]
    supports_custom_mask: bool
    supports_paged_tree: bool  # page_size > 1 together with topk > 1
    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES  # KV / query dtypes it computes in
    supports_graphs: bool = False  # graph_plan / update_graph_plan (CUDA-graph batches)
    head_dims: tuple[int, ...] | None = None  # the head sizes its kernels take; None: any

    def runs_head_dims(self, head_dims: Iterable[int]) -> bool:
        return self.head_dims is None or all(d in self.head_dims for d in head_dims)


class AttentionBackend(Protocol):
    """flashinfer-style split: ``plan`` once per batch, ``forward`` once per layer."""

    capabilities: BackendCapabilities

    def plan(self, meta: AttentionMetadata) -> Any:
        """Precompute whatever every layer of this batch reuses (indices, masks)."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_buffer: torch.Tensor,  # [pool_slots, num_kv_heads, head_dim]
        v_buffer: torch.Tensor,
        plan: Any,  # what ``plan`` returned for this batch
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...

    # Backends with ``supports_graphs`` also have (see metadata.GraphShape, GraphBuffers):
    #   graph_buffer_needs(shape) -> {name: (numel, dtype)}   shared buffers it views
    #   graph_plan(shape, device, buffers) -> plan          static buffers for that shape
    #   update_graph_plan(plan, meta)                        copy a padded batch's metadata
    #   update_graph_plan_lens(plan, qo_lens, kv_lens)       lengths only ...
    #   graph_kv_indices(plan) -> Tensor                     ... the graph writes the indices
    # so a captured forward reads each replay's batch from the same memory.


_FACTORIES: dict[str, Callable[[], AttentionBackend]] = {}
_CAPABILITIES: dict[str, BackendCapabilities] = {}
_MISSING: dict[str, str] = {}  # backend -> why it is not registered
_OPTIONAL = {
    "triton": ("specd.kernels.triton_backend", "pip install triton (or specd[gpu])"),
    "flashinfer": ("specd.kernels.flashinfer_backend", "pip install 'specd[gpu]' on a CUDA host"),
}


def register_backend(capabilities: BackendCapabilities):
    """Class decorator: register a backend under ``capabilities.name``."""

    def wrap(cls):
        cls.capabilities = capabilities
        _FACTORIES[capabilities.name] = cls
        _CAPABILITIES[capabilities.name] = capabilities
        return cls

    return wrap


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


def _pick_auto(
    device: str, dtype: torch.dtype | None, paged_tree: bool, head_dims: tuple[int, ...]
) -> str:
    backends = available_backends()
    if device != "cuda":
        return "torch"
    for name in CUDA_PREFERENCE:
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
