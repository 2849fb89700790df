"""docs/config.md is generated from the pydantic models of `mopd_core/config.py` by `tools/gen_config_doc.py`;
these tests regenerate it in memory and fail when the committed page is stale (a field added, renamed, re-described
or given another default without regenerating), naming the command that fixes it."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_doc", ROOT / "tools" / "gen_config_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_config_doc_is_current():
    gen = _generator()
    committed = (ROOT / "docs" / "config.md").read_text()
    fresh = gen.render()
    if committed != fresh:
        diff = "".join(list(difflib.unified_diff(committed.splitlines(True), fresh.splitlines(True),
                                                 "docs/config.md (committed)", "regenerated"))[:40])
        raise AssertionError(f"docs/config.md is stale; regenerate it with `{gen.COMMAND}`\n{diff}")


def test_config_doc_lists_every_field():
    """Every leaf field of the config (dotted, as `--set` takes it) has a row with its description."""
    from mopd_core.config import RecipeConfig

    text = _generator().render()

    def walk(model, prefix):
        for name, f in model.model_fields.items():
            key = prefix + (f.alias or name)
            sub, is_list = _generator_model_of(f.annotation)
            if sub is not None:
                yield from walk(sub, key + ("[]." if is_list else "."))
            else:
                yield key, f.description

    _generator_model_of = _generator()._model_of
    fields = list(walk(RecipeConfig, ""))
    assert len(fields) > 100
    for key, description in fields:
        assert description, f"{key} has no Field(description=…)"
        row = next((line for line in text.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, f"docs/config.md has no row for {key}"
        assert " ".join(description.split()).replace("|", "\\|") in row, key


def test_stale_page_is_caught(tmp_path, monkeypatch):
    """The check can fail: a field whose description changed makes the regenerated page differ."""
    from mopd_core import config as C

    gen = _generator()
    before = gen.render()
    field = C.MOPDConfig.model_fields["kd_clip"]
    monkeypatch.setattr(field, "description", field.description + " (changed)")
    assert gen.render() != before
