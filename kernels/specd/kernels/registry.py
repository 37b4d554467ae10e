"""Attention backend registry.

Each backend declares what it supports (devices, custom masks, the paged tree layout
with page_size > 1 and topk > 1); the engine asks the registry instead of branching
on names, and config validation refuses combinations a backend cannot run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from specd.kernels.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class BackendCapabilities:
    name: str
    devices: tuple[str, ...]
    supports_custom_mask: bool
    supports_paged_tree: bool  # page_size > 1 together with topk > 1


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


_FACTORIES: dict[str, Callable[[], AttentionBackend]] = {}
_CAPABILITIES: dict[str, BackendCapabilities] = {}


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


def available_backends() -> dict[str, BackendCapabilities]:
    _load_builtin_backends()
    return dict(_CAPABILITIES)


def resolve_backend_name(name: str, device: str) -> str:
    """Map ``auto`` to a concrete backend for ``device`` and check the device is served."""
    backends = available_backends()
    if name == "auto":
        name = "flashinfer" if device == "cuda" and "flashinfer" in backends else "torch"
    if name not in backends:
        raise ValueError(
            f"spec.attentionBackend: backend {name!r} is not available in this build; "
            f"available: {sorted(backends)}"
        )
    if device not in backends[name].devices:
        raise ValueError(
            f"spec.attentionBackend: backend {name!r} does not run on {device}; "
            f"backends for {device}: {sorted(n for n, c in backends.items() if device in c.devices)}"
        )
    return name


def get_backend(name: str, device: str = "cpu") -> AttentionBackend:
    name = resolve_backend_name(name, device)
    return _FACTORIES[name]()
