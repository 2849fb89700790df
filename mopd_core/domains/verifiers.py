"""Reward functions for dataset domains, by name: `exact_match`, `contains`, `code_tests`, `math_verify`, `ifeval`.

A verifier maps (Example, completion) to a reward in [0, 1]. `validate(example)` checks at load time that a row
carries what the verifier needs (so a bad row fails before any compute); `batch` scores many completions (the
code verifier runs them in parallel sandboxes, math_verify in a process pool). `score` also returns what was
extracted from the completion (`VerdictRow`), which evaluation logs per row; its reward equals `__call__`'s.

Verifiers take keyword arguments (`DomainSpec.verifier_args`): `get_verifier(name, **args)`; an unknown one is a
one-line DomainError listing the accepted ones. `math_verify` and `ifeval` need the `mopd[domains]` extra
(math-verify, lm-eval[ifeval]); they import it only when used.
"""

from __future__ import annotations

import inspect
import json
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from .base import DomainError, Example, exact_match


@dataclass(frozen=True)
class VerdictRow:
    """One scored completion: the reward, what the verifier extracted from the completion (the boxed answer, the
    program, the response text; None when nothing was found) and verifier-specific details (JSON-friendly)."""

    reward: float
    extracted: str | None = None
    info: Mapping[str, Any] = field(default_factory=dict)


class Verifier(ABC):
    name: str = ""

    @abstractmethod
    def __call__(self, example: Example, completion: str) -> float:
        """Reward in [0, 1]."""

    def validate(self, example: Example) -> None:
        """Raise DomainError (one line, naming the missing/bad field and the fix) if `example` cannot be scored."""

    def check_ready(self) -> None:
        """Raise DomainError if this verifier cannot run on this host (called once when a domain is built)."""

    def score(self, example: Example, completion: str, *, truncated: bool = False) -> VerdictRow:
        """The reward with what was extracted. Verifiers without an extraction step report the completion."""
        return VerdictRow(float(self(example, completion)), completion, {})

    def score_batch(self, examples: Sequence[Example], completions: Sequence[str],
                    truncated: Sequence[bool] | None = None) -> list[VerdictRow]:
        flags = _batch_flags(self.name, examples, completions, truncated)
        return [self.score(e, c, truncated=t) for e, c, t in zip(examples, completions, flags)]

    def batch(self, examples: Sequence[Example], completions: Sequence[str]) -> list[float]:
        if len(examples) != len(completions):
            raise ValueError(f"{self.name}: {len(examples)} examples but {len(completions)} completions")
        return [float(self(e, c)) for e, c in zip(examples, completions)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _batch_flags(name: str, examples: Sequence, completions: Sequence, truncated: Sequence | None) -> list[bool]:
    """The per-row truncated flags of a `score_batch` call (all False when not given), its lengths checked."""
    if len(examples) != len(completions):
        raise ValueError(f"{name}: {len(examples)} examples but {len(completions)} completions")
    if truncated is not None and len(truncated) != len(examples):
        raise ValueError(f"{name}: {len(examples)} examples but {len(truncated)} truncated flags")
    return list(truncated) if truncated is not None else [False] * len(examples)


# ---- the options every real verifier shares: thinking, truncation --------------------------------------------

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def split_think(completion: str) -> tuple[bool | None, str]:
    """(well_formed, answer) of a completion that may start with a `<think>…</think>` block.

    well_formed: None when the completion has no think tags at all; True when it opens with exactly one
    `<think>`, closes it exactly once and has a non-empty answer after it; False otherwise. answer: the text after
    the closing tag (the whole completion without tags; "" when a think block was opened and never closed, so a
    truncated chain of thought never scores as an answer).
    """
    n_open, n_close = completion.count(_THINK_OPEN), completion.count(_THINK_CLOSE)
    if n_open == 0 and n_close == 0:
        return None, completion
    head = completion.lstrip()
    if n_close == 0:
        return False, ""
    answer = completion.rsplit(_THINK_CLOSE, 1)[1]
    ok = head.startswith(_THINK_OPEN) and n_open == 1 and n_close == 1 and bool(answer.strip())
    return ok, answer


class RealVerifier(Verifier):
    """Base of the verifiers that follow the published recipes (math_verify, ifeval, code_tests).

    Shared arguments: `strip_think` (score only the text after a leading `<think>…</think>`; default on — it
    changes nothing for completions without think tags), `zero_if_truncated` (reward 0 for a completion that hit
    the token budget, when the caller passes `truncated`; default off) and `think_format_weight` w in [0, 1]:
    reward = (1 − w)·task + w·[think block well formed] (default 0: off).
    Subclasses implement `_score(example, answer_text, completion) -> VerdictRow`.
    """

    def __init__(self, *, strip_think: bool = True, zero_if_truncated: bool = False,
                 think_format_weight: float = 0.0):
        _arg_type(self.name, "strip_think", strip_think, bool)
        _arg_type(self.name, "zero_if_truncated", zero_if_truncated, bool)
        if isinstance(think_format_weight, bool) or not isinstance(think_format_weight, (int, float)) \
                or not 0.0 <= think_format_weight <= 1.0:
            raise DomainError(f"verifier {self.name}: think_format_weight must be a number in [0, 1] (got "
                              f"{think_format_weight!r}); 0 turns the format term off")
        self.strip_think = strip_think
        self.zero_if_truncated = zero_if_truncated
        self.think_format_weight = float(think_format_weight)

    @abstractmethod
    def _score(self, example: Example, answer: str, completion: str) -> VerdictRow:
        """Task reward of `answer` (the completion after any think block)."""

    def _answer_text(self, completion: str) -> tuple[bool | None, str]:
        well_formed, answer = split_think(completion)
        return well_formed, (answer if self.strip_think else completion)

    def _finish(self, row: VerdictRow, well_formed: bool | None, truncated: bool) -> VerdictRow:
        info = dict(row.info)
        reward = row.reward
        if self.think_format_weight:
            fmt = 1.0 if well_formed else 0.0
            info["think_format"] = fmt
            reward = (1.0 - self.think_format_weight) * reward + self.think_format_weight * fmt
        if truncated and self.zero_if_truncated:
            info["truncated"] = True
            reward = 0.0
        return VerdictRow(float(reward), row.extracted, info)

    def score(self, example: Example, completion: str, *, truncated: bool = False) -> VerdictRow:
        well_formed, answer = self._answer_text(completion)
        return self._finish(self._score(example, answer, completion), well_formed, truncated)

    def __call__(self, example: Example, completion: str) -> float:
        return self.score(example, completion).reward

    def batch(self, examples: Sequence[Example], completions: Sequence[str]) -> list[float]:
        return [r.reward for r in self.score_batch(examples, completions)]


def _arg_type(verifier: str, arg: str, value: Any, typ: type) -> None:
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise DomainError(f"verifier {verifier}: {arg} must be a {typ.__name__} (got {value!r}); fix verifier_args")


def _arg_choice(verifier: str, arg: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise DomainError(f"verifier {verifier}: {arg} must be one of {', '.join(choices)} (got {value!r}); fix "
                          "verifier_args")


class ExactMatch(Verifier):
    """1.0 iff completion.strip() == answer.strip()."""

    name = "exact_match"

    def validate(self, example: Example) -> None:
        if example.answer is None:
            raise DomainError("exact_match needs an 'answer' column; add it or choose another verifier")

    def __call__(self, example: Example, completion: str) -> float:
        return exact_match(completion, example.answer)


class Contains(Verifier):
    """1.0 iff answer.strip() occurs in the completion."""

    name = "contains"

    def validate(self, example: Example) -> None:
        if example.answer is None or not example.answer.strip():
            raise DomainError("contains needs a non-empty 'answer' column; add it or choose another verifier")

    def __call__(self, example: Example, completion: str) -> float:
        if example.answer is None or not example.answer.strip():
            return 0.0
        return 1.0 if example.answer.strip() in completion else 0.0


class FinalAnswer(Verifier):
    """1.0 iff the final answer — the text after the last `sep` — equals the reference's (whitespace-stripped);
    a worked answer "4+8=12,12+2=14;14" is judged by "14", as math-verify judges the last boxed answer. With
    `check_chain` the worked steps must hold too: each "a+b=c" (or a-b, a*b) is right and starts from the
    previous step's result, and the final answer is the last step's (the reference's own steps are not
    compared: another valid order counts)."""

    name = "final_answer"
    _STEP = re.compile(r"^\s*(-?\d+)\s*([+*-])\s*(-?\d+)\s*=\s*(-?\d+)\s*$")

    def __init__(self, sep: str = ";", check_chain: bool = False):
        _arg_type(self.name, "sep", sep, str)
        _arg_type(self.name, "check_chain", check_chain, bool)
        if not sep:
            raise DomainError(f"verifier {self.name}: sep must be a non-empty string; fix verifier_args")
        self.sep, self.check_chain = sep, check_chain

    def validate(self, example: Example) -> None:
        if example.answer is None or not example.answer.strip():
            raise DomainError("final_answer needs a non-empty 'answer' column; add it or choose another verifier")

    def final(self, text: str) -> str:
        return text.rsplit(self.sep, 1)[-1].strip()

    def chain_ok(self, completion: str) -> bool:
        if self.sep not in completion:
            return False
        body, final = completion.rsplit(self.sep, 1)
        prev = None
        for step in body.split(","):
            m = self._STEP.match(step)
            if m is None:
                return False
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            if (prev is not None and a != prev) or c != (a + b if op == "+" else a - b if op == "-" else a * b):
                return False
            prev = c
        return prev is not None and final.strip() == str(prev)

    def __call__(self, example: Example, completion: str) -> float:
        if example.answer is None or self.sep not in completion:
            return 0.0
        if self.final(completion) != self.final(example.answer):
            return 0.0
        return 1.0 if not self.check_chain or self.chain_ok(completion) else 0.0

    def score(self, example: Example, completion: str, *, truncated: bool = False) -> VerdictRow:
        got = self.final(completion) if self.sep in completion else None
        return VerdictRow(float(self(example, completion)), got, {})


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The program in a completion: the last fenced block (```python … ```, or an untagged one) if any, else the
    whole text."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(completion)]
    py = [b for lang, b in blocks if lang in ("python", "py", "python3", "")]
    if py:
        return py[-1]
    return completion


def _norm_output(s: str) -> str:
    lines = [ln.rstrip() for ln in s.replace("\r\n", "\n").split("\n")]
    return "\n".join(lines).strip("\n")


def lcb_outputs_match(prediction: str, expected: str) -> bool:
    """stdout comparison as LiveCodeBench grades stdin/stdout problems: both texts stripped and split into lines,
    each line stripped; the line counts must agree and each line pair must be equal as text or, token by token,
    as `Decimal` values ("2.50" == "2.5", "3" == "3.0"; no tolerance beyond that, as there)."""
    p_lines = [ln.strip() for ln in prediction.strip().split("\n")]
    g_lines = [ln.strip() for ln in expected.strip().split("\n")]
    if len(p_lines) != len(g_lines):
        return False
    for p, g in zip(p_lines, g_lines):
        if p == g:
            continue
        try:
            if [Decimal(t) for t in p.split()] != [Decimal(t) for t in g.split()]:
                return False
        except (InvalidOperation, ValueError):
            return False
    return True


_TESTTYPES = ("stdin", "functional")
_TESTS_HELP = ("a list of assert strings, of {input, output} cases, or of {input, output, testtype: stdin | "
               "functional} cases (LiveCodeBench)")


def parse_tests(example: Example) -> list:
    """The row's tests, normalised: assert strings; {"input", "output"} (legacy stdin, trailing whitespace ignored);
    {"input", "output", "testtype": "stdin" | "functional"} (LiveCodeBench; functional needs `fields["func_name"]`
    and JSON inputs, one argument per line, and a JSON output); or one {"check": source, "entry_point": expr} for a
    LeetCode-style `fields["test"]` (`def check(candidate): ...`) with `fields["entry_point"]`. `fields["tests"]`
    may be a JSON string holding the list. Raises DomainError on anything else."""
    f = example.fields
    if "tests" not in f:
        if "test" in f:
            return [_parse_check(example)]
        raise DomainError(f"code_tests needs a 'tests' column ({_TESTS_HELP}) or LeetCode's 'test' + "
                          "'entry_point'; add it or choose another verifier")
    tests = f["tests"]
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            raise DomainError(f"code_tests: 'tests' is a string but not a JSON list; store {_TESTS_HELP}") from None
    if not isinstance(tests, (list, tuple)) or not tests:
        raise DomainError(f"code_tests: 'tests' must be a non-empty list (got {type(tests).__name__}); store "
                          f"{_TESTS_HELP}")
    out: list = []
    for j, t in enumerate(tests):
        if isinstance(t, str) and t.strip():
            out.append(t)
        elif isinstance(t, Mapping) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str):
            kind = t.get("testtype")
            if kind is None:
                out.append({"input": t["input"], "output": t["output"]})
                continue
            if kind not in _TESTTYPES:
                raise DomainError(f"code_tests: tests[{j}] has testtype {kind!r}; use 'stdin' or 'functional'")
            case = {"input": t["input"], "output": t["output"], "testtype": kind}
            if kind == "functional":
                _check_functional(example, j, case)
            out.append(case)
        else:
            raise DomainError(f"code_tests: tests[{j}] is neither an assert string nor an object with string "
                              "'input' and 'output'; fix that test")
    return out


def _check_functional(example: Example, j: int, case: dict) -> None:
    name = example.fields.get("func_name")
    if not isinstance(name, str) or not name.isidentifier():
        raise DomainError(f"code_tests: tests[{j}] is a functional test but 'func_name' is {name!r}; store the "
                          "method/function name (LiveCodeBench metadata.func_name)")
    try:
        case["args"] = [json.loads(line) for line in case["input"].split("\n")]
        case["expected"] = json.loads(case["output"])
    except json.JSONDecodeError:
        raise DomainError(f"code_tests: tests[{j}] is a functional test whose input (one JSON value per line) or "
                          "output is not JSON; store them as LiveCodeBench does") from None


def _parse_check(example: Example) -> dict:
    src, entry = example.fields.get("test"), example.fields.get("entry_point")
    if not isinstance(src, str) or "def check(" not in src:
        raise DomainError("code_tests: 'test' must be the source of `def check(candidate): ...` (LeetCodeDataset); "
                          "fix the column")
    if not isinstance(entry, str) or not entry.strip():
        raise DomainError("code_tests: a LeetCode 'test' needs an 'entry_point' column (e.g. 'Solution().twoSum'); "
                          "add it")
    try:
        compile(entry, "<entry_point>", "eval")
    except SyntaxError:
        raise DomainError(f"code_tests: entry_point {entry!r} is not a Python expression; store e.g. "
                          "'Solution().twoSum'") from None
    return {"check": src, "entry_point": entry.strip()}


# Imports LiveCodeBench and LeetCodeDataset put in front of a solution (solutions use `List`, `Counter`, `heapq`
# … without importing them). Our own short list; a row's `import_prompt` field (LeetCodeDataset's `prompt`)
# replaces it.
CODE_PRELUDE = ("from typing import *\nfrom collections import *\nfrom functools import *\nfrom itertools import *\n"
                "from heapq import *\nfrom bisect import *\nfrom math import *\nimport collections, functools, "
                "itertools, heapq, bisect, math, string, re, json\n")

# The child side of a functional test: the program runs in its own namespace (so `if __name__ == "__main__"`
# blocks stay quiet, as under LiveCodeBench), the call's result goes out as one tagged JSON line and is compared
# in the parent — the expected output never enters the sandbox, so the program cannot forge a pass.
_CALL_HARNESS = '''
def _mopd_call():
    import json, os
    dumps, write = json.dumps, os.write
    args = [json.loads(line) for line in {args!r}.split("\\n")]
    ns = {{"__name__": "solution", "__builtins__": __builtins__}}
    exec(compile({code!r}, "solution.py", "exec"), ns)
    sol = ns.get("Solution")
    fn = getattr(sol(), {func!r}) if isinstance(sol, type) else ns[{func!r}]
    out = fn(*args)
    if isinstance(out, tuple):
        out = list(out)
    write(1, ("\\n" + {tag!r} + dumps(out) + "\\n").encode())
_mopd_call()
'''


class CodeTests(RealVerifier):
    """Runs the completion (see `extract_code`) as Python in the sandbox against the row's tests (`parse_tests`).

    Assert strings run in one sandboxed process after the program (a program that exits or hangs early fails the
    tests it did not reach); LeetCode's `check(candidate)` runs the same way, as one test. {input, output} and
    stdin tests run the program once per case with that stdin (legacy cases: trailing whitespace per line ignored;
    testtype stdin: `lcb_outputs_match`); functional tests call `Solution().<func_name>(*args)` (or the top-level
    function) once per case, a tuple counting as a list, as LiveCodeBench does. Every run is its own sandboxed
    process with `timeout_s` wall time and `memory_mb` address space.

    scoring: `all` (reward 1 iff every test passes — the published protocol; stops at the first failure) or
    `fraction` (share passed). Default: `fraction` for rows with assert / legacy {input, output} tests (the
    behaviour before verifier_args existed), `all` for LiveCodeBench and LeetCode rows. max_tests: only the first
    N tests. isolation: `bwrap` (default: the bubblewrap boundary of `sandbox`) or `none` (the explicit opt-out
    for hosts without user namespaces; warned at every stage). Extracted: the program.
    """

    name = "code_tests"

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_workers: int | None = None, *,
                 scoring: str | None = None, max_tests: int | None = None, isolation: str = "bwrap", **common: Any):
        super().__init__(**common)
        _arg_choice(self.name, "isolation", isolation, ("bwrap", "none"))
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600:
            raise DomainError(f"verifier code_tests: timeout_s must be a number in (0, 3600] (got {timeout_s!r})")
        _arg_type(self.name, "memory_mb", memory_mb, int)
        if memory_mb < 32:
            raise DomainError(f"verifier code_tests: memory_mb must be >= 32 (got {memory_mb})")
        if scoring is not None:
            _arg_choice(self.name, "scoring", scoring, ("all", "fraction"))
        if max_tests is not None:
            _arg_type(self.name, "max_tests", max_tests, int)
            if max_tests < 1:
                raise DomainError(f"verifier code_tests: max_tests must be >= 1 (got {max_tests})")
        self.timeout_s = float(timeout_s)
        self.memory_mb = memory_mb
        self.max_workers = max_workers
        self.scoring = scoring
        self.max_tests = max_tests
        self.isolation = isolation

    def validate(self, example: Example) -> None:
        parse_tests(example)

    def check_ready(self) -> None:
        from .sandbox import SandboxError, check_isolation

        try:
            check_isolation(self.isolation)  # probes the host once; `none` warns every time (each stage)
        except SandboxError as e:
            raise DomainError(f"verifier code_tests cannot run here: {e}") from None

    def _score(self, example: Example, answer: str, completion: str) -> VerdictRow:
        from .sandbox import run_python_tests, run_sandboxed

        tests = parse_tests(example)
        if self.max_tests is not None:
            tests = tests[: self.max_tests]
        legacy = all(isinstance(t, str) or "testtype" not in t and "check" not in t for t in tests)
        scoring = self.scoring or ("fraction" if legacy else "all")
        code = extract_code(answer)
        lim = {"timeout_s": self.timeout_s, "memory_mb": self.memory_mb, "isolation": self.isolation}
        results: list[bool] = []
        fail: str | None = None
        asserts = [t for t in tests if isinstance(t, str)]
        if asserts:
            r = run_python_tests(code, asserts, **lim)
            results += r.passed
            if not all(r.passed):
                fail = _why(r.result, "assert test failed")
        for case in tests:
            if isinstance(case, str):
                continue
            if scoring == "all" and fail is not None:
                break  # the published protocol stops at the first failing test
            if "check" in case:
                prelude = example.fields.get("import_prompt")
                prelude = prelude if isinstance(prelude, str) else CODE_PRELUDE
                r = run_python_tests(prelude + "\n" + code, [case["check"] + f"\ncheck({case['entry_point']})\n"],
                                     **lim)
                ok, res = bool(r.passed[0]), r.result
            elif case.get("testtype") == "functional":
                tag = "mopd-result-" + os.urandom(8).hex() + ":"
                harness = _CALL_HARNESS.format(args=case["input"], code=CODE_PRELUDE + code,
                                               func=example.fields["func_name"], tag=tag)
                res = run_sandboxed(harness, **lim)
                ok = res.ok and not res.truncated and _tagged_result(res.stdout, tag) == [case["expected"]]
            else:
                prelude = CODE_PRELUDE if case.get("testtype") == "stdin" else ""
                res = run_sandboxed(prelude + code, stdin=case["input"], **lim)
                same = lcb_outputs_match if case.get("testtype") == "stdin" else \
                    (lambda a, b: _norm_output(a) == _norm_output(b))
                ok = res.ok and not res.truncated and same(res.stdout, case["output"])
            results.append(ok)
            if not ok and fail is None:
                fail = _why(res, "wrong answer")
        passed, total = sum(results), len(tests)
        reward = (1.0 if passed == total else 0.0) if scoring == "all" else passed / total
        info: dict[str, Any] = {"passed": passed, "total": total, "scoring": scoring}
        if fail is not None:
            info["failure"] = fail
        return VerdictRow(reward, code, info)

    def score_batch(self, examples: Sequence[Example], completions: Sequence[str],
                    truncated: Sequence[bool] | None = None) -> list[VerdictRow]:
        flags = _batch_flags(self.name, examples, completions, truncated)
        if len(examples) <= 1:
            return [self.score(e, c, truncated=t) for e, c, t in zip(examples, completions, flags)]
        workers = self.max_workers or max(1, min(len(examples), os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mopd-code-tests") as pool:
            return list(pool.map(lambda e, c, t: self.score(e, c, truncated=t), examples, completions, flags))

    def __repr__(self) -> str:
        return f"CodeTests(timeout_s={self.timeout_s}, memory_mb={self.memory_mb}, scoring={self.scoring})"


def _tagged_result(stdout: str, tag: str) -> list:
    """The JSON value(s) the functional harness printed after `tag` (empty if none or not JSON)."""
    out = []
    for line in stdout.split("\n"):
        if line.startswith(tag):
            try:
                out.append(json.loads(line[len(tag):]))
            except json.JSONDecodeError:
                return []
    return out[-1:] if out else []


def _why(res: Any, default: str) -> str:
    if res.timed_out:
        return "timeout"
    # stdlib modules probe sys._getframe and fall back when refused (namedtuple, typing): not the program's doing
    blocked = [b for b in res.blocked if not b.startswith("sys._getframe")]
    if blocked:
        return "blocked: " + ", ".join(blocked)
    if res.killed_reason:
        return res.killed_reason
    last = res.stderr.strip().splitlines()
    if last:  # a traceback (test mode reports failures on stderr and exits 0)
        return last[-1][:200]
    if res.returncode not in (0, None):
        return f"exit {res.returncode}"
    return default


# ---- registry ---------------------------------------------------------------------------------------------


class _Lazy:
    """A verifier class in a module imported on first use (the `domains` extra's verifiers)."""

    def __init__(self, module: str, attr: str):
        self.module, self.attr = module, attr

    def resolve(self) -> Callable[..., Verifier]:
        import importlib

        return getattr(importlib.import_module(self.module, __package__), self.attr)


_VERIFIERS: dict[str, Callable[..., Verifier] | _Lazy] = {}


def register_verifier(name: str, factory: Callable[..., Verifier] | None = None):
    """Register a verifier class/factory under `name` (called with the domain's verifier_args as keywords);
    decorator-friendly."""

    def _register(f: Callable[..., Verifier]) -> Callable[..., Verifier]:
        _VERIFIERS[name] = f
        return f

    return _register(factory) if factory is not None else _register


register_verifier("exact_match", ExactMatch)
register_verifier("contains", Contains)
register_verifier("code_tests", CodeTests)
register_verifier("final_answer", FinalAnswer)
_VERIFIERS["math_verify"] = _Lazy(".math_verifier", "MathVerify")
_VERIFIERS["ifeval"] = _Lazy(".ifeval_verifier", "IFEval")


def available_verifiers() -> list[str]:
    return sorted(_VERIFIERS)


def verifier_args_of(factory: Callable[..., Verifier]) -> list[str] | None:
    """The keyword arguments `factory` accepts (None: it takes **kwargs it does not name)."""
    names: list[str] = []
    for cls in (factory.__mro__ if isinstance(factory, type) else (factory,)):
        init = cls.__init__ if isinstance(factory, type) else cls
        if isinstance(factory, type) and "__init__" not in vars(cls):
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            return None
        var_kw = False
        for p in params:
            if p.name == "self" or p.kind is p.VAR_POSITIONAL:
                continue
            if p.kind is p.VAR_KEYWORD:
                var_kw = True
            elif p.name not in names:
                names.append(p.name)
        if not var_kw:
            return sorted(names)
        if not isinstance(factory, type):
            return None
    return sorted(names)


def get_verifier(name: str, **args: Any) -> Verifier:
    """A fresh verifier instance by name, built with `args` (a domain's verifier_args); DomainError listing the
    known names, or the accepted arguments, otherwise."""
    if name not in _VERIFIERS:
        raise DomainError(f"unknown verifier '{name}'; known verifiers: {', '.join(available_verifiers())}")
    entry = _VERIFIERS[name]
    factory = entry.resolve() if isinstance(entry, _Lazy) else entry
    accepted = verifier_args_of(factory)
    if accepted is not None:
        unknown = sorted(set(args) - set(accepted))
        if unknown:
            raise DomainError(f"verifier {name}: unknown verifier_args {unknown}; accepted: "
                              f"{', '.join(accepted) or '(none)'}")
    return factory(**args)
