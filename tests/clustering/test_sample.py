from __future__ import annotations

import numpy as np
import pytest

from clustering.sample import StreamSample


@pytest.mark.parametrize("chunk", [1, 7, 100, 5000])
def test_sample_does_not_depend_on_chunking(chunk):
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((2000, 3)).astype(np.float32)
    whole = StreamSample(250, seed=5)
    whole.add(vectors, list(range(2000)))
    streamed = StreamSample(250, seed=5)
    for start in range(0, 2000, chunk):
        streamed.add(vectors[start : start + chunk], list(range(start, min(start + chunk, 2000))))
    v1, p1 = whole.result()
    v2, p2 = streamed.result()
    assert p1 == p2 and len(p1) == 250 and p1 == sorted(p1)
    np.testing.assert_array_equal(v1, v2)
    np.testing.assert_array_equal(v1, vectors[p1])


def test_sample_is_spread_over_the_stream():
    sample = StreamSample(1000, seed=0)
    sample.add(np.zeros((20000, 1), np.float32), list(range(20000)))
    positions = np.array(sample.result()[1])
    # Each quarter of the stream holds about a quarter of the sample.
    counts = np.bincount(positions // 5000, minlength=4)
    assert counts.min() > 200 and counts.max() < 300


def test_fewer_rows_than_size_keeps_them_all_and_empty_is_an_error():
    sample = StreamSample(10)
    with pytest.raises(ValueError, match="empty"):
        sample.result()
    sample.add(np.ones((3, 2), np.float32))
    assert sample.result()[0].shape == (3, 2)
