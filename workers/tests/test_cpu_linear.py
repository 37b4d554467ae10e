"""oneDNN pre-packed linear layers match nn.Linear and swap in place."""

import pytest
import torch
from torch import nn

from specd.workers.model.cpu_linear import PackedLinear, prepack_linears, prepack_supported

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
    assert prepack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    half = nn.Sequential(nn.Linear(8, 8)).half()
    assert prepack_linears(half) == 0 and isinstance(half[0], nn.Linear)


def test_bf16_is_packed_only_where_this_cpu_can_and_still_runs_where_it_cannot():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16)).to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = model(x)
        packed = prepack_linears(model)
        assert packed == (1 if prepack_supported(torch.bfloat16) else 0)
        assert isinstance(model[0], PackedLinear) == bool(packed)
        torch.testing.assert_close(model(x), expected, atol=2e-2, rtol=2e-2)
