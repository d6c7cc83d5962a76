"""Speculative decoding's acceptance counters (vLLM's spec_decode counters), which the scheduler keeps per step and
actors/engine/metrics.py reports. Imports nothing of ours."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """vLLM's spec_decode counters: rows that verified drafts, draft tokens, accepted ones (and per position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def observe(self, num_drafts: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        self.accepted_per_pos.extend([0] * (num_drafts - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def since(self, last: SpecStats) -> str | None:
        """Acceptance rate and mean accepted length since `last` (None: no drafts since)."""
        drafts, accepted = self.num_drafts - last.num_drafts, self.num_accepted_tokens - last.num_accepted_tokens
        if not drafts:
            return None
        rate = accepted / (self.num_draft_tokens - last.num_draft_tokens)
        return f"{drafts} drafts, acceptance rate {100 * rate:.1f}%, mean accepted length {1 + accepted / drafts:.2f}"
