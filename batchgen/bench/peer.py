"""`batchgen bench peer`: our side of the vLLM comparison, on the workloads and with the
timing protocol of scripts/vllm_peer.py (vLLM's side), so the two JSON files compare row by
row (`--compare vllm.json` adds the ratios).

The model is the random Moonlight-16B-A3B of `bench decode-moe --in-memory` (a `random:`
spec drawn on the GPU: bf16, or FP8 dense + MXFP4 experts), or `--model PATH`. Requests go
through the offline API, `LLM.generate`, as a user's would.

Protocol (the anchor's, ../shared/tools/vllm-anchor/vllm_moonlight.py):
- short: a warm-up of 4 requests x 8 tokens; per batch a warm pass (4 new tokens), t1 =
  the batch with 1 new token (prefill and one sample), tg = the batch with `--gen`;
  e2e_tok_s = batch x gen / tg, decode_tok_s = batch x (gen - 1) / (tg - t1),
  prefill_tok_s = prompt tokens / t1. Then, untimed, a pass of 16 new tokens with routing
  recorded: the distinct experts per MoE layer per decode step (against uniform routing's).
- long, mixed: a warm pass of 64 requests of the shape, t1 = the workload's shape with 1
  new token, t = the whole workload (each pass on prompts of its own: peer_workloads); e2e_tok_s = output tokens / t, prefill_tok_s = prompt tokens / t1.
Runs on a CUDA GPU, also as `python -m batchgen.bench.peer` (torch, click; no polars).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import click

from batchgen.bench import peer_workloads as workloads
from batchgen.bench.common import write_result

SHORT_BATCHES = (1, 8, 32, 128, 256, 512, 1024)


def _generate(llm, requests, temperature: float) -> tuple[float, int]:
    from engine.sampling_params import SamplingParams

    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=temperature,
                       seed=0 if temperature > 0 else None, ignore_eos=True)
        for r in requests
    ]  # fmt: skip
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    return seconds, made


def _engine_info(llm, load_s: float) -> dict:
    runner = llm.engine.runner
    return {
        "load_s": round(load_s, 1),
        "graph_buckets": runner.graphs.buckets if runner.graphs else None,
        "capture_s": round(runner.graphs.capture_seconds, 1) if runner.graphs else None,
        "graph_pool_gib": round(runner.graphs.pool_bytes / 2**30, 2) if runner.graphs else None,
        "kv_blocks": runner.num_blocks,
        "max_num_seqs": llm.engine.config.max_num_seqs,
        "batch_size_choice": llm.batch_size_choice,
        "batch_invariant": llm.engine.config.batch_invariant,
    }


ROUTING_TOKENS = 16  # decode steps of the routing pass (eager: recording leaves the graphs)


def distinct_experts(llm, requests, temperature: float) -> dict:
    """Distinct routed experts per MoE layer per decode step, from one more pass of the
    batch with routing recorded (after the timed ones: recording steps run eagerly), and
    what uniform routing would touch, E x (1 - (1 - k/E)^batch). Empty for a model
    without routed experts."""
    if not llm.record_routing(True):
        return {}
    try:
        _generate(llm, requests, temperature)
        decode = llm.routing_stats()["decode"]
    finally:
        llm.record_routing(False)
    config = llm.engine.runner.source.config
    experts, top_k = config.get("n_routed_experts"), config.get("num_experts_per_tok")
    out = {"distinct_experts_per_layer_step": round(decode["mean_distinct_experts"], 2)}
    if experts and top_k:
        uniform = experts * (1 - (1 - top_k / experts) ** len(requests))
        out["distinct_experts_uniform"] = round(uniform, 2)
    return out


def _decode_tok_s(batch: int, gen: int, tg: float, t1: float) -> float | None:
    """The anchor's decode estimate, batch x (gen - 1) / (tg - t1); None (with a warning)
    where the 1-token pass took as long as the whole one, so that a stall in t1 cannot
    pass for a decode rate."""
    if tg <= t1:
        print(f"batch {batch}: t1 {t1:.3f} s >= tg {tg:.3f} s, no decode estimate", flush=True)
        return None
    return batch * (gen - 1) / (tg - t1)


def run_short(llm, batches, prompt_len: int, gen: int, temperature: float, weights: str):
    _generate(llm, workloads.short(4, prompt_len, 8), temperature)
    rows = []
    for b in batches:
        reqs = workloads.short(b, prompt_len, gen)
        _generate(llm, workloads.scaled(reqs, 4), temperature)
        t1, _ = _generate(llm, workloads.scaled(reqs, 1), temperature)
        tg, made = _generate(llm, reqs, temperature)
        distinct = distinct_experts(llm, workloads.scaled(reqs, ROUTING_TOKENS), temperature)
        row = {"engine": "batchgen", "workload": "short", "weights": weights, "batch": b,
               **distinct,
               "temperature": temperature, "e2e_tok_s": made / tg,
               "decode_tok_s": _decode_tok_s(b, gen, tg, t1),
               "prefill_tok_s": b * prompt_len / t1, "t_gen_s": tg, "t_prefill1_s": t1}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def run_job_shape(llm, name: str, make, temperature: float, weights: str):
    """`make(start=...)`: the workload's requests, prompts from index `start` on."""
    requests = make(start=0)
    shape = workloads.summary(requests)
    _generate(llm, make(start=workloads.WARM_START)[:64], temperature)
    t1, _ = _generate(llm, workloads.scaled(make(start=workloads.PREFILL_START), 1), temperature)
    t, made = _generate(llm, requests, temperature)
    row = {"engine": "batchgen", "workload": name, "weights": weights, **shape,
           "temperature": temperature, "e2e_tok_s": made / t,
           "total_tok_s": (made + shape["prompt_tokens"]) / t,
           "prefill_tok_s": shape["prompt_tokens"] / t1, "t_s": t, "t_prefill1_s": t1}  # fmt: skip
    print(json.dumps(row), flush=True)
    return [row]


def add_ratios(rows: list[dict], vllm_rows: list[dict]) -> None:
    """ratio_vs_vllm (e2e, and decode / prefill where both have them) on each of our rows
    that vLLM's file has a row for (same workload and batch)."""
    theirs = {(r.get("workload", "short"), r.get("batch")): r for r in vllm_rows}
    for row in rows:
        peer = theirs.get((row["workload"], row.get("batch")))
        if peer is None:
            continue
        for key in ("e2e_tok_s", "decode_tok_s", "prefill_tok_s"):
            if row.get(key) and peer.get(key):
                row[f"{key}_ratio_vs_vllm"] = row[key] / peer[key]


@click.command("peer")
@click.option("--workload", type=click.Choice(["short", "long", "mixed"]), default="short",
              show_default=True)  # fmt: skip
@click.option("--weights", type=click.Choice(["bf16", "fp8-mxfp4"]), default="bf16",
              show_default=True)  # fmt: skip
@click.option("--model", default=None, help="A checkpoint (default: the random Moonlight).")
@click.option("--batches", default=",".join(map(str, SHORT_BATCHES)), show_default=True,
              help="short: the batch sizes.")  # fmt: skip
@click.option("--prompt-len", type=int, default=128, show_default=True, help="short only.")
@click.option("--gen", type=int, default=128, show_default=True, help="short only.")
@click.option("--requests", "count", type=int, default=512, show_default=True,
              help="long, mixed: requests in the job.")  # fmt: skip
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--max-num-seqs", default=None,
              help="Engine batch (default: short the largest batch; long/mixed auto).")  # fmt: skip
@click.option("--max-num-batched-tokens", type=int, default=16384, show_default=True)
@click.option("--batch-invariant/--no-batch-invariant", default=True, show_default=True)
@click.option("--device", default="cuda", show_default=True)
@click.option("--compare", "compare", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A scripts/vllm_peer.py JSON of the same workload: adds the ratios.")  # fmt: skip
@click.option("--name", default=None, help="JSON name (default: peer-<workload>-<weights>).")
def command(workload, weights, model, batches, prompt_len, gen, count, temperature,
            max_num_seqs, max_num_batched_tokens, batch_invariant, device, compare, name):  # fmt: skip
    from batchgen.bench.decode_moe import random_model
    from engine.llm import LLM

    batch_list = tuple(int(b) for b in batches.split(","))
    if workload == "short":
        requests = workloads.short(max(batch_list), prompt_len, gen)
    elif workload == "long":
        make = functools.partial(workloads.long, count)
    else:
        make = functools.partial(workloads.mixed, count)
    if workload != "short":
        requests = make(start=0)
    shape = workloads.summary(requests)
    seqs = max_num_seqs or (max(batch_list) if workload == "short" else "auto")
    seqs = int(seqs) if str(seqs).isdigit() else seqs
    mean_len = (shape["prompt_tokens"] + shape["output_tokens"]) // shape["requests"]
    start = time.perf_counter()
    llm = LLM(
        model or random_model("deepseek_v3", "moonlight-16b-a3b", None, weights),
        device=device,
        dtype="bfloat16" if device == "cuda" else "auto",
        max_num_seqs=seqs,
        expected_seq_len=mean_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=shape["longest_request"] + 16,
        batch_invariant=batch_invariant,
    )
    info = _engine_info(llm, time.perf_counter() - start)
    print(json.dumps(info), flush=True)
    if workload == "short":
        rows = run_short(llm, batch_list, prompt_len, gen, temperature, weights)
    else:
        rows = run_job_shape(llm, workload, make, temperature, weights)
    payload = {"workload": workload, "weights": weights, "model": model or "random Moonlight",
               "engine_info": info, "results": rows}  # fmt: skip
    if compare:
        vllm = json.loads(Path(compare).read_text())
        add_ratios(rows, vllm.get("results", []))
        payload["vllm_file"] = str(compare)
    inv = "" if batch_invariant else "-no-invariant"
    path = write_result(name or f"peer-{workload}-{weights}{inv}", payload)
    for r in rows:
        ratio = r.get("e2e_tok_s_ratio_vs_vllm")
        print(f"{r['workload']} batch {r.get('batch', r.get('requests'))}: e2e "
              f"{r['e2e_tok_s']:.0f} tok/s" + (f" ({ratio:.2f}x vLLM)" if ratio else ""))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    command()
