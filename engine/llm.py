"""The public entry point: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import Request, RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """An offline generator over one model.

        llm = LLM(model="smollm2-135m-instruct")
        outs = llm.generate(["Translate into French: good morning"], SamplingParams(max_tokens=32))
        outs[0].outputs[0].text

    `model` is an alias, a Hugging Face directory or a GGUF file. `options` are the
    fields of `EngineConfig` (device, dtype, batch limits, KV memory, seed, speculative
    decoding, scheduling, batch invariance, prefix caching) and of `CudaTuning` (the CUDA backend's speed
    choices), each documented where it is declared in engine/config.py. `device` "auto"
    takes the GPU when there is one; `dtype` "auto" is float32 on the CPU and bfloat16 on
    a GPU (quantized weights stay in their stored format either way). An unknown option
    is a TypeError naming it.
    """

    def __init__(self, model: str, **options) -> None:
        self.config = EngineConfig.from_options(model, **options)
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

    @property
    def batch_size_choice(self) -> dict | None:
        """How max_num_seqs "auto" was resolved (engine/batch_size.py); None when it was given."""
        choice = self.engine.runner.batch_size_choice
        return None if choice is None else choice.as_dict()

    def reset_prefix_cache(self, enabled: bool | None = None) -> None:
        """Forget every cached prefix (between jobs: the next one starts cold). `enabled`
        turns caching on or off from now on (None: as it is); only while nothing runs."""
        runner = self.engine.runner
        on = runner.blocks.caches_prefixes if enabled is None else enabled
        runner.blocks.replace_prefix_cache(runner.new_prefix_cache() if on else None)

    def record_routing(self, on: bool = True) -> bool:
        """Start (or stop) recording routing statistics; False for models without routed
        experts. On a GPU, recording steps run eagerly instead of replaying graphs."""
        return self.engine.record_routing(on)

    def routing_stats(self) -> dict | None:
        """Per-layer distinct experts and expert bytes per step (MoE models, when the LLM
        was built with record_routing=True); None otherwise."""
        recorder = self.engine.routing_recorder
        return recorder.summary() if recorder is not None else None

    @property
    def expert_placement(self) -> dict | None:
        """Where the routed experts live (LLM(expert_offload=...)): experts per layer on the
        device and on the host, host bytes, the expected share of routes on the host;
        None when every expert is on the device."""
        return self.engine.runner.expert_placement

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
