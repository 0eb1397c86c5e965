from __future__ import annotations

import numpy as np

from clustering.cluster import ClusterConfig, cluster_vectors
from clustering.naming import class_tfidf, name_clusters, top_terms

# A word each task's cluster name should contain: what a person would call the task.
EXPECTED_TERMS = {
    "translate_fr": {"french", "translate", "translation"},
    "summarize": {"summary", "summarize", "summarise", "points"},
    "write_sql": {"sql", "query", "table", "select"},
    "sentiment": {"sentiment", "positive", "negative", "review"},
    "extract_entities_json": {"json", "entities", "entity", "named"},
    "write_poem": {"poem", "haiku", "poetry", "sonnet"},
    "math_word_problem": {"solve", "math", "problem", "calculate", "answer"},
    "fix_grammar": {"grammar", "correct", "fix", "proofread"},
}


def test_names_of_the_mixed_task_clusters_say_the_task(mixed_frame, mixed_vectors):
    texts = mixed_frame["prompt"].to_list()
    labels, clustering = cluster_vectors(mixed_vectors, ClusterConfig(min_cluster_size=32))
    names = name_clusters(texts, mixed_vectors, labels, clustering.centroids)
    tasks = np.array(mixed_frame["task"].to_list())
    named_right = 0
    for name in names:
        members = tasks[labels == name.cluster_id]
        majority = max(set(members), key=list(members).count)
        if set(name.terms) & EXPECTED_TERMS[majority]:
            named_right += 1
        # The example is a member prompt of that cluster.
        assert name.example in {t for t, lab in zip(texts, labels) if lab == name.cluster_id}
        assert name.name == " / ".join(name.terms)
    assert named_right == len(names)


def test_class_tfidf_prefers_terms_unique_to_a_cluster():
    texts = [
        "please translate this sentence",
        "please translate that letter",
        "please write a poem",
        "please write a haiku poem",
    ]
    labels = np.array([0, 0, 1, 1])
    scores, vocabulary = class_tfidf(texts, labels, 2)
    assert "please" not in vocabulary  # prompt boilerplate is a stop word
    assert top_terms(texts, labels, 2, n_terms=1) == [("translate",), ("poem",)]
    assert scores.shape == (2, len(vocabulary))


def test_nearest_prompt_and_empty_vocabulary():
    vectors = np.array([[1, 0], [0.8, 0.6], [0, 1]], np.float32)
    labels = np.array([0, 0, 1])
    centroids = np.array([[1, 0], [0, 1]], np.float32)
    names = name_clusters(["the", "a", "an"], vectors, labels, centroids)
    assert [n.example for n in names] == ["the", "an"]
    assert [n.name for n in names] == ["cluster 0", "cluster 1"]  # only stop words
