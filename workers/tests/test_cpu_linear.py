"""oneDNN pre-packed linear layers match nn.Linear, swap in place, and are used from the
row count where this machine's timing says they pay."""

import pytest
import torch
from torch import nn
from torch.profiler import profile

from specd.workers.model.cpu_linear import (
    PackedLinear,
    packed_from_rows,
    prepack_linears,
    prepack_supported,
)

pytestmark = pytest.mark.skipif(
    not prepack_supported(torch.float32), reason="this torch build has no oneDNN packing"
)


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_matches_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(64, 96, bias=bias)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), atol=1e-5, rtol=1e-5)


def test_prepack_swaps_every_linear_and_skips_unsupported_dtypes():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    assert prepack_linears(model, always=True) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    half = nn.Sequential(nn.Linear(8, 8)).half()
    assert prepack_linears(half) == 0 and isinstance(half[0], nn.Linear)


def test_bf16_is_packed_only_where_this_cpu_can_and_still_runs_where_it_cannot():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16)).to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = model(x)
        packed = prepack_linears(model, always=True)
        assert packed == (1 if prepack_supported(torch.bfloat16) else 0)
        assert isinstance(model[0], PackedLinear) == bool(packed)
        torch.testing.assert_close(model(x), expected, atol=2e-2, rtol=2e-2)


def _ran_packed(layer: PackedLinear, rows: int) -> bool:
    with torch.inference_mode(), profile() as prof:
        layer(torch.randn(rows, layer.in_features))
    return any(e.name == "mkldnn::_linear_pointwise" for e in prof.events())


@pytest.mark.parametrize("bias", [True, False])
def test_packed_weight_is_used_from_its_row_count(bias):
    """Below ``from_rows`` the plain weight runs (F.linear), from it the packed one;
    both give nn.Linear's result.  Packed from row 1 keeps no plain copy."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 48, bias=bias)
    layer = PackedLinear(linear, from_rows=8)
    assert [_ran_packed(layer, rows) for rows in (1, 7, 8, 40)] == [False, False, True, True]
    with torch.inference_mode():
        for rows in (3, 8):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(layer(x), linear(x), atol=1e-5, rtol=1e-5)
    assert PackedLinear(linear).weight is None and _ran_packed(PackedLinear(linear), 1)


def test_measured_packing_follows_the_timed_decision_per_shape():
    """Default prepacking times each weight shape once per process (cached) and packs a
    layer only where packing won: a model's layers of one shape share the decision."""
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64), nn.Linear(64, 256))
    decisions = [packed_from_rows(torch.float32, m.in_features, m.out_features) for m in model]
    assert all(d in (None, 1, 8, 32) for d in decisions)
    swapped = prepack_linears(model)
    assert swapped == sum(d is not None for d in decisions)
    for layer, decision in zip(model, decisions, strict=True):
        assert isinstance(layer, PackedLinear) == (decision is not None)
        if decision is not None:
            assert layer.from_rows == decision
    assert packed_from_rows.cache_info().hits >= 3
