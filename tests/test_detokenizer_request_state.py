"""DetokRequestState: seq checks, stop strings, engine finishes, min_tokens, usage and logprobs."""

from __future__ import annotations

import random

import pytest

from actors.detokenizer.incremental import METHODS
from actors.detokenizer.logprob_text import decode_logprob_tokens, token_bytes
from actors.detokenizer.request_state import DetokRequestState
from messages.sampling_params import SamplingParams
from messages.wire import AddRequest, Finished, RequestOutput, TextDelta, TokenLogprobs
from tests.detok_tokenizers import EMOJI_CJK, smollm2

PROMPT = "<|im_start|>user\nTell me<|im_end|>\n<|im_start|>assistant\n"
EOS = 2  # <|im_end|>


def make_state(method: str | None = None, **params) -> DetokRequestState:
    tok = smollm2()
    request = AddRequest(request_id="req-1", prompt_token_ids=tok.encode(PROMPT).ids, params=SamplingParams(**params))
    return DetokRequestState(request, tok, method=method)


def entries(ids: list[int], sizes=(1,), finish_reason: str | None = "length", stop_reason=None) -> list[RequestOutput]:
    """Engine entries for `ids` in chunks of `sizes` (cycled); the last one carries the finish."""
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        last = i + n >= len(ids)
        out.append(
            RequestOutput(
                request_id="req-1",
                seq=i,
                new_token_ids=ids[i : i + n],
                finish_reason=finish_reason if last else None,
                stop_reason=stop_reason if last else None,
            )
        )
        i, k = i + n, k + 1
    return out


def run(state: DetokRequestState, outputs: list[RequestOutput]) -> tuple[list[TextDelta], Finished]:
    deltas = []
    for out in outputs:
        delta, finished = state.process(out)
        if finished is not None:
            return deltas, finished
        if delta is not None:
            deltas.append(delta)
    raise AssertionError("no Finished")


def text_of(deltas: list[TextDelta], finished: Finished) -> str:
    return "".join(d.text for d in deltas) + finished.text


@pytest.mark.parametrize("method", METHODS)
def test_streamed_text_equals_the_non_streamed_result(method):
    tok = smollm2()
    ids = tok.encode(EMOJI_CJK + " The END is near.").ids
    rng = random.Random(0)
    for stop, include in [([], False), (["END"], False), (["END", "🚀"], True), (["near.", "中文"], False)]:
        whole = tok.decode(ids)
        cut = min((whole.find(s) + len(s), s) for s in stop) if stop else None
        expected = whole if cut is None else whole[: cut[0] if include else cut[0] - len(cut[1])]
        for _ in range(3):
            sizes = [rng.randint(1, 3) for _ in range(5)]
            state = make_state(method, stop=stop, include_stop_str_in_output=include, max_tokens=100)
            deltas, fin = run(state, entries(ids, sizes))
            assert text_of(deltas, fin) == expected
            assert fin.finish_reason == ("stop" if stop else "length")
            assert fin.stop_reason == (cut[1] if stop else None)


def test_stop_string_ends_the_request_and_asks_for_an_abort():
    tok = smollm2()
    ids = tok.encode("one two END three four").ids
    state = make_state(stop=["END"])
    deltas, fin = run(state, entries(ids, finish_reason=None))
    assert text_of(deltas, fin) == "one two "
    assert (fin.finish_reason, fin.stop_reason, state.abort_reason) == ("stop", "END", "stop")
    assert fin.num_output_tokens == ids.index(tok.token_to_id("ĠEND")) + 1
    assert state.finished
    with pytest.raises(RuntimeError):
        state.process(RequestOutput(request_id="req-1", seq=fin.num_output_tokens, new_token_ids=[905]))


def test_stop_string_matched_on_the_engines_last_step_needs_no_abort():
    ids = smollm2().encode("one END").ids
    state = make_state(stop=["END"])
    deltas, fin = run(state, entries(ids, finish_reason="length"))
    assert (text_of(deltas, fin), fin.finish_reason, state.abort_reason) == ("one ", "stop", None)


def test_held_back_text_is_released_when_the_engine_finishes():
    ids = smollm2().encode("it is the EN").ids
    state = make_state(stop=["END"])
    deltas, fin = run(state, entries([*ids, EOS], finish_reason="stop"))
    assert deltas[-1].text == " "  # of " EN": "EN" may still become "END"
    assert "".join(d.text for d in deltas) == "it is the "
    assert fin.text == "EN" and fin.finish_reason == "stop"


@pytest.mark.parametrize(
    ("include", "skip", "expected"),
    [(False, True, "Hi"), (False, False, "Hi"), (True, True, "Hi"), (True, False, "Hi<|im_end|>")],
)
def test_eos_text_is_output_only_with_include_stop_str_and_kept_special_tokens(include, skip, expected):
    ids = [*smollm2().encode("Hi").ids, EOS]
    state = make_state(include_stop_str_in_output=include, skip_special_tokens=skip)
    deltas, fin = run(state, entries(ids, finish_reason="stop"))
    assert (text_of(deltas, fin), fin.finish_reason, fin.stop_reason) == (expected, "stop", None)
    assert fin.num_output_tokens == len(ids) and fin.token_ids[-1] == EOS


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id_text_is_excluded_unless_included(include):
    tok = smollm2()
    ids = tok.encode("Hi. Bye").ids[:2]  # "Hi", "."
    state = make_state(stop_token_ids=[ids[-1]], include_stop_str_in_output=include)
    deltas, fin = run(state, entries(ids, finish_reason="stop", stop_reason=ids[-1]))
    assert text_of(deltas, fin) == ("Hi." if include else "Hi")
    assert fin.stop_reason == ids[-1]


def test_duplicate_entries_are_dropped_and_counted():
    ids = smollm2().encode("a b c d").ids
    outs = entries(ids)
    state = make_state()
    deltas, fin = run(state, [outs[0], outs[0], outs[1], outs[0], *outs[2:]])
    assert text_of(deltas, fin) == "a b c d"
    assert state.duplicates_dropped == 2


def test_a_seq_gap_fails_the_request_cleanly():
    ids = smollm2().encode("a b c d").ids
    outs = entries(ids, (1,), finish_reason=None)
    state = make_state()
    _, fin = run(state, [outs[0], outs[2]])
    assert fin.finish_reason == "error" and "seq 2" in fin.error and "expected seq 1" in fin.error
    assert state.abort_reason == "error" and fin.text == "" and fin.token_ids == [] and fin.logprobs is None


def test_out_of_vocabulary_ids_fail_the_request():
    state = make_state()
    _, fin = state.process(RequestOutput(request_id="req-1", seq=0, new_token_ids=[905, 10**6]))
    assert fin.finish_reason == "error" and "outside the vocabulary" in fin.error and fin.token_ids == []
    assert state.abort_reason == "error"
    bad_prompt = AddRequest(request_id="r2", prompt_token_ids=[1, -5], params=SamplingParams())
    _, fin = DetokRequestState(bad_prompt, smollm2()).process(RequestOutput(request_id="r2", seq=0, new_token_ids=[7]))
    assert fin.finish_reason == "error" and "invalid prompt" in fin.error


def test_engine_error_is_forwarded():
    _, fin = make_state().process(
        RequestOutput(request_id="req-1", seq=0, new_token_ids=[], finish_reason="error", error="oom")
    )
    assert fin.finish_reason == "error" and "oom" in fin.error


def test_min_tokens_suppresses_early_stop_strings():
    tok = smollm2()
    ids = tok.encode("END one END two").ids  # END | one | END | two
    state = make_state(stop=["END"], min_tokens=2)
    deltas, fin = run(state, entries(ids, finish_reason=None))
    assert text_of(deltas, fin) == "END one "
    assert fin.stop_reason == "END"
    state = make_state(stop=["END"], min_tokens=3)  # the second END is the 3rd token: also ignored
    deltas, fin = run(state, entries(ids))
    assert text_of(deltas, fin) == "END one END two" and fin.finish_reason == "length"


def test_usage_counts():
    tok = smollm2()
    ids = tok.encode("Hello there").ids
    _, fin = run(make_state(), entries(ids, (2,)))
    assert (fin.num_prompt_tokens, fin.num_output_tokens) == (len(tok.encode(PROMPT).ids), len(ids))


def test_abort_gives_the_terminal_message():
    """finish_reason abort with the abort's reason as stop_reason; a request aborted because it failed (reason
    error: its copy's client lost the failure) ends as an error, never as an abort nobody asked for."""
    state = make_state()
    state.process(RequestOutput(request_id="req-1", seq=0, new_token_ids=[905]))
    fin = state.abort("client")
    assert (fin.finish_reason, fin.stop_reason, fin.num_output_tokens, state.finished) == ("abort", "client", 1, True)
    fin = make_state().abort("error")
    assert (fin.finish_reason, fin.stop_reason, fin.error) == ("error", None, "request req-1: failed")


def test_logprobs_pass_through_with_token_strings_and_text_offsets():
    tok = smollm2()
    ids = tok.encode("Hi 🤗 ok").ids  # Hi | ĠðŁ | ¤ | Ĺ | Ġok
    state = make_state(logprobs=1)
    lp = TokenLogprobs(
        sampled=[-0.5] * len(ids), ranks=[1] * len(ids), top_ids=[[t] for t in ids], top_logprobs=[[-0.5]] * len(ids)
    )
    delta, _ = state.process(RequestOutput(request_id="req-1", seq=0, new_token_ids=ids, logprobs=lp))
    assert delta.logprobs == lp and delta.text == "Hi 🤗 ok"
    decoded = state.logprobs_text
    assert decoded.tokens == ["Hi", "bytes: \\xf0\\x9f", "bytes:\\xa4", "bytes:\\x97", " ok"]
    assert decoded.top_tokens == [[t] for t in decoded.tokens]
    assert decoded.text_offsets == [0, 2, 3, 3, 4]  # "Hi| |🤗| ok": 🤗 starts where its bytes complete
    assert b"".join(token_bytes(tok, ids)) == "Hi 🤗 ok".encode()


def test_decode_logprob_tokens_shows_special_tokens_and_whole_characters():
    tok = smollm2()
    assert decode_logprob_tokens(tok, [EOS, *tok.encode("中 ok").ids]) == ["<|im_end|>", "中", " ok"]


@pytest.mark.parametrize("logprobs", [None, 1])
def test_a_stop_string_inside_a_speculative_run_ends_at_its_token(logprobs):
    tok = smollm2()
    ids = tok.encode(" one two three four five six").ids
    state = make_state(stop=[" thr"], logprobs=logprobs)
    lp = TokenLogprobs(
        sampled=[-0.5] * len(ids), ranks=[1] * len(ids), top_ids=[[i] for i in ids], top_logprobs=[[-0.5]] * len(ids)
    )
    run = RequestOutput(request_id="req-1", seq=0, new_token_ids=ids, logprobs=lp if logprobs is not None else None)
    deltas, finished = state.process_run(run)  # one entry of six tokens: the third completes the stop string
    assert (finished.finish_reason, finished.stop_reason, finished.num_output_tokens) == ("stop", " thr", 3)
    assert [t for d in deltas for t in d.token_ids] + finished.token_ids == ids[:3]
    assert "".join(d.text for d in deltas) + finished.text == " one two"
    if logprobs is not None:
        assert [x for d in deltas for x in d.logprobs.sampled] + finished.logprobs.sampled == [-0.5] * 3
    assert state.abort_reason == "stop"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("stop", [[], ["界 dX", "end!"], ["🚀 x", "done 👍"]], ids=["no-stop", "held", "matched"])
def test_a_resumed_state_goes_on_exactly_as_the_original(method, stop):
    """DESIGN I8: a state rebuilt from the tokens its client has and the characters of text it received (a
    restarted detokenizer, a resumed request) streams the rest exactly as the original would have: the held-back
    text (a stop string's possible start, half a character) comes out where the original releases it, and a stop
    string completed after the cut ends it at the same place, for a cut after every token."""
    tok = smollm2()
    ids = tok.encode(EMOJI_CJK + " " + EMOJI_CJK).ids
    prompt = tok.encode(PROMPT).ids
    params = SamplingParams(stop=stop, max_tokens=len(ids))
    for cut in range(len(ids)):
        request = AddRequest(request_id="req-1", prompt_token_ids=prompt, params=params)
        original = DetokRequestState(request, tok, method=method)
        outputs = entries(ids)
        delivered = "".join(d.text for d in (original.process(out)[0] for out in outputs[:cut]) if d is not None)
        if original.finished:  # a stop string matched before the cut
            break
        record = original.resume_request()  # what a repair re-submits: what the client has
        assert (record.resume_token_ids, record.resume_chars, record.attempt) == (
            ids[:cut],
            len(delivered),
            2,
        )  # (even: its copies)
        want_deltas, want_finished = run(original, outputs[cut:])
        resumed = DetokRequestState(
            AddRequest(
                request_id="req-1",
                prompt_token_ids=prompt,
                params=params,
                resume_token_ids=ids[:cut],
                resume_chars=len(delivered),
            ),
            tok,
            method=method,
        )
        got_deltas, got_finished = run(resumed, outputs[cut:])
        assert text_of(got_deltas, got_finished) == text_of(want_deltas, want_finished), cut
        assert [d.seq for d in got_deltas] == [d.seq for d in want_deltas]
        assert (got_finished.finish_reason, got_finished.stop_reason, got_finished.num_output_tokens) == (
            want_finished.finish_reason,
            want_finished.stop_reason,
            want_finished.num_output_tokens,
        )


def test_a_resume_that_does_not_match_the_tokens_fails_the_request():
    """Characters delivered that the tokens do not decode to: the request fails rather than stream wrong text."""
    tok = smollm2()
    ids = tok.encode("Hello there").ids
    request = AddRequest(
        request_id="req-1",
        prompt_token_ids=tok.encode(PROMPT).ids,
        params=SamplingParams(),
        resume_token_ids=ids,
        resume_chars=3,
    )
    _, finished = DetokRequestState(request, tok).process(
        RequestOutput(request_id="req-1", seq=len(ids), new_token_ids=[5])
    )
    assert finished.finish_reason == "error" and "cannot resume" in finished.error
