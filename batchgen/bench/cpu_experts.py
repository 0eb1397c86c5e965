"""`batchgen bench cpu-experts`: the host expert kernels (kernels/cpu/host_experts.py)
against the host's own limits.

First the host's read bandwidth: a multithreaded sum over a buffer much larger than the
caches (numba, the kernels' thread pool), best of a few passes. Then, for each shape
(V4-Flash D 4096 / I 2048 MXFP4; Moonlight D 2048 / I 1408 MXFP4 and FP8) and each number
of tokens per expert, `host_experts_forward` on `top_k` experts that each get that many
tokens (every token chose the same top_k). Calls rotate over enough slots that the
weights they read (`--pool-gb`) do not fit the caches, so every call reads its experts
from memory, as a decode step does.

Per case: ms per call (the best of `--repeats` after a warm-up), GB/s of weights read (the
experts' stored bytes / time) and its share of the measured bandwidth, and TOPS: 2 x
tokens x top_k x 3 x D x I multiply-adds / time, against the int8 peak estimated as cores x
clock x `--int8-ops-per-cycle` (default 256: two 512-bit vpdpbusd per cycle, 64 multiply-
adds each; one per cycle on cores with a single 512-bit integer port: pass 128). The clock
is the highest `cpu MHz` in /proc/cpuinfo (below the turbo clock on most servers).

For many tokens per expert it also times a torch path on the same shapes: the experts
dequantized to bfloat16 with torch ops, then bf16 matmuls (oneDNN, AMX where the CPU has
it), to say where numba stops being the faster choice.

Run on the GPU machine as `python -m batchgen.bench.cpu_experts` (torch, numba, click).
JSON goes to $BATCHGEN_BENCH_DIR or data/benchmarks/cpu-experts-<host>.json.
"""

from __future__ import annotations

import math
import platform
import time

import click
import numba
import numpy as np
import torch

from batchgen.bench.common import write_result

SHAPES = {  # name: (hidden, intermediate, format)
    "v4-flash": (4096, 2048, "mxfp4"),
    "moonlight": (2048, 1408, "mxfp4"),
    "moonlight-fp8": (2048, 1408, "fp8"),
}
TOKENS = (1, 2, 4, 8, 32, 128)
TOP_K = 6


@numba.njit(numba.float64(numba.int64[::1]), parallel=True, nogil=True, cache=True)
def _parallel_sum(buf):
    total = 0
    for i in numba.prange(buf.shape[0]):
        total += buf[i]
    return float(total)


def read_bandwidth(gigabytes: float = 2.0, passes: int = 5) -> float:
    """GB/s of a multithreaded read over a buffer of `gigabytes` (best of `passes`)."""
    n = int(gigabytes * 1e9) // 8
    buf = np.ones(n, dtype=np.int64)
    _parallel_sum(buf)
    best = math.inf
    for _ in range(passes):
        t0 = time.perf_counter()
        _parallel_sum(buf)
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best / 1e9


def _random_experts(fmt: str, slots: int, hidden: int, intermediate: int, seed: int = 0):
    """Host experts with random bytes (codes, and scales near 2^-6 so values stay finite)."""
    from kernels.cpu.host_experts import HostFp8Experts, HostMxfp4Experts

    rng = np.random.default_rng(seed)
    if fmt == "mxfp4":
        e = HostMxfp4Experts.allocate(slots, hidden, intermediate)
        for codes in (e.gate_up, e.down):
            codes[...] = rng.integers(0, 256, codes.shape, dtype=np.uint8)
        for scales in (e.gate_up_scales, e.down_scales):
            scales[...] = rng.integers(118, 124, scales.shape, dtype=np.uint8)
        return e
    e = HostFp8Experts.allocate(slots, hidden, intermediate)
    for codes in (e.gate, e.up, e.down):
        # E4M3 bytes with exponent fields 1..14: finite, no NaN
        codes[...] = rng.integers(0x08, 0x78, codes.shape, dtype=np.uint8) | (
            rng.integers(0, 2, codes.shape, dtype=np.uint8) << 7
        )
    for scales in (e.gate_scales, e.up_scales, e.down_scales):
        scales[...] = 2.0**-8
    return e


def time_kernel(experts, tokens: int, top_k: int, repeats: int, limit: float | None = 10.0):
    """Best seconds of one host_experts_forward call where each of top_k experts gets
    `tokens` tokens; calls rotate over the slots so each reads its experts from memory."""
    from kernels.cpu.host_experts import host_experts_forward

    d = experts.hidden
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, d, generator=g)
    weights = torch.rand(tokens, top_k, generator=g)
    out = torch.empty(tokens, d)
    groups = max(1, experts.num_slots // top_k)
    best = math.inf
    for call in range(repeats + 1):
        first = (call % groups) * top_k
        ids = torch.arange(first, first + top_k, dtype=torch.int32).repeat(tokens, 1)
        t0 = time.perf_counter()
        host_experts_forward(experts, x, ids, weights, limit, out)
        elapsed = time.perf_counter() - t0
        if call:  # the first call may compile or load the kernels
            best = min(best, elapsed)
    return best


def time_torch_bf16(hidden: int, intermediate: int, tokens: int, top_k: int, repeats: int):
    """Best seconds of the torch path for the same call: top_k MXFP4 experts dequantized
    to bf16 with torch ops (kernels/formats), then gate/up/down as bf16 matmuls."""
    from kernels.formats.mxfp4 import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)

    def stored(rows, cols):
        w = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
        return w, torch.randint(118, 124, (rows, cols // 32), generator=g, dtype=torch.uint8)

    experts = [
        (stored(intermediate, hidden), stored(intermediate, hidden), stored(hidden, intermediate))
        for _ in range(top_k)
    ]
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    best = math.inf
    for call in range(repeats + 1):
        t0 = time.perf_counter()
        out = torch.zeros(tokens, hidden)
        for gate, up, down in experts:
            wg, wu, wd = (dequantize_mxfp4(*p, dtype=torch.bfloat16) for p in (gate, up, down))
            h = torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)
            out += (h @ wd.T).float()
        elapsed = time.perf_counter() - t0
        if call:
            best = min(best, elapsed)
    return best


def _clock_ghz() -> float:
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
        return max(mhz) / 1000 if mhz else 0.0
    except OSError:
        return 0.0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run(shapes, tokens, top_k, threads, pool_gb, repeats, int8_ops_per_cycle, torch_tokens,
        read_gb=2.0):  # fmt: skip
    """Measure and return the JSON payload (also printed as a table)."""
    from kernels.cpu import _host_experts_kernels as kernels

    if threads:
        numba.set_num_threads(threads)
    torch.set_num_threads(1)  # torch's pool stays out of numba's way (module docstring)
    cores = numba.get_num_threads()
    bandwidth = read_bandwidth(read_gb)
    peak_tops = cores * _clock_ghz() * int8_ops_per_cycle / 1e3
    print(f"{_cpu_model()}: {cores} threads, read bandwidth {bandwidth:.1f} GB/s, "
          f"int8 peak ~{peak_tops:.1f} TOPS ({cores} x {_clock_ghz():.2f} GHz x "
          f"{int8_ops_per_cycle} ops/cycle); VNNI kernel: {kernels.VNNI}")  # fmt: skip
    results = []
    for name in shapes:
        hidden, intermediate, fmt = SHAPES[name]
        probe = _random_experts(fmt, 1, hidden, intermediate)
        per_expert = probe.nbytes
        slots = max(2 * top_k, top_k * math.ceil(pool_gb * 1e9 / per_expert / top_k))
        experts = _random_experts(fmt, slots, hidden, intermediate)
        print(f"\n{name} ({fmt}, D {hidden}, I {intermediate}, top-{top_k}): "
              f"{per_expert / 1e6:.2f} MB per expert, {slots} slots")  # fmt: skip
        print(f"{'tokens/expert':>13} {'ms':>8} {'GB/s':>7} {'% bw':>6} {'TOPS':>7} {'% peak':>7}")
        for n in tokens:
            seconds = time_kernel(experts, n, top_k, repeats)
            gb_s = top_k * per_expert / seconds / 1e9
            tops = 2 * n * top_k * 3 * hidden * intermediate / seconds / 1e12
            row = {"shape": name, "format": fmt, "hidden": hidden, "intermediate": intermediate,
                   "top_k": top_k, "tokens_per_expert": n, "path": "numba", "ms": seconds * 1e3,
                   "weights_gb_s": gb_s, "bandwidth_share": gb_s / bandwidth, "tops": tops,
                   "peak_share": tops / peak_tops if peak_tops else None}  # fmt: skip
            results.append(row)
            print(f"{n:>13} {seconds * 1e3:>8.2f} {gb_s:>7.1f} {100 * gb_s / bandwidth:>5.0f}% "
                  f"{tops:>7.2f} {100 * tops / peak_tops if peak_tops else 0:>6.1f}%")  # fmt: skip
            if fmt == "mxfp4" and n in torch_tokens:
                seconds = time_torch_bf16(hidden, intermediate, n, top_k, max(1, repeats // 2))
                tops = 2 * n * top_k * 3 * hidden * intermediate / seconds / 1e12
                results.append({**row, "path": "torch-bf16", "ms": seconds * 1e3, "tops": tops,
                                "weights_gb_s": None, "bandwidth_share": None,
                                "peak_share": None})  # fmt: skip
                print(f"{'':>13} {seconds * 1e3:>8.2f}  torch: dequantize to bf16 + matmul")
        del experts
    return {"cpu_model": _cpu_model(), "threads": cores, "read_gb_s": bandwidth,
            "clock_ghz": _clock_ghz(), "int8_ops_per_cycle": int8_ops_per_cycle,
            "int8_peak_tops": peak_tops, "vnni": kernels.VNNI, "results": results}  # fmt: skip


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


@click.command()
@click.option("--shapes", default=",".join(SHAPES), show_default=True,
              help=f"Comma-separated, from {sorted(SHAPES)}.")  # fmt: skip
@click.option("--tokens", default=",".join(map(str, TOKENS)), show_default=True,
              help="Tokens per expert.")  # fmt: skip
@click.option("--top-k", type=int, default=TOP_K, show_default=True)
@click.option("--threads", type=int, default=0, help="numba threads (default: all cores).")
@click.option("--pool-gb", type=float, default=2.0, show_default=True,
              help="Expert bytes the calls rotate over (>> the caches).")  # fmt: skip
@click.option("--repeats", type=int, default=8, show_default=True)
@click.option("--read-gb", type=float, default=2.0, show_default=True,
              help="Buffer size of the read-bandwidth measurement.")  # fmt: skip
@click.option("--int8-ops-per-cycle", type=int, default=256, show_default=True,
              help="Per core, for the int8 peak estimate.")  # fmt: skip
@click.option("--torch-tokens", default="32,128", show_default=True,
              help="Tokens per expert at which to time the torch bf16 path too.")  # fmt: skip
@click.option("--name", default=None, help="JSON name (default cpu-experts-<host>).")
def command(shapes, tokens, top_k, threads, pool_gb, repeats, read_gb, int8_ops_per_cycle,
            torch_tokens, name):  # fmt: skip
    """Host expert kernel: GB/s of weights vs the host's read bandwidth, TOPS vs int8 peak."""
    chosen = [s.strip() for s in shapes.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SHAPES]
    if unknown:
        raise click.BadParameter(f"unknown shapes {unknown}; choose from {sorted(SHAPES)}")
    payload = run(chosen, _ints(tokens), top_k, threads, pool_gb, repeats, int8_ops_per_cycle,
                  _ints(torch_tokens), read_gb)  # fmt: skip
    path = write_result(name or f"cpu-experts-{platform.node() or 'host'}", payload)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    command()
