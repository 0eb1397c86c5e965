"""The batch interfaces users already have files for: OpenAI Batch API and Anthropic
Message Batches request files in (JSONL), their result files out (`batchgen export`),
and the per-request parameters both carry."""
