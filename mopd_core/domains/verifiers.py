"""Reward functions for dataset domains, by name: `exact_match`, `contains`, `code_tests`.

A verifier maps (Example, completion) to a reward in [0, 1]. `validate(example)` checks at load time that a row
carries what the verifier needs (so a bad row fails before any compute); `batch` scores many completions (the
code verifier runs them in parallel sandboxes).
"""

from __future__ import annotations

import json
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from .base import DomainError, Example, exact_match


class Verifier(ABC):
    name: str = ""

    @abstractmethod
    def __call__(self, example: Example, completion: str) -> float:
        """Reward in [0, 1]."""

    def validate(self, example: Example) -> None:
        """Raise DomainError (one line, naming the missing/bad field and the fix) if `example` cannot be scored."""

    def check_ready(self) -> None:
        """Raise DomainError if this verifier cannot run on this host (called once when a domain is built)."""

    def batch(self, examples: Sequence[Example], completions: Sequence[str]) -> list[float]:
        if len(examples) != len(completions):
            raise ValueError(f"{self.name}: {len(examples)} examples but {len(completions)} completions")
        return [float(self(e, c)) for e, c in zip(examples, completions)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


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


def parse_tests(example: Example) -> list:
    """`fields["tests"]` as a list of assert strings and/or {"input": str, "output": str} cases (a JSON string
    holding such a list is accepted). Raises DomainError on anything else."""
    if "tests" not in example.fields:
        raise DomainError("code_tests needs a 'tests' column (a list of assert strings or of {input, output} "
                          "cases); add it or choose another verifier")
    tests = example.fields["tests"]
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            raise DomainError("code_tests: 'tests' is a string but not a JSON list; store a list of assert "
                              "strings or of {input, output} objects") from None
    if not isinstance(tests, (list, tuple)) or not tests:
        raise DomainError(f"code_tests: 'tests' must be a non-empty list (got {type(tests).__name__}); store a "
                          "list of assert strings or of {input, output} objects")
    out = []
    for j, t in enumerate(tests):
        if isinstance(t, str) and t.strip():
            out.append(t)
        elif isinstance(t, Mapping) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str):
            out.append({"input": t["input"], "output": t["output"]})
        else:
            raise DomainError(f"code_tests: tests[{j}] is neither an assert string nor an object with string "
                              "'input' and 'output'; fix that test")
    return out


class CodeTests(Verifier):
    """Runs the completion (see `extract_code`) as Python in the sandbox against `fields["tests"]`.

    Assert-string tests run in one sandboxed process after the program (each test counted separately; a
    program that exits or hangs early fails the tests it did not reach). {input, output} tests run the
    program once per case with that stdin and compare stdout (trailing whitespace per line ignored).
    Reward = fraction of tests passed.
    """

    name = "code_tests"

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_workers: int | None = None):
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_workers = max_workers

    def validate(self, example: Example) -> None:
        parse_tests(example)

    def check_ready(self) -> None:
        from .sandbox import SandboxError, sandbox_layers

        try:
            sandbox_layers()  # probes the host once
        except SandboxError as e:
            raise DomainError(f"verifier code_tests cannot run here: {e}") from None

    def __call__(self, example: Example, completion: str) -> float:
        from .sandbox import run_python_tests, run_sandboxed

        tests = parse_tests(example)
        code = extract_code(completion)
        passed = 0
        asserts = [t for t in tests if isinstance(t, str)]
        if asserts:
            passed += sum(run_python_tests(code, asserts, timeout_s=self.timeout_s, memory_mb=self.memory_mb).passed)
        for case in tests:
            if isinstance(case, dict):
                r = run_sandboxed(code, stdin=case["input"], timeout_s=self.timeout_s, memory_mb=self.memory_mb)
                if r.ok and not r.truncated and _norm_output(r.stdout) == _norm_output(case["output"]):
                    passed += 1
        return passed / len(tests)

    def batch(self, examples: Sequence[Example], completions: Sequence[str]) -> list[float]:
        if len(examples) != len(completions):
            raise ValueError(f"{self.name}: {len(examples)} examples but {len(completions)} completions")
        if len(examples) <= 1:
            return [float(self(e, c)) for e, c in zip(examples, completions)]
        workers = self.max_workers or max(1, min(len(examples), os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mopd-code-tests") as pool:
            return [float(r) for r in pool.map(self, examples, completions)]

    def __repr__(self) -> str:
        return f"CodeTests(timeout_s={self.timeout_s}, memory_mb={self.memory_mb})"


# ---- registry ---------------------------------------------------------------------------------------------

_VERIFIERS: dict[str, Callable[[], Verifier]] = {}


def register_verifier(name: str, factory: Callable[[], Verifier] | None = None):
    """Register a verifier class/factory (called with no arguments) under `name`; decorator-friendly."""

    def _register(f: Callable[[], Verifier]) -> Callable[[], Verifier]:
        _VERIFIERS[name] = f
        return f

    return _register(factory) if factory is not None else _register


register_verifier("exact_match", ExactMatch)
register_verifier("contains", Contains)
register_verifier("code_tests", CodeTests)


def available_verifiers() -> list[str]:
    return sorted(_VERIFIERS)


def get_verifier(name: str) -> Verifier:
    """A fresh verifier instance by name; DomainError listing the known names otherwise."""
    if name not in _VERIFIERS:
        raise DomainError(f"unknown verifier '{name}'; known verifiers: {', '.join(available_verifiers())}")
    return _VERIFIERS[name]()
