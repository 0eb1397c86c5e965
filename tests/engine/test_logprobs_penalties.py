"""Log-probabilities and presence/frequency penalties: the sampler against plain torch
references on random logits, and the engine's greedy outputs against transformers' own
logits of the same tiny model."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, Request, SamplingParams
from engine.sampler import apply_penalties, sample_step, token_logprobs
from kernels.reference.token_mask import unpack_bitmask


def _logits(n, v, seed):
    return 3 * torch.randn(n, v, generator=torch.Generator().manual_seed(seed))


def test_logprobs_equal_log_softmax_and_top_k_is_ordered():
    logits = _logits(5, 97, 0)
    tokens = [3, 10, 96, 0, 50]
    ks = [0, 1, 5, 20, None]
    out = token_logprobs(logits, tokens, ks)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out[4] is None
    for i, k in enumerate(ks[:4]):
        assert out[i].logprob == pytest.approx(float(ref[i, tokens[i]]), abs=1e-5)
        assert len(out[i].top_ids) == k
        expected = torch.argsort(-ref[i], stable=True)[:k].tolist()
        assert out[i].top_ids == expected
        assert out[i].top_logprobs == sorted(out[i].top_logprobs, reverse=True)
        assert torch.allclose(
            torch.tensor(out[i].top_logprobs).double(), ref[i, expected], atol=1e-5
        )


def test_top_k_ties_go_to_the_lower_id():
    logits = torch.zeros(1, 40)
    logits[0, [7, 30]] = 2.0
    out = token_logprobs(logits, [0], [4])[0]
    assert out.top_ids == [7, 30, 0, 1]


def _penalty_reference(logits, outputs, presence, frequency):
    out = logits.clone()
    for t in set(outputs):
        count = outputs.count(t)
        out[t] -= presence + frequency * count
    return out


@pytest.mark.parametrize("presence,frequency", [(0.0, 0.5), (1.5, 0.0), (-0.7, 1.3), (2.0, -2.0)])
def test_penalties_match_a_reference(presence, frequency):
    logits = _logits(1, 64, 1)[0]
    outputs = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    got = apply_penalties(logits, outputs, presence, frequency)
    assert torch.allclose(got, _penalty_reference(logits, outputs, presence, frequency))


def test_out_of_range_values_are_refused():
    for kw in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"logprobs": 21},
               {"logprobs": -1}, {"logprobs": True}):  # fmt: skip
        with pytest.raises(ValueError):
            SamplingParams(**kw)


def _random_bitmask(n, v, seed):
    words = -(-v // 32)
    return torch.randint(-(2**31), 2**31 - 1, (n, words), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(seed))  # fmt: skip


def test_sample_step_rows_do_not_depend_on_their_batch():
    n, v = 9, 200
    logits = _logits(n, v, 3)
    bitmask = _random_bitmask(n, v, 4)
    params = [SamplingParams(temperature=t, top_p=p, presence_penalty=0.5 * (i % 3),
                             frequency_penalty=0.3, logprobs=i % 4)
              for i, (t, p) in enumerate([(0.0, 1.0), (1.0, 0.9), (0.7, 1.0)] * 3)]  # fmt: skip
    outputs = [torch.randint(0, v, (i + 3,)).tolist() for i in range(n)]
    constrained = [i % 2 == 0 for i in range(n)]
    kw = dict(output_tokens=outputs, bitmask=bitmask, constrained=constrained)
    tokens, logprobs = sample_step(logits, params, list(range(n)), [5] * n, **kw)
    allowed = unpack_bitmask(bitmask, v)
    for i in range(n):
        one_kw = {k: val[i : i + 1] for k, val in kw.items()}
        alone, alone_lp = sample_step(logits[i : i + 1], params[i : i + 1], [i], [5], **one_kw)
        assert alone == tokens[i : i + 1]
        assert alone_lp[0] == logprobs[i]  # exact: the same bits
        if constrained[i]:
            assert allowed[i, tokens[i]]
        # logprobs come from the raw logits, before penalties and mask
        raw = torch.log_softmax(logits[i].double(), -1)[tokens[i]]
        assert logprobs[i].logprob == pytest.approx(float(raw), abs=1e-5)


@pytest.fixture(scope="module")
def pair(tiny_llama):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    return LLM(str(tiny_llama), device="cpu", dtype="float32"), hf


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double()  # [T, V]


def test_engine_logprobs_equal_transformers_log_softmax(pair):
    llm, hf = pair
    prompt = [0, 5, 17, 40, 88, 9]
    out = llm.generate([prompt], SamplingParams(temperature=0.8, seed=5, max_tokens=12,
                                                logprobs=5, ignore_eos=True))[0].outputs[0]  # fmt: skip
    ids = prompt + out.token_ids
    ref = torch.log_softmax(_hf_logits(hf, ids), dim=-1)
    assert len(out.logprobs) == len(out.token_ids)
    for j, entry in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + j]
        assert entry.token_id == out.token_ids[j]
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert [t.token_id for t in entry.top] == torch.argsort(-row, stable=True)[:5].tolist()
        assert entry.token == llm.tokenizer.decode([entry.token_id])
        assert entry.bytes.decode("utf-8", "replace") or entry.token == ""


def test_engine_penalties_equal_a_reference_greedy_loop(pair):
    llm, hf = pair
    prompt = [0, 11, 23, 5]
    params = SamplingParams(temperature=0.0, max_tokens=16, presence_penalty=0.8,
                            frequency_penalty=0.6, ignore_eos=True)  # fmt: skip
    out = llm.generate([prompt], params)[0].outputs[0].token_ids
    ids, generated = list(prompt), []
    for _ in range(16):
        row = _hf_logits(hf, ids)[-1].float()
        token = int(_penalty_reference(row, generated, 0.8, 0.6).argmax())
        ids.append(token)
        generated.append(token)
    assert out == generated
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16,
                                                  ignore_eos=True))[0].outputs[0].token_ids  # fmt: skip
    assert plain != out  # the penalties changed something


def test_logprobs_in_a_batch_equal_logprobs_alone(pair):
    llm, _ = pair
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=10, logprobs=3) for s in range(4)]
    requests = [Request(f"r{s}", [0, 3 + s, 9, 12], p) for s, p in enumerate(params)]
    together = {o.request_id: o for o in llm.stream(requests)}
    for r in requests:
        alone = next(iter(llm.stream([r])))
        assert alone.outputs[0].logprobs == together[r.request_id].outputs[0].logprobs
