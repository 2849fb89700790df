"""`data.filter_overlong_prompts`: dataset rows whose prompt (as the rollout renders it, chat template included)
is over data.max_prompt_tokens are dropped, counted and logged; without it the pre-flight fails on the first,
naming the row and both fixes; a file with nothing short enough is an error before any compute."""

from __future__ import annotations

import json
import logging

import pytest

from mopd_core import preflight
from mopd_core import recipe as R
from mopd_core.config import load_config
from mopd_core.errors import MopdError
from tests.conftest import tiny_overrides


def _cfg(tmp_path, rows, *extra):
    f = tmp_path / "math.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ov = [o for o in tiny_overrides(tmp_path / "runs") if not o.startswith("data.domains")]
    return load_config("tiny", ov + ["data.max_prompt_tokens=12", "rollout.max_new_tokens=6",
                                     f"data.domains=[{{name: math, source: '{f}', eval_size: 1}}]", "sft.mix=null",
                                     "mopd.mix=null", *extra])


def _rows(n_short: int, n_long: int):
    short = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(n_short)]
    long = [{"prompt": f"{i}+{'9' * 20}=", "answer": "0"} for i in range(n_long)]
    return short + long


def test_overlong_rows_fail_the_preflight_naming_the_row_and_the_fixes(tmp_path):
    cfg = _cfg(tmp_path, _rows(5, 1))
    with pytest.raises(MopdError) as e:
        preflight.check_recipe(cfg, R.stage_plan(cfg), R.build_domains(cfg))
    msg = str(e.value)
    assert "\n" not in msg and "row 5" in msg and "data.max_prompt_tokens=12" in msg
    assert "data.filter_overlong_prompts=true" in msg


def test_the_filter_drops_counts_and_logs_them_and_the_preflight_passes(tmp_path, caplog):
    cfg = _cfg(tmp_path, _rows(5, 2), "data.filter_overlong_prompts=true")
    with caplog.at_level(logging.WARNING, logger="mopd"):
        dom = R.build_domains(cfg)["math"]
    kept = dom.eval_examples() + list(dom._train)
    assert len(kept) == 5 and all(len(e.prompt) <= 12 for e in kept)
    warn = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(warn) == 1 and "dropped 2 of 7 prompts over 12 tokens" in warn[0] and "domain 'math'" in warn[0]
    preflight.check_recipe(cfg, R.stage_plan(cfg), R.build_domains(cfg))  # nothing over the limit is left to refuse


def test_a_file_with_nothing_short_enough_is_an_error(tmp_path):
    cfg = _cfg(tmp_path, _rows(0, 3), "data.filter_overlong_prompts=true")
    with pytest.raises(MopdError) as e:
        R.build_domains(cfg)
    assert "every prompt of domain 'math'" in str(e.value) and "(3)" in str(e.value)


def test_the_default_leaves_fingerprints_alone():
    cfg = load_config("tiny")
    assert "filter_overlong_prompts" not in cfg.model_dump(mode="json")["data"]
    on = load_config("tiny", ["data.filter_overlong_prompts=true"])
    assert on.model_dump(mode="json")["data"]["filter_overlong_prompts"] is True
