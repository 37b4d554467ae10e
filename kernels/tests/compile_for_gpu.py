"""Compile every Triton kernel of specd for a CUDA target without a GPU (Triton's NVIDIA
backend and its bundled ptxas): ``python compile_for_gpu.py [arch ...]`` (default 90).
Exit 0: all compiled; 1: a kernel failed; 2: this Triton build cannot target CUDA.
Run without ``TRITON_INTERPRET`` (kernels defined for the interpreter cannot compile).

Each case is one specialization the launchers really use: argument types in order
(``None``: an optional pointer left out), then the constexprs.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from specd.kernels import triton_attention, triton_elementwise, triton_ops

_STRIDES = "i32 " * 8
EXTEND = "*{t} *{t} *{t} *{t} *i64 *i64 *i64 {mask} fp32 " + _STRIDES
DECODE = "*{t} *{t} *{t} *fp32 *fp32 *i64 *i64 *i64 fp32 " + "i32 " * 6
REDUCE = "*fp32 *fp32 *{t} *i64 i32 i32 i32"
CASES = [
    (triton_ops, "_tree_structure_kernel", "*i64 *i64 *u8 *i64 *i64 i32", dict(BLOCK_I=64, BLOCK_T=64)),
    (triton_ops, "_tree_structure_kernel", "*i64 *i64 *u8 *i64 *i64 i32", dict(BLOCK_I=16, BLOCK_T=256)),
    (triton_ops, "_greedy_walk_kernel", "*i64 *i64 *i64 *i64 *i64 i32 i32", {}),
    (triton_ops, "_verify_mask_kernel", "*u8 *i64 *u8 i32 i32", dict(BLOCK=1024)),
    (triton_ops, "_gather_row_slots_kernel", "*i64 i32 *i64 *i64 *i64 *i64 *i64", dict(R=2, E=3, BLOCK=1024)),
    (triton_ops, "_gather_row_slots_kernel", "*i32 i64 *i64 *i64 *i64 *i64 *i64", dict(R=1, E=0, BLOCK=256)),
    (triton_ops, "_gather_row_slots_kernel", "*i64 i32 *i64 *i64 *i64 *i64 *i32", dict(R=2, E=4, BLOCK=1024)),
    (triton_ops, "_move_kv_kernel", "*i16 *i64 *i64 i32 i64 i32 i32", dict(BLOCK=1024)),  # bf16, > 2^31
    (triton_ops, "_move_kv_kernel", "*u8 *i64 *i64 i32 i32 i32 i32", dict(BLOCK=16)),  # fp8
    (triton_ops, "_write_req_to_token_kernel", "*i64 i32 *i64 *i64 *i64 *i64", dict(BLOCK=1024)),
    (triton_ops, "_write_req_to_token_kernel", "*i32 i32 *i64 *i64 *i64 *i64", dict(BLOCK=16)),
    (triton_attention, "_extend_kernel", EXTEND.format(t="bf16", mask="None None"),
     dict(GROUP=4, HEAD_DIM=128, MASK_MODE=1, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128)),
    (triton_attention, "_extend_kernel", EXTEND.format(t="bf16", mask="*u8 *i64"),
     dict(GROUP=4, HEAD_DIM=128, MASK_MODE=2, BLOCK_M=32, BLOCK_N=64, BLOCK_D=128)),
    (triton_attention, "_extend_kernel", EXTEND.format(t="fp32", mask="*u8 *i64"),
     dict(GROUP=3, HEAD_DIM=80, MASK_MODE=2, BLOCK_M=64, BLOCK_N=32, BLOCK_D=128)),
    (triton_attention, "_decode_split_kernel", DECODE.format(t="bf16"),
     dict(GROUP=4, HEAD_DIM=128, BLOCK_M=16, BLOCK_N=64, BLOCK_D=128)),
    (triton_attention, "_decode_split_kernel", DECODE.format(t="fp32"),
     dict(GROUP=1, HEAD_DIM=24, BLOCK_M=16, BLOCK_N=64, BLOCK_D=32)),
    (triton_attention, "_decode_reduce_kernel", REDUCE.format(t="bf16"),
     dict(HEAD_DIM=128, BLOCK_S=16, BLOCK_D=128)),
    (triton_elementwise, "_rms_norm_kernel", "*bf16 *bf16 *bf16 i32 i32 fp32", dict(BLOCK_H=4096)),
    (triton_elementwise, "_rms_norm_kernel", "*fp32 *fp32 *fp32 i32 i32 fp32", dict(BLOCK_H=512)),
    (triton_elementwise, "_silu_and_mul_kernel", "*bf16 *bf16 i32 i32", dict(BLOCK=1024)),
    (triton_elementwise, "_rotary_kernel", "*bf16 *bf16 *bf16 *bf16 i32 i32 i32", dict(D=128, BLOCK=1024)),
    (triton_elementwise, "_rotary_kernel", "*fp32 *fp32 *fp32 *fp32 i32 i32 i32", dict(D=64, BLOCK=1024)),
]  # fmt: skip


def compile_case(module, name: str, types: str, constexprs: dict, arch: int) -> None:
    fn = getattr(module, name)
    runtime = iter(types.split())
    signature, constants = {}, dict(constexprs)
    for arg in fn.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
            continue
        kind = next(runtime)
        signature[arg] = "constexpr" if kind == "None" else kind
        if kind == "None":
            constants[arg] = None
    compiled = triton.compile(
        ASTSource(fn, signature, constants), target=GPUTarget("cuda", arch, 32)
    )
    assert compiled.asm["cubin"], name


def main(archs: list[int]) -> int:
    if not isinstance(triton_ops._move_kv_kernel, triton.JITFunction):
        print("kernels were defined for the interpreter (TRITON_INTERPRET is set)")
        return 1
    failed = 0
    for arch in archs:
        for module, name, types, constexprs in CASES:
            try:
                compile_case(module, name, types, constexprs, arch)
            except RuntimeError as err:  # e.g. no ptxas in this Triton build
                if "ptxas" in str(err):
                    print(f"Triton cannot target CUDA here: {err}")
                    return 2
                raise
            except Exception as err:  # noqa: BLE001  (report every kernel, then fail)
                failed += 1
                print(f"sm_{arch} {name} {constexprs}: {type(err).__name__}: {err}")
    print(f"compiled {len(CASES) * len(archs) - failed} of {len(CASES) * len(archs)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [90]))
