"""`batchgen bench decode-moe`: decode throughput of a DeepSeek MoE model on a CUDA GPU, our
engine against the memory roofline and (V3 family) transformers' `generate`.

V3 (the default `--arch deepseek_v3`), in one process: measure the device copy bandwidth; generate a random checkpoint on the GPU
(`make_random_checkpoint`, Moonlight-16B-A3B shapes by default) in bf16 and in FP8 dense +
MXFP4 experts; run our engine at each batch size (prompts of 128 random tokens, 128 new
tokens, ignore_eos, sampled at temperature 1.0 by default); profile one decode step (kernel launches, host time); then run
transformers' DeepseekV3ForCausalLM `generate` on the same bf16 checkpoint.

Per batch size it prints tok/s, ms per decode step, the fraction of the roofline and the
speedup over transformers, and writes data/benchmarks/<name>.json with `machine`,
`copy_tb_s` and `results` (one row per engine, weights, batch).

Numbers:
- batchgen `tok_s` is decode throughput: batch * decode steps / their wall time, from
  `LLMEngine.step` (host work included; prefill steps excluded). `e2e_tok_s` includes
  prefill. `graph_ms` is one CUDA graph replay alone (device time, events).
- transformers `tok_s` is batch * new tokens / the wall time of `generate` (its prefill is
  one forward of 128 tokens, small against 128 decode steps).
- roofline: the fewest bytes a decode step must read at the mean context (all non-expert
  weights once, the LM head, the expected distinct routed experts per MoE layer for
  uniform routing E(1-(1-k/E)^B), and the KV cache), over the measured copy bandwidth.

`--in-memory` (V3): the models are `random:` specs (engine/loader/random_source.py), drawn
on the GPU while the engine loads them, with no checkpoint written (so shapes the disk
would not hold run) and no transformers comparison.

`--arch deepseek_v4` (`--preset v4-flash|tiny`, `--layers N`, default 4; `--weights
fp8-mxfp4|bf16`): the first N layers of DeepSeek-V4 at the preset's shapes, their weights
drawn on the GPU while the engine loads them (a `random:` spec, `random_model`: no files,
so N up to ~20 fits the H200's memory and a run fits minutes); prompts of 512 random tokens (128 CSA and
4 HCA entries per sequence at V4-Flash's ratios), 32 new tokens sampled at temperature 1.0.
Per batch: tok/s, each layer's time in the decode step (CUDA events around it) against the
bytes it must read (batchgen/bench/v4_roofline.py) over the copy bandwidth, and the same
figures for the preset's whole layer count, extrapolated from the measured layers by kind
(`extrapolated`); per run: kernel launches per decode step at batch 1 and whether decode
steps replayed CUDA graphs (`cuda_graphs`). No transformers comparison.

Run on the GPU machine as `python -m batchgen.bench.decode_moe` (needs torch, triton,
transformers, click; not the pipeline's polars/pydantic).
"""

from __future__ import annotations

import collections
import functools
import gc
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import click
import torch

from batchgen.bench import offload_figures as offload
from batchgen.bench.common import write_result
from batchgen.bench.v4_roofline import DecodeReads, extrapolate_step_ms
from engine.config import FP8_NATIVE_MIN_TOKENS

WEIGHTS = {"bf16": ("bf16", "bf16"), "fp8-mxfp4": ("fp8", "mxfp4")}
ENGINE_BATCHES = (1, 8, 32, 128, 256)
HF_BATCHES = (1, 32, 128)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- bytes per step -----------------------------------------------------------------------
def step_bytes(model, batch: int, mean_context: int, kv_bytes_per_token: int) -> dict:
    """Bytes one decode step of `batch` sequences must read, by part."""
    from engine.layers.moe import RoutedExperts

    expert_params: set[int] = set()
    routed = 0.0
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            e, k = module.num_experts, _top_k(model)
            distinct = e * (1 - (1 - k / e) ** batch)
            routed += distinct * module.bytes_per_expert()
            expert_params.update(id(p) for p in module.parameters())
    embed = model.model.embed_tokens.weight
    dense = sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if id(p) not in expert_params and p is not embed
    )
    rows = batch * embed.shape[1] * embed.element_size()
    kv = batch * mean_context * kv_bytes_per_token
    return {"dense": dense, "routed": routed, "embed_rows": rows, "kv": kv}


def _top_k(model) -> int:
    return int(model.config.num_experts_per_tok)


# -- our engine ---------------------------------------------------------------------------
def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Ids 258+ avoid the byte tokenizer's special and low ids; any id is a valid input. A
    # vocabulary of the tokenizer's 258 alone (V4's tiny preset) takes the 256 bytes.
    low, high = (258, vocab) if vocab > 258 else (0, min(vocab, 256))
    return torch.randint(low, high, (batch, length), generator=gen).tolist()


def run_engine_batch(
    llm,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    vocab: int,
    sampling: dict | None = None,
    clock: LayerClock | None = None,
) -> dict:
    """`sampling`: SamplingParams fields of the measured requests (default greedy); `clock`
    times the layers of the measured decode steps."""
    from engine.sampling_params import SamplingParams

    engine = llm.engine
    # Warm-up with other prompts of the same shape: a batch's first prefill compiles the
    # Triton kernels for its token counts (~2 s for batch 8 on the H200), which is not what
    # end-to-end throughput should measure.
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, prompt_len, vocab, seed=batch + 10_000)):
        engine.add_request(f"warm{batch}-{i}", prompt, warm)
    while engine.has_unfinished():
        engine.step()
    params = SamplingParams(**(sampling or {"temperature": 0.0}), max_tokens=new_tokens,
                            ignore_eos=True)  # fmt: skip
    for i, prompt in enumerate(random_prompts(batch, prompt_len, vocab, seed=batch)):
        engine.add_request(f"b{batch}-{i}", prompt, params)
    decode_s: list[float] = []
    prefill_s = 0.0  # steps that compute prompt tokens (end-to-end time beyond decode)
    start = time.perf_counter()
    done = 0
    while engine.has_unfinished():
        running = list(engine.scheduler.running)  # the step finishes sequences in place
        decode = not engine.scheduler.waiting and all(s.num_computed == len(s) - 1 for s in running)
        if clock is not None:
            clock.on = decode and bool(running)
        t0 = time.perf_counter()
        done += len(engine.step())
        if decode and running:
            decode_s.append(time.perf_counter() - t0)
        elif not decode:
            prefill_s += time.perf_counter() - t0
    total = time.perf_counter() - start
    if clock is not None:
        clock.on = False
    if done != batch:
        raise RuntimeError(f"batch {batch}: {done} requests finished, expected {batch}")
    ms = 1e3 * statistics.median(decode_s)
    return {
        "ms_per_step": ms,
        "tok_s": batch / (ms * 1e-3),
        "e2e_tok_s": batch * new_tokens / total,
        "decode_steps": len(decode_s),
        "prefill_ms": 1e3 * prefill_s,
    }


def run_varied_lengths(llm, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    """End to end as a real job runs: 4 x `batch` requests through `batch` slots, each
    asking for 1/4 to 2x `new_tokens` (seeded), so sequences finish at different steps
    and waiting ones are admitted mid-run (continuous batching). Counts the steps that
    replayed a decode graph and those that ran eagerly (any prefill row).

    The workload runs twice and the second run is the figure: the first meets prefill
    sizes the earlier runs did not (tuned kernel tiles per token bucket), whose Triton
    compiles fall inside it (H200, batch 256: ~20% below the warm run,
    docs/notes-gpu-engine.md); it is kept as `first_run_e2e_tok_s`."""
    first = _varied_pass(llm, batch, prompt_len, new_tokens, vocab, "cold")
    warm = _varied_pass(llm, batch, prompt_len, new_tokens, vocab, "warm")
    return {**warm, "first_run_e2e_tok_s": first["e2e_tok_s"]}


def _varied_pass(llm, batch, prompt_len, new_tokens, vocab, tag: str) -> dict:
    from engine.sampling_params import SamplingParams

    engine = llm.engine
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(new_tokens // 4, 2 * new_tokens + 1, (4 * batch,), generator=gen)
    prompts = random_prompts(4 * batch, prompt_len, vocab, seed=batch + 20_000)
    for i, (prompt, n) in enumerate(zip(prompts, lens.tolist())):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request(f"v{batch}-{tag}-{i}", prompt, params)
    schedule, kinds = engine.scheduler.schedule, collections.Counter()

    def counting():
        b = schedule()
        kinds[
            "decode" if b.seqs and b.is_decode else "prefill or mixed" if b.seqs else "empty"
        ] += 1
        return b

    engine.scheduler.schedule = counting
    try:
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        total = time.perf_counter() - start
    finally:
        engine.scheduler.schedule = schedule
    return {"requests": 4 * batch, "tokens": int(lens.sum()), "e2e_tok_s": int(lens.sum()) / total,
            "steps": dict(kinds)}  # fmt: skip


def graph_replay_ms(runner, batch: int) -> float | None:
    """Device time of one graph replay of `batch`'s bucket (its inputs as last filled)."""
    graphs = runner.graphs
    if graphs is None:
        return None
    from engine.cuda_graph_runner import bucket_for

    bucket = bucket_for(batch, graphs.buckets)
    if bucket is None:
        return None
    graph = graphs.graphs[bucket]
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


class _WaitTimer:
    """Seconds spent waiting for a launched step's tokens (PendingStep.tokens) while on."""

    def __enter__(self):
        from engine.pending_step import PendingStep

        self.seconds = 0.0
        self._original = PendingStep.tokens
        timer, original = self, self._original

        def timed(step):
            t0 = time.perf_counter()
            try:
                return original(step)
            finally:
                timer.seconds += time.perf_counter() - t0

        PendingStep.tokens = timed
        return self

    def __exit__(self, *exc):
        from engine.pending_step import PendingStep

        PendingStep.tokens = self._original


def profile_prefill_step(llm, prompt_len: int, vocab: int, batch: int) -> dict:
    """Device time by kernel, host time by op and wall time of the step that prefills
    `batch` prompts (one step when they fit max_num_batched_tokens): where end-to-end time
    beyond decode goes. A wall time far above the kernels' sum points at the host (its
    ops by self time say which)."""
    from torch.profiler import ProfilerActivity, profile

    from engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    plain_ms = _prefill_wall_ms(engine, prompt_len, vocab, batch, params)
    python_top = _prefill_python_profile(engine, prompt_len, vocab, batch, params)
    cuda = torch.cuda.is_available()
    for i, prompt in enumerate(random_prompts(batch, prompt_len, vocab, seed=11)):
        engine.add_request(f"prefill-{i}", prompt, params)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    # verbose: without it key_averages(group_by_stack_n) returns empty stacks
    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)
    with profile(activities=activities, with_stack=True, experimental_config=verbose) as prof:
        t0 = time.perf_counter()
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us: collections.Counter = collections.Counter()
    for e in kernels:
        device_us[e.name[:60]] += e.time_range.elapsed_us()
    host_us: collections.Counter = collections.Counter()
    for e in prof.key_averages():
        if e.self_cpu_time_total > 0:
            host_us[e.key[:60]] += e.self_cpu_time_total
    # prompts this one step computed in full (the rest did not fit max_num_batched_tokens)
    prefilled = sum(1 for s in engine.scheduler.running if s.num_computed >= len(s) - 1)
    while engine.has_unfinished():
        engine.step()
    return {
        "prompts": batch,
        "prefilled_prompts": prefilled,
        "plain_wall_ms": plain_ms,
        "wall_ms": 1e3 * wall,
        "kernel_us": sum(device_us.values()),
        "kernels": len(kernels),
        "top_kernels_us": {n: round(us, 1) for n, us in device_us.most_common(16)},
        "host_op_us": sum(host_us.values()),
        "top_host_ops_us": {n: round(us, 1) for n, us in host_us.most_common(16)},
        "waits": host_waits(prof),
        "device_ops": device_ops(prof),
        "device_us_by_op": device_time_by_op(prof),
        "python_top": python_top,
    }


def _prefill_requests(engine, prompt_len: int, vocab: int, batch: int, params, tag: str) -> None:
    for i, prompt in enumerate(random_prompts(batch, prompt_len, vocab, seed=11)):
        engine.add_request(f"{tag}-{i}", prompt, params)


def _finish(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prefill_wall_ms(engine, prompt_len: int, vocab: int, batch: int, params) -> float:
    """Wall time of one prefill step with no profiler attached (synchronized both ends)."""
    _prefill_requests(engine, prompt_len, vocab, batch, params, "plain")
    _sync()
    t0 = time.perf_counter()
    engine.step()
    _sync()
    wall = time.perf_counter() - t0
    _finish(engine)
    return 1e3 * wall


def _prefill_python_profile(engine, prompt_len, vocab, batch, params, top: int = 25) -> list:
    """The prefill step's Python functions by self time under cProfile (which slows
    Python-heavy code ~1.5-2x, so read shares, not absolute times): what the host does
    while the GPU waits for it."""
    import cProfile
    import pstats

    _prefill_requests(engine, prompt_len, vocab, batch, params, "cprofile")
    _sync()
    prof = cProfile.Profile()
    prof.enable()
    engine.step()
    _sync()
    prof.disable()
    _finish(engine)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        {"fn": f"{file.split('/')[-1]}:{line}:{name}", "calls": nc,
         "self_ms": round(1e3 * tt, 2), "cum_ms": round(1e3 * ct, 2)}
        for (file, line, name), (_cc, nc, tt, ct, _callers) in rows
    ]  # fmt: skip


# Host ops that wait for the GPU (or may): each one drains the queue of launched work, so
# the GPU idles while the host issues what comes after it.
WAIT_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::nonzero",
            "aten::_local_scalar_dense", "cudaMemcpyAsync", "aten::copy_", "aten::index")  # fmt: skip


def _our_frames(stack) -> list[str]:
    return [f for f in stack if any(d in f for d in ("engine/", "kernels/", "batchgen/"))]


def device_ops(prof, top: int = 16) -> list[dict]:
    """Ops by the device time of the kernels they launched, each with the project's frames
    that called it (innermost first): which Python line a glue kernel (a gather, a cat, a
    cast) of the step comes from, which the kernel names alone do not say."""
    rows = []
    for e in prof.key_averages(group_by_stack_n=8):
        us = getattr(e, "self_device_time_total", None)
        if us is None:  # torch before 2.4
            us = getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            rows.append({"op": e.key, "device_us": round(us, 1), "calls": e.count,
                         "stack": _our_frames(e.stack)[:4]})  # fmt: skip
    return sorted(rows, key=lambda r: -r["device_us"])[:top]


def device_time_by_op(prof, top: int = 24) -> dict[str, float]:
    """Device time of the kernels each op launched, summed over every call site: device_ops
    splits an op by its Python stack, so glue spread over many call sites (a prefill step's
    gathers: many small index kernels, each call site too small for device_ops' top rows)
    shows only here."""
    rows: collections.Counter = collections.Counter()
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:  # torch before 2.4
            us = getattr(e, "self_cuda_time_total", 0)
        # host-side ops only (the kernel events themselves are in top_kernels_us)
        if us > 0 and getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU:
            rows[e.key] += us
    return {k: round(us, 1) for k, us in rows.most_common(top)}


def host_waits(prof, top: int = 10) -> list[dict]:
    """The costliest WAIT_OPS by host self time, each with the project's frames of the
    Python stack that issued it (innermost first): where a step waits for the GPU."""
    rows = []
    for e in prof.key_averages(group_by_stack_n=12):
        if e.key in WAIT_OPS and e.self_cpu_time_total > 0:
            rows.append({"op": e.key, "self_us": round(e.self_cpu_time_total, 1),
                         "calls": e.count, "stack": _our_frames(e.stack)[:6]})  # fmt: skip
    return sorted(rows, key=lambda r: -r["self_us"])[:top]


def kernel_timeline(kernels, steps: int, count: int = 30) -> list[list]:
    """`count` consecutive kernels from the middle of the first profiled step (about two
    decoder layers), each [name, stream, start us from the first, duration us]: which
    kernels overlap on the two streams and where the device idles between them (a profile's
    sums cannot say)."""
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    per_step = len(ordered) // max(1, steps)
    window = ordered[per_step // 2 : per_step // 2 + count]
    if not window:
        return []
    t0 = window[0].time_range.start
    return [
        [e.name[:32], getattr(e, "device_resource_id", None),
         round(e.time_range.start - t0, 1), round(e.time_range.elapsed_us(), 1)]
        for e in window
    ]  # fmt: skip


def profile_tokens(modes: tuple[str, ...]) -> int:
    """Tokens each request of profile_decode_step asks for: the prefill's, 3 steps, then
    per mode 1 + 5 + 10 steps, and a few to spare."""
    return 8 + 16 * len(modes)


def profile_decode_step(
    llm, prompt_len: int, vocab: int, batch: int = 1, modes: tuple[str, ...] = ("graph", "eager")
) -> dict:
    """Kernel launches, device time by kernel and host time of a decode step of `batch`
    sequences, replaying graphs and eagerly."""
    from torch.profiler import ProfilerActivity, profile

    from engine.sampling_params import SamplingParams

    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=profile_tokens(modes), ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, prompt_len, vocab, seed=7)):
        engine.add_request(f"profile-{i}", prompt, params)
    while any(s.num_computed < len(s) - 1 for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(3):
        engine.step()
    out: dict = {}
    graphs = runner.graphs
    for mode in modes:
        runner.graphs = graphs if mode == "graph" else None
        engine.step()  # warm
        steps = 5
        cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
        with profile(activities=[ProfilerActivity.CPU, *cuda]) as prof:
            for _ in range(steps):
                engine.step()
        _sync()
        events = prof.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        launches = [e for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel")]
        graph_launches = [e for e in events if e.name.startswith("cudaGraphLaunch")]
        walls, busy = [], []
        for _ in range(10):
            waited = _WaitTimer()
            with waited:
                t0 = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t0
            walls.append(wall)
            busy.append(wall - waited.seconds)
        names = collections.Counter(e.name[:60] for e in kernels)
        device_us: collections.Counter = collections.Counter()
        for e in kernels:
            device_us[e.name[:60]] += e.time_range.elapsed_us() / steps
        out[mode] = {
            # what is left to fuse: the most frequent kernels of a step, per step
            "top_kernels": {n: c / steps for n, c in names.most_common(16)},
            # where the step's device time goes: microseconds per step by kernel
            "top_kernels_us": {n: round(us, 1) for n, us in device_us.most_common(16)},
            "kernel_us_per_step": sum(device_us.values()),
            "device_kernels_per_step": len(kernels) / steps,
            "host_kernel_launches_per_step": len(launches) / steps,
            "graph_launches_per_step": len(graph_launches) / steps,
            "step_ms": 1e3 * statistics.median(walls),
            # host work per step: the step's wall time less its waits for the device
            "host_busy_ms": 1e3 * statistics.median(busy),
            "timeline": kernel_timeline(kernels, steps),
        }
    runner.graphs = graphs
    if graphs is not None and "graph" in modes:
        replay = graph_replay_ms(runner, batch)
        out["graph"]["replay_ms"] = replay
        # With async scheduling the host's work overlaps the next replay; what a step loses
        # to the host is its wall time beyond one replay's device time.
        exposed = max(0.0, out["graph"]["step_ms"] - replay)
        out["graph"]["host_ms"] = exposed
        out["graph"]["host_frac"] = exposed / out["graph"]["step_ms"]
        out["graph"]["async_scheduling"] = engine.async_scheduling
    while engine.has_unfinished():
        engine.step()
    return out


def bench_engine(
    path: Path | str,  # a checkpoint directory or a `random:` spec
    weights: str,
    batches: tuple[int, ...],
    prompt_len: int,
    new_tokens: int,
    copy_bps: float,
    profile_step: bool,
    engine_options: dict | None = None,
    sampling: dict | None = None,
) -> tuple[list[dict], dict]:
    """`engine_options`: LLM keyword arguments (streams, FP8 and MLA choices) beyond the
    bench's own sizes."""
    from engine.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        str(path),
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=max(batches),
        max_num_batched_tokens=16384,
        max_model_len=prompt_len + new_tokens + 16,
        **(engine_options or {}),
    )
    runner = llm.engine.runner
    info = {
        "load_s": time.perf_counter() - t0,
        "capture_s": runner.graphs.capture_seconds if runner.graphs else None,
        "kv_blocks": runner.num_blocks,
        "weight_gb": sum(p.numel() * p.element_size() for p in runner.model.parameters()) / 1e9,
    }
    log(f"{weights}: engine up in {info['load_s']:.1f} s ({info})")
    model = runner.model
    vocab = int(model.config.vocab_size)
    kv_per_token = sum(s.bytes_per_token(runner.dtype) for s in model.cache_specs())
    mean_context = prompt_len + new_tokens // 2
    rows = []
    for batch in batches:
        r = run_engine_batch(llm, batch, prompt_len, new_tokens, vocab, sampling)
        parts = step_bytes(model, batch, mean_context, kv_per_token)
        nbytes = sum(parts.values())
        roof_tok_s = batch / (nbytes / copy_bps)
        row = {
            "engine": "batchgen",
            "weights": weights,
            "batch": batch,
            **r,
            "graph_ms": graph_replay_ms(runner, batch),
            "bytes_per_step": nbytes,
            "bytes_parts": parts,
            "roofline_tok_s": roof_tok_s,
            "roofline_frac": r["tok_s"] / roof_tok_s,
        }
        rows.append(row)
        log(
            f"{weights} batch {batch}: {r['tok_s']:.0f} tok/s, {r['ms_per_step']:.2f} ms/step "
            f"(graph {row['graph_ms']}), {row['roofline_frac']:.1%} of roofline "
            f"({nbytes / 1e9:.2f} GB/step), e2e {r['e2e_tok_s']:.0f} tok/s"
        )
    big = max(batches)
    info[f"varied_lengths_batch{big}"] = run_varied_lengths(llm, big, prompt_len, new_tokens, vocab)
    log(f"{weights}: varied lengths {info[f'varied_lengths_batch{big}']}")
    if profile_step:
        info["profile_batch1"] = profile_decode_step(llm, prompt_len, vocab)
        log(f"{weights}: profile {info['profile_batch1']}")
        if 1 in batches and big > 1:  # one prompt: the fixed cost of a prefill step
            info["profile_prefill_batch1"] = profile_prefill_step(llm, prompt_len, vocab, 1)
            log(f"{weights}: prefill profile {info['profile_prefill_batch1']}")
        if big > 1:
            info[f"profile_batch{big}"] = profile_decode_step(
                llm, prompt_len, vocab, batch=big, modes=("graph",)
            )
            log(f"{weights}: profile {info[f'profile_batch{big}']}")
        info[f"profile_prefill_batch{big}"] = profile_prefill_step(llm, prompt_len, vocab, big)
        log(f"{weights}: prefill profile {info[f'profile_prefill_batch{big}']}")
    del llm, runner, model
    gc.collect()
    torch.cuda.empty_cache()
    return rows, info


# -- transformers -------------------------------------------------------------------------
def bench_transformers(
    path: Path, batches: tuple[int, ...], prompt_len: int, new_tokens: int, copy_bps: float
) -> tuple[list[dict], dict]:
    from transformers import DeepseekV3ForCausalLM

    t0 = time.perf_counter()
    model = DeepseekV3ForCausalLM.from_pretrained(
        str(path), dtype=torch.bfloat16, device_map="cuda"
    ).eval()
    load_s = time.perf_counter() - t0
    log(f"transformers: loaded in {load_s:.1f} s")
    vocab = model.config.vocab_size
    rows = []
    for batch in batches:
        ids = torch.tensor(random_prompts(batch, prompt_len, vocab, seed=batch), device="cuda")
        mask = torch.ones_like(ids)
        kwargs = dict(
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        with torch.inference_mode():
            model.generate(ids[:, :8], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2,
                                          "attention_mask": mask[:, :8]})  # fmt: skip
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids, **kwargs)
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        made = out.shape[1] - prompt_len
        rows.append(
            {
                "engine": "transformers",
                "weights": "bf16",
                "batch": batch,
                "tok_s": batch * made / seconds,
                "ms_per_step": 1e3 * seconds / made,
                "new_tokens": made,
            }
        )
        log(f"transformers batch {batch}: {rows[-1]['tok_s']:.1f} tok/s")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows, {"load_s": load_s}


# -- the run ------------------------------------------------------------------------------
def make_checkpoint(workdir: Path, preset: str, layers: int | None, weights: str) -> Path:
    from engine.checkpoint_maker import make_random_checkpoint

    dense, experts = WEIGHTS[weights]
    out = workdir / (f"{preset}-{weights}" + ("" if layers is None else f"-{layers}l"))
    if out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    make_random_checkpoint(
        out,
        preset=preset,
        layers=layers,
        dense_dtype=dense,
        expert_dtype=experts,
        seed=0,
        device="cuda",
        mtp=False,
    )
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e9
    log(f"{weights}: checkpoint {size:.1f} GB written in {time.perf_counter() - t0:.1f} s")
    return out


def add_speedups(rows: list[dict]) -> None:
    hf = {r["batch"]: r["tok_s"] for r in rows if r["engine"] == "transformers"}
    for r in rows:
        if r["engine"] == "batchgen" and r["batch"] in hf:
            r["speedup_vs_transformers"] = r["tok_s"] / hf[r["batch"]]
            r["e2e_speedup_vs_transformers"] = r["e2e_tok_s"] / hf[r["batch"]]


def print_table(rows: list[dict]) -> None:
    print(f"{'engine':<13}{'weights':<11}{'batch':>6}{'tok/s':>10}{'ms/step':>9}"
          f"{'graph ms':>9}{'roofline':>9}{'vs HF':>7}")  # fmt: skip
    for r in rows:
        graph = r.get("graph_ms")
        frac = r.get("roofline_frac")
        speed = r.get("speedup_vs_transformers")
        print(
            f"{r['engine']:<13}{r['weights']:<11}{r['batch']:>6}{r['tok_s']:>10.1f}"
            f"{r['ms_per_step']:>9.2f}{'' if graph is None else f'{graph:.2f}':>9}"
            f"{'' if frac is None else f'{frac:.1%}':>9}"
            f"{'' if speed is None else f'{speed:.1f}x':>7}"
        )


def run(
    preset: str,
    layers: int | None,
    weights: tuple[str, ...],
    batches: tuple[int, ...],
    hf_batches: tuple[int, ...],
    prompt_len: int,
    new_tokens: int,
    workdir: Path,
    name: str,
    engine_options: dict | None = None,
    sampling: dict | None = None,
    in_memory: bool = False,
) -> dict:
    """The V3 benchmark (module docstring). `in_memory`: the models are `random:` specs
    drawn while loading, not checkpoints written to `workdir` (no transformers run: it
    reads the bf16 checkpoint's files)."""
    from kernels.tune.timing import copy_bandwidth

    if in_memory and hf_batches:
        raise click.UsageError(
            "--hf-batches: transformers reads checkpoint files, --in-memory has none"
        )
    if not torch.cuda.is_available():
        raise click.UsageError("bench decode-moe needs a CUDA GPU")
    device = torch.device("cuda")
    copy_bps = copy_bandwidth(device)
    log(f"copy bandwidth {copy_bps / 1e12:.2f} TB/s")
    payload: dict = {
        "copy_tb_s": copy_bps / 1e12,
        "preset": preset,
        "layers": layers,
        "prompt_tokens": prompt_len,
        "new_tokens": new_tokens,
        **(engine_options or {}),
        "sampling": sampling or {"temperature": 0.0},
        "in_memory": in_memory,
        "results": [],
        "engine_info": {},
    }
    paths = {}
    for w in weights:
        if in_memory:
            paths[w] = random_model("deepseek_v3", preset, layers, w)
        else:
            paths[w] = make_checkpoint(workdir, preset, layers, w)
        rows, info = bench_engine(paths[w], w, batches, prompt_len, new_tokens, copy_bps,
                                  profile_step=True, engine_options=engine_options,
                                  sampling=sampling)  # fmt: skip
        payload["results"] += rows
        payload["engine_info"][w] = info
        write_result(name, payload)  # after each phase, so a cut-off run keeps its numbers
        if w != "bf16" and not in_memory:
            shutil.rmtree(paths[w], ignore_errors=True)
    if hf_batches and "bf16" in paths:
        rows, info = bench_transformers(paths["bf16"], hf_batches, prompt_len, new_tokens, copy_bps)
        payload["results"] += rows
        payload["transformers_info"] = info
    add_speedups(payload["results"])
    path = write_result(name, payload)
    print_table(payload["results"])
    log(f"wrote {path}")
    return payload


# -- DeepSeek-V4 --------------------------------------------------------------------------
# decode steps timed layer by layer when decode steps replay graphs (hooks see no replay)
EAGER_TIMING_TOKENS = 5
# random weights: sampling at 1.0 keeps the decoded ids varied, as text's are (hash layers
# route by the token id)
V4_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "seed": 0}


def random_model(
    arch: str, preset: str, layers: int | None, weights: str, seed: int = 0, mtp: bool = False
) -> str:
    """The `random:` spec (engine/loader/random_source.py) of the model make-random would
    write: its weights are drawn on the GPU while the engine loads them, with no
    safetensors written and read back (at v4-flash shapes ~3.6 GB a layer, 150 GB whole,
    more than the GPU machine's disk)."""
    query = f"arch={arch}&weights={weights}&seed={seed}&mtp={int(mtp)}"
    if layers is not None:
        query += f"&layers={layers}"
    return f"random:{preset}?{query}"


class LayerClock:
    """The time of each decoder layer's forward in the steps run while `on`: CUDA events
    recorded before and after it on a GPU (the stream's time from the layer's first launch
    to its last kernel's end, host gaps included, as the step spends it), the host clock on
    the CPU."""

    def __init__(self, layers, device: torch.device) -> None:
        self.layers, self.cuda = list(layers), device.type == "cuda"
        self.on = False
        self.marks: list[list[list]] = [[] for _ in self.layers]  # per layer: [start, end]s
        self._handles: list = []

    def __enter__(self) -> LayerClock:
        for i, layer in enumerate(self.layers):
            start, end = functools.partial(self._start, i), functools.partial(self._end, i)
            self._handles += [
                layer.register_forward_pre_hook(start),
                layer.register_forward_hook(end),
            ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _start(self, layer: int, *_hook_args) -> None:
        if self.on:
            self.marks[layer].append([self._now(), None])

    def _end(self, layer: int, *_hook_args) -> None:
        if self.on and self.marks[layer]:
            self.marks[layer][-1][1] = self._now()

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self) -> list[float] | None:
        """Per layer, the median ms of its timed calls (None: a layer has none)."""
        _sync()
        per_layer = [
            [start.elapsed_time(end) if self.cuda else 1e3 * (end - start)
             for start, end in marks if end is not None]
            for marks in self.marks
        ]  # fmt: skip
        if not all(per_layer):
            return None
        return [statistics.median(times) for times in per_layer]


def v4_layer_ms(
    llm, batch: int, prompt_len: int, new_tokens: int, vocab: int, sampling: dict,
    after_measured: Callable[[dict], None] | None = None,
) -> tuple[dict, list[float], float, str]:  # fmt: skip
    """Decode figures of `batch` sequences, each layer's ms in eager decode steps, the
    median ms of those steps, and where the layers were timed. When decode steps replay
    CUDA graphs (which hooks do not see), the layers are timed in separate eager steps.
    `after_measured` is called with the measured run's figures before any other step."""
    runner = llm.engine.runner
    with LayerClock(runner.model.layers, runner.device) as clock:
        if runner.graphs is None:
            r = run_engine_batch(llm, batch, prompt_len, new_tokens, vocab, sampling, clock)
            eager, where = r, "the measured decode steps (eager)"
            if after_measured is not None:
                after_measured(r)
        else:
            r = run_engine_batch(llm, batch, prompt_len, new_tokens, vocab, sampling)
            if after_measured is not None:
                after_measured(r)
            graphs, runner.graphs = runner.graphs, None
            try:
                eager = run_engine_batch(
                    llm, batch, prompt_len, EAGER_TIMING_TOKENS, vocab, sampling, clock
                )
            finally:
                runner.graphs = graphs
            where = "separate eager decode steps (the measured ones replay CUDA graphs)"
        layer_ms = clock.ms()
    if layer_ms is None:
        raise RuntimeError(f"batch {batch}: no decode step ran through every layer")
    return r, layer_ms, eager["ms_per_step"], where


def device_copy_bandwidth(device: torch.device) -> float:
    """Bytes/s read plus written by a device-to-device copy (the roofline's bandwidth); on
    the CPU a host-timed 64 MiB copy."""
    if device.type == "cuda":
        from kernels.tune.timing import copy_bandwidth

        return copy_bandwidth(device)
    src = torch.ones(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    seconds = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - t0)
    return 2 * src.numel() / statistics.median(seconds)


def v4_batch_row(
    r: dict, timing: tuple[list[float], float, str], batch: int, mean_context: int,
    copy_bps: float, reads: DecodeReads, full_reads: DecodeReads,
) -> dict:  # fmt: skip
    """One batch's figures for the measured model (`reads`) and, extrapolated, for the
    whole one (`full_reads`); `timing` is v4_layer_ms's layer ms, eager step ms and where."""
    layer_ms, eager_step_ms, where = timing
    step = reads.step(batch, mean_context)
    full = full_reads.step(batch, mean_context)
    full_cfg = full_reads.cfg
    layers = []
    for layer, ms, counted in zip(reads.layers, layer_ms, step["layers"], strict=True):
        roof_ms = 1e3 * counted["total"] / copy_bps
        layers.append({"layer": layer.index, "kind": layer.kind, "hash_routing": layer.hash_routing,
                       "ms": ms, "bytes": counted["total"], "bytes_parts": counted["parts"],
                       "roofline_ms": roof_ms, "roofline_frac": roof_ms / ms})  # fmt: skip
    measured = [
        ((la.compress_ratio, la.hash_routing), ms) for la, ms in zip(reads.layers, layer_ms)
    ]
    kinds = [(full_cfg.compress_ratios[i], full_cfg.is_hash_layer(i))
             for i in range(full_cfg.num_hidden_layers)]  # fmt: skip
    full_ms, sources = extrapolate_step_ms(r["ms_per_step"], eager_step_ms, measured, kinds)
    roof_tok_s = batch / (step["total"] / copy_bps)
    full_roof_tok_s = batch / (full["total"] / copy_bps)
    full_tok_s = batch / (full_ms * 1e-3)
    return {
        "engine": "batchgen",
        "arch": "deepseek_v4",
        "batch": batch,
        **r,
        "layers": layers,
        "layers_timed_in": where,
        "layers_ms": sum(layer_ms),
        # the eager step's time outside the layers: embedding, head, sampling, host work
        "eager_step_ms": eager_step_ms,
        "rest_ms": eager_step_ms - sum(layer_ms),
        "bytes_per_step": step["total"],
        "bytes_parts": step["parts"],
        "roofline_tok_s": roof_tok_s,
        "roofline_frac": r["tok_s"] / roof_tok_s,
        "extrapolated": {
            "extrapolated": True,
            "layers": full_cfg.num_hidden_layers,
            "how": "ms_per_step x (rest_ms + each layer's ms by kind, layer_ms_from) / "
            "eager_step_ms; bytes counted for every layer",
            "ms_per_step": full_ms,
            "tok_s": full_tok_s,
            "layer_ms_from": sources,
            "bytes_per_step": full["total"],
            "bytes_parts": full["parts"],
            "roofline_tok_s": full_roof_tok_s,
            "roofline_frac": full_tok_s / full_roof_tok_s,
        },
    }


def bench_v4(
    model_name: str, weights: str, batches: tuple[int, ...], prompt_len: int, new_tokens: int,
    copy_bps: float, reads: DecodeReads, full_reads: DecodeReads, device: torch.device,
    dtype: str, engine_options: dict, sampling: dict, info: dict, on_row: Callable[[dict], None],
    profile: bool = True,
) -> None:  # fmt: skip
    """Load `model_name` (a `random:` spec) and measure each batch, handing each row to
    `on_row` as it is measured; `info` (the run's engine_info entry) is filled as it goes;
    `profile`: then profile a batch-1 decode step (launches per step)."""
    from engine.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        model_name,
        device=device.type,
        dtype=dtype,
        max_num_seqs=max(batches),
        max_num_batched_tokens=16384,
        max_model_len=prompt_len + max(new_tokens, profile_tokens(("graph", "eager"))) + 16,
        **engine_options,
    )
    runner = llm.engine.runner
    model = runner.model
    info |= {
        "load_s": time.perf_counter() - t0,
        "model": model_name,
        "weights_source": "drawn on the device while loading (no files)",
        "kv_blocks": runner.num_blocks,
        "weight_gb": sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9,
        "cuda_graphs": runner.graphs is not None,
        "async_scheduling": llm.engine.async_scheduling,
    }
    log(f"v4 {weights}: engine up in {info['load_s']:.1f} s ({info})")
    info["layer_bytes"] = [
        {"layer": la.index, "kind": la.kind, "hash_routing": la.hash_routing,
         "hub_bytes": la.total, "expert_bytes": la.expert_bytes,
         "engine_param_bytes": sum(p.numel() * p.element_size()
                                   for p in model.layers[la.index].parameters())}
        for la in reads.layers
    ]  # fmt: skip
    vocab = int(reads.cfg.vocab_size)
    mean_context = prompt_len + new_tokens // 2
    split = bool(offload.split_layers(llm))
    if split:
        info["expert_placement"] = llm.expert_placement | {"layers": None}
        from batchgen.bench.cpu_experts import read_bandwidth  # numba, for split runs only

        info["host_read_gb_s"] = read_bandwidth()
    for batch in batches:
        host: dict = {}
        if split:
            offload.reset(llm)
        r, *timing = v4_layer_ms(
            llm, batch, prompt_len, new_tokens, vocab, sampling,
            lambda _, host=host, batch=batch, llm=llm: host.update(
                measured=offload.host_step(llm, batch) if split else None),
        )  # fmt: skip
        row = {"weights": weights,
               **v4_batch_row(r, timing, batch, mean_context, copy_bps, reads, full_reads)}  # fmt: skip
        if split:
            row["offload"] = offload.offload_figures(
                llm, batch, r["ms_per_step"], row["bytes_per_step"], copy_bps,
                info["host_read_gb_s"] * 1e9, host["measured"], graph_replay_ms,
            )  # fmt: skip
            log(f"v4 {weights} batch {batch} offload: {row['offload']}")
        on_row(row)
        ext = row["extrapolated"]
        log(
            f"v4 {weights} batch {batch}: {r['tok_s']:.1f} tok/s, {r['ms_per_step']:.2f} ms/step "
            f"(layers {row['layers_ms']:.2f} ms, {row['roofline_frac']:.1%} of roofline); "
            f"{ext['layers']} layers (extrapolated): {ext['tok_s']:.1f} tok/s, "
            f"{ext['roofline_frac']:.1%} of roofline"
        )
    if profile:
        modes = ("graph", "eager") if runner.graphs is not None else ("eager",)
        prof = profile_decode_step(llm, prompt_len, vocab, batch=1, modes=modes)
        info["profile_batch1"] = prof
        info["launches_per_step_batch1"] = {
            m: {
                "host_kernel_launches": prof[m]["host_kernel_launches_per_step"],
                "device_kernels": prof[m]["device_kernels_per_step"],
                "graph_launches": prof[m]["graph_launches_per_step"],
            }
            for m in modes
        }
        log(f"v4 {weights}: launches per decode step at batch 1 {info['launches_per_step_batch1']}")
    del llm, runner, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_v4(
    preset: str,
    layers: int | None,
    weights: tuple[str, ...],
    batches: tuple[int, ...],
    prompt_len: int,
    new_tokens: int,
    name: str,
    engine_options: dict | None = None,
    sampling: dict | None = None,
    device: str = "cuda",
    dtype: str = "bfloat16",
    pcie_batches: tuple[int, ...] = (),
) -> dict:
    """The V4 benchmark (module docstring); returns what it writes to <name>.json.
    `sampling`: SamplingParams fields of the measured requests (default V4_SAMPLING).
    `pcie_batches`: with expert offload, the same model again at these batches with its
    host experts copied to the GPU when used (expert_offload_compute "pcie")."""
    from engine.deepseek_v4_checkpoint import plan
    from engine.models.deepseek_v4_config import DeepseekV4ModelConfig

    dev = torch.device(device)
    copy_bps = device_copy_bandwidth(dev)
    log(f"copy bandwidth {copy_bps / 1e12:.2f} TB/s")
    sampling = sampling or V4_SAMPLING
    payload: dict = {
        "arch": "deepseek_v4",
        "preset": preset,
        "copy_tb_s": copy_bps / 1e12,
        "prompt_tokens": prompt_len,
        "new_tokens": new_tokens,
        "mean_context": prompt_len + new_tokens // 2,
        "sampling": sampling,
        "engine_options": engine_options or {},
        "results": [],
        "engine_info": {},
    }
    for w in weights:
        dense, experts = WEIGHTS[w]
        cfg = DeepseekV4ModelConfig.from_dict(plan(preset, layers, dense, experts, mtp=False)[0])
        full_cfg = DeepseekV4ModelConfig.from_dict(plan(preset, None, dense, experts, mtp=False)[0])
        payload["layers"] = cfg.num_hidden_layers
        payload["full_layers"] = full_cfg.num_hidden_layers
        payload["compressed_entries_per_prompt"] = {
            f"ratio {m}": prompt_len // m for m in sorted(set(cfg.compress_ratios) - {0})
        }
        model_name = random_model("deepseek_v4", preset, layers, w)
        passes = [("cpu", batches, True), ("pcie", pcie_batches, False)]
        for compute, pass_batches, profile in passes:
            if not pass_batches:
                continue
            info = payload["engine_info"][w if compute == "cpu" else f"{w} pcie"] = {}

            def add_row(row: dict, info: dict = info, compute: str = compute) -> None:
                payload["results"].append(row | {"host_compute": compute})
                if compute == "cpu":
                    payload["cuda_graphs"] = info["cuda_graphs"]
                write_result(name, payload)  # after each batch: a cut-off run keeps its rows

            options = (engine_options or {}) | {"expert_offload_compute": compute}
            bench_v4(model_name, w, pass_batches, prompt_len, new_tokens, copy_bps,
                     DecodeReads(cfg), DecodeReads(full_cfg), dev, dtype, options, sampling,
                     info, add_row, profile)  # fmt: skip
    path = write_result(name, payload)
    print_v4_tables(payload)
    log(f"wrote {path}")
    return payload


def print_v4_tables(payload: dict) -> None:
    full = payload["full_layers"]
    print(f"{'weights':<11}{'batch':>6}{'tok/s':>10}{'ms/step':>9}{'roofline':>9}"
          f"{f'tok/s {full}L*':>13}{f'roofline {full}L*':>15}")  # fmt: skip
    for r in payload["results"]:
        ext = r["extrapolated"]
        print(f"{r['weights']:<11}{r['batch']:>6}{r['tok_s']:>10.1f}{r['ms_per_step']:>9.2f}"
              f"{r['roofline_frac']:>9.1%}{ext['tok_s']:>13.1f}{ext['roofline_frac']:>15.1%}")  # fmt: skip
    print(f"* extrapolated from the {payload['layers']} measured layers by kind")
    print(f"{'weights':<11}{'batch':>6}{'layer':>6}{'kind':>8}{'ms':>8}{'MB':>9}{'roofline':>9}")
    for r in payload["results"]:
        for la in r["layers"]:
            print(f"{r['weights']:<11}{r['batch']:>6}{la['layer']:>6}{la['kind']:>8}"
                  f"{la['ms']:>8.3f}{la['bytes'] / 1e6:>9.1f}{la['roofline_frac']:>9.1%}")  # fmt: skip


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


# Per arch, the options left unset on the command line.
ARCH_DEFAULTS = {
    "deepseek_v3": {"preset": "moonlight-16b-a3b", "layers": None, "weights": "bf16,fp8-mxfp4",
                    "hf_batches": ",".join(map(str, HF_BATCHES)), "prompt_len": 128,
                    "new_tokens": 128, "temperature": 1.0, "name": "decode-h200-moonlight"},
    "deepseek_v4": {"preset": "v4-flash", "layers": 4, "weights": "fp8-mxfp4", "hf_batches": "",
                    "prompt_len": 512, "new_tokens": 32, "temperature": 1.0, "name": None},
}  # fmt: skip


@click.command("decode-moe")
@click.option("--arch", type=click.Choice(sorted(ARCH_DEFAULTS)), default="deepseek_v3",
              show_default=True, help="deepseek_v4: the V4 benchmark (module docstring).")  # fmt: skip
@click.option("--preset", default=None,
              help="Default moonlight-16b-a3b (V3), v4-flash (V4; also tiny).")  # fmt: skip
@click.option("--layers", type=int, default=None,
              help="Fewer layers at real shapes (V3 default all, V4 default 4).")  # fmt: skip
@click.option("--weights", default=None,
              help=f"Comma-separated, of {sorted(WEIGHTS)} (default bf16,fp8-mxfp4 for V3, "
                   "fp8-mxfp4 for V4).")  # fmt: skip
@click.option("--batches", default=",".join(map(str, ENGINE_BATCHES)), show_default=True)
@click.option("--hf-batches", default=None,
              help="transformers batch sizes (V3 only; default 1,32,128); empty to skip.")  # fmt: skip
@click.option("--prompt-len", type=int, default=None,
              help="Prompt tokens (default 128 for V3, 512 for V4).")  # fmt: skip
@click.option("--new-tokens", type=int, default=None,
              help="New tokens per request (default 128 for V3, 32 for V4).")  # fmt: skip
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    default=Path("/tmp/batchgen-bench"),
    show_default=True,
    help="Where the V3 random checkpoints are written (not with --in-memory).",
)
@click.option("--in-memory", is_flag=True,
              help="V3: draw the model while loading (a `random:` spec), no checkpoint on "
                   "disk and no transformers run. V4 is always drawn in memory.")  # fmt: skip
@click.option("--name", default=None,
              help="JSON name (default decode-h200-moonlight; V4 decode-h200-v4-<preset>-<N>l).")  # fmt: skip
@click.option("--fp8-native-min-tokens", type=int, default=FP8_NATIVE_MIN_TOKENS, show_default=True,
              help="Dense FP8 linears multiply in FP8 from this many tokens (0: never).")  # fmt: skip
@click.option("--shared-expert-stream/--one-stream", default=True, show_default=True,
              help="Run each MoE layer's shared expert on a second CUDA stream.")  # fmt: skip
@click.option("--mla-expanded-float32/--mla-expanded-model-dtype", default=False,
              show_default=True,
              help="MLA's prefill attention in float32, or in the model's dtype.")  # fmt: skip
@click.option("--main-stream-first/--equal-stream-priority", default=True, show_default=True,
              help="Capture decode graphs on a high-priority stream (the shared expert's "
                   "side stream keeps the default).")  # fmt: skip
@click.option("--separate-prefill/--mixed-steps", default=True, show_default=True,
              help="Steps all decode or all prefill (the engine's default with CUDA graphs), "
                   "or decode rows and prefill chunks mixed in one (eager) step.")  # fmt: skip
@click.option("--min-prefill-seqs", type=int, default=None,
              help="With separate prefill: requests admitted per prefill step at least "
                   "(default: the engine's, max_num_seqs / 2).")  # fmt: skip
@click.option("--batch-invariant/--no-batch-invariant", default=True, show_default=True,
              help="Fixed launch configs and prefill through the decode kernel, so a row's "
                   "tokens do not depend on its batch (docs/batch-invariance.md).")  # fmt: skip
@click.option("--fold-input-norm/--no-fold-input-norm", default=True, show_default=True,
              help="DeepSeek layers' input RMSNorm inside the FP8 q/kv_a GEMV (1-8 tokens).")  # fmt: skip
@click.option(
    "--expert-offload",
    default="off",
    show_default=True,
    help="off | auto | a placement file: routed experts computed on the host CPU.",
)
@click.option(
    "--expert-routing-stats",
    default=None,
    help="A `bench routing --out` file that --expert-offload auto ranks experts by.",
)
@click.option("--pcie-batches", default="",
              help="With --expert-offload: then these batches (e.g. 1,8) with the host experts "
                   "copied to the GPU when used, the way offloading to the CPU replaces (V4).")  # fmt: skip
@click.option("--temperature", type=float, default=None,
              help="Our engine's requests: 0 is greedy. Default 1.0: greedy decoding of random "
                   "weights emits one token per row and routing collapses onto a few experts "
                   "(transformers stays greedy).")  # fmt: skip
@click.option("--top-p", type=float, default=1.0, show_default=True)
def command(arch, preset, layers, weights, batches, hf_batches, prompt_len, new_tokens, workdir,
            in_memory, name, temperature, top_p, pcie_batches, **engine_options):  # fmt: skip
    """Decode tok/s of a DeepSeek MoE on the GPU vs the roofline (V3: and vs transformers)."""
    if in_memory and hf_batches is None:
        hf_batches = ""  # transformers reads files; an in-memory model has none
    given = {"preset": preset, "layers": layers, "weights": weights, "hf_batches": hf_batches,
             "prompt_len": prompt_len, "new_tokens": new_tokens, "temperature": temperature,
             "name": name}  # fmt: skip
    o = {k: ARCH_DEFAULTS[arch][k] if v is None else v for k, v in given.items()}
    chosen = tuple(w.strip() for w in o["weights"].split(",") if w.strip())
    unknown = [w for w in chosen if w not in WEIGHTS]
    if unknown:
        raise click.BadParameter(f"unknown weights {unknown}; choose from {sorted(WEIGHTS)}")
    # every other option is an LLM keyword argument, under its own name
    engine_options["fp8_native_min_tokens"] = engine_options["fp8_native_min_tokens"] or None
    sampling = None
    if o["temperature"] > 0:
        sampling = {"temperature": o["temperature"], "top_p": top_p, "seed": 0}
    if arch == "deepseek_v3":
        run(o["preset"], o["layers"], chosen, _ints(batches), _ints(o["hf_batches"]),
            o["prompt_len"], o["new_tokens"], workdir, o["name"], engine_options, sampling,
            in_memory)  # fmt: skip
        return
    if _ints(o["hf_batches"]):
        raise click.BadParameter("--hf-batches: the transformers comparison is V3's only")
    from engine.deepseek_v4_checkpoint import plan

    try:
        config, _ = plan(o["preset"], o["layers"], *WEIGHTS[chosen[0]], mtp=False)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None
    if not torch.cuda.is_available():
        raise click.UsageError("bench decode-moe needs a CUDA GPU")
    n = config["num_hidden_layers"]
    if _ints(pcie_batches) and engine_options["expert_offload"] == "off":
        raise click.BadParameter("--pcie-batches needs --expert-offload (auto or a file)")
    run_v4(o["preset"], o["layers"], chosen, _ints(batches), o["prompt_len"], o["new_tokens"],
           o["name"] or f"decode-h200-v4-{o['preset']}-{n}l", engine_options,
           sampling or {"temperature": 0.0}, pcie_batches=_ints(pcie_batches))  # fmt: skip


if __name__ == "__main__":
    command()
