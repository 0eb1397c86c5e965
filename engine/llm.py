"""The public entry point: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from engine.config import FP8_NATIVE_MIN_TOKENS, EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import Request, RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """An offline generator over one model.

        llm = LLM(model="smollm2-135m-instruct")
        outs = llm.generate(["Translate into French: good morning"], SamplingParams(max_tokens=32))
        outs[0].outputs[0].text

    `model` is an alias, a Hugging Face directory or a GGUF file. `device` "auto" takes
    the GPU when there is one; `dtype` "auto" is float32 on the CPU and bfloat16 on a GPU
    (quantized weights stay in their stored format either way). `speculative_tokens` K
    turns on multi-token-prediction drafts (models whose checkpoint has an MTP layer).
    `async_scheduling` launches each decode step before the previous one's tokens are
    read, hiding the host's work behind the GPU's (default: on where decode steps replay
    CUDA graphs). `fp8_native_min_tokens` N lets dense FP8 linears of steps of >= N tokens
    quantize activations to FP8 on GPUs that multiply FP8 natively (default 64; None:
    never). `shared_expert_stream` runs a MoE layer's shared expert on a second CUDA
    stream, concurrently with its routed experts, in steps of up to 64 tokens (default on);
    `main_stream_first` gives small decode graphs' main stream the higher priority.
    `mla_expanded_float32` True computes MLA's prefill attention in float32 on a GPU
    (default: in the model's dtype). `separate_prefill` keeps every step all decode or all
    prefill and admits waiting requests in groups of at least `min_prefill_seqs` (default:
    on where decode steps replay CUDA graphs, groups of max_num_seqs / 2).
    `fold_input_norm` computes a DeepSeek layer's input RMSNorm inside its FP8 q/kv_a GEMV
    in small decode steps on a GPU (default on). `batch_invariant` (default on) makes a
    row's CPU arithmetic independent of its batch, chunking and preemptions; False takes
    faster fused attention forms (docs/batch-invariance.md).
    """

    def __init__(
        self,
        model: str,
        device: str = "auto",
        dtype: str = "auto",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory: int | None = None,
        seed: int = 0,
        block_size: int = 16,
        max_model_len: int | None = None,
        record_routing: bool = False,
        speculative_tokens: int = 0,
        async_scheduling: bool | None = None,
        fp8_native_min_tokens: int | None = FP8_NATIVE_MIN_TOKENS,
        shared_expert_stream: bool = True,
        main_stream_first: bool = True,
        mla_expanded_float32: bool = False,
        separate_prefill: bool | None = None,
        min_prefill_seqs: int | None = None,
        fold_input_norm: bool = True,
        batch_invariant: bool = True,
    ) -> None:
        self.config = EngineConfig(
            model=str(model),
            device=device,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            max_model_len=max_model_len,
            seed=seed,
            record_routing=record_routing,
            speculative_tokens=speculative_tokens,
            async_scheduling=async_scheduling,
            fp8_native_min_tokens=fp8_native_min_tokens,
            shared_expert_stream=shared_expert_stream,
            main_stream_first=main_stream_first,
            mla_expanded_float32=mla_expanded_float32,
            separate_prefill=separate_prefill,
            min_prefill_seqs=min_prefill_seqs,
            fold_input_norm=fold_input_norm,
            batch_invariant=batch_invariant,
        )
        self.engine = LLMEngine(self.config)
        self.model_name = str(model)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_preemptions(self) -> int:
        return self.engine.scheduler.num_preemptions

    @property
    def requests_in_step(self) -> frozenset[str]:
        """The request ids of the engine's current step (and of a launched step not yet
        resolved): after `stream` raises, the requests the failure concerns."""
        return self.engine.requests_in_step

    def record_routing(self, on: bool = True) -> bool:
        """Start (or stop) recording routing statistics; False for models without routed
        experts. On a GPU, recording steps run eagerly instead of replaying graphs."""
        return self.engine.record_routing(on)

    def routing_stats(self) -> dict | None:
        """Per-layer distinct experts and expert bytes per step (MoE models, when the LLM
        was built with record_routing=True); None otherwise."""
        recorder = self.engine.routing_recorder
        return recorder.summary() if recorder is not None else None

    def speculative_stats(self) -> dict | None:
        """Accepted-draft histogram and tokens per step (LLM(speculative_tokens=K))."""
        speculator = self.engine.runner.speculator
        return speculator.stats.summary() if speculator is not None else None

    # -- prompts --------------------------------------------------------------------
    def _tokenize(
        self, prompt: Prompt, add_special_tokens: bool = True
    ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"model {self.model_name!r} has no tokenizer, so text prompts cannot be "
                    "encoded; pass token-id lists instead"
                )
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if not all(isinstance(t, int) for t in prompt):
            raise TypeError("a prompt must be a str or a list of int token ids")
        return None, list(prompt)

    # -- generation -----------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        requests = [Request(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(requests)) if use_tqdm else None
        for out in self.stream(requests):
            results[out.request_id] = out
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return [results[r.request_id] for r in requests]

    def chat(
        self,
        messages_list: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_name!r} has no tokenizer, so it cannot chat")
        if messages_list and isinstance(messages_list[0], dict):
            messages_list = [messages_list]
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(m, add_generation_prompt=add_generation_prompt),
                add_special_tokens=False,
            )
            for m in messages_list
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, requests: Iterable[Request]) -> Iterator[RequestOutput]:
        """Yield each request's result as soon as it finishes (finish order).

        Requests are pulled from the iterable only while the engine's queue is short, so
        a generator over millions of rows runs in bounded memory. A request that cannot
        run on its own (too long, empty) comes back with `error` set; the rest go on.
        """
        source = iter(requests)
        exhausted = False
        lookahead = 2 * self.config.max_num_seqs
        engine = self.engine
        while True:
            while not exhausted and engine.num_waiting < lookahead:
                req = next(source, None)
                if req is None:
                    exhausted = True
                    break
                params = req.sampling_params or SamplingParams()
                text, ids = self._tokenize(req.prompt)
                rejected = engine.add_request(req.request_id, ids, params, text, req.group, req.tag)
                if rejected is not None:
                    yield rejected
            if not engine.has_unfinished():
                if exhausted:
                    return
                continue
            yield from engine.step()


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generating")
