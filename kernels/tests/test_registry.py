"""Backend resolution: ``auto`` per device and dtype, and errors that name the field."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from specd.kernels import registry
from specd.kernels.registry import (
    CUDA_PREFERENCE,
    BackendCapabilities,
    available_backends,
    missing_backends,
    resolve_backend_name,
)
from specd.kernels.torch_backend import TorchAttentionBackend


def fake_backend(monkeypatch, name, devices=("cpu", "cuda"), dtypes=registry.ALL_DTYPES):
    """Register ``name`` for this test only."""
    caps = BackendCapabilities(name, devices, True, True, dtypes)
    monkeypatch.setitem(registry._CAPABILITIES, name, caps)
    monkeypatch.setitem(registry._FACTORIES, name, TorchAttentionBackend)


def test_auto_on_cpu_is_the_c_kernel_for_its_dtypes_and_torch_for_the_rest():
    assert "cpu" in available_backends(), missing_backends().get("cpu")
    assert resolve_backend_name("auto", "cpu") == "cpu"
    assert resolve_backend_name("auto", "cpu", torch.bfloat16) == "cpu"
    assert resolve_backend_name("auto", "cpu", torch.float16) == "torch"
    with pytest.raises(ValueError, match="spec.attentionBackend.*'cpu' does not run on cuda"):
        resolve_backend_name("cpu", "cuda")


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float32])
def test_auto_on_cuda_is_the_first_installed_backend_for_the_dtype(dtype):
    backends = available_backends()
    want = next(
        name
        for name in CUDA_PREFERENCE
        if name in backends
        and "cuda" in backends[name].devices
        and (dtype is None or dtype in backends[name].dtypes)
    )
    assert resolve_backend_name("auto", "cuda", dtype) == want


def test_auto_prefers_flashinfer_then_triton(monkeypatch):
    fake_backend(monkeypatch, "flashinfer", ("cuda",), (torch.bfloat16, torch.float16))
    fake_backend(monkeypatch, "triton", ("cuda",))
    assert resolve_backend_name("auto", "cuda", torch.bfloat16) == "flashinfer"
    assert resolve_backend_name("auto", "cuda", torch.float32) == "triton"  # not flashinfer's
    monkeypatch.delitem(registry._CAPABILITIES, "triton")
    assert resolve_backend_name("auto", "cuda", torch.float32) == "torch"


def test_auto_skips_a_backend_without_the_paged_tree_when_the_spec_needs_it(monkeypatch):
    monkeypatch.setitem(
        registry._CAPABILITIES,
        "flashinfer",
        BackendCapabilities("flashinfer", ("cuda",), True, False, (torch.bfloat16,)),
    )
    monkeypatch.setitem(registry._FACTORIES, "flashinfer", TorchAttentionBackend)
    fake_backend(monkeypatch, "triton", ("cuda",))
    assert resolve_backend_name("auto", "cuda", torch.bfloat16) == "flashinfer"
    assert resolve_backend_name("auto", "cuda", torch.bfloat16, paged_tree=True) == "triton"


def test_a_dtype_the_backend_cannot_compute_in_names_the_field(monkeypatch):
    fake_backend(monkeypatch, "half-only", dtypes=(torch.bfloat16,))
    assert resolve_backend_name("half-only", "cpu", torch.bfloat16) == "half-only"
    with pytest.raises(ValueError, match=r"spec.model.dtype: .*half-only.* float32.*bfloat16"):
        resolve_backend_name("half-only", "cpu", torch.float32)


def test_a_missing_backend_names_the_install_step():
    if "flashinfer" in available_backends():
        pytest.skip("flashinfer is installed here")
    with pytest.raises(ValueError, match=r"spec.attentionBackend: .*flashinfer.*pip install"):
        resolve_backend_name("flashinfer", "cuda")


def test_a_backend_for_another_device_is_refused(monkeypatch):
    fake_backend(monkeypatch, "gpu-only", ("cuda",))
    with pytest.raises(ValueError, match=r"does not run on cpu; backends for cpu: .*torch"):
        resolve_backend_name("gpu-only", "cpu")


def test_head_sizes_a_backend_cannot_run_steer_auto_and_refuse_it_by_name(monkeypatch):
    monkeypatch.setitem(
        registry._CAPABILITIES,
        "flashinfer",
        BackendCapabilities(
            "flashinfer", ("cuda",), True, True, (torch.bfloat16,), head_dims=(64, 128, 256)
        ),
    )
    monkeypatch.setitem(registry._FACTORIES, "flashinfer", TorchAttentionBackend)
    fake_backend(monkeypatch, "triton", ("cuda",))
    bf16 = torch.bfloat16
    assert resolve_backend_name("auto", "cuda", bf16, head_dims=[128, 128]) == "flashinfer"
    assert resolve_backend_name("auto", "cuda", bf16, head_dims=[128, 96]) == "triton"  # draft
    assert resolve_backend_name("flashinfer", "cuda", bf16, head_dims=[64]) == "flashinfer"
    with pytest.raises(
        ValueError, match=r"runs head sizes \[64, 128, 256\]; this model has \[16\]"
    ):
        resolve_backend_name("flashinfer", "cuda", bf16, head_dims=[16])
    assert resolve_backend_name("triton", "cuda", bf16, head_dims=[16]) == "triton"  # any size


def test_missing_backends_say_why():
    """A built-in backend that cannot load here is listed with the import error and the
    fix, and is never also available (flashinfer: not installed on CPU machines)."""
    missing = missing_backends()
    assert not set(missing) & set(available_backends())
    if importlib.util.find_spec("flashinfer") is None:
        assert "No module named 'flashinfer'" in missing["flashinfer"]
        assert "pip install 'specd[gpu]'" in missing["flashinfer"]
