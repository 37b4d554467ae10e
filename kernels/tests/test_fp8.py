"""FP8 weights and GEMMs (``specd.kernels.fp8``, kernels in ``specd.kernels.triton_fp8``):
the published scale layouts round-trip within e4m3's rounding, the activation quantizer
is the same on every device, and the GEMMs equal "quantize the activation the same way,
dequantize both, multiply exactly" to the output dtype's rounding.  The block GEMM
kernel also runs on CPU through Triton's interpreter (float32 output: the interpreter
truncates float32 -> bf16, and its float32 -> fp8 cast does not carry a rounding into the
exponent, so CPU quantizes in torch); bf16, ``torch._scaled_mm``, the CUDA quantizer and
graph capture are checked on a GPU with FP8 (capability 8.9+).  Without Triton the
torch side still imports and runs (a CPU install dequantizes FP8 checkpoints with it)."""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from specd.kernels import fp8

try:
    from specd.kernels import triton_fp8
    from specd.kernels.triton_backend import triton_devices

    TRITON_DEVICES = triton_devices()
except ImportError:  # no Triton: the kernel tests skip, the torch ones still run
    triton_fp8, TRITON_DEVICES = None, ()

HAS_FP8_GPU = fp8.fp8_gemm_available("cuda") if torch.cuda.is_available() else False
needs_fp8_gpu = pytest.mark.skipif(
    not HAS_FP8_GPU, reason="needs a CUDA GPU with FP8 (capability 8.9+)"
)
# where the block kernel runs here: an FP8 GPU, else CPU through the interpreter
KERNEL_DEVICE = "cuda" if HAS_FP8_GPU else "cpu"
E4M3_STEP = 2**-4  # e4m3 rounds to within 2^-4 of a value's magnitude (3 mantissa bits)
# the float32 output's error, relative to its largest value: near float32's rounding,
# except that Hopper's FP8 tensor cores (wgmma, the 64-row tiles) accumulate a dot with
# ~14 mantissa bits: measured 1.8e-4 on an H200 for K = 128 steps; CPU, 1e-7
KERNEL_ATOL = 2**-11 if KERNEL_DEVICE == "cuda" else 1e-5


def _randn(*shape, seed=0, scale=1.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device)


def _block_amax(scale_inv, shape, block):
    """Each element's block amax (``scale * 448``), as an [out, in] tensor."""
    ones = torch.ones(shape, dtype=fp8.FP8_DTYPE, device=scale_inv.device)
    return fp8.dequantize_block(ones, scale_inv, block, torch.float32) * fp8.FP8_MAX


def _fp8_values(shape, seed=0):
    """Random e4m3 values (exactly representable), each row holding +-448."""
    values = (_randn(*shape, seed=seed) * 100).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE)
    values[:, ::16] = fp8.FP8_MAX  # every block of >= 16 columns holds the top value
    return values


# ---- weights: the writers' side and the loader's side ------------------------------


@pytest.mark.parametrize(
    "shape,block",
    [((64, 64), (32, 32)), ((70, 100), (32, 32)), ((200, 300), (128, 128)), ((5, 40), (16, 32))],
    ids=["whole-blocks", "partial-both", "published-128", "one-partial-row-block"],
)
def test_block_round_trip_is_within_e4m3_rounding(shape, block):
    weight = _randn(*shape, scale=0.05) * torch.linspace(0.1, 3.0, shape[1])  # uneven blocks
    weight_fp8, scale_inv = fp8.quantize_block(weight, block)
    rows, cols = -(-shape[0] // block[0]), -(-shape[1] // block[1])
    assert weight_fp8.dtype == fp8.FP8_DTYPE and weight_fp8.shape == shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (rows, cols)
    back = fp8.dequantize_block(weight_fp8, scale_inv, block, torch.float32)
    err = (back - weight).abs()
    assert (err <= E4M3_STEP * _block_amax(scale_inv, shape, block)).all()
    blocks = fp8._as_blocks(err, block).norm(dim=(1, 3))  # [R, C]
    assert (blocks <= 2**-3 * fp8._as_blocks(weight, block).norm(dim=(1, 3))).all()
    assert (
        fp8.dequantize_block(weight_fp8, scale_inv, block, torch.bfloat16).dtype == torch.bfloat16
    )


def test_a_partial_block_is_scaled_by_its_own_values_only():
    weight = _randn(70, 100)
    weight[64:, 96:] *= 0.01  # the corner block: 6 x 4 values, much smaller than the rest
    _, scale_inv = fp8.quantize_block(weight, (32, 32))
    corner = weight[64:, 96:].abs().max() / fp8.FP8_MAX
    assert scale_inv.shape == (3, 4)
    torch.testing.assert_close(scale_inv[2, 3], corner, rtol=0, atol=0)


@pytest.mark.parametrize("power", [0, -5, 3])
def test_representable_blocks_survive_bit_for_bit(power):
    """A block of e4m3 values topping out at 448 * 2^p gets scale 2^p and its own bits."""
    values = _fp8_values((64, 96))
    weight = values.float() * 2.0**power
    weight_fp8, scale_inv = fp8.quantize_block(weight, (32, 32))
    assert torch.equal(weight_fp8.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(scale_inv, torch.full((2, 3), 2.0**power))
    assert torch.equal(fp8.dequantize_block(weight_fp8, scale_inv, (32, 32), torch.float32), weight)
    channel_fp8, channel_scale = fp8.quantize_channel(weight, per_tensor=False)
    assert torch.equal(channel_fp8.view(torch.uint8), values.view(torch.uint8))


def test_zero_blocks_get_a_positive_scale_and_zeros():
    weight = torch.zeros(40, 40)
    weight[:32, :32] = 1.0
    weight_fp8, scale_inv = fp8.quantize_block(weight, (32, 32))
    assert (scale_inv > 0).all() and torch.isfinite(scale_inv).all()
    assert torch.equal(fp8.dequantize_block(weight_fp8, scale_inv, (32, 32), torch.float32), weight)


def test_a_misshapen_block_scale_is_refused_with_the_shapes():
    weight_fp8, scale_inv = fp8.quantize_block(_randn(70, 100), (32, 32))
    with pytest.raises(ValueError, match=r"needs \[3, 4\]"):
        fp8.dequantize_block(weight_fp8, scale_inv[:, :3], (32, 32), torch.float32)


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per-channel", "per-tensor"])
def test_channel_round_trip_and_every_published_scale_shape(per_tensor):
    weight = _randn(48, 80, scale=0.05) * torch.linspace(0.1, 3.0, 48)[:, None]
    weight_fp8, scale = fp8.quantize_channel(weight, per_tensor=per_tensor)
    assert scale.dtype == torch.float32 and scale.shape == ((1,) if per_tensor else (48, 1))
    back = fp8.dequantize_channel(weight_fp8, scale, torch.float32)
    amax = weight.abs().amax() if per_tensor else weight.abs().amax(dim=1, keepdim=True)
    assert ((back - weight).abs() <= E4M3_STEP * amax).all()
    shapes = [(), (1,)] if per_tensor else [(48,), (48, 1)]
    for shape in shapes:
        same = fp8.dequantize_channel(weight_fp8, scale.reshape(shape), torch.float32)
        assert torch.equal(same, back)
    assert fp8.dequantize_channel(weight_fp8, scale, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(47,), (48, 2), (1, 48)])
def test_a_misshapen_channel_scale_is_refused(shape):
    weight_fp8, _ = fp8.quantize_channel(_randn(48, 80), per_tensor=False)
    with pytest.raises(ValueError, match="weight_scale has shape"):
        fp8.dequantize_channel(weight_fp8, torch.ones(shape), torch.float32)


@pytest.mark.parametrize(
    "block,supported",
    [
        ((128, 128), True), ((32, 32), True), ((16, 32), True), ((256, 256), True),
        ((64, 16), False), ((128, 512), False), ((96, 128), False), ((8, 128), False),
        ((128,), False), ((128.0, 128), False),
    ],
)  # fmt: skip
def test_supported_block_sizes(block, supported):
    assert fp8.supported_block(block) is supported


# ---- activations ---------------------------------------------------------------------


@pytest.mark.parametrize("k,group", [(256, 128), (100, 32), (100, 100)])
def test_per_token_group_quant_scales_each_group_by_its_amax(k, group):
    x = _randn(5, k, scale=3.0) * torch.linspace(0.01, 10, k)
    x[3] = 0.0  # a zero token
    x_fp8, scales = fp8.per_token_group_quant(x.to(torch.bfloat16), group)
    num_groups = -(-k // group)
    assert x_fp8.shape == (5, k) and scales.shape == (5, num_groups)
    groups = fp8._as_blocks(x.to(torch.bfloat16).float(), (1, group))  # [5, 1, G, group]
    amax = groups.abs().amax(dim=(1, 3))
    live = amax > 0
    assert torch.equal(scales[live], amax[live] / fp8.FP8_MAX)
    assert (scales[3] > 0).all() and (x_fp8[3].float() == 0).all()
    top = fp8._as_blocks(x_fp8.float().abs(), (1, group)).amax(dim=(1, 3))
    assert (top[live] == fp8.FP8_MAX).all()  # every group uses the whole e4m3 range
    back = fp8.dequantize_block(x_fp8, scales, (1, group), torch.float32)
    bound = E4M3_STEP * _block_amax(scales, (5, k), (1, group))
    assert ((back - x.to(torch.bfloat16).float()).abs() <= bound).all()


def _exact_reference(x, weight_fp8, scale_inv, block, bias, x_fp8=None, x_scales=None):
    """float64 product of the dequantized sides (x quantized per ``block[1]`` group)."""
    if x_fp8 is None:
        x_fp8, x_scales = fp8.per_token_group_quant(x, block[1])
    x_real = fp8.dequantize_block(x_fp8, x_scales, (1, block[1]), torch.float64)
    w_real = fp8.dequantize_block(weight_fp8, scale_inv, block, torch.float64)
    return F.linear(x_real, w_real, None if bias is None else bias.double())


# ---- the block GEMM kernel (CPU: interpreter) -----------------------------------------

kernel_runs_here = pytest.mark.skipif(
    KERNEL_DEVICE not in TRITON_DEVICES,
    reason="needs Triton (pip install 'specd[gpu]'); on CPU, TRITON_INTERPRET=1",
)


@kernel_runs_here
@pytest.mark.parametrize("m", [1, 7, 20, 70], ids=lambda m: f"M{m}")  # each tile config
@pytest.mark.parametrize(
    "k,n,block",
    [(96, 80, (32, 32)), (100, 70, (32, 32)), (64, 96, (128, 128)), (300, 200, (64, 256))],
    ids=["partial-N", "ragged-K", "one-partial-block", "two-K-steps-per-group"],
)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_block_gemm_kernel_equals_the_exact_product(m, k, n, block, with_bias):
    x = _randn(m, k, seed=m, device=KERNEL_DEVICE)
    weight_fp8, scale_inv = fp8.quantize_block(_randn(n, k, seed=1, scale=0.05), block)
    weight_fp8, scale_inv = weight_fp8.to(KERNEL_DEVICE), scale_inv.to(KERNEL_DEVICE)
    bias = _randn(n, seed=2, device=KERNEL_DEVICE) if with_bias else None
    x_fp8, x_scales = fp8.per_token_group_quant(x, block[1])
    got = triton_fp8.fp8_block_gemm(
        x_fp8, x_scales, weight_fp8, scale_inv, block, bias, torch.float32
    )
    want = _exact_reference(x, weight_fp8, scale_inv, block, bias, x_fp8, x_scales)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=KERNEL_ATOL * want.abs().max())


@kernel_runs_here
@pytest.mark.parametrize(
    "m,k,n,block,split_k",
    [(7, 300, 200, (64, 256), 3), (1, 512, 80, (32, 32), 5), (20, 100, 70, (32, 32), 2)],
    ids=["a-step-each", "5-asked-4-made", "ragged-K"],
)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_split_k_sums_the_splits_to_the_unsplit_result(m, k, n, block, split_k, with_bias):
    x = _randn(m, k, seed=m, device=KERNEL_DEVICE)
    weight_fp8, scale_inv = fp8.quantize_block(_randn(n, k, seed=1, scale=0.05), block)
    weight_fp8, scale_inv = weight_fp8.to(KERNEL_DEVICE), scale_inv.to(KERNEL_DEVICE)
    bias = _randn(n, seed=2, device=KERNEL_DEVICE) if with_bias else None
    x_fp8, x_scales = fp8.per_token_group_quant(x, block[1])
    args = (x_fp8, x_scales, weight_fp8, scale_inv, block, bias, torch.float32)
    split = triton_fp8.fp8_block_gemm(*args, split_k=split_k)
    whole = triton_fp8.fp8_block_gemm(*args, split_k=1)
    want = _exact_reference(x, weight_fp8, scale_inv, block, bias, x_fp8, x_scales)
    atol = 1e-5 * want.abs().max().item()
    torch.testing.assert_close(split.double(), want, rtol=1e-5, atol=atol)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=atol)
    assert torch.equal(split, triton_fp8.fp8_block_gemm(*args, split_k=split_k))  # deterministic


@pytest.mark.skipif(triton_fp8 is None, reason="needs Triton (pip install 'specd[gpu]')")
@pytest.mark.parametrize(
    "programs,k_steps,target,splits",
    [(896, 32, 528, 1), (128, 112, 528, 5), (128, 32, 528, 5), (16, 12, 528, 3), (4, 3, 528, 1)],
)
def test_split_k_fills_the_gpu_but_keeps_splits_long(programs, k_steps, target, splits):
    assert triton_fp8.choose_split_k(programs, k_steps, target) == splits


@kernel_runs_here
def test_block_gemm_kernel_reads_one_scale_per_output_row_for_channel_weights():
    """``fp8_channel_linear``'s fallback: block (1, K), one K group whatever K is."""
    x = _randn(5, 100, device=KERNEL_DEVICE)
    weight_fp8, scale = fp8.quantize_channel(_randn(70, 100, seed=1), per_tensor=False)
    weight_fp8, scale = weight_fp8.to(KERNEL_DEVICE), scale.to(KERNEL_DEVICE)
    x_fp8, x_scales = fp8.per_token_group_quant(x, 100)
    got = triton_fp8.fp8_block_gemm(
        x_fp8, x_scales, weight_fp8, scale, (1, 100), None, torch.float32
    )
    want = _exact_reference(x, weight_fp8, scale, (1, 100), None, x_fp8, x_scales)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=KERNEL_ATOL * want.abs().max())


# ---- the linears on CPU: the torch path ------------------------------------------------


def test_channel_math_is_torch_scaled_mm_with_row_wise_scales():
    """Our reading of per-token x scales and per-row weight scales is ``_scaled_mm``'s
    (torch runs it on CPU too): an independent check of the layout."""
    x = _randn(6, 64)
    weight_fp8, scale = fp8.quantize_channel(_randn(48, 64, seed=1), per_tensor=False)
    x_fp8, x_scales = fp8.per_token_group_quant(x, 64)
    try:
        torch_mm = torch._scaled_mm(
            x_fp8, weight_fp8.t(), scale_a=x_scales, scale_b=scale.reshape(1, 48),
            out_dtype=torch.float32,
        )  # fmt: skip
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"this torch has no CPU _scaled_mm: {e}")
    ours = fp8.fp8_channel_linear(x, weight_fp8, scale.reshape(48))
    torch.testing.assert_close(ours, torch_mm, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_linears_on_cpu_approximate_the_unquantized_product_in_any_leading_shape(layout):
    x = _randn(2, 3, 96)
    weight = _randn(80, 96, seed=1, scale=0.05)
    bias = _randn(80, seed=2)
    if layout == "block":
        weight_fp8, scale = fp8.quantize_block(weight, (32, 32))
        got = fp8.fp8_block_linear(x, weight_fp8, scale, (32, 32), bias)
    else:
        weight_fp8, scale = fp8.quantize_channel(weight, per_tensor=False)
        got = fp8.fp8_channel_linear(x, weight_fp8, scale.reshape(80), bias)
    want = F.linear(x, weight, bias)
    assert got.shape == (2, 3, 80) and got.dtype == torch.float32
    assert (got - want).norm() <= 0.05 * want.norm()


NO_TRITON_CHECK = """
import sys

sys.modules["triton"] = None  # a CPU install without the gpu extra: importing it fails
import torch
from specd.kernels import fp8

weight = torch.randn(70, 100, generator=torch.Generator().manual_seed(0)) * 0.05
amax = weight.abs().max().item()
q, scale_inv = fp8.quantize_block(weight, (32, 32))
block_err = (fp8.dequantize_block(q, scale_inv, (32, 32), torch.float32) - weight).abs()
q, scale = fp8.quantize_channel(weight, per_tensor=False)
channel_err = (fp8.dequantize_channel(q, scale, torch.float32) - weight).abs()
x_fp8, x_scales = fp8.per_token_group_quant(weight[:3], 32)
out = fp8.fp8_channel_linear(weight[:3], q, scale.reshape(-1))
print(block_err.max().item() / amax, channel_err.max().item() / amax)
print(x_fp8.dtype == fp8.FP8_DTYPE, tuple(x_scales.shape), tuple(out.shape))
print(fp8.fp8_gemm_available("cpu"), fp8.fp8_gemm_available("cuda"))
print(sys.modules["triton"] is None and "specd.kernels.triton_fp8" not in sys.modules)
"""


def test_the_torch_side_runs_without_triton():
    """A CPU install has no Triton (it is in the ``gpu`` extra): the layouts, the torch
    quantizer and the reference GEMM still work, and no device offers the FP8 GEMMs."""
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(NO_TRITON_CHECK)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    errors, shapes, available, untouched = run.stdout.split("\n")[:4]
    assert all(float(e) <= E4M3_STEP for e in errors.split())
    assert shapes == "True (3, 4) (3, 70)"
    assert available == "False False"
    assert untouched == "True"


# ---- CUDA (capability 8.9+) -------------------------------------------------------------

GPU_M = [1, 7, 64, 300]
# (K, N): square; N = 384 + 64 (a partial 128-row block; still a multiple of 16); N = 200
# (not a multiple of 16: the channel linear's Triton path); K = 4096 (split-K at few rows)
GPU_SHAPES = [(512, 512), (512, 448), (512, 200), (4096, 512)]


def _gpu_case(m, k, n, seed=0):
    x = _randn(m, k, seed=seed, device="cuda").to(torch.bfloat16)
    weight = _randn(n, k, seed=seed + 1, scale=0.05, device="cuda")
    bias = _randn(n, seed=seed + 2, device="cuda").to(torch.bfloat16)
    return x, weight, bias


def _assert_bf16_rounding_of(got, want):
    """Equal to the exact result up to bf16 rounding (and float32 summation order)."""
    assert got.dtype == torch.bfloat16
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=2**-9 * scale)


def _assert_near_unquantized(got, x, weight, bias):
    want = F.linear(x, weight.to(torch.bfloat16), bias).float()
    assert (got.float() - want).norm() <= 0.05 * want.norm()


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("k,group", [(512, 128), (448, 448), (300, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_quantizer_gives_the_torch_bits(k, group, dtype):
    x = (_randn(300, k, scale=4.0) * torch.linspace(0.01, 10, k)).to(dtype)
    x[5] = 0.0
    q_gpu, s_gpu = fp8.per_token_group_quant(x.cuda(), group)
    q_cpu, s_cpu = fp8.per_token_group_quant(x, group)
    assert torch.equal(s_gpu.cpu(), s_cpu)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("m", GPU_M, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("k,n", GPU_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_cuda_block_linear(m, k, n, with_bias):
    x, weight, bias = _gpu_case(m, k, n)
    bias = bias if with_bias else None
    weight_fp8, scale_inv = fp8.quantize_block(weight, (128, 128))
    got = fp8.fp8_block_linear(x, weight_fp8, scale_inv, (128, 128), bias)
    assert got.shape == (m, n)
    _assert_bf16_rounding_of(got, _exact_reference(x, weight_fp8, scale_inv, (128, 128), bias))
    _assert_near_unquantized(got, x, weight, bias)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("m", GPU_M, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("k,n", GPU_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_cuda_channel_linear(m, k, n, with_bias):
    """N = 512, 448: ``_scaled_mm`` (on Hopper); N = 200: the block kernel."""
    x, weight, bias = _gpu_case(m, k, n)
    bias = bias if with_bias else None
    weight_fp8, scale = fp8.quantize_channel(weight, per_tensor=False)
    got = fp8.fp8_channel_linear(x, weight_fp8, scale.reshape(n), bias)
    assert got.shape == (m, n)
    want = _exact_reference(x, weight_fp8, scale, (1, k), bias)
    _assert_bf16_rounding_of(got, want)
    _assert_near_unquantized(got, x, weight, bias)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cuda_linears_in_other_activation_dtypes(dtype):
    """Not bf16: the channel linear runs the block kernel (``_scaled_mm`` row-wise writes
    bf16 only); both return x's dtype."""
    x, weight, bias = _gpu_case(7, 512, 448)
    x, bias = x.to(dtype), bias.to(dtype)
    weight_fp8, scale_inv = fp8.quantize_block(weight, (128, 128))
    block_out = fp8.fp8_block_linear(x, weight_fp8, scale_inv, (128, 128), bias)
    channel_fp8, scale = fp8.quantize_channel(weight, per_tensor=False)
    channel_out = fp8.fp8_channel_linear(x, channel_fp8, scale.reshape(-1), bias)
    for got, want in [
        (block_out, _exact_reference(x, weight_fp8, scale_inv, (128, 128), bias)),
        (channel_out, _exact_reference(x, channel_fp8, scale, (1, 512), bias)),
    ]:
        assert got.dtype == dtype
        torch.testing.assert_close(
            got.double(), want, rtol=2**-10, atol=1e-3 * want.abs().max().item()
        )


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("layout", ["block", "channel"])
@pytest.mark.parametrize("m", [1, 64])
def test_cuda_linears_replay_in_a_cuda_graph(layout, m):
    x, weight, bias = _gpu_case(m, 512, 448)
    if layout == "block":
        weight_fp8, scale = fp8.quantize_block(weight, (128, 128))

        def linear(inp):
            return fp8.fp8_block_linear(inp, weight_fp8, scale, (128, 128), bias)
    else:
        weight_fp8, scale = fp8.quantize_channel(weight, per_tensor=False)
        scale = scale.reshape(-1)

        def linear(inp):
            return fp8.fp8_channel_linear(inp, weight_fp8, scale, bias)

    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        linear(static_x)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = linear(static_x)
    fresh = _randn(m, 512, seed=9, device="cuda").to(torch.bfloat16)
    static_x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, linear(fresh))
