"""The workloads of the vLLM comparison, shared by our side (`batchgen bench peer`) and
vLLM's (scripts/vllm_peer.py): plain Python, no torch, so the vLLM environment imports it.

- short: the anchor's shape (../shared/tools/vllm-anchor/vllm_moonlight.py): prompt i is
  [(7i + 13j) mod 160000 + 2 for j < 128], 128 new tokens, one batch per size.
- long: overnight summarization: 512 distinct 4,000-token prompts (no two share a first
  token), 256 new tokens each.
- mixed: a job of 512 requests, prompts of 100 to 8,000 tokens and outputs of 32 to 512,
  drawn by random.Random(0), each output cut to fit Moonlight's 8,192-token context beside
  its prompt; distinct prompts.

The long and mixed protocols give their warm-up and prefill-only passes prompts of their
own (WARM_START, PREFILL_START), so the measured run meets no cached prefix. The short
protocol repeats the anchor's prompts in its passes, as the anchor did (both engines then
find the prefill pass's prompts in their prefix caches).

Every request samples at the workload's temperature with seed 0 (as the anchor's did) and
ignores EOS, so each makes exactly its max_tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB_SPAN = 160_000  # ids 2 .. 160001: inside Moonlight's 163,840, clear of BOS/EOS


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


def short_prompt(i: int, length: int = 128) -> list[int]:
    return [(7 * i + 13 * j) % VOCAB_SPAN + 2 for j in range(length)]


def distinct_prompt(i: int, length: int) -> list[int]:
    """Prompt i of a set where no two prompts share a first token (so no shared prefix
    for a prefix cache to find): a multiplicative walk from a start of its own."""
    return [(i + 1 + j * (2 * i + 7919)) % VOCAB_SPAN + 2 for j in range(length)]


def short(batch: int, prompt_len: int = 128, gen: int = 128) -> list[Request]:
    return [Request(short_prompt(i, prompt_len), gen) for i in range(batch)]


def long(count: int = 512, prompt_len: int = 4000, gen: int = 256, start: int = 0) -> list[Request]:
    """`start`: the first prompt's index; each pass of a protocol takes prompts of its own,
    so no pass finds another's prompts in a prefix cache."""
    return [Request(distinct_prompt(start + i, prompt_len), gen) for i in range(count)]


# Moonlight's context (max_position_embeddings) less the engines' margin of 16: a mixed
# request's output is cut to fit beside its prompt (an 8,000-token prompt gets 176)
CONTEXT = 8192 - 16


def mixed(count: int = 512, seed: int = 0, start: int = 0) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt_len, max_tokens = rng.randint(100, 8000), rng.randint(32, 512)
        out.append(Request(distinct_prompt(start + i, prompt_len),
                           min(max_tokens, CONTEXT - prompt_len)))  # fmt: skip
    return out


# prompt offsets of the long and mixed protocols' passes (below 160,000: first tokens stay
# distinct across passes too)
WARM_START, PREFILL_START = 50_000, 100_000


def scaled(requests: list[Request], max_tokens: int) -> list[Request]:
    """The same prompts asking for max_tokens each (the prefill-only pass: 1)."""
    return [Request(r.prompt, max_tokens) for r in requests]


def summary(requests: list[Request]) -> dict:
    prompts = [len(r.prompt) for r in requests]
    return {
        "requests": len(requests),
        "prompt_tokens": sum(prompts),
        "output_tokens": sum(r.max_tokens for r in requests),
        "longest_prompt": max(prompts),
        "longest_request": max(len(r.prompt) + r.max_tokens for r in requests),
    }
