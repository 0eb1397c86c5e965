"""The grammar bitmask of a batch's sampling rows, built on the host."""

from __future__ import annotations

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
    for i, seq in enumerate(rows):
        if seq.grammar is not None:
            seq.grammar.sync(seq.output_token_ids)
            seq.grammar.fill(bitmask, i)
    return bitmask, constrained
