"""The split-K kernels compile for an H100/H200 (sm_90) without a GPU: Triton's front end
type-checks what the interpreter runs unchecked (a runtime branch may not retype a
variable, for one). The compile runs in a child process without TRITON_INTERPRET, which
must be unset before triton is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _compile_all() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.triton._fp8_linear_kernels import fp8_block_linear_kernel
    from kernels.triton._matmul_kernels import fixed_matmul_kernel

    target = GPUTarget("cuda", 90, 32)

    def build(fn, signature: dict, constants: dict) -> None:
        signature = {k: "constexpr" if k in constants else v for k, v in signature.items()}
        names = list(signature)
        consts = {(names.index(k),): v for k, v in constants.items()}
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=target)

    i32 = "i32"
    fp8 = dict(x_ptr="*bf16", xs_ptr="*bf16", w_ptr="*fp8e4nv", ws_ptr="*fp32", y_ptr="*bf16",
               part_ptr="*fp32", counters_ptr="*i32", M=i32, N=i32, K=i32, stride_xm=i32,
               stride_wn=i32, stride_wsn=i32, stride_xsm=i32, SPLIT_K=i32, SCALE_E8M0="",
               NATIVE_FP8="", BLOCK_M="", BLOCK_N="", BLOCK_K="", F32_DOT="", SWAP_AB="")  # fmt: skip
    for swap in (False, True):
        meta = dict(SCALE_E8M0=True, NATIVE_FP8=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128,
                    F32_DOT=False, SWAP_AB=swap)  # fmt: skip
        build(fp8_block_linear_kernel, fp8, meta)  # SPLIT_K a runtime value
        build(fp8_block_linear_kernel, fp8, dict(meta, SPLIT_K=1))
    mm = dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", part_ptr="*fp32", counters_ptr="*i32",
              M=i32, N=i32, K=i32, stride_as=i32, stride_am=i32, stride_ak=i32, stride_bs=i32,
              stride_bn=i32, stride_bk=i32, stride_cp=i32, stride_cs=i32, stride_cm=i32,
              BLOCK_M="", BLOCK_N="", BLOCK_K="", SPLIT_K="", INLINE="", IEEE="",
              F32_DOT="")  # fmt: skip
    for split, inline in ((4, 0), (4, 1), (1, 0)):
        build(fixed_matmul_kernel, mm, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, SPLIT_K=split,
                                            INLINE=inline, IEEE=False, F32_DOT=False))  # fmt: skip
    print("compiled")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine compiles them for real")
def test_split_k_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


if __name__ == "__main__":
    _compile_all()
