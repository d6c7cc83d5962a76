"""The token counters of /metrics, kept where vLLM keeps them (its output processor): what reached a live request.

  counter                   counts                                                     per
  prompt_tokens_total       a request's whole prompt (cached part included)           request, at its first tokens
  generation_tokens_total   the output tokens a request was given (up to a stop)       output
  iteration_tokens_total    both, summed over one engine step's outputs (histogram)   step that gave a request tokens

So vLLM's test holds exactly (10 requests of 9 prompt and 10 output tokens: 90, 100, and 100 steps holding 190
tokens): a step's scheduled tokens would miss each request's last token and count steps whose output was discarded,
and the engine's own counts (EngineStats) include the tokens computed past a stop string before its Abort arrived.
"""

from __future__ import annotations

from messages.wire import Finished, TextDelta


class TokenCounts:
    def __init__(self):
        self.prompt = 0
        self.generated = 0
        self._steps: list[int] = []  # each step's tokens, since the last `take_steps`
        self._step = 0

    def output(self, num_prompt_tokens: int | None, deltas: list[TextDelta], finished: Finished | None) -> None:
        """A request's output of this step; `num_prompt_tokens` while it has had no tokens (else None): its prompt
        is counted with its first tokens (a request failed before any, as a refused one, counts nothing)."""
        n = sum(len(d.token_ids) for d in deltas) + (len(finished.token_ids) if finished is not None else 0)
        if n:
            self.generated += n
            self.prompt += num_prompt_tokens or 0
            self._step += n + (num_prompt_tokens or 0)

    def end_step(self) -> None:
        if self._step:
            self._steps.append(self._step)
            self._step = 0

    def report(self) -> dict:
        """DetokStats' fields: the totals, and the steps since the last report."""
        steps, self._steps = self._steps, []
        return {
            "prompt_tokens_total": self.prompt,
            "generation_tokens_total": self.generated,
            "iteration_tokens": steps,
        }
