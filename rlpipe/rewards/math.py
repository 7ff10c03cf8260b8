"""`math` verifier: the completion's final answer (boxed or otherwise extracted) against the gold answer,
equal up to numeric and symbolic form ("1/2" = "0.5" = "\\frac{1}{2}", "72" = "72.0" = "$72$"), checked
by math-verify. Reward 1.0 when equivalent, else 0.0; no steps.

Every sample is checked in a pool of worker processes under a wall-clock bound. math-verify's own
timeout uses SIGALRM (main thread only, and a signal handler cannot run while C code such as a huge
integer power holds the GIL), so a thread watchdog could not stop it; instead the parent kills the
worker (SIGKILL) once a sample passes the bound, scores it 0, logs one short line and forks a fresh
worker. Workers are reused across samples and calls; model output is only ever handed to
math-verify's parser, never evaluated here.

Importing this module loads only the standard library (and `Verdict`); math-verify and sympy are
imported in the worker processes, never in the parent.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import re
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Literal

from rlpipe.rewards.verifiers import Verdict

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
"""Wall-clock bound per sample, from dispatch to result; past it the worker is killed and the sample scores 0."""
MAX_COMPLETION_CHARS = 8192
"""Completions are cut to their last this many characters before parsing: final answers live at the end,
and math-verify's extraction regexes are quadratic on some inputs ("1 " * 50_000 takes 34 s whole, 0.2 s
as its last 8192 characters), so a long completion would spend its time budget on text far from the answer."""
MAX_ANSWER_CHARS = 1024
"""Gold answers are short; longer ones are cut (keeping the head) so that a corrupt row cannot stall a worker."""
WORKER_MEMORY_BYTES = 4 << 30
"""Address-space limit of a worker (RLIMIT_AS): a tower of powers fails with MemoryError instead of
taking the host's memory before the timeout fires."""
PREVIEW_CHARS = 60
"""How much of a timed-out completion the log line shows."""
MAX_DEFAULT_WORKERS = 16
"""The pool's default size is the number of usable CPUs, at most this."""
STARTUP_TIMEOUT_S = 120.0
"""How long a new worker may take to import math-verify and report ready before the pool gives up."""

_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_LATEX_ENV = ("$", "\\boxed", "\\(", "\\[")


def gold_latex(answer: str) -> str:
    """The gold answer as latex math-verify extracts reliably: thousands separators dropped from a plain
    number ("1,000" -> "1000"), and bare text boxed ("\\sqrt{2}" -> "\\boxed{\\sqrt{2}}"), since
    math-verify only finds latex inside an environment."""
    answer = answer.strip()[:MAX_ANSWER_CHARS]
    if _THOUSANDS.fullmatch(answer):
        answer = answer.replace(",", "")
    if any(env in answer for env in _LATEX_ENV):
        return answer
    return "\\boxed{" + answer + "}"


_ANSWER_START = re.compile(r"\s*[-+$\\(.\d]")
"""What an answer after GSM8K's "####" starts with: a digit, sign, point, dollar, parenthesis or latex."""


def final_answer_span(completion: str) -> str:
    """The rest of the line after the last "####" that marks a final answer (GSM8K's marker), else the
    completion. A "####" followed by a word is a Markdown heading ("#### Step 2: Money"), not a marker.

    math-verify ranks a number after the word "answer" above a bare trailing number, so without this a
    solution reading "... 25-8=17 questions answered. #### 17" would be scored on "8"."""
    for marker in reversed([m.end() for m in re.finditer("####", completion)]):
        rest = completion[marker:].split("\n", 1)[0]
        if _ANSWER_START.match(rest):
            return rest.strip()
    return completion


_BOXED_FLAT = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER_AND_UNIT = re.compile(
    r"\s*(?:\\?\$)?\s*"  # an optional dollar sign
    r"(?P<number>[+-]?\d{1,3}(?:(?:\s|\\,|\\ |~)\d{3})+(?:\.\d+)?|[+-]?\d+(?:\.\d+)?)"  # 1 080, 1\,080 or 18.5
    r"(?:\s*\\?%|\s+(?P<unit>[A-Za-z]{2,}[A-Za-z .]*))?\s*"  # an optional percent sign, or words after a space
)
_MATH_WORDS = {"pi", "sqrt", "ln", "log", "sin", "cos", "tan", "exp", "mod", "and", "or"}
"""Words after a number that are mathematics, not a unit: "\\boxed{3 pi}" is not 3."""


def plain_boxed(completion: str) -> str:
    """Each \\boxed{} holding a number with a percent sign, a unit, or spaces between digit groups, as
    the plain number: "\\boxed{18\\%}", "\\boxed{18 eggs}" and "\\boxed{1 080}" become "\\boxed{18}",
    "\\boxed{18}" and "\\boxed{1080}". Anything else ("\\boxed{2 3}", "\\boxed{x+1}") is left alone."""

    def flatten(match: re.Match) -> str:
        plain = _NUMBER_AND_UNIT.fullmatch(match.group(1))
        unit = plain and plain.group("unit")
        if plain is None or (unit and unit.split()[0].lower() in _MATH_WORDS):
            return match.group(0)
        return "\\boxed{" + re.sub(r"\s|\\,|\\ |~", "", plain.group("number")) + "}"

    return _BOXED_FLAT.sub(flatten, completion)


def completion_tail(completion: str) -> str:
    """The part of the completion that is parsed: its last MAX_COMPLETION_CHARS characters."""
    return completion[-MAX_COMPLETION_CHARS:]


def _preview(text: str) -> str:
    head = text[:PREVIEW_CHARS]
    return repr(head) + (f"... ({len(text)} chars)" if len(text) > PREVIEW_CHARS else "")


# ---- worker side (runs in the child processes only) ----

def _worker_main(conn: Connection, memory_bytes: int) -> None:
    """Answer (completion, gold) requests with `correct` until the parent closes the pipe."""
    import resource
    import signal

    # Ctrl-C reaches the whole process group; the parent handles it and kills the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    # math-verify logs the whole input on its own timeouts and warns that its timeout is disabled;
    # the parent logs one short line per timed-out sample instead.
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    check = _checker()
    check("1", "1")  # compiles math-verify's regexes, so that the first sample is not charged for it
    conn.send("ready")
    while True:
        try:
            completion, gold = conn.recv()
        except (EOFError, OSError):
            return
        try:
            correct = check(completion, gold)
        except Exception:  # MemoryError, RecursionError, parser failures: the answer is not verified
            correct = False
        conn.send(correct)


def _checker():
    from functools import lru_cache

    from math_verify import parse, verify

    # The parent bounds the wall time by killing the process, so math-verify's SIGALRM timeouts are off.
    @lru_cache(maxsize=1024)
    def parse_gold(gold: str):
        return parse(gold_latex(gold), parsing_timeout=None)

    def check(completion: str, gold: str) -> bool:
        gold_parsed = parse_gold(gold)
        if not gold_parsed or not completion.strip():
            return False
        completion = plain_boxed(completion)
        span = final_answer_span(completion)
        predicted = parse(span, parsing_timeout=None)
        if not predicted and span is not completion:
            predicted = parse(completion, parsing_timeout=None)
        return bool(verify(gold_parsed, predicted, timeout_seconds=None))

    return check


# ---- parent side ----

@dataclass(frozen=True)
class Scored:
    """One sample's check, as the pool saw it."""

    correct: bool
    seconds: float
    """Wall time from dispatch to the worker until its answer (or until the kill)."""
    outcome: Literal["ok", "timeout", "crashed"]
    """"timeout": killed past the bound; "crashed": the worker died on it (e.g. a C stack overflow)."""


class _Worker:
    def __init__(self, context, memory_bytes: int):
        self.conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(target=_worker_main, args=(child_conn, memory_bytes), daemon=True,
                                       name="math-verify")
        self.process.start()
        child_conn.close()
        # Fail loudly if workers cannot start (a broken install, an unguarded __main__ script), rather
        # than scoring every sample 0 through an endless respawn loop.
        try:
            if self.conn.poll(STARTUP_TIMEOUT_S) and self.conn.recv() == "ready":
                return
        except (EOFError, OSError):
            pass
        self.kill()
        raise RuntimeError(f"math-verify worker did not start (exit code {self.process.exitcode}); see its stderr")

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


def _default_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return min(cpus, MAX_DEFAULT_WORKERS)


class MathVerifyPool:
    """Worker processes that check answers one sample at a time, each under a wall-clock bound.

    Workers fork from a forkserver that has math-verify preloaded, so a replacement after a kill starts
    in milliseconds and does not inherit the parent's threads. Not thread-safe: score from one thread.
    """

    def __init__(self, workers: int | None = None, memory_bytes: int = WORKER_MEMORY_BYTES):
        self.context = multiprocessing.get_context("forkserver")
        # The server imports these once and every worker forks from it. Takes effect only if this
        # process's forkserver is not running yet; otherwise workers import math-verify themselves on
        # start (slower, same results). As under spawn, each worker re-imports the parent's __main__
        # script, so a script that scores must guard its entry point (stages/*.py do).
        self.context.set_forkserver_preload(["rlpipe.rewards.math", "math_verify"])
        self.memory_bytes = memory_bytes
        self.workers = [self._spawn() for _ in range(workers or _default_workers())]

    def _spawn(self) -> _Worker:
        return _Worker(self.context, self.memory_bytes)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        replacement = self._spawn()
        self.workers[self.workers.index(worker)] = replacement
        return replacement

    def _send(self, worker: _Worker, request: tuple[str, str]) -> _Worker:
        try:
            worker.conn.send(request)
        except OSError:  # it died while idle (e.g. killed from outside): start another
            worker = self._replace(worker)
            worker.conn.send(request)
        return worker

    def score(self, completions: list[str], answers: list[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Scored]:
        """One `Scored` per completion, in order. A sample past `timeout_s` is killed and scored 0."""
        if not self.workers:
            raise RuntimeError("MathVerifyPool is closed")
        try:
            return self._score(completions, answers, timeout_s)
        except BaseException:
            # Requests may still be in flight; a later call must not read their answers.
            self.close()
            raise

    def _score(self, completions: list[str], answers: list[str], timeout_s: float) -> list[Scored]:
        results: list[Scored | None] = [None] * len(completions)
        pending = deque(range(len(completions)))
        idle = list(self.workers)
        busy: dict[Connection, tuple[_Worker, int, float]] = {}
        while pending or busy:
            while pending and idle:
                index = pending.popleft()
                worker = self._send(idle.pop(), (completion_tail(completions[index]), answers[index]))
                busy[worker.conn] = (worker, index, time.monotonic())
            first_deadline = min(started for _, _, started in busy.values()) + timeout_s
            for conn in wait(list(busy), timeout=max(0.0, first_deadline - time.monotonic())):
                worker, index, started = busy.pop(conn)
                try:
                    results[index] = Scored(bool(conn.recv()), time.monotonic() - started, "ok")
                except (EOFError, OSError):
                    results[index] = Scored(False, time.monotonic() - started, "crashed")
                    log.warning("math reward: sample %d crashed its worker (reward 0): %s",
                                index, _preview(completions[index]))
                    worker = self._replace(worker)
                idle.append(worker)
            now = time.monotonic()
            for conn, (worker, index, started) in list(busy.items()):
                if now - started >= timeout_s:
                    del busy[conn]
                    results[index] = Scored(False, now - started, "timeout")
                    log.warning("math reward: sample %d timed out after %.1f s (reward 0): %s",
                                index, now - started, _preview(completions[index]))
                    idle.append(self._replace(worker))
        return results

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers = []

    def __enter__(self) -> MathVerifyPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_shared: MathVerifyPool | None = None


def shared_pool() -> MathVerifyPool:
    """The process-wide pool, started on first use and closed at exit (or after a failed call)."""
    global _shared
    if _shared is None or not _shared.workers:
        _shared = MathVerifyPool()
        atexit.register(_shared.close)
    return _shared


def math_verify_batch(completions: list[str], answers: list[str], metas: list[str],
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Verdict]:
    """1.0 when the completion's final answer equals the gold `answer` (math-verify), else 0.0.

    `metas` is unused. Each sample gets at most `timeout_s` seconds of wall time; past it it scores 0.
    """
    scored = shared_pool().score(list(completions), list(answers), timeout_s)
    return [Verdict(reward=float(s.correct), correct=s.correct) for s in scored]
