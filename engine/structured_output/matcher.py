"""One sequence's position in its grammar."""

from __future__ import annotations

import torch


class SequenceGrammar:
    """Follows a sequence's output tokens through its grammar (a copy of the compiled
    start-state matcher, engine/structured_output/compiler.py).

    The engine never feeds it tokens: before a mask is built, `sync` catches it up with
    the sequence's output so far, so it stays right across async steps, speculative drafts,
    preemption and recompute (the sequence keeps its tokens; an output that is not an
    extension of what was accepted rebuilds the matcher from the tokens).

    Once the grammar is complete with nothing that may follow (a JSON object's closing
    brace), llguidance stops the matcher, which then refuses even EOS; a stop token there
    is accepted here without reaching the matcher. It arrives that way under async
    scheduling: the next step is scheduled before the EOS is read, and its mask is built
    from an output that already ends with it (the engine drops that step's token)."""

    def __init__(self, compiled, stop_token_ids: list[int] | tuple[int, ...] = ()) -> None:
        self._compiled = compiled
        self._stop_token_ids = frozenset(stop_token_ids)
        self.matcher = compiled.deep_copy()
        self._tokens: list[int] = []  # accepted so far
        self._after_stop = 0  # trailing stop tokens accepted past the matcher's end

    @property
    def num_accepted(self) -> int:
        return len(self._tokens)

    def sync(self, output_token_ids: list[int]) -> None:
        """Accept the tokens of `output_token_ids` not accepted yet (it holds no pending
        placeholder). Raises RuntimeError on a token the grammar refuses: the mask should
        have made it impossible."""
        n = len(self._tokens)
        if n and (len(output_token_ids) < n or output_token_ids[n - 1] != self._tokens[-1]):
            self.matcher = self._compiled.deep_copy()
            self._tokens = []
            self._after_stop = 0
            n = 0
        for token in output_token_ids[n:]:
            if not self.try_accept(token):
                raise RuntimeError(
                    f"token {token} at output position {len(self._tokens)} breaks the grammar: "
                    f"{self.matcher.get_error()}"
                )

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 words, bit v % 32 of
        word v // 32 set for an allowed token v)."""
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def try_accept(self, token: int) -> bool:
        """Accept one more token (a draft) if the grammar allows it; `rollback` undoes it.
        A refused token leaves the matcher as it was."""
        if self.matcher.is_stopped():
            if token not in self._stop_token_ids:
                return False
            self._after_stop += 1
        elif self.matcher.validate_tokens([token]):
            self.matcher.consume_token(token)
        else:
            return False
        self._tokens.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            past_end = min(num_tokens, self._after_stop)
            self._after_stop -= past_end
            if num_tokens > past_end:
                self.matcher.rollback(num_tokens - past_end)
            del self._tokens[-num_tokens:]
