"""One sequence's position in its grammar."""

from __future__ import annotations

import torch


class SequenceGrammar:
    """Follows a sequence's output tokens through its compiled grammar.

    The engine never feeds it tokens: before a mask is built, `sync` catches it up with
    the sequence's output so far, so it stays right across async steps, speculative drafts,
    preemption and recompute (the sequence keeps its tokens; a shorter output rolls the
    matcher back, or rebuilds it from the tokens)."""

    def __init__(self, compiled, max_rollback_tokens: int = 0) -> None:
        import xgrammar as xgr

        self._compiled = compiled
        self._max_rollback = max_rollback_tokens
        self._matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=max_rollback_tokens)
        self._tokens: list[int] = []  # accepted so far

    @property
    def num_accepted(self) -> int:
        return len(self._tokens)

    def _rebuild(self) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(self._compiled, max_rollback_tokens=self._max_rollback)
        self._tokens = []

    def sync(self, output_token_ids: list[int]) -> None:
        """Accept the tokens of `output_token_ids` not accepted yet (it holds no pending
        placeholder). Raises RuntimeError on a token the grammar refuses: the mask should
        have made it impossible."""
        n = len(self._tokens)
        if n and (len(output_token_ids) < n or output_token_ids[n - 1] != self._tokens[-1]):
            self._rebuild()  # the output is not an extension of what was accepted
            n = 0
        for token in output_token_ids[n:]:
            if not self._matcher.accept_token(token):
                raise RuntimeError(
                    f"token {token} at output position {len(self._tokens)} breaks the grammar"
                )
            self._tokens.append(token)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 words, bit v % 32 of
        word v // 32 set for an allowed token v)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def try_accept(self, token: int) -> bool:
        """Accept one more token (a draft) if the grammar allows it; `rollback` undoes it."""
        if self._matcher.accept_token(token):
            self._tokens.append(token)
            return True
        return False

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)
            del self._tokens[-num_tokens:]

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()
