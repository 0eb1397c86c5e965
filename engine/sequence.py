"""One sequence being generated: its tokens, cache blocks, sampling state."""

from __future__ import annotations

import enum
from itertools import count

import torch

from engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = count()

# Stands in token_ids for a token that a launched decode step is still sampling on the
# device (async scheduling, engine/pending_step.py); the engine writes the real token when
# it reads that step back. Never a real token id (those are >= 0).
PENDING_TOKEN = -1


class Sequence:
    """A prompt plus the tokens generated so far. `num_computed` tokens already have
    their K/V in the cache; the rest are computed by the next steps (chunked prefill, or
    after a preemption that freed the cache, recomputation)."""

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sample_seed: int | None,
        group: int | None = None,
    ) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n completions this is
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        # Keys this sequence's random draws (engine/sampler.py); None for greedy ones.
        self.sample_seed = sample_seed
        self._generator: torch.Generator | None = None
        self.group = group
        self.status = Status.WAITING
        self.num_computed = 0
        self.block_table: list[int] = []
        # The slot of the model's fixed per-sequence state (CausalLM.state_specs) this
        # sequence owns while it holds blocks; None for models without such state.
        self.state_slot: int | None = None
        # Prefix caching (engine/block_manager.py): the content keys of the leading full
        # blocks, how many leading blocks of block_table are committed to the index (or
        # were read from it), and up to which block its prompt blocks were announced as
        # being computed.
        self.block_keys: list[bytes] = []
        self.num_committed = 0
        self.num_announced = 0
        # Prompt tokens read from the prefix cache at the first admission, not computed.
        self.cached_prompt_tokens: int | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text = ""  # the output cut at its stop string (set only when one ends it)
        # Speculative decoding: tokens proposed by the draft model for the next step, and
        # the distributions they were drawn from (for rejection sampling).
        self.draft_tokens: list[int] = []
        self.draft_probs: torch.Tensor | None = None
        # Structured output: the SequenceGrammar its samples must stay inside (None: free).
        self.grammar = None
        # Requested logprobs of its sampled tokens (engine/sampler.SampledLogprobs), by
        # output position; entries past the output's end (tokens cut by a stop) are unused.
        self.logprobs: dict[int, object] = {}

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A generator on `device` seeded by sample_seed, for the speculator's draft and
        acceptance draws (engine/spec_decode/); token sampling itself is keyed, not
        stateful."""
        if self._generator is None and self.sample_seed is not None:
            self._generator = torch.Generator(device=device).manual_seed(self.sample_seed)
        return self._generator

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
