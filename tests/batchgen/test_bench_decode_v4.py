"""`bench decode-moe --arch deepseek_v4`: the bytes a decode step must read, held against
MODELS.md section 4's V4-Flash table (from the real config, no weights drawn); the bench's
`random:` model holding exactly the weights `make_random_v4_checkpoint` writes; and the
whole benchmark on the tiny preset on the CPU (batches 1 and 2, 2 decode steps), its JSON
checked field by field."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from batchgen.bench.decode_moe import (
    LayerClock,
    command,
    random_model,
    run_engine_batch,
    run_v4,
    v4_layer_ms,
)
from batchgen.bench.v4_roofline import (
    DecodeReads,
    expected_experts,
    extrapolate_step_ms,
    kv_read_bytes,
    state_read_bytes,
)
from engine import LLM
from engine.deepseek_v4_checkpoint import make_random_v4_checkpoint, plan
from engine.models.deepseek_v4_config import DeepseekV4ModelConfig


def _nbytes(spec) -> int:
    return spec.dtype.itemsize * torch.Size(spec.shape).numel()


def _flash(layers=None) -> tuple[DeepseekV4ModelConfig, dict]:
    config, specs = plan("v4-flash", layers, "fp8", "mxfp4", mtp=False)
    return DeepseekV4ModelConfig.from_dict(config), specs


# MODELS.md section 4, "Weight bytes per token, batch 1", MB (rounded there to 1 MB)
FLASH_TABLE_MB = {
    "attention": 4599,
    "routed_experts": 3449,
    "shared_expert": 1082,
    "head": 1059,
    "compressor": 520,
    "indexer": 275,
    "mhc": 135,
    "router": 90,
}
FLASH_TOTAL_MB = 11218


def test_batch1_bytes_reproduce_the_v4_flash_decode_cost_table():
    cfg, specs = _flash()
    step = DecodeReads(cfg).step(batch=1, context=0)
    assert {p: round(step["parts"][p] / 1e6) for p in FLASH_TABLE_MB} == FLASH_TABLE_MB
    # The table's total counts the `ape` tables whole; a step reads one row of each.
    ape = [s for n, s in specs.items() if n.endswith(".ape")]
    ape_whole = sum(_nbytes(s) for s in ape)
    ape_rows = sum(_nbytes(s) // s.shape[0] for s in ape)
    weights = step["total"] - step["parts"]["kv"] - step["parts"]["state"]
    assert round((weights - ape_rows + ape_whole) / 1e6) == FLASH_TOTAL_MB


def test_expected_distinct_experts_match_random_routing():
    gen, trials = torch.Generator().manual_seed(0), 200
    for batch in (1, 32, 256):
        picks = torch.rand(trials, batch, 256, generator=gen).topk(6, dim=-1).indices
        hit = torch.zeros(trials, 256, dtype=torch.bool)
        hit.scatter_(1, picks.reshape(trials, -1), True)  # [trials, E] experts read
        distinct = hit.sum(1).double().mean().item()
        assert distinct == pytest.approx(expected_experts(256, 6, batch), rel=0.01)


def test_kv_reads_reproduce_the_attention_reads_per_token():
    # MODELS.md section 4: 4k context 22.8 MB, 64k 115 MB, 1M 1,594 MB per token (bf16 KV)
    cfg, _ = _flash()
    per_token = {
        context: sum(kv_read_bytes(cfg, i, context) for i in range(cfg.num_hidden_layers)) / 1e6
        for context in (4096, 65536, 1 << 20)
    }
    assert round(per_token[4096], 1) == 22.8
    assert round(per_token[65536]) == 115
    assert round(per_token[1 << 20]) == 1594


def test_pooling_states_are_read_once_per_window():
    # docs/notes-v4.md: HCA 512 KiB, CSA compressor 64 KiB + its indexer's 16 KiB per
    # sequence; each read whole when a window of m = 128 (HCA) or 4 (CSA) tokens closes
    cfg, _ = _flash()
    per_step = sum(state_read_bytes(cfg, i) for i in range(cfg.num_hidden_layers))
    assert per_step == 20 * (512 << 10) / 128 + 21 * (80 << 10) / 4
    step = DecodeReads(cfg).step(batch=3, context=512)
    assert step["parts"]["state"] == 3 * per_step


def test_layer_bytes_of_the_first_layers_equal_the_whole_models():
    # --layers N keeps the first N layers' shapes: their counts are the 43-layer model's
    small, full = (DecodeReads(_flash(n)[0]).step(8, 512) for n in (4, None))
    assert small["layers"] == full["layers"][:4]
    assert small["globals"] == full["globals"]


def test_extrapolation_times_each_layer_by_its_kind():
    sliding_hash, csa_hash, hca_topk, csa_topk = (0, True), (4, True), (128, False), (4, False)
    measured = [(sliding_hash, 1.0), (sliding_hash, 3.0), (csa_hash, 5.0), (hca_topk, 7.0)]
    full = [sliding_hash, csa_hash, hca_topk, csa_topk, (8, False)]
    # eager steps: 0.5 ms outside the layers, then sliding median(1, 3), CSA top-k from the
    # CSA hash layer, HCA-8 from every measured layer
    ms, sources = extrapolate_step_ms(16.5, 16.5, measured, full)
    assert ms == pytest.approx(0.5 + 2.0 + 5.0 + 7.0 + 5.0 + 4.0)
    assert sources["csa+topk"] == "csa+hash (routing differs)"
    assert sources["hca8+topk"] == "all measured layers (kind not measured)"
    # graph replays twice as fast as the eager steps: the whole model's step scales alike
    graphed, _ = extrapolate_step_ms(8.25, 16.5, measured, full)
    assert graphed == pytest.approx(23.5 / 2)


def test_the_benchs_model_holds_the_weights_the_maker_writes(tmp_path):
    written = make_random_v4_checkpoint(tmp_path / "written", preset="tiny", dense_dtype="fp8",
                                        expert_dtype="mxfp4", mtp=False, device="cpu")  # fmt: skip
    drawn = random_model("deepseek_v4", "tiny", None, "fp8-mxfp4")
    assert drawn.startswith("random:tiny?")
    models = [LLM(str(p), dtype="bfloat16").engine.runner.model for p in (written, drawn)]
    a, b = (m.state_dict() for m in models)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def tiny_v4_llm():
    """The tiny preset's first 2 layers, drawn at load, on the CPU."""
    return LLM(random_model("deepseek_v4", "tiny", 2, "bf16"), dtype="float32", max_num_seqs=2)


SAMPLED = {"temperature": 1.0, "seed": 0}


def test_the_clock_times_each_layer_once_per_decode_step(tiny_v4_llm):
    layers = tiny_v4_llm.engine.runner.model.layers
    with LayerClock(layers, torch.device("cpu")) as clock:
        r = run_engine_batch(tiny_v4_llm, 2, 12, 4, 258, SAMPLED, clock)
    assert r["decode_steps"] == 3
    assert [len(marks) for marks in clock.marks] == [3, 3]  # not the prefill steps
    assert all(layer._forward_hooks == {} for layer in layers)  # the hooks are gone


def test_layers_are_timed_in_eager_steps_when_decode_steps_replay_graphs(tiny_v4_llm):
    class ReplayUnseenByHooks:  # stands in for decode graphs: no layer call, token 0 a row
        def fits(self, batch: int) -> bool:
            return True

        def launch(self, seqs, chained_rows=None):
            return lambda: [0] * len(seqs)

    runner = tiny_v4_llm.engine.runner
    graphs = runner.graphs = ReplayUnseenByHooks()
    try:
        r, layer_ms, eager_ms, where = v4_layer_ms(tiny_v4_llm, 2, 12, 3, 258, SAMPLED)
        assert runner.graphs is graphs  # put back after the eager steps
    finally:
        runner.graphs = None
    assert where.startswith("separate eager decode steps")
    assert r["tok_s"] > 0 and len(layer_ms) == 2 and min(layer_ms) > 0
    assert eager_ms >= 0.9 * sum(layer_ms) and not tiny_v4_llm.engine.has_unfinished()


def test_the_v4_bench_on_the_tiny_preset_writes_every_figure(tmp_path, monkeypatch):
    monkeypatch.setattr("batchgen.bench.common.BENCH_DIR", tmp_path / "bench")
    # 20 tokens of context: 5 CSA (ratio 4) and 2 HCA (ratio 8) entries per sequence
    run_v4("tiny", 3, ("fp8-mxfp4",), (1, 2), prompt_len=20, new_tokens=3, name="v4",
           device="cpu")  # fmt: skip
    out = json.loads((tmp_path / "bench" / "v4.json").read_text())
    assert out["arch"] == "deepseek_v4" and out["layers"] == 3 and out["full_layers"] == 4
    assert out["cuda_graphs"] is False and out["sampling"]["temperature"] == 1.0
    assert out["compressed_entries_per_prompt"] == {"ratio 4": 5, "ratio 8": 2}
    assert out["copy_tb_s"] > 0 and out["machine"] and out["command"] is not None

    _, specs = plan("tiny", 3, "fp8", "mxfp4", mtp=False)
    info = out["engine_info"]["fp8-mxfp4"]
    assert [la["kind"] for la in info["layer_bytes"]] == ["sliding", "csa", "hca"]
    for la in info["layer_bytes"]:
        prefix = f"layers.{la['layer']}."
        hub = sum(_nbytes(s) for n, s in specs.items() if n.startswith(prefix))
        assert la["hub_bytes"] == hub > 0 and la["engine_param_bytes"] > 0
    assert set(info["launches_per_step_batch1"]) == {"eager"}  # no graphs: eager steps
    assert info["load_s"] > 0 and info["weights_source"].startswith("drawn")
    assert info["model"] == "random:tiny?arch=deepseek_v4&weights=fp8-mxfp4&seed=0&mtp=0&layers=3"

    assert [r["batch"] for r in out["results"]] == [1, 2]
    for r in out["results"]:
        assert r["decode_steps"] == 2 and r["tok_s"] > 0 and r["weights"] == "fp8-mxfp4"
        assert [la["layer"] for la in r["layers"]] == [0, 1, 2]
        for la in r["layers"]:
            assert la["ms"] > 0 and la["bytes"] > 0 and la["roofline_frac"] > 0
            assert la["bytes"] == pytest.approx(sum(la["bytes_parts"].values()))
        assert r["layers_ms"] == pytest.approx(sum(la["ms"] for la in r["layers"]))
        assert r["layers_timed_in"] == "the measured decode steps (eager)"
        assert r["eager_step_ms"] == r["ms_per_step"]
        assert r["rest_ms"] == pytest.approx(r["ms_per_step"] - r["layers_ms"])
        assert r["bytes_per_step"] > sum(la["bytes"] for la in r["layers"])  # + head
        ext = r["extrapolated"]
        assert ext["extrapolated"] is True and ext["layers"] == 4
        assert ext["layer_ms_from"] == {
            "sliding+hash": "sliding+hash",
            "csa+topk": "csa+topk",
            "hca8+topk": "hca8+topk",
        }
        assert ext["ms_per_step"] > r["ms_per_step"] - r["layers_ms"]
        assert ext["bytes_per_step"] > r["bytes_per_step"] and ext["tok_s"] > 0
    one, two = out["results"]
    assert two["layers"][1]["bytes_parts"]["routed_experts"] == pytest.approx(
        one["layers"][1]["bytes_parts"]["routed_experts"] * expected_experts(8, 2, 2) / 2
    )
    assert two["layers"][2]["bytes_parts"]["kv"] == 2 * one["layers"][2]["bytes_parts"]["kv"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_the_v4_command_checks_its_options_then_refuses_without_a_gpu():
    def invoke(*args):
        return CliRunner().invoke(command, ["--arch", "deepseek_v4", *args])

    result = invoke("--layers", "2", "--batches", "1,8")
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.output
    result = invoke("--layers", "44")
    assert result.exit_code == 2 and "layers must be in 1..43" in result.output
    result = invoke("--preset", "moonlight-16b-a3b")
    assert result.exit_code == 2 and "unknown deepseek_v4 preset" in result.output
    result = invoke("--hf-batches", "1")
    assert result.exit_code == 2 and "transformers comparison is V3's only" in result.output
