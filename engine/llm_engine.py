"""The step loop: schedule -> run -> postprocess, and the bookkeeping of requests."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.fault_injection import from_environment as injected_faults
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestOutput
from engine.pending_step import PendingStep
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence
from engine.structured_output.compiler import GrammarCompiler, GrammarError
from engine.structured_output.matcher import SequenceGrammar
from engine.token_text import TokenText

log = logging.getLogger(__name__)

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, index) pairs over the generator's seed space


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    tag: str | None = None  # the caller's label (Request.tag)
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = self.runner.source.tokenizer
        self.grammars = GrammarCompiler(
            self.tokenizer.hf if self.tokenizer is not None else None,
            self.runner.vocab_size,
            self.runner.eos_token_ids,
        )
        self.token_text = TokenText(self.tokenizer)
        self.max_model_len = self.runner.max_model_len
        graphs = self.runner.graphs is not None
        self.scheduler = Scheduler.for_engine(config, self.runner.blocks, decode_graphs=graphs)
        self.requests: dict[str, _RequestState] = {}
        self._unseeded = 0
        self.num_steps = 0
        # None: on where decode steps replay CUDA graphs (the host's work then overlaps them)
        self.async_scheduling = (
            graphs if config.async_scheduling is None else config.async_scheduling
        )
        self._inflight: PendingStep | None = None  # launched, not yet resolved
        # The requests of the step being run and of a launched step still to resolve:
        # after step() raises, the requests its failure concerns.
        self.requests_in_step: frozenset[str] = frozenset()
        self.faults = injected_faults()
        self.routing_recorder = None
        if config.record_routing:
            self.record_routing(True)

    def record_routing(self, on: bool) -> bool:
        """Turn routing statistics on or off; False when the model has no routed experts."""
        from engine.routing_stats import RoutingRecorder

        recorder = RoutingRecorder() if on else None
        if not self.runner.set_routing_recorder(recorder):
            return False
        self.routing_recorder = recorder
        return True

    # -- requests -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        group: int | None = None,
        tag: str | None = None,
    ) -> RequestOutput | None:
        """Queue a request. Returns an error RequestOutput at once when this request alone
        cannot run (empty prompt, longer than the context); the others go on."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        error = None
        if not prompt_token_ids:
            error = "empty prompt: it has no tokens"
        elif len(prompt_token_ids) >= self.max_model_len:
            error = (
                f"prompt has {len(prompt_token_ids)} tokens; the model's context is "
                f"{self.max_model_len} tokens and must leave room for at least one new token"
            )
        if error:
            return RequestOutput(request_id, prompt, list(prompt_token_ids), [], True, error)
        compiled = None
        if params.grammar is not None:
            try:
                compiled = self.grammars.compile(params.grammar)
            except GrammarError as exc:
                return RequestOutput(request_id, prompt, list(prompt_token_ids), [], True, str(exc))
        seqs = [
            Sequence(request_id, i, prompt_token_ids, params, self._sample_seed(params, i), group)
            for i in range(params.n)
        ]
        if compiled is not None:
            for seq in seqs:
                seq.grammar = SequenceGrammar(compiled, self.grammars.stop_token_ids)
        self.requests[request_id] = _RequestState(
            request_id, prompt, list(prompt_token_ids), seqs, tag
        )
        for seq in seqs:
            self.scheduler.add(seq)
        return None

    def _sample_seed(self, params: SamplingParams, index: int) -> int | None:
        """The key of completion `index`'s draws: from the request's seed when it has one
        (the same tokens alone or in any batch), else from the engine's seed and arrival
        order."""
        if params.greedy:
            return None
        if params.seed is not None:
            return (params.seed * _SEED_MIX + index) % (1 << 63)
        self._unseeded += 1
        return (self.config.seed * _SEED_MIX + self._unseeded) % (1 << 63)

    def has_unfinished(self) -> bool:
        # A launched step still to resolve counts as work (async scheduling): after the last
        # sequence stops on a token, the step launched behind it is still in flight.
        return self.scheduler.has_work() or self._inflight is not None

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the loop -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the requests that finished. With async
        scheduling a decode step is launched and the previous one resolved, so the tokens
        a step returns are those of the step before it."""
        inflight = self._inflight.seqs if self._inflight is not None else []
        self.requests_in_step = frozenset(s.request_id for s in inflight)
        finished = self._fail_unfit(self.scheduler.abort_unrunnable())
        batch = self.scheduler.schedule()
        if self._inflight is not None:  # async scheduling: a launched step to resolve
            return finished + self._step_async(batch)
        return finished + self._run(batch)  # run, then postprocess

    def _run(self, batch: ScheduledBatch, resolved: bool = False) -> list[RequestOutput]:
        """Run a batch with no step in flight: launch it (an async decode step), or run it
        and postprocess its tokens. `resolved`: a launched step was resolved just now."""
        if not batch.seqs:
            return self._nothing_scheduled(resolved)
        if self.async_scheduling and batch.is_decode:
            self._inflight = self._launch(batch, None)
            return []
        self._begin_step(batch)
        return self._postprocess(batch, self.runner.run(batch))

    def _step_async(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """The async path, a step launched and not resolved: launch this decode step on
        its tokens, then resolve the launched one. Any other step reads its inputs on the
        host: resolve first, then run it without the sequences that stopped."""
        batch = batch.keep(self._may_continue)
        if batch.seqs and batch.is_decode and self.async_scheduling:
            # The launched step is recorded before the previous one is resolved, so an
            # error while resolving cannot lose it.
            previous, self._inflight = self._inflight, self._launch(batch, self._inflight)
            return self._resolve(previous)
        finished = self._resolve(self._inflight)
        self._inflight = None
        return finished + self._run(batch.keep(lambda s: not s.is_finished), resolved=True)

    def _postprocess(
        self, batch: ScheduledBatch, new_tokens: dict[int, list[int]]
    ) -> list[RequestOutput]:
        """Append each sequence's new tokens with the stop checks."""
        finished: list[RequestOutput] = []
        now = time.monotonic()
        for seq in batch.seqs:
            tokens = new_tokens.get(seq.seq_id)
            if not tokens:
                continue
            state = self.requests[seq.request_id]
            state.first_token = state.first_token or now
            for token in tokens:  # several when speculative drafts were accepted
                seq.token_ids.append(token)
                if self._finish_if_done(seq, token, state, now, finished):
                    break
        return finished

    def _fail_unfit(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Fail the requests of sequences that can never fit the whole cache."""
        finished: list[RequestOutput] = []
        for seq in seqs:
            finished.extend(self._fail(seq.request_id, "sequence does not fit the KV cache"))
        return finished

    def _nothing_scheduled(self, resolved: bool) -> list[RequestOutput]:
        # A sequence that outgrew the whole cache mid-decode was just preempted into the
        # waiting queue: fail its request alone, as the next step would, rather than the run.
        unrunnable = self.scheduler.abort_unrunnable()
        finished = self._fail_unfit(unrunnable)
        if self.scheduler.has_work() and not resolved and not unrunnable:
            raise RuntimeError("scheduler made no progress: KV cache too small for any sequence")
        return finished

    def _begin_step(self, batch: ScheduledBatch) -> None:
        self.num_steps += 1
        self.requests_in_step |= {s.request_id for s in batch.seqs}
        if self.faults is not None:
            tags = {self.requests[r].tag for r in self.requests_in_step if r in self.requests}
            self.faults.before_step(self.num_steps, tags)
        if self.routing_recorder is not None:
            groups = Counter(s.group for s in batch.seqs if s.group is not None)
            dominant = groups.most_common(1)[0][0] if groups else None
            self.routing_recorder.begin_step(sum(batch.num_tokens), batch.is_decode, dominant)

    def _launch(self, batch: ScheduledBatch, previous: PendingStep | None) -> PendingStep:
        self._begin_step(batch)
        return self.runner.launch(batch, previous)

    def _may_continue(self, seq: Sequence) -> bool:
        """False when the sequence's pending token is its last whatever its value
        (max_tokens or the context reached): another step for it would be thrown away."""
        return seq.num_output_tokens < seq.params.max_tokens and len(seq) < self.max_model_len

    def _resolve(self, pending: PendingStep) -> list[RequestOutput]:
        """Write a launched step's tokens in place of its placeholders and make the stop
        checks. A sequence that stopped drops the placeholder a later launch gave it."""
        finished: list[RequestOutput] = []
        now = time.monotonic()
        for seq, pos, token in zip(pending.seqs, pending.positions, pending.tokens()):
            if seq.is_finished:
                continue
            seq.token_ids[pos] = token
            later = seq.token_ids[pos + 1 :]  # the next launch's placeholder, if any
            del seq.token_ids[pos + 1 :]
            state = self.requests[seq.request_id]
            state.first_token = state.first_token or now
            if not self._finish_if_done(seq, token, state, now, finished):
                seq.token_ids.extend(later)
        return finished

    def _finish_if_done(
        self,
        seq: Sequence,
        token: int,
        state: _RequestState,
        now: float,
        finished: list[RequestOutput],
    ) -> bool:
        """Stop checks on the sequence's newest token; on a stop, finish it (and its request
        when that was the last of its sequences)."""
        if not self._check_finished(seq, token):
            return False
        seq.draft_tokens, seq.draft_probs = [], None
        self.scheduler.finish(seq)
        if all(s.is_finished for s in state.seqs):
            finished.append(self._output(state, now))
        return True

    def _check_finished(self, seq: Sequence, token: int) -> bool:
        p = seq.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.runner.eos_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", None
                return True
            if token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return True
            if p.stop and self._stop_string_hit(seq):
                return True
        if n_out >= p.max_tokens or len(seq) >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def _stop_string_hit(self, seq: Sequence) -> bool:
        # A stop string the newest token completed lies within the last few tokens, so
        # only that tail is decoded each step (decoding the whole output every token
        # would cost O(n^2) over a long completion). A few tokens more than the longest
        # stop string covers tokens that decode to no character of their own (partial
        # UTF-8 bytes). Only on a hit is the whole output decoded, to cut the text there:
        # the earliest occurrence is this one, since earlier steps found none.
        stops = seq.params.stop
        ids = seq.output_token_ids
        window = max(len(s) for s in stops) + 4
        tail = self._decode(seq, ids[-window:])
        if not any(s in tail for s in stops):
            return False
        text = self._decode(seq, ids)
        found = [(text.find(s), s) for s in stops if s in text]
        if not found:  # the tail's decoding differed at its cut (a partial character)
            return False
        index, stop = min(found)
        seq.text = text[:index]
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True

    def _decode(self, seq: Sequence, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        ids = seq.output_token_ids
        if isinstance(seq.stop_reason, str):
            text = seq.text  # already cut at the stop string
        else:
            shown = ids[:-1] if isinstance(seq.stop_reason, int) else ids
            text = self._decode(seq, shown)
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = self.token_text.entries(ids, seq.logprobs)
        return CompletionOutput(
            seq.index,
            text,
            list(ids),
            seq.finish_reason,
            seq.stop_reason,
            cached_prompt_tokens=seq.cached_prompt_tokens or 0,
            logprobs=logprobs,
        )

    def _output(self, state: _RequestState, now: float) -> RequestOutput:
        del self.requests[state.request_id]
        completions = [self._completion(s) for s in sorted(state.seqs, key=lambda s: s.index)]
        metrics = {
            "arrival_time": state.arrival,
            "first_token_latency_s": (state.first_token or now) - state.arrival,
            "latency_s": now - state.arrival,
            "completion_tokens": sum(len(c.token_ids) for c in completions),
            "cached_prompt_tokens": sum(c.cached_prompt_tokens for c in completions),
        }
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_token_ids, completions, True, None, metrics
        )

    def _fail(self, request_id: str, message: str) -> list[RequestOutput]:
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
        return [RequestOutput(request_id, state.prompt, state.prompt_token_ids, [], True, message)]
