"""Hub dataset schemas → `Example`s: the column map of a dataset domain (its `params`) and one adapter per format.

Schemas (`params.schema`; the default `auto` recognises the schema from the columns, see `detect_schema`):

    flat           prompt (string or chat messages) [, teacher_id, answer]; every other column → fields as is
                   (mopd's own format, and what `Example.to_dict` writes)
    verl           verl's RL parquet (examples/data_preprocess/*.py): prompt = chat messages,
                   reward_model.ground_truth → answer; data_source, ability, extra_info, … → fields
    ifeval         IFEval jsonl (google/IFEval, lm-eval's ifeval task): key, prompt, instruction_id_list, kwargs
    livecodebench  LiveCodeBench code_generation(_lite): question_content (+ starter_code) → prompt;
                   public_test_cases + private_test_cases → fields.tests; metadata.func_name → fields.func_name
    deepcoder      agentica-org/DeepCoder-Preview-Dataset: problem (+ starter_code) → prompt; tests (its
                   LiveCodeBench, PrimeIntellect or TACO form) → fields.tests
    taco           BAAI/TACO (and APPS): question (+ starter_code) → prompt; input_output → fields.tests
    leetcode       newfacade/LeetCodeDataset: query (or meta.query) → prompt; test (`def check(candidate)`),
                   entry_point → fields; its `prompt` column (the import prelude) → fields.import_prompt;
                   response (or meta.response) → fields.completion (the SFT target); its `completion` (the bare
                   solution) → fields.solution
    gsm8k          openai/gsm8k: question → prompt; the answer's `#### 42` line → answer "42" (thousands commas
                   dropped, as verl does); the whole worked answer → fields.solution
    aime           question/answer math files (AIME 2024/2025, MATH-500, …): problem or question → prompt,
                   answer → answer

Field contract (what the verifiers read): math → `answer` is the ground-truth string; IFEval →
`fields["instruction_id_list"]` (list of str) and `fields["kwargs"]` (one dict per instruction, null entries
dropped); code → `fields["tests"]` = [{"input": str, "output": str, "testtype": "stdin" | "functional"}] and
`fields["func_name"]` when any test is functional (functional input: one JSON value per line, one per argument;
output: a JSON value — LiveCodeBench's form); LeetCode → `fields["test"]`, `fields["entry_point"]`,
`fields["import_prompt"]`.

Column map (dataset `params`, all optional): `prompt_field`, `answer_field` (null: the rows have no answer),
`teacher_id_field` (default `teacher_id`; rows without one get the domain name) and `fields: {name: path}` take
dotted paths into nested rows (`reward_model.ground_truth`; a list index `prompt.0.content`; a string holding a
JSON object, such as LiveCodeBench's `metadata`, is looked into). They override the schema's own columns; a field
mapped to `tests` or `kwargs` is normalised to the contract above. Columns an adapter does not consume go into
`fields` unchanged.

Answers are coerced to strings: ints as written, floats without a spurious `.0` (`3.0` → "3", `0.5` → "0.5"),
a list is joined only when `params.answer_join` gives the separator (otherwise it is an error naming the row: a
list of golds is a choice the user must make), an object or a boolean is an error. A flat file's own `answer`
column stays strict (a string or null) — mopd files are written with string answers, so a number there is a
writer's mistake; set `answer_field: answer` to coerce it.

Loading never executes dataset content: LiveCodeBench's private tests (base64 of zlib of a pickle of a JSON
string) are unpickled by `_PlainUnpickler`, which admits only plain builtins (str, list, dict, int, float,
bool, None) and refuses every other global with a one-line DomainError.
"""

from __future__ import annotations

import ast
import base64
import binascii
import builtins
import decimal
import io
import json
import math
import numbers
import pickle
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .base import DomainError, Example

SCHEMAS = ("flat", "verl", "ifeval", "livecodebench", "deepcoder", "taco", "leetcode", "gsm8k", "aime")
COLUMN_MAP_PARAMS = ("schema", "prompt_field", "answer_field", "fields", "teacher_id_field", "answer_join")
_RESERVED = ("prompt", "teacher_id", "answer")


class _SchemaDefault:
    """Marker: `answer_field` was not given, the schema's own answer column applies (None means "no answer")."""

    def __repr__(self) -> str:
        return "<schema default>"

    def __reduce__(self) -> str:
        return "SCHEMA_DEFAULT"  # stays the singleton through pickling


SCHEMA_DEFAULT = _SchemaDefault()
_MISSING = object()


@dataclass(frozen=True)
class ColumnMap:
    """The validated column map of a dataset source (hashable: it keys the loader's cache)."""

    schema: str = "auto"
    prompt_field: str | None = None
    answer_field: Any = SCHEMA_DEFAULT
    fields: tuple[tuple[str, str], ...] = ()
    teacher_id_field: str | None = None
    answer_join: str | None = None

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | ColumnMap | None = None) -> ColumnMap:
        """The column-map keys of a domain's `params` (other keys — split, verifier, … — are ignored here)."""
        if params is None:
            return cls()
        if isinstance(params, ColumnMap):
            return params
        if not isinstance(params, Mapping):
            raise DomainError(f"dataset params must be a mapping (got {type(params).__name__}); write them as "
                              "key: value pairs")
        schema = params.get("schema") or "auto"
        if schema not in ("auto", *SCHEMAS):
            raise DomainError(f"params.schema {schema!r} is not a known dataset schema; use one of: auto, "
                              f"{', '.join(SCHEMAS)}")

        def path(key: str) -> str | None:
            v = params.get(key)
            if v is None:
                return None
            if not isinstance(v, str) or not v.strip() or v != v.strip():
                raise DomainError(f"params.{key} must be a dotted column path such as 'reward_model.ground_truth' "
                                  f"(got {v!r})")
            return v

        answer_field = path("answer_field") if "answer_field" in params else SCHEMA_DEFAULT
        fmap = params.get("fields") or {}
        if not isinstance(fmap, Mapping):
            raise DomainError(f"params.fields must map field names to column paths, e.g. {{tests: input_output}} "
                              f"(got {type(fmap).__name__})")
        items = []
        for name, src in fmap.items():
            if not isinstance(name, str) or not name or name in _RESERVED:
                raise DomainError(f"params.fields: {name!r} cannot be a field name; prompt, teacher_id and answer "
                                  "have their own prompt_field / teacher_id_field / answer_field")
            if not isinstance(src, str) or not src.strip():
                raise DomainError(f"params.fields.{name} must be a dotted column path (got {src!r})")
            items.append((name, src))
        join = params.get("answer_join")
        if join is not None and not isinstance(join, str):
            raise DomainError(f"params.answer_join must be the separator string, e.g. ', ' (got {join!r})")
        return cls(schema=schema, prompt_field=path("prompt_field"), answer_field=answer_field,
                   fields=tuple(sorted(items)), teacher_id_field=path("teacher_id_field"), answer_join=join)


@dataclass(frozen=True)
class SourceInfo:
    """What the loader made of a source (printed by `mopd data check`)."""

    source: str
    schema: str
    how: str  # "given" (params.schema), "recognised" (auto) or "fallback" (auto, nothing matched: flat)
    columns: tuple[str, ...]
    mapping: tuple[tuple[str, str], ...]  # (target, where it comes from)
    rows: int


# ---- paths, values ----------------------------------------------------------------------------------------

def get_path(row: Mapping[str, Any], path: str) -> Any:
    """`row[path]` when that key exists (a flattened 'a.b' column), else the dotted walk: mappings by key, lists
    by index, a string holding a JSON object is parsed on the way. `_MISSING` when it leads nowhere."""
    if path in row:
        return row[path]
    cur: Any = row
    for part in path.split("."):
        if isinstance(cur, str) and cur.lstrip().startswith("{"):
            try:
                cur = json.loads(cur)
            except json.JSONDecodeError:
                return _MISSING
        if isinstance(cur, Mapping):
            if part not in cur:
                return _MISSING
            cur = cur[part]
        elif isinstance(cur, (list, tuple)) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return _MISSING
    return cur


def _head(path: str) -> str:
    return path.split(".", 1)[0]


def _short(v: Any, n: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 1] + "…"


def _not_found(row: Mapping[str, Any], path: str) -> str:
    head = path if path in row else _head(path)
    if head not in row:
        return f"no column '{head}' (columns present: {', '.join(map(str, row))})"
    parts, cur, seen = path.split("."), row, []
    for part in parts:
        if isinstance(cur, str) and cur.lstrip().startswith("{"):
            try:
                cur = json.loads(cur)
            except json.JSONDecodeError:
                break
        if isinstance(cur, Mapping) and part in cur:
            cur, seen = cur[part], [*seen, part]
        elif isinstance(cur, (list, tuple)) and part.isdigit() and int(part) < len(cur):
            cur, seen = cur[int(part)], [*seen, part]
        else:
            break
    where = ".".join(seen)
    if isinstance(cur, Mapping):
        return f"'{path}' not found ('{where}' has keys: {', '.join(map(str, cur)) or '(none)'})"
    return f"'{path}' not found ('{where}' is a {type(cur).__name__})"


def coerce_answer(value: Any, what: str = "answer", join: str | None = None) -> str | None:
    """An answer value as a string (see the module docstring): None stays None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise DomainError(f"{what} is a boolean ({value}); store it as a string such as \"{str(value).lower()}\"")
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise DomainError(f"{what} is {value}; give a finite number or a string")
        return str(int(value)) if value == value.to_integral_value() else format(value.normalize(), "f")
    if isinstance(value, numbers.Real):
        x = float(value)
        if not math.isfinite(x):
            raise DomainError(f"{what} is {x}; give a finite number or a string")
        return str(int(x)) if x.is_integer() else repr(x)
    if isinstance(value, (list, tuple)):
        if join is None:
            raise DomainError(f"{what} is a list of {len(value)} item(s); set params.answer_join (e.g. ', ') to "
                              "join them, or pick one with params.answer_field: <column>.0")
        parts = [coerce_answer(v, f"{what} item {j}", None) for j, v in enumerate(value)]
        if any(p is None for p in parts):
            raise DomainError(f"{what} has a null item; drop it from the list or fix the row")
        return join.join(p for p in parts if p is not None)
    if isinstance(value, Mapping):
        raise DomainError(f"{what} is an object (keys: {', '.join(map(str, value))}); map its parts with "
                          "params.fields and set params.answer_field to a string/number path, or null for none")
    raise DomainError(f"{what} must be a string or a number (got {type(value).__name__}); fix the column")


def _json_value(value: Any, col: str) -> Any:
    """A column that holds JSON text (or the decoded value already)."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise DomainError(f"'{col}' is a string but not JSON ({e.msg}); store it as JSON text or as the "
                              "decoded list/object") from None
    return value


def _literal_value(value: Any, col: str) -> Any:
    """`_json_value`, falling back to Python literal syntax: some DeepCoder/PrimeIntellect test columns are
    written with Python's repr (single quotes, True/None). `ast.literal_eval` builds literals only and runs no
    code."""
    try:
        return _json_value(value, col)
    except DomainError:
        try:
            return ast.literal_eval(value.decode("utf-8", "replace") if isinstance(value, bytes) else value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise DomainError(f"'{col}' is a string but neither JSON nor a Python literal; store the tests as JSON "
                              "text or as the decoded list/object") from None


def _json_object(value: Any) -> Any:
    """Metadata-like columns: a JSON object string → dict; anything else as it is (never an error)."""
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


# ---- pickled test cases: never executed ------------------------------------------------------------------

_PLAIN_BUILTINS = frozenset({"str", "list", "dict", "int", "float", "bool"})
_MAX_DECOMPRESSED = 1 << 30  # LiveCodeBench's largest private test sets are far below 1 GiB; this stops a bomb


class _Refused(pickle.UnpicklingError):
    pass


class _PlainUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves no global but the plain builtin types: a pickle can only make them, so
    loading it runs no code of the pickle's choosing (os.system, eval, any __reduce__ gadget is refused).
    The standard library's documented way to restrict unpickling; there is no maintained "safe pickle" for
    plain data, and the alternative — running the dataset's own loader — executes whatever the file names."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _PLAIN_BUILTINS:
            return getattr(builtins, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id")


def plain_unpickle(data: bytes, col: str = "the column") -> Any:
    """Unpickle `data` admitting only plain builtins; DomainError (one line) for anything else."""
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except _Refused as r:
        raise DomainError(f"'{col}' holds a pickle that needs {r}; only plain str/list/dict/int/float/bool/None "
                          "pickles are loaded (dataset content is never executed) — re-export these tests as "
                          "JSON") from None
    except Exception as e:  # noqa: BLE001 - truncated/corrupt pickles raise many types
        raise DomainError(f"'{col}' is not a readable pickle ({type(e).__name__}); re-export these tests as "
                          "JSON") from None


def _decode_compressed(text: str, col: str) -> Any:
    """base64(zlib(pickle(...))) → the pickled value (JSON text decoded), through `plain_unpickle`."""
    try:
        raw = base64.b64decode(text.encode("ascii", "replace"))
    except (binascii.Error, ValueError):
        raise DomainError(f"'{col}' is neither JSON nor base64 text (LiveCodeBench's compressed form); check the "
                          "column") from None
    d = zlib.decompressobj()
    try:
        data = d.decompress(raw, _MAX_DECOMPRESSED)
    except zlib.error:
        raise DomainError(f"'{col}' is neither JSON nor base64 of zlib data (LiveCodeBench's compressed form); "
                          "check the column") from None
    if d.unconsumed_tail:
        raise DomainError(f"'{col}' decompresses to over {_MAX_DECOMPRESSED >> 30} GiB; split the tests or store "
                          "them as JSON")
    value = plain_unpickle(data, col)
    return _json_value(value, col) if isinstance(value, (str, bytes)) else value


def decode_test_blob(value: Any, col: str) -> list:
    """A LiveCodeBench test-case column: JSON text, or base64(zlib(pickle(JSON text))) as its private tests are
    published, or an already decoded list; "" / None → []."""
    if value is None:
        return []
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = _decode_compressed(text, col)
    if not isinstance(value, (list, tuple)):
        raise DomainError(f"'{col}' must hold a list of test cases (got {type(value).__name__}); check the column")
    return list(value)


# ---- code tests -------------------------------------------------------------------------------------------

_TESTTYPES = {"stdin": "stdin", "stdin_stdout": "stdin", "functional": "functional", "function_call": "functional",
              "call": "functional"}
_DEF = re.compile(r"^\s*def\s+([A-Za-z_]\w*)\s*\(", re.MULTILINE)


def starter_func_name(starter: Any) -> str | None:
    """The first function defined in a starter code (LiveCodeBench/TACO: `class Solution: def twoSum(self…`);
    read as text with a regex, never executed."""
    if not isinstance(starter, str):
        return None
    m = _DEF.search(starter)
    return m.group(1) if m else None


def _unwrap(v: Any) -> Any:
    # TACO/APPS and PrimeIntellect store a call's return value wrapped in a one-element list
    return v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v


def _stdin_text(v: Any, what: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
        return "\n".join(v)  # TACO occasionally stores stdin/stdout as a list of lines
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return str(v)
    raise DomainError(f"{what} must be text (got {type(v).__name__} {_short(v)}); check the test case")


def normalize_tests(raw: Any, col: str = "tests", func_name: str | None = None) -> tuple[list, str | None]:
    """Code tests in any of the hub forms → (tests, func_name) in the contract form (module docstring).

    Accepted: JSON text of any of these; TACO/APPS `{"inputs": [...], "outputs": [...], "fn_name"?}`; a list of
    `{"input", "output"[, "testtype" | "type", "fn_name", "metadata": {"func_name"}]}` (LiveCodeBench,
    DeepCoder, PrimeIntellect); a list of assert strings (mopd's flat format, returned unchanged).
    `func_name` is the fallback name for functional tests that name none (metadata / starter code)."""
    v = _literal_value(raw, col)
    cases: list[tuple[Any, Any, str | None, bool]] = []  # (input, output, testtype, already JSON text)
    if isinstance(v, Mapping):
        if "inputs" not in v or "outputs" not in v:
            raise DomainError(f"'{col}' is an object without inputs/outputs (keys: {', '.join(map(str, v))}); "
                              "give {inputs, outputs[, fn_name]} or a list of {input, output} cases")
        ins, outs, fn = v["inputs"], v["outputs"], v.get("fn_name") or None
        if not isinstance(ins, (list, tuple)) or not isinstance(outs, (list, tuple)):
            raise DomainError(f"'{col}': inputs and outputs must be lists; check the column")
        if len(ins) != len(outs):
            raise DomainError(f"'{col}' has {len(ins)} inputs but {len(outs)} outputs; give one output per input")
        if fn is not None and not isinstance(fn, str):
            raise DomainError(f"'{col}': fn_name must be a string (got {type(fn).__name__})")
        func_name = fn or func_name
        cases = [(i, o, "functional" if fn else "stdin", False) for i, o in zip(ins, outs)]
    elif isinstance(v, (list, tuple)):
        if v and all(isinstance(t, str) for t in v):
            return list(v), func_name
        names = set()
        for j, t in enumerate(v):
            if isinstance(t, str) and t.strip():  # an assert string (mopd's flat format), kept as is
                cases.append((t, None, "assert", True))
                continue
            if not isinstance(t, Mapping) or "input" not in t or "output" not in t:
                raise DomainError(f"'{col}'[{j}] is not an {{input, output}} test case (got {_short(t)}); fix "
                                  "that test")
            kind = t.get("testtype") or t.get("type")
            if kind is not None and kind not in _TESTTYPES:
                raise DomainError(f"'{col}'[{j}]: unknown test type {kind!r}; use stdin or functional")
            meta = t.get("metadata") if isinstance(t.get("metadata"), Mapping) else {}
            fn = t.get("fn_name") or meta.get("func_name")
            if fn:
                names.add(fn)
            kind = _TESTTYPES.get(kind) if kind else None
            cases.append((t["input"], t["output"], kind, isinstance(t["input"], str)))
        if len(names) > 1:
            raise DomainError(f"'{col}' names several functions ({', '.join(sorted(map(str, names)))}); one "
                              "problem is one entry point")
        if names:
            func_name = next(iter(names))
        cases = [(i, o, kind or ("functional" if names else "stdin"), enc) for i, o, kind, enc in cases]
    else:
        raise DomainError(f"'{col}' must be a list of test cases or an {{inputs, outputs}} object (got "
                          f"{type(v).__name__}); check the column")
    if not cases:
        raise DomainError(f"'{col}' holds no test cases; add tests or drop the row")
    out = []
    for j, (i, o, kind, encoded) in enumerate(cases):
        what = f"'{col}' test {j}"
        if kind == "assert":
            out.append(i)
            continue
        if kind == "functional":
            if encoded:  # LiveCodeBench: already one JSON value per line / a JSON value
                inp = i
                outp = o if isinstance(o, str) else json.dumps(_unwrap(o))
            else:
                args = i if isinstance(i, (list, tuple)) else [i]
                try:
                    inp = "\n".join(json.dumps(a) for a in args)
                    outp = json.dumps(_unwrap(o))
                except (TypeError, ValueError):
                    raise DomainError(f"{what}: arguments/result are not JSON values; check the test case") from None
        else:
            inp, outp = _stdin_text(i, f"{what} input"), _stdin_text(o, f"{what} output")
        out.append({"input": inp, "output": outp, "testtype": kind})
    if any(isinstance(t, dict) and t["testtype"] == "functional" for t in out):
        if not func_name:
            raise DomainError(f"'{col}' has functional (call-style) tests but no function name; give fn_name / "
                              "metadata.func_name or map one with params.fields.func_name")
        return out, func_name
    return out, None


# ---- IFEval -----------------------------------------------------------------------------------------------

def ifeval_kwargs(raw: Any, n: int | None = None, col: str = "kwargs") -> list[dict]:
    """IFEval's per-instruction kwargs: a list of objects (null → {}), null values dropped (a parquet struct
    column fills every key any instruction uses)."""
    v = _json_value(raw, col)
    if not isinstance(v, (list, tuple)):
        raise DomainError(f"'{col}' must be a list with one object per instruction (got {type(v).__name__})")
    out = []
    for j, kw in enumerate(v):
        if kw is None:
            kw = {}
        if not isinstance(kw, Mapping):
            raise DomainError(f"'{col}'[{j}] must be an object of instruction arguments (got {type(kw).__name__})")
        out.append({str(k): x for k, x in kw.items() if x is not None})
    if n is not None and len(out) != n:
        raise DomainError(f"'{col}' has {len(out)} entries for {n} instructions; give one (possibly empty) object "
                          "per instruction")
    return out


def ifeval_ids(raw: Any, col: str = "instruction_id_list") -> list[str]:
    v = _json_value(raw, col)
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(x, str) and x.strip() for x in v):
        raise DomainError(f"'{col}' must be a non-empty list of instruction ids such as 'punctuation:no_comma' "
                          f"(got {_short(v)})")
    return list(v)


# ---- adapters ---------------------------------------------------------------------------------------------

Adapted = tuple[Any, "str | None", dict]


def _prompt(row: Mapping[str, Any], cm: ColumnMap, defaults: Sequence[str]) -> Any:
    path = cm.prompt_field or next((c for c in defaults if get_path(row, c) is not _MISSING), defaults[0])
    v = get_path(row, path)
    if v is _MISSING:
        raise DomainError(f"prompt: {_not_found(row, path)}; set params.prompt_field")
    if isinstance(v, str):
        if not v.strip():
            raise DomainError(f"empty or non-string prompt ({_short(v)}); give every row a non-empty prompt string")
        return v
    if isinstance(v, (list, tuple)):
        return v  # chat messages: `Example` validates and freezes them
    raise DomainError(f"empty or non-string prompt ({_short(v)}); give every row a non-empty prompt string or "
                      "chat messages")


def _answer(row: Mapping[str, Any], cm: ColumnMap, default: str | None, *, required: bool,
            strict: bool = False) -> str | None:
    explicit = cm.answer_field is not SCHEMA_DEFAULT
    path = cm.answer_field if explicit else default
    if path is None:
        return None
    v = get_path(row, path)
    if v is _MISSING:
        if required or explicit:
            raise DomainError(f"answer: {_not_found(row, path)}; set params.answer_field (null for no answer)")
        return None
    if strict and not explicit:
        if v is not None and not isinstance(v, str):
            raise DomainError(f"answer must be a string or null (got {type(v).__name__} {_short(v)}); quote it, "
                              f"e.g. \"{v}\" (or set params.answer_field: answer to coerce it)")
        return v
    return coerce_answer(v, f"answer ('{path}')", cm.answer_join)


def _with_starter(question: Any, starter: Any) -> Any:
    if isinstance(question, str) and isinstance(starter, str) and starter.strip():
        return f"{question.rstrip()}\n\nStarter code:\n```python\n{starter.rstrip()}\n```"
    return question


def _flat(row, cm) -> Adapted:
    return _prompt(row, cm, ("prompt",)), _answer(row, cm, "answer", required=False, strict=True), {}


def _verl(row, cm) -> Adapted:
    return _prompt(row, cm, ("prompt",)), _answer(row, cm, "reward_model.ground_truth", required=True), {}


def _ifeval(row, cm) -> Adapted:
    ids = ifeval_ids(row["instruction_id_list"])
    return (_prompt(row, cm, ("prompt",)), _answer(row, cm, None, required=False),
            {"instruction_id_list": ids, "kwargs": ifeval_kwargs(row["kwargs"], len(ids))})


def _code_fields(tests: list, fn: str | None, **extra: Any) -> dict:
    fields = {"tests": tests, **extra}
    if fn:
        fields["func_name"] = fn
    return fields


def _livecodebench(row, cm) -> Adapted:
    starter = row.get("starter_code") or ""
    meta = _json_object(row.get("metadata"))
    hint = (meta.get("func_name") if isinstance(meta, Mapping) else None) or starter_func_name(starter)
    cases = (decode_test_blob(row.get("public_test_cases"), "public_test_cases")
             + decode_test_blob(row.get("private_test_cases"), "private_test_cases"))
    tests, fn = normalize_tests(cases, "public_test_cases + private_test_cases", hint)
    extra = {} if meta is None else {"metadata": meta}
    return (_with_starter(_prompt(row, cm, ("question_content",)), starter), _answer(row, cm, None, required=False),
            _code_fields(tests, fn, **extra))


def _deepcoder(row, cm) -> Adapted:
    starter = row.get("starter_code") or ""
    meta = _json_object(row.get("metadata"))
    hint = (meta.get("func_name") if isinstance(meta, Mapping) else None) or starter_func_name(starter)
    tests, fn = normalize_tests(row["tests"], "tests", hint)
    extra = {} if meta is None else {"metadata": meta}
    return (_with_starter(_prompt(row, cm, ("problem",)), starter), _answer(row, cm, None, required=False),
            _code_fields(tests, fn, **extra))


def _taco(row, cm) -> Adapted:
    starter = row.get("starter_code") or ""
    tests, fn = normalize_tests(row["input_output"], "input_output", starter_func_name(starter))
    return (_with_starter(_prompt(row, cm, ("question",)), starter), _answer(row, cm, None, required=False),
            _code_fields(tests, fn))


def _leetcode(row, cm) -> Adapted:
    test, entry = row["test"], row["entry_point"]
    if not isinstance(test, str) or "def check(" not in test:
        raise DomainError(f"'test' must be the source of a `def check(candidate)` function (got {_short(test)}); "
                          "LeetCodeDataset rows carry one — check the file or use schema flat")
    if not isinstance(entry, str) or not entry.strip():
        raise DomainError(f"'entry_point' must name the function under test, e.g. 'Solution().twoSum' (got "
                          f"{_short(entry)})")
    fields: dict[str, Any] = {"test": test, "entry_point": entry}
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        fields["import_prompt"] = row["prompt"]
    if "completion" in row:
        fields["solution"] = row["completion"]
    response = get_path(row, "response") if "response" in row else get_path(row, "meta.response")
    if isinstance(response, str):
        fields["completion"] = response
    # the hub copy has query/response as columns, the repository's jsonl files inside `meta`
    return _prompt(row, cm, ("query", "meta.query")), _answer(row, cm, None, required=False), fields


_GSM8K_FINAL = re.compile(r"^[ \t]*####[ \t]*(.*?)[ \t]*$", re.MULTILINE)


def _gsm8k(row, cm) -> Adapted:
    prompt = _prompt(row, cm, ("question",))
    if cm.answer_field is not SCHEMA_DEFAULT:
        return prompt, _answer(row, cm, None, required=True), {}
    sol = row["answer"]
    finals = _GSM8K_FINAL.findall(sol) if isinstance(sol, str) else []
    if not finals or not finals[-1].strip():
        raise DomainError(f"answer has no '#### <final answer>' line ({_short(sol)}); GSM8K answers end with one — "
                          "fix the row, or use schema aime / params.answer_field for plain answers")
    return prompt, finals[-1].replace(",", "").strip(), {"solution": sol}


def _aime(row, cm) -> Adapted:
    return _prompt(row, cm, ("problem", "question")), _answer(row, cm, "answer", required=True), {}


@dataclass(frozen=True)
class Schema:
    name: str
    prompt_cols: tuple[str, ...]  # the prompt column (alternatives: the first present is used)
    answer_col: str | None  # the default answer path (required unless the schema's answer is optional)
    answer_required: bool
    required: tuple[str, ...]  # further columns the adapter needs
    consumes: tuple[str, ...]  # raw columns not copied into fields (the adapter decoded them)
    adapt: Callable[[Mapping[str, Any], ColumnMap], Adapted]
    mapping: tuple[tuple[str, str], ...]  # (target, source) as `mopd data check` prints it


_CODE_TESTS = "fields.tests"
_SCHEMA_LIST = (
    Schema("flat", ("prompt",), "answer", False, (), ("prompt", "answer"), _flat,
           (("prompt", "prompt"), ("answer", "answer (optional, a string)"))),
    Schema("verl", ("prompt",), "reward_model.ground_truth", True, (), ("prompt", "reward_model"), _verl,
           (("prompt", "prompt"), ("answer", "reward_model.ground_truth (coerced to a string)"))),
    Schema("ifeval", ("prompt",), None, False, ("instruction_id_list", "kwargs"), ("prompt",), _ifeval,
           (("prompt", "prompt"), ("fields.instruction_id_list", "instruction_id_list"),
            ("fields.kwargs", "kwargs (null entries dropped)"))),
    Schema("livecodebench", ("question_content",), None, False, ("public_test_cases",),
           ("question_content", "public_test_cases", "private_test_cases"), _livecodebench,
           (("prompt", "question_content + starter_code"),
            (_CODE_TESTS, "public_test_cases + private_test_cases (JSON; private: base64/zlib/plain pickle)"),
            ("fields.func_name", "metadata.func_name (functional tests)"))),
    Schema("deepcoder", ("problem",), None, False, ("tests",), ("problem", "tests"), _deepcoder,
           (("prompt", "problem + starter_code"), (_CODE_TESTS, "tests (LiveCodeBench / PrimeIntellect / TACO form)"),
            ("fields.func_name", "fn_name / metadata.func_name (functional tests)"))),
    Schema("taco", ("question",), None, False, ("input_output",), ("question", "input_output"), _taco,
           (("prompt", "question + starter_code"), (_CODE_TESTS, "input_output {inputs, outputs, fn_name}"),
            ("fields.func_name", "input_output.fn_name (call-based tests)"))),
    Schema("leetcode", ("query", "meta.query"), None, False, ("test", "entry_point"),
           ("query", "prompt", "completion", "response"), _leetcode,
           (("prompt", "query | meta.query"), ("fields.test", "test (def check(candidate))"),
            ("fields.entry_point", "entry_point"), ("fields.import_prompt", "prompt"),
            ("fields.completion", "response | meta.response"), ("fields.solution", "completion"))),
    Schema("gsm8k", ("question",), "answer", True, (), ("question", "answer"), _gsm8k,
           (("prompt", "question"), ("answer", "answer's '#### N' line"), ("fields.solution", "answer"))),
    Schema("aime", ("problem", "question"), "answer", True, (), ("problem", "question", "answer"), _aime,
           (("prompt", "problem | question"), ("answer", "answer (coerced to a string)"))),
)
_SCHEMAS = {s.name: s for s in _SCHEMA_LIST}
assert tuple(_SCHEMAS) == SCHEMAS


def detect_schema(columns: Sequence[str], first_row: Mapping[str, Any] | None = None) -> str | None:
    """The schema a file's columns say it is, or None. Files with a `prompt` column are verl, IFEval, LeetCode or
    flat; the others are told apart by their distinctive columns (GSM8K vs other question/answer files by the
    first answer's `####` line)."""
    cols = set(columns)
    if "prompt" in cols:
        if "reward_model" in cols:
            return "verl"
        if {"instruction_id_list", "kwargs"} <= cols:
            return "ifeval"
        if {"test", "entry_point"} <= cols and cols & {"query", "meta"}:
            return "leetcode"  # a HumanEval file (prompt, test, entry_point, no query) is flat: its prompt is one
        return "flat"
    if {"query", "test", "entry_point"} <= cols:
        return "leetcode"
    if {"question_content", "public_test_cases"} <= cols:
        return "livecodebench"
    if {"problem", "tests"} <= cols:
        return "deepcoder"
    if {"question", "input_output"} <= cols:
        return "taco"
    if "answer" in cols and cols & {"question", "problem"}:
        ans = (first_row or {}).get("answer")
        if "question" in cols and isinstance(ans, str) and _GSM8K_FINAL.search(ans):
            return "gsm8k"
        return "aime"
    return None


def _teacher_id(row: Mapping[str, Any], cm: ColumnMap, default: str | None) -> str:
    path = cm.teacher_id_field or "teacher_id"
    v = get_path(row, path)
    if (v is _MISSING or v is None) and cm.teacher_id_field is None and default is not None:
        return default
    if v is _MISSING:
        raise DomainError(f"teacher_id: {_not_found(row, path)}; fix params.teacher_id_field")
    if not isinstance(v, str) or not v.strip():
        raise DomainError(f"teacher_id must be a non-empty string (got {type(v).__name__} {_short(v)}); use the "
                          "domain name, e.g. \"math\"")
    return v


def _mapped_fields(row: Mapping[str, Any], cm: ColumnMap, fields: dict) -> None:
    names = {n for n, _ in cm.fields}
    for name, src in cm.fields:
        v = get_path(row, src)
        if v is _MISSING:
            raise DomainError(f"params.fields.{name}: {_not_found(row, src)}")
        if name == "tests":
            v, fn = normalize_tests(v, src, fields.get("func_name"))
            if fn and "func_name" not in names:
                fields["func_name"] = fn
        elif name == "kwargs":
            v = ifeval_kwargs(v, None, src)
        fields[name] = v


def _requirements(schema: Schema, cm: ColumnMap, need_tid: bool) -> list[tuple[tuple[str, ...], str]]:
    """(alternative columns, how to fix) a file of `schema` must have, with the column map's overrides."""
    req = []
    if cm.prompt_field:
        req.append(((_head(cm.prompt_field),), "fix params.prompt_field"))
    else:
        req.append((schema.prompt_cols, "map one with params.prompt_field"))
    if cm.answer_field is SCHEMA_DEFAULT:
        if schema.answer_col and schema.answer_required:
            req.append(((_head(schema.answer_col),), "map one with params.answer_field (null for no answer)"))
    elif cm.answer_field is not None:
        req.append(((_head(cm.answer_field),), "fix params.answer_field"))
    req += [((c,), "check the file") for c in schema.required]
    if need_tid:
        req.append(((_head(cm.teacher_id_field or "teacher_id"),),
                    "fix params.teacher_id_field" if cm.teacher_id_field else
                    "load the file as a domain (rows without a teacher_id get its name)"))
    req += [((_head(src),), f"fix params.fields.{name}") for name, src in cm.fields]
    return req


def _present(alts: tuple[str, ...], cols) -> bool:
    return any(a in cols or _head(a) in cols for a in alts)


def _schema_hint(schema: Schema, how: str) -> str:
    if how == "fallback":
        return (f"no known schema matches; set params.schema to one of {', '.join(SCHEMAS)} or map the columns with "
                "params.prompt_field / answer_field / fields")
    return f"schema {schema.name}{' (recognised from the columns)' if how == 'recognised' else ''}"


def to_examples(rows: Sequence[Mapping[str, Any]], source: str, columns: Sequence[str] | None,
                column_map: ColumnMap | Mapping[str, Any] | None = None, default_teacher_id: str | None = None
                ) -> tuple[list[Example], SourceInfo]:
    """Validate and map every row of a source into Examples. `columns`: the tabular formats' column names (checked
    once); None for jsonl/json, where each row is checked. Errors are one line naming the file, row, column and
    fix."""
    cm = ColumnMap.from_params(column_map)
    if not rows:
        raise DomainError(f"dataset {source} is empty (0 rows); add rows with columns prompt, teacher_id[, answer]")
    cols = list(columns) if columns is not None else list(dict.fromkeys(k for r in rows for k in r))
    if cm.schema != "auto":
        name, how = cm.schema, "given"
    else:
        found = detect_schema(cols, rows[0])
        name, how = (found, "recognised") if found else ("flat", "fallback")
    schema = _SCHEMAS[name]
    need_tid = default_teacher_id is None or cm.teacher_id_field is not None
    reqs = _requirements(schema, cm, need_tid)
    if columns is not None:  # tabular formats: the schema names every column once
        for alts, fix in reqs:
            if not _present(alts, cols):
                raise DomainError(f"{source} has no column '{alts[0]}' ({_schema_hint(schema, how)}); columns "
                                  f"present: {', '.join(cols)}; add or rename a column to '{alts[0]}' or {fix}")
    tid_path = cm.teacher_id_field or "teacher_id"
    consumed = {*schema.consumes, _head(tid_path), tid_path}
    for p in (cm.prompt_field, cm.answer_field if isinstance(cm.answer_field, str) else None,
              *(src for _, src in cm.fields)):
        if p:
            consumed |= {p, _head(p)}
    out = []
    for i, row in enumerate(rows):
        if columns is None:
            for alts, fix in reqs:
                if not _present(alts, row):
                    raise DomainError(f"{source} row {i} has no column '{alts[0]}' ({_schema_hint(schema, how)}); "
                                      f"columns present: {', '.join(map(str, row))}; every row needs '{alts[0]}' "
                                      f"— {fix}")
        try:
            prompt, answer, contract = schema.adapt(row, cm)
            tid = _teacher_id(row, cm, default_teacher_id)
            fields = {k: v for k, v in row.items() if k not in consumed and not str(k).startswith("__index_level_")}
            fields.update(contract)
            _mapped_fields(row, cm, fields)
            out.append(Example(prompt=prompt, teacher_id=tid, answer=answer, fields=fields))
        except DomainError as e:
            raise DomainError(f"{source} row {i}: {e}") from None
    return out, SourceInfo(source=source, schema=name, how=how, columns=tuple(map(str, cols)),
                           mapping=_describe(schema, cm, cols, default_teacher_id, consumed), rows=len(out))


def _describe(schema: Schema, cm: ColumnMap, cols: Sequence[str], default_tid: str | None, consumed: set
              ) -> tuple[tuple[str, str], ...]:
    m = dict(schema.mapping)
    if cm.prompt_field:
        m["prompt"] = f"{cm.prompt_field} (params.prompt_field)"
    if cm.answer_field is None:
        m.pop("answer", None)
    elif cm.answer_field is not SCHEMA_DEFAULT:
        m["answer"] = f"{cm.answer_field} (params.answer_field, coerced to a string)"
    tid = cm.teacher_id_field or "teacher_id"
    if cm.teacher_id_field or tid in cols:
        m["teacher_id"] = tid + (" (params.teacher_id_field)" if cm.teacher_id_field else "") + (
            f", else the domain name '{default_tid}'" if default_tid and not cm.teacher_id_field else "")
    else:
        m["teacher_id"] = f"the domain name '{default_tid}'" if default_tid else "(required column teacher_id)"
    for name, src in cm.fields:
        m[f"fields.{name}"] = f"{src} (params.fields)"
    rest = [c for c in cols if c not in consumed and not c.startswith("__index_level_")
            and f"fields.{c}" not in m]
    if rest:
        m["fields (as is)"] = ", ".join(rest)
    return tuple(m.items())
