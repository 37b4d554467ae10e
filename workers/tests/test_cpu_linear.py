"""CPU linear layouts match nn.Linear, swap in place, and follow this machine's timing."""

import pytest
import torch
from torch import nn
from torch.profiler import profile

from specd.workers.model.cpu_linear import (
    LAYOUTS,
    CpuLinear,
    fastest_layout,
    layouts_for,
    native_bfloat16_matmuls,
    prepack_supported,
    relayout_linears,
)


def _layout_that_ran(layer: nn.Module, rows: int) -> str:
    """Which layout's kernel a call ran, from the ops a profiler saw: ``F.linear`` on the
    stored weight, a plain ``mm`` on a pre-transposed one, or oneDNN's packed kernel."""
    with torch.inference_mode(), profile() as prof:
        layer(torch.randn(rows, layer.in_features))
    names = {e.name for e in prof.events()}
    if "mkldnn::_linear_pointwise" in names:
        assert not names & {"aten::linear", "aten::mm", "aten::addmm"}
        return "packed"
    if "aten::linear" in names:
        return "plain"
    assert "aten::mm" in names and "aten::t" not in names  # no transpose per call
    return "transposed"


@pytest.mark.parametrize("layout", layouts_for(torch.float32))
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_every_layout_matches_linear(layout, rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(64, 96, bias=bias)
    x = torch.randn(rows, 64)
    layer = CpuLinear(linear, layout)
    assert _layout_that_ran(layer, rows) == layout
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), linear(x), atol=1e-5, rtol=1e-5)
        x3 = torch.randn(2, rows, 64)  # leading batch dims pass through
        torch.testing.assert_close(layer(x3), linear(x3), atol=1e-5, rtol=1e-5)


def test_transposed_layout_holds_one_weight_copy_in_its_own_layout():
    linear = nn.Linear(32, 48)
    layer = CpuLinear(linear, "transposed")
    assert layer.weight.shape == (32, 48) and layer.weight.is_contiguous()
    assert [name for name, _ in layer.named_parameters()] == []  # plain tensors, one copy
    with pytest.raises(ValueError, match="unknown CPU linear layout 'tiled'"):
        CpuLinear(linear, "tiled")


def test_relayout_swaps_every_linear_and_skips_packing_where_unsupported():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    assert relayout_linears(model, "transposed") == 2
    assert isinstance(model[0], CpuLinear) and model[2][0].layout == "transposed"
    half = nn.Sequential(nn.Linear(8, 8)).half()
    assert relayout_linears(half, "packed") == 0 and isinstance(half[0], nn.Linear)
    with pytest.raises(ValueError, match="one of"):
        relayout_linears(nn.Sequential(nn.Linear(8, 8)), "tiled")


def test_bf16_is_packed_only_where_this_cpu_can_and_still_runs_where_it_cannot():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16)).to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = model(x)
        packed = relayout_linears(model, "packed")
        assert packed == (1 if prepack_supported(torch.bfloat16) else 0)
        assert isinstance(model[0], CpuLinear) == bool(packed)
        torch.testing.assert_close(model(x), expected, atol=2e-2, rtol=2e-2)


def test_default_layout_follows_the_timed_decision_per_shape():
    """Default relayout times each weight shape once per process (cached): a model's
    layers of one shape share the decision, and a layer timed fastest ``plain`` stays an
    ``nn.Linear``."""
    fastest_layout.cache_clear()
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64), nn.Linear(64, 256))
    usable = layouts_for(torch.float32)
    decisions = [
        fastest_layout(torch.float32, m.in_features, m.out_features, usable) for m in model
    ]
    assert set(decisions) <= set(layouts_for(torch.float32)) <= set(LAYOUTS)
    assert decisions[0] == decisions[2]
    swapped = relayout_linears(model)
    assert swapped == sum(d != "plain" for d in decisions)
    for layer, decision in zip(model, decisions, strict=True):
        if decision == "plain":
            assert type(layer) is nn.Linear
        else:
            assert layer.layout == decision
            assert _layout_that_ran(layer, 4) == decision
    assert fastest_layout.cache_info().hits >= 3 and fastest_layout.cache_info().misses == 2


@pytest.mark.parametrize("value", ["true", "TRUE", " 1 "])
def test_openmp_dynamic_teams_keep_weights_out_of_the_packed_layout(monkeypatch, value):
    """With OMP_DYNAMIC on, oneDNN's packed matmul computes wrong values on a loaded
    machine (cpu_linear.openmp_shrinks_teams): no layer is timed, asked or swapped into it."""
    monkeypatch.setenv("OMP_DYNAMIC", value)
    assert "packed" not in layouts_for(torch.float32)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64))
    assert relayout_linears(model, "packed") == 0
    assert all(type(m) is nn.Linear for m in model)
    relayout_linears(model)
    assert all(getattr(m, "layout", "plain") != "packed" for m in model)
    monkeypatch.setenv("OMP_DYNAMIC", "false")
    assert layouts_for(torch.float32) == (
        LAYOUTS if prepack_supported(torch.float32) else LAYOUTS[:2]
    )


FEATURE_CHECKS = ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_cpu_support_amx_tile")


def test_a_torch_without_the_cpu_feature_checks_reads_as_no_native_bfloat16(monkeypatch):
    """torch's CPU feature checks are private and renamed across the versions specd
    accepts: where this torch has none of them, native bfloat16 reads as absent (an auto
    draft stays float32) instead of failing the engine's start; an older torch's AMX
    check still counts."""
    for check in FEATURE_CHECKS:
        monkeypatch.delattr(torch.cpu, check, raising=False)
    assert native_bfloat16_matmuls.__wrapped__() is False
    monkeypatch.setattr(torch.cpu, "_is_cpu_support_amx_tile", lambda: True, raising=False)
    assert native_bfloat16_matmuls.__wrapped__() is True
