"""The `math_verify` verifier: the last `\\boxed{}` of a completion checked against `example.answer` with
HuggingFace's `math-verify` (LaTeX/SymPy equivalence: 0.5 = \\frac{1}{2}, \\sqrt{50} = 5\\sqrt{2}, x=5 = 5).

verifier_args:
  mode: `boxed` (default: the content of the last \\boxed{}), `gsm8k` (the text after the last `####`, commas
        dropped), `aime` (the last \\boxed{} must be an integer 0-999, compared as integers, no SymPy) or `any`
        (math-verify's own extraction from the whole answer text).
  timeout_s: hard wall-clock limit per item (default 5). workers: processes in the pool (default min(4, CPUs)).
  memory_mb: address-space cap of each worker (default 4096).
  strip_think / zero_if_truncated / think_format_weight: see `verifiers.RealVerifier`.

SymPy can hang (a tower like 9^{9^{9}} is a single C-level integer power that no signal interrupts), so
`parse`/`verify` run in a pool of spawn-started worker processes and each item gets `timeout_s` once a worker
takes it; a worker that overruns is killed and replaced, its item scores 0 (`info["timeout"]`), the others are
unaffected. math-verify's own signal-based timeouts are off inside the workers (they cannot stop C code; ours
can). The gold answer is parsed the way verl's math_verify reward does it: wrapped in \\boxed{} and read as LaTeX.
"""

from __future__ import annotations

import importlib.util
import os
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

from .base import DomainError, Example
from .verifiers import RealVerifier, VerdictRow, _arg_choice, _batch_flags

MODES = ("boxed", "gsm8k", "aime", "any")
_INSTALL = "pip install 'mopd[domains]' (math-verify)"


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`; None if there is none
    or its braces never close (a truncated completion)."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)(?![A-Za-z])", text)]
    if not starts:
        return None
    i = starts[-1]
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1: j]
    return None


def gsm8k_answer(text: str) -> str | None:
    """The GSM8K final answer: what follows the last `####` (commas, `$` and a trailing period dropped)."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
    tail = tail.replace(",", "").replace("$", "").strip().rstrip(".").strip()
    return tail or None


def aime_integer(text: str | None) -> int | None:
    """`text` as an AIME answer (an integer 0-999, leading zeros allowed, optionally wrapped in \\text{} or $),
    else None."""
    if text is None:
        return None
    s = re.sub(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}", r"\1", text).replace("$", "").strip()
    m = re.fullmatch(r"0*(\d{1,3})", s)
    return int(m.group(1)) if m else None


# ---- worker side (a spawn-started process: imports math_verify once, then scores items) ---------------------

def _check_item(gold: str, pred: str, mode: str) -> tuple[bool, str | None]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    def read(s: str, boxed: bool) -> list:
        if boxed:
            got = parse("\\boxed{" + s + "}", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
            if got:
                return got
        return parse(s, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None)

    gold_p = read(gold, True)
    pred_p = read(pred, mode != "any")
    extracted = str(pred_p[-1]) if pred_p else None
    if not gold_p or not pred_p:
        return False, extracted
    return bool(verify(gold_p, pred_p, timeout_seconds=None)), extracted


def _worker_main(conn: Any, memory_mb: int | None) -> None:
    import logging

    try:
        if memory_mb:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" warning: ours is on
        import math_verify  # noqa: F401  (warm: the first item must not pay the SymPy import inside its timeout)
    except BaseException as e:  # noqa: BLE001
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, args = msg
        try:
            out: tuple = ("ok", _check_item(*args))
        except MemoryError:
            out = ("error", "MemoryError")
        except Exception as e:  # noqa: BLE001 - a bad item scores 0, the worker goes on
            out = ("error", f"{type(e).__name__}: {e}"[:200])
        conn.send((idx, out))


class HardTimeoutPool:
    """Worker processes (spawn context) that each take one item at a time, with a hard per-item wall-clock limit.

    Why not `concurrent.futures.ProcessPoolExecutor`: it can time out waiting for a future but cannot stop the
    task — the hung worker stays busy forever and the only way out (terminating its processes) breaks the whole
    executor. Here a worker that overruns is SIGKILLed and replaced, and its item is reported as a timeout.
    `map(items)` returns per item ("ok", value) | ("timeout", None) | ("error", message); callers are serialised.
    """

    def __init__(self, target: Any, workers: int, timeout_s: float, *, target_args: tuple = (),
                 startup_timeout_s: float = 180.0):
        import multiprocessing

        self._ctx = multiprocessing.get_context("spawn")
        self.target, self.target_args = target, target_args
        self.workers, self.timeout_s, self.startup_timeout_s = workers, timeout_s, startup_timeout_s
        self._procs: dict[Any, Any] = {}  # conn -> process
        self._idle: list[Any] = []  # ready conns
        self._lock = threading.Lock()
        self.restarts = 0
        self._finalizer = weakref.finalize(self, HardTimeoutPool._shutdown, self._procs)

    def _start(self) -> Any:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=self.target, args=(child, *self.target_args), daemon=True,
                                 name="mopd-verifier-worker")
        proc.start()
        child.close()
        self._procs[parent] = proc
        return parent

    def _kill(self, conn: Any) -> None:
        proc = self._procs.pop(conn, None)
        if conn in self._idle:
            self._idle.remove(conn)
        if proc is not None:
            proc.kill()
            proc.join(5)
        conn.close()

    def _await_ready(self, starting: list[Any]) -> None:
        from multiprocessing.connection import wait

        deadline = time.monotonic() + self.startup_timeout_s
        pending = list(starting)
        while pending:
            left = deadline - time.monotonic()
            ready = wait(pending, timeout=max(0.0, left)) if left > 0 else []
            if not ready:
                for c in pending:
                    self._kill(c)
                raise RuntimeError(f"verifier worker did not start within {self.startup_timeout_s:.0f}s")
            for c in ready:
                pending.remove(c)
                try:
                    kind, detail = c.recv()
                except (EOFError, OSError):
                    kind, detail = "failed", "the worker process died while starting"
                if kind != "ready":
                    self._kill(c)
                    for other in pending:
                        self._kill(other)
                    raise DomainError(f"verifier worker cannot start: {detail}; install the domains extra: "
                                      f"{_INSTALL}")
                self._idle.append(c)

    def map(self, items: Sequence[tuple]) -> list[tuple[str, Any]]:
        from multiprocessing.connection import wait

        with self._lock:
            results: list[tuple[str, Any]] = [("error", "not run")] * len(items)
            todo = deque(range(len(items)))
            busy: dict[Any, tuple[int, float]] = {}
            while todo or busy:
                missing = min(self.workers - len(self._procs), len(todo) - len(self._idle))
                if missing > 0:  # first use, or replacing killed workers (started only while work is left)
                    self._await_ready([self._start() for _ in range(missing)])
                while todo and self._idle:
                    conn = self._idle.pop()
                    i = todo.popleft()
                    try:
                        conn.send((i, items[i]))
                    except (BrokenPipeError, OSError):
                        self._kill(conn)
                        todo.appendleft(i)
                        continue
                    busy[conn] = (i, time.monotonic() + self.timeout_s)
                if not busy:
                    continue
                left = min(d for _, d in busy.values()) - time.monotonic()
                for conn in wait(list(busy), timeout=max(0.0, left)):
                    i, _ = busy.pop(conn)
                    try:
                        _, results[i] = conn.recv()
                        self._idle.append(conn)
                    except (EOFError, OSError):  # died (e.g. killed by the OS for memory)
                        results[i] = ("error", "the worker process died")
                        self._kill(conn)
                now = time.monotonic()
                for conn, (i, deadline) in list(busy.items()):
                    if now >= deadline:
                        del busy[conn]
                        results[i] = ("timeout", None)
                        self._kill(conn)
                        self.restarts += 1
            return results

    def close(self) -> None:
        self._finalizer()

    @staticmethod
    def _shutdown(procs: dict) -> None:
        for conn, proc in list(procs.items()):
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
            proc.join(1)
            if proc.is_alive():
                proc.kill()
                proc.join(1)
            conn.close()
        procs.clear()


_POOLS: dict[tuple, HardTimeoutPool] = {}
_POOLS_LOCK = threading.Lock()


def shutdown_pools() -> None:
    """Stop every math_verify worker process of this process (they also stop when it exits)."""
    with _POOLS_LOCK:
        for pool in _POOLS.values():
            pool.close()
        _POOLS.clear()


class MathVerify(RealVerifier):
    """math-verify equivalence of the completion's final answer with `example.answer` (see the module docstring).
    Extracted: the answer string the mode took from the completion."""

    name = "math_verify"

    def __init__(self, *, mode: str = "boxed", timeout_s: float = 5.0, workers: int | None = None,
                 memory_mb: int | None = 4096, **common: Any):
        super().__init__(**common)
        _arg_choice(self.name, "mode", mode, MODES)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 600:
            raise DomainError(f"verifier math_verify: timeout_s must be a number in (0, 600] (got {timeout_s!r})")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise DomainError(f"verifier math_verify: workers must be an int >= 1 (got {workers!r})")
        if memory_mb is not None and (isinstance(memory_mb, bool) or not isinstance(memory_mb, int)
                                      or memory_mb < 256):
            raise DomainError(f"verifier math_verify: memory_mb must be an int >= 256 or null (got {memory_mb!r})")
        self.mode = mode
        self.timeout_s = float(timeout_s)
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self.memory_mb = memory_mb

    def validate(self, example: Example) -> None:
        gold = example.answer
        if gold is None or not str(gold).strip():
            raise DomainError("math_verify needs the gold answer in 'answer' (verl: reward_model.ground_truth); "
                              "add it or choose another verifier")
        if self.mode == "aime" and aime_integer(self._gold(example)) is None:
            raise DomainError(f"math_verify mode aime: answer {gold!r} is not an integer 0-999; use mode boxed "
                              "for this data")

    def check_ready(self) -> None:
        if self.mode != "aime" and importlib.util.find_spec("math_verify") is None:
            raise DomainError(f"verifier math_verify needs the math-verify package: {_INSTALL}")

    def _gold(self, example: Example) -> str:
        gold = str(example.answer or "").strip()
        if self.mode == "gsm8k" and "####" in gold:
            gold = gsm8k_answer(gold) or gold
        if self.mode == "aime":
            gold = last_boxed(gold) or gold
        return gold

    def pool(self) -> HardTimeoutPool:
        """The process pool for this verifier's settings, shared by every MathVerify with the same ones (one set of
        warm workers per process, however many domains or eval benchmarks use math_verify)."""
        key = (self.workers, self.timeout_s, self.memory_mb)
        with _POOLS_LOCK:
            if key not in _POOLS:
                _POOLS[key] = HardTimeoutPool(_worker_main, self.workers, self.timeout_s,
                                              target_args=(self.memory_mb,))
            return _POOLS[key]

    def _extract(self, answer: str) -> str | None:
        if self.mode == "gsm8k":
            return gsm8k_answer(answer)
        if self.mode == "any":
            return answer if answer.strip() else None
        return last_boxed(answer)

    def _score(self, example: Example, answer: str, completion: str) -> VerdictRow:
        return self._score_many([example], [answer])[0]

    def _score_many(self, examples: Sequence[Example], answers: Sequence[str]) -> list[VerdictRow]:
        rows: list[VerdictRow | None] = [None] * len(examples)
        jobs: list[tuple[int, tuple[str, str, str]]] = []
        for k, (ex, ans) in enumerate(zip(examples, answers)):
            pred = self._extract(ans)
            if pred is None or not pred.strip():
                rows[k] = VerdictRow(0.0, None, {"reason": "no final answer found"})
            elif self.mode == "aime":
                got, want = aime_integer(pred), aime_integer(self._gold(ex))
                info = {} if got is not None else {"reason": "not an integer 0-999"}
                rows[k] = VerdictRow(1.0 if got is not None and got == want else 0.0, pred, info)
            else:
                jobs.append((k, (self._gold(ex), pred, self.mode)))
        if jobs:
            for (k, (_, pred, _)), (status, value) in zip(jobs, self.pool().map([a for _, a in jobs])):
                if status == "ok":
                    ok, parsed = value
                    rows[k] = VerdictRow(1.0 if ok else 0.0, pred if self.mode != "any" else parsed,
                                         {"parsed": parsed})
                elif status == "timeout":
                    rows[k] = VerdictRow(0.0, pred if self.mode != "any" else None,
                                         {"timeout": True, "reason": f"math-verify exceeded {self.timeout_s:g}s"})
                else:
                    rows[k] = VerdictRow(0.0, pred if self.mode != "any" else None, {"reason": str(value)})
        return [r for r in rows if r is not None]

    def score_batch(self, examples: Sequence[Example], completions: Sequence[str],
                    truncated: Sequence[bool] | None = None) -> list[VerdictRow]:
        flags = _batch_flags(self.name, examples, completions, truncated)
        split = [self._answer_text(c) for c in completions]
        rows = self._score_many(examples, [a for _, a in split])
        return [self._finish(r, wf, t) for r, (wf, _), t in zip(rows, split, flags)]

    def __repr__(self) -> str:
        return f"MathVerify(mode={self.mode!r}, timeout_s={self.timeout_s}, workers={self.workers})"
