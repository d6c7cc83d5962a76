"""Structured outputs (issue 15): StructuredOutput specs compiled by xgrammar, and a matcher per constrained
request.

- `Grammars` (one per process, thread-safe): spec -> xgrammar CompiledGrammar, cached by spec (xgrammar's
  cache, 256 MiB); a bad spec raises GrammarError. `check(spec, timeout)` is the frontend's validation, on the
  instance's own `threads`: a valid spec compiled before is answered at once from memory (the last 4,096, by
  digest: a client's usual schemas never queue, and one that took longer than `timeout` stays refused, so a
  retry cannot pass it on to the engine); a second request with a spec being compiled waits on the same compile;
  a compile gets `timeout` seconds once it starts (longer: GrammarError, and it runs on, unused: xgrammar cannot
  be interrupted), and waits at most `timeout` to start (then it is taken off the queue: GrammarBusy, the
  server's state, not the spec's fault). The engine builds its matchers on the same threads (`run`). xgrammar
  takes ~2.5 s to import: `warm()` builds the instance on a background thread once the process (the front, the
  engine) has been idle WARM_IDLE_S after its start: at the start it took a core from the model's load, and its
  import held the GIL from the first steps (a constrained request before then builds it, off the event loop).
- `Matcher`: a constrained request's grammar state. The scheduler `accept()`s each token as it is emitted; the
  grammar ends the request once the matcher has accepted a stop token (EOS), ignore_eos notwithstanding. The
  engine `release()`s it when its request is freed (the Scheduler counts the matchers its requests hold: the idle
  invariant's `matchers`). An exception inside xgrammar (its fill or accept) fails that matcher alone: it keeps the
  `error`, leaves its mask rows all-allowed and accepts no token, so its request ends at its next token with
  finish_reason "error" while the rest of the step (the other rows' masks) goes on.
- Each step's bitmask: actors/engine/grammar_masks.py.

JSON schemas are compiled in xgrammar's strict mode (no properties beyond those the schema names) with compact
separators (", ", ": ") and no free whitespace: every output validates against the schema, and a small model
cannot loop on whitespace until max_tokens.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor  # imported now: the warm-up may build the pool during exit
from pathlib import Path
from typing import TYPE_CHECKING

from actors.engine.json_schema import structural_tag_schemas, unsupported
from messages.sampling_params import StructuredOutput

if TYPE_CHECKING:  # the HTTP process's main module imports this (frontend/structured.py): torch stays out of it
    import torch

WARM_IDLE_S = 2.0  # a process warms its Grammars once idle this long after its start (module docstring)
KNOWN_SPECS = 4096  # valid specs remembered, by digest, as compiling in time or not (check() needs no thread)
CACHE_BYTES = 256 << 20  # xgrammar's cache of compiled grammars, per process (least recently used evicted)


class GrammarError(ValueError):
    """The spec is invalid, or took too long to compile."""


class GrammarBusy(GrammarError):
    """Every compile thread stayed busy with other grammars: the spec was never tried."""


class _Compile:
    """One spec's compile on the pool: its future, and when it started (set: it runs or ran; also set when it is
    cancelled, to wake the other askers)."""

    def __init__(self) -> None:
        self.too_slow = False  # an asker gave up waiting for it to end (the first waits `timeout` from its start)
        self.started = threading.Event()
        self.start = 0.0
        self.future: concurrent.futures.Future | None = None


class Grammars:
    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: list[int], threads: int = 2):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(model_dir) / "tokenizer.json"))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="sluice-grammar")
        self._running: dict[bytes, _Compile] = {}  # by the spec's digest
        self._known: OrderedDict[bytes, bool] = OrderedDict()  # digest -> compiled in time (else: too slow)
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput):
        """The CompiledGrammar of `spec` (cached); GrammarError when it is invalid."""
        c = self._compiler
        try:
            match spec.kind:
                case "json":
                    schema = json.loads(spec.spec)
                    if not isinstance(schema, (dict, bool)):
                        raise GrammarError("a JSON schema must be an object")
                    _enforceable(schema)
                    return c.compile_json_schema(spec.spec, any_whitespace=False)
                case "json_object":
                    return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
                case "regex":
                    return c.compile_regex(spec.spec)
                case "choice":
                    return c.compile_grammar(_choice_ebnf(json.loads(spec.spec)))
                case "grammar":
                    return c.compile_grammar(spec.spec)
                case "structural_tag":
                    for schema in structural_tag_schemas(json.loads(spec.spec)):
                        _enforceable(schema)
                    return c.compile_structural_tag(spec.spec)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError (and ValueError, TypeError) with its C++ location
            raise GrammarError(_clean(str(e)) or type(e).__name__) from e
        raise GrammarError(f"unknown structured output kind {spec.kind!r}")

    def check(self, spec: StructuredOutput, timeout: float) -> None:
        """Compile `spec`, or raise GrammarError (invalid, or `timeout` seconds of compiling were not enough, now or
        the last time) or GrammarBusy (it did not start within `timeout`)."""
        key = _digest(spec)
        with self._lock:
            fast = self._known.get(key)
            if fast is None:
                job = self._running.get(key)
                new = job is None
                if new:
                    job = self._running[key] = _Compile()
                    job.future = self._pool.submit(self._compile, spec, job)
            else:
                self._known.move_to_end(key)
        if fast is not None:
            if not fast:
                raise GrammarError(f"the grammar took more than {timeout:g} s to compile (it did before)")
            return
        if new:  # outside the lock: a compile already done runs the callback here, and it takes the lock
            job.future.add_done_callback(lambda future: self._done(key, job, future))
        if not job.started.wait(timeout) and job.future.cancel():
            raise GrammarBusy(f"all {self.threads} grammar compile threads stayed busy for {timeout:g} s: retry")
        began = job.start if job.start else time.monotonic()  # (0: it starts just now, or was cancelled)
        try:
            job.future.result(max(0.0, began + timeout - time.monotonic()))
        except concurrent.futures.CancelledError:  # another request with this spec gave up waiting for a thread
            raise GrammarBusy(f"all {self.threads} grammar compile threads stayed busy: retry") from None
        except concurrent.futures.TimeoutError:
            job.too_slow = True
            raise GrammarError(f"the grammar took more than {timeout:g} s to compile") from None

    def run(self, fn, *args) -> concurrent.futures.Future:
        """fn(*args) on this instance's compile threads (the engine's matchers: off the loop, and off the executor
        that waits for steps)."""
        return self._pool.submit(fn, *args)

    def matcher(self, spec: StructuredOutput, accepted: list[int] = ()) -> Matcher:
        """A fresh matcher, advanced past `accepted` (a resumed request's tokens); GrammarError if it rejects one."""
        compiled = self.compile(spec)
        try:
            m = Matcher(compiled, self.vocab_size)
        except Exception as e:
            raise GrammarError(f"the grammar matcher could not be built: {type(e).__name__}: {e}") from e
        for i, token in enumerate(accepted):
            if not m.accept(token):
                raise GrammarError(m.error or f"resumed output token {i} ({token}) is not allowed by the grammar")
        return m

    def _compile(self, spec: StructuredOutput, job: _Compile):
        job.start = time.monotonic()
        job.started.set()
        return self.compile(spec)

    def _done(self, key: bytes, job: _Compile, future: concurrent.futures.Future) -> None:
        """Remember a valid spec: fine (checks pass at once) or too slow for its asker (checks fail at once)."""
        job.started.set()  # (a cancelled one: its other askers stop waiting)
        with self._lock:
            self._running.pop(key, None)
            if not future.cancelled() and future.exception() is None:
                self._known[key] = not job.too_slow
                if len(self._known) > KNOWN_SPECS:
                    self._known.popitem(last=False)


_BUILDING = threading.Lock()


def grammars(model_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> Grammars:
    """This process's Grammars for a model, built once: a caller that comes while another builds it (the warm-up)
    waits for that one instead of building a second."""
    with _BUILDING:
        return _build(model_dir, vocab_size, stop_token_ids)


@functools.cache
def _build(model_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> Grammars:
    return Grammars(model_dir, vocab_size, list(stop_token_ids))


def warm(model_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
    """Import xgrammar and build the process's Grammars on a background thread.

    Not a daemon: a process that exits while the thread is inside xgrammar's C++ aborts (SIGABRT, "terminate
    called without an active exception"), so the interpreter waits for it at exit (a few seconds at most)."""
    threading.Thread(target=grammars, args=(model_dir, vocab_size, stop_token_ids), name="sluice-grammar-warm").start()


def _enforceable(schema) -> None:
    if problem := unsupported(schema):
        raise GrammarError(problem)


def _choice_ebnf(choices) -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("choice must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean(message: str) -> str:
    """xgrammar's message without its '[time] file.cc:line: ' prefix and 'Check failed' noise."""
    message = re.sub(r"\[[\d:]+\] [^\s:]+:\d+: ", "", message).strip()
    return re.sub(r"^Check failed: .*? is false: ", "", message)


class Matcher:
    """One constrained request's grammar state (module docstring)."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.error: str | None = None  # xgrammar failed: the request ends with this error at its next token
        self._m = xgr.GrammarMatcher(compiled)  # (rollback is unbounded: speculation rolls drafts back)

    def accept(self, token: int) -> bool:
        """Advance past an emitted token; False: the grammar does not allow it (the matcher is unchanged), or the
        matcher failed (`error`)."""
        if self.error is None:
            try:
                return self._m.accept_token(token)
            except Exception as e:
                self._failed(e)
        return False

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        if self.error is None:
            try:
                return self._m.is_terminated()
            except Exception as e:
                self._failed(e)
        return False

    def fill(self, bitmask: torch.Tensor, row: int, drafts: list[int] = ()) -> None:
        """Rows row .. row + len(drafts) of `bitmask`: the allowed next tokens now and after each draft prefix
        (rows after a draft the grammar rejects stay all-allowed: nothing there is emitted; so do a failed
        matcher's: its request ends at its next token)."""
        if self.error is not None:
            return
        try:
            self._fill(bitmask, row, drafts)
        except Exception as e:
            self._failed(e)
            bitmask[row : row + 1 + len(drafts)] = -1  # all allowed (a half-written row could allow nothing)

    def release(self) -> None:
        """Its request is freed: xgrammar's matcher goes now (a CFG request is a reference cycle: collected later);
        a later fill does nothing, a later accept refuses."""
        self._m = None
        self.error = "the matcher was released"

    def _fill(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        if self._m.is_terminated():  # a junk row after the request ended: its sample is discarded
            return
        self._m.fill_next_token_bitmask(bitmask, row)
        accepted = 0
        for j, token in enumerate(drafts, 1):
            if not self._m.accept_token(token):
                break
            accepted += 1
            if self._m.is_terminated():
                break
            self._m.fill_next_token_bitmask(bitmask, row + j)
        if accepted:
            self._m.rollback(accepted)

    def _failed(self, e: Exception) -> None:
        self.error = f"the grammar matcher failed: {type(e).__name__}: {e}"  # (logged with the request's id)


def _digest(spec: StructuredOutput) -> bytes:
    return hashlib.blake2b(f"{spec.kind}\0{spec.spec}".encode(), digest_size=16).digest()
