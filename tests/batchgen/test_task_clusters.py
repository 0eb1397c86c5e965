"""batchgen.task_clusters at the library level: stored results, resume after kill -9 in
the middle of embedding, the assignment cursor, and task-column clusters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import polars as pl
import pytest

from batchgen.task_clusters import (
    ClusterSettings,
    build_task_clusters,
    label_clusters,
    load_task_clusters,
)
from tests.clustering.conftest import HashEmbedder

SETTINGS = ClusterSettings(min_cluster_size=5, max_k=6)


def _rows(count: int) -> list[tuple[str, str | None]]:
    topics = ["translate to French", "write a SQL query for", "summarize the memo on"]
    return [(f"id{i:04d}", f"{topics[i % 3]} item {i}") for i in range(count)]


def test_stored_result_is_reloaded_and_other_settings_rebuild_from_the_cache(tmp_path):
    rows = _rows(60)
    embedder = HashEmbedder()
    built = build_task_clusters(iter(rows), tmp_path, SETTINGS, embedder=embedder, chunk_rows=16)
    assert built.texts_embedded == 60 and built.rows == 60
    assert sum(c.size for c in built.clusters) == 60

    def untouchable():
        raise AssertionError("a stored result must not read the rows again")
        yield

    again = build_task_clusters(untouchable(), tmp_path, SETTINGS, embedder=HashEmbedder())
    assert again.texts_embedded == 0 and again.clusters == built.clusters

    other = HashEmbedder()
    changed = ClusterSettings(k=2, min_cluster_size=5)
    rebuilt = build_task_clusters(iter(rows), tmp_path, changed, embedder=other)
    assert other.texts_embedded == 0  # new clusters, same embeddings
    assert len(rebuilt.clusters) == 2
    assert load_task_clusters(tmp_path, SETTINGS) is None  # replaced by the new settings


def test_rows_without_text_are_kept_in_order_with_no_cluster(tmp_path):
    rows = _rows(30)
    rows[4] = ("id0004", None)
    rows[7] = ("id0007", "   ")
    result = build_task_clusters(iter(rows), tmp_path, SETTINGS, embedder=HashEmbedder())
    frame = pl.read_parquet(result.assignments_path)
    assert frame["id"].to_list() == [r[0] for r in rows]
    assert frame["cluster_id"].null_count() == 2 == result.unassigned
    assert frame.filter(pl.col("id") == "id0004")["cluster_name"].to_list() == [None]


def test_nothing_to_cluster_leaves_every_row_unassigned(tmp_path):
    rows = [("a", None), ("b", "")]
    result = build_task_clusters(iter(rows), tmp_path, SETTINGS, embedder=HashEmbedder())
    assert result.clusters == [] and result.unassigned == 2
    assert pl.read_parquet(result.assignments_path)["cluster_id"].null_count() == 2


_KILLED_RUN = textwrap.dedent(
    """
    import os, signal, sys
    from batchgen.task_clusters import build_task_clusters, ClusterSettings
    from tests.clustering.conftest import HashEmbedder
    from tests.batchgen.test_task_clusters import _rows

    embedder = HashEmbedder()
    original = embedder.embed

    def embed_then_die(texts):
        out = original(texts)
        if len(embedder.calls) == 4:  # die for real while the 4th chunk is in flight
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    embedder.embed = embed_then_die
    build_task_clusters(iter(_rows(100)), sys.argv[1], ClusterSettings(min_cluster_size=5),
                        embedder=embedder, chunk_rows=16)
    """
)


def test_resume_after_kill_9_reuses_stored_embeddings(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_RUN, str(tmp_path)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not (tmp_path / "clusters.json").exists()
    # Three chunks of 16 were committed to the cache before the kill; only the rest is
    # embedded on resume, and a third run embeds nothing at all.
    resumed = HashEmbedder()
    settings = ClusterSettings(min_cluster_size=5)
    result = build_task_clusters(
        iter(_rows(100)), tmp_path, settings, embedder=resumed, chunk_rows=16
    )
    assert resumed.texts_embedded == 100 - 3 * 16
    assert result.rows == 100
    third = HashEmbedder()
    again = build_task_clusters(iter(_rows(100)), tmp_path, settings, embedder=third)
    assert third.texts_embedded == 0 and again.clusters == result.clusters


def test_cursor_follows_input_order_and_names_a_changed_input(tmp_path):
    rows = _rows(40)
    result = build_task_clusters(iter(rows), tmp_path, SETTINGS, embedder=HashEmbedder())
    frame = pl.read_parquet(result.assignments_path)
    cursor = result.cursor()
    # Skipping rows (committed ones on resume) is fine.
    for seq in (0, 3, 17, 39):
        assert cursor.cluster_of(seq, rows[seq][0]) == frame["cluster_id"][seq]
    with pytest.raises(ValueError, match="input order"):
        cursor.cluster_of(5, rows[5][0])
    with pytest.raises(ValueError, match="has id 'id0002'.*'other'"):
        result.cursor().cluster_of(2, "other")
    with pytest.raises(ValueError, match="has 40 rows"):
        result.cursor().cluster_of(40, "id0040")
    assert result.cursor().names() == {c.cluster_id: c.name for c in result.clusters}


def test_label_clusters_from_a_task_column(tmp_path):
    labels = ["sql", "poem", "sql", None, "sql", "poem", "french"]
    rows = [(f"r{i}", label) for i, label in enumerate(labels)]
    result = label_clusters(lambda: iter(rows), tmp_path)
    assert [(c.cluster_id, c.name, c.size) for c in result.clusters] == [
        (0, "sql", 3),
        (1, "poem", 2),
        (2, "french", 1),
    ]
    frame = pl.read_parquet(result.assignments_path)
    assert frame["cluster_id"].to_list() == [0, 1, 0, None, 0, 1, 2]
    assert result.unassigned == 1


def test_cluster_section_shares_a_parts_time_by_output_tokens(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchgen.task_clusters import cluster_section

    def part(name, clusters, completion):
        path = tmp_path / name
        table = {
            "cluster_id": pa.array(clusters, pa.int32()),
            "n_index": [0] * len(clusters),
            "prompt_tokens": [10] * len(clusters),
            "completion_tokens": completion,
        }
        pq.write_table(pa.table(table), path)
        return path

    parts = [
        (part("a.parquet", [0, 0], [50, 50]), 10.0),  # cluster 0 alone: 100 tokens in 10 s
        (part("b.parquet", [0, 1, None], [30, 90, 0]), 4.0),  # 1 s to cluster 0, 3 s to 1
    ]
    table = cluster_section(tmp_path / "no-clusters", parts, {0: "sql", 1: "poem"})
    assert [(c["cluster_id"], c["name"], c["rows"]) for c in table] == [
        (0, "sql", 3),
        (1, "poem", 1),
        (None, "(no cluster)", 1),
    ]
    assert table[0]["output_tok_s"] == round(130 / 11, 2)
    assert table[1]["output_tok_s"] == 30.0
    assert table[0]["prompt_tokens"] == 30 and table[0]["size"] is None
