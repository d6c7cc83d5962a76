"""actors.protocol's message numbering (DESIGN I6): StepNumbers finds duplicates, reorders and losses on a
numbered link; SentNames and `recent` name the requests a lost message held, so only those are repaired."""

from __future__ import annotations

from dataclasses import dataclass

from actors.protocol import SentNames, StepNumbers, lost_suspects


@dataclass
class Heard:
    heard: int  # the last message with output of the request


def test_sent_names_leave_out_the_requests_the_stamped_message_holds():
    """A request in the stamped message would show a loss before it as a seq gap: only the others are named."""
    names = SentNames()
    assert names.stamp(0, ["a", "b"]) == []
    assert names.stamp(1, ["a"]) == [(0, ["b"])]
    assert names.stamp(2, ["c"]) == [(1, ["a"]), (0, ["a", "b"])]
    assert names.stamp(3, ["a", "c"]) == [(2, []), (1, [])]


def test_a_lost_message_named_later_makes_suspects_of_its_requests_alone():
    link, names = StepNumbers(), SentNames()
    sent = [(n, names.stamp(n, ids)) for n, ids in enumerate([["a", "b", "c"], ["b"], ["a", "c"], [], []])]
    records = {rid: Heard(0) for rid in "abcd"}
    for n, recent in (sent[0], sent[2], sent[3]):  # 1 is lost: it held b's output
        assert link.accept(n, recent)
    lost = link.lost()
    assert (len(lost), str(lost)) == (1, "1") and lost_suspects(link, lost, records.items()) == ["b"]


def test_an_unnamed_loss_falls_back_to_every_request_not_heard_from_since():
    """1, 2 and 3 go missing; 2 arrives late (reordered) and again (a duplicate). 1, two messages behind the last,
    is lost and no message named it (4 names 3 and 2 only): every request not heard from since it is a suspect."""
    link = StepNumbers()
    assert link.accept(0) and link.accept(4, [(3, ["x"]), (2, ["y"])])
    assert link.accept(2) and not link.accept(2)
    records = {"x": Heard(0), "y": Heard(2), "z": Heard(4)}
    lost = link.lost()
    assert (len(lost), str(lost)) == (1, "1") and lost_suspects(link, lost, records.items()) == ["x"]
    assert list(link.missing) == [3] and link.named == {3: ["x"]}  # lost by time later: x alone


def test_a_long_gap_is_reported_whole_and_its_untracked_part_may_still_arrive_late():
    """0, then 10**6: the numbers 1 .. 999999 are missing, the last KEPT one by one, the run before them as one entry.
    One of that run arriving before the loss is declared is a late message (accepted, out of the run; again: a
    duplicate); the loss counts every number and names the runs."""
    link = StepNumbers()
    assert link.accept(0) and link.accept(10**6)
    assert link.accept(500) and not link.accept(500) and link.accept(10**6 - 1)
    lost = link.lost()
    assert (len(lost), str(lost)) == (10**6 - 3, "1..499, 501..999998")
    assert not link.missing and not link.accept(7), "lost, then late: taken as a duplicate (its requests repaired)"
