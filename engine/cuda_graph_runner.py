"""The decode step as CUDA graphs: one graph replay runs a whole decode step (every layer,
the logits and the sampler) for a batch padded up to a bucket size.

A graph replays fixed kernels on fixed memory, so each step's inputs are copied into static
buffers the graphs were captured on (`DecodeInputs`): token ids, positions, cache slots,
context lengths, block tables sized for max_model_len, and the per-row sampling
parameters. Padding rows point at a scratch block the block manager never hands out
(BlockManager.reserved), so their cache writes and attention reads touch nobody's tokens. Per step the host does three
small copies, one replay and one read-back of the sampled tokens.

Buckets cover every batch size up to max_num_seqs (`capture_buckets`): a graph per bucket,
all sharing one memory pool, so the pool is the largest bucket's activations, which the
KV budget keeps free (engine/backends/cuda/memory.py measures it before the cache is
allocated).

Only decode steps (every sequence has exactly one new token) replay graphs; prefill and
mixed steps and (the model runner's choice) steps
that must ban tokens (min_tokens) or record routing run eagerly. Sampled rows draw from the Triton sampler (Philox keyed by the
sequence's seed and output position), so a seeded sequence repeats itself on the GPU; greedy
rows take the argmax like the eager sampler.

Async scheduling (engine/pending_step.py): `launch` returns before the tokens are back. Every
graph also leaves its tokens in one shared `sampled` buffer, and a row whose input token is
still pending names the previous step's row to take it from (SRC_ROWS); the graph gathers it
on the device. The host staging buffers are double-buffered so that filling step n+1 cannot
overwrite step n's inputs before their copy has run.

Structured output (engine/structured_output/): a grammar's mask is a static input too, and
the mask kernel runs between the logits and the sampler. The host builds a mask from the
sequence's tokens, so a step with a constrained row replays two graphs of its bucket: the
forward (every other input chained as above), then, once the host has the previous step's
tokens and has filled and copied the masks, the mask and sampler over the logits the
forward left in a static buffer. The GPU runs the forward during the host's wait and mask
fill. Steps without a grammar replay the one graph.

The graph runner knows the model only as the function it captures (`step_logits`: input
ids, positions and attention context to float32 logits) and the cache only as its geometry
and scratch block; the model runner builds it and decides when a step replays.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from engine.backends.cuda.host_func import raise_host_failures
from engine.ops.attention_context import AttentionContext
from engine.sampler import SampledLogprobs
from engine.sampling_params import MAX_TOP_LOGPROBS
from engine.sequence import PENDING_TOKEN, Sequence
from engine.structured_output.bitmask import fill_grammar_bitmask

log = logging.getLogger(__name__)

# Decode batch sizes with a graph. A batch pads up to the next bucket, so the steps between
# buckets stay near an eighth to a quarter of the bucket past 16 rows, where a step's time
# starts to grow with its rows; past the last, buckets come every LARGE_BUCKET_STEP rows.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512,
                 640, 768, 896, 1024)  # fmt: skip
LARGE_BUCKET_STEP = 256
# Buckets whose graphs are captured on a high-priority stream (CudaTuning.main_stream_first):
# on the H200 it speeds batch 1 up (+6.5% bf16, +2% FP8 + MXFP4) and slows batch 32 down by
# 1-2%, where the routed kernels fill the GPU and the shared expert is the one kept waiting
# (docs/notes-gpu-engine.md).
MAIN_STREAM_FIRST_MAX_BATCH = 16

# Rows of DecodeInputs.ints (int64) and .floats (float32).
INPUT_IDS, POSITIONS, SLOTS, CONTEXT_LENS, SEEDS, STEPS, SRC_ROWS, STATE_SLOTS = range(8)
TEMPERATURE, TOP_P, MIN_P, TOP_K = range(4)


def capture_buckets(max_num_seqs: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> list[int]:
    """The buckets a runner needs: all below max_num_seqs and the first at or above it;
    past the listed ones, every LARGE_BUCKET_STEP rows, so every decode batch up to
    max_num_seqs has a graph."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = list(buckets)
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + LARGE_BUCKET_STEP)
    chosen = [b for b in sizes if b < max_num_seqs]
    above = [b for b in sizes if b >= max_num_seqs]
    return chosen + above[:1]


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding num_seqs rows, or None when none does."""
    for b in buckets:
        if b >= num_seqs:
            return b
    return None


class DecodeInputs:
    """Static device buffers of one decode step (max_batch rows), their pinned host staging
    copies (two sets, used in turn), and the `sampled` tokens of the last step. `fill`
    writes a batch's rows, pads up to the bucket, and copies."""

    def __init__(
        self,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        scratch_state_slot: int | None = None,
        vocab_size: int = 0,
    ) -> None:
        pin = device.type == "cuda"
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.block_size, self.scratch_block = block_size, scratch_block
        # the model's per-sequence state slot no sequence owns (None: the model has none)
        self.scratch_state_slot = scratch_state_slot
        self.host_ints = torch.zeros(2, 8, max_batch, dtype=torch.int64, pin_memory=pin)
        self.host_floats = torch.zeros(2, 4, max_batch, dtype=torch.float32, pin_memory=pin)
        self.host_tables = torch.zeros(2, max_batch, max_blocks, dtype=torch.int64, pin_memory=pin)
        self.ints = torch.zeros(8, max_batch, dtype=torch.int64, device=device)
        self.floats = torch.zeros(4, max_batch, dtype=torch.float32, device=device)
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int64, device=device)
        self.sampled = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.cu_query_lens = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._ints, self._floats = self.host_ints.numpy(), self.host_floats.numpy()
        self._tables = self.host_tables.numpy()
        self._set = 0  # which staging set the next fill writes
        # the staging set and row count of the last fill (fill_masks writes that set too)
        self._filled, self._filled_rows = 0, 0
        # Grammar masks (engine/structured_output/): a row's bitmask words and whether it
        # is constrained; a free row is skipped by the mask kernel after reading its flag.
        words = -(-vocab_size // 32)
        self.host_bitmask = torch.zeros(2, max_batch, words, dtype=torch.int32, pin_memory=pin)
        self.host_constrained = torch.zeros(2, max_batch, dtype=torch.int32, pin_memory=pin)
        self.bitmask = torch.zeros(max_batch, words, dtype=torch.int32, device=device)
        self.constrained = torch.zeros(max_batch, dtype=torch.int32, device=device)

    def fill(
        self,
        seqs: list[Sequence],
        bucket: int,
        pending_rows: dict[int, int] | None = None,
        masks: bool = True,
    ) -> None:
        """Rows 0..len(seqs)-1 from the sequences (each decoding its last token), rows up to
        `bucket` padding on the scratch block; then copy to the device buffers. A sequence
        whose last token is PENDING_TOKEN takes it from row pending_rows[seq_id] of the
        previous step's `sampled` tokens. Without `masks` the grammar masks are left to a
        `fill_masks` call after (a split step fills them while its forward runs)."""
        n = len(seqs)
        if n > bucket or bucket > self.max_batch:
            raise ValueError(f"{n} sequences do not fit bucket {bucket} (max {self.max_batch})")
        k = self._set
        self._set ^= 1
        self._filled, self._filled_rows = k, n
        ints, floats, tables = self._ints[k], self._floats[k], self._tables[k]
        bs = self.block_size
        for i, seq in enumerate(seqs):
            pos = len(seq) - 1
            table = seq.block_table
            if pos // bs >= len(table) or len(table) > self.max_blocks:
                raise ValueError(
                    f"sequence {seq.seq_id}: position {pos} has no cache block "
                    f"(block table of {len(table)}, at most {self.max_blocks})"
                )
            p = seq.params
            token = seq.token_ids[pos]
            if token == PENDING_TOKEN:
                if pending_rows is None or seq.seq_id not in pending_rows:
                    raise ValueError(
                        f"sequence {seq.seq_id}: its last token is pending but the previous "
                        "step has no row for it"
                    )
                ints[INPUT_IDS, i], ints[SRC_ROWS, i] = 0, pending_rows[seq.seq_id]
            else:
                ints[INPUT_IDS, i], ints[SRC_ROWS, i] = token, -1
            ints[POSITIONS, i] = pos
            ints[SLOTS, i] = table[pos // bs] * bs + pos % bs
            ints[CONTEXT_LENS, i] = pos + 1
            ints[SEEDS, i] = seq.sample_seed if seq.sample_seed is not None else 0
            ints[STEPS, i] = seq.num_output_tokens
            if self.scratch_state_slot is not None:
                ints[STATE_SLOTS, i] = seq.state_slot
            floats[TEMPERATURE, i] = 0.0 if p.greedy else p.temperature
            floats[TOP_P, i] = p.top_p
            floats[MIN_P, i] = p.min_p
            floats[TOP_K, i] = p.top_k
            tables[i, : len(table)] = table
        if bucket > n:
            ints[:, n:bucket] = 0
            ints[SLOTS, n:bucket] = self.scratch_block * bs
            ints[CONTEXT_LENS, n:bucket] = 1
            ints[SRC_ROWS, n:bucket] = -1
            if self.scratch_state_slot is not None:
                ints[STATE_SLOTS, n:bucket] = self.scratch_state_slot
            floats[:, n:bucket] = 0.0
            tables[n:bucket, 0] = self.scratch_block
        self.ints.copy_(self.host_ints[k], non_blocking=True)
        self.floats.copy_(self.host_floats[k], non_blocking=True)
        self.tables[:bucket].copy_(self.host_tables[k, :bucket], non_blocking=True)
        if masks:
            self.fill_masks(seqs)

    def fill_masks(self, seqs: list[Sequence]) -> None:
        """The grammar masks and constrained flags of the rows the last `fill` wrote, into
        its staging set, then copied. A grammar reads its sequence's tokens on the host, so
        a constrained sequence's last token may not be pending."""
        k, n = self._filled, len(seqs)
        if n != self._filled_rows:
            raise ValueError(f"masks for {n} rows after a fill of {self._filled_rows}")
        flags = self.host_constrained[k]
        flags.zero_()
        if any(seq.grammar is not None for seq in seqs):
            for seq in seqs:
                if seq.grammar is not None and seq.token_ids[-1] == PENDING_TOKEN:
                    raise ValueError(
                        f"sequence {seq.seq_id}: its grammar needs its last token on the host, "
                        "which is still pending (write the previous step's tokens first)"
                    )
            constrained = fill_grammar_bitmask(seqs, self.host_bitmask[k, :n])
            flags[:n] = torch.tensor(constrained, dtype=torch.int32)
            self.bitmask[:n].copy_(self.host_bitmask[k, :n], non_blocking=True)
        self.constrained.copy_(flags, non_blocking=True)

    def input_ids(self, bucket: int) -> torch.Tensor:
        """The step's input tokens, pending ones gathered from `sampled` (inside the graph)."""
        ids, src = self.ints[INPUT_IDS, :bucket], self.ints[SRC_ROWS, :bucket]
        return torch.where(src >= 0, self.sampled[src.clamp(min=0)], ids)

    def context(self, bucket: int, max_model_len: int) -> AttentionContext:
        """The attention metadata of a `bucket`-row decode step, as views of the buffers.
        The host-side context lengths are the worst case, so launch shapes chosen from
        them (the attention kernel's split count) hold for every step of the bucket."""
        ctx = AttentionContext(
            block_size=self.block_size,
            slot_mapping=self.ints[SLOTS, :bucket],
            cu_query_lens=self.cu_query_lens[: bucket + 1],
            context_lens=self.ints[CONTEXT_LENS, :bucket],
            block_tables=self.tables[:bucket],
            query_lens_host=[1] * bucket,
            context_lens_host=[max_model_len] * bucket,
            is_decode=True,
        )
        if self.scratch_state_slot is not None:
            # on the device only: a captured step cannot read the host's slot list
            ctx.state_slots = self.ints[STATE_SLOTS, :bucket]
        return ctx


def decode_graphs_apply(model: nn.Module, device: torch.device) -> bool:
    """Whether `model`'s decode step can be captured: on CUDA, for models whose decode step
    never syncs the host: those whose attention is MLA (its CUDA decode path reads context
    lengths on the device), and DeepSeek-V4 where every attention layer's ops declare
    `captures_decode`; never when some layer's ops declare it False (quantized experts
    the kernels do not take). Other families' torch attention sizes its work from
    host-side lengths, so they stay eager."""
    from engine.layers.mla import MultiLatentAttention
    from engine.layers.v4_attention import V4Attention

    if device.type != "cuda":
        return False
    if any(getattr(getattr(m, "ops", None), "captures_decode", True) is False
           for m in model.modules()):  # fmt: skip
        return False  # a layer's device ops say their decode step syncs the host
    v4 = [m for m in model.modules() if isinstance(m, V4Attention)]
    if v4:  # the device's V4 ops say whether their decode step is free of host syncs
        return all(getattr(m.ops, "captures_decode", False) for m in v4)
    return any(isinstance(m, MultiLatentAttention) for m in model.modules())


StepLogits = Callable[[torch.Tensor, torch.Tensor, AttentionContext], torch.Tensor]


class CudaGraphRunner:
    """Captures the decode step per bucket and replays it. `step_logits(input_ids [B],
    positions [B], ctx)` runs the model and returns float32 logits [B, V]; the padding rows
    use `scratch_block`, a cache block no sequence is ever given."""

    def __init__(
        self,
        step_logits: StepLogits,
        *,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        scratch_block: int,
        main_stream_first: bool,
        scratch_state_slot: int | None = None,
        vocab_size: int = 0,
    ) -> None:
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self._step_logits = step_logits
        self.device = device
        self.max_model_len = max_model_len
        self.main_stream_first = main_stream_first
        self.buckets = capture_buckets(max_num_seqs)
        max_blocks = -(-max_model_len // block_size)
        self.inputs = DecodeInputs(
            self.buckets[-1], max_blocks, block_size, scratch_block, device, scratch_state_slot,
            vocab_size,
        )  # fmt: skip
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.tokens: dict[int, torch.Tensor] = {}
        # Graphs that also return logprobs, captured on the first step that asks for them
        # (a run without logprobs never pays for the log_softmax and top-k): by bucket,
        # the graph and its (sampled logprob [B], top logprobs [B, K], top ids [B, K]).
        self.logprob_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logprob_outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        # A step with a grammar runs as two graphs so that the host fills the masks while
        # the forward runs (`launch`): by bucket the forward (into `split_logits`), by
        # (bucket, logprobs) the mask and sampler and their outputs, as the one-graph
        # step's. Captured on the first constrained step of a bucket: a run without
        # grammars never pays for them.
        self.forward_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sample_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.sample_outputs: dict[tuple[int, bool], torch.Tensor | tuple[torch.Tensor, ...]] = {}
        # float32 logits [largest bucket, V] the forward graphs leave for the sample graphs:
        # one buffer outside the pool for every bucket (logits kept alive in the pool
        # would take a bucket's worth per captured bucket)
        self.split_logits: torch.Tensor | None = None
        self._pool = None
        self._host_logprobs = torch.zeros(
            2, self.buckets[-1], 1 + 2 * MAX_TOP_LOGPROBS, dtype=torch.float64, pin_memory=True
        )
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        # pinned host copies of the sampled tokens, two sets used in turn (see `launch`)
        self._host_tokens = torch.zeros(2, self.buckets[-1], dtype=torch.int64, pin_memory=True)
        self._host_set = 0
        # Capture streams, made once: PyTorch hands streams out round-robin from a small
        # pool per priority, so streams made per capture (recapture) would come back as the
        # shared expert's side stream and capture it serialized with the routed experts.
        self._first = torch.cuda.Stream(device, priority=-1)
        self._equal = torch.cuda.Stream(device)
        self._capture()

    def _step(self, bucket: int, logprobs: bool = False):
        """The captured work: forward, logits, grammar mask, sampling -> tokens [bucket]
        int64, also left in the shared `sampled` buffer for the next step's pending inputs.
        With `logprobs`, (tokens, logprobs [bucket, 1 + 2K] float64: the sampled token's
        raw logprob, the top K logprobs, the top K ids), read from the unmasked logits."""
        return self._sample(bucket, self._forward(bucket), logprobs)

    def _forward(self, bucket: int) -> torch.Tensor:
        """The model's forward and logits over the static inputs -> [bucket, V] float32."""
        buf = self.inputs
        ctx = buf.context(bucket, self.max_model_len)
        return self._step_logits(buf.input_ids(bucket), buf.ints[POSITIONS, :bucket], ctx)

    def _forward_to_buffer(self, bucket: int) -> None:
        """The split step's first graph: the logits left in `split_logits`."""
        logits = self._forward(bucket)  # [B, V] float32
        if self.split_logits is None:  # on the eager warm-up, never inside a capture
            self.split_logits = torch.zeros(
                self.buckets[-1], logits.shape[1], dtype=logits.dtype, device=self.device
            )
        self.split_logits[:bucket].copy_(logits)

    def _sample(self, bucket: int, logits: torch.Tensor, logprobs: bool):
        """Logprobs (with `logprobs`), grammar mask (in place) and sampling over logits
        [bucket, V]; what `_step` returns."""
        from kernels.triton.sampling import sample
        from kernels.triton.token_mask import apply_token_bitmask

        buf = self.inputs
        if logprobs:
            raw = torch.log_softmax(logits.float(), dim=-1)  # [B, V], before the mask
            top_values, top_ids = torch.topk(raw, MAX_TOP_LOGPROBS, dim=-1)  # [B, K]
        if buf.bitmask.shape[1]:
            apply_token_bitmask(logits, buf.bitmask[:bucket], buf.constrained[:bucket])
        tokens = sample(
            logits,
            buf.floats[TEMPERATURE, :bucket],
            buf.floats[TOP_K, :bucket].to(torch.int32),
            buf.floats[TOP_P, :bucket],
            buf.floats[MIN_P, :bucket],
            buf.ints[SEEDS, :bucket],
            buf.ints[STEPS, :bucket],
        )
        buf.sampled[:bucket].copy_(tokens)
        if not logprobs:
            return tokens
        chosen = raw.gather(1, tokens[:, None])  # [B, 1]
        block = torch.cat([chosen.double(), top_values.double(), top_ids.double()], dim=1)
        return tokens, block

    def recapture(self, buckets: list[int] | None = None) -> None:
        """Capture these buckets (default: all) again, for launch configs that changed since
        (`batchgen bench step-tune` times table entries inside the step). The inputs are
        left as padding rows."""
        chosen = self.buckets if buckets is None else sorted(buckets)
        unknown = set(chosen) - set(self.buckets)
        if unknown:
            raise ValueError(f"buckets {sorted(unknown)} are not captured ({self.buckets})")
        for bucket in chosen:  # released before capturing again
            self.graphs.pop(bucket, None)
            self.tokens.pop(bucket, None)
            # the lazily captured ones are captured again when a step next needs them
            self.logprob_graphs.pop(bucket, None)
            self.logprob_outputs.pop(bucket, None)
            self.forward_graphs.pop(bucket, None)
            for key in [(bucket, False), (bucket, True)]:
                self.sample_graphs.pop(key, None)
                self.sample_outputs.pop(key, None)
        torch.cuda.synchronize(self.device)
        self._capture(chosen)

    @torch.inference_mode()
    def _capture(self, buckets: list[int] | None = None) -> None:
        buckets = self.buckets if buckets is None else buckets
        start = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        self.inputs.fill([], self.buckets[-1])  # every row padding: valid, harmless inputs
        pool = None
        device = self.device
        for bucket in reversed(buckets):  # largest first: later graphs reuse its pool
            self._step(bucket)  # eager once: compiles the kernels for these shapes
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self._stream_for(bucket)):
                self.tokens[bucket] = self._step(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        self._pool = pool
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start
        # what the capture added to the allocator's reserve: the graphs' private pool
        # (the KV budget kept room for it: engine/backends/cuda/memory.py)
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved
        log.info(
            "captured decode graphs %s in %.1f s (pool %.2f GiB)",
            buckets,
            self.capture_seconds,
            self.pool_bytes / 2**30,
        )

    def _stream_for(self, bucket: int) -> torch.cuda.Stream:
        """The stream a bucket's graphs are captured on. CudaTuning.main_stream_first: the
        kernels captured on the high-priority stream keep its priority, those on the shared
        expert's side stream the default; only buckets up to MAIN_STREAM_FIRST_MAX_BATCH
        use it."""
        prioritized = self.main_stream_first and bucket <= MAIN_STREAM_FIRST_MAX_BATCH
        return self._first if prioritized else self._equal

    @torch.inference_mode()
    def _capture_lazily(
        self, bucket: int, work: Callable[[], object]
    ) -> tuple[torch.cuda.CUDAGraph, object]:
        """A graph of `work` for `bucket` in the pool, on padding inputs (the caller fills
        the real ones after); returns (graph, what work returned). The step being launched
        may gather its inputs from the previous step's `sampled` rows, which the eager
        warm-up overwrites: they are put back."""
        torch.cuda.synchronize(self.device)  # the staging sets may still be copying
        sampled = self.inputs.sampled.clone()
        self.inputs.fill([], bucket)
        work()  # eager once, as in _capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream_for(bucket)):
            out = work()
        torch.cuda.synchronize(self.device)
        self.inputs.sampled.copy_(sampled)
        return graph, out

    def _capture_logprobs(self, bucket: int) -> None:
        """The bucket's one-graph step that also returns logprobs."""
        graph, out = self._capture_lazily(bucket, lambda: self._step(bucket, logprobs=True))
        self.logprob_graphs[bucket], self.logprob_outputs[bucket] = graph, out

    def _capture_split(self, bucket: int, logprobs: bool) -> None:
        """The bucket's split step: its forward graph, then the sample graph over the
        logits it leaves (with or without logprobs), whichever is missing. The forward's
        eager warm-up fills `split_logits` before the sample graph's reads them."""
        if bucket not in self.forward_graphs:
            graph, _ = self._capture_lazily(bucket, lambda: self._forward_to_buffer(bucket))
            self.forward_graphs[bucket] = graph
        key = (bucket, logprobs)
        if key not in self.sample_graphs:
            logits = self.split_logits[:bucket]
            graph, out = self._capture_lazily(
                bucket, lambda: self._sample(bucket, logits, logprobs)
            )
            self.sample_graphs[key], self.sample_outputs[key] = graph, out

    def fits(self, num_seqs: int) -> bool:
        """Whether a captured bucket holds a decode step of num_seqs (> 0) sequences."""
        return num_seqs > 0 and bucket_for(num_seqs, self.buckets) is not None

    def launch(
        self,
        seqs: list[Sequence],
        pending_rows: dict[int, int] | None = None,
        before_mask: Callable[[], None] | None = None,
    ) -> Callable[[], list[int]]:
        """Fill the inputs, replay the step and start copying its tokens (and the logprobs
        its rows ask for) to the host; no sync. Returns a function that waits for them,
        records the logprobs on the sequences and gives the tokens as a list.

        A step with a grammar replays the split graphs: the forward first, then, while it
        runs, `before_mask` (the model runner's wait for the previous step's tokens, which
        the grammars read) and the masks on the host, then the mask and sampler. A step
        without one never calls `before_mask`. Both paths run the same kernels on the same
        inputs, so a row's tokens do not depend on which one ran."""
        n = len(seqs)
        bucket = bucket_for(n, self.buckets)
        if bucket is None:
            raise ValueError(f"{n} sequences are more than the largest graph ({self.buckets[-1]})")
        wants = [(i, seq, seq.num_output_tokens) for i, seq in enumerate(seqs)
                 if seq.params.logprobs is not None]  # fmt: skip
        split = any(seq.grammar is not None for seq in seqs)
        if split and (bucket, bool(wants)) not in self.sample_graphs:
            self._capture_split(bucket, bool(wants))
        elif not split and wants and bucket not in self.logprob_graphs:
            self._capture_logprobs(bucket)
        host = self._host_tokens[self._host_set, :n]
        host_logprobs = self._host_logprobs[self._host_set, :n]
        self._host_set ^= 1  # the next launch may run before this one is read
        if split:
            self.inputs.fill(seqs, bucket, pending_rows, masks=False)
            self.forward_graphs[bucket].replay()
            if before_mask is not None:
                before_mask()
            self.inputs.fill_masks(seqs)
            self.sample_graphs[bucket, bool(wants)].replay()
            out = self.sample_outputs[bucket, bool(wants)]
        elif wants:
            self.inputs.fill(seqs, bucket, pending_rows)
            self.logprob_graphs[bucket].replay()
            out = self.logprob_outputs[bucket]
        else:
            self.inputs.fill(seqs, bucket, pending_rows)
            self.graphs[bucket].replay()
            out = self.tokens[bucket]
        if wants:
            tokens, block = out
            host_logprobs.copy_(block[:n], non_blocking=True)
        else:
            tokens = out
        host.copy_(tokens[:n], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        for seq in seqs:
            seq.num_computed += 1

        def read() -> list[int]:
            done.synchronize()
            raise_host_failures()  # host nodes (host-resident experts) report here
            if wants:
                rows = host_logprobs.tolist()
                k_all = MAX_TOP_LOGPROBS
                for i, seq, position in wants:
                    k, line = seq.params.logprobs, rows[i]
                    ids = [int(t) for t in line[1 + k_all : 1 + k_all + k]]
                    seq.logprobs[position] = SampledLogprobs(line[0], ids, line[1 : 1 + k])
            return host.tolist()

        return read
