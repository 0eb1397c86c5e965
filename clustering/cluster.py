"""k-means clustering of prompt embeddings, built to stream.

The flow for any input size:

    fit(sample, n_total)      choose k (fixed or `auto`) and fit k-means on a sample
    assign(chunk) ...         nearest centroid, chunk by chunk (bounded memory)
    finalize(counts)          merge clusters too small to fill a batch into their nearest
                              neighbour, renumber by size (cluster 0 is the largest)

`cluster_vectors` runs the same three steps on an in-memory array.

`auto` picks k by the silhouette score on a sample, over k = 2 .. min(max_k, n_total //
min_cluster_size): a cluster smaller than a batch cannot keep the engine's batch
homogeneous, so k never goes beyond what the data can fill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from clustering.sample import StreamSample

if TYPE_CHECKING:
    from sklearn.cluster import KMeans, MiniBatchKMeans

# scikit-learn (and threadpoolctl with it) is imported where k-means runs, not with this
# module: it takes over a second, and a run that only reads stored clusters never fits.


@dataclass(frozen=True)
class ClusterConfig:
    """How to cluster. `k=None` means auto."""

    k: int | None = None
    min_cluster_size: int = 64
    max_k: int = 32
    sample_size: int = 50_000
    # k is chosen on at most this many rows of the sample (silhouette is O(n^2)), and the
    # search stops once `k_patience` values of k in a row have not beaten the best score.
    k_search_rows: int = 4_000
    k_patience: int = 8
    seed: int = 0
    # BLAS/OpenMP threads for fitting. One by default: on a small shared machine, k-means
    # with an OpenMP team of spinning threads runs ~30x slower than single-threaded.
    threads: int | None = 1

    def __post_init__(self) -> None:
        if self.k is not None and self.k < 1:
            raise ValueError(f"k must be at least 1, got {self.k}")
        if self.min_cluster_size < 1:
            raise ValueError(f"min_cluster_size must be at least 1, got {self.min_cluster_size}")
        if self.max_k < 1:
            raise ValueError(f"max_k must be at least 1, got {self.max_k}")


@dataclass
class Clustering:
    """The final clusters. `raw_to_final` maps a k-means label to its (merged) cluster id."""

    centroids: np.ndarray  # (C, D) float32, final clusters, largest first
    sizes: np.ndarray  # (C,) int64
    raw_to_final: np.ndarray  # (k,) int32
    k_scores: dict[int, float] = field(default_factory=dict)  # silhouette by k when auto

    @property
    def num_clusters(self) -> int:
        return len(self.sizes)


def _nearest(vectors: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Index of the nearest centroid (Euclidean) for each row. N = rows, K = centroids."""
    # |x - c|^2 = |x|^2 - 2 x.c + |c|^2; |x|^2 is the same for every c, so drop it.
    scores = vectors @ centroids.T  # (N, K)
    scores *= -2.0
    scores += np.einsum("kd,kd->k", centroids, centroids)[None, :]
    return np.argmin(scores, axis=1).astype(np.int32)


# Up to this many rows, full-batch k-means is affordable and clearly better: on the
# mixed-task set at k=8, KMeans finds the eight tasks (ARI 0.99) where MiniBatchKMeans
# splits one and merges two (ARI 0.80). Beyond it, mini-batches keep the fit time flat.
FULL_BATCH_ROWS = 20_000


def _kmeans(vectors: np.ndarray, k: int, seed: int) -> KMeans | MiniBatchKMeans:
    from sklearn.cluster import KMeans, MiniBatchKMeans

    if len(vectors) <= FULL_BATCH_ROWS:
        return KMeans(n_clusters=k, random_state=seed, n_init=10).fit(vectors)
    return MiniBatchKMeans(
        n_clusters=k, random_state=seed, n_init=3, batch_size=4096, max_no_improvement=20
    ).fit(vectors)


def choose_k(
    sample: np.ndarray,
    n_total: int,
    config: ClusterConfig,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[int, dict[int, float]]:
    """The k with the best silhouette on the sample, and the score of every k tried.
    `on_progress(tried, candidates)` is called before each k and once at the end."""
    from sklearn.metrics import silhouette_score
    from threadpoolctl import threadpool_limits

    upper = min(config.max_k, n_total // config.min_cluster_size, len(sample) - 1)
    if upper < 2:
        return 1, {}
    candidates = upper - 1  # k = 2 .. upper
    rng = np.random.default_rng(config.seed)
    search = sample
    if len(search) > config.k_search_rows:
        search = search[np.sort(rng.choice(len(search), config.k_search_rows, replace=False))]
    scores: dict[int, float] = {}
    best_k = None
    with threadpool_limits(limits=config.threads):
        for k in range(2, upper + 1):
            if on_progress is not None:
                on_progress(k - 2, candidates)
            labels = _kmeans(search, k, config.seed).labels_
            if len(np.unique(labels)) < 2:
                continue
            scores[k] = float(silhouette_score(search, labels))
            if best_k is None or scores[k] > scores[best_k]:
                best_k = k
            elif k - best_k >= config.k_patience:
                break
    if on_progress is not None:
        on_progress(k - 1, candidates)
    if not scores:
        return 1, {}
    return max(scores, key=lambda k: (scores[k], -k)), scores


def merge_small(
    centroids: np.ndarray, sizes: np.ndarray, min_cluster_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge every cluster smaller than min_cluster_size into its nearest neighbour.

    Returns (centroids, sizes, old_to_new) with clusters renumbered largest first. The
    smallest cluster goes first, into the centroid nearest it (cosine); the merged centroid
    is the size-weighted mean, so it stays the mean of its members. Empty clusters vanish.
    """
    alive = [i for i in range(len(sizes)) if sizes[i] > 0]
    cents = {i: centroids[i].astype(np.float64) for i in alive}
    count = {i: int(sizes[i]) for i in alive}
    parent = np.arange(len(sizes))
    while len(alive) > 1:
        smallest = min(alive, key=lambda i: (count[i], i))
        if count[smallest] >= min_cluster_size:
            break
        others = [i for i in alive if i != smallest]
        c = cents[smallest] / (np.linalg.norm(cents[smallest]) or 1.0)
        sims = [float(c @ cents[o]) / (np.linalg.norm(cents[o]) or 1.0) for o in others]
        target = others[int(np.argmax(sims))]
        total = count[target] + count[smallest]
        cents[target] = (cents[target] * count[target] + cents[smallest] * count[smallest]) / total
        count[target] = total
        parent[parent == smallest] = target
        alive.remove(smallest)
    order = sorted(alive, key=lambda i: (-count[i], i))
    new_id = {old: new for new, old in enumerate(order)}
    old_to_new = np.array([new_id.get(int(parent[i]), -1) for i in range(len(sizes))], np.int32)
    # An empty raw cluster that was never merged has no home; send it to cluster 0 so any
    # label still maps somewhere valid (no row carries it: its count was zero).
    old_to_new[old_to_new < 0] = 0
    new_centroids = np.stack([cents[i] for i in order]).astype(np.float32)
    new_sizes = np.array([count[i] for i in order], dtype=np.int64)
    return new_centroids, new_sizes, old_to_new


class KMeansClusterer:
    """fit on a sample, assign chunks, finalize with the full counts (see module doc)."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.centroids: np.ndarray | None = None  # (k, D) raw k-means centroids
        self.k_scores: dict[int, float] = {}

    def fit(
        self,
        sample: np.ndarray,
        n_total: int,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Choose k (when auto) and fit; `on_progress` as in choose_k."""
        from threadpoolctl import threadpool_limits

        if len(sample) == 0:
            raise ValueError("cannot cluster zero rows")
        sample = np.asarray(sample, dtype=np.float32)
        with threadpool_limits(limits=self.config.threads):
            if self.config.k is None:
                k, self.k_scores = choose_k(sample, n_total, self.config, on_progress)
            else:
                k = min(self.config.k, len(sample))
            if k == 1:
                self.centroids = sample.mean(axis=0, keepdims=True)
            else:
                model = _kmeans(sample, k, self.config.seed)
                self.centroids = model.cluster_centers_.astype(np.float32)

    def assign(self, vectors: np.ndarray) -> np.ndarray:
        """Raw k-means label for each row; feed the counts of all rows to finalize()."""
        if self.centroids is None:
            raise RuntimeError("fit() the clusterer before assign()")
        return _nearest(np.asarray(vectors, dtype=np.float32), self.centroids)

    def finalize(self, raw_counts: np.ndarray) -> Clustering:
        assert self.centroids is not None
        centroids, sizes, raw_to_final = merge_small(
            self.centroids, raw_counts, self.config.min_cluster_size
        )
        return Clustering(centroids, sizes, raw_to_final, dict(self.k_scores))


def cluster_vectors(vectors: np.ndarray, config: ClusterConfig) -> tuple[np.ndarray, Clustering]:
    """In-memory clustering: (final label per row, Clustering). Same result as streaming
    the rows through StreamSample + KMeansClusterer in chunks of any size."""
    sample = StreamSample(config.sample_size, config.seed)
    sample.add(vectors)
    clusterer = KMeansClusterer(config)
    clusterer.fit(sample.result()[0], len(vectors))
    raw = clusterer.assign(vectors)
    clustering = clusterer.finalize(np.bincount(raw, minlength=len(clusterer.centroids)))
    return clustering.raw_to_final[raw], clustering
