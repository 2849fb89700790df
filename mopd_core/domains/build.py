"""`build_domain` — a domain from its source — and the kinds it knows (`available_domains`).

It sits above every kind of domain (the synthetic kinds, which register themselves in `base`'s registry when
imported, dataset files with their column maps and verifiers), so those modules import `base` and never this one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from . import synthetic  # noqa: F401  (registers the built-in kinds)
from .base import _REGISTRY, Domain, DomainError, DomainFactory, Example
from .dataset import DatasetDomain, domain_examples
from .schemas import COLUMN_MAP_PARAMS
from .verifiers import get_verifier


def available_domains() -> list[str]:
    """The registered synthetic domain kinds, sorted."""
    return sorted(_REGISTRY)


def get_domain_factory(kind: str) -> DomainFactory:
    known = available_domains()
    if kind not in _REGISTRY:
        raise DomainError(f"unknown synthetic domain kind '{kind}'; known kinds: {', '.join(known)} "
                          "(use source 'synthetic:<kind>' or register_domain)")
    return _REGISTRY[kind]


SYNTHETIC_PREFIX = "synthetic:"


def kind_results_version(source: str) -> int:
    """A synthetic kind's own results version (its factory's `RESULTS_VERSION`, default 1): bumped when the kind
    draws other data from the same params, so stages trained on it are retrained — and only those (the global
    `config.RESULTS_VERSION` would retrain every stage of every recipe). 1 for files and unknown kinds."""
    if not isinstance(source, str) or not source.startswith(SYNTHETIC_PREFIX):
        return 1
    factory = _REGISTRY.get(source[len(SYNTHETIC_PREFIX):])
    return int(factory.RESULTS_VERSION) if isinstance(factory, type) and issubclass(factory, Domain) else 1


def build_domain(name: str, source: str, params: Mapping[str, Any] | None = None, eval_size: int = 200,
                 seed: int = 0, verifier: str | None = None,
                 verifier_args: Mapping[str, Any] | None = None, shared: bool = False,
                 prompt_filter: Callable[[list[Example], str], list[Example]] | None = None) -> Domain:
    """Build the domain `name` from `source`.

    source "synthetic:<kind>": a registered synthetic domain (its own exact-match reward; `params` go to its
                               factory, unknown params are an error).
    any other string:         a dataset path (.jsonl / .json / .parquet / `datasets.save_to_disk` dir); the
                               rows whose teacher_id == name become a DatasetDomain (rows without a teacher_id
                               get `name`). `params` may hold `split` (for a DatasetDict dir), `verifier`
                               (same as the argument), `max_eval_fraction`, and the column map (`schema`,
                               `prompt_field`, `answer_field`, `fields`, `teacher_id_field`, `answer_join`:
                               see `schemas`).
    verifier: dataset sources only (default exact_match); synthetic domains accept only None/"exact_match".
    verifier_args: keyword arguments of the verifier's constructor (e.g. {"mode": "aime"} for math_verify); an
                   unknown one is an error naming the domain, the argument and the accepted ones.
    shared: other domains read the same file, so its rows must name their teacher_id (`dataset.domain_examples`).
    prompt_filter: dataset sources only — `(rows of this domain, source) -> rows kept`, applied before the
                   eval/train split (the recipe's `data.filter_overlong_prompts`).
    """
    if not isinstance(name, str) or not name:
        raise DomainError(f"domain name must be a non-empty string (got {name!r}); set data.domains[].name")
    if not isinstance(source, str) or not source.strip():
        raise DomainError(f"domain '{name}': source must be 'synthetic:<kind>' or a dataset path (got {source!r})")
    if isinstance(eval_size, bool) or not isinstance(eval_size, int) or eval_size < 0:
        raise DomainError(f"domain '{name}': eval_size must be an int >= 0 (got {eval_size!r})")
    params = dict(params or {})
    if source.startswith(SYNTHETIC_PREFIX):
        kind = source[len(SYNTHETIC_PREFIX):]
        if verifier not in (None, "exact_match"):
            raise DomainError(f"domain '{name}': synthetic sources bring their own exact-match reward; remove "
                              f"verifier '{verifier}' or use a dataset source")
        if verifier_args:
            raise DomainError(f"domain '{name}': synthetic sources take no verifier_args (got "
                              f"{sorted(verifier_args)}); remove them or use a dataset source")
        factory = get_domain_factory(kind)
        return factory(name=name, eval_size=eval_size, seed=seed, **params)

    known = {"split", "verifier", "max_eval_fraction", *COLUMN_MAP_PARAMS}
    unknown = sorted(set(params) - known)
    if unknown:
        raise DomainError(f"domain '{name}': unknown params {unknown} for dataset source {source}; accepted: "
                          f"{', '.join(sorted(known))}")
    if verifier is not None and "verifier" in params and params["verifier"] != verifier:
        raise DomainError(f"domain '{name}': verifier given twice ({verifier!r} and params.verifier="
                          f"{params['verifier']!r}); keep one")
    v = verifier or params.get("verifier") or "exact_match"
    if verifier_args is not None and not isinstance(verifier_args, Mapping):
        raise DomainError(f"domain '{name}': verifier_args must be a mapping (got {type(verifier_args).__name__});"
                          " write them as key: value pairs")
    try:  # before loading the data: a typo in verifier_args costs no I/O
        v = get_verifier(v, **dict(verifier_args or {}))
    except DomainError as e:
        raise DomainError(f"domain '{name}': {e}") from None
    examples = domain_examples(source, params, name, shared=shared)
    if prompt_filter is not None:
        examples = prompt_filter([e for e in examples if e.teacher_id == name], source)
    kwargs = {}
    if "max_eval_fraction" in params:
        kwargs["max_eval_fraction"] = params["max_eval_fraction"]
    return DatasetDomain(name, examples, verifier=v, eval_size=eval_size, seed=seed, source=source, **kwargs)
