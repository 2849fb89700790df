"""Character-level synthetic domains for the tiny CPU recipe: tasks a ~1.4 M-parameter model learns in minutes on
a CPU.

    math  "37+45=" → "82", "91-27=" → "64" (a ≥ b for '-', so no negatives)
    code  "sort:31425=" → "12345" (digits), "rev:abcde=" → "edcba" (lowercase letters)
    if    "upper:abcd=" → "ABCD", "rep3:ab=" → "ababab"

The completion is the answer string (the tokenizer appends EOS elsewhere); reward = exact match after
stripping surrounding whitespace.

A weak demonstrator (params `weak_tasks`, `weak_rate`, default off): the SFT completion of a training example of
one of `weak_tasks` ends in a stray "." ("64" → "64.") with probability `weak_rate` (`Example.fields
["completion"]`; the reward still checks the exact answer) — a format slip, as real demonstrators make. SFT
learns every task in full, and on the weak ones to add the "." more often than not, so its greedy answer there
is wrong while a sample at temperature 1 is right ~(1 - weak_rate) × its skill — the gap RL with the verifier
closes (pass@k → pass@1) and distillation has to carry over to the student. It keeps the tiny recipe's RL
headroom from hanging on where SFT's learning curve stops (which differed by seed and machine). Tried first: a
demonstration cut one character short (the last character is then seen too rarely to be learned, so RL cannot
recover it) and one with its last character repeated (the model spreads that mass over several characters, so on
some seeds greedy decoding already stops right and the gap is gone) — one fixed token keeps the gap the same on
every seed.

The held-out eval set is `eval_size` distinct prompts drawn from a generator
seeded by (kind, seed) only — not by the domain's name — so it is the same for every run with that seed;
`train_examples` rejects every eval prompt, so training never sees one.
"""

from __future__ import annotations

import random
import string
from abc import abstractmethod
from typing import Any, ClassVar

from .base import Domain, DomainError, Example, exact_match, register_domain

_MAX_REJECTIONS = 10_000
WEAK_SUFFIX = "."  # what the weak demonstrator appends (one token of the tiny character vocabulary)


class SyntheticDomain(Domain):
    """Base for generated domains: subclasses set `kind`, `DEFAULTS` and implement `sample` and `space_size`."""

    kind: ClassVar[str] = ""
    DEFAULTS: ClassVar[dict[str, Any]] = {}
    TASKS: ClassVar[tuple[str, ...]] = ()
    WEAK_DEFAULTS: ClassVar[dict[str, Any]] = {"weak_tasks": [], "weak_rate": 0.0}

    def __init__(self, name: str | None = None, *, eval_size: int = 200, seed: int = 0, **params: Any):
        self.name = name or self.kind
        accepted = {**self.DEFAULTS, **self.WEAK_DEFAULTS}
        unknown = sorted(set(params) - set(accepted))
        if unknown:
            raise DomainError(f"domain '{self.name}' (synthetic:{self.kind}): unknown params {unknown}; accepted: "
                              f"{', '.join(f'{k} (default {v!r})' for k, v in accepted.items()) or 'none'}")
        self.params: dict[str, Any] = {**accepted, **params}
        self._check_params()
        self._check_weak()
        if isinstance(eval_size, bool) or not isinstance(eval_size, int) or eval_size < 0:
            raise DomainError(f"domain '{self.name}': eval_size must be an int >= 0 (got {eval_size!r})")
        space = self.space_size()
        if eval_size > space // 2:
            raise DomainError(f"domain '{self.name}': eval_size={eval_size} is more than half of the "
                              f"{space} distinct prompts of synthetic:{self.kind} with params {self.params}; "
                              "lower eval_size or enlarge the task (params)")
        self.eval_size = eval_size
        self.seed = seed
        rng = random.Random(f"mopd-eval:{self.kind}:{seed}")
        seen: set[str] = set()
        evals: list[Example] = []
        while len(evals) < eval_size:
            ex = self.sample(rng)
            if ex.prompt not in seen:
                seen.add(ex.prompt)
                evals.append(ex)
        self._eval = tuple(evals)
        self._eval_prompts = frozenset(seen)

    # -- subclass hooks --------------------------------------------------------------------------------------
    @abstractmethod
    def sample(self, rng: random.Random) -> Example:
        """One random example (may be an eval prompt; callers filter)."""

    @abstractmethod
    def space_size(self) -> int:
        """Number of distinct prompts the generator can produce."""

    def _check_params(self) -> None:
        pass

    def task_of(self, prompt: str) -> str:
        """The task a prompt belongs to ("sort", "rep", "+", …): the text before ':' (digits dropped)."""
        return prompt.split(":", 1)[0].rstrip(string.digits)

    def _check_weak(self) -> None:
        tasks = self.params["weak_tasks"]
        if isinstance(tasks, str):
            tasks = [tasks]
        if not isinstance(tasks, (list, tuple)) or any(t not in self.TASKS for t in tasks):
            raise self._param_error("weak_tasks", f"must be a list drawn from {list(self.TASKS)}")
        rate = self.params["weak_rate"]
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise self._param_error("weak_rate", "must be a number in [0, 1] (the share of weak demonstrations)")
        self._weak, self._weak_rate = frozenset(tasks), float(rate)

    def _demonstrate(self, ex: Example, rng: random.Random) -> Example:
        """`ex`, or with a weak demonstration (a stray "." after the answer) as its SFT completion."""
        if not self._weak_rate or not self._weak or self.task_of(ex.prompt) not in self._weak:
            return ex
        if rng.random() >= self._weak_rate or ex.answer is None:
            return ex
        return Example(prompt=ex.prompt, teacher_id=ex.teacher_id, answer=ex.answer,
                       fields={**ex.fields, "completion": ex.answer + WEAK_SUFFIX})

    def _param_error(self, key: str, why: str) -> DomainError:
        return DomainError(f"domain '{self.name}' (synthetic:{self.kind}): params.{key}={self.params[key]!r} {why}")

    def _int_param(self, key: str, lo: int, hi: int) -> int:
        v = self.params[key]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self._param_error(key, f"must be an int in [{lo}, {hi}]")
        return v

    def _tasks_param(self, key: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
        v = self.params[key]
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, (list, tuple)) or not v or any(t not in allowed for t in v):
            raise self._param_error(key, f"must be a non-empty list drawn from {list(allowed)}")
        return tuple(dict.fromkeys(v))

    # -- Domain API ------------------------------------------------------------------------------------------
    def train_examples(self, n: int, rng: random.Random) -> list[Example]:
        out: list[Example] = []
        for _ in range(n):
            for _attempt in range(_MAX_REJECTIONS):
                ex = self.sample(rng)
                if ex.prompt not in self._eval_prompts:
                    out.append(self._demonstrate(ex, rng))
                    break
            else:  # pragma: no cover - impossible while eval_size <= space/2
                raise RuntimeError(f"domain '{self.name}': could not draw a non-eval prompt")
        return out

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def is_eval_prompt(self, prompt: str) -> bool:
        return prompt in self._eval_prompts

    def reward(self, example: Example, completion: str) -> float:
        return exact_match(completion, example.answer)

    def _ex(self, prompt: str, answer: str) -> Example:
        return Example(prompt=prompt, teacher_id=self.name, answer=answer)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, eval_size={self.eval_size}, seed={self.seed}, " \
               f"params={self.params})"


@register_domain("math")
class MathDomain(SyntheticDomain):
    """`digits`-digit operands (no leading zeros), ops from "+-*"; "37+45=" → "82", "91-27=" → "64". `digits_b`
    (default: `digits`) sets the second operand's length alone: "37+5=" → "42" with digits_b 1."""

    kind = "math"
    DEFAULTS = {"digits": 2, "ops": "+-", "digits_b": None}
    TASKS = ("+", "-", "*")

    def task_of(self, prompt: str) -> str:
        return next((o for o in "+-*" if o in prompt), "")

    def _check_params(self) -> None:
        d = self._int_param("digits", 1, 9)
        ops = self.params["ops"]
        if not isinstance(ops, str) or not ops or any(o not in "+-*" for o in ops):
            raise self._param_error("ops", "must be a non-empty string of operators from '+-*'")
        self._ops = "".join(dict.fromkeys(ops))
        db = d if self.params["digits_b"] is None else self._int_param("digits_b", 1, 9)
        span = lambda k: (10 ** (k - 1) if k > 1 else 0, 10 ** k - 1)  # noqa: E731
        self._lo, self._hi = span(d)
        self._lo_b, self._hi_b = span(db)

    def sample(self, rng: random.Random) -> Example:
        op = self._ops[rng.randrange(len(self._ops))]
        a = rng.randint(self._lo, self._hi)
        b = rng.randint(self._lo_b, self._hi_b)
        if op == "-" and a < b:
            a, b = b, a
        val = a + b if op == "+" else a - b if op == "-" else a * b
        return self._ex(f"{a}{op}{b}=", str(val))

    def space_size(self) -> int:
        n, m = self._hi - self._lo + 1, self._hi_b - self._lo_b + 1
        if (self._lo, self._hi) == (self._lo_b, self._hi_b):
            return sum(n * (n + 1) // 2 if op == "-" else n * n for op in self._ops)
        # operands of different lengths: a ≥ b, or swapped for '-' (pairs counted once)
        return sum(n * m for _ in self._ops)


@register_domain("code")
class CodeDomain(SyntheticDomain):
    """Program-like transformations: "sort:31425=" → "12345" (digits), "rev:abcde=" → "edcba" (letters)."""

    kind = "code"
    DEFAULTS = {"length": 5, "tasks": ["sort", "rev"]}
    TASKS = ("sort", "rev")

    def _check_params(self) -> None:
        self._len = self._int_param("length", 1, 32)
        self._tasks = self._tasks_param("tasks", self.TASKS)

    def sample(self, rng: random.Random) -> Example:
        task = self._tasks[rng.randrange(len(self._tasks))]
        if task == "sort":
            s = "".join(rng.choice(string.digits) for _ in range(self._len))
            return self._ex(f"sort:{s}=", "".join(sorted(s)))
        s = "".join(rng.choice(string.ascii_lowercase) for _ in range(self._len))
        return self._ex(f"rev:{s}=", s[::-1])

    def space_size(self) -> int:
        return sum(10 ** self._len if t == "sort" else 26 ** self._len for t in self._tasks)


@register_domain("if")
class InstructionDomain(SyntheticDomain):
    """Instruction following: "upper:abcd=" → "ABCD" (word of upper_min_len..upper_max_len letters) and
    "rep3:ab=" → "ababab" (k in rep_min_k..rep_max_k, word of rep_min_len..rep_max_len letters)."""

    kind = "if"
    DEFAULTS = {"tasks": ["upper", "rep"], "upper_min_len": 3, "upper_max_len": 5, "rep_min_len": 2,
                "rep_max_len": 3, "rep_min_k": 2, "rep_max_k": 3}
    TASKS = ("upper", "rep")

    def _check_params(self) -> None:
        self._tasks = self._tasks_param("tasks", self.TASKS)
        ul, uh = self._int_param("upper_min_len", 1, 32), self._int_param("upper_max_len", 1, 32)
        rl, rh = self._int_param("rep_min_len", 1, 32), self._int_param("rep_max_len", 1, 32)
        kl, kh = self._int_param("rep_min_k", 1, 9), self._int_param("rep_max_k", 1, 9)
        for lo, hi, key in ((ul, uh, "upper_max_len"), (rl, rh, "rep_max_len"), (kl, kh, "rep_max_k")):
            if hi < lo:
                raise self._param_error(key, f"must be >= its min ({lo})")
        self._upper, self._rep, self._k = (ul, uh), (rl, rh), (kl, kh)

    @staticmethod
    def _word(rng: random.Random, lo: int, hi: int) -> str:
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))

    def sample(self, rng: random.Random) -> Example:
        task = self._tasks[rng.randrange(len(self._tasks))]
        if task == "upper":
            w = self._word(rng, *self._upper)
            return self._ex(f"upper:{w}=", w.upper())
        k = rng.randint(*self._k)
        w = self._word(rng, *self._rep)
        return self._ex(f"rep{k}:{w}=", w * k)

    def space_size(self) -> int:
        words = lambda lo, hi: sum(26 ** n for n in range(lo, hi + 1))  # noqa: E731
        total = 0
        if "upper" in self._tasks:
            total += words(*self._upper)
        if "rep" in self._tasks:
            total += (self._k[1] - self._k[0] + 1) * words(*self._rep)
        return total


# ---- the imbalanced pair (configs/tiny_imbalanced.yaml) ------------------------------------------------------
# Open-MOPD's diagnosis (arXiv 2608.19098): the `if` domain held 20 % of the prompts but ~1 % of the gradient
# tokens, its answers being ~25x shorter than math's worked solutions. The tiny math/code/if answers are all
# <= 10 characters, so they cannot show it; these two differ ~11x in answer length with the same tiny model.

@register_domain("mathchain")
class MathChainDomain(SyntheticDomain):
    """Long-form math: the running sum of `terms` digits written out step by step, then the final answer after
    `;` — "sum:482=" → "4+8=12,12+2=14;14" (left to right), "rsum:482=" → "2+8=10,10+4=14;14" (right to left).
    Reward: the `final_answer` verifier (the text after the last `;` equals the sum; with `check_chain`, also
    every step's arithmetic and its link to the previous step's result). Each step is the tiny recipe's
    `37+5=` skill; the chain makes the answer ~17 characters long for 3 terms."""

    kind = "mathchain"
    DEFAULTS = {"terms": 3, "tasks": ["sum", "rsum"], "check_chain": False}
    TASKS = ("sum", "rsum")

    def _check_params(self) -> None:
        self._terms = self._int_param("terms", 2, 6)  # 6 terms: a 34-character answer, past the tiny context
        self._tasks = self._tasks_param("tasks", self.TASKS)
        if not isinstance(self.params["check_chain"], bool):
            raise self._param_error("check_chain", "must be true or false")
        from .verifiers import get_verifier

        self._verifier = get_verifier("final_answer", check_chain=self.params["check_chain"])

    @staticmethod
    def chain(digits: list[int]) -> str:
        """The worked answer: "a+b=s1,s1+c=s2,…;final"."""
        acc, steps = digits[0], []
        for d in digits[1:]:
            steps.append(f"{acc}+{d}={acc + d}")
            acc += d
        return ",".join(steps) + f";{acc}"

    def sample(self, rng: random.Random) -> Example:
        task = self._tasks[rng.randrange(len(self._tasks))]
        digits = [rng.randrange(10) for _ in range(self._terms)]
        order = digits if task == "sum" else digits[::-1]
        return self._ex(f"{task}:{''.join(map(str, digits))}=", self.chain(order))

    def space_size(self) -> int:
        return len(self._tasks) * 10 ** self._terms

    def reward(self, example: Example, completion: str) -> float:
        return self._verifier(example, completion)


@register_domain("ifshort")
class ShortInstructionDomain(SyntheticDomain):
    """Short-answer instruction following, written with mathchain's characters only: one-digit answers —
    "mu:48213=" → "4" (the first digit), "um:48213=" → "3" (the last) — from a string of `length` digits.
    Exact match.

    Why digits and the letters of "sum": in a real model every domain shares the vocabulary, so this domain has
    no embedding or output row of its own either. That is realism, not what makes the imbalance show: a control
    with prefixes of letters mathchain never uses ("first:"/"last:"), at configs/tiny_imbalanced.yaml's settings,
    was under-served as much by naive MOPD (18 / 7 % of its headroom recovered, seeds 0 / 1; a trial run on
    2026-12-03, not a committed command).

    Its weak demonstrator copies the wrong position — the second digit for `first` ("mu:48213=" → "8") — a flaw of
    this domain's own (not mathchain's stray "."), so that another domain's signal does not fix it on the side;
    closing it moves attention, which every domain shares."""

    kind = "ifshort"
    RESULTS_VERSION = 2  # 1: letters ("first:qwxyz=" → "q", "last2:…" → "yz"), one letter too many as the flaw
    DEFAULTS = {"tasks": ["first", "last"], "length": 5}
    TASKS = ("first", "last")
    PREFIX = {"first": "mu", "last": "um"}  # letters of mathchain's "sum:"/"rsum:" prompts
    _TASK_OF = {v: k for k, v in PREFIX.items()}

    def _check_params(self) -> None:
        self._tasks = self._tasks_param("tasks", self.TASKS)
        self._len = self._int_param("length", 2, 12)

    def sample(self, rng: random.Random) -> Example:
        task = self._tasks[rng.randrange(len(self._tasks))]
        w = "".join(rng.choice(string.digits) for _ in range(self._len))
        return self._ex(f"{self.PREFIX[task]}:{w}=", w[0] if task == "first" else w[-1])

    def task_of(self, prompt: str) -> str:
        return self._TASK_OF.get(prompt.split(":", 1)[0], "")

    def _demonstrate(self, ex: Example, rng: random.Random) -> Example:
        """`ex`, or with the weak demonstration (the neighbouring digit) as its SFT completion."""
        task = self.task_of(ex.prompt)
        if not self._weak_rate or task not in self._weak or rng.random() >= self._weak_rate:
            return ex
        w = ex.prompt.split(":", 1)[1][:-1]
        return Example(prompt=ex.prompt, teacher_id=ex.teacher_id, answer=ex.answer,
                       fields={**ex.fields, "completion": w[1] if task == "first" else w[-2]})

    def space_size(self) -> int:
        return len(self._tasks) * 10 ** self._len


# ---- the sparse-reward domain (configs/tiny_sparse.yaml) -----------------------------------------------------
# On the tiny math/code/if tasks a sample at T=1 is right ~35 % of the time, so GRPO's reward is nearly as dense as
# a teacher's per-token signal and RL looks as sample-efficient as distillation (benchmarks/results/
# sample_efficiency.md). Here the answer is `length` independent decisions that the reward only sees together.

@register_domain("caps")
class CapsDomain(SyntheticDomain):
    """Sparse reward: "caps:qwxyz=" → "QWXYZ", exact match, so an answer is rewarded only when every one of its
    `length` letters is right.

    Its weak demonstrator (`weak_tasks: [caps]`, `weak_rate` r) leaves each letter of an SFT answer lowercase,
    independently, with probability r. SFT learns the mapping and the slip at every position, so its greedy answer
    keeps at least one lowercase letter (r > 1/2) and a sample at T=1 is right with probability ~(1 − r)^length
    (1.0 % for 5 letters at r = 0.6): GRPO from SFT sees a reward in few groups, while an RL expert's per-token
    score tells the student at every letter of every sample which case it wants."""

    kind = "caps"
    DEFAULTS = {"length": 5}
    TASKS = ("caps",)

    def _check_params(self) -> None:
        self._len = self._int_param("length", 1, 24)

    def sample(self, rng: random.Random) -> Example:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(self._len))
        return self._ex(f"caps:{w}=", w.upper())

    def _demonstrate(self, ex: Example, rng: random.Random) -> Example:
        """`ex`, or with each letter of its SFT completion left lowercase with probability `weak_rate`."""
        if not self._weak_rate or "caps" not in self._weak or ex.answer is None:
            return ex
        slipped = "".join(c.lower() if rng.random() < self._weak_rate else c for c in ex.answer)
        if slipped == ex.answer:
            return ex
        return Example(prompt=ex.prompt, teacher_id=ex.teacher_id, answer=ex.answer,
                       fields={**ex.fields, "completion": slipped})

    def space_size(self) -> int:
        return 26 ** self._len
