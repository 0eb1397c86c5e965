from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from clustering.cluster import (
    ClusterConfig,
    KMeansClusterer,
    choose_k,
    cluster_vectors,
    merge_small,
)
from clustering.sample import StreamSample

# Recorded in the issue-5 report: automatic clustering of data/tasks/mixed_tasks.parquet
# (8 tasks x 72 prompts) recovers the task types with this adjusted Rand index or better.
MIN_ARI = 0.8


def blobs(sizes, dim=16, spread=0.05, seed=0):
    """Unit vectors around len(sizes) random directions, with their true labels."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((len(sizes), dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    labels = np.repeat(np.arange(len(sizes)), sizes)
    x = centres[labels] + spread * rng.standard_normal((len(labels), dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    order = rng.permutation(len(labels))
    return x[order].astype(np.float32), labels[order]


def test_auto_recovers_task_types_of_the_mixed_set(mixed_frame, mixed_vectors):
    labels, clustering = cluster_vectors(mixed_vectors, ClusterConfig(min_cluster_size=32))
    ari = adjusted_rand_score(mixed_frame["task"].to_list(), labels)
    assert ari >= MIN_ARI, f"ARI {ari:.3f}, k chosen {clustering.num_clusters}"
    assert 6 <= clustering.num_clusters <= 10
    assert clustering.sizes.sum() == len(mixed_frame)
    assert list(clustering.sizes) == sorted(clustering.sizes, reverse=True)


def test_auto_k_finds_the_number_of_blobs():
    x, truth = blobs([120, 100, 90, 80, 70])
    k, scores = choose_k(x, len(x), ClusterConfig(min_cluster_size=20))
    assert k == 5
    assert max(scores, key=scores.get) == 5


def test_auto_k_is_bounded_by_min_cluster_size():
    x, _ = blobs([50] * 8)
    k, scores = choose_k(x, len(x), ClusterConfig(min_cluster_size=100))
    assert max(scores) <= 4  # 400 rows cannot fill more than 4 clusters of 100
    assert k <= 4
    assert choose_k(x, 150, ClusterConfig(min_cluster_size=100)) == (1, {})


def test_fixed_k():
    x, _ = blobs([60, 60, 60])
    labels, clustering = cluster_vectors(x, ClusterConfig(k=2, min_cluster_size=1))
    assert clustering.num_clusters == 2 and set(labels) == {0, 1}


def test_small_clusters_merge_into_their_nearest_neighbour():
    centroids = np.array([[1, 0, 0], [0, 1, 0], [0.95, 0.3, 0], [0, 0.2, 1]], np.float32)
    sizes = np.array([100, 80, 5, 3])
    merged, new_sizes, old_to_new = merge_small(centroids, sizes, min_cluster_size=10)
    assert list(new_sizes) == [105, 83]
    # Cluster 2 sits next to cluster 0, cluster 3 next to cluster 1.
    assert list(old_to_new) == [0, 1, 0, 1]
    # The merged centroid is the size-weighted mean of the two.
    np.testing.assert_allclose(merged[0], (100 * centroids[0] + 5 * centroids[2]) / 105, rtol=1e-6)


def test_merge_keeps_going_until_every_cluster_fills_a_batch():
    centroids = np.eye(4, dtype=np.float32)
    merged, sizes, old_to_new = merge_small(centroids, np.array([6, 5, 4, 0]), 10)
    assert list(sizes) == [15]  # nothing reaches 10 alone: all end in one cluster
    assert set(old_to_new) == {0}


def test_small_cluster_merge_in_the_full_flow():
    x, truth = blobs([200, 150, 12], seed=3)
    labels, clustering = cluster_vectors(x, ClusterConfig(k=3, min_cluster_size=40))
    assert clustering.num_clusters == 2
    assert sorted(np.bincount(labels)) == [150 + 12, 200] or sorted(np.bincount(labels)) == [
        150,
        200 + 12,
    ]
    # The big blobs stay whole.
    for blob in (0, 1):
        assert len(set(labels[truth == blob])) == 1


@pytest.mark.parametrize("chunk", [37, 500])
def test_streaming_assignment_equals_in_memory(chunk):
    x, _ = blobs([300, 250, 200, 150], seed=7)
    config = ClusterConfig(min_cluster_size=50, sample_size=400, seed=1)
    in_memory, reference = cluster_vectors(x, config)

    sample = StreamSample(config.sample_size, config.seed)
    for start in range(0, len(x), chunk):
        sample.add(x[start : start + chunk])
    clusterer = KMeansClusterer(config)
    clusterer.fit(sample.result()[0], sample.rows_seen)
    raw = np.concatenate(
        [clusterer.assign(x[start : start + chunk]) for start in range(0, len(x), chunk)]
    )
    clustering = clusterer.finalize(np.bincount(raw, minlength=len(clusterer.centroids)))
    np.testing.assert_array_equal(clustering.raw_to_final[raw], in_memory)
    np.testing.assert_array_equal(clustering.centroids, reference.centroids)


def test_assignment_is_the_nearest_centroid():
    x, _ = blobs([40, 40, 40], seed=2)
    clusterer = KMeansClusterer(ClusterConfig(k=3))
    clusterer.fit(x, len(x))
    distances = ((x[:, None, :] - clusterer.centroids[None, :, :]) ** 2).sum(-1)
    np.testing.assert_array_equal(clusterer.assign(x), distances.argmin(1))


def test_bad_config_and_empty_input_are_errors():
    with pytest.raises(ValueError, match="k must be"):
        ClusterConfig(k=0)
    with pytest.raises(ValueError, match="min_cluster_size"):
        ClusterConfig(min_cluster_size=0)
    with pytest.raises(ValueError, match="zero rows"):
        KMeansClusterer(ClusterConfig()).fit(np.zeros((0, 4), np.float32), 0)
