"""Multi-head latent attention on CUDA.

- Decode steps (one new token per sequence): q_proj (or q_a) and kv_a in one GEMM, one
  kernel for rope, the latent norm, the cache write and (small T) the W_UK absorption, the
  absorbed decode kernel over the paged cache, W_UV and o_proj. In small steps whose
  q/kv_a runs the FP8 GEMV the layer's input RMSNorm is computed inside it
  (CudaTuning.fold_input_norm).
- Prefill: the same stacked GEMM and one launch for rope, norm and cache write, then the
  torch attention forms (engine/ops/mla_forms.py), the expanded one in the model's dtype
  unless CudaTuning.mla_expanded_float32.

Legend: docs/shapes.md. Context lengths are read by the attention kernel from a device
tensor, so a decode step never syncs the host and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from engine.backends.cuda.norm_linear import KERNEL_DTYPES, StackedLinear, fp8_native_min_tokens
from engine.ops.attention_context import AttentionContext
from engine.ops.device_layer import DeviceSetup, register
from engine.ops.mla import MlaOps, TorchMlaOps, check_ready
from engine.quant.fp8_block import Fp8BlockFormat
from engine.spec_decode.mtp import MAX_DRAFTS
from kernels.reference.mla_decode import mla_decode_reference

MIN_DOT_K = 16  # tl.dot needs K >= 16; the decode kernel dots over the latent and rope widths
# The batch-invariant launches' split scratch (float32 partials of every row's splits) is
# at most this many bytes: rows run in as many launches as that takes. Larger launches
# mean fewer of them (a 16,384-query prefill step at 2,050 tokens of context is 4
# launches a layer, not 64 of 256 rows, each ~0.2 ms of host time) and one launch for a
# 1,024-row decode step.
PARTIALS_BYTES = 1 << 30
# The batch-invariant launch, one for every row count (its tile and warps fix each row's
# bits): 64-slot cache tiles at 4 warps. H200, Moonlight's MLA shapes, against 32-slot
# tiles at 8 warps (docs/prefix-caching.md): 0.84 against 1.17 ms for 1,000 decode rows at
# ~2,080 tokens of context, 14.0 against 18.6 ms for 16,384 prefill queries after a
# 2,000-token prefix, 202 against 247 us for 1,024 rows at 192 tokens.
INVARIANT_BLOCK_T = 64
INVARIANT_WARPS = 4


class CudaMlaOps(TorchMlaOps):
    def __init__(self, attn, setup: DeviceSetup):
        expanded = torch.float32 if setup.tuning.mla_expanded_float32 else setup.dtype
        super().__init__(expanded_dtype=expanded, invariant_forms=False)
        d = attn.dims
        N = d.qk_nope_head_dim
        w = attn.kv_b_weight().float()  # [H, N+V, R]
        self.w_uk = w[:, :N].to(setup.dtype).contiguous()  # [H, N, R]: q_c = q_nope W_uk
        self.w_uv_t = w[:, N:].transpose(1, 2).to(setup.dtype).contiguous()  # [H, R, V]
        device = attn.kv_a_layernorm.weight.device
        # Rows past max_model_len too: the MTP drafter decodes up to MAX_DRAFTS - 1
        # positions past a sequence's last row (drafts it then drops when they would pass
        # max_model_len), and the rope kernels index this table by position without a bound.
        positions = torch.arange(setup.max_model_len + MAX_DRAFTS, device=device)
        cos, sin = attn.rotary.cos_sin(positions)
        self.cos, self.sin = cos.float().contiguous(), sin.float().contiguous()  # [L, P/2]
        # q_proj (or q_a_proj) and kv_a_proj_with_mqa read the same x: one GEMV (and one
        # activation quantization) for both where they stack.
        q_in = attn.q_a_proj if d.q_lora_rank else attn.q_proj
        self.q_rows = q_in.out_features
        self.invariant = setup.batch_invariant
        self.q_kv_a = StackedLinear.of(
            q_in, attn.kv_a_proj_with_mqa, fp8_native_min_tokens(setup), fixed=self.invariant
        )
        # The fold runs the GEMV, a config picked by the row count: not when invariant.
        self.fold_input_norm = setup.tuning.fold_input_norm and not self.invariant
        from kernels.triton.mla_decode import MAX_SPLITS, splits_for_context

        # Batch-invariant decode: the kernel's split count fixed for the longest context the
        # engine serves, so each sequence takes the splits its own length calls for.
        self.fixed_splits = min(
            splits_for_context(positions.numel(), INVARIANT_BLOCK_T), MAX_SPLITS
        )

    # -- the projections -------------------------------------------------------------
    def query_and_latent(self, attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, N+P] and kv_a's output [T, R+P], in one GEMM where they are stacked."""
        if self.q_kv_a is not None:
            return self.split_query_latent(attn, self.q_kv_a(x))
        q_in = attn.q_a_proj if attn.dims.q_lora_rank else attn.q_proj
        return self.query_heads(attn, q_in(x)), attn.kv_a_proj_with_mqa(x)

    def split_query_latent(self, attn, both: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked q/kv_a output [T, q rows + R + P] -> q [T, H, N+P], kv [T, R+P]."""
        return self.query_heads(attn, both[:, : self.q_rows]), both[:, self.q_rows :]

    @staticmethod
    def query_heads(attn, q: torch.Tensor) -> torch.Tensor:
        """q_proj's output (or q_a's, through its norm and q_b) as [T, H, N+P]."""
        d = attn.dims
        if d.q_lora_rank:
            q = attn.q_b_proj(attn.q_a_layernorm(q))
        return q.view(q.shape[0], d.num_heads, d.qk_nope_head_dim + d.qk_rope_head_dim)

    def rope_cache_args(self, attn, kv, positions, ctx: AttentionContext) -> tuple:
        """kernels.triton.mla_cache's arguments after q: the latent and rope key to
        normalise, rotate and write at the step's slots."""
        norm = attn.kv_a_layernorm
        return (kv, positions, self.cos, self.sin, attn.rotary.interleaved, norm.weight,
                norm.eps, attn.kv_cache.view(-1, attn.dims.cache_width), ctx.slot_mapping)  # fmt: skip

    def project(self, attn, x, positions, ctx):
        """Prefill: q [T, H, N+P] with its rope slice rotated and the new cache entries
        written, in one launch after the stacked GEMM (the torch code launches an RMSNorm,
        ~12 ops of rope per tensor and a concatenation and scatter)."""
        from kernels.triton.mla_cache import mla_rope_cache_write_

        q, kv = self.query_and_latent(attn, x)
        n = attn.dims.qk_nope_head_dim
        mla_rope_cache_write_(q[..., n:], *self.rope_cache_args(attn, kv, positions, ctx))
        return q

    # -- the layer -------------------------------------------------------------------
    def forward(self, attn, x, positions, ctx):
        check_ready(attn)
        if ctx.is_decode and attn.mode != "expanded":
            q, kv = self.query_and_latent(attn, x)
            if self.invariant:
                return self.invariant_attend(attn, q, kv, positions, ctx, x.dtype)
            return self.decode_attend(attn, q, kv, positions, ctx, x.dtype)
        if self.invariant and attn.mode != "expanded":
            q, kv = self.query_and_latent(attn, x)
            return self.invariant_attend(attn, q, kv, positions, ctx, x.dtype)
        return super().forward(attn, x, positions, ctx)

    def invariant_attend(self, attn, q, kv, positions, ctx: AttentionContext, dtype):
        """Every query, decode or prefill, in the absorbed form by the decode kernel over
        its own causal context (its position + 1 tokens of its sequence's blocks), with
        each launch's configuration fixed: a token's attention is then the same in a
        prompt's prefill, a chunk after a cached prefix, a recomputation after preemption
        and a decode step of any batch. The output in `dtype` (the layer input's)."""
        from kernels.triton.matmul import fixed_bmm
        from kernels.triton.mla_cache import mla_rope_cache_write_
        from kernels.triton.mla_decode import mla_decode, splits_for_context

        d = attn.dims
        T, H, N, V = q.shape[0], d.num_heads, d.qk_nope_head_dim, d.v_head_dim
        cache = attn.kv_cache
        mla_rope_cache_write_(q[..., N:], *self.rope_cache_args(attn, kv, positions, ctx))
        if ctx.is_decode:  # one query per sequence: the step's own tables and lengths
            tables, lens = ctx.block_tables, ctx.context_lens
        else:
            tables, lens = ctx.shared("mla-query-tables", lambda: query_tables(ctx, positions))
        q_c = fixed_bmm(q[..., :N].transpose(0, 1), self.w_uk.to(q.dtype))  # [H, T, R]
        q_c = q_c.transpose(0, 1).to(cache.dtype).contiguous()  # [T, H, R]
        q_rope = q[..., N:].to(cache.dtype).contiguous()  # [T, H, P]
        if cache.dtype in KERNEL_DTYPES and min(d.kv_lora_rank, d.qk_rope_head_dim) >= MIN_DOT_K:
            # Rows in launches: the split partials' scratch grows with the rows (a prefill's
            # thousands), and a row's result does not depend on its launch; the scratch only
            # for the splits the longest context here uses.
            kept = min(
                splits_for_context(ctx.max_context_len, INVARIANT_BLOCK_T), self.fixed_splits
            )
            per_row = H * kept * d.kv_lora_rank * 4
            launch_rows = max(1, PARTIALS_BYTES // per_row)
            fixed = dict(block_t=INVARIANT_BLOCK_T, num_warps=INVARIANT_WARPS, value_blocks=1,
                         partial_splits=kept)  # fmt: skip

            def attend(rows: slice) -> torch.Tensor:
                return mla_decode(q_c[rows], q_rope[rows], cache, tables[rows], lens[rows],
                                  attn.scale, self.fixed_splits, **fixed)  # fmt: skip

            launches = [slice(r, r + launch_rows) for r in range(0, T, launch_rows)]
            o_lat = torch.cat([attend(rows) for rows in launches]) if len(launches) > 1 else (
                attend(slice(None))
            )  # fmt: skip
        else:
            o_lat = mla_decode_reference(
                q_c, q_rope, cache, tables, lens, attn.scale, ctx.max_context_len
            )
        out = fixed_bmm(o_lat.transpose(0, 1), self.w_uv_t.to(o_lat.dtype))  # [H, T, V]
        out = out.transpose(0, 1).reshape(T, H * V)
        return attn.o_proj(out.to(dtype))

    def fold_config(self, attn, x, residual, ctx: AttentionContext) -> dict | None:
        """The q/kv_a GEMV config a decode step takes its input RMSNorm into, or None where
        that does not apply: the fold is off, the step is not an absorbed decode, q/kv_a is
        not one stacked FP8 linear, or its config for this many rows is not the GEMV (which
        alone takes a float32 x and the norm)."""
        from kernels.triton.fp8_linear import GEMV_MAX_M, choose_config

        linear = self.q_kv_a
        if not self.fold_input_norm or linear is None:
            return None
        rows = x.shape[0]
        if (
            not ctx.is_decode
            or attn.mode not in ("auto", "absorbed")
            or attn.kv_cache is None
            or not isinstance(linear.format, Fp8BlockFormat)
            or rows > GEMV_MAX_M
            or residual.dtype not in KERNEL_DTYPES
            or x.dtype not in (torch.float32, residual.dtype)
        ):
            return None
        native = linear.native_min is not None and rows >= linear.native_min
        n, k = linear.weight.shape
        cfg = choose_config(rows, n, k, x.device, native)
        return cfg if cfg.get("KERNEL") == "gemv" and not native else None

    def forward_with_input_norm(self, attn, norm, x, residual, positions, ctx):
        from kernels.triton.fp8_linear import fp8_gemv_rmsnorm

        cfg = self.fold_config(attn, x, residual, ctx)
        if cfg is None:
            return None
        linear = self.q_kv_a
        both, residual = fp8_gemv_rmsnorm(
            x.contiguous(), residual.contiguous(), norm.weight, norm.eps, linear.weight,
            linear.scale, cfg,
        )  # fmt: skip
        q, kv = self.split_query_latent(attn, both)
        return self.decode_attend(attn, q, kv, positions, ctx, residual.dtype), residual

    def decode_attend(self, attn, q, kv, positions, ctx: AttentionContext, dtype) -> torch.Tensor:
        """The decode step after q/kv_a: rope and the cache write, the absorbed attention,
        W_UV and o_proj; the output in `dtype` (the layer input's)."""
        from kernels.triton.mla_cache import (
            ABSORB_MAX_TOKENS,
            mla_decode_prologue_,
            mla_rope_cache_write_,
        )
        from kernels.triton.mla_decode import choose_num_splits, mla_decode

        d = attn.dims
        T, H, N, P, R = (
            q.shape[0],
            d.num_heads,
            d.qk_nope_head_dim,
            d.qk_rope_head_dim,
            d.kv_lora_rank,
        )
        cache = attn.kv_cache
        # One launch: rope on q's rope slices (in place), and the entry [norm(c) | rope(k_rot)]
        # written into the token's cache slot; at decode batch sizes also the absorption of
        # q_nope through W_UK (q_c), which larger T leaves to one batched GEMM.
        cache_args = self.rope_cache_args(attn, kv, positions, ctx)
        if T <= ABSORB_MAX_TOKENS and q.dtype in KERNEL_DTYPES:
            q_c = mla_decode_prologue_(q, P, *cache_args, self.w_uk)  # [T, H, R]
        else:
            mla_rope_cache_write_(q[..., N:], *cache_args)
            q_c = torch.bmm(q[..., :N].transpose(0, 1), self.w_uk.to(q.dtype))  # [H, T, R]
            q_c = q_c.transpose(0, 1).to(cache.dtype)  # [T, H, R]
        q_rope = q[..., N:].to(cache.dtype)  # [T, H, P]
        if cache.dtype in KERNEL_DTYPES and min(R, P) >= MIN_DOT_K:
            splits = choose_num_splits(T, ctx.max_context_len, H, q.device)
            o_lat = mla_decode(
                q_c, q_rope, cache, ctx.block_tables, ctx.context_lens, attn.scale, splits
            )  # [T, H, R]
        else:  # float32 (the kernel's float32 dots round to tf32), or dims under tl.dot's K
            o_lat = mla_decode_reference(q_c, q_rope, cache, ctx.block_tables, ctx.context_lens, attn.scale,
                                          ctx.max_context_len)  # fmt: skip
        # The value half written straight in [T, H, V] order (cuBLAS takes the strided
        # output), so no transpose copy before o_proj.
        out = torch.empty((T, H, d.v_head_dim), dtype=o_lat.dtype, device=q.device)
        torch.bmm(o_lat.transpose(0, 1), self.w_uv_t.to(o_lat.dtype), out=out.transpose(0, 1))
        return attn.o_proj(out.view(T, H * d.v_head_dim).to(dtype))


def query_tables(ctx: AttentionContext, positions: torch.Tensor):
    """Each query's block table (its sequence's) [T, blocks] and causal context length
    (its position + 1) [T], for running a prefill step's queries as decode rows."""
    seq_of = torch.repeat_interleave(
        torch.arange(ctx.num_seqs), torch.tensor(ctx.query_lens_host)
    ).to(ctx.block_tables.device, non_blocking=True)
    return ctx.block_tables[seq_of].contiguous(), (positions + 1).to(torch.int32)


@register("mla", "cuda")
def cuda_mla_ops(attn, setup: DeviceSetup) -> MlaOps:
    return CudaMlaOps(attn, setup)
