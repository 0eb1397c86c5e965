"""Task clusters for a job: embed the rendered prompts, cluster them, name the clusters, and
keep the result in the run directory so a resumed run neither embeds nor clusters again.

    <run>/clusters/embeddings/<model>/shard-*.npy   embedding cache, by text hash
    <run>/clusters/rows/part-*.parquet             pass-1 spill: id, text key, preview
    <run>/clusters/assignments.parquet             id, cluster_id, cluster_name (input order)
    <run>/clusters/clusters.json                   the clusters; written last = complete

Two streamed passes, memory bounded by one chunk plus the fitting sample:
1. read (id, text) in chunks: embed through the cache, spill (id, key) to parquet, and
   keep a fixed-size sample of vectors (with a preview of each text for naming);
2. fit k-means on the sample, assign every spilled row (its vector read back from the
   memory-mapped cache), merge small clusters with the full counts, write assignments.

Each pass reports its progress through an optional `on_progress(phase, done, total)`
(batchgen.progress.Progress.phase): "embedding" rows, "clustering" k values tried, "assigning"
rows. At 200,000 rows on 2 CPU cores the embedding pass alone takes about ten minutes.

Rows without a text (a render error, a null or blank prompt) get a null cluster: they never
reach the engine. The assignments keep input order, one row per input row, so the run loop
reads them with a cursor alongside the input instead of holding an id -> cluster map.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from jinja2.exceptions import SecurityError, UndefinedError

from batchgen.job_spec import JobSpec
from batchgen.render import template_columns, template_text
from batchgen.rows import InputRow
from batchgen.run_dir import write_atomic
from batchgen.store_path import StorePath, parquet_file, read_table, run_path
from clustering.cluster import ClusterConfig, KMeansClusterer
from clustering.embed import Embedder
from clustering.embedding_cache import CachedEmbedder
from clustering.naming import name_clusters
from clustering.sample import StreamSample

log = logging.getLogger(__name__)

PREVIEW_CHARS = 300  # of each sampled text, kept for naming and shown as the example
ASSIGNMENT_SCHEMA = pa.schema(
    [("id", pa.string()), ("cluster_id", pa.int32()), ("cluster_name", pa.string())]
)
_ROWS_SCHEMA = pa.schema([("id", pa.string()), ("key", pa.binary(16))])

# on_progress(phase, done, total): see batchgen.progress.PHASE_FIELDS for the phases.
ProgressCallback = Callable[[str, int, int | None], None]


def _no_progress(phase: str, done: int, total: int | None) -> None:
    pass


@dataclass(frozen=True)
class ClusterSettings:
    """What decides the clusters. A stored result made with other settings is rebuilt
    (from the embedding cache, so without embedding again)."""

    k: int | None = None  # None: choose k from the data
    min_cluster_size: int = 64
    max_k: int = 32
    sample_size: int = 50_000
    embedding_model: str = "default"
    seed: int = 0

    def cluster_config(self) -> ClusterConfig:
        return ClusterConfig(
            k=self.k,
            min_cluster_size=self.min_cluster_size,
            max_k=self.max_k,
            sample_size=self.sample_size,
            seed=self.seed,
        )


@dataclass(frozen=True)
class ClusterInfo:
    cluster_id: int
    name: str
    size: int
    terms: list[str]
    example: str


@dataclass
class TaskClusters:
    """The stored result: where the assignments are and what the clusters are."""

    directory: Path
    clusters: list[ClusterInfo]
    rows: int
    unassigned: int  # rows without a text, cluster null
    settings: ClusterSettings
    k_scores: dict[int, float]
    texts_embedded: int  # by the session that built it; 0 when loaded from disk

    @property
    def assignments_path(self) -> Path:
        return self.directory / "assignments.parquet"

    def names(self) -> dict[int, str]:
        return {c.cluster_id: c.name for c in self.clusters}

    def cursor(self) -> AssignmentCursor:
        largest = max(self.clusters, key=lambda c: (c.size, -c.cluster_id), default=None)
        return AssignmentCursor(
            self.assignments_path, self.names(), None if largest is None else largest.cluster_id
        )


class AssignmentCursor:
    """Reads assignments in input order alongside the input rows, so the run loop gets each
    row's cluster with O(1) memory. Rows may be skipped (committed ones on resume), never
    revisited. Has the interface of planner.ClusterLabels: assign(row), names(),
    largest_group()."""

    def __init__(self, path: Path, names: dict[int, str], largest: int | None = None) -> None:
        self.path = path
        self._names = names
        self._largest = largest
        self._batches = parquet_file(path).iter_batches(columns=["id", "cluster_id"])
        self._ids: list = []
        self._clusters: list = []
        self._start = 0  # input position of self._ids[0]
        self._last = -1

    def names(self) -> dict[int, str]:
        return dict(self._names)

    def largest_group(self) -> int | None:
        """The largest cluster (by the stored sizes): the planner feeds it first, while the
        rest of the input is still being read."""
        return self._largest

    def cluster_of(self, seq: int, row_id: str) -> int | None:
        if seq <= self._last:
            raise ValueError(
                f"rows must come in input order; got position {seq} after {self._last}"
            )
        self._last = seq
        while seq >= self._start + len(self._ids):
            self._start += len(self._ids)
            try:
                batch = next(self._batches)
            except StopIteration:
                raise ValueError(
                    f"{self.path} has {self._start} rows, but the input has a row at position "
                    f"{seq} (id {row_id!r}); the input changed since clustering: delete "
                    f"{self.path.parent} to cluster again"
                ) from None
            self._ids = batch.column("id").to_pylist()
            self._clusters = batch.column("cluster_id").to_pylist()
        stored = self._ids[seq - self._start]
        if stored != row_id:
            raise ValueError(
                f"{self.path}: the row at position {seq} has id {stored!r}, but the input has "
                f"{row_id!r}; the input changed since clustering: delete {self.path.parent} "
                "to cluster again"
            )
        return self._clusters[seq - self._start]

    def assign(self, row) -> int | None:
        """The cluster of an InputRow (anything with .seq and .id)."""
        return self.cluster_of(row.seq, row.id)


def _chunks(rows: Iterable[tuple[str, str | None]], size: int) -> Iterator[list]:
    chunk = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def load_task_clusters(directory: str | os.PathLike, settings: ClusterSettings | None = None):
    """The stored result in `directory`, or None if there is none (or it was made with
    other settings, when `settings` is given)."""
    directory = run_path(directory)
    meta_path = directory / "clusters.json"
    if not meta_path.is_file() or not (directory / "assignments.parquet").is_file():
        return None
    meta = json.loads(meta_path.read_text())
    stored = ClusterSettings(**meta["settings"])
    if settings is not None and stored != settings:
        return None
    return TaskClusters(
        directory=directory,
        clusters=[ClusterInfo(**c) for c in meta["clusters"]],
        rows=meta["rows"],
        unassigned=meta["unassigned"],
        settings=stored,
        k_scores={int(k): v for k, v in meta["k_scores"].items()},
        texts_embedded=0,
    )


@dataclass
class _Spilled:
    """What pass 1 leaves: the row parts, the counts, and the fitting sample."""

    parts: list[Path]
    rows: int
    unassigned: int
    sample: StreamSample


def _embed_pass(
    rows: Iterable[tuple[str, str | None]],
    cached: CachedEmbedder,
    rows_dir: Path,
    settings: ClusterSettings,
    chunk_rows: int,
    on_progress: ProgressCallback,
    total_rows: int | None,
) -> _Spilled:
    shutil.rmtree(rows_dir, ignore_errors=True)
    rows_dir.mkdir()
    spilled = _Spilled([], 0, 0, StreamSample(settings.sample_size, settings.seed))
    on_progress("embedding", 0, total_rows)
    for chunk in _chunks(rows, chunk_rows):
        has_text = [text is not None and text.strip() != "" for _, text in chunk]
        texts = [text for (_, text), ok in zip(chunk, has_text) if ok]
        before = spilled.rows + len(chunk) - len(texts)  # rows without a text count as done

        def embedded(done: int, before: int = before) -> None:
            on_progress("embedding", before + done, total_rows)

        keys, vectors = cached.embed_keyed(texts, on_progress=embedded)
        spilled.sample.add(vectors, [t[:PREVIEW_CHARS] for t in texts])
        all_keys: list = [None] * len(chunk)
        for position, key in zip(np.flatnonzero(has_text), keys.tolist()):
            all_keys[position] = key.ljust(16, b"\0")  # numpy drops trailing NUL bytes
        part = rows_dir / f"part-{len(spilled.parts):06d}.parquet"
        ids = [row_id for row_id, _ in chunk]
        pq.write_table(pa.table({"id": ids, "key": all_keys}, schema=_ROWS_SCHEMA), part)
        spilled.parts.append(part)
        spilled.rows += len(chunk)
        spilled.unassigned += len(chunk) - len(texts)
        if len(spilled.parts) % 25 == 0:
            log.info("clustering: %d rows embedded or found in the cache", spilled.rows)
    return spilled


def _assign_pass(
    spilled: _Spilled,
    cached: CachedEmbedder,
    clusterer: KMeansClusterer,
    on_progress: ProgressCallback,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Raw k-means labels per part (-1 for rows without a text), and the count per label."""
    assert clusterer.centroids is not None
    raw_labels = []
    counts = np.zeros(len(clusterer.centroids), dtype=np.int64)
    assigned = 0
    on_progress("assigning", 0, spilled.rows)
    for part in spilled.parts:
        keys = pq.read_table(part, columns=["key"]).column("key")
        valid = np.asarray(keys.is_valid())
        labels = np.full(len(keys), -1, dtype=np.int32)
        if valid.any():
            present = np.array(keys.filter(keys.is_valid()).to_pylist(), dtype="S16")
            labels[valid] = clusterer.assign(cached.cache.get(present))
            counts += np.bincount(labels[valid], minlength=len(counts))
        raw_labels.append(labels)
        assigned += len(labels)
        on_progress("assigning", assigned, spilled.rows)
    return raw_labels, counts


def _write_assignments(
    path: Path, parts: list[Path], labels_per_part: list[np.ndarray], names: list[str]
) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with pq.ParquetWriter(tmp, ASSIGNMENT_SCHEMA) as writer:
        for part, labels in zip(parts, labels_per_part):
            ids = pq.read_table(part, columns=["id"]).column("id")
            cluster_ids = pa.array(labels, type=pa.int32(), mask=labels < 0)
            cluster_names = [names[c] if c >= 0 else None for c in labels.tolist()]
            table = {"id": ids, "cluster_id": cluster_ids, "cluster_name": cluster_names}
            writer.write_table(pa.table(table, schema=ASSIGNMENT_SCHEMA))
    os.replace(tmp, path)


def build_task_clusters(
    rows: Iterable[tuple[str, str | None]],
    directory: str | os.PathLike,
    settings: ClusterSettings = ClusterSettings(),
    embedder: Embedder | None = None,
    chunk_rows: int = 4096,
    on_progress: ProgressCallback | None = None,
    total_rows: int | None = None,
) -> TaskClusters:
    """Reuse the stored clusters in `directory` if they were made with these settings;
    otherwise embed (through the cache), cluster, name and store them.

    `rows` yields (id, text) in input order, text None for a row that cannot run. It is
    consumed once, and only when there is no stored result. `total_rows` (how many it
    will yield) gives the embedding progress its total and ETA."""
    directory = Path(directory)
    stored = load_task_clusters(directory, settings)
    if stored is not None:
        log.info("task clusters: reloaded %d clusters from %s", len(stored.clusters), directory)
        return stored
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "clusters.json").unlink(missing_ok=True)
    if embedder is None:
        embedder = Embedder(settings.embedding_model)
    cached = CachedEmbedder(embedder, directory / "embeddings")
    embedded_before = embedder.texts_embedded
    report = on_progress or _no_progress

    spilled = _embed_pass(
        rows, cached, directory / "rows", settings, chunk_rows, report, total_rows
    )
    clusters: list[ClusterInfo] = []
    k_scores: dict[int, float] = {}
    if spilled.sample.rows_seen == 0:
        # Nothing to cluster (every row failed to render): every row is unassigned.
        final = [np.full(pq.read_metadata(p).num_rows, -1, np.int32) for p in spilled.parts]
        names: list[str] = []
    else:
        clusterer = KMeansClusterer(settings.cluster_config())
        sample_vectors, sample_texts = spilled.sample.result()
        report("clustering", 0, None)

        def k_tried(tried: int, candidates: int) -> None:
            report("clustering", tried, candidates)

        clusterer.fit(sample_vectors, spilled.sample.rows_seen, on_progress=k_tried)
        raw_labels, counts = _assign_pass(spilled, cached, clusterer, report)
        clustering = clusterer.finalize(counts)
        k_scores = clustering.k_scores
        sample_labels = clustering.raw_to_final[clusterer.assign(sample_vectors)]
        named = name_clusters(sample_texts, sample_vectors, sample_labels, clustering.centroids)
        names = [n.name for n in named]
        clusters = [
            ClusterInfo(
                n.cluster_id, n.name, int(clustering.sizes[n.cluster_id]), list(n.terms), n.example
            )
            for n in named
        ]
        to_final = clustering.raw_to_final
        final = [np.where(raw >= 0, to_final[np.maximum(raw, 0)], -1) for raw in raw_labels]
    _write_assignments(directory / "assignments.parquet", spilled.parts, final, names)
    shutil.rmtree(directory / "rows", ignore_errors=True)

    result = TaskClusters(
        directory=directory,
        clusters=clusters,
        rows=spilled.rows,
        unassigned=spilled.unassigned,
        settings=settings,
        k_scores=k_scores,
        texts_embedded=embedder.texts_embedded - embedded_before,
    )
    meta = {
        "settings": asdict(settings),
        "embedding_model": embedder.fingerprint,
        "rows": result.rows,
        "unassigned": result.unassigned,
        "k_scores": {str(k): v for k, v in k_scores.items()},
        "clusters": [asdict(c) for c in clusters],
    }
    # Written last: its presence is what makes the result complete.
    write_atomic(directory / "clusters.json", json.dumps(meta, indent=2, ensure_ascii=False))
    log.info(
        "task clusters: embedded %d texts (%d found in the cache), %d clusters -> %s",
        result.texts_embedded,
        cached.hits,
        len(clusters),
        directory,
    )
    return result


def label_clusters(
    rows: Callable[[], Iterable[tuple[str, str | None]]], directory: str | os.PathLike
) -> TaskClusters:
    """Clusters from a task column, no embedding: one cluster per label, ids by size
    (largest first), named by the label. `rows()` gives a fresh iterator of (id, label);
    it is read twice (count, then write), holding only the label counts in memory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    counts: Counter[str] = Counter()
    total = 0
    for _, label in rows():
        total += 1
        if label is not None:
            counts[str(label)] += 1
    order = sorted(counts, key=lambda label: (-counts[label], label))
    cluster_of = {label: i for i, label in enumerate(order)}
    tmp = directory / "assignments.parquet.tmp"
    with pq.ParquetWriter(tmp, ASSIGNMENT_SCHEMA) as writer:
        for chunk in _chunks(rows(), 65536):
            labels = [None if label is None else str(label) for _, label in chunk]
            writer.write_table(
                pa.table(
                    {
                        "id": [row_id for row_id, _ in chunk],
                        "cluster_id": [cluster_of.get(label) for label in labels],
                        "cluster_name": labels,
                    },
                    schema=ASSIGNMENT_SCHEMA,
                )
            )
    os.replace(tmp, directory / "assignments.parquet")
    clusters = [ClusterInfo(i, label, counts[label], [label], "") for i, label in enumerate(order)]
    return TaskClusters(
        directory=directory,
        clusters=clusters,
        rows=total,
        unassigned=total - sum(counts.values()),
        settings=ClusterSettings(),
        k_scores={},
        texts_embedded=0,
    )


DEFAULT_MIN_CLUSTER_SIZE = 64  # the engine's default max_num_seqs: one full batch


def settings_for_job(job: JobSpec) -> ClusterSettings:
    """A cluster must be able to fill a running batch on its own, so the smallest allowed
    cluster is the job's max_num_seqs."""
    return ClusterSettings(
        k=job.batching.num_clusters,
        min_cluster_size=job.batching.max_num_seqs or DEFAULT_MIN_CLUSTER_SIZE,
        embedding_model=job.batching.embedding_model,
    )


def prompt_texts(job: JobSpec, rows: Iterable[InputRow]) -> Iterator[tuple[str, str | None]]:
    """(id, the job template rendered over the row) in input order; None for a row that
    cannot be rendered (it becomes an error row in the run and joins no cluster)."""
    if job.prompt is None or job.prompt.template is None:
        from batchgen.row_preparer import chat_row_text

        for row in rows:
            yield row.id, chat_row_text(job, row)
        return
    render = template_text(job.prompt.template)
    columns = sorted(template_columns(job.prompt.template))
    for row in rows:
        if any(row.values.get(c) is None for c in columns):
            yield row.id, None
            continue
        try:
            yield row.id, render(row.values)
        except (UndefinedError, SecurityError, TypeError, ValueError):
            yield row.id, None


# Texts embedded to time the embedding model for `validate`: one of its batches, after a
# short untimed warm-up (the first call pays one-off costs a long run does not).
ESTIMATE_ROWS = 128
_WARMUP_ROWS = 8


@dataclass(frozen=True)
class EmbeddingEstimate:
    """How long a run's embedding pass will take: the model's load time plus every row to
    embed at the rate measured on the job's first rows."""

    rows: int  # rows the run will embed (0: stored clusters are reused)
    rows_s: float | None  # measured rate; None when nothing was measured
    load_s: float

    @property
    def seconds(self) -> float:
        if self.rows == 0 or not self.rows_s:
            return 0.0
        return self.load_s + self.rows / self.rows_s


def estimate_embedding(
    job: JobSpec,
    rows: Iterable[InputRow],
    total_rows: int,
    directory: str | os.PathLike,
    embedder: Embedder | None = None,
) -> EmbeddingEstimate:
    """Time the embedding model on the first rows of a `cluster: auto` job. A run whose
    clusters are stored in `directory` with the same settings embeds nothing."""
    settings = settings_for_job(job)
    if load_task_clusters(directory, settings) is not None:
        return EmbeddingEstimate(0, None, 0.0)
    texts = []
    for _, text in prompt_texts(job, rows):
        if text is not None and text.strip():
            texts.append(text)
        if len(texts) >= _WARMUP_ROWS + ESTIMATE_ROWS:
            break
    if not texts:
        return EmbeddingEstimate(0, None, 0.0)
    started = time.perf_counter()
    embedder = embedder or Embedder(settings.embedding_model)
    warmup, timed = texts[:_WARMUP_ROWS], texts[_WARMUP_ROWS:] or texts
    embedder.embed(warmup)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    embedder.embed(timed)
    rate = len(timed) / max(time.perf_counter() - started, 1e-6)
    return EmbeddingEstimate(total_rows, rate, load_s)


def cluster_job(
    job: JobSpec,
    rows: Iterable[InputRow],
    directory: str | os.PathLike,
    on_progress: ProgressCallback | None = None,
    total_rows: int | None = None,
) -> TaskClusters:
    """The task clusters of a `cluster: auto` job, built or reloaded from `directory`."""
    if isinstance(directory, StorePath):
        return _cluster_on_store(job, rows, directory, on_progress, total_rows)
    return build_task_clusters(
        prompt_texts(job, rows),
        directory,
        settings_for_job(job),
        on_progress=on_progress,
        total_rows=total_rows,
    )


# What a stored result is made of, the marker of a finished one last.
_PUBLISHED = ("assignments.parquet", "clusters.json")


def _cluster_on_store(
    job: JobSpec,
    rows: Iterable[InputRow],
    directory: StorePath,
    on_progress: ProgressCallback | None,
    total_rows: int | None,
) -> TaskClusters:
    """Clusters for a run directory on object storage: built in a local scratch
    directory (the embedding cache and the spilled rows are memory-mapped files), then
    published there, assignments first and clusters.json, which marks it finished, last.
    A resume fetches the published result and reloads it without embedding; the
    embedding cache is not kept, so clustering again with other settings embeds again."""
    with tempfile.TemporaryDirectory(prefix="batchgen-clusters-") as scratch:
        local = Path(scratch)
        published = all((directory / name).is_file() for name in _PUBLISHED)
        if published:
            for name in _PUBLISHED:
                (directory / name).download(local / name)
        before = (local / "clusters.json").read_bytes() if published else None
        built = build_task_clusters(
            prompt_texts(job, rows),
            local,
            settings_for_job(job),
            on_progress=on_progress,
            total_rows=total_rows,
        )
        if (local / "clusters.json").read_bytes() != before:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "clusters.json").unlink(missing_ok=True)
            for name in _PUBLISHED:
                (directory / name).upload(local / name)
    return dataclasses.replace(built, directory=directory)


def cluster_section(
    clusters_dir: str | os.PathLike,
    parts: Iterable[tuple[Path, float | None]],
    names: dict[int, str] | None = None,
) -> list[dict]:
    """The run report's per-cluster table: planned size (when clustering ran), rows done,
    prompt and output tokens, and output tok/s.

    `parts` are the live result parts with the seconds each took (None when unknown). A
    part's seconds are shared among its clusters by their output tokens: with rows fed
    cluster by cluster, almost every part holds a single cluster, so the split is exact
    there and only the parts at a cluster boundary are apportioned."""
    stored = load_task_clusters(clusters_dir)
    sizes = {c.cluster_id: c.size for c in stored.clusters} if stored else {}
    names = {**(stored.names() if stored else {}), **(names or {})}
    table: dict = {}

    def entry(cluster):
        return table.setdefault(
            cluster, {"rows": 0, "prompt_tokens": 0, "completion_tokens": 0, "seconds": 0.0}
        )

    for path, seconds in parts:
        columns = ["cluster_id", "n_index", "prompt_tokens", "completion_tokens"]
        frame = read_table(path, columns=columns).to_pydict()
        part_tokens: Counter = Counter()
        for cluster, n_index, prompt, completion in zip(*(frame[c] for c in columns)):
            row = entry(cluster)
            if n_index == 0:
                row["rows"] += 1
                row["prompt_tokens"] += prompt or 0
            row["completion_tokens"] += completion or 0
            part_tokens[cluster] += completion or 0
        total = sum(part_tokens.values())
        if seconds and total:
            for cluster, tokens in part_tokens.items():
                entry(cluster)["seconds"] += seconds * tokens / total
    out = []
    keys = sorted(set(table) | set(sizes), key=lambda c: (c is None, c if c is not None else 0))
    for cluster in keys:
        row = table.get(
            cluster, {"rows": 0, "prompt_tokens": 0, "completion_tokens": 0, "seconds": 0.0}
        )
        seconds = row["seconds"]
        out.append(
            {
                "cluster_id": cluster,
                "name": names.get(cluster, "(no cluster)" if cluster is None else "-"),
                "size": sizes.get(cluster),
                "rows": row["rows"],
                "prompt_tokens": row["prompt_tokens"],
                "completion_tokens": row["completion_tokens"],
                "output_tok_s": round(row["completion_tokens"] / seconds, 2) if seconds else None,
            }
        )
    return out
