"""Beam search in the engine: a beam group is one request to the scheduler, its beams the sequences it schedules.

- A group (an EngineRequest whose `beams` is a BeamGroup) is admitted, preempted, aborted and freed as one; its
  sequences are its live beams, each with its own KV blocks and slot (it holds `width` slots from its admission:
  `spare_slots` are those no beam holds). It starts with one beam, the prompt (prefilled in chunks like any prompt).
- The prompt's choices are its members (EngineRequests with `search` set, holding nothing): each is answered with
  the hypothesis of its rank, all of it in one terminal output, when the search ends. The actors/engine/lifecycle.py
  ledger joins a choice to the live group of its `search_key` (its BeamSearch.group, prompt and parameters: only
  choices of one search share it) whose rank is free, or starts one; acks an aborted member at once; and aborts a
  group left without members silently.
- A step: every live beam feeds its unfed tokens (as the budget allows) and samples at its end: the top 2 x width
  raw logprobs of its next token are its candidates. Once every live beam has its candidates and is computed to its
  end, the search steps (`advance`, HF's rule): the candidates by cumulative logprob, best first; an ending one (EOS
  unless ignore_eos, or a stop token id) among the first `width` is a finished hypothesis, the first `width` others
  are the next beams. The group is never scheduled ahead: its next rows need this step's decision (the engine loop
  steps synchronously while a group runs).
- The next beams (`regroup`): a beam without children is freed first; another child of a parent forks it: the
  parent's full blocks are shared (reference counted; never written again, as every sharer computes from their end)
  and its partial last block is recomputed by the child (under block_size tokens); the parent's first child then
  continues it in place (its next row feeds the one new token).
- Scores are vLLM's: cumulative logprob / length ** length_penalty, the length counting the prompt and the output
  but not an ending token, compared as `beam_score` keys (never overflowing, for any finite length_penalty: vLLM
  does not bound it; past |length_penalty| x ln(longest) = 575 they are log magnitudes, which rank as vLLM's finite
  values do, but for near-ties within float rounding, up to where vLLM's own formula fails: `beam_score`). The search ends when `width` hypotheses have ended and early_stopping says so (true: at once;
  false: once no running beam can score better at its current length; "never": nor at its longest, with a positive
  length_penalty), when no beam continues, or at max_tokens / max_model_len, where the running beams end ("length")
  and compete too, unless the search was done (HF's finalize). The `width` best hypotheses are kept, best first;
  choice k gets the k-th (the last one if fewer ended: only when stop token ids ended nearly every candidate).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from actors.engine.block_manager import BlockManager
from actors.engine.request import EngineRequest, token_range
from messages.sampling_params import BeamSearch
from messages.wire import FinishReason, TokenLogprobs

Ending = tuple[FinishReason, int | None]  # why a token ends a beam: ("stop", the stop token id or None for EOS)
Score = tuple[int, float]  # beam_score's: greater is better
# Up to this |length_penalty| x log(a search's longest length) the formula is evaluated as vLLM does: the scale is
# within e^+-575 (1e+-250), so it and a sum of float32 logprobs over it stay normal floats at every length. vLLM's
# own evaluation stays finite a little further (length ** length_penalty overflows past ~709, raising OverflowError,
# for a positive penalty; underflows to a division by zero past ~744 for a negative one); between 575 and there the
# log form ranks the same scores alike, differing from vLLM's only where two are equal within float rounding.
EXACT_LOG_SCALE = 575.0


def beam_score(cum_logprob: float, length: int, length_penalty: float, longest: int) -> Score:
    """vLLM's score, cum_logprob / length ** length_penalty, as a sort key that never overflows: (0, the score) when
    |length_penalty| x log(the search's `longest`) <= EXACT_LOG_SCALE (exactly vLLM's values and order), else
    (sign, sign x log|score|), log|score| = log|cum_logprob| - length_penalty x log(length): the same order as the
    exact scores (vLLM's where its formula is still finite, but for near-ties within float rounding), also where
    that formula would overflow (OverflowError) or underflow to a division by zero."""
    if abs(length_penalty) * math.log(longest) <= EXACT_LOG_SCALE:
        return 0, cum_logprob / length**length_penalty
    if cum_logprob == 0:
        return 0, 0.0
    sign = 1 if cum_logprob > 0 else -1  # (a logprob sum is <= 0: -1)
    return sign, sign * (math.log(abs(cum_logprob)) - length_penalty * math.log(length))


class Hypothesis(NamedTuple):
    score: Score
    token_ids: list[int]
    finish_reason: FinishReason
    stop_reason: int | None


@dataclass(eq=False)
class Beam:
    """One running hypothesis: duck-types the BlockManager's sequence (its own blocks, slot and block hashes)."""

    group: EngineRequest
    output_token_ids: list[int]
    cum_logprob: float = 0.0
    block_table: list[int] = field(default_factory=list)
    sent_blocks: int = 0
    num_computed_tokens: int = 0
    slot: int = -1
    block_hashes: list[bytes] = field(default_factory=list)
    candidates: list[tuple[int, float]] | None = None  # its last sample's top 2 x width (token, logprob)

    @property
    def request_id(self) -> str:
        return self.group.request_id

    @property
    def prefix_root(self) -> bytes:
        return self.group.prefix_root

    @property
    def num_known_tokens(self) -> int:
        return len(self.group.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.group.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return self.group.num_prompt_tokens + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        return token_range(self.group.prompt_token_ids, self.output_token_ids, start, end)


@dataclass(eq=False)
class BeamGroup:
    """A group's search (its request's `beams`: actors/engine/request.py's Beams)."""

    spec: BeamSearch
    live: list[Beam] = field(default_factory=list)
    members: dict[int, EngineRequest] = field(default_factory=dict)  # rank -> the choice it answers
    ended: list[Hypothesis] = field(default_factory=list)  # the best `width`, best first
    spare_slots: list[int] = field(default_factory=list)
    key: bytes = b""  # its search_key

    @property
    def ready(self) -> bool:
        """Every live beam is computed to its end and has its candidates: the search may step."""
        return all(b.candidates is not None and b.num_computed_tokens == b.num_tokens for b in self.live)

    def sampled(self, slot: int, lists: TokenLogprobs, at: int) -> None:
        """The beam in `slot` sampled at the step's position `at`: its candidates."""
        beam = next(b for b in self.live if b.slot == slot)
        n = 2 * self.spec.width
        beam.candidates = list(zip(lists.top_ids[at][:n], lists.top_logprobs[at][:n], strict=True))

    def advance(
        self, ending: Callable[[int], Ending | None], num_prompt: int, max_output: int
    ) -> list[tuple[Beam, int, float]]:
        """One search step: the next beams as (parent, token, cumulative logprob), best first; none when the search
        is over (`ended` holds the answer). `max_output`: the output's longest (max_tokens, max_model_len)."""
        w, length = self.spec.width, len(self.live[0].output_token_ids) + 1  # (the beams advance in lockstep)
        longest = num_prompt + max_output
        ranked = [(b.cum_logprob + lp, tok, b) for b in self.live for tok, lp in b.candidates]
        ranked.sort(key=lambda c: -c[0])  # (stable: ties keep beam, then candidate order)
        children = []
        for rank, (cum, tok, beam) in enumerate(ranked):
            if (end := ending(tok)) is not None:
                if rank < w:
                    score = self._score(cum, num_prompt + length - 1, longest)
                    self._end(Hypothesis(score, [*beam.output_token_ids, tok], *end))
            elif len(children) < w:
                children.append((beam, tok, cum))
        if not children or self._done(children[0][2], num_prompt + length, longest):
            return []
        if length >= max_output:  # (HF's finalize: the running beams compete, unless the search was done)
            for beam, tok, cum in children:
                hyp = [*beam.output_token_ids, tok]
                self._end(Hypothesis(self._score(cum, num_prompt + length, longest), hyp, "length", None))
            return []
        return children

    def _score(self, cum_logprob: float, length: int, longest: int) -> Score:
        return beam_score(cum_logprob, length, self.spec.length_penalty, longest)

    def _end(self, hyp: Hypothesis) -> None:
        self.ended = sorted([*self.ended, hyp], key=lambda h: h.score, reverse=True)[: self.spec.width]  # (stable)

    def _done(self, best_cum: float, length: int, longest: int) -> bool:
        """Whether no running beam can do better than the `width` ended ones (HF's BeamHypotheses.is_done)."""
        stop, lp = self.spec.early_stopping, self.spec.length_penalty
        if len(self.ended) < self.spec.width:
            return False
        at = longest if stop == "never" and lp > 0 else length  # (the best a running beam can reach)
        return stop is True or self.ended[-1].score >= self._score(best_cum, at, longest)


def search_key(member: EngineRequest) -> bytes:
    """What the choices of one search share: its group name, prompt and parameters (its rank, and a seed, which each
    choice of a prompt gets its own of and a search does not read, aside)."""
    beam = msgspec.structs.replace(member.params.beam, rank=0)
    params = msgspec.structs.replace(member.params, beam=beam, seed=None)
    return msgspec.msgpack.encode((member.prompt_token_ids, params))


def new_group(member: EngineRequest, request_id: str) -> EngineRequest:
    """A search for the choice's prompt: greedy rows that return 2 x width logprobs, one beam (the prompt)."""
    spec = member.params.beam
    params = msgspec.structs.replace(member.params, n=1, temperature=0.0, logprobs=2 * spec.width, beam=None)
    group = EngineRequest(request_id, member.prompt_token_ids, params, member.arrival_time)
    group.beams = BeamGroup(spec)
    group.beams.live.append(Beam(group, []))
    return group


def beam_plan(group: EngineRequest, budget: int, chunk: int) -> list[tuple[Beam, int]]:
    """Each live beam and the tokens it feeds this step: its unfed ones (a prefill at most `chunk`, the scheduler's
    per-request chunk), in beam order, as far as the budget goes."""
    plan = []
    for beam in group.beams.live:
        n = min(beam.num_tokens - beam.num_computed_tokens, budget, chunk)
        plan.append((beam, n))
        budget -= n
    return plan


def regroup(group: EngineRequest, children: list[tuple[Beam, int, float]], blocks: BlockManager) -> None:
    """Make the children the live beams (module docstring): free the childless, fork, then continue in place."""
    beams, keep = group.beams, {}
    for parent, tok, cum in children:
        keep.setdefault(parent, (tok, cum))
    for beam in beams.live:
        if beam not in keep:
            blocks.free(beam)
            beams.spare_slots.append(beam.slot)
            beam.slot = -1
    live = []
    for parent, tok, cum in children:
        if keep[parent][0] == tok:  # (a beam's candidates are distinct tokens)
            live.append(parent)
            continue
        child = Beam(group, [*parent.output_token_ids, tok], cum, slot=beams.spare_slots.pop())
        beams.live.append(child)  # (the group's at once: if anything fails from here, it is freed with the group)
        blocks.fork(child, parent, parent.num_computed_tokens // blocks.block_size)
        live.append(child)
    for parent, (tok, cum) in keep.items():
        parent.output_token_ids.append(tok)
        parent.cum_logprob, parent.candidates = cum, None
    beams.live = live


def beam_fit_error(width: int, num_prompt: int, max_output: int, max_num_seqs: int, blocks: BlockManager) -> str | None:
    """Why a search of `width` beams cannot run here (it must fit the KV cache alone at its longest, every beam
    holding its own blocks after a preemption: actors/engine/scheduler.py's progress argument), or None."""
    if width > max_num_seqs:
        return f"beam search with {width} beams needs max_num_seqs >= {width} (the server's is {max_num_seqs})"
    need = width * blocks.num_blocks_for(num_prompt + max_output - 1)
    if need > blocks.num_blocks:
        return (
            f"beam search with {width} beams of up to {num_prompt + max_output - 1} tokens needs {need} KV blocks "
            f"of {blocks.block_size} tokens at its longest; the KV cache has {blocks.num_blocks}"
        )
    return None
