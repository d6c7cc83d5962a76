"""One request's detokenization state: engine outputs in, TextDelta / Finished out.

`process` applies, in order: the seq check (DESIGN I6), incremental decoding, min_tokens, stop
strings with hold-back, and the engine's own finish (EOS / stop token / length / error). It is pure
and synchronous; the detokenizer actor owns mailboxes, tombstones and Aborts. After a call, a
non-None `abort_reason` means this state ended the request while the engine still runs it ("stop"
for a stop string, "error" for a seq gap or a bad token id): the actor must send Abort(reason=...).
A non-terminal entry always gives a TextDelta (its text may be '': held back or half a character),
so token ids and logprobs flow on; the terminal one gives only the Finished, which carries the last
text. With `params.logprobs`, `logprobs_text` holds the display strings and text offsets of the
last entry's tokens (they have no wire field).
"""

from __future__ import annotations

import msgspec
from tokenizers import Tokenizer

from actors.detokenizer.incremental import IncrementalDetokenizer
from actors.detokenizer.logprob_text import DecodedLogprobs, decode_logprob_tokens
from actors.detokenizer.stop_strings import StopChecker, token_by_token
from actors.protocol import DETOK_COPIES, next_attempt
from messages.wire import AbortReason, AddRequest, Finished, RequestOutput, TextDelta, TokenLogprobs


def abort_finished(fin: Finished, reason: AbortReason) -> Finished:
    """An aborted request's Finished: finish_reason abort, the reason in stop_reason; one aborted because it failed
    (reason error: a failure already told, and lost on the way) ends as an error again."""
    if reason == "error":
        fin.finish_reason, fin.error = "error", f"request {fin.request_id}: failed"
    else:
        fin.finish_reason, fin.stop_reason = "abort", reason
    return fin


class DetokRequestState:
    def __init__(self, request: AddRequest, tokenizer: Tokenizer, *, method: str | None = None):
        params = request.params
        self.request = request  # the record a repair re-submits, with what the client has so far:
        self.output_ids = list(request.resume_token_ids or [])  # ... the tokens (every token processed)
        self.attempt = request.attempt
        self.client = request.client  # the actor that receives its text
        self.heard = -1  # the actor's: the last step that registered it or had an entry of it
        self.request_id = request.request_id
        self.params = params
        self.tokenizer = tokenizer
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.finished = False
        self.abort_reason: AbortReason | None = None
        self.duplicates_dropped = 0
        self.logprobs_text: DecodedLogprobs | None = None  # of the last processed entry
        self.prompt_logprobs: TokenLogprobs | None = None  # from the first entry, for the Finished
        self.num_cached_tokens = 0  # likewise
        self._stop = StopChecker(params.stop, params.include_stop_str_in_output) if params.stop else None
        self._offsets: list[int] | None = [] if params.logprobs is not None else None
        self._decoded_chars = 0  # length of the generated text decoded so far (before hold-back)
        self._error: str | None = None
        self._plain = False  # may `process` take its hot path? (decided by _process)
        try:
            self._detok = self._new_detok(method)
        except ValueError as e:  # an out-of-vocab prompt id: the first output fails the request
            self._error = f"invalid prompt: {e}"
        if request.resume_token_ids and self._error is None:
            self._resume(request.resume_token_ids, request.resume_chars)

    def _resume(self, token_ids: list[int], delivered: int) -> None:
        """A resumed request (DESIGN I8): decode the tokens its client has; the text past the `delivered`
        characters it has is the held-back text (a mismatch fails the request rather than corrupt its text)."""
        try:
            text = self._detok.step(token_ids)
        except Exception as e:
            self._error = f"cannot resume: {e}"
            return
        self._decoded_chars = len(text)
        if self._stop is not None:
            self._stop.resume(text, delivered)
        elif delivered != len(text):
            self._error = f"cannot resume: {delivered} characters delivered, the tokens decode to {len(text)}"

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    def process(self, out: RequestOutput) -> tuple[TextDelta | None, Finished | None]:
        """Consume one engine entry: the text to stream now, or the request's Finished (exactly once).
        A duplicate entry returns (None, None) and counts in `duplicates_dropped`. The actor drops
        outputs of finished (tombstoned) requests before calling this."""
        if out.seq != len(self.output_ids) or out.finish_reason is not None or not self._plain:
            return self._process(out)
        # The hot path, a subset of _process: an in-order, unfinished entry past min_tokens, no logprobs.
        ids = out.new_token_ids
        self.output_ids += ids
        try:
            text = self._detok.step(ids)
        except Exception as e:  # an id outside the vocabulary, a tokenizer error: fail this request only
            return None, self._fail(out, str(e))
        if self._stop is not None:
            text, matched = self._stop.feed(text)
            if matched is not None:
                self.abort_reason = "stop"
                return None, self._finish(out, "stop", matched, text)
        return self._delta(out, text), None

    def _process(self, out: RequestOutput) -> tuple[TextDelta | None, Finished | None]:
        ids = out.new_token_ids
        if self.finished:
            raise RuntimeError(f"request {self.request_id}: output after Finished")
        n_before = len(self.output_ids)
        if out.seq != n_before:
            if out.seq < n_before and out.seq + len(ids) <= n_before:
                self.duplicates_dropped += 1
                return None, None
            return None, self._fail(out, f"output seq {out.seq} ({len(ids)} tokens), expected seq {n_before}")
        if self._error is not None or out.finish_reason == "error" or out.error is not None:
            return None, self._fail(out, self._error or out.error or "engine error")
        self.output_ids += ids
        self.prompt_logprobs = out.prompt_logprobs or self.prompt_logprobs
        self.num_cached_tokens = out.num_cached_tokens or self.num_cached_tokens
        self._plain = self._offsets is None and self.num_output_tokens >= self.params.min_tokens
        # The engine stopped on EOS / a stop token: the token's text is not output (vLLM).
        stop_terminated = out.finish_reason == "stop" and not self.params.include_stop_str_in_output
        decode_ids = ids[:-1] if stop_terminated else ids
        try:
            text, matched = self._decode(decode_ids, n_before)
        except Exception as e:
            return None, self._fail(out, str(e))
        if self._offsets is not None and out.logprobs is not None:
            self._set_logprobs_text(out, len(ids) - len(decode_ids))
        if matched is not None:
            if out.finish_reason is None:
                self.abort_reason = "stop"
            return None, self._finish(out, "stop", matched, text)
        if out.finish_reason is not None:
            return None, self._finish_naturally(out, text)
        return self._delta(out, text), None

    def _delta(self, out: RequestOutput, text: str) -> TextDelta:
        return TextDelta(
            request_id=self.request_id,
            seq=out.seq,
            text=text,
            token_ids=out.new_token_ids,
            logprobs=out.logprobs,
            attempt=self.attempt,
        )

    def resume_request(self) -> AddRequest:
        """The next copy of the request, from what its client has (a repair, DESIGN I6): the stream goes on there.
        The characters of text it has are found here, off the per-token path: what all its tokens decode to, less
        the held-back text."""
        chars = len(self._new_detok(self._detok.method).step(self.output_ids)) - (self._stop.held if self._stop else 0)
        return msgspec.structs.replace(
            self.request,
            resume_token_ids=list(self.output_ids),
            resume_chars=chars,
            attempt=next_attempt(self.attempt, DETOK_COPIES),
        )

    def _new_detok(self, method: str | None) -> IncrementalDetokenizer:
        p = self.params
        return IncrementalDetokenizer(
            self.tokenizer,
            self.request.prompt_token_ids,
            p.skip_special_tokens,
            p.spaces_between_special_tokens,
            method=method,
            request_id=self.request_id,
        )

    def process_run(self, out: RequestOutput) -> tuple[list[TextDelta], Finished | None]:
        """`process` for any entry: one of several tokens (a speculative run) with stop strings goes token by
        token, so a stop string inside the run ends the request at the token that completes it and the run's
        later tokens never get out (nor count in its usage)."""
        if self._stop is None or len(out.new_token_ids) < 2:
            delta, finished = self.process(out)
            return [delta] if delta is not None else [], finished
        deltas = []
        for part in token_by_token(out):
            delta, finished = self.process(part)
            if delta is not None:
                deltas.append(delta)
            if finished is not None:
                return deltas, finished
        return deltas, None

    def abort(self, reason: AbortReason) -> Finished:
        """The terminal message of an aborted request (AbortAck, actor death): no more text."""
        return abort_finished(self._finish(None, "abort", None, ""), reason)

    # ------------------------------------------------------------------ internals

    def _decode(self, ids: list[int], n_before: int) -> tuple[str, str | None]:
        """Per-token decode (text offsets) with no stop search in the text of the first min_tokens tokens."""
        unchecked = min(max(self.params.min_tokens - n_before, 0), len(ids))
        if self._offsets is not None:
            self._offsets = []
        emitted, _ = self._feed(self._step(ids[:unchecked]), check=False)
        more, matched = self._feed(self._step(ids[unchecked:]), check=True)
        return emitted + more, matched

    def _step(self, ids: list[int]) -> str:
        if self._offsets is None:
            return self._detok.step(ids)
        pieces = []
        for t in ids:
            self._offsets.append(self._decoded_chars)
            pieces.append(self._detok.step([t]))
            self._decoded_chars += len(pieces[-1])
        return "".join(pieces)

    def _feed(self, text: str, check: bool) -> tuple[str, str | None]:
        if self._stop is None or not text:
            return text, None
        return self._stop.feed(text, check)

    def _finish_naturally(self, out: RequestOutput, text: str) -> Finished:
        """The engine finished the request: flush buffered bytes, then the hold-back."""
        more, matched = self._feed(self._detok.flush(), check=self.num_output_tokens > self.params.min_tokens)
        text += more
        if matched is not None:
            return self._finish(out, "stop", matched, text)
        if self._stop is not None:
            text += self._stop.finish()
        return self._finish(out, out.finish_reason, out.stop_reason, text)

    def _finish(
        self, out: RequestOutput | None, reason: str, stop_reason: int | str | None, text: str, error: str | None = None
    ) -> Finished:
        """The Finished that ends the request, with `out`'s tokens (None: the entry's tokens are not delivered)."""
        self.finished, self._plain = True, False
        return Finished(
            request_id=self.request_id,
            finish_reason=reason,
            stop_reason=stop_reason,
            text=text,
            token_ids=[] if out is None else out.new_token_ids,
            logprobs=None if out is None else out.logprobs,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            error=error,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            attempt=self.attempt,
            timings=None if out is None else out.timings,
        )

    def _fail(self, out: RequestOutput, error: str) -> Finished:
        """The failing entry's tokens are not delivered: the client gets the error after the text it has (and, for
        the engine's error, whose fault it is)."""
        if out.finish_reason is None:
            self.abort_reason = "error"
        fin = self._finish(None, "error", None, "", f"request {self.request_id}: {error}")
        if out.error is not None and self._error is None:  # the engine's: whose fault it is, for the client
            fin.error_kind, fin.error_param = out.error_kind, out.error_param
        return fin

    def _set_logprobs_text(self, out: RequestOutput, skipped: int) -> None:
        offsets = self._offsets + [self._decoded_chars] * skipped  # a skipped stop token sits at the end
        self.logprobs_text = DecodedLogprobs(
            tokens=decode_logprob_tokens(self.tokenizer, out.new_token_ids),
            top_tokens=[decode_logprob_tokens(self.tokenizer, top) for top in out.logprobs.top_ids],
            text_offsets=offsets,
        )
