"""The teacher-score cache through a real MOPD stage (2-layer model, 4 steps, checkpoints every 2): a stage with
the cache trains the uncached stage's numbers; interrupted after step 3 and resumed, the replayed step 3 asks the
teachers nothing and step 4 is scored; run again from its cache alone, no step asks the teachers anything — with
the same losses, gradients and per-teacher reverse KL every time."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mopd_core import recipe as R
from mopd_core.models import build_tiny
from tests.conftest import StageStopped, interrupted_mopd_stage, perturbed_teachers

COMPARED = ("loss", "grad_norm", "adv/kd_mean", "reward/mean")



def _rows(stage_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (stage_dir / "metrics.jsonl").read_text().splitlines())}


def _same(row: dict, ref: dict) -> None:
    keys = [k for k in ref if k in COMPARED or k.startswith("reverse_kl/")]
    assert len(keys) > 4
    for k in keys:
        assert row[k] == pytest.approx(ref[k], rel=1e-6, abs=1e-7), (row["step"], k)


def _hits(row: dict) -> tuple[float, float, float]:
    pick = lambda suffix: sum(v for k, v in row.items() if k.startswith("teacher/") and k.endswith(suffix))  # noqa: E731
    return pick("/cache_hits"), pick("/cache_misses"), pick("/score_s")


def test_cached_stage_equals_uncached_fresh_resumed_and_replayed(tiny_cfg, tmp_path):
    cfg = tiny_cfg.model_copy(deep=True)
    cfg.mopd.steps, cfg.mopd.save_every = 4, 2
    student = build_tiny(cfg.model, tmp_path / "student", seed=3)
    teachers = perturbed_teachers(cfg, student, tmp_path)
    rows_per_step = cfg.mopd.prompts_per_step * cfg.mopd.group_size

    def run(name: str, cache: bool, stop_after: int | None = None):
        c = cfg.model_copy(update={"output_dir": str(tmp_path / name)}, deep=True)
        c.teachers.score_cache = cache
        if stop_after is None:
            return R.mopd_stage(c, student, teachers, progress=False)
        with pytest.raises(StageStopped):
            interrupted_mopd_stage(c, student, teachers, stop_after)

    ref = _rows(run("uncached", False).stage_dir)
    assert ref[4]["grad_norm"] > 0 and "teacher/math/cache_hits" not in ref[1]

    fresh = run("fresh", True)
    for s, row in _rows(fresh.stage_dir).items():
        _same(row, ref[s])
        assert _hits(row)[:2] == (0, rows_per_step)
    assert list((fresh.stage_dir / "teacher_cache").glob("*.seg"))

    run("resumed", True, stop_after=3)  # steps 1..3 scored; the last checkpoint is step 2
    resumed = _rows(run("resumed", True).stage_dir)
    assert sorted(resumed) == [1, 2, 3, 4]
    hits, misses, score_s = _hits(resumed[3])
    assert (hits, misses, score_s) == (rows_per_step, 0, 0)  # the replayed step asked no teacher
    assert resumed[3]["perf/teacher_cache_saved_s"] > 0
    assert _hits(resumed[4])[:2] == (0, rows_per_step)
    for s in (3, 4):
        _same(resumed[s], ref[s])

    stage = tmp_path / "replayed" / cfg.name / fresh.stage_dir.name
    stage.mkdir(parents=True)
    shutil.copytree(fresh.stage_dir / "teacher_cache", stage / "teacher_cache")
    replayed = _rows(run("replayed", True).stage_dir)
    for s, row in replayed.items():
        assert _hits(row) == (rows_per_step, 0, 0)
        _same(row, ref[s])
