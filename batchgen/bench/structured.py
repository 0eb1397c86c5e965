"""`batchgen bench structured`: output tokens per second with and without a JSON schema, at
several batch sizes, on one model.

    batchgen bench structured --model smollm2-135m-instruct --device cpu --max-tokens 24

Each batch runs twice on the same prompts (short chat-style requests, cycled) and seeds:
free text, then constrained by SCHEMA (compact JSON, as by default). tok/s = the
completions' tokens / wall time of one `generate` call, prefill included. Constrained rows
may stop before max_tokens (the grammar ends them), so both sides count the tokens they
made; `valid` is the share of the constrained rows that stopped and parse against the
schema (a row cut by max_tokens is not counted as valid). The grammar is compiled in a
warm-up call first, and each batch and mode runs once untimed (two tokens: its prefill
shapes compile their kernels), so the times are the per-step mask cost, not one-off work.

Imports only the engine, torch and click (not the pipeline's pydantic / polars), so it also
runs from a checkout on the GPU machine: `python -m batchgen.bench.structured ...`.
The JSON goes to data/benchmarks/ only with --json NAME.
"""

from __future__ import annotations

import json
import time

import click

from batchgen.bench.common import write_result

PROMPTS = [
    "Describe a fictional person as JSON with name, age and city.",
    "Give me a product review as JSON.",
    "Return a JSON record for a book: title, author, year.",
    "Write a support ticket as JSON.",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}


def _prompt_ids(llm, batch: int) -> list[list[int]]:
    tok = llm.tokenizer
    rendered = []
    for text in PROMPTS:
        if tok.has_chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": text}])
            rendered.append(tok.encode(text, add_special_tokens=False))
        else:
            rendered.append(tok.encode(text))
    return [list(rendered[i % len(rendered)]) for i in range(batch)]


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == set(SCHEMA["required"])


def run_batch(llm, batch: int, max_tokens: int) -> dict:
    from engine import SamplingParams

    prompts = _prompt_ids(llm, batch)
    row = {"batch": batch}
    for label, fmt in (("free", None), ("json", RESPONSE_FORMAT)):
        params = [
            SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, response_format=fmt)
            for i in range(batch)
        ]
        # untimed: this batch's prefill shapes compile their kernels on first use
        warm = [SamplingParams(temperature=0.8, seed=i, max_tokens=2, response_format=fmt)
                for i in range(batch)]  # fmt: skip
        llm.generate(prompts, warm)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row[f"{label}_tok_s"] = tokens / elapsed
        row[f"{label}_tokens"] = tokens
        if fmt is not None:
            stopped = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
            row["valid"] = sum(_valid(c.text) for c in stopped) / batch
    row["slowdown_pct"] = 100.0 * (1.0 - row["json_tok_s"] / row["free_tok_s"])
    return row


def bench_structured(model, device, dtype, batches, max_tokens) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=max(batches))
    start = time.perf_counter()
    warm = SamplingParams(max_tokens=2, response_format=RESPONSE_FORMAT)
    llm.generate(_prompt_ids(llm, 2), [warm, SamplingParams(max_tokens=2)])
    warmup_s = time.perf_counter() - start
    rows = [run_batch(llm, b, max_tokens) for b in batches]
    return {
        "model": model,
        "device": device,
        "max_tokens": max_tokens,
        "warmup_s": warmup_s,
        "rows": rows,
    }


def print_table(payload: dict) -> None:
    click.echo(f"{payload['model']} on {payload['device']}, max_tokens {payload['max_tokens']}")
    click.echo(f"{'batch':>6} {'free tok/s':>11} {'json tok/s':>11} {'slower':>7} {'valid':>6}")
    for r in payload["rows"]:
        click.echo(
            f"{r['batch']:>6} {r['free_tok_s']:>11.1f} {r['json_tok_s']:>11.1f} "
            f"{r['slowdown_pct']:>6.1f}% {r['valid']:>6.0%}"
        )


@click.command("structured")
@click.option("--model", default="smollm2-135m-instruct", show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--batches", default="1,32,128", show_default=True)
@click.option("--max-tokens", type=int, default=24, show_default=True)
@click.option("--json", "json_name", default=None, help="Also write data/benchmarks/NAME.json.")
def command(model, device, dtype, batches, max_tokens, json_name) -> None:
    """Decode tok/s with and without a JSON schema."""
    sizes = [int(x) for x in batches.split(",") if x.strip()]
    payload = bench_structured(model, device, dtype, sizes, max_tokens)
    print_table(payload)
    if json_name:
        click.echo(f"wrote {write_result(json_name, payload)}")


if __name__ == "__main__":
    command()
