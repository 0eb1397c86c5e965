"""The grammar bitmask of a batch's sampling rows, built on the host."""

from __future__ import annotations

from functools import lru_cache

import torch

from engine.sequence import Sequence


def grammar_bitmask(
    rows: list[Sequence], vocab_size: int, pin: bool = False
) -> tuple[torch.Tensor | None, list[bool] | None]:
    """(bitmask [N, ceil(V/32)] int32, constrained [N]) for rows that sample next; (None,
    None) when no row has a grammar. Each grammar first catches up with its sequence's
    output; a free row's words are all ones (every token allowed)."""
    constrained = [seq.grammar is not None for seq in rows]
    if not any(constrained):
        return None, None
    bitmask = torch.full((len(rows), -(-vocab_size // 32)), -1, dtype=torch.int32)
    if pin:
        bitmask = bitmask.pin_memory()
    pairs = []
    for i, seq in enumerate(rows):
        if seq.grammar is not None:
            seq.grammar.sync(seq.output_token_ids)
            pairs.append((seq.grammar.matcher, i))
    if len(pairs) == 1:
        rows[pairs[0][1]].grammar.fill(bitmask, pairs[0][1])
    else:  # llguidance's threads fill the rows in parallel, without the GIL
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask_par(_executor(), pairs, bitmask)
    return bitmask, constrained


@lru_cache(maxsize=1)
def _executor():
    import llguidance

    return llguidance.LLExecutor()
