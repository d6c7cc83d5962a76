"""Stop strings on streamed text: matched anywhere, across token boundaries, with hold-back.

Each `feed` searches for matches that end in the new text; they may start in the characters kept
from before (at most `max(len(stop)) - 1`). The earliest-ending match wins (ties: the one starting
first): that is what a character-by-character stream sees first, so the result does not depend on how
the text was chunked. Unless the stop string goes into the output, the trailing characters that could
still begin a stop string (a proper prefix of one, so at most `max(len(stop)) - 1`) are held back
while streaming and released by `finish()`. Holding back only those, instead of always the last
`max(len(stop)) - 1` characters as vLLM does, gives the same text and guarantees, streams ordinary
text without delay, and keeps the common step free of string slicing (DESIGN §9 budget). A run of several
tokens (speculative decoding) is checked token by token (`token_by_token`), so that nothing after a stop string
gets out.
"""

from __future__ import annotations

import msgspec

from messages.wire import RequestOutput


def token_by_token(out: RequestOutput) -> list[RequestOutput]:
    """One entry per token of `out`: its finish on the last, what comes with a first output on the first."""
    last = len(out.new_token_ids) - 1
    return [
        msgspec.structs.replace(
            out,
            seq=out.seq + i,
            new_token_ids=[token],
            logprobs=out.logprobs and out.logprobs.part(i, i + 1),
            **({} if i == last else {"finish_reason": None, "stop_reason": None, "timings": None}),
            **({} if i == 0 else {"prompt_logprobs": None, "num_cached_tokens": None}),
        )
        for i, token in enumerate(out.new_token_ids)
    ]


class StopChecker:
    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False):
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._first_chars = sorted({s[0] for s in self.stop})
        self._lookback = max(map(len, self.stop), default=1) - 1
        # The longest suffix of the text fed so far that is a proper prefix of a stop string: held
        # back (not emitted) unless include_stop_str_in_output, and the context for the next search.
        self._tail = ""

    def feed(self, text: str, check: bool = True) -> tuple[str, str | None]:
        """Add decoded text. Returns (text to emit now, matched stop string or None). On a match the
        emitted text ends where the stop string starts (or ends, with include_stop_str_in_output) and
        the stream is over. `check=False` (min_tokens) adds the text without searching it."""
        window = self._tail + text if self._tail else text
        for c in self._first_chars:  # no first character in sight: nothing to match or hold back
            if c in window:
                break
        else:
            return text, None
        if check:
            for s in self.stop:
                if s in window:  # a pre-test: the match may lie wholly in old text
                    found = self._match(window, len(self._tail))
                    if found is not None:
                        return found
                    break
        held = self._held_from(window)
        emitted = text if self.include_stop_str_in_output else window[:held]
        self._tail = window[held:]
        return emitted, None

    def resume(self, text: str, delivered: int) -> None:
        """A stream rebuilt after a restart: `text` was fed before, of which the first `delivered` characters
        were emitted; the rest is what was held back."""
        self._tail = text[self._held_from(text) :] if self.include_stop_str_in_output else text[delivered:]

    @property
    def held(self) -> int:
        """How many characters fed so far are held back (not yet emitted)."""
        return 0 if self.include_stop_str_in_output else len(self._tail)

    def finish(self) -> str:
        """End of stream: release the held-back characters."""
        text = "" if self.include_stop_str_in_output else self._tail
        self._tail = ""
        return text

    def _held_from(self, window: str) -> int:
        """Where the longest suffix of `window` that is a proper prefix of a stop string starts."""
        for p in range(max(len(window) - self._lookback, 0), len(window)):
            if window[p] in self._first_chars:
                suffix = window[p:]
                if any(len(suffix) < len(s) and s.startswith(suffix) for s in self.stop):
                    return p
        return len(window)

    def _match(self, window: str, new_from: int) -> tuple[str, str] | None:
        """The earliest-ending match that ends in window[new_from:], as (text to emit, stop string)."""
        start, end, matched = -1, -1, None
        for s in self.stop:
            i = window.find(s, max(new_from - len(s) + 1, 0))
            if i != -1 and (matched is None or i + len(s) < end or (i + len(s) == end and i < start)):
                start, end, matched = i, i + len(s), s
        if matched is None:
            return None
        self._tail = ""
        if self.include_stop_str_in_output:
            return window[new_from:end], matched
        return window[:start], matched
