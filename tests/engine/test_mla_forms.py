"""MLA's two batched attention forms on the same paged cache: sequences of different
lengths, chunked prefill (queries after a cached prefix), padded query rows."""

import torch

from engine.ops.mla_forms import (
    MlaDims,
    attend_absorbed_batched,
    attend_expanded_batched,
    expanded_groups,
)

DIMS = MlaDims(hidden_size=32, num_heads=3, q_lora_rank=None, kv_lora_rank=16,
               qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)  # fmt: skip
BLOCK = 4


def _paged_case(context_lens: list[int], query_lens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    d = DIMS
    blocks_per_seq = max(-(-c // BLOCK) for c in context_lens)
    cache = torch.randn(len(context_lens) * blocks_per_seq + 3, BLOCK, d.cache_width, generator=g)
    # each sequence's blocks scattered over the cache (not in order)
    perm = torch.randperm(cache.shape[0], generator=g)[: len(context_lens) * blocks_per_seq]
    tables = perm.view(len(context_lens), blocks_per_seq).int()
    qmax = max(query_lens)
    q_nope = torch.randn(len(context_lens), qmax, d.num_heads, d.qk_nope_head_dim, generator=g)
    q_rope = torch.randn(len(context_lens), qmax, d.num_heads, d.qk_rope_head_dim, generator=g)
    # the queries are each sequence's last query_len tokens; padding repeats the last one
    q_pos = torch.tensor([[c - q + min(i, q - 1) for i in range(qmax)]
                          for c, q in zip(context_lens, query_lens)])  # fmt: skip
    w = torch.randn(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank, generator=g)
    return q_nope, q_rope, q_pos, cache, tables, torch.tensor(context_lens), w


def _one_sequence_reference(q_nope, q_rope, q_pos, entries, w, scale):
    """Textbook attention for one sequence, keys and values expanded through kv_b."""
    d = DIMS
    latent, k_rope = entries[:, : d.kv_lora_rank], entries[:, d.kv_lora_rank :]
    kv = torch.einsum("lr,hkr->lhk", latent, w)
    k_nope, v = kv[..., : d.qk_nope_head_dim], kv[..., d.qk_nope_head_dim :]
    scores = torch.einsum("qhn,lhn->hql", q_nope, k_nope)
    scores = (scores + torch.einsum("qhp,lp->hql", q_rope, k_rope)) * scale
    future = torch.arange(entries.shape[0])[None, :] > q_pos[:, None]
    probs = scores.masked_fill(future[None], float("-inf")).softmax(-1)
    return torch.einsum("hql,lhv->qhv", probs, v)


def test_expanded_and_absorbed_forms_agree_with_a_per_sequence_reference():
    context_lens, query_lens = [9, 4, 13], [9, 2, 5]  # a prefill, a decode-ish chunk, a chunk
    case = _paged_case(context_lens, query_lens, seed=3)
    q_nope, q_rope, q_pos, cache, tables, lens, w = case
    scale = 0.3
    q = torch.cat((q_nope, q_rope), dim=-1)
    expanded = attend_expanded_batched(q, q_pos, cache, tables, lens, w, DIMS, scale)
    absorbed = attend_absorbed_batched(q, q_pos, cache, tables, lens, w, DIMS, scale)
    flat = cache.view(-1, DIMS.cache_width)
    for b, (c, q) in enumerate(zip(context_lens, query_lens)):
        slots = tables[b, torch.arange(c) // BLOCK].long() * BLOCK + torch.arange(c) % BLOCK
        ref = _one_sequence_reference(q_nope[b, :q], q_rope[b, :q], q_pos[b, :q], flat[slots],
                                      w, scale)  # fmt: skip
        torch.testing.assert_close(expanded[b, :q], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(absorbed[b, :q], ref, rtol=1e-5, atol=1e-5)


def test_expanded_groups_bound_padding_and_size():
    lens = [100, 7, 120, 8, 64, 130, 9, 1000]
    fresh = list(lens)  # prefills: the query chunk is the whole context
    groups = expanded_groups(list(range(len(lens))), lens, fresh, max_tokens=400)
    assert sorted(b for g in groups for b in g) == list(range(len(lens)))
    for g in groups:
        longest, shortest = max(lens[b] for b in g), min(lens[b] for b in g)
        assert len(g) == 1 or (len(g) * longest <= 400 and 2 * longest <= 3 * shortest)
    assert [1, 3, 6] in groups  # 7, 8 and 9 tokens share a call
    assert [7] in groups  # longer than the budget: alone
    assert expanded_groups([], lens, fresh, 400) == []
    # same contexts, but one is a short chunk after a cached prefix: its queries would be
    # padded to the others' 100+, so it goes alone
    chunked = [100, 7, 120, 8, 64, 10, 9, 1000]
    groups = expanded_groups(list(range(len(lens))), lens, chunked, max_tokens=400)
    assert [5] in groups and [0, 2] in groups


def test_mla_layer_groups_scatter_back_to_the_right_rows(monkeypatch):
    # A step mixing a decode row, a chunk after a prefix and fresh prompts, with a budget
    # so small that every expanded sequence runs in its own group, and one that batches
    # them: both must equal the all-absorbed layer output row for row.
    import engine.ops.mla as mla
    from tests.engine.deepseek_helpers import PagedRunner, engine_model_from_hf, hf_model

    model = engine_model_from_hf(hf_model(seed=5, q_lora_rank=None))
    runner = PagedRunner(model, block_size=4, num_blocks=64, seed=1)
    runner.step([(0, list(range(3, 12))), (1, [5, 6])])  # cache prefixes for 0 and 1
    step = [(0, [40]), (1, [7, 8, 9, 10, 11, 12]), (2, list(range(20, 33))), (3, [50, 51, 52])]
    ctx, positions = runner.context([(s, len(t)) for s, t in step])
    attn = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(len(t) for _, t in step), attn.dims.hidden_size, generator=gen)
    cache = attn.kv_cache.clone()

    def layer(mode: str, budget: int) -> torch.Tensor:
        attn.kv_cache.copy_(cache)
        attn.mode = mode
        monkeypatch.setattr(mla, "EXPANDED_GROUP_BYTES", budget)
        return attn(x, positions, ctx)

    want = layer("absorbed", mla.EXPANDED_GROUP_BYTES)
    torch.testing.assert_close(layer("expanded", 1), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer("expanded", 512 << 20), want, rtol=1e-4, atol=1e-5)


def test_expanded_form_in_bf16_stays_close_to_float32():
    # The GPU option CudaTuning.mla_expanded_float32 = False: keys, values and attention
    # in bf16 (the cache and the queries are bf16 in such a model), the output float32.
    context_lens, query_lens = [9, 13], [9, 5]
    q_nope, q_rope, q_pos, cache, tables, lens, w = _paged_case(context_lens, query_lens, 4)
    q, cache = torch.cat((q_nope, q_rope), dim=-1).bfloat16(), cache.bfloat16()
    args = (q, q_pos, cache, tables, lens, w, DIMS, 0.3)
    want = attend_expanded_batched(*args)
    got = attend_expanded_batched(*args, dtype=torch.bfloat16)
    assert got.dtype == torch.float32 and got.shape == want.shape
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < 2e-2  # bf16 roundings, and not the float32 path by mistake
