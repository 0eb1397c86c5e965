"""vLLM's side of `batchgen bench peer`: the same workloads (batchgen/bench/peer_workloads.py)
and timing protocol on vLLM's offline LLM.generate, over a random-weight (`load_format=
"dummy"`) Moonlight-16B-A3B-shaped DeepSeek-V3 config, bf16 or FP8 block-scaled + MXFP4, or
over a checkpoint on disk (`--model DIR`, e.g. `batchgen models make-random --preset
moonlight-16b-a3b DIR`, which `bench peer --model DIR` reads too).

The checkpoint matters for a MoE model: vLLM's dummy loader draws every tensor, norm weights
and the router's correction bias included, uniform in +-1e-3, so the router's scores hardly
vary from token to token, the bias alone picks the experts, and every token of a batch goes
to the same ~6 experts a layer (docs/notes-vllm-peer.md). A trained model's routing is
spread; make-random's is too, so the same checkpoint on both engines compares equal work.
Writes rows of the same schema (engine "vllm"). On the GPU machine, with vLLM installed as
../shared/tools/vllm-anchor/README.md says:
    source payload/tools/env.sh; python3 scripts/vllm_peer.py --workload short --out v.json
The workloads module is loaded by its path, without PYTHONPATH: the repository's own
`engine` and `kernels` packages must not shadow what vLLM imports.
"""

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

_WORKLOADS = Path(__file__).resolve().parents[1] / "batchgen" / "bench" / "peer_workloads.py"
_spec = importlib.util.spec_from_file_location("peer_workloads", _WORKLOADS)
workloads = sys.modules["peer_workloads"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workloads)  # registered first: its dataclasses look it up

MOONLIGHT = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", torch_dtype="bfloat16",
    vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
    n_routed_experts=64, num_experts_per_tok=6, n_group=1, topk_group=1, topk_method="noaux_tc",
    scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.446,
    first_k_dense_replace=1, moe_layer_freq=1, q_lora_rank=None, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, hidden_act="silu",
    max_position_embeddings=8192, rope_theta=50000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=["short", "long", "mixed"], default="short")
    ap.add_argument("--quant", choices=["none", "fp8-mxfp4"], default="none")
    ap.add_argument("--batches", default="1,8,32,128,256,512,1024")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--model", default=None, help="a bf16 checkpoint dir (else dummy weights)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    if a.workload == "short":
        requests = workloads.short(max(batches))
    else:
        requests = getattr(workloads, a.workload)(a.requests)
    shape = workloads.summary(requests)
    cfg = dict(MOONLIGHT)
    if a.quant != "none":
        cfg["quantization_config"] = dict(quant_method="fp8", activation_scheme="dynamic",
                                          fmt="e4m3", weight_block_size=[128, 128],
                                          store_dtype="mxfp4")  # fmt: skip
    if a.model:
        if a.quant != "none":
            sys.exit("--model takes the checkpoint's own format: leave --quant out")
        model_dir, load_format = a.model, "auto"
    else:
        model_dir, load_format = tempfile.mkdtemp(prefix="moonlight-"), "dummy"
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(cfg, f)

    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model=model_dir, load_format=load_format, skip_tokenizer_init=True,
              max_model_len=shape["longest_request"] + 16,
              max_num_seqs=max(batches) if a.workload == "short" else 1024,
              gpu_memory_utilization=0.85, seed=0)  # fmt: skip
    up = time.time() - t0

    def generate(reqs):
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=a.temperature,
                                 seed=0 if a.temperature > 0 else None, ignore_eos=True,
                                 detokenize=False) for r in reqs]  # fmt: skip
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r.prompt} for r in reqs], params,
                            use_tqdm=False)  # fmt: skip
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    weights = "bf16" if a.quant == "none" else a.quant
    rows = []
    if a.workload == "short":
        generate(workloads.short(4, 128, 8))
        for b in batches:
            reqs = workloads.short(b)
            generate(workloads.scaled(reqs, 4))
            t1, _ = generate(workloads.scaled(reqs, 1))
            tg, made = generate(reqs)
            rows.append({"engine": "vllm", "version": vllm.__version__, "workload": "short",
                         "weights": weights, "batch": b, "temperature": a.temperature,
                         "e2e_tok_s": made / tg, "decode_tok_s": b * 127 / max(tg - t1, 1e-9),
                         "prefill_tok_s": b * 128 / t1, "t_gen_s": tg, "t_prefill1_s": t1})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    else:
        make = getattr(workloads, a.workload)
        generate(make(a.requests, start=workloads.WARM_START)[:64])
        t1, _ = generate(workloads.scaled(make(a.requests, start=workloads.PREFILL_START), 1))
        t, made = generate(requests)
        rows.append({"engine": "vllm", "version": vllm.__version__, "workload": a.workload,
                     "weights": weights, **shape, "temperature": a.temperature,
                     "e2e_tok_s": made / t, "total_tok_s": (made + shape["prompt_tokens"]) / t,
                     "prefill_tok_s": shape["prompt_tokens"] / t1, "t_s": t,
                     "t_prefill1_s": t1})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    with open(a.out, "w") as f:
        json.dump(
            {
                "engine_up_s": up,
                "workload": a.workload,
                "weights_source": a.model or "dummy",
                "results": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
