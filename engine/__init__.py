"""The batchgen decode engine: a vLLM-shaped API over continuous batching and a paged KV
cache, for dense (llama) and DeepSeek MoE model families."""

from engine.outputs import CompletionOutput, Request, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Request", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch models and loaders; import it on first use so that
    # `from engine import SamplingParams` stays light.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
