"""The engine a job asks for: its model section and batching limits as engine options.
`run` (the job's engine and every rebuild of it) and `job_context` (a model whose config
leaves the context length to its family's default) both build it here."""

from __future__ import annotations

from batchgen.job_spec import JobSpec


def load_llm(job: JobSpec, max_num_seqs: int | None = None, expected_seq_len: int | None = None):
    """The engine for a job (imported here: engine loading pulls in torch models).
    `max_num_seqs` overrides the job's (an engine rebuilt after running out of memory);
    with neither, the engine picks it ("auto") for sequences of `expected_seq_len` tokens
    (batchgen/job_lengths.py; None: the model's context)."""
    from engine import LLM

    kwargs = {
        "model": job.model.path,
        "device": job.model.device,
        "dtype": job.model.dtype,
        "kv_cache_memory": job.model.kv_cache_memory,
        "seed": job.sampling.seed,
        "expert_offload": job.model.expert_offload,
        "expert_routing_stats": job.model.expert_routing_stats,
    }
    if job.model.max_model_len is not None:
        kwargs["max_model_len"] = job.model.max_model_len
    kwargs["max_num_seqs"] = max_num_seqs or job.batching.max_num_seqs or "auto"
    kwargs["expected_seq_len"] = expected_seq_len
    kwargs["batch_invariant"] = job.batching.batch_invariant
    kwargs["enable_prefix_caching"] = job.batching.prefix_caching
    if job.batching.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = job.batching.max_num_batched_tokens
    return LLM(**kwargs)
