"""Live counters of a run, for the progress display and the error budget."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from batchgen.rows import ResultRow

# Throughput is measured over the last minute, so the ETA follows the current speed
# rather than the slow start (model load, first prefill).
_RATE_WINDOW_S = 60.0


@dataclass
class RunStats:
    rows_total: int  # input rows of the job
    n: int  # completions per row
    rows_done_before: int = 0  # committed by earlier sessions
    ok: int = 0  # result rows, this session
    error: int = 0
    errors_before: int = 0
    rows_done: int = 0  # input rows finished this session
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # prompt tokens of every ok completion (each prefills its prompt), and of those the
    # ones read from the engine's prefix cache
    prefilled_prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    current_cluster: int | None = None
    engine_restarts: int = 0  # engines rebuilt after a fault, this session
    started: float = field(default_factory=time.time)
    _window: deque = field(default_factory=deque)  # (time, prompt tok, completion tok)

    def record_row(self, results: list[ResultRow]) -> None:
        """Count the result rows of one finished input row."""
        now = time.time()
        self.rows_done += 1
        p = c = 0
        for r in results:
            if r.ok:
                self.ok += 1
                self.finish_reasons[r.finish_reason] += 1
                self.prefilled_prompt_tokens += r.prompt_tokens
                self.cached_prompt_tokens += r.cached_prompt_tokens
            else:
                self.error += 1
            c += r.completion_tokens
        if results and results[0].ok:
            p = results[0].prompt_tokens
        self.prompt_tokens += p
        self.completion_tokens += c
        if results and results[0].cluster_id is not None:
            self.current_cluster = results[0].cluster_id
        self._add_to_window(now, p, c)

    def record_block(
        self,
        rows: int,
        ok: int,
        error: int,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reasons: dict[str, int],
        prefilled_prompt_tokens: int = 0,
        cached_prompt_tokens: int = 0,
    ) -> None:
        """Count the rows of a block another process ran (a Ray worker), as one event."""
        self.rows_done += rows
        self.ok += ok
        self.error += error
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.prefilled_prompt_tokens += prefilled_prompt_tokens
        self.cached_prompt_tokens += cached_prompt_tokens
        self.finish_reasons.update(finish_reasons)
        self._add_to_window(time.time(), prompt_tokens, completion_tokens)

    def _add_to_window(self, now: float, p: int, c: int) -> None:
        # One bucket per second keeps the window small however fast rows finish.
        second = int(now)
        if self._window and self._window[-1][0] == second:
            _, wp, wc = self._window[-1]
            self._window[-1] = (second, wp + p, wc + c)
        else:
            self._window.append((second, p, c))
        while self._window and now - self._window[0][0] > _RATE_WINDOW_S:
            self._window.popleft()

    @property
    def rows_finished(self) -> int:
        return self.rows_done_before + self.rows_done

    @property
    def errors_total(self) -> int:
        return self.errors_before + self.error

    def rates(self) -> tuple[float, float]:
        """(prompt tok/s, output tok/s) over the recent window."""
        if not self._window:
            return 0.0, 0.0
        span = max(min(time.time() - self.started, _RATE_WINDOW_S), 1e-6)
        p = sum(w[1] for w in self._window)
        c = sum(w[2] for w in self._window)
        return p / span, c / span

    def eta_seconds(self) -> float | None:
        """Remaining rows times the tokens a row has cost so far, over the current token
        rate (prompt and output tokens together)."""
        if self.rows_done == 0:
            return None
        remaining = self.rows_total - self.rows_finished
        per_row = (self.prompt_tokens + self.completion_tokens) / self.rows_done
        p_rate, c_rate = self.rates()
        rate = p_rate + c_rate
        if rate <= 0:
            return None
        return remaining * per_row / rate

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """The share of the ok completions' prompt tokens read from the prefix cache."""
        if not self.prefilled_prompt_tokens:
            return None
        return self.cached_prompt_tokens / self.prefilled_prompt_tokens

    def snapshot(self) -> dict:
        p_rate, c_rate = self.rates()
        eta = self.eta_seconds()
        return {
            "rows_total": self.rows_total,
            "rows_done": self.rows_finished,
            "ok": self.ok,
            "error": self.errors_total,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefix_cache_hit_rate": (
                None if self.prefix_cache_hit_rate is None else round(self.prefix_cache_hit_rate, 4)
            ),
            "prompt_tok_s": round(p_rate, 1),
            "output_tok_s": round(c_rate, 1),
            "eta_s": None if eta is None else round(eta, 1),
            "elapsed_s": round(time.time() - self.started, 1),
            "current_cluster": self.current_cluster,
            "engine_restarts": self.engine_restarts,
        }
