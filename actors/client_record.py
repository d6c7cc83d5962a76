"""A client's record of one engine request (DESIGN I8, I6): what it first sent, what arrived, which copy of it the
client follows and on which replica; the ledger of such records is actors/client_ledger.py."""

from __future__ import annotations

import msgspec

from actors.protocol import CLIENT_COPIES, MAX_ATTEMPTS, next_attempt
from actors.routing import ReplicaLink
from messages.wire import AddRequest


class RequestRecord:
    """A client's durable record of one engine request (DESIGN I8) and the check of its outputs (I6): what it
    first sent, the tokens and characters of text received so far, which copy of the request it follows and the
    replica that runs that copy.

    `check(seq, n, attempt)` of an output bringing n tokens: "ok" (the next one: take it, and `received` it),
    "stale" (an older copy's, still in flight), "duplicate" (seen before) or "gap" (something before it was
    lost). A newer copy's output (the detokenizer re-submitted the request) makes that copy the one followed."""

    __slots__ = ("add", "attempt", "deaths", "generation", "heard", "num_chars", "replica", "token_ids")

    def __init__(self, add: AddRequest, replica: ReplicaLink):
        self.add = add
        self.token_ids: list[int] = []
        self.num_chars = 0
        self.attempt = add.attempt
        self.deaths = 0  # detokenizer deaths it was live at (a poison request's are bounded)
        self.move(replica)

    def move(self, replica: ReplicaLink) -> None:
        """Its next copy runs on `replica`."""
        self.replica, self.generation = replica, replica.generation
        self.heard = replica.link.last  # the number of the last TextOutputs on its replica's link whose output of it
        # was taken (or that came before it)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def orphaned(self) -> bool:
        """Its replica forgot it (or never took it): it is to be re-submitted."""
        return self.generation != self.replica.generation or self.replica.forgot

    def follows(self, attempt: int) -> bool:
        """False for an output (or Finished) of an older copy; one of a newer copy makes that copy the one followed
        (a repair goes on above it)."""
        self.attempt = max(self.attempt, attempt)
        return attempt == self.attempt

    def check(self, seq: int, n: int, attempt: int) -> str:
        if not self.follows(attempt):
            return "stale"
        if seq == len(self.token_ids):
            return "ok"
        return "duplicate" if seq + n <= len(self.token_ids) else "gap"

    def received(self, text: str, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.num_chars += len(text)

    def resume(self) -> AddRequest | None:
        """The request's next copy, going on after what was received; None once it had MAX_ATTEMPTS copies."""
        if self.attempt >= MAX_ATTEMPTS:
            return None
        self.attempt = next_attempt(self.attempt, CLIENT_COPIES)
        return msgspec.structs.replace(
            self.add, resume_token_ids=list(self.token_ids), resume_chars=self.num_chars, attempt=self.attempt
        )
