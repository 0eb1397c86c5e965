"""Structured output on the CPU engine: rows that stop are valid against their grammar,
rows cut by max_tokens say "length" and keep a valid prefix, constrained and free rows mix
in one batch without changing each other, n > 1 with seeds repeats itself, and a grammar
that does not compile fails its request alone."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine import LLM, Request, SamplingParams
from engine.structured_output import grammar_spec

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["fox", "dog", "report"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "kind", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "row", "schema": SCHEMA}}
REGEX = r"[a-c]{2,4}-\d{2}"
CHOICES = ["positive", "negative", "neutral"]
PROMPTS = ["the quick brown", "translate into french:", "summarize the", "1234 abc"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), device="cpu", dtype="float32")


def _params(fmt, seed=0, **kw):
    kw.setdefault("max_tokens", 80)
    return SamplingParams(temperature=1.0, seed=seed, response_format=fmt, **kw)


def _stream(llm, requests):
    return {o.request_id: o for o in llm.stream(requests)}


def test_json_schema_rows_that_stop_validate_and_cut_rows_are_prefixes(llm):
    requests = [Request(f"{p}/{seed}", p, _params(JSON_SCHEMA, seed=seed))
                for p in PROMPTS for seed in range(3)]  # fmt: skip
    stopped = 0
    for o in _stream(llm, requests).values():
        c = o.outputs[0]
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
            assert c.text == json.dumps(
                json.loads(c.text), separators=(",", ":"), ensure_ascii=False
            )
            stopped += 1
        else:
            assert len(c.token_ids) == 80 and c.text.startswith("{")
    assert stopped >= 6  # the grammar ends most rows well before max_tokens


def test_cut_row_says_length_and_keeps_its_partial_text(llm):
    out = llm.generate(PROMPTS[0], _params(JSON_SCHEMA, seed=1, max_tokens=5))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text and out.text.startswith("{")


def test_json_object_regex_and_choice_are_honoured(llm):
    formats = {
        "object": {"type": "json_object"},
        "regex": {"type": "regex", "regex": REGEX},
        "choice": {"type": "choice", "choice": CHOICES},
    }
    requests = [Request(f"{name}/{p}/{seed}", p, _params(f, seed=seed, max_tokens=40))
                for name, f in formats.items() for p in PROMPTS for seed in range(2)]  # fmt: skip
    for rid, o in _stream(llm, requests).items():
        c = o.outputs[0]
        if rid.startswith("object"):
            if c.finish_reason == "stop":
                assert isinstance(json.loads(c.text), dict)
        elif rid.startswith("regex"):
            assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text)
        else:
            assert c.finish_reason == "stop" and c.text in CHOICES


def test_greedy_constrained_row_picks_the_best_allowed_token(llm):
    """A greedy choice row equals the choice the model scores highest token by token."""
    out = llm.generate(PROMPTS[1], SamplingParams(
        temperature=0.0, max_tokens=10, logprobs=0,
        response_format={"type": "choice", "choice": CHOICES}))[0].outputs[0]  # fmt: skip
    assert out.text in CHOICES and out.finish_reason == "stop"


def test_mixed_batch_rows_equal_rows_alone(tiny_llama):
    mixed = LLM(str(tiny_llama), device="cpu", dtype="float32", max_num_seqs=8)
    alone = LLM(str(tiny_llama), device="cpu", dtype="float32", max_num_seqs=1)
    formats = [JSON_SCHEMA, None, {"type": "regex", "regex": REGEX}, None,
               {"type": "choice", "choice": CHOICES}, {"type": "json_object"}]  # fmt: skip
    requests = [
        Request(f"r{i}", PROMPTS[i % 4], _params(f, seed=10 + i, max_tokens=24, logprobs=2))
        for i, f in enumerate(formats)
    ]
    together = _stream(mixed, requests)
    for r in requests:
        single = _stream(alone, [r])[r.request_id].outputs[0]
        got = together[r.request_id].outputs[0]
        assert got.token_ids == single.token_ids, r.request_id
        assert [e.logprob for e in got.logprobs] == [e.logprob for e in single.logprobs]


def test_n_completions_with_a_seed_repeat_and_each_validates(llm):
    params = _params(JSON_SCHEMA, seed=7, n=3)
    first = llm.generate(PROMPTS[0], params)[0].outputs
    again = llm.generate(PROMPTS[0], params)[0].outputs
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) > 1  # the n samples differ
    for c in first:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_constrained_rows_survive_preemption_unchanged(tiny_llama):
    """Rows in a cache too small for all of them at once (preempted, recomputed, their
    matchers caught up again) equal the same rows in a roomy cache."""
    requests = [Request(f"r{i}", PROMPTS[i % 4], _params(JSON_SCHEMA, seed=i, max_tokens=40))
                for i in range(10)]  # fmt: skip
    roomy = LLM(str(tiny_llama), device="cpu", dtype="float32", max_num_seqs=10)
    expected = {k: v.outputs[0].token_ids for k, v in _stream(roomy, requests).items()}
    runner = roomy.engine.runner
    per_block = sum(s.bytes_per_block(8, runner.dtype) for s in runner.model.cache_specs())
    small = LLM(str(tiny_llama), device="cpu", dtype="float32", block_size=8,
                kv_cache_memory=per_block * 20, max_num_seqs=10, max_num_batched_tokens=32)  # fmt: skip
    got = _stream(small, requests)
    assert small.num_preemptions > 0
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == expected


def test_a_schema_that_does_not_compile_fails_its_request_alone(llm):
    bad = {"type": "json_schema",
           "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}  # fmt: skip
    requests = [
        Request("bad", PROMPTS[0], _params(bad)),
        Request("bad_regex", PROMPTS[0], _params({"type": "regex", "regex": "(abc"})),
        Request("good", PROMPTS[1], _params({"type": "choice", "choice": CHOICES})),
    ]
    out = _stream(llm, requests)
    assert "json_schema" in out["bad"].error and "frobnicate" in out["bad"].error
    assert "regex" in out["bad_regex"].error and not out["bad_regex"].outputs
    assert out["good"].error is None and out["good"].outputs[0].text in CHOICES


@pytest.mark.parametrize(
    "fmt, words",
    [
        ("json", "must be an object"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": "{}"}}, "schema"),
        ({"type": "regex", "regex": ""}, "regex"),
        ({"type": "choice", "choice": []}, "choice"),
    ],
)
def test_malformed_response_format_is_a_value_error_naming_the_key(fmt, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(response_format=fmt)


def test_text_and_none_are_free():
    assert grammar_spec(None) is None and grammar_spec({"type": "text"}) is None
    assert SamplingParams(response_format={"type": "text"}).grammar is None


def test_grammar_rejects_ignore_eos_and_min_tokens():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(response_format={"type": "json_object"}, ignore_eos=True)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(response_format={"type": "json_object"}, min_tokens=2)


def test_without_the_library_a_constrained_request_is_a_clear_error(llm, monkeypatch):
    import sys

    from engine.structured_output.compiler import GrammarCompiler, GrammarError

    monkeypatch.setitem(sys.modules, "llguidance", None)
    compiler = GrammarCompiler(llm.engine.tokenizer.hf, llm.engine.runner.vocab_size, [1])
    with pytest.raises(GrammarError, match="llguidance"):
        compiler.compile(grammar_spec({"type": "json_object"}))


def test_matcher_rebuilds_when_the_output_is_not_an_extension(llm):
    from engine.structured_output.matcher import SequenceGrammar

    engine = llm.engine
    compiled = engine.grammars.compile(grammar_spec({"type": "choice", "choice": CHOICES}))
    hf = engine.tokenizer.hf
    pos, neg = (
        hf.encode("positive", add_special_tokens=False),
        hf.encode("negative", add_special_tokens=False),
    )
    grammar = SequenceGrammar(compiled)
    words = -(-engine.runner.vocab_size // 32)
    grammar.sync(pos[:1])
    grammar.sync(neg[:1])  # another first token: rebuilt, not refused
    assert grammar.num_accepted == 1
    grammar.sync(neg)
    mask = torch.zeros(1, words, dtype=torch.int32)
    grammar.fill(mask, 0)
    allowed = [
        v for v in range(engine.runner.vocab_size) if (int(mask[0, v // 32]) >> (v % 32)) & 1
    ]
    assert allowed == engine.runner.eos_token_ids  # "negative" is complete: only EOS
    with pytest.raises(RuntimeError, match="breaks the grammar"):
        SequenceGrammar(compiled).sync(hf.encode("zzz", add_special_tokens=False))


def test_a_stop_token_after_the_grammar_ends_is_accepted_and_rolled_back(llm):
    """A complete choice stops llguidance's matcher, which then refuses EOS; under async
    scheduling the next step's mask sees the output ending with it, so it must be taken."""
    from engine.structured_output.matcher import SequenceGrammar

    engine = llm.engine
    compiled = engine.grammars.compile(grammar_spec({"type": "choice", "choice": CHOICES}))
    neg = engine.tokenizer.hf.encode("negative", add_special_tokens=False)
    eos = engine.runner.eos_token_ids[0]
    grammar = SequenceGrammar(compiled, engine.grammars.stop_token_ids)
    grammar.sync(neg)
    assert grammar.matcher.is_stopped()  # llguidance ends the matcher at a complete choice
    grammar.sync(neg + [eos])
    assert grammar.num_accepted == len(neg) + 1
    assert not grammar.try_accept(neg[0])  # nothing but a stop token past the end
    grammar.rollback(2)  # the stop token and one real token
    assert grammar.num_accepted == len(neg) - 1 and not grammar.matcher.is_stopped()
    grammar.sync(neg + [eos])
    assert grammar.num_accepted == len(neg) + 1
    with pytest.raises(RuntimeError, match="breaks the grammar"):
        SequenceGrammar(compiled).sync(neg + [eos])  # no stop ids given: refused as before


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    from engine.checkpoint_maker import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("ds") / "m", preset="tiny", seed=3)


def test_mtp_drafts_are_checked_against_the_grammar(tiny_deepseek):
    """With MTP drafts, greedy constrained rows equal the same rows without drafts (a
    permissive grammar lets drafts through to verification, a strict one refuses most),
    sampled ones stay valid, and every emitted token has its logprob."""
    plain = LLM(str(tiny_deepseek), dtype="float32")
    spec = LLM(str(tiny_deepseek), dtype="float32", speculative_tokens=3)
    prompts = [[5, 9, 13, 2, 7], [40, 41], list(range(10, 30))]
    for regex in (r"(?s:.){1,25}", r"[a-f]{3,12}(-[0-9]{1,3}){0,4}"):
        fmt = {"type": "regex", "regex": regex}
        greedy = SamplingParams(temperature=0.0, max_tokens=30, response_format=fmt, logprobs=1)
        want = [o.outputs[0] for o in plain.generate(prompts, greedy)]
        got = [o.outputs[0] for o in spec.generate(prompts, greedy)]
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for a, b in zip(got, want):
            assert [e.logprob for e in a.logprobs] == pytest.approx(
                [e.logprob for e in b.logprobs], abs=1e-5
            )
        sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=30, response_format=fmt)
                   for s in range(3)]  # fmt: skip
        for o in spec.generate(prompts, sampled):
            c = o.outputs[0]
            if c.finish_reason == "stop":
                assert re.fullmatch(regex, c.text, re.S), c.text
    assert spec.speculative_stats()["sequence_steps"] > 0  # drafts were verified


def test_draft_masks_stop_at_the_first_refused_draft(llm):
    from engine.sequence import Sequence
    from engine.spec_decode.speculator import MtpSpeculator
    from engine.structured_output.matcher import SequenceGrammar

    engine = llm.engine
    hf = engine.tokenizer.hf
    spec = grammar_spec({"type": "choice", "choice": ["positive", "negative"]})
    seq = Sequence("r", 0, [0, 5], SamplingParams(response_format={"type": "text"}), None)
    seq.grammar = SequenceGrammar(engine.grammars.compile(spec))
    word = hf.encode("positive", add_special_tokens=False)
    assert len(word) >= 4
    seq.token_ids.append(word[0])
    seq.draft_tokens = [word[1], word[2], hf.encode("zz", add_special_tokens=False)[0], word[0]]
    vocab = engine.runner.vocab_size
    masks, k = MtpSpeculator._grammar_masks(None, seq, vocab)
    assert k == 2 and masks.shape[0] == 3
    assert seq.grammar.num_accepted == 1  # rolled back to the sequence's own output
    from kernels.reference.token_mask import unpack_bitmask

    allowed = unpack_bitmask(masks, vocab)
    for j in range(3):
        assert allowed[j, word[j + 1]] and int(allowed[j].sum()) < vocab


def test_decode_graph_inputs_carry_the_grammar_mask(llm):
    """The graphs' static mask buffers after a fill: the constrained row's words are its
    grammar's mask, the free row and the padding are flagged off."""
    from engine.cuda_graph_runner import DecodeInputs
    from engine.sequence import Sequence
    from engine.structured_output.matcher import SequenceGrammar
    from kernels.reference.token_mask import unpack_bitmask

    engine = llm.engine
    vocab = engine.runner.vocab_size
    inputs = DecodeInputs(4, 3, 4, 9, torch.device("cpu"), vocab_size=vocab)
    constrained = Sequence("a", 0, [5, 6, 7], _params({"type": "choice", "choice": CHOICES}), 1)
    constrained.grammar = SequenceGrammar(
        engine.grammars.compile(grammar_spec({"type": "choice", "choice": CHOICES}))
    )
    free = Sequence("b", 0, [8, 9], SamplingParams(temperature=0.0), None)
    for seq in (constrained, free):
        seq.block_table, seq.num_computed = [0], len(seq) - 1
    inputs.fill([constrained, free], 4)
    assert inputs.constrained.tolist() == [1, 0, 0, 0]
    allowed = unpack_bitmask(inputs.bitmask[:1], vocab)[0]
    firsts = {engine.tokenizer.hf.encode(c, add_special_tokens=False)[0] for c in CHOICES}
    assert set(torch.nonzero(allowed).flatten().tolist()) >= firsts
    assert int(allowed.sum()) < vocab
    inputs.fill([free], 2)  # a later step without grammars clears the flags
    assert inputs.constrained.tolist() == [0, 0, 0, 0]


def test_split_step_fills_the_masks_after_the_other_inputs(llm):
    """A constrained step's inputs in two parts (the split graphs): `fill` without masks
    leaves the mask buffers alone, `fill_masks` then writes the rows of that fill, and
    refuses a constrained row whose last token is still pending or another row count."""
    from engine.cuda_graph_runner import INPUT_IDS, SRC_ROWS, DecodeInputs
    from engine.sequence import PENDING_TOKEN, Sequence
    from engine.structured_output.matcher import SequenceGrammar
    from kernels.reference.token_mask import unpack_bitmask

    engine = llm.engine
    vocab = engine.runner.vocab_size
    spec = grammar_spec({"type": "choice", "choice": CHOICES})
    inputs = DecodeInputs(4, 3, 4, 9, torch.device("cpu"), vocab_size=vocab)
    constrained = Sequence("a", 0, [5, 6, 7], _params({"type": "choice", "choice": CHOICES}), 1)
    constrained.grammar = SequenceGrammar(engine.grammars.compile(spec))
    free = Sequence("b", 0, [8, 9], SamplingParams(temperature=0.0), None)
    for seq in (constrained, free):
        seq.token_ids.append(PENDING_TOKEN)  # the previous step's token, on the device
        seq.block_table, seq.num_computed = [0], len(seq) - 1
    first = engine.tokenizer.hf.encode(CHOICES[0], add_special_tokens=False)[0]
    inputs.sampled[:2] = torch.tensor([40, first])
    rows = {constrained.seq_id: 1, free.seq_id: 0}
    inputs.fill([constrained, free], 4, pending_rows=rows, masks=False)
    assert inputs.ints[SRC_ROWS, :2].tolist() == [1, 0]
    assert inputs.input_ids(4)[:2].tolist() == [first, 40]
    assert inputs.constrained.tolist() == [0, 0, 0, 0]  # not written yet
    with pytest.raises(ValueError, match="pending"):
        inputs.fill_masks([constrained, free])
    constrained.token_ids[-1], free.token_ids[-1] = first, 40  # the previous step, written
    with pytest.raises(ValueError, match="after a fill of 2"):
        inputs.fill_masks([constrained])
    inputs.fill_masks([constrained, free])
    assert inputs.constrained.tolist() == [1, 0, 0, 0]
    allowed = unpack_bitmask(inputs.bitmask[:1], vocab)[0]
    assert 0 < int(allowed.sum()) < vocab
    assert inputs.ints[INPUT_IDS, :2].tolist() == [0, 0]  # still gathered on the device
