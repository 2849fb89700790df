"""The whole recipe, shortened: the CLI prints the table, the same seed gives the same table and weights,
a re-run reuses every finished stage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from mopd_core import recipe as R
from mopd_core.config import load_config
from mopd_core.models import load_model
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]


def test_recipe_cli_then_same_seed_in_process_gives_same_table(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    args = [a for o in tiny_overrides(a) for a in ("--set", o)]
    proc = subprocess.run([sys.executable, "-m", "mopd_core.cli", "recipe", "--config", "tiny", "--no-progress",
                           *args], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| model | math | code | if |" in proc.stdout
    for row in ("| base |", "| sft |", "| expert-math |", "| expert-code |", "| expert-if |", "| student |"):
        assert row in proc.stdout, row
    run_a = a / "t"
    acc_a = json.loads((run_a / "accuracy.json").read_text())["accuracy"]
    assert (run_a / "accuracy.png").stat().st_size > 1000
    assert all(0.0 <= v["greedy"] <= 1.0 for r in acc_a.values() for v in r.values())

    cfg_b = load_config("tiny", tiny_overrides(b))
    res_b = R.run_recipe(cfg_b, progress=False)
    assert res_b.accuracy == acc_a
    wa = load_model(run_a / "student" / "final").state_dict()
    wb = load_model(b / "t" / "student" / "final").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # a second run over the same folder reuses every stage: nothing is rewritten
    stamps = {p: p.stat().st_mtime_ns for p in run_a.glob("*/final/model.safetensors")}
    assert len(stamps) == 5
    cfg_a = load_config("tiny", tiny_overrides(a))
    again = R.run_recipe(cfg_a, progress=False)
    assert again.accuracy == acc_a
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps

    # a copied run folder is reusable where it lands: fingerprints name no paths
    import shutil

    c = tmp_path / "c"
    shutil.copytree(a, c)
    moved = {p: p.stat().st_mtime_ns for p in (c / "t").glob("*/final/model.safetensors")}
    shutil.rmtree(a)  # the copy must not lean on the original
    res_c = R.run_recipe(load_config("tiny", tiny_overrides(c)), progress=False)
    assert {p: p.stat().st_mtime_ns for p in moved} == moved
    assert res_c.accuracy == acc_a and res_c.outputs["student"].model_dir == c / "t" / "student" / "final"
