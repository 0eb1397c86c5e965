"""Loads the model, owns its KV cache (the tensors and the `BlockManager` handing out
their blocks), and runs one scheduled batch: inputs are flattened, the model runs once,
and the sequences that finished their pending tokens get a sampled next token.

It builds the CUDA graph runner and the MTP speculator and hands each the buffers and
callables it needs (the model's logits function, the input builder, the token ban), so
neither of them knows the model runner."""

from __future__ import annotations

import logging
import math

import psutil
import torch

from engine.backends.prepare import prepare_model
from engine.batch_size import BatchSizeChoice, auto_cap, choose_max_num_seqs
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.expert_offload import choose_placement
from engine.expert_placement import placing_experts
from engine.loader import ModelSource, open_model_source
from engine.models.base import CacheSpec, CausalLM
from engine.models.registry import model_class_for
from engine.ops.attention_context import AttentionContext
from engine.ops.device_layer import DeviceSetup
from engine.pending_step import PendingStep
from engine.prefix_cache import PrefixCache, cache_identity
from engine.sampler import sample_step
from engine.scheduler import ScheduledBatch
from engine.sequence import PENDING_TOKEN, Sequence
from engine.structured_output.bitmask import grammar_bitmask

log = logging.getLogger(__name__)


def aligned_block_size(block_size: int, specs: list[CacheSpec]) -> int:
    """`block_size` rounded up to a multiple of every cache's tokens_per_entry, so a block
    holds whole entries of each (V4's compressed caches: one entry per 4 or 128 tokens)."""
    step = 1
    for spec in specs:
        step = math.lcm(step, spec.tokens_per_entry)
    aligned = -(-block_size // step) * step
    if aligned != block_size:
        log.info(
            "block_size %d -> %d (a multiple of every cache's entry span)", block_size, aligned
        )
    return aligned


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(self.device)
        self.source: ModelSource = open_model_source(
            config.model, dtype=config.explicit_dtype, device=self.device
        )
        self.model = self._build_model(self.source)
        self.max_model_len = min(
            self.model.max_model_len, config.max_model_len or self.model.max_model_len
        )
        self.block_size = aligned_block_size(config.block_size, self.model.cache_specs())
        # read once: the engine checks every new token against it
        self.eos_token_ids: list[int] = self._eos_token_ids()
        # the logits' width (grammar bitmasks are sized by it)
        self.vocab_size = int(self.source.config.get("vocab_size") or 0)
        self.graphs = None
        self.speculator = None
        self.routing_recorder = None  # set_routing_recorder
        if config.speculative_tokens:
            from engine.spec_decode.speculator import MtpSpeculator

            self.speculator = MtpSpeculator(
                self.model,
                config.speculative_tokens,
                build_inputs=self.build_inputs,
                banned_tokens=self.banned_tokens,
                max_model_len=self.max_model_len,
            )
        # each layer takes its device's ops (engine/backends: Triton kernels on CUDA)
        prepare_model(self.model, DeviceSetup(self.device, self.dtype, self.max_model_len,
                                              config.cuda, config.batch_invariant))  # fmt: skip
        decode_graphs = self._decode_graphs_apply()
        self.decode_graphs = decode_graphs
        # max_num_seqs "auto" (engine/batch_size.py): the warm-ups run with one state slot,
        # then the KV budget decides the number and the state gets a slot per sequence
        self.batch_size_choice: BatchSizeChoice | None = None
        auto = config.max_num_seqs == "auto"
        num_state_slots = self._allocate_sequence_state(
            1 if auto else config.max_num_seqs, scratch=decode_graphs
        )
        kv_blocks = self._allocate_kv_cache()
        if auto:
            num_state_slots = self.sequence_state_slots
        # The one place the scratch block (and state slot) is decided: the decode graphs'
        # padding rows write and read the cache's last block and the last state slot,
        # which the block manager never hands out.
        self.blocks = BlockManager(
            kv_blocks,
            self.block_size,
            int(decode_graphs),
            num_state_slots,
            prefix_cache=self.new_prefix_cache() if config.enable_prefix_caching else None,
        )
        if decode_graphs:  # decode steps replay CUDA graphs (engine/cuda_graph_runner.py)
            from engine.cuda_graph_runner import CudaGraphRunner

            self.graphs = CudaGraphRunner(
                self._step_logits,
                device=self.device,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                block_size=self.block_size,
                scratch_block=self.blocks.reserved[0],
                main_stream_first=config.cuda.main_stream_first,
                scratch_state_slot=num_state_slots if num_state_slots else None,
                vocab_size=self.vocab_size,
            )

    @property
    def num_blocks(self) -> int:
        """KV cache blocks sequences can own (the graphs' scratch block not counted)."""
        return self.blocks.num_blocks

    def new_prefix_cache(self) -> PrefixCache | None:
        """An empty index of shareable KV blocks, where the model's whole decode state is
        its paged caches. A model with fixed per-sequence state (DeepSeek-V4's window ring
        and compression pooling rows) runs without (None): a sequence starting after a
        cached prefix would need that state as of the prefix's end, which no block holds."""
        if self.model.state_specs():
            log.info(
                "prefix caching off: %s keeps per-sequence state outside its paged cache "
                "(docs/prefix-caching.md)",
                type(self.model).__name__,
            )
            return None
        specs = [(s.shape, str(s.dtype), s.tokens_per_entry) for s in self.model.cache_specs()]
        identity = cache_identity(
            self.config.model,
            type(self.model).__name__,
            str(self.dtype),
            self.block_size,
            specs,
            self.config.speculative_tokens > 0,
        )
        # With the MTP speculator each position's MTP cache entry reads the next token.
        return PrefixCache(identity, self.block_size, key_next_token=self.speculator is not None)

    def _decode_graphs_apply(self) -> bool:
        """CUDA graphs for the decode step, where the model allows them, unless routing is
        recorded from the start or steps verify speculative drafts (rows of several tokens):
        those steps run eagerly."""
        if self.device.type != "cuda" or self.config.record_routing or self.speculator is not None:
            return False
        from engine.cuda_graph_runner import decode_graphs_apply

        return decode_graphs_apply(self.model, self.device)

    def _step_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """The model's forward and logits of every row: what a decode graph captures."""
        return self.model.compute_logits(self.model(input_ids, positions, ctx))  # [T, V]

    def set_routing_recorder(self, recorder) -> bool:
        """Record the model's routing into `recorder` (None: stop). False, and nothing set,
        when the model has no routed experts. While one records, decode steps run eagerly."""
        if not hasattr(self.model, "routing_recorder"):
            return False
        self.model.routing_recorder = recorder
        self.routing_recorder = recorder
        return True

    def _build_model(self, source: ModelSource) -> CausalLM:
        cls = model_class_for(source.config)
        # expert_placement: the summary of where routed experts live (None: all on the
        # device), for the log and the job's reports
        placement, self.expert_placement = choose_placement(
            self.config, cls, source, self.device, self.dtype
        )
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), placing_experts(placement):
                model = cls(source.config, source.quant_config)
        finally:
            torch.set_default_dtype(previous)
        model.load_weights(source.iter_weights())
        return model.eval()

    def _allocate_sequence_state(self, num_seqs: int, scratch: bool) -> int:
        """The model's fixed per-sequence state (CausalLM.state_specs), one slot for each
        of `num_seqs` sequences, plus with `scratch` one more that no sequence owns (the
        decode graphs' padding rows); returns the sequences' slot count (0: the model has
        none)."""
        specs = self.model.state_specs()
        slots = num_seqs if specs else 0
        self.sequence_state_slots = slots
        allocated = slots + int(scratch and slots > 0)
        self.sequence_state = [
            torch.zeros(allocated, *s.shape, dtype=s.dtype or self.dtype, device=self.device)
            for s in specs
        ]
        self.model.bind_state(self.sequence_state)
        self.state_bytes = allocated * sum(s.bytes_per_sequence(self.dtype) for s in specs)
        if specs:
            log.info(
                "sequence state: %d slots of %.1f MiB",
                allocated,
                self.state_bytes / allocated / 2**20,
            )
        return slots

    def _allocate_kv_cache(self) -> int:
        specs = self.model.cache_specs()
        per_block = sum(s.bytes_per_block(self.block_size, self.dtype) for s in specs)
        per_token = per_block / self.block_size
        auto = self.config.max_num_seqs == "auto"
        tokens = self.max_model_len + 1 + self.config.speculative_tokens
        blocks_per_seq = -(-tokens // self.block_size)
        # bytes for the sequences' fixed state and the paged cache together
        budget = self.config.kv_cache_memory  # the user's figure, when given
        if budget is None and self.device.type == "cuda":  # sized after warm-up forwards
            from engine.backends.cuda.memory import kv_cache_budget
            from engine.cuda_graph_runner import capture_buckets

            most = auto_cap(self.device) if auto else self.config.max_num_seqs
            # measured with the sequence state already allocated: what is left is paged
            budget = self.state_bytes + kv_cache_budget(
                self.model,
                self.dtype,
                self.device,
                self.block_size,
                min(self.config.max_num_batched_tokens, self.max_model_len - 1),
                int(self.source.config.get("vocab_size", 2)),
                capture_buckets(most)[-1] if self.decode_graphs else 0,
                self.max_model_len,
            )
            for state in self.sequence_state:
                state.zero_()  # the warm-up wrote into slot 0
        elif budget is None:
            budget = min(2 << 30, int(psutil.virtual_memory().available * 0.25))
        if auto:
            self._choose_max_num_seqs(budget, per_block)
        paged = budget - self.state_bytes
        if self.config.kv_cache_memory is None and self.device.type != "cuda":
            # Never more than max_num_seqs sequences of max_model_len tokens can hold:
            # a small model gets the megabytes it can use, not 2 GiB of zeros to write
            # (and to keep resident) on every start.
            paged = min(paged, self.config.max_num_seqs * blocks_per_seq * per_block)
        if per_block == 0:
            # No paged cache (every layer keeps its state in the sequence slots, as a
            # DeepSeek-V4 model of sliding-window layers only): the block tables still
            # address positions, at no memory, so every sequence may reach max_model_len.
            num_blocks = self.config.max_num_seqs * blocks_per_seq + 1
        else:
            num_blocks = int(paged // per_block)
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory of {budget} bytes holds fewer than 2 blocks of "
                f"{self.block_size} tokens ({per_token:.0f} bytes per token) besides "
                f"{self.state_bytes} bytes of per-sequence state; give it more memory"
            )
        # Zeros, not torch.empty: attention gathers whole blocks and padded block-table
        # entries, and a masked key's probability is 0 but 0 * NaN (stale memory) is NaN,
        # which made outputs depend on what the allocator handed back.
        self.kv_caches = [
            torch.zeros(
                num_blocks,
                *s.block_shape(self.block_size),
                dtype=s.dtype or self.dtype,
                device=self.device,
            )
            for s in specs
        ]
        self.model.bind_kv_cache(self.kv_caches)
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            self.block_size,
            num_blocks * per_block / 2**20,
        )
        return num_blocks

    def _choose_max_num_seqs(self, budget: int, per_block: int) -> None:
        """max_num_seqs "auto": the number `budget` bytes of state and KV cache hold at the
        expected sequence length, written into the config (the scheduler and the graphs
        read it there); the state is reallocated with a slot per sequence."""
        expected = self.config.expected_seq_len or self.max_model_len
        expected = min(expected, self.max_model_len) + 1 + self.config.speculative_tokens
        state_per_seq = sum(s.bytes_per_sequence(self.dtype) for s in self.model.state_specs())
        choice = choose_max_num_seqs(
            budget - state_per_seq * int(self.decode_graphs),  # the graphs' scratch slot
            per_block,
            state_per_seq,
            self.block_size,
            expected,
            auto_cap(self.device),
        )
        self.batch_size_choice = choice
        self.config.max_num_seqs = choice.max_num_seqs
        self._allocate_sequence_state(choice.max_num_seqs, scratch=self.decode_graphs)
        log.info(
            "max_num_seqs auto: %d (the KV budget holds %d sequences of %d tokens; cap %d)",
            choice.max_num_seqs,
            choice.kv_holds,
            expected,
            choice.cap,
        )

    def prepare(self, batch: ScheduledBatch):
        """Flattened inputs and the attention context for a scheduled batch. A sequence's
        rows are its uncomputed tokens, then its draft tokens (speculative decoding)."""
        items = [(s, s.num_computed, n) for s, n in zip(batch.seqs, batch.num_tokens)]
        return self.build_inputs(items)

    def build_inputs(self, items: list[tuple[Sequence, int, int]]):
        """items: (sequence, first position, number of rows). Returns (input_ids [T],
        positions [T], AttentionContext)."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        clens: list[int] = []
        bs = self.block_size
        for seq, start, n in items:
            tokens = seq.token_ids + seq.draft_tokens if seq.draft_tokens else seq.token_ids
            ids.extend(tokens[start : start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            qlens.append(n)
            clens.append(start + n)
        width = max(len(s.block_table) for s, _, _ in items)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s, _, _ in items]
        dev = self.device
        cu = [0]
        for n in qlens:
            cu.append(cu[-1] + n)
        ctx = AttentionContext(
            block_size=bs,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(clens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            query_lens_host=qlens,
            context_lens_host=clens,
            is_decode=all(n == 1 for n in qlens),
            batch_invariant=self.config.batch_invariant,
        )
        if self.blocks.uses_state:
            ctx.state_slots_host = [s.state_slot for s, _, _ in items]
            ctx.state_slots = torch.tensor(ctx.state_slots_host, dtype=torch.int32, device=dev)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return input_ids, pos, ctx

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> dict[int, list[int]]:
        """Run the batch; returns {seq_id: new tokens} for the sequences that emit tokens
        (one each, or several when speculative drafts were accepted)."""
        if self.speculator is not None:
            return self.speculator.run(batch)
        if batch.is_decode and self._replays(batch.seqs):
            # CUDA graphs: one replay runs the whole decode step (engine/cuda_graph_runner.py)
            tokens = self.graphs.launch(batch.seqs)()
            return {s.seq_id: [t] for s, t in zip(batch.seqs, tokens)}
        return self._run_eager(batch)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: PendingStep | None) -> PendingStep:
        """Start a decode step (each sequence decodes its one uncomputed token) and return
        without its tokens (async scheduling, engine/pending_step.py): each sequence gets a
        PENDING_TOKEN now. `previous` is the step launched before this one, not resolved
        yet; its pending tokens are this step's inputs."""
        seqs = batch.seqs
        on_graph = self._replays(seqs)
        # chained: a graph step gathers its pending inputs from the previous step's rows on
        # the device; any other step reads them on the host
        chained = previous is not None and previous.device_rows and on_graph
        if previous is not None and not chained:
            previous.write_tokens()
        positions = [len(s) for s in seqs]
        if on_graph:
            # constrained: a grammar's mask needs the previous step's tokens on the host; the
            # graph runner writes them (before_mask) once the forward is replaying, so the
            # wait and the mask fill overlap it. A step without a grammar never waits.
            read = self.graphs.launch(
                seqs,
                previous.row_of() if chained else None,
                before_mask=previous.write_tokens if chained else None,
            )
            pending = PendingStep(seqs, positions, read, device_rows=True)
        else:
            new = self._run_eager(batch)
            tokens = [new[s.seq_id][0] for s in seqs]
            pending = PendingStep(seqs, positions, lambda: tokens)
        for seq in seqs:
            seq.token_ids.append(PENDING_TOKEN)
        return pending

    def _replays(self, seqs: list[Sequence]) -> bool:
        """Whether a decode step of these sequences replays a graph (else it runs eagerly):
        a bucket holds them, routing is not being recorded, and no row bans tokens or
        has penalties (the graphs' sampler applies neither)."""
        return (
            self.graphs is not None
            and self.graphs.fits(len(seqs))
            and self.routing_recorder is None
            and not any(self.banned_tokens(s) or s.params.penalized for s in seqs)
        )

    def _run_eager(self, batch: ScheduledBatch) -> dict[int, list[int]]:
        input_ids, positions, ctx = self.prepare(batch)
        hidden = self.model(input_ids, positions, ctx)  # [T, D]
        rows: list[int] = []
        sampling: list[Sequence] = []
        end = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            end += n
            if seq.num_computed + n == len(seq):
                rows.append(end - 1)
                sampling.append(seq)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += n
        if not sampling:
            return {}
        # built while the device runs the forward (on CUDA the launches above are async)
        bitmask, constrained = grammar_bitmask(
            sampling, self.vocab_size, pin=self.device.type == "cuda"
        )
        logits = self.model.compute_logits(hidden[rows])  # [N, V]
        tokens, logprobs = sample_step(
            logits,
            [s.params for s in sampling],
            [s.sample_seed or 0 for s in sampling],
            [s.num_output_tokens for s in sampling],
            output_tokens=[s.output_token_ids if s.params.penalized else [] for s in sampling],
            bitmask=bitmask,
            constrained=constrained,
            banned=[self.banned_tokens(s) for s in sampling],
        )
        for seq, entry in zip(sampling, logprobs):
            if entry is not None:
                seq.logprobs[seq.num_output_tokens] = entry
        return {s.seq_id: [t] for s, t in zip(sampling, tokens)}

    def banned_tokens(self, seq: Sequence) -> list[int]:
        """Token ids the sequence may not sample next: its stop ids and EOS while it has
        fewer than min_tokens outputs; none after."""
        if seq.num_output_tokens >= seq.params.min_tokens:
            return []
        return list(seq.params.stop_token_ids) + list(self.eos_token_ids)

    def _eos_token_ids(self) -> list[int]:
        tok = self.source.tokenizer
        if tok is not None and tok.eos_token_ids:
            return list(tok.eos_token_ids)
        eos = self.source.config.get("eos_token_id")
        if eos is None:
            return []
        return list(eos) if isinstance(eos, list) else [eos]
