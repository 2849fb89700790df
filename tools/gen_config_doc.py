"""Writes docs/config.md — every field of the recipe config, from the pydantic models in `mopd_core/config.py`.

    .venv/bin/python tools/gen_config_doc.py > docs/config.md

The page is generated rather than written so it cannot drift from the code: `tests/unit/test_config_doc.py`
regenerates it in memory and fails when the committed file differs (then run the command above). It reads the
models only (names, types, defaults, constraints, `Field(description=…)`, class docstrings); it imports nothing
of the engine but `mopd_core.config`.
"""

from __future__ import annotations

import enum
import inspect
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

# run as a script (`python tools/gen_config_doc.py`): the checkout's mopd_core, not an installed one
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mopd_core import config as C  # noqa: E402

COMMAND = ".venv/bin/python tools/gen_config_doc.py > docs/config.md"
CONSTRAINTS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))


def _model_of(annotation) -> tuple[type[BaseModel] | None, bool]:
    """(the pydantic model a field holds, whether it is a list of them), or (None, False)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is list and args and _is_model(args[0]):
        return args[0], True
    if _is_model(annotation):
        return annotation, False
    models = [a for a in args if _is_model(a)]  # `X | None`
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(models) == 1:
        return models[0], False
    return None, False


def _is_model(t) -> bool:
    return inspect.isclass(t) and issubclass(t, BaseModel)


def _type(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join("…" if a is Ellipsis else _type(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if annotation is type(None):
        return "null"
    if annotation is typing.Any:
        return "any"
    if inspect.isclass(annotation) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in annotation)
    return getattr(annotation, "__name__", str(annotation))  # lib: typing (builtins and typing forms)


def _default(f: FieldInfo) -> str:
    if f.default_factory is not None:
        value = f.default_factory()
    elif f.default is PydanticUndefined:
        return "required"
    else:
        value = f.default
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value}`"


def _constraints(f: FieldInfo) -> str:
    out = []
    for meta in f.metadata:
        for attr, sym in CONSTRAINTS:
            v = getattr(meta, attr, None)  # lib: annotated_types (Ge/Gt/Le/Lt carry one attribute each)
            if v is not None:
                out.append(f"{sym} {v}")
        pattern = getattr(meta, "pattern", None)  # lib: pydantic (its string constraints)
        if pattern is not None:
            out.append(f"matches `{pattern}`")
    return ", ".join(out)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _doc(model: type[BaseModel]) -> str:
    own = model.__dict__.get("__doc__")
    return " ".join(inspect.cleandoc(own).split()) if own else ""


def _rows(model: type[BaseModel], prefix: str, nested: list[tuple[str, type[BaseModel], str]]) -> list[str]:
    """One table row per scalar field of `model`; sub-sections (models, lists of models) go to `nested`."""
    rows = []
    for name, f in model.model_fields.items():
        key = f"{prefix}{f.alias or name}"
        sub, is_list = _model_of(f.annotation)
        if sub is not None:
            nested.append((f"{key}[]" if is_list else key, sub, f.description or ""))
            if not is_list and f.default_factory is None and f.default is not PydanticUndefined:
                rows.append(f"| `{key}` | {_type(f.annotation)} | {_default(f)} | | {_cell(f.description or '')} |")
            continue
        rows.append(f"| `{key}` | {_type(f.annotation)} | {_default(f)} | {_constraints(f)} | "
                    f"{_cell(f.description or '')} |")
    return rows


def _section(key: str, model: type[BaseModel], description: str, level: int) -> list[str]:
    nested: list[tuple[str, type[BaseModel], str]] = []
    rows = _rows(model, key + ".", nested)
    out = [f"{'#' * level} `{key}`", ""]
    intro = " ".join(t for t in (_cell(description), _doc(model)) if t)
    if intro:
        out += [intro, ""]
    if rows:
        out += ["| field | type | default | bounds | what |", "|---|---|---|---|---|", *rows, ""]
    for sub_key, sub, sub_desc in nested:
        out += _section(sub_key, sub, sub_desc, min(level + 1, 4))
    return out


def render() -> str:
    """The whole page, as `tools/gen_config_doc.py` prints it."""
    top = C.RecipeConfig
    nested: list[tuple[str, type[BaseModel], str]] = []
    rows = _rows(top, "", nested)
    out = [
        "# Configuration reference",
        "",
        f"Generated from the pydantic models in `mopd_core/config.py` by `{COMMAND}`; do not edit by hand "
        "(`tests/unit/test_config_doc.py` fails when this page is stale). A preset in `configs/*.yaml` sets any of "
        "these fields; `--set key=value` (CLI, `make recipe SET=\"…\"`) or a deployment's `overrides` change one; "
        "`mopd config show --config PRESET` prints a preset resolved. An unknown key or a value out of bounds is a "
        "one-line error naming the field, before any compute.",
        "",
        "Sections: " + " · ".join(f"[`{k}`](#{k.replace('[]', '').replace('.', '').lower()})"
                                  for k, _, _ in nested),
        "",
        "## Top level",
        "",
        "| field | type | default | bounds | what |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]
    for key, model, description in nested:
        out += _section(key, model, description, 2)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
