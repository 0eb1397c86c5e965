"""One sequence's position in its grammar."""

from __future__ import annotations

import torch


class SequenceGrammar:
    """Follows a sequence's output tokens through its grammar (a copy of the compiled
    start-state matcher, engine/structured_output/compiler.py).

    The engine never feeds it tokens: before a mask is built, `sync` catches it up with
    the sequence's output so far, so it stays right across async steps, speculative drafts,
    preemption and recompute (the sequence keeps its tokens; an output that is not an
    extension of what was accepted rebuilds the matcher from the tokens)."""

    def __init__(self, compiled) -> None:
        self._compiled = compiled
        self.matcher = compiled.deep_copy()
        self._tokens: list[int] = []  # accepted so far

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
        if self.matcher.is_stopped() or not self.matcher.validate_tokens([token]):
            return False
        self.matcher.consume_token(token)
        self._tokens.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)
            del self._tokens[-num_tokens:]
