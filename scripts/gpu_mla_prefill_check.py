"""On a GPU: does kernels/triton/mla_prefill.py give every prompt query the decode kernel's
bits at Moonlight's MLA shapes (16 heads, latent 512, rope 64, 64-token blocks), and how
long does it take against the decode kernel run over the same queries (the engine's
invariant prefill today, engine/backends/cuda/mla.py)? Prints one line per variant; a
variant whose bits differ says which rows.

    PYTHONPATH=. python3 scripts/gpu_mla_prefill_check.py [--prompt 2048] [--seqs 4]
"""

import argparse

import torch

from kernels.triton.mla_decode import MAX_SPLITS, mla_decode, splits_for_context
from kernels.triton.mla_prefill import mla_prefill


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=8192)
    a = ap.parse_args()
    torch.manual_seed(0)
    H, KVL, R, BS = 16, 512, 64, 64
    S, L = a.seqs, a.prompt
    blocks = -(-L // BS)
    cache = torch.randn(S * blocks + 1, BS, KVL + R, device="cuda").bfloat16()
    tables = torch.randperm(S * blocks, device="cuda")[: S * blocks].view(S, blocks).int()
    T = S * L
    q_c = torch.randn(T, H, KVL, device="cuda").bfloat16()
    q_r = torch.randn(T, H, R, device="cuda").bfloat16()
    lens = torch.arange(1, L + 1, device="cuda", dtype=torch.int32).repeat(S)
    seq_of = torch.arange(S, device="cuda").repeat_interleave(L)
    splits = min(splits_for_context(a.max_model_len), MAX_SPLITS)  # as CudaMlaOps fixes it
    scale = 192**-0.5
    rows = tables[seq_of].contiguous()

    def decode():  # the engine's invariant prefill: the decode kernel, 256 rows a launch
        return torch.cat([mla_decode(q_c[i : i + 256], q_r[i : i + 256], cache, rows[i : i + 256],
                                     lens[i : i + 256], scale, splits, value_blocks=1)
                          for i in range(0, T, 256)])  # fmt: skip

    want = decode()
    t_decode = timed(decode)
    print(f"decode kernel over {T} queries ({S} x {L}): {t_decode:.2f} ms", flush=True)
    for q_tile, value_blocks in [(2, 1), (4, 2), (4, 1), (8, 4), (8, 2)]:

        def prefill(q_tile=q_tile, value_blocks=value_blocks):
            return mla_prefill(q_c, q_r, cache, tables, [L] * S, lens, scale, splits,
                               q_tile=q_tile, value_blocks=value_blocks)  # fmt: skip

        try:
            got = prefill()
            t = timed(prefill)
        except Exception as exc:  # a variant that does not compile (resources) is reported
            print(f"q_tile {q_tile} value_blocks {value_blocks}: {type(exc).__name__} {exc}")
            continue
        diff = (got != want).any(dim=-1).any(dim=-1).nonzero().flatten()
        bits = (
            "equal bits"
            if diff.numel() == 0
            else f"{diff.numel()} rows differ, first {diff[:8].tolist()}"
        )
        print(f"q_tile {q_tile} value_blocks {value_blocks}: {t:.2f} ms "
              f"({t_decode / t:.2f}x the decode kernel), {bits}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
