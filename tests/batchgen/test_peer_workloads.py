"""The vLLM comparison's workloads: the anchor's prompts exactly, distinct long prompts."""

from batchgen.bench import peer_workloads as w


def test_short_prompts_are_the_anchors():
    reqs = w.short(3)
    assert reqs[2].prompt == [(7 * 2 + 13 * j) % 160000 + 2 for j in range(128)]
    assert {r.max_tokens for r in reqs} == {128}


def test_long_prompts_share_no_prefix():
    reqs = w.long(512, prompt_len=50)
    assert len({r.prompt[0] for r in reqs}) == 512
    assert all(len(r.prompt) == 50 and r.max_tokens == 256 for r in reqs)
    assert all(2 <= t < 160002 for r in reqs for t in r.prompt)


def test_mixed_is_seeded_and_in_range():
    a, b = w.mixed(64), w.mixed(64)
    assert a == b
    assert all(100 <= len(r.prompt) <= 8000 and 1 <= r.max_tokens <= 512 for r in a)
    assert all(len(r.prompt) + r.max_tokens <= 8192 - 16 for r in w.mixed(512))
    assert len({r.prompt[0] for r in a}) == 64
    s = w.summary(a)
    assert s["output_tokens"] == sum(r.max_tokens for r in a)


def test_peer_bench_runs_the_protocol_and_compares(tmp_path, monkeypatch, tiny_model_dir):
    import json

    from click.testing import CliRunner

    from batchgen.bench.peer import command

    monkeypatch.setattr(w, "VOCAB_SPAN", 200)  # the tiny model's vocabulary
    monkeypatch.setattr("batchgen.bench.common.BENCH_DIR", tmp_path)
    vllm = tmp_path / "vllm.json"
    vllm.write_text(json.dumps({"results": [
        {"engine": "vllm", "workload": "short", "batch": 2, "e2e_tok_s": 1.0, "decode_tok_s": 2.0},
    ]}))  # fmt: skip
    result = CliRunner().invoke(command, [
        "--model", str(tiny_model_dir), "--device", "cpu", "--batches", "1,2",
        "--prompt-len", "6", "--gen", "3", "--compare", str(vllm), "--name", "peer-test",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "peer-test.json").read_text())["results"]
    assert [r["batch"] for r in rows] == [1, 2]
    assert rows[1]["e2e_tok_s_ratio_vs_vllm"] == rows[1]["e2e_tok_s"] / 1.0
    if rows[1]["decode_tok_s"] is None:  # a stall made the 1-token pass the longer one
        assert "decode_tok_s_ratio_vs_vllm" not in rows[1]
    else:
        assert rows[1]["decode_tok_s_ratio_vs_vllm"] == rows[1]["decode_tok_s"] / 2.0
    assert "e2e_tok_s_ratio_vs_vllm" not in rows[0]


def test_no_decode_estimate_when_the_one_token_pass_took_longer():
    from batchgen.bench.peer import _decode_tok_s

    assert _decode_tok_s(128, 128, tg=1.51, t1=1.68) is None
    assert _decode_tok_s(2, 3, tg=3.0, t1=1.0) == 2.0


def test_peer_bench_reports_distinct_experts_on_a_moe_model(tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner

    from batchgen.bench.peer import command
    from engine.checkpoint_maker import make_random_checkpoint

    model = make_random_checkpoint(tmp_path / "moe", preset="tiny", seed=2)
    monkeypatch.setattr(w, "VOCAB_SPAN", 200)
    monkeypatch.setattr("batchgen.bench.common.BENCH_DIR", tmp_path)
    args = ["--model", str(model), "--device", "cpu", "--batches", "4", "--prompt-len", "6",
            "--gen", "3", "--name", "peer-moe"]  # fmt: skip
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 0, result.output
    (row,) = json.loads((tmp_path / "peer-moe.json").read_text())["results"]
    # tiny preset: 8 routed experts, top-2; 4 rows touch 2 to 8 per layer and step
    assert 2 <= row["distinct_experts_per_layer_step"] <= 8
    assert row["distinct_experts_uniform"] == round(8 * (1 - (1 - 2 / 8) ** 4), 2)


def test_vllm_side_runs_the_same_workloads_on_the_same_shape():
    import importlib.util
    from pathlib import Path

    from engine.checkpoint_maker import PRESETS

    path = Path(__file__).resolve().parents[2] / "scripts" / "vllm_peer.py"
    spec = importlib.util.spec_from_file_location("vllm_peer", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # vllm is imported only when it runs
    assert script.workloads.short(2)[1].prompt == w.short(2)[1].prompt
    pairs = [(r.prompt, r.max_tokens) for r in script.workloads.mixed(8)]
    assert pairs == [(r.prompt, r.max_tokens) for r in w.mixed(8)]
    ours = PRESETS["moonlight-16b-a3b"]
    for key, value in script.MOONLIGHT.items():
        if key in ours:
            assert ours[key] == value, key
