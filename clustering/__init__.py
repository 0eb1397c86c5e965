"""Embedding and clustering of prompts by task type. Knows nothing of the engine."""
