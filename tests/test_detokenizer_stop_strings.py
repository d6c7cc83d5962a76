"""StopChecker: matches anywhere and across chunks, holds back only what may start a stop string."""

from __future__ import annotations

import random

import pytest

from actors.detokenizer.stop_strings import StopChecker


def run(chunks: list[str], stop: list[str], include: bool = False) -> tuple[list[str], str | None]:
    """Feed the chunks; the emitted pieces (the last one is finish()'s unless stopped) and the match."""
    checker = StopChecker(stop, include)
    pieces = []
    for chunk in chunks:
        piece, matched = checker.feed(chunk)
        pieces.append(piece)
        if matched is not None:
            return pieces, matched
    return [*pieces, checker.finish()], None


def reference(text: str, stop: list[str], include: bool = False) -> tuple[str, str | None]:
    """Cut the whole text at the stop string that completes first (ties: the longest)."""
    hits = [(text.find(s) + len(s), -len(s), s) for s in stop if s in text]
    if not hits:
        return text, None
    end, neg_len, s = min(hits)
    return text[: end if include else end + neg_len], s


def test_stop_string_across_a_token_boundary():
    assert run(["Hello E", "N", "D world"], ["END"]) == (["Hello ", "", ""], "END")


def test_stop_string_spanning_three_chunks_and_include_in_output():
    chunks = ["ab<", "st", "op>", "cd"]
    assert run(chunks, ["<stop>"]) == (["ab", "", ""], "<stop>")
    assert run(chunks, ["<stop>"], include=True) == (["ab<", "st", "op>"], "<stop>")


def test_stop_string_at_the_very_end():
    assert run(["The end", "."], ["end."]) == (["The ", ""], "end.")
    assert run(["The end."], ["end."], include=True) == (["The end."], "end.")


def test_held_back_text_is_released_on_finish():
    pieces, matched = run(["Hello E", "N"], ["END"])
    assert matched is None
    assert pieces == ["Hello ", "", "EN"]  # "E", "EN" might still become "END"


def test_only_a_possible_stop_prefix_is_held_back():
    pieces, _ = run(["one two", " three"], ["\n\nUser:"])
    assert pieces == ["one two", " three", ""]
    pieces, _ = run(["one\n", "\nUs", "e", "x"], ["\n\nUser:"])
    assert pieces == ["one", "", "", "\n\nUsex", ""]


def test_the_earliest_ending_match_wins():
    assert run(["Hello world"], ["world", "lo w"]) == (["Hel"], "lo w")
    assert run(["abcd"], ["abcd", "c"]) == (["ab"], "c")  # as if streamed char by char
    assert run(["xabc"], ["bc", "abc"]) == (["x"], "abc")  # same end: the earlier start


def test_a_match_only_in_unchecked_text_is_ignored_but_one_reaching_checked_text_counts():
    checker = StopChecker(["END"])
    assert checker.feed("xEND", check=False) == ("xEND", None)
    assert checker.feed("E", check=False) == ("", None)
    assert checker.feed("ND!") == ("", "END")


def test_no_stop_strings_passes_text_through():
    checker = StopChecker([])
    assert checker.feed("abc") == ("abc", None)
    assert checker.finish() == ""


@pytest.mark.parametrize("include", [False, True])
def test_every_chunking_gives_the_reference_result(include):
    rng = random.Random(0)
    alphabet = "ab c\n#"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        pieces, matched = run(chunks, stop, include)
        assert ("".join(pieces), matched) == reference(text, stop, include), (chunks, stop)
        emitted = ""
        for piece in pieces:  # never emits a character that the final text does not have
            emitted += piece
            assert reference(text, stop, include)[0].startswith(emitted)
