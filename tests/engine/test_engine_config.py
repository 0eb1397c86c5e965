import pytest

from engine.config import EngineConfig


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
        EngineConfig(model="m", **{field: value})


def test_async_scheduling_and_speculative_tokens_do_not_combine():
    with pytest.raises(ValueError, match="does not combine"):
        EngineConfig(model="m", async_scheduling=True, speculative_tokens=2)
    assert EngineConfig(model="m", fp8_native_min_tokens=64).fp8_native_min_tokens == 64
