"""The domain contract: `Example`, the `Domain` base class, the domain registry and `DomainError`.

A domain is a prompt source (train prompts sampled with a caller's `random.Random`, plus a fixed held-out eval
set that training never sees) and a reward function in [0, 1]. Its `name` is the `teacher_id` that routes a
sample to its teacher.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import DataError


class DomainError(DataError):
    """Bad domain input (source, params, dataset file, row). The message is one line naming the field, file or
    row, and the fix."""


def _freeze(value: Any) -> Any:
    """Deep-immutable copy: lists/tuples → tuples, mappings → FrozenFields, sets → frozensets."""
    if isinstance(value, FrozenFields):
        return value
    if isinstance(value, Mapping):
        return FrozenFields(value)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(_freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Inverse of `_freeze` into plain JSON-friendly containers (dicts and lists): what a Jinja chat template, a
    `datasets` table, JSON or a third-party checker expects of an Example's frozen fields and messages."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(thaw(v) for v in value)
    return value


class FrozenFields(Mapping):
    """An immutable, hashable mapping (nested lists become tuples, nested dicts FrozenFields), so that
    `Example` stays hashable while `ex.fields["tests"]` works as with a dict."""

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[str, Any] | None = None):
        self._data = {str(k): _freeze(v) for k, v in (data or {}).items()}
        self._hash: int | None = None

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(sorted(self._data.items(), key=lambda kv: kv[0])))
        return self._hash

    def __repr__(self) -> str:
        return f"FrozenFields({self._data!r})"

    def to_dict(self) -> dict[str, Any]:
        return thaw(self)


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def freeze_messages(messages: Any) -> tuple[FrozenFields, ...]:
    """Validate chat messages and store them as a tuple of immutable {"role", "content"} mappings."""
    if isinstance(messages, Mapping) or not isinstance(messages, (list, tuple)):
        raise DomainError(f"prompt must be a string or a list of chat messages (got {type(messages).__name__}); "
                          "write a string or [{\"role\": \"user\", \"content\": ...}]")
    if not messages:
        raise DomainError("prompt is an empty list of chat messages; give at least one "
                          "{\"role\": \"user\", \"content\": ...}")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise DomainError(f"prompt message {j} is a {type(m).__name__}, not a {{role, content}} mapping; write "
                              "each message as {\"role\": ..., \"content\": ...}")
        # parquet struct columns fill absent keys with null: those carry nothing and are ignored
        extra = sorted(str(k) for k, v in m.items() if k not in ("role", "content") and v is not None)
        if extra:
            raise DomainError(f"prompt message {j} has keys {extra} besides role/content; messages carry only "
                              "'role' and 'content' (ShareGPT's from/value: map human→user, gpt→assistant)")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise DomainError(f"prompt message {j}: role {role!r} is not one of {', '.join(CHAT_ROLES)}; rename it "
                              "(e.g. human→user, gpt→assistant)")
        if not isinstance(content, str):
            raise DomainError(f"prompt message {j} ({role}): content must be a string (got "
                              f"{type(content).__name__}); multimodal or null content is not supported")
        out.append(FrozenFields({"role": role, "content": content}))
    if not any(m["content"].strip() for m in out):
        raise DomainError("prompt: every chat message has empty content; give the user turn its text")
    return tuple(out)


@dataclass(frozen=True)
class Example:
    """One prompt of one domain.

    prompt:     a raw prompt string, or chat messages: a tuple of immutable {"role", "content"} mappings (a list
                of dicts is accepted and frozen). How either becomes token ids is the prompt formatter's job;
                `prompt_messages()` / `prompt_text()` give the two views of it.
    teacher_id: the domain name; routes the sample to its teacher.
    answer:     reference answer (SFT target unless fields["completion"]; the math/exact-match verifiers' ground
                truth), without EOS.
    fields:     extra verifier fields (e.g. "tests" for code_tests); stored immutable and hashable.
    """

    prompt: str | tuple[Mapping[str, str], ...]
    teacher_id: str
    answer: str | None = None
    fields: Mapping[str, Any] = field(default_factory=FrozenFields)

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            object.__setattr__(self, "prompt", freeze_messages(self.prompt))
        if not isinstance(self.fields, FrozenFields):
            object.__setattr__(self, "fields", FrozenFields(self.fields))

    @property
    def is_chat(self) -> bool:
        """True when the prompt is chat messages rather than a raw string."""
        return not isinstance(self.prompt, str)

    def prompt_messages(self) -> list[dict[str, str]]:
        """The prompt as chat messages (plain dicts): a string prompt is one user turn."""
        if isinstance(self.prompt, str):
            return [{"role": "user", "content": self.prompt}]
        return [{"role": m["role"], "content": m["content"]} for m in self.prompt]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly row (`fields` flattened into columns, messages as a list of dicts), the inverse of the
        dataset loader."""
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt_messages()
        row: dict[str, Any] = {"prompt": prompt, "teacher_id": self.teacher_id}
        if self.answer is not None:
            row["answer"] = self.answer
        row.update(self.fields.to_dict())
        return row


def prompt_text(prompt: Example | str | Sequence[Mapping[str, str]]) -> str:
    """Plain text of a prompt (an Example's, a string, or messages) for logs, previews and text-only consumers: a
    string as is; messages → their contents joined by a blank line (no role markers, no chat template — render
    with the prompt formatter for token ids). A single user turn gives exactly its content."""
    p = prompt.prompt if isinstance(prompt, Example) else prompt
    if isinstance(p, str):
        return p
    return "\n\n".join(m["content"] for m in freeze_messages(p))


def exact_match(completion: str, answer: str | None) -> float:
    """1.0 when the completion equals the answer up to surrounding whitespace, else 0.0."""
    if answer is None:
        return 0.0
    return 1.0 if completion.strip() == answer.strip() else 0.0


class Domain(ABC):
    """A prompt source with a fixed held-out eval set and a reward in [0, 1].

    Subclasses implement `train_examples`, `eval_examples` and `reward`; `rewards` is the batch form (override
    it to parallelise, as the sandboxed code verifier does).
    """

    name: str = "?"  # set by every domain's constructor
    # a synthetic kind's own results version (`build.kind_results_version`): bumped when the kind draws other data
    RESULTS_VERSION: int = 1

    @abstractmethod
    def train_examples(self, n: int, rng: random.Random) -> list[Example]:
        """`n` training examples drawn with `rng` (deterministic given its state); never an eval prompt."""

    @abstractmethod
    def eval_examples(self) -> list[Example]:
        """The fixed held-out eval set: the same list on every call, disjoint from every training prompt."""

    @abstractmethod
    def reward(self, example: Example, completion: str) -> float:
        """Reward of `completion` for `example`, in [0, 1]."""

    # True when the rewards depend on whether a completion was cut off by the token budget (a dataset domain whose
    # verifier has zero_if_truncated): only then do callers pass `truncated` (a domain written before the argument
    # existed keeps its two-argument `rewards`)
    uses_truncation: bool = False

    def rewards(self, examples: Sequence[Example], completions: Sequence[str],
                truncated: Sequence[bool] | None = None) -> list[float]:
        """Rewards of a batch. `truncated` (per completion: hit the token budget without a stop id) is passed
        when `uses_truncation`; the synthetic domains' exact match ignores it."""
        if len(examples) != len(completions):
            raise ValueError(f"rewards: {len(examples)} examples but {len(completions)} completions; pass one "
                             "completion per example")
        return [float(self.reward(e, c)) for e, c in zip(examples, completions)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# ---- registry of synthetic domain kinds -------------------------------------------------------------------

DomainFactory = Callable[..., Domain]
_REGISTRY: dict[str, DomainFactory] = {}


def register_domain(kind: str, factory: DomainFactory | None = None):
    """Register a synthetic domain kind, reachable as `source="synthetic:<kind>"`.

    The factory is called as `factory(name=..., eval_size=..., seed=..., **params)` and returns a Domain.
    Usable directly (`register_domain("math", MathDomain)`) or as a decorator (`@register_domain("math")`).
    Re-registering a kind replaces it.
    """
    if not isinstance(kind, str) or not kind or ":" in kind:
        raise DomainError(f"domain kind must be a non-empty string without ':' (got {kind!r}); pick another name")

    def _register(f: DomainFactory) -> DomainFactory:
        if not callable(f):
            raise DomainError(f"register_domain('{kind}'): factory {f!r} is not callable; pass a class or function")
        _REGISTRY[kind] = f
        return f

    return _register(factory) if factory is not None else _register


def domain_rewards(domain: Domain, examples: Sequence[Example], completions: Sequence[str],
                   truncated: Sequence[bool] | None = None) -> list[float]:
    """`domain.rewards`, with the truncation flags only for a domain that uses them (`Domain.uses_truncation`)."""
    if truncated is not None and domain.uses_truncation:
        return domain.rewards(examples, completions, truncated)
    return domain.rewards(examples, completions)
