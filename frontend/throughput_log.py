"""The serving log's pulse: every interval (10 s, vLLM's), one line per engine replica, as vLLM prints it:

  engine 0: prompt 412.3 tok/s, generation 96.0 tok/s, running 8, waiting 2, KV cache 37.5%, prefix cache hit rate 61.2%

Throughputs are the interval's tokens (the detokenizer's counters: what reached requests) over its length, from a
replica's first report on (its first interval is its baseline: the HTTP process may restart alone); running,
waiting and KV use are the engine's latest report; the hit rate is the interval's (hits / queries, "-" without
queries); a counter lower than before is a restarted actor's, counted from zero. An idle interval (no tokens, nothing running or waiting) after an idle one is not logged: a quiet server
leaves a quiet log, and the line that says it went idle is the last.
"""

from __future__ import annotations

from dataclasses import dataclass

from frontend.metrics import NO_DETOK_STATS, NO_ENGINE_STATS, Metrics


@dataclass
class _Last:
    at: float
    prompt: int = 0
    generation: int = 0
    queries: int = 0
    hits: int = 0
    busy: bool = False


class ThroughputLog:
    def __init__(self, metrics: Metrics, now: float, interval_s: float = 10.0):
        self.metrics = metrics
        self.interval_s = interval_s
        self._last: dict[int, _Last] = {}
        self._start = now

    def lines(self, now: float) -> list[str]:
        """The lines due at `now` (none before the interval has passed)."""
        if now - max((last.at for last in self._last.values()), default=self._start) < self.interval_s:
            return []
        out = []
        for k in range(len(self.metrics.replicas)):
            e = self.metrics.engine.get(k, NO_ENGINE_STATS)
            d = self.metrics.detok.get(k, NO_DETOK_STATS)
            if (last := self._last.get(k)) is None:  # (its first report: the baseline, whatever it counted before)
                if k in self.metrics.detok:
                    self._last[k] = _Last(now, d.prompt_tokens_total, d.generation_tokens_total,
                                          e.prefix_cache_queries_total, e.prefix_cache_hits_total)  # fmt: skip
                continue
            span = max(now - last.at, 1e-9)
            # (a restarted actor counts from zero: a negative difference is the new count)
            prompt = _since(d.prompt_tokens_total, last.prompt)
            generation = _since(d.generation_tokens_total, last.generation)
            queries = _since(e.prefix_cache_queries_total, last.queries)
            hits = _since(e.prefix_cache_hits_total, last.hits)
            busy = bool(prompt or generation or e.num_running or e.num_waiting)
            self._last[k] = _Last(now, d.prompt_tokens_total, d.generation_tokens_total, e.prefix_cache_queries_total,
                                  e.prefix_cache_hits_total, busy)  # fmt: skip
            if busy or last.busy:
                rate = f"{100 * hits / queries:.1f}%" if queries else "-"
                out.append(
                    f"engine {k}: prompt {prompt / span:.1f} tok/s, generation {generation / span:.1f} tok/s, "
                    f"running {e.num_running}, waiting {e.num_waiting}, KV cache {100 * e.kv_usage:.1f}%, "
                    f"prefix cache hit rate {rate}"
                )
        return out


def _since(total: int, last: int) -> int:
    return total - last if total >= last else total
