"""vLLM's side of `batchgen bench prefix-cache`: the same jobs (batchgen/bench/prefix_workloads.py,
loaded by its path), seeds and sampling on vLLM's offline LLM.generate with its automatic
prefix caching on (its default); the random-weight Moonlight-16B-A3B config of scripts/vllm_peer.py. On the GPU machine, with vLLM installed as
../shared/tools/vllm-anchor/README.md says:
    source payload/tools/env.sh; python3 scripts/vllm_prefix_cache.py --out v.json
Each job starts from an empty cache (LLM.reset_prefix_cache); a warm-up of other prompts
runs first. Per job: wall time of one generate call, prompt tokens read from the cache
(RequestOutput.num_cached_tokens), output tok/s.
"""

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location(
    "prefix_workloads", HERE.parent / "batchgen" / "bench" / "prefix_workloads.py"
)
workloads = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workloads)
sys.path.insert(0, str(HERE))  # scripts/ holds no package vLLM imports
from vllm_peer import MOONLIGHT  # noqa: E402


def generate(llm, sampling_params, prompts, new_tokens):
    """(wall seconds, outputs) of one generate call, the bench's sampling."""
    params = [sampling_params(max_tokens=new_tokens, temperature=1.0, seed=1000 + i,
                              ignore_eos=True, detokenize=False)
              for i in range(len(prompts))]  # fmt: skip
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", default="shared")
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--suffix-tokens", type=int, default=50)
    ap.add_argument("--n-prompts", type=int, default=200)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model_dir = tempfile.mkdtemp(prefix="moonlight-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(MOONLIGHT, f)

    import vllm
    from vllm import LLM, SamplingParams

    vocab = MOONLIGHT["vocab_size"]
    t0 = time.time()
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True,
              max_model_len=a.prefix_tokens + a.suffix_tokens + a.new_tokens + 16,
              max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
              gpu_memory_utilization=0.85, enable_prefix_caching=True,
              seed=0)  # fmt: skip
    up = time.time() - t0
    generate(llm, SamplingParams, workloads.job_prompts("distinct", 4, 64, 8, 1, 1, vocab, 99), 4)
    rows = []
    for job in [j.strip() for j in a.jobs.split(",") if j.strip()]:
        prompts = workloads.job_prompts(job, a.rows, a.prefix_tokens, a.suffix_tokens,
                                        a.n_prompts, a.n, vocab, seed=1)  # fmt: skip
        llm.reset_prefix_cache()
        wall, outs = generate(llm, SamplingParams, prompts, a.new_tokens)
        made = sum(len(o.outputs[0].token_ids) for o in outs)
        prompt_tokens = sum(len(p) for p in prompts)
        rows.append({
            "engine": "vllm", "version": vllm.__version__, "job": job, "caching": True,
            "requests": len(prompts), "prompt_tokens": prompt_tokens,
            "distinct_prompt_tokens": workloads.distinct_prompt_tokens(prompts),
            "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outs),
            "completion_tokens": made, "wall_s": round(wall, 3),
            "output_tok_s": round(made / wall, 1),
            "total_tok_s": round((made + prompt_tokens) / wall, 1), "engine_up_s": round(up, 1),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    with open(a.out, "w") as f:
        json.dump({"shape": vars(a), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
