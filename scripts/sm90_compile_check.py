"""Offline check (no GPU needed): compile the decode-path kernels for sm_90 at the engine's
Moonlight launch constants and print each one's registers, spills and shared memory, as
ptxas reports them.

Why: the interpreter runs kernels as Python and never meets the real compiler, so a kernel
can pass every CPU test and still fail to compile (or spill) on the GPU, where device time
is scarce. Run it with the GPU image's triton (a venv with triton 3.6 and a CPU torch):

    /tmp/t36/bin/python scripts/sm90_compile_check.py

A kernel that does not compile raises here with the compiler's message.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.triton import (  # noqa: E402
    _fp8_linear_kernels,
    _mla_decode_kernels,
    _moe_int8_kernels,
    mla_cache,
    moe_prologue,
    mxfp4_dequant,
)

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _signature(fn, pointers: dict, constexprs: dict) -> dict:
    """Every parameter: pointers as given, constexprs, the rest i32 (sizes, strides)."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = pointers.get(name, "fp32" if name in ("scale", "scaling", "eps") else "i32")
    return sig


def _divisible(name: str, kind: str, divisible: frozenset) -> bool:
    """Arguments Triton's launcher specializes as multiples of 16: pointers, and the integer
    arguments a call names as such at the engine's shapes (without them the compiler cannot
    prove 16-byte rows and pipelines no 1-byte or 2-byte load into shared memory)."""
    return kind.startswith("*") or name in divisible


def compile_report(label: str, fn, pointers: dict, constexprs: dict, warps: int, stages: int,
                   divisible: frozenset = frozenset()):  # fmt: skip
    sig = _signature(fn, pointers, constexprs)
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if _divisible(n, sig[n], divisible)}  # fmt: skip
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        out = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", str(ptx), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True)  # fmt: skip
    info = out.stderr + out.stdout
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    print(f"{label:48} regs {regs.group(1) if regs else '?':>4}  "
          f"spill st/ld {spill.group(1) if spill else '?'}/{spill.group(2) if spill else '?'}  "
          f"shared {compiled.metadata.shared} B  "
          f"async copies {compiled.asm['ttgir'].count('async_copy_global_to_local')}")  # fmt: skip


# The MLA decode's strides that are multiples of 16 at Moonlight's shapes (16 heads, 512
# latent + 64 rope, 16-slot pages): all but the block table's (its width follows the
# longest context) and the LSE partials' (the split count).
MLA_DIVISIBLE = frozenset({"stride_qcb", "stride_qch", "stride_qrb", "stride_qrh", "stride_cblk",
                           "stride_cslot", "stride_outb", "stride_outh", "stride_ob", "stride_oh",
                           "stride_os"})  # fmt: skip


# fp8_gemv_kernel's optional forms, off (a constexpr left out here would compile as a
# runtime argument, both branches kept)
GEMV_PLAIN = dict(PRENORM=False, NORM_BLOCK=128)


def main() -> None:
    print(f"triton {triton.__version__}, sm_90")
    # MLA decode at batch 1 (4 and 16 splits) and batch 256 (one split)
    mla_ptrs = dict(qc_ptr="*bf16", qr_ptr="*bf16", cache_ptr="*bf16", block_tables_ptr="*i32",
                    ctx_lens_ptr="*i32", out_ptr="*bf16", o_part_ptr="*fp32", lse_ptr="*fp32",
                    counters_ptr="*i32")  # fmt: skip
    # (value_blocks 4: batch 1's launch, each program owning 128 of the 512 output columns)
    for splits, warps, block_t, prefetch, vblocks in (
        (4, 8, 32, 1, 1), (16, 8, 32, 1, 1), (1, 4, 32, 1, 1), (4, 8, 16, 1, 1),
        (4, 8, 32, 1, 4), (4, 4, 32, 1, 4), (4, 8, 16, 1, 2),
    ):  # fmt: skip
        meta = dict(KVL=512, R=64, BS=16, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
                    MERGE_UNROLL=min(4, splits), BLOCK_H=16, BLOCK_T=block_t,
                    BLOCK_V=512 // vblocks, F32_DOT=False, PREFETCH=prefetch)  # fmt: skip
        compile_report(f"mla_decode splits={splits} warps={warps} tile={block_t} "
                       f"prefetch={prefetch} value_blocks={vblocks}",
                       _mla_decode_kernels.mla_decode_kernel, mla_ptrs, meta, warps, 2,
                       MLA_DIVISIBLE)  # fmt: skip
    # the MLA decode prologue with the W_UK absorption (Moonlight: 16 heads, nope 128)
    rope_ptrs = dict(q_ptr="*bf16", kv_ptr="*bf16", pos_ptr="*i64", cos_ptr="*fp32",
                     sin_ptr="*fp32", norm_w_ptr="*bf16", cache_ptr="*bf16", slot_ptr="*i64",
                     qn_ptr="*bf16", w_uk_ptr="*bf16", qc_ptr="*bf16")  # fmt: skip
    for absorb in (False, True):
        meta = dict(HALF=32, INTERLEAVED=True, BLOCK_H=16, BLOCK_J=32, BLOCK_C=512,
                    ABSORB=absorb, NOPE=128, BLOCK_L=mla_cache.ABSORB_BLOCK_L,
                    BLOCK_T=mla_cache.ABSORB_BLOCK_T, F32_DOT=False)  # fmt: skip
        compile_report(f"mla_rope_cache absorb={absorb}", mla_cache.mla_rope_cache_kernel,
                       rope_ptrs, meta, 4, 1)  # fmt: skip
    # the MoE prologue at batch 1 (Moonlight: 64 experts top-6, sigmoid with bias, no groups)
    pro_ptrs = dict(x_ptr="*bf16", w_ptr="*fp32", bias_ptr="*fp32", logits_ptr="*fp32",
                    counters_ptr="*i32", ids_ptr="*i32", weights_ptr="*fp32", sorted_ptr="*i32",
                    block_expert_ptr="*i32", xq_ptr="*i32", xs_ptr="*fp32", acc_ptr="*fp32")  # fmt: skip
    for block_m, quant, tile_per_pair in ((1, True, True), (16, False, True), (16, False, False)):
        meta = dict(SCORING=0, HAS_BIAS=True, N_GROUP=1, TOPK_GROUP=1, TOP_K=6, NORM=True,
                    BLOCK_E=64, BLOCK_G=1, BLOCK_K=8, GEMV_E=1, BLOCK_D=2048, BLOCK_M=block_m,
                    TILE_PER_PAIR=tile_per_pair,
                    CHUNK=16, TILES=16, QUANT=quant, QBLOCK=_moe_int8_kernels.INT8_QUANT_BLOCK,
                    ZBLOCK=4096)  # fmt: skip
        compile_report(f"moe_prologue block_m={block_m} quant={quant} tile/pair={tile_per_pair}",
                       moe_prologue.moe_prologue_kernel, pro_ptrs, meta, 4, 3)  # fmt: skip

    # The FP8 GEMV at one token: the table's tile, and the tuner's whole-K single-step tiles
    gemv_ptrs = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", ws_ptr="*fp32", y_ptr="*bf16",
                     part_ptr="*fp32", count_ptr="*i32", res_ptr="*bf16", norm_w_ptr="*bf16",
                     res_out_ptr="*bf16")  # fmt: skip
    for bn, bk, split, warps in ((16, 256, 4, 4), (8, 2048, 1, 4), (16, 1024, 1, 4),
                                 (16, 1024, 1, 8)):  # fmt: skip
        meta = dict(SCALE_E8M0=False, M_PAD=1, BLOCK_N=bn, BLOCK_K=bk, VEC=16, SPLIT_K=split,
                    BIT_DECODE=False, **GEMV_PLAIN)  # fmt: skip
        compile_report(f"fp8_gemv {bn} x {bk} split={split} warps={warps}",
                       _fp8_linear_kernels.fp8_gemv_kernel, gemv_ptrs, meta, warps, 1,
                       frozenset({"K", "stride_xm", "stride_wn"}))  # fmt: skip
    # q/kv_a with the input RMSNorm inside (x: the MoE's float32 accumulator), 1 and 8 rows
    for m_pad in (1, 8):
        meta = dict(SCALE_E8M0=False, M_PAD=m_pad, BLOCK_N=16, BLOCK_K=256, VEC=16,
                    SPLIT_K=4, BIT_DECODE=False,
                    **dict(GEMV_PLAIN, PRENORM=True, NORM_BLOCK=max(128, 2048 // m_pad)))  # fmt: skip
        compile_report(f"fp8_gemv + rmsnorm, {m_pad} rows", _fp8_linear_kernels.fp8_gemv_kernel,
                       dict(gemv_ptrs, x_ptr="*fp32"), meta, 4, 1,
                       frozenset({"K", "stride_xm", "stride_wn", "stride_res"}))  # fmt: skip
    # MXFP4 experts decoded to bf16 once (the fused MoE's "dequant" configs, prefill sizes)
    compile_report("mxfp4_dequant", mxfp4_dequant.mxfp4_dequant_kernel,
                   dict(codes_ptr="*u8", scales_ptr="*u8", out_ptr="*bf16"),
                   dict(BLOCK_R=mxfp4_dequant.BLOCK_ROWS, BLOCK_B=mxfp4_dequant.BLOCK_BYTES,
                        F32_DOT=False, ASM=True), 4, 1, frozenset({"KB"}))  # fmt: skip


if __name__ == "__main__":
    main()
