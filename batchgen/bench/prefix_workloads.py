"""The jobs of `batchgen bench prefix-cache`, shared with vLLM's side
(scripts/vllm_prefix_cache.py): plain Python, no torch or click, so the vLLM environment
loads this file by its path.

- shared: `rows` prompts of one `prefix`-token head followed by `suffix` distinct tokens
  each (issue 26: 1,000 x 2,000 + 50);
- n: `n_prompts` distinct prompts of prefix + suffix tokens, each `n` times as separate
  requests (200 x 8), as batchgen feeds `sampling.n`;
- distinct: `rows` prompts of the same length sharing nothing (the cache's overhead).
"""

from __future__ import annotations

import random

JOBS = ("shared", "n", "distinct")


def distinct_prompt_tokens(prompts: list[list[int]]) -> int:
    """Nodes of the prompts' token trie: each distinct (prefix, next token) counted once."""
    total, previous = 0, []
    for p in sorted(prompts):
        shared = 0
        for a, b in zip(previous, p):
            if a != b:
                break
            shared += 1
        total += len(p) - shared
        previous = p
    return total


def job_prompts(
    job: str, rows: int, prefix: int, suffix: int, n_prompts: int, n: int, vocab: int, seed: int
) -> list[list[int]]:
    """The job's prompts, one per request, in the order they are fed (an n > 1 prompt's
    requests next to each other, as batchgen's request feed gives them)."""
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(k)]

    if job == "shared":
        head = tokens(prefix)
        return [head + tokens(suffix) for _ in range(rows)]
    if job == "n":
        return [p for p in (tokens(prefix + suffix) for _ in range(n_prompts)) for _ in range(n)]
    if job == "distinct":
        return [tokens(prefix + suffix) for _ in range(rows)]
    raise ValueError(f"unknown job {job!r}; use {', '.join(JOBS)}")
