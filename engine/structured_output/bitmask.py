"""The grammar bitmask of a batch's sampling rows, built on the host."""

from __future__ import annotations

from functools import lru_cache

import torch

from engine.sequence import Sequence


def grammar_bitmask(
    rows: list[Sequence], vocab_size: int, pin: bool = False
) -> tuple[torch.Tensor | None, list[bool] | None]:
    """(bitmask [N, ceil(V/32)] int32, constrained [N]) for rows that sample next; (None,
    None) when no row has a grammar."""
    if not any(seq.grammar is not None for seq in rows):
        return None, None
    bitmask = torch.empty((len(rows), -(-vocab_size // 32)), dtype=torch.int32, pin_memory=pin)
    return bitmask, fill_grammar_bitmask(rows, bitmask)


def fill_grammar_bitmask(rows: list[Sequence], bitmask: torch.Tensor) -> list[bool]:
    """Write the rows' masks into bitmask [N, W] (a contiguous CPU int32 tensor) and
    return which rows are constrained. Each grammar first catches up with its sequence's
    output; a free row's words are all ones (every token allowed)."""
    bitmask.fill_(-1)
    pairs = []
    for i, seq in enumerate(rows):
        if seq.grammar is not None:
            seq.grammar.sync(seq.output_token_ids)
            pairs.append((seq.grammar.matcher, i))
    if len(pairs) == 1:
        rows[pairs[0][1]].grammar.fill(bitmask, pairs[0][1])
    elif pairs:  # llguidance's threads fill the rows in parallel, without the GIL
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask_par(_executor(), pairs, bitmask)
    return [seq.grammar is not None for seq in rows]


@lru_cache(maxsize=1)
def _executor():
    import llguidance

    return llguidance.LLExecutor()
