"""A decode step that has been launched but not read back (async scheduling).

With async scheduling the engine launches decode step n+1 before it reads step n's tokens,
so the host's work for a step (scheduling, filling the graph's inputs, reading tokens back,
stop checks) runs while the GPU computes the next one instead of leaving it idle. A launch
appends PENDING_TOKEN to each of its sequences (their lengths, cache slots and block
counts are then those of the step that will follow) and returns a PendingStep; the engine
resolves it one launch later, writing the real tokens in place of the placeholders.

The next step's input for a sequence whose last token is still pending is that token on the
device: a CUDA-graph step reads it from the previous step's sampled tokens by row
(`device_rows`); any other step first writes the previous step's tokens on the host
(`write_tokens`, which waits for them). A graph step with a grammar does both: its forward
gathers the tokens on the device, and its mask waits for them on the host.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.sequence import PENDING_TOKEN, Sequence


class PendingStep:
    """Row i of the step sampled the token at seqs[i].token_ids[positions[i]]."""

    def __init__(
        self,
        seqs: list[Sequence],
        positions: list[int],
        read: Callable[[], list[int]],
        device_rows: bool = False,
    ) -> None:
        self.seqs = seqs
        self.positions = positions
        self._read = read
        self._tokens: list[int] | None = None
        # True when the tokens also sit on the device, in the rows the next CUDA-graph
        # step gathers its pending inputs from.
        self.device_rows = device_rows

    def tokens(self) -> list[int]:
        """The sampled tokens, row by row (waits for the device the first time)."""
        if self._tokens is None:
            self._tokens = self._read()
        return self._tokens

    def row_of(self) -> dict[int, int]:
        """seq_id -> row, for the next step's gather of pending inputs."""
        return {seq.seq_id: row for row, seq in enumerate(self.seqs)}

    def write_tokens(self) -> None:
        """Put the real tokens in place of the placeholders (no stop checks: the engine
        makes those when it resolves the step). Sequences that were cut short since keep
        their shorter length."""
        for seq, pos, token in zip(self.seqs, self.positions, self.tokens()):
            if pos < len(seq.token_ids) and seq.token_ids[pos] == PENDING_TOKEN:
                seq.token_ids[pos] = token
