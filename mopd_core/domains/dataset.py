"""Dataset-backed domains: load rows from a file, validate them up front, split a fixed held-out eval set.

Formats: `.jsonl` (one object per line), `.json` (a list of objects), `.parquet`, or a directory written by
`datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk` (then `split` is required). Columns: `prompt` and
`teacher_id` are required, `answer` is optional, every other column goes into `Example.fields` for the
verifier (e.g. `tests` for code_tests). Every problem is a one-line `DomainError` naming the file, column or
row and the fix, raised before any compute starts. `datasets`/`pyarrow` are imported only when needed.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from .base import Domain, DomainError, Example

SUPPORTED = (".jsonl", ".json", ".parquet")
_FORMATS = "a .jsonl, .json or .parquet file, or a datasets save_to_disk directory"
REQUIRED = ("prompt", "teacher_id")


def load_examples(path: str | os.PathLike, *, split: str | None = None) -> list[Example]:
    """Load and validate every row of `path` into Examples (see the module docstring for formats/columns)."""
    p = Path(path)
    if not p.exists():
        raise DomainError(f"dataset not found: {p} (check the path; expected {_FORMATS})")
    if p.is_dir():
        rows, columns = _read_datasets_dir(p, split)
    else:
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
    return _to_examples(rows, p, columns)


@lru_cache(maxsize=16)
def _cached(resolved: str, mtime_ns: int, size: int, split: str | None) -> tuple[Example, ...]:
    return tuple(load_examples(resolved, split=split))


def load_examples_cached(path: str | os.PathLike, *, split: str | None = None) -> list[Example]:
    """`load_examples`, memoised on (path, mtime, size, split): several domains usually share one file."""
    p = Path(path)
    if not p.exists():
        return load_examples(p, split=split)  # raises the not-found error
    st = p.stat()
    return list(_cached(str(p.resolve()), st.st_mtime_ns, st.st_size, split))


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

def _to_examples(rows: Sequence[Mapping[str, Any]], p: Path, columns: list[str] | None) -> list[Example]:
    if not rows:
        raise DomainError(f"dataset {p} is empty (0 rows); add rows with columns prompt, teacher_id[, answer]")
    if columns is not None:  # tabular formats: the schema names every column once
        for col in REQUIRED:
            if col not in columns:
                raise DomainError(f"{p} has no column '{col}'; columns present: {', '.join(columns)}; add or "
                                  f"rename a column to '{col}'")
    out = []
    for i, row in enumerate(rows):
        for col in REQUIRED:
            if col not in row:
                raise DomainError(f"{p} row {i} has no column '{col}'; columns present: {', '.join(row)}; every "
                                  f"row needs '{col}'")
        prompt, tid, answer = row["prompt"], row["teacher_id"], row.get("answer")
        if not isinstance(prompt, str) or not prompt.strip():
            raise DomainError(f"{p} row {i}: empty or non-string prompt ({prompt!r}); give every row a non-empty "
                              "prompt string")
        if not isinstance(tid, str) or not tid.strip():
            raise DomainError(f"{p} row {i}: teacher_id must be a non-empty string (got {type(tid).__name__} "
                              f"{tid!r}); use the domain name, e.g. \"math\"")
        if answer is not None and not isinstance(answer, str):
            raise DomainError(f"{p} row {i}: answer must be a string or null (got {type(answer).__name__} "
                              f"{answer!r}); quote it, e.g. \"{answer}\"")
        fields = {k: v for k, v in row.items()
                  if k not in ("prompt", "teacher_id", "answer") and not k.startswith("__index_level_")}
        out.append(Example(prompt=prompt, teacher_id=tid, answer=answer, fields=fields))
    return out


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

    def train_examples(self, n: int, rng: random.Random) -> list[Example]:
        k = len(self._train)
        return [self._train[rng.randrange(k)] for _ in range(n)]

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def num_train_rows(self) -> int:
        return len(self._train)

    def reward(self, example: Example, completion: str) -> float:
        return float(self.verifier(example, completion))

    def rewards(self, examples: Sequence[Example], completions: Sequence[str]) -> list[float]:
        if len(examples) != len(completions):
            raise ValueError(f"rewards: {len(examples)} examples but {len(completions)} completions; pass one "
                             "completion per example")
        return [float(r) for r in self.verifier.batch(list(examples), list(completions))]

    def __repr__(self) -> str:
        return (f"DatasetDomain(name={self.name!r}, source={self.source!r}, verifier={self.verifier.name!r}, "
                f"train_rows={len(self._train)}, eval={len(self._eval)})")
