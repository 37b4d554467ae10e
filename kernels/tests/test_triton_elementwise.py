"""The decoder layer's one-launch Triton kernels (RMSNorm, SiLU-and-mul, RoPE) against
the eager torch code they replace: RoPE bit-identical, the others to the last float32 bit
or the dtype's rounding.  On CPU they run in Triton's interpreter."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from specd.kernels import triton_elementwise as te  # noqa: E402
from specd.kernels.triton_backend import triton_devices  # noqa: E402
from specd.workers.model.config import RopeConfig  # noqa: E402
from specd.workers.model.llama import RMSNorm  # noqa: E402
from specd.workers.model.rope import RotaryEmbedding, apply_rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter truncates float32 -> bf16 where a GPU rounds to nearest even: bf16 is
# checked on the GPU
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
# RMSNorm's mean and SiLU's exp may round differently in float32; in bf16 that can move
# an output by one bf16 ulp
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=0, rtol=2**-7)}

if DEVICE == "cpu" and DEVICE not in triton_devices():
    pytest.skip("Triton on CPU needs TRITON_INTERPRET=1", allow_module_level=True)


def _randn(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 96), (3, 1000)])
def test_rms_norm_matches_the_eager_norm(dtype, rows, hidden):
    norm = RMSNorm(hidden, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(hidden, dtype=dtype, seed=1))
    wide = _randn(rows, hidden + 8, dtype=dtype)
    x = wide[:, 4 : 4 + hidden]  # strided rows, as a slice of a wider activation
    got = te.rms_norm(x, norm.weight, norm.eps)
    assert got.shape == (rows, hidden) and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, norm(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 48), (4, 1100)])
def test_silu_and_mul_matches_eager(dtype, rows, inter):
    gate_up = _randn(rows, 2 * inter, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = te.silu_and_mul(gate_up)
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, F.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 64), (40, 8, 64)])
def test_rotary_is_bit_identical_to_eager_on_a_fused_qkv_view(dtype, heads, kv_heads, head_dim):
    """The model rotates q|k as a strided view of the fused projection's output."""
    n = 5
    qkv = _randn(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(n, heads + kv_heads, head_dim)
    rope = RotaryEmbedding(head_dim, RopeConfig(theta=10000.0))
    positions = torch.tensor([0, 1, 7, 300, 4095], device=DEVICE)
    cos, sin = rope(positions, dtype)
    got = te.rotary(qk, cos, sin)
    assert got.is_contiguous() and got.shape == qk.shape
    assert torch.equal(got, apply_rotary(qk, cos, sin))


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 32, device=DEVICE)
    assert te.rms_norm(x, torch.ones(32, device=DEVICE), 1e-6).shape == (0, 32)
    assert te.silu_and_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)
    cos = torch.empty(0, 16, device=DEVICE)
    assert te.rotary(torch.empty(0, 2, 16, device=DEVICE), cos, cos).shape == (0, 2, 16)
