"""Multi-round MOPD through `mopd recipe --set rounds=2` on the shortened tiny recipe: both rounds train into
their folders (round 2 from round 1's student), the table has a row per model of each round, a re-run trains
nothing, and switching round 2's student to start from SFT retrains that one stage only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mopd_core import recipe as R
from mopd_core.config import load_config
from mopd_core.train.checkpoint import read_stage
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
ROUND1 = ["sft", "expert-math", "expert-code", "expert-if", "student"]
ROUND2 = ["r2-expert-math", "r2-expert-code", "r2-expert-if", "r2-student"]


def _stamps(run: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in run.glob("**/final/model.safetensors")}


def test_two_rounds_train_register_in_the_table_and_rerun_reuses_both(tmp_path):
    ov = tiny_overrides(tmp_path) + ["rounds=2"]
    proc = subprocess.run([sys.executable, "-m", "mopd_core.cli", "recipe", "--config", "tiny", "--no-progress",
                           *[a for o in ov for a in ("--set", o)]], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows == ["model", "base", *ROUND1, *ROUND2]
    run = tmp_path / "t"
    acc = json.loads((run / "accuracy.json").read_text())["accuracy"]
    assert list(acc) == ["base", *ROUND1, *ROUND2]
    # round 1 where it always was, round 2 under r2/, each expert of round 2 trained from round 1's student
    cfg = load_config("tiny", ov)
    student1 = run / "student" / "final"
    for d in ("math", "code", "if"):
        info = read_stage(run / "r2" / f"expert-{d}")
        assert info["status"] == "done" and info["steps"] == 3 and Path(info["init"]) == student1
        assert info["fingerprint"] == R.expert_fingerprint(cfg, d, student1, rnd=2)
        assert info["fingerprint"] != read_stage(run / f"expert-{d}")["fingerprint"]
    s2 = read_stage(run / "r2" / "student")
    assert Path(s2["init"]) == student1 and s2["stage"] == "r2-student"
    assert R.model_ref_id(run / "r2" / "student" / "final") == f"stage:{s2['fingerprint']}:3"
    stamps = _stamps(run)
    assert len(stamps) == 9  # sft, 3 + 3 experts, 2 students

    again = R.run_recipe(cfg, progress=False)
    assert _stamps(run) == stamps  # nothing retrained in either round
    assert again.accuracy == acc

    # round 2's student from SFT instead: round 1 and round 2's experts stay, that student alone retrains
    fresh = R.run_recipe(load_config("tiny", ov + ["round_student_init=sft"]), progress=False)
    now = _stamps(run)
    changed = {p.relative_to(run).parts[:-2] for p in stamps if now.get(p) != stamps[p]}
    assert changed == {("r2", "student")}, changed
    assert (run / "r2" / f"student@{s2['fingerprint']}" / "final").is_dir()  # the other student set aside, kept
    assert Path(read_stage(run / "r2" / "student")["init"]) == run / "sft" / "final"
    assert list(fresh.accuracy) == list(acc)
