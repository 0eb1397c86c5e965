"""`batchgen bench decode`: output tokens per second of our engine on a dense model, at
batch 1 and at many concurrent prompts, against transformers' `generate` on the same
weights in the same run.

    batchgen bench decode --model smollm2-135m-instruct --device cpu

Prompts: short chat-style requests rendered to token ids once and shared by both engines
(cycled to the batch size), `new_tokens` generated greedily with ignore_eos, so every
request produces exactly that many tokens. Numbers per row:
- `tok_s`: batch * new_tokens / wall time of one `generate` call (prefill included);
- `decode_tok_s`: batch * (new_tokens - 1) / (that time - the time of the same call with
  one new token), i.e. throughput once the prompts are in the cache.
transformers runs in float32 on the CPU (bfloat16 on CUDA), loading GGUF files through
its own dequantizing loader; the engine runs with `--dtype` (auto keeps GGUF blocks small).
"""

from __future__ import annotations

import gc
import logging
import re
import time
from pathlib import Path

import click
import torch

from batchgen.bench.common import write_result

PROMPTS = [
    "Translate into French: good morning, how did you sleep?",
    "Summarize in one sentence: the meeting moved to Thursday because the venue flooded.",
    "Write a haiku about a lighthouse.",
    "List three uses of a paperclip.",
    "What is the capital of Japan? Answer briefly.",
    "Explain recursion to a ten-year-old.",
    "Give a synonym for 'happy' and use it in a sentence.",
    "Write the first line of a mystery novel.",
]


def log(msg: str) -> None:
    click.echo(f"[{time.strftime('%H:%M:%S')}] {msg}", err=True)


def prompt_ids(tokenizer, count: int) -> list[list[int]]:
    """`count` prompts as token ids (chat template when the model has one)."""
    rendered = []
    for text in PROMPTS:
        if tokenizer.has_chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
            rendered.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            rendered.append(tokenizer.encode(text))
    return [rendered[i % len(rendered)] for i in range(count)]


def run_engine(llm, prompts: list[list[int]], new_tokens: int) -> dict:
    from engine import SamplingParams

    def timed(max_tokens: int) -> tuple[float, int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)

    first, _ = timed(1)
    elapsed, produced = timed(new_tokens)
    return _row("batchgen", len(prompts), new_tokens, produced, elapsed, first)


def _row(engine, batch, new_tokens, produced, elapsed, first) -> dict:
    decode_s = elapsed - first
    return {
        "engine": engine,
        "batch": batch,
        "new_tokens": new_tokens,
        "output_tokens": produced,
        "seconds": round(elapsed, 3),
        "tok_s": round(produced / elapsed, 2),
        "prefill_s": round(first, 3),
        "decode_tok_s": round(batch * (new_tokens - 1) / decode_s, 2) if decode_s > 0 else None,
    }


def load_transformers(path: Path, device: torch.device):
    """transformers' own model for the same weights (GGUF: its dequantizing loader)."""
    from transformers import AutoModelForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


def run_transformers(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> dict:
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding, as generate expects
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)

    def timed(max_tokens: int) -> tuple[float, int]:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, (out.shape[1] - width) * out.shape[0]

    first, _ = timed(1)
    elapsed, produced = timed(new_tokens)
    return _row("transformers", len(prompts), new_tokens, produced, elapsed, first)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def default_name(model: str, device: str) -> str:
    stem = Path(model).stem if ("/" in model or model.endswith(".gguf")) else model
    slug = re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")
    if slug.startswith("smollm2"):
        slug = "smollm2"
    return f"decode-{device}-{slug}"


def bench_decode(
    model: str,
    device: str,
    dtype: str,
    batches: list[int],
    hf_batches: list[int],
    new_tokens: int,
    threads: int | None,
    batch_invariant: bool = True,
) -> dict:
    from engine import LLM
    from engine.loader import open_model_source

    if threads:
        torch.set_num_threads(threads)
    log(f"loading {model} into batchgen (device={device}, dtype={dtype})")
    start = time.perf_counter()
    llm = LLM(
        model,
        device=device,
        dtype=dtype,
        max_num_seqs=max(batches + [1]),
        batch_invariant=batch_invariant,
    )
    load_s = time.perf_counter() - start
    if llm.tokenizer is None:
        raise click.ClickException(f"{model} has no tokenizer; the benchmark renders text prompts")
    source = llm.engine.runner.source
    model_obj = llm.engine.runner.model
    formats = sorted({m.format.name for m in model_obj.modules() if hasattr(m, "format")})
    head = getattr(model_obj, "lm_head", None)
    if head is None:
        head_desc = f"tied embedding ({model_obj.model.embed_tokens.weight.dtype})"
    else:
        head_desc = getattr(getattr(head, "format", None), "name", type(head).__name__)
    run_engine(llm, prompt_ids(llm.tokenizer, 1), 4)  # warm-up: first-call allocations
    rows = []
    for batch in batches:
        log(f"batchgen: batch {batch}, {new_tokens} new tokens")
        rows.append(run_engine(llm, prompt_ids(llm.tokenizer, batch), new_tokens))
        log(f"  {rows[-1]['tok_s']} tok/s")
    tokenizer = llm.tokenizer
    del llm
    gc.collect()
    if hf_batches:
        log("loading the same weights into transformers")
        path = open_model_source(model).path
        hf_model = load_transformers(path, torch.device(device))
        pad = source.config.get("pad_token_id")
        pad = pad if pad is not None else tokenizer.eos_token_ids[0]
        for batch in hf_batches:
            log(f"transformers: batch {batch}, {new_tokens} new tokens")
            rows.append(run_transformers(hf_model, prompt_ids(tokenizer, batch), new_tokens, pad))
            log(f"  {rows[-1]['tok_s']} tok/s")
        del hf_model
    return {
        "model": model,
        "model_path": str(source.path),
        "device": device,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "weight_formats": formats,
        "lm_head": head_desc,
        "load_s": round(load_s, 2),
        "batch_invariant": batch_invariant,
        "results": rows,
    }


def print_table(payload: dict) -> None:
    click.echo(
        f"\n{payload['model']} on {payload['device']} ({payload['threads']} threads), "
        f"formats: {', '.join(payload['weight_formats'])}, head: {payload['lm_head']}"
    )
    header = f"{'engine':<14}{'batch':>6}{'tok/s':>10}{'decode tok/s':>14}{'prefill s':>11}"
    click.echo(header)
    click.echo("-" * len(header))
    for r in payload["results"]:
        click.echo(
            f"{r['engine']:<14}{r['batch']:>6}{r['tok_s']:>10.1f}"
            f"{(r['decode_tok_s'] or 0):>14.1f}{r['prefill_s']:>11.2f}"
        )


@click.command("decode")
@click.option("--model", default="smollm2-135m-instruct", show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--batches", default="1,32,64", show_default=True, help="Our engine's batches.")
@click.option(
    "--hf-batches", default="1,16", show_default=True, help="transformers' batches ('' skips)."
)
@click.option("--new-tokens", type=int, default=128, show_default=True)
@click.option("--threads", type=int, default=None, help="torch threads (default: torch's).")
@click.option(
    "--batch-invariant/--no-batch-invariant",
    default=True,
    show_default=True,
    help="Our engine's batch-invariant arithmetic (docs/batch-invariance.md).",
)
@click.option("--name", default=None, help="JSON name (default decode-<device>-<model>).")
def command(
    model, device, dtype, batches, hf_batches, new_tokens, threads, batch_invariant, name
) -> None:
    """Decode throughput of a dense model: our engine vs transformers' generate."""
    payload = bench_decode(
        model,
        device,
        dtype,
        _int_list(batches),
        _int_list(hf_batches),
        new_tokens,
        threads,
        batch_invariant,
    )
    print_table(payload)
    path = write_result(name or default_name(model, device), payload)
    click.echo(f"wrote {path}")
