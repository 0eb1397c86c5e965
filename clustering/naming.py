"""Names a person can read for clusters of prompts.

A cluster's name is its most distinguishing terms by class-based TF-IDF: all prompts of a
cluster are treated as one document, a term's weight is its frequency in that cluster
times log(1 + A / f), where A is the average number of words per cluster and f the
term's frequency over all clusters. A term frequent in one cluster and rare elsewhere
("french", "sql", "poem") wins over one frequent everywhere ("please", "following").
Each cluster also gets its representative: the prompt nearest its centroid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Words of prompt boilerplate that say nothing about the task.
_PROMPT_STOP_WORDS = frozenset(
    {"please", "following", "text", "give", "need", "want", "like", "just", "answer", "help"}
)


@dataclass(frozen=True)
class ClusterName:
    cluster_id: int
    name: str
    terms: tuple[str, ...]
    example: str


def class_tfidf(
    texts: Sequence[str], labels: np.ndarray, num_clusters: int
) -> tuple[np.ndarray, list[str]]:
    """(scores (num_clusters, V), vocabulary) of class-based TF-IDF."""
    # Imported here: scikit-learn takes over a second to import, and only naming needs it.
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS, CountVectorizer

    vectorizer = CountVectorizer(
        stop_words=sorted(ENGLISH_STOP_WORDS | _PROMPT_STOP_WORDS),
        token_pattern=r"(?u)\b[^\W\d_][^\W\d_]+\b",  # words of 2+ letters, no digits
        lowercase=True,
    )
    counts = vectorizer.fit_transform(texts)  # (N, V) sparse
    vocabulary = vectorizer.get_feature_names_out().tolist()
    # Sum the rows of each cluster: a (C, N) one-hot matrix times the counts.
    one_hot = np.zeros((num_clusters, len(texts)), dtype=np.float64)
    one_hot[labels, np.arange(len(texts))] = 1.0
    per_class = np.asarray((counts.T @ one_hot.T).T)  # (C, V)
    words_per_class = per_class.sum(axis=1, keepdims=True)  # (C, 1)
    tf = per_class / np.maximum(words_per_class, 1.0)
    term_total = per_class.sum(axis=0)  # (V,)
    average_words = words_per_class.mean()
    idf = np.log1p(average_words / np.maximum(term_total, 1.0))  # (V,)
    return tf * idf, vocabulary


def top_terms(
    texts: Sequence[str], labels: np.ndarray, num_clusters: int, n_terms: int = 3
) -> list[tuple[str, ...]]:
    """The n_terms most distinguishing terms of each cluster (empty for a cluster that has
    no words among the texts)."""
    if len(texts) == 0:
        return [() for _ in range(num_clusters)]
    try:
        scores, vocabulary = class_tfidf(texts, labels, num_clusters)
    except ValueError:  # every text is stop words or empty: the vocabulary is empty
        return [() for _ in range(num_clusters)]
    result = []
    for row in scores:
        best = np.argsort(-row, kind="stable")[:n_terms]
        result.append(tuple(vocabulary[i] for i in best if row[i] > 0))
    return result


def nearest_to_centroids(vectors: np.ndarray, labels: np.ndarray, centroids: np.ndarray) -> list:
    """For each cluster, the index of its member nearest its centroid (None if no member)."""
    # Vectors are L2-normalized, so the highest dot product is the nearest in cosine.
    similarity = np.einsum("nd,nd->n", vectors, centroids[labels])  # (N,)
    best: list = [None] * len(centroids)
    for index in np.argsort(-similarity, kind="stable"):
        cluster = labels[index]
        if best[cluster] is None:
            best[cluster] = int(index)
    return best


def name_clusters(
    texts: Sequence[str],
    vectors: np.ndarray,
    labels: np.ndarray,
    centroids: np.ndarray,
    n_terms: int = 3,
) -> list[ClusterName]:
    """Names for clusters 0..C-1 from member prompts (all of them or a sample)."""
    labels = np.asarray(labels)
    terms = top_terms(texts, labels, len(centroids), n_terms)
    nearest = nearest_to_centroids(vectors, labels, centroids)
    names = []
    for cluster_id in range(len(centroids)):
        words = terms[cluster_id]
        name = " / ".join(words) if words else f"cluster {cluster_id}"
        example = texts[nearest[cluster_id]] if nearest[cluster_id] is not None else ""
        names.append(ClusterName(cluster_id, name, words, example))
    return names
