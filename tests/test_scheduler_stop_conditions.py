"""Scheduler stop conditions: EOS, stop_token_ids, min_tokens, ignore_eos, max_tokens and
max_model_len, in sync and one-ahead mode (tests.scheduler_harness)."""

import pytest

from tests.scheduler_harness import Harness, chain

PROMPT = [3, 1, 4, 1, 5]
FULL = chain(PROMPT, 12)
K = next(i for i in range(3, 12) if FULL.count(FULL[i]) == 1)  # TOK occurs once, as output K
TOK = FULL[K]
STOP_CASES = [  # (eos_token_ids, params, tokens, (finish_reason, stop_reason))
    ((TOK,), {}, FULL[: K + 1], ("stop", None)),
    ((TOK,), {"ignore_eos": True}, FULL, ("length", None)),
    ((TOK,), {"min_tokens": K}, FULL[: K + 1], ("stop", None)),  # K outputs before it: allowed
    ((TOK,), {"min_tokens": K + 1}, FULL, ("length", None)),  # held by min_tokens
    ((), {"stop_token_ids": [TOK]}, FULL[: K + 1], ("stop", TOK)),
    ((), {"stop_token_ids": [TOK], "ignore_eos": True}, FULL[: K + 1], ("stop", TOK)),
    ((), {"stop_token_ids": [TOK], "min_tokens": K + 1}, FULL, ("length", None)),
    ((TOK,), {"max_tokens": K}, FULL[:K], ("length", None)),
]


@pytest.mark.parametrize("one_ahead", [False, True])
@pytest.mark.parametrize(("eos", "params", "tokens", "finish"), STOP_CASES)
def test_stop_conditions(one_ahead, eos, params, tokens, finish):
    h = Harness(one_ahead=one_ahead, eos=eos)
    h.add("r", PROMPT, **{"max_tokens": 12, **params})
    h.run()
    assert (h.tokens["r"], h.finish["r"]) == (tokens, finish)
    # One-ahead scheduled a junk row past a stop token, never past a foreseeable length end.
    assert h.sched.num_discarded_samples == (one_ahead and finish[0] == "stop")


@pytest.mark.parametrize("one_ahead", [False, True])
def test_max_model_len_ends_with_length(one_ahead):
    h = Harness(one_ahead=one_ahead, max_model_len=16)
    h.add("r", list(range(10)), max_tokens=100, ignore_eos=True)
    with pytest.raises(ValueError):
        h.add("too-long", list(range(16)))
    h.run()
    assert h.tokens["r"] == chain(list(range(10)), 6) and h.finish["r"] == ("length", None)
