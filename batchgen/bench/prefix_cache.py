"""`batchgen bench prefix-cache`: prompt tokens computed and end-to-end time with the engine's
prefix cache on and off, on three jobs (batchgen/bench/prefix_workloads.py, which vLLM's
side, scripts/vllm_prefix_cache.py, runs too):

- shared: `--rows` rows of one `--prefix-tokens` prefix followed by `--suffix-tokens`
  distinct tokens each (issue 26: 1,000 x 2,000 + 50);
- n: `--n-prompts` distinct prompts of prefix + suffix length, each `--n` times as separate
  requests with their own seeds, as batchgen feeds `sampling.n` (200 x 8);
- distinct: `--rows` prompts of the same length sharing nothing (the cache's overhead).

Each job generates `--new-tokens` tokens per request at temperature 1.0 (seeded, ignore_eos;
greedy collapses random weights' routing). Per job and mode: wall time of
`LLM.generate`, prompt tokens computed (every prefill row the scheduler ran, recomputation
after a preemption included), prompt tokens read from the cache, the distinct prompt
tokens of the job (the fewest any cache can compute: the size of the prompts' token
trie), preemptions and evictions; per job the speedup of on over off, the computed / distinct
ratio with caching, and whether the texts were the same token ids on and off.

One engine serves both modes: `LLM.reset_prefix_cache(enabled)` between runs, so each
starts cold and the model is loaded once. Engine-level (engine.LLM, click, torch): runs
where the pipeline's pydantic / gguf are absent, as `python -m batchgen.bench.prefix_cache`.
Writes $BATCHGEN_BENCH_DIR/<name>.json (default data/benchmarks/).
"""

from __future__ import annotations

import time

import click

from batchgen.bench.common import write_result
from batchgen.bench.prefix_workloads import JOBS, distinct_prompt_tokens, job_prompts


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class PrefillCounter:
    """Counts the prompt rows each scheduled step computes (wraps Scheduler.schedule)."""

    def __init__(self, scheduler) -> None:
        self.computed = 0
        self._schedule = scheduler.schedule
        scheduler.schedule = self._counting

    def _counting(self):
        batch = self._schedule()
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed
            self.computed += max(0, min(start + n, seq.num_prompt_tokens) - start)
        return batch


def run_job(llm, prompts: list[list[int]], new_tokens: int, caching: bool, counter) -> dict:
    from engine import SamplingParams

    llm.reset_prefix_cache(enabled=caching)
    blocks = llm.engine.runner.blocks
    params = [
        SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=1000 + i)
        for i in range(len(prompts))
    ]
    counter.computed = 0
    preempted = llm.num_preemptions
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    cached = sum(o.cached_prompt_tokens for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "caching": caching,
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "prompt_tokens_computed": counter.computed,
        "cached_prompt_tokens": cached,
        "completion_tokens": completion,
        "wall_s": round(wall, 3),
        "total_tok_s": round((sum(len(p) for p in prompts) + completion) / wall, 1),
        "output_tok_s": round(completion / wall, 1),
        "preemptions": llm.num_preemptions - preempted,
        "evictions": blocks.cache.num_evictions if blocks.cache is not None else 0,
        "tokens": [c.token_ids for o in outs for c in o.outputs],
    }


def measure(
    model: str,
    jobs: list[str],
    rows: int,
    prefix: int,
    suffix: int,
    n_prompts: int,
    n: int,
    new_tokens: int,
    engine_options: dict,
    warmup: bool = True,
    on_job=None,
) -> dict:
    """The payload; `on_job(payload so far)` after each job (the bench writes its JSON
    then, so a run cut short keeps the jobs it finished)."""
    from engine import LLM

    llm = LLM(model, **engine_options)
    if not llm.engine.runner.blocks.caches_prefixes:
        raise click.ClickException(f"{model}: this model runs without prefix caching")
    vocab = int(llm.engine.runner.source.config.get("vocab_size", 32000))
    counter = PrefillCounter(llm.engine.scheduler)
    if warmup:  # first calls compile kernels / numba functions: outside every timing
        run_job(llm, job_prompts("distinct", 4, 64, 8, 1, 1, vocab, 99), 4, True, counter)
    results = []
    payload = {
        "model": model,
        "engine": {k: str(v) for k, v in engine_options.items()},
        "block_size": llm.engine.runner.block_size,
        "num_blocks": llm.engine.runner.num_blocks,
        "shape": {
            "rows": rows,
            "prefix_tokens": prefix,
            "suffix_tokens": suffix,
            "n_prompts": n_prompts,
            "n": n,
            "new_tokens": new_tokens,
        },
        "results": results,
    }
    for job in jobs:
        prompts = job_prompts(job, rows, prefix, suffix, n_prompts, n, vocab, seed=1)
        distinct = distinct_prompt_tokens(prompts)
        runs = {}
        for caching in (False, True):
            log(f"{job}: {len(prompts)} requests, caching {'on' if caching else 'off'}")
            runs[caching] = run_job(llm, prompts, new_tokens, caching, counter)
            r = runs[caching]
            log(
                f"  {r['wall_s']:.2f} s, prompt tokens computed {r['prompt_tokens_computed']:,} "
                f"(distinct {distinct:,}), cached {r['cached_prompt_tokens']:,}, "
                f"preemptions {r['preemptions']}"
            )
        on, off = runs[True], runs[False]
        same = on.pop("tokens") == off.pop("tokens")
        results.append(
            {
                "job": job,
                "distinct_prompt_tokens": distinct,
                "off": off,
                "on": on,
                "speedup": round(off["wall_s"] / on["wall_s"], 3),
                "computed_over_distinct": round(on["prompt_tokens_computed"] / distinct, 3),
                "same_tokens": same,
            }
        )
        if on_job is not None:
            on_job(payload)
    return payload


def print_table(payload: dict) -> None:
    print(
        f"{'job':<9} {'requests':>8} {'distinct':>10} {'computed off':>13} {'computed on':>12} "
        f"{'on/distinct':>11} {'off s':>8} {'on s':>8} {'speedup':>8} {'same':>5}"
    )
    for r in payload["results"]:
        on, off = r["on"], r["off"]
        print(
            f"{r['job']:<9} {on['requests']:>8} {r['distinct_prompt_tokens']:>10,} "
            f"{off['prompt_tokens_computed']:>13,} {on['prompt_tokens_computed']:>12,} "
            f"{r['computed_over_distinct']:>11.3f} {off['wall_s']:>8.2f} {on['wall_s']:>8.2f} "
            f"{r['speedup']:>7.2f}x {'yes' if r['same_tokens'] else 'NO':>5}"
        )


@click.command(name="prefix-cache")
@click.option(
    "--model",
    default="smollm2-135m-instruct",
    show_default=True,
    help="model alias or checkpoint directory (e.g. a Moonlight-shaped random one)",
)
@click.option("--jobs", default=",".join(JOBS), show_default=True, help="comma-separated")
@click.option("--rows", default=1000, show_default=True, help="rows of the shared / distinct jobs")
@click.option("--prefix-tokens", default=2000, show_default=True)
@click.option("--suffix-tokens", default=50, show_default=True)
@click.option("--n-prompts", default=200, show_default=True, help="prompts of the n job")
@click.option("--n", "n", default=8, show_default=True, help="completions per prompt, n job")
@click.option("--new-tokens", default=64, show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--max-num-seqs", type=int, default=None)
@click.option("--max-num-batched-tokens", type=int, default=None)
@click.option("--kv-cache-memory", type=int, default=None, help="bytes (default: the engine's)")
@click.option("--no-batch-invariant", is_flag=True, help="the engine's tuned per-size kernels")
@click.option("--name", default=None, help="JSON name (default prefix-cache-<device>)")
def command(
    model, jobs, rows, prefix_tokens, suffix_tokens, n_prompts, n, new_tokens, device, dtype,
    max_num_seqs, max_num_batched_tokens, kv_cache_memory, no_batch_invariant, name,
):  # fmt: skip
    """Prompt tokens computed and end-to-end time, prefix caching on against off."""
    options = {"device": device, "dtype": dtype, "batch_invariant": not no_batch_invariant}
    for key, value in (
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("kv_cache_memory", kv_cache_memory),
    ):
        if value is not None:
            options[key] = value
    wanted = [j.strip() for j in jobs.split(",") if j.strip()]
    for job in wanted:
        if job not in JOBS:
            raise click.BadParameter(f"unknown job {job!r}; use {', '.join(JOBS)}")
    import torch

    default = f"prefix-cache-{'cuda' if torch.cuda.is_available() and device != 'cpu' else 'cpu'}"

    def save(payload: dict) -> None:
        log(f"wrote {write_result(name or default, payload)}")

    payload = measure(
        model, wanted, rows, prefix_tokens, suffix_tokens, n_prompts, n, new_tokens, options,
        on_job=save,
    )  # fmt: skip
    print_table(payload)


if __name__ == "__main__":
    command()
