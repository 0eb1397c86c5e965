"""The order that lets the engine's prefix cache work: rows sharing a prompt prefix next to
each other, so the first of them computes the prefix and the others, admitted after it
(engine/scheduler.py holds them back while it is computed), read it from the cache instead
of each computing it while it is still uncached. Families with the longest shared prefix
go first (SGLang's longest-prefix-first): they save the most per row and their blocks are
the likeliest to be evicted if they wait behind everything else."""

from __future__ import annotations

from batchgen.rows import PreparedRow

# The engine's default block size: the cache shares only full blocks, so rows sharing
# fewer tokens than this gain nothing from being together.
MIN_SHARED_TOKENS = 16


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_prefix_order(
    rows: list[PreparedRow], min_shared: int = MIN_SHARED_TOKENS
) -> list[PreparedRow]:
    """`rows` with each family of rows that share at least `min_shared` leading prompt tokens
    together, the families by shared length, longest first, each longest prompt first;
    then the rows that share nothing, longest prompt first. (Inside a family every order
    reads the family's prefix from the cache once its first row has computed it.)"""
    families: list[tuple[int, list[PreparedRow]]] = []  # (tokens all members share, rows)
    for row in sorted(rows, key=lambda r: r.prompt_token_ids):
        if families:
            shared, members = families[-1]
            n = common_prefix_length(members[-1].prompt_token_ids, row.prompt_token_ids)
            if n >= min_shared:
                members.append(row)
                families[-1] = (min(shared, n), members)
                continue
        families.append((len(row.prompt_token_ids), [row]))
    grouped = [f for f in families if len(f[1]) > 1]
    alone = [f[1][0] for f in families if len(f[1]) == 1]
    grouped.sort(key=lambda f: -f[0])  # stable: equal lengths stay in token order
    rows_out: list[PreparedRow] = []
    for _, members in grouped:
        rows_out += sorted(members, key=lambda r: -r.num_prompt_tokens)
    return rows_out + sorted(alone, key=lambda r: -r.num_prompt_tokens)
