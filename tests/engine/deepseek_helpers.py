"""Test helpers for the DeepSeek family: tiny transformers configs with every weight
randomised (transformers zero-inits the correction bias), and a minimal paged runner that
builds the caches and AttentionContext the engine's model runner would, so model-level
tests do not depend on the scheduler."""

from __future__ import annotations

import math

import torch

from engine.ops.attention_context import AttentionContext

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def hf_config(**overrides):
    from transformers import DeepseekV3Config

    kwargs = {**TINY, **overrides}
    cfg = DeepseekV3Config(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Scale-aware random weights: linears ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1^2),
    embeddings ~ N(0, 1), router bias ~ N(0, 0.1^2) so it changes some selections."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        elif "norm" in name:
            p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.1)
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        else:
            fan_in = max(p.shape[-1], 1)
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def hf_model(seed: int = 0, **overrides):
    from transformers import DeepseekV3ForCausalLM as HF

    torch.manual_seed(seed)
    model = HF(hf_config(**overrides)).eval()
    randomize_(model, seed + 1)
    return model


def engine_model_from_hf(hf, **kwargs):
    from engine.models.deepseek_v3 import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(hf.config.to_dict(), **kwargs).eval()
    model.load_weights((n, t.detach()) for n, t in hf.state_dict().items())
    return model


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """Full-sequence logits [len, V] (no cache): the reference for every step."""
    return hf(torch.tensor([tokens])).logits[0].float()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


class PagedRunner:
    """Allocates one cache per CacheSpec ([num_blocks, *spec.block_shape(block_size)]) and
    the model's per-sequence state (one slot per sequence), and runs steps
    of (seq_id, new_tokens) pairs, giving each sequence blocks in a scrambled order so the
    block tables are not contiguous."""

    def __init__(
        self,
        model,
        block_size: int = 4,
        num_blocks: int = 64,
        seed: int = 0,
        lookahead: int = 0,
        num_state_slots: int = 16,
    ):
        """`lookahead`: blocks are reserved that far past each step's tokens (MTP drafts)."""
        from engine.model_runner import aligned_block_size

        # a multiple of every cache's entry span, as the model runner makes it
        block_size = aligned_block_size(block_size, model.cache_specs())
        self.model, self.block_size, self.lookahead = model, block_size, lookahead
        dtype = next(model.parameters()).dtype
        # fixed per-sequence state (V4's window ring and pooling rows), in scrambled slots
        state_specs = model.state_specs()
        self.states = [
            torch.zeros(num_state_slots, *s.shape, dtype=s.dtype or dtype) for s in state_specs
        ]
        model.bind_state(self.states)
        self.caches = [
            torch.zeros(num_blocks, *s.block_shape(block_size), dtype=s.dtype or dtype)
            for s in model.cache_specs()
        ]
        model.bind_kv_cache(self.caches)
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.free_slots = torch.randperm(num_state_slots, generator=gen).tolist()
        self.uses_state = bool(state_specs)
        self.blocks: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.slots: dict[int, int] = {}

    def context(self, items: list[tuple[int, int]]) -> tuple[AttentionContext, torch.Tensor]:
        """Reserve room for (seq_id, num_new) and build the step's context and positions."""
        slots, positions, q_lens, c_lens = [], [], [], []
        for seq, n in items:
            start = self.lengths.get(seq, 0)
            blocks = self.blocks.setdefault(seq, [])
            while len(blocks) * self.block_size < start + n + self.lookahead:
                blocks.append(self.free.pop())
            for p in range(start, start + n):
                slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
                positions.append(p)
            self.lengths[seq] = start + n
            q_lens.append(n)
            c_lens.append(start + n)
        width = max(len(self.blocks[s]) for s, _ in items)
        tables = [self.blocks[s] + [0] * (width - len(self.blocks[s])) for s, _ in items]
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        ctx = AttentionContext(
            block_size=self.block_size,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            cu_query_lens=torch.tensor(cu, dtype=torch.int32),
            context_lens=torch.tensor(c_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            query_lens_host=q_lens,
            context_lens_host=c_lens,
            is_decode=all(n == 1 for n in q_lens),
        )
        if self.uses_state:
            for seq, _ in items:
                if seq not in self.slots:
                    self.slots[seq] = self.free_slots.pop()
            ctx.state_slots_host = [self.slots[s] for s, _ in items]
            ctx.state_slots = torch.tensor(ctx.state_slots_host, dtype=torch.int32)
        return ctx, torch.tensor(positions, dtype=torch.int64)

    def context_at(self, items: list[tuple[int, int, int]]) -> AttentionContext:
        """Context for (seq_id, start, n): rows at positions start..start+n-1 of sequences
        whose cache already reaches start+n (speculative steps re-run verified rows)."""
        saved = dict(self.lengths)
        for seq, start, _ in items:
            self.lengths[seq] = start
        ctx, _ = self.context([(seq, n) for seq, _, n in items])
        for seq, _, _ in items:
            self.lengths[seq] = max(self.lengths[seq], saved.get(seq, 0))
        return ctx

    @torch.no_grad()
    def step(self, items: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Run new tokens of several sequences in one forward; logits [n, V] per sequence."""
        ctx, positions = self.context([(s, len(t)) for s, t in items])
        ids = torch.tensor([t for _, toks in items for t in toks], dtype=torch.int64)
        logits = self.model.compute_logits(self.model(ids, positions, ctx))
        out, start = [], 0
        for _, toks in items:
            out.append(logits[start : start + len(toks)])
            start += len(toks)
        return out


def read_checkpoint(path):
    """(config dict, iterator of (name, tensor)) from a safetensors checkpoint directory."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    path = Path(path)
    config = json.loads((path / "config.json").read_text())

    def tensors():
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)

    return config, tensors()


def load_engine_model(path, **kwargs):
    from engine.models.deepseek_v3 import DeepseekV3ForCausalLM

    config, tensors = read_checkpoint(path)
    model = DeepseekV3ForCausalLM(config, **kwargs).eval()
    model.load_weights(tensors)
    return model
