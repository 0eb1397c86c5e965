import pytest

from engine.config import CudaTuning, EngineConfig


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_num_seqs", 0, "max_num_seqs must be >= 1"),
        ("speculative_tokens", 5, "speculative_tokens must be in 0..4"),
        ("fp8_native_min_tokens", 0, "fp8_native_min_tokens must be >= 1 or None"),
        ("dtype", "int8", "unknown dtype 'int8'"),
    ],
)
def test_bad_settings_are_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options("m", **{field: value})


def test_async_scheduling_and_speculative_tokens_do_not_combine():
    with pytest.raises(ValueError, match="does not combine"):
        EngineConfig(model="m", async_scheduling=True, speculative_tokens=2)


def test_flat_options_split_into_the_config_and_its_cuda_tuning():
    config = EngineConfig.from_options("m", max_num_seqs=3, fp8_native_min_tokens=None,
                                       shared_expert_stream=False)  # fmt: skip
    assert config.max_num_seqs == 3
    assert config.cuda == CudaTuning(fp8_native_min_tokens=None, shared_expert_stream=False)
    assert EngineConfig.from_options("m").cuda == CudaTuning()


def test_an_unknown_option_is_named():
    with pytest.raises(TypeError, match="unknown engine option.*max_num_seq\\b"):
        EngineConfig.from_options("m", max_num_seq=3)
