"""Speculative decoding in the scheduler (a mixin of actors/engine/scheduler.py's Scheduler, on its state).

`speculation_candidates()` names the decoding requests with nothing in flight and how many drafts each may take (never
a beam group's: its beams' next tokens are the search's); a proposer drafts for them (on the device thread);
`schedule(drafts)` feeds each its last token and its drafts (planned after every row's own tokens, in the budget and
free blocks those leave: drafts never preempt, nor cost a row anything) and samples at each of those positions;
`update()` receives how many tokens each row emits (1..K+1), appends them up to the first that ends the request (no
token after the end ever gets out), rolls `num_computed_tokens` back past the rejected drafts (their KV slots are
rewritten later) and frees the lookahead blocks no longer needed.
"""

from __future__ import annotations

from actors.engine.request import EngineRequest, RequestStatus


class Lookahead:
    def speculation_candidates(self) -> list[tuple[EngineRequest, int]]:
        """The decoding requests with nothing in flight, and how many drafts each step may verify without passing
        max_tokens or max_model_len (the step budget may cut them further)."""
        out = []
        for req in self.running:
            if (
                req.beams is not None
                or req.num_pending_tokens
                or any(s.num_tokens - s.num_computed_tokens != 1 for s in req.sequences)
            ):
                continue  # (nor one whose CFG companion still prefills)
            k = req.length_limit - req.num_tokens - 1
            if k > 0:
                out.append((req, k))
        return out

    def _lookahead(self, req: EngineRequest, plan: list, budget: int, drafts: dict[str, list[int]]) -> list[int]:
        """The drafts a planned row takes: only when each sequence feeds its last token, as many as the budget left
        covers, none unless their lookahead blocks are free (drafts never preempt; a CFG companion feeds them too)."""
        row_drafts = drafts.get(req.request_id)
        if not row_drafts or any(n != 1 for _, n in plan):
            return []  # (the common row: no drafts, nothing to check)
        row_drafts = row_drafts[: budget // len(plan)]
        k = len(row_drafts)
        return row_drafts if self.block_manager.may_grow([(seq, n + k) for seq, n in plan]) else []

    def _verified(self, req: EngineRequest, num_drafts: int, accepted: int) -> None:
        """A row verified `num_drafts` drafts and accepted `accepted`: the rejected ones' KV is junk (unless the
        request was preempted meanwhile: then it recomputes everything anyway)."""
        if req.status is RequestStatus.RUNNING:
            for seq in req.sequences:
                seq.num_computed_tokens -= num_drafts - accepted
                self.block_manager.trim(seq)
        self.spec.observe(num_drafts, accepted)
