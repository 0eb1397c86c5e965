"""Rendering: data is never template code, the chat template and system prompt are applied,
and the overflow policy keeps prompts inside the context."""

from __future__ import annotations

import pytest

from batchgen.job_spec import JobError, PromptSpec
from batchgen.render import PromptRenderer
from batchgen.rows import InputRow
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer.from_dir(tiny_model_dir)


def _renderer(tokenizer, max_model_len=256, max_tokens=16, **prompt):
    spec = PromptSpec(**{"template": "Translate:\n{{ text }}", **prompt})
    return PromptRenderer(spec, tokenizer, max_model_len, max_tokens, {"text": "input_text"})


def _row(text, **extra):
    return InputRow(seq=0, id="x", values={"text": text, **extra})


@pytest.mark.parametrize(
    "literal", ["{{ 7*7 }}", "{% for x in range(3) %}loop{% endfor %}", "{{ ''.__class__ }}"]
)
def test_row_values_are_data_not_template_code(tokenizer, literal):
    r = _renderer(tokenizer)
    prepared = r.prepare(_row(f"keep {literal} verbatim"))
    assert prepared.error is None
    seen = tokenizer.decode(prepared.prompt_token_ids, skip_special_tokens=False)
    assert f"keep {literal} verbatim" in seen
    assert "49" not in seen and "looplooploop" not in seen


def test_chat_template_and_system_prompt(tokenizer):
    r = _renderer(tokenizer, system="You translate business text.")
    ids = r.prepare(_row("Good morning")).prompt_token_ids
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text == (
        "<|im_start|>system\nYou translate business text.<|im_end|>\n"
        "<|im_start|>user\nTranslate:\nGood morning<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = _renderer(tokenizer, chat=False, system="Be brief.")
    assert plain.full_prompt("hi") == "Be brief.\n\nhi"


def test_sandbox_blocks_unsafe_template(tokenizer):
    r = _renderer(tokenizer, template="{{ text.__class__.__mro__[1].__subclasses__() }}")
    prepared = r.prepare(_row("x"))
    assert prepared.error is not None and prepared.error.type == "render_error"


def test_null_and_blank_rows_are_errors(tokenizer):
    r = _renderer(tokenizer)
    assert r.prepare(_row(None)).error.type == "null_input"
    assert r.prepare(_row("")).error.type == "empty_prompt"
    assert r.prepare(_row(" \t\n\u3000 ")).error.type == "empty_prompt"


def test_overflow_policies(tokenizer):
    long_text = "START " + " ".join(f"w{i}" for i in range(400)) + " END"
    budget = 256 - 16
    err = _renderer(tokenizer).prepare(_row(long_text))
    assert err.error.type == "prompt_too_long" and str(budget) in err.error.message

    left = _renderer(tokenizer, overflow="truncate_left").prepare(_row(long_text))
    assert left.error is None and left.truncated and left.num_prompt_tokens <= budget
    left_text = tokenizer.decode(left.prompt_token_ids, skip_special_tokens=False)
    assert "END" in left_text and "START" not in left_text
    assert left_text.endswith("<|im_start|>assistant\n")  # the template is never cut

    mid = _renderer(tokenizer, overflow="truncate_middle").prepare(_row(long_text))
    assert mid.error is None and mid.num_prompt_tokens <= budget
    mid_text = tokenizer.decode(mid.prompt_token_ids, skip_special_tokens=False)
    assert "START" in mid_text and "END" in mid_text and "…" in mid_text


def test_system_prompt_alone_over_budget_is_an_error_row(tokenizer):
    r = _renderer(tokenizer, max_model_len=64, max_tokens=8, system="word " * 80,
                  overflow="truncate_left")  # fmt: skip
    assert r.prepare(_row("hello")).error.type == "prompt_too_long"


def test_max_tokens_leaving_no_room_is_refused(tokenizer):
    with pytest.raises(JobError, match="max_tokens"):
        _renderer(tokenizer, max_model_len=64, max_tokens=64)
