"""The `random:` model source (engine/loader/random_source.py): the tensors, config.json and
tokenizer of the directory `make-random` writes for the same preset, formats and seed,
streamed from memory; loaded and decoded through the engine like that directory; drawn
where the model loads; strict about its spec."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.checkpoint_maker import RandomCheckpoint, make_random_checkpoint
from engine.loader import open_model_source
from engine.loader.model_source import register_scheme, spec_scheme
from engine.loader.random_source import parse_random_spec

# (spec query, make-random arguments)
CASES = {
    "v4-fp8-mxfp4": (
        "arch=deepseek_v4&weights=fp8-mxfp4&seed=3",
        dict(arch="deepseek_v4", dense_dtype="fp8", expert_dtype="mxfp4", seed=3),
    ),
    "v4-bf16-2-layers-no-mtp": (
        "arch=deepseek_v4&layers=2&mtp=0",
        dict(arch="deepseek_v4", layers=2, mtp=False),
    ),
    "v4-fp8-fp8": (
        "arch=deepseek_v4&weights=fp8-fp8&seed=1",
        dict(arch="deepseek_v4", dense_dtype="fp8", expert_dtype="fp8", seed=1),
    ),
    "v3-fp8-mxfp4": (
        "arch=deepseek_v3&weights=fp8-mxfp4&seed=2",
        dict(arch="deepseek_v3", dense_dtype="fp8", expert_dtype="mxfp4", seed=2),
    ),
    "v3-bf16": ("arch=deepseek_v3", dict(arch="deepseek_v3")),
    "llama": ("arch=llama&seed=4", dict(arch="llama", seed=4)),
}


def _written(tmp_path_factory, case: str):
    return make_random_checkpoint(
        tmp_path_factory.mktemp(case) / "model", preset="tiny", device="cpu", **CASES[case][1]
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_stream_is_the_directory_make_random_writes(case, tmp_path_factory):
    written = open_model_source(_written(tmp_path_factory, case))
    drawn = open_model_source(f"random:tiny?{CASES[case][0]}", device="cpu")
    assert drawn.path is None and drawn.format == "random"
    assert drawn.config == written.config
    assert type(drawn.quant_config) is type(written.quant_config)
    on_disk = dict(written.iter_weights())
    names = []
    for name, tensor in drawn.iter_weights():
        names.append(name)
        stored = on_disk[name]
        assert tensor.dtype == stored.dtype and tensor.shape == stored.shape, name
        # bit patterns: fp8 codes and E8M0 scales compare as bytes (NaN-free either way)
        assert torch.equal(tensor.view(torch.uint8), stored.view(torch.uint8)), name
    assert sorted(names) == sorted(on_disk) and len(names) == len(set(names))


def test_seeds_give_different_weights():
    a = dict(open_model_source("random:tiny?arch=deepseek_v4&seed=0").iter_weights())
    b = dict(open_model_source("random:tiny?arch=deepseek_v4&seed=1").iter_weights())
    assert a.keys() == b.keys()
    floats = [n for n, t in a.items() if t.is_floating_point()]
    assert floats and not any(torch.equal(a[n], b[n]) for n in floats)
    assert not torch.equal(a["layers.0.ffn.gate.tid2eid"], b["layers.0.ffn.gate.tid2eid"])


@pytest.mark.parametrize("case", ["v4-fp8-mxfp4", "v3-fp8-mxfp4", "llama"])
def test_loads_and_decodes_as_the_written_directory(case, tmp_path_factory):
    path = _written(tmp_path_factory, case)
    llms = [LLM(m, dtype="float32", device="cpu") for m in (path, f"random:tiny?{CASES[case][0]}")]
    written, drawn = (llm.engine.runner.model.state_dict() for llm in llms)
    assert written.keys() == drawn.keys()
    for name in written:
        assert written[name].dtype == drawn[name].dtype, name
        assert torch.equal(written[name], drawn[name]), name
    prompts = ["The quick brown fox", [5, 17, 200, 3, 99]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for llm in llms]
    assert tokens[0] == tokens[1] and all(len(t) == 6 for t in tokens[1])
    # the tokenizer is make-random's: same ids, same chat template, same end of sequence
    a, b = (llm.tokenizer for llm in llms)
    text = "héllo, wörld ✓ 123"
    assert a.encode(text) == b.encode(text) and b.decode(b.encode(text)).endswith(text)
    assert a.eos_token_ids == b.eos_token_ids and a.hf.chat_template == b.hf.chat_template


def test_tensors_are_drawn_one_at_a_time_on_the_load_device(monkeypatch):
    calls = []
    real = RandomCheckpoint.tensors

    def recording(self, device):
        calls.append(device)
        for item in real(self, device):
            calls.append(item[0])
            yield item

    monkeypatch.setattr(RandomCheckpoint, "tensors", recording)
    source = open_model_source("random:tiny?arch=deepseek_v4", device=torch.device("cuda"))
    assert calls == []  # opening draws nothing
    stream = source.iter_weights()
    # the first tensor asks the checkpoint for the load device (CUDA is not needed to see it)
    try:
        assert next(stream)[1].device.type == "cuda"
    except (RuntimeError, AssertionError, TypeError):
        assert not torch.cuda.is_available()  # drawing on CUDA fails without one
    assert calls[0] == torch.device("cuda")
    calls.clear()
    pinned = open_model_source("random:tiny?arch=deepseek_v4&device=cpu", device="cuda")
    first = pinned.iter_weights()
    name, tensor = next(first)
    assert calls == [torch.device("cpu"), name] and tensor.device.type == "cpu"
    # one tensor per step: the second is drawn only when asked for
    next(first)
    assert len(calls) == 3
    calls.clear()
    LLM("random:tiny?arch=deepseek_v4&layers=2&mtp=0", device="cpu", dtype="float32")
    assert calls[0] == torch.device("cpu")


def test_an_explicit_dtype_converts_the_float_tensors_only():
    tensors = dict(
        open_model_source(
            "random:tiny?arch=deepseek_v4&weights=fp8-mxfp4", dtype=torch.float16
        ).iter_weights()
    )
    dtypes = {t.dtype for t in tensors.values()}
    assert torch.float16 in dtypes and torch.float8_e4m3fn in dtypes and torch.int8 in dtypes
    assert not dtypes & {torch.float32, torch.bfloat16}
    assert tensors["layers.0.ffn.gate.tid2eid"].dtype == torch.int64


def test_defaults_are_the_shipped_formats_and_make_randoms():
    flash = parse_random_spec("random:v4-flash").checkpoint
    assert (flash.arch, flash.layers, flash.mtp, flash.seed) == ("deepseek_v4", None, True, 0)
    assert (flash.dense_dtype, flash.expert_dtype) == ("fp8", "mxfp4")
    config = flash.config()
    assert config["num_hidden_layers"] == 43 and config["quantization_config"]["scale_fmt"]
    v3 = parse_random_spec("random:deepseek-v3-671b?layers=4").checkpoint
    assert (v3.arch, v3.dense_dtype, v3.expert_dtype, v3.layers) == ("deepseek_v3", "fp8", "fp8", 4)
    moon = parse_random_spec("random:moonlight-16b-a3b?weights=bf16-mxfp4&mtp=false").checkpoint
    assert (moon.dense_dtype, moon.expert_dtype, moon.mtp) == ("bf16", "mxfp4", False)
    tiny = parse_random_spec("random:tiny?arch=deepseek_v3").checkpoint
    assert (tiny.dense_dtype, tiny.expert_dtype) == ("bf16", "bf16")


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("random:huge", r"unknown preset 'huge' \(presets: deepseek_v3: .*v4-flash"),
        ("random:", r"unknown preset ''"),
        ("random:tiny", r"'tiny' exists for deepseek_v3, deepseek_v4, llama: add \?arch="),
        ("random:v4-flash?layer=2", r"unknown key 'layer'; the keys are"),
        ("random:v4-flash?layers=2&layers=3", r"key 'layers' is given twice"),
        ("random:v4-flash?layers", r"'layers' is not key=value"),
        ("random:v4-flash?layers=two", r"layers 'two' is not an integer"),
        ("random:v4-flash?layers=44", r"layers must be in 1..43"),
        ("random:v4-flash?seed=1.5", r"seed '1.5' is not an integer"),
        ("random:v4-flash?arch=gpt2", r"arch 'gpt2' is not one of"),
        ("random:v4-flash?arch=llama", r"llama has no preset 'v4-flash'"),
        ("random:tiny?arch=llama&weights=fp8", r"llama random checkpoints are bf16"),
        ("random:v4-flash?arch=deepseek_v3", r"deepseek_v3 has no preset 'v4-flash'"),
        ("random:v4-flash?weights=fp8-mxfp4-x", r"weights 'fp8-mxfp4-x': expected <dense>"),
        ("random:v4-flash?weights=bf16-mxfp4", r"deepseek_v4 checkpoints come as"),
        ("random:moonlight-16b-a3b?weights=fp4", r"dense dtype 'fp4'"),
        ("random:moonlight-16b-a3b?weights=bf16-int4", r"expert dtype 'int4'"),
        ("random:tiny?arch=deepseek_v3&mtp=maybe", r"mtp 'maybe': expected 1 or 0"),
        ("random:tiny?arch=deepseek_v3&device=gpu0", r"device 'gpu0' is not a torch device"),
    ],
)
def test_bad_specs_are_errors_naming_the_problem(spec, problem):
    with pytest.raises(ValueError, match=problem) as err:
        open_model_source(spec)
    assert repr(spec) in str(err.value)


def test_schemes_are_words_and_only_registered_ones_open(tmp_path, monkeypatch):
    assert spec_scheme("random:tiny") == "random"
    assert spec_scheme("C:/models/x") is None and spec_scheme("nope:tiny") is None
    with pytest.raises(ValueError, match="two or more lower-case letters"):
        register_scheme("c", lambda *a: None)
    # a path that merely holds a colon is still a path
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        open_model_source(str(tmp_path / "nope:tiny"))


def test_a_job_file_may_name_a_random_model():
    from batchgen.job_context import check_model_path

    check_model_path("random:tiny?arch=deepseek_v4")  # checked in full when opened
    source = open_model_source("random:tiny?arch=deepseek_v4")
    assert source.declared_context == 256 and source.tokenizer is not None
    assert json.loads(json.dumps(source.config)) == source.config


def test_host_experts_load_from_the_stream_as_from_the_directory(tmp_path):
    """Expert offload's loader path (host experts staged, then re-laid for the CPU kernel)
    takes the random stream as it takes the files: the same host bytes, the same tokens."""
    from engine.expert_placement import ExpertPlacement
    from engine.layers.moe import DeepseekMoE

    query = "arch=deepseek_v4&weights=fp8-mxfp4&mtp=0&layers=2"
    path = make_random_checkpoint(tmp_path / "m", arch="deepseek_v4", preset="tiny", layers=2,
                                  dense_dtype="fp8", expert_dtype="mxfp4", mtp=False, device="cpu")  # fmt: skip
    experts = parse_random_spec(f"random:tiny?{query}").checkpoint.config()["n_routed_experts"]
    host = {layer: tuple(range(1, experts, 2)) for layer in range(2)}  # every layer is MoE
    ExpertPlacement(host).save(tmp_path / "placement.json")
    llms = [
        LLM(m, dtype="float32", expert_offload=str(tmp_path / "placement.json"))
        for m in (path, f"random:tiny?{query}")
    ]
    stores = [
        [m.experts.host.kernel_store for m in llm.engine.runner.model.modules()
         if isinstance(m, DeepseekMoE)]
        for llm in llms
    ]  # fmt: skip
    assert len(stores[1]) == 2
    for a, b in zip(*stores, strict=True):
        for field in ("gate_up", "gate_up_scales", "down", "down_scales"):
            assert (getattr(a, field) == getattr(b, field)).all(), field
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = [
        [o.outputs[0].token_ids for o in llm.generate([[3, 17, 42, 5]], params)] for llm in llms
    ]
    assert tokens[0] == tokens[1]
