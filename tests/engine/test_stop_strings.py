"""Stop strings are matched on the decoded text, across token boundaries."""

from engine import LLM, SamplingParams


def test_stop_string_split_across_tokens(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    prompt = "translate into french: good morning"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    ids = free.outputs[0].token_ids
    tok = llm.tokenizer
    # a stop string made of the end of token 5 and the start of token 6
    left, right = tok.decode(ids[5:6]), tok.decode(ids[6:7])
    assert left and right
    stop = left[-1:] + right[:1]
    text_before = tok.decode(ids[:5]) + left[:-1]
    assert stop not in text_before, "pick a prompt whose output does not repeat the stop string"
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text_before
    assert stop not in out.text


def test_chat_applies_the_template(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    messages = [{"role": "user", "content": "good morning"}]
    rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.endswith("assistant:")
    chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    direct = llm.generate(
        [llm.tokenizer.encode(rendered, add_special_tokens=False)],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )[0]
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
