"""Dataset-backed domains: load rows from a file, validate them up front, split a fixed held-out eval set.

Formats: `.jsonl` (one object per line), `.json` (a list of objects), `.parquet`, or a directory written by
`datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk` (then `split` is required). Columns: mopd's flat
format (`prompt` — a string or chat messages — and `teacher_id` required, `answer` optional, every other column
into `Example.fields` for the verifier, e.g. `tests` for code_tests) or one of the hub schemas of `schemas`
(verl RL parquet, IFEval, LiveCodeBench, DeepCoder, TACO, LeetCodeDataset, GSM8K, AIME-style), chosen by the
column map (`params.schema`, default auto). Loaded as a domain, rows without a teacher_id get the domain's name.
Every problem is a one-line `DomainError` naming the file, column or row and the fix, raised before any compute
starts. `datasets`/`pyarrow` are imported only when needed. `filter_long_prompts` drops (and counts, and logs)
prompts over a token budget.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from .base import Domain, DomainError, Example
from .schemas import ColumnMap, SourceInfo, to_examples

log = logging.getLogger("mopd")

SUPPORTED = (".jsonl", ".json", ".parquet")
_FORMATS = "a .jsonl, .json or .parquet file, or a datasets save_to_disk directory"


def load_examples(path: str | os.PathLike, *, split: str | None = None,
                  column_map: ColumnMap | Mapping[str, Any] | None = None,
                  default_teacher_id: str | None = None) -> list[Example]:
    """Load and validate every row of `path` into Examples (see the module docstring for formats/columns).

    column_map: a domain's `params` (only the column-map keys are read: schema, prompt_field, answer_field,
                fields, teacher_id_field, answer_join) or a `ColumnMap`.
    default_teacher_id: the teacher_id of rows that have none (the domain name); None = every row needs one.
    """
    return inspect_source(path, split=split, column_map=column_map, default_teacher_id=default_teacher_id)[0]


def inspect_source(path: str | os.PathLike, *, split: str | None = None,
                   column_map: ColumnMap | Mapping[str, Any] | None = None,
                   default_teacher_id: str | None = None) -> tuple[list[Example], SourceInfo]:
    """`load_examples` plus what the loader made of the file: the schema (given / recognised), its columns and
    where each Example attribute comes from (`mopd data check` prints it)."""
    cm = ColumnMap.from_params(column_map)
    rows, columns, p = _read(path, split)
    return to_examples(rows, str(p), columns, cm, default_teacher_id)


def _read(path: str | os.PathLike, split: str | None) -> tuple[list[dict], list[str] | None, Path]:
    p = Path(path)
    if not p.exists():
        raise DomainError(f"dataset not found: {p} (check the path; expected {_FORMATS})")
    if p.is_dir():
        rows, columns = _read_datasets_dir(p, split)
        return rows, columns, p
    ext = p.suffix.lower()
    if ext not in SUPPORTED:
        raise DomainError(f"unsupported dataset file {p}: extension '{p.suffix or '(none)'}'; convert it to "
                          f"{_FORMATS}")
    if split is not None:
        raise DomainError(f"split={split!r} given for {p}, but only a DatasetDict directory has splits; "
                          "remove split")
    try:
        if ext == ".jsonl":
            rows, columns = _read_jsonl(p), None
        elif ext == ".json":
            rows, columns = _read_json(p), None
        else:
            rows, columns = _read_parquet(p)
    except (OSError, UnicodeDecodeError) as e:  # unreadable, or not UTF-8 text
        raise DomainError(f"cannot read dataset {p} ({type(e).__name__}: {_one_line(e)}); give a readable "
                          "UTF-8 file") from None
    return rows, columns, p


@lru_cache(maxsize=16)
def _cached(resolved: str, mtime_ns: int, size: int, split: str | None, cm: ColumnMap,
            default_teacher_id: str | None) -> tuple[Example, ...]:
    return tuple(load_examples(resolved, split=split, column_map=cm, default_teacher_id=default_teacher_id))


def load_examples_cached(path: str | os.PathLike, *, split: str | None = None,
                         column_map: ColumnMap | Mapping[str, Any] | None = None,
                         default_teacher_id: str | None = None) -> list[Example]:
    """`load_examples`, memoised on (path, mtime, size, split, column map, default teacher_id): several domains
    usually share one file."""
    p = Path(path)
    cm = ColumnMap.from_params(column_map)
    if not p.exists():
        return load_examples(p, split=split)  # raises the not-found error
    st = p.stat()
    return list(_cached(str(p.resolve()), st.st_mtime_ns, st.st_size, split, cm, default_teacher_id))


def domain_examples(source: str | os.PathLike, params: Mapping[str, Any], name: str, *,
                    shared: bool = False) -> list[Example]:
    """Every row of a dataset domain's file, as the recipe reads it (its params' split and column map). A file
    only this domain reads may leave teacher_id out (its rows are the domain's); a `shared` file — several
    domains read it — must name each row's teacher_id, else defaulting would give each of them every row. One
    rule (and so one cache entry) for the teacher-id check, the pre-flight and the domain itself."""
    return load_examples_cached(source, split=params.get("split"), column_map=params,
                                default_teacher_id=None if shared else name)


def filter_long_prompts(examples: Sequence[Example], max_tokens: int, count_tokens: Callable[[Example], int], *,
                        source: str = "the dataset") -> tuple[list[Example], int]:
    """Drop the examples whose prompt is over `max_tokens` (as `count_tokens(example)` measures it — the caller's
    tokenizer and chat formatting), keeping order: (kept, dropped_count). A drop is logged once (logger `mopd`,
    one warning line with the count and `source`) instead of failing mid-run; an input with nothing left is an
    error, raised before compute."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise DomainError(f"filter_long_prompts: max_tokens must be an int >= 1 (got {max_tokens!r}); set "
                          "data.max_prompt_tokens")
    kept, dropped, longest, shortest = [], 0, 0, None
    for e in examples:
        n = int(count_tokens(e))
        if n > max_tokens:
            dropped += 1
            longest = max(longest, n)
            shortest = n if shortest is None else min(shortest, n)
        else:
            kept.append(e)
    if dropped and not kept:
        raise DomainError(f"every prompt of {source} ({dropped}) is over {max_tokens} tokens (the shortest has "
                          f"{shortest}); raise data.max_prompt_tokens or shorten the prompts")
    if dropped:
        log.warning("%s: dropped %d of %d prompts over %d tokens (longest %d); raise data.max_prompt_tokens to "
                    "keep them", source, dropped, len(examples), max_tokens, longest)
    return kept, dropped


# ---- readers ----------------------------------------------------------------------------------------------

def _read_jsonl(p: Path) -> list[dict]:
    rows = []
    with p.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DomainError(f"{p} line {lineno}: invalid JSON ({e.msg}); write one JSON object per "
                                  "line") from None
            if not isinstance(row, dict):
                raise DomainError(f"{p} line {lineno}: expected a JSON object, got {type(row).__name__}; write "
                                  "one object with prompt/teacher_id per line") from None
            rows.append(row)
    return rows


def _read_json(p: Path) -> list[dict]:
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DomainError(f"{p}: invalid JSON ({e.msg} at line {e.lineno}); fix the file or use .jsonl") from None
    if not isinstance(data, list):
        raise DomainError(f"{p}: expected a JSON list of row objects, got {type(data).__name__}; wrap the rows "
                          "in [...] or use .jsonl")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise DomainError(f"{p} row {i}: expected an object, got {type(row).__name__}; every list item must "
                              "be {\"prompt\": ..., \"teacher_id\": ...}")
    return data


def _read_parquet(p: Path) -> tuple[list[dict], list[str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        raise DomainError(f"reading {p} needs pyarrow; pip install pyarrow") from None
    try:
        table = pq.read_table(p)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for corrupt files
        raise DomainError(f"{p}: not a readable parquet file ({type(e).__name__}: {_one_line(e)}); "
                          "rewrite it with pandas/pyarrow") from None
    return table.to_pylist(), list(table.column_names)


def _read_datasets_dir(p: Path, split: str | None) -> tuple[list[dict], list[str]]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        raise DomainError(f"reading the directory {p} needs the `datasets` package; pip install datasets") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # noqa: BLE001 - FileNotFoundError / ValueError depending on the version
        raise DomainError(f"{p} is a directory but not a `datasets` save_to_disk directory ({_one_line(e)}); "
                          f"point to {_FORMATS}") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = ", ".join(ds.keys())
        if split is None:
            raise DomainError(f"{p} is a DatasetDict with splits {splits}; choose one with split=<name> "
                              "(domain params.split)")
        if split not in ds:
            raise DomainError(f"split '{split}' not in {p}; available splits: {splits}")
        ds = ds[split]
    elif split is not None:
        raise DomainError(f"split={split!r} given, but {p} holds a single Dataset without splits; remove split")
    return ds.to_list(), list(ds.column_names)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


# ---- validation -------------------------------------------------------------------------------------------

def check_teacher_ids(examples: Iterable[Example], known_teacher_ids: Iterable[str], source: str = "the dataset"
                      ) -> None:
    """Raise DomainError on the first example whose teacher_id is not a known teacher (row = its index)."""
    known = sorted(set(known_teacher_ids))
    known_set = set(known)
    for i, ex in enumerate(examples):
        if ex.teacher_id not in known_set:
            raise DomainError(f"unknown teacher_id '{ex.teacher_id}' in {source} (row {i}); known teachers: "
                              f"{', '.join(known) or '(none)'}; fix the row or add a domain of that name")


# ---- the domain -------------------------------------------------------------------------------------------

class DatasetDomain(Domain):
    """The rows of one teacher_id, split once into a fixed held-out eval set and a training pool.

    The split is by distinct prompt (rows repeating an eval prompt never reach training). Eval size:
    min(eval_size, ceil(max_eval_fraction × distinct prompts)); at least one training prompt must remain.
    `train_examples` samples the training rows with replacement using the caller's rng.
    """

    def __init__(self, name: str, examples: Sequence[Example], verifier: Any = "exact_match", eval_size: int = 200,
                 seed: int = 0, *, max_eval_fraction: float = 0.2, source: str = "the dataset"):
        from .verifiers import Verifier, get_verifier

        self.name = name
        self.source = str(source)
        self.verifier: Verifier = verifier if isinstance(verifier, Verifier) else get_verifier(verifier)
        if isinstance(eval_size, bool) or not isinstance(eval_size, int) or eval_size < 0:
            raise DomainError(f"domain '{name}': eval_size must be an int >= 0 (got {eval_size!r})")
        if not (isinstance(max_eval_fraction, (int, float)) and 0 < max_eval_fraction < 1):
            raise DomainError(f"domain '{name}': max_eval_fraction must be in (0, 1) (got {max_eval_fraction!r})")
        rows = [(i, e) for i, e in enumerate(examples) if e.teacher_id == name]
        if not rows:
            present = sorted({e.teacher_id for e in examples})
            raise DomainError(f"no rows with teacher_id '{name}' in {self.source}; teacher_ids present: "
                              f"{', '.join(present) or '(none)'}; rename the domain or fix the rows")
        for i, e in rows:
            try:
                self.verifier.validate(e)
            except DomainError as err:
                raise DomainError(f"{self.source} row {i} (domain '{name}'): {err}") from None
        self.verifier.check_ready()
        by_prompt: dict[str, list[Example]] = {}
        for _, e in rows:
            by_prompt.setdefault(e.prompt, []).append(e)
        prompts = list(by_prompt)
        n_eval = min(eval_size, math.ceil(max_eval_fraction * len(prompts)))
        if len(prompts) - n_eval < 1:
            raise DomainError(f"domain '{name}' has {len(prompts)} distinct prompt(s) in {self.source}: nothing "
                              "left to train on after the held-out eval split; add rows or set eval_size=0")
        random.Random(f"mopd-eval:{name}:{seed}").shuffle(prompts)
        self.eval_size = n_eval
        self.seed = seed
        self._eval = tuple(by_prompt[p][0] for p in prompts[:n_eval])
        self._eval_prompts = frozenset(prompts[:n_eval])
        self._train = tuple(e for p in prompts[n_eval:] for e in by_prompt[p])

    @property
    def uses_truncation(self) -> bool:
        return bool(self.verifier.zero_if_truncated)

    def train_examples(self, n: int, rng: random.Random) -> list[Example]:
        k = len(self._train)
        return [self._train[rng.randrange(k)] for _ in range(n)]

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def num_train_rows(self) -> int:
        return len(self._train)

    def reward(self, example: Example, completion: str) -> float:
        return float(self.verifier(example, completion))

    def rewards(self, examples: Sequence[Example], completions: Sequence[str],
                truncated: Sequence[bool] | None = None) -> list[float]:
        if len(examples) != len(completions):
            raise ValueError(f"rewards: {len(examples)} examples but {len(completions)} completions; pass one "
                             "completion per example")
        if truncated is None:
            return [float(r) for r in self.verifier.batch(list(examples), list(completions))]
        # with the truncation flags (verifier_args zero_if_truncated: a cut-off completion earns 0)
        return [float(v.reward) for v in self.verifier.score_batch(list(examples), list(completions),
                                                                   list(truncated))]

    def __repr__(self) -> str:
        return (f"DatasetDomain(name={self.name!r}, source={self.source!r}, verifier={self.verifier.name!r}, "
                f"train_rows={len(self._train)}, eval={len(self._eval)})")
