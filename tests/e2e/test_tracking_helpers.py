"""tasks.tracking on a throw-away SQLite store (no Prefect): references, champion deltas, plots, metric
streaming, and closing runs whose process died."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tasks import tracking


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tmp_path


def test_parse_refs_and_champion_deltas():
    assert tracking.parse_model_uri("models:/t-sft/3") == ("t-sft", "3", None)
    assert tracking.parse_model_uri("models:/t-student@champion") == ("t-student", None, "champion")
    with pytest.raises(tracking.ModelRefError):
        tracking.parse_model_uri("models:/justaname")
    deltas, bad = tracking.champion_deltas({"math": 0.5, "code": 0.62}, {"math": 0.6, "code": 0.6}, 0.05)
    assert deltas == pytest.approx({"math": -0.1, "code": 0.02})
    assert len(bad) == 1 and "domain 'math'" in bad[0] and "-10.0 points" in bad[0]
    assert tracking.champion_deltas({"math": 0.56}, {"math": 0.6}, 0.05)[1] == []


def test_plots_from_step_metrics(tmp_path):
    rows = [{"step": s, "loss": 1.0 / s, "reward/math": 0.1 * s, "reward/code": 0.2,
             "teacher_token_frac/math": 0.5, "reverse_kl/math": 0.3} for s in range(1, 5)]
    files = {p.name for p in tracking.plot_metrics(rows, tmp_path)}
    assert files == {"loss.png", "reward.png", "teacher_token_frac.png", "reverse_kl.png"}
    for r in rows:  # a MOPD stage also has per-teacher scoring time and per-phase memory
        r.update({"teacher/math/score_s": 0.2, "teacher/math/tokens": 40, "mem/train/resident_mb": 20.8,
                  "mem/score/resident_mb": 10.4, "mem/train/host_rss_mb": 900.0})
    files = {p.name for p in tracking.plot_metrics(rows, tmp_path)}
    assert {"teacher_score_s.png", "phase_memory.png"} <= files


def test_refs_metrics_tail_and_stale_runs(store):
    with pytest.raises(tracking.ModelRefError, match="neither"):
        tracking.canonical_ref(str(store / "missing"))
    run = tracking.start_run("x", "stage")
    path = store / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2)))
    tail = tracking.MetricsTail(run, path, every_s=0.1)
    with path.open("a") as f:
        f.write(json.dumps({"step": 3, "loss": 0.3, "mean@4": 0.5}) + "\n{half a line")
    rows = tail.close()
    assert [r["step"] for r in rows] == [1, 2, 3]
    c = tracking.client()
    assert [m.step for m in c.get_metric_history(run, "loss")] == [1, 2, 3]
    assert "mean_4" in c.get_run(run).data.metrics
    # a run whose process is gone is closed as KILLED; this process's own runs are left alone
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    ghost = tracking.start_run("x", "ghost", tags={"mopd.pid": dead})
    closed = tracking.reap_stale_runs("x")
    assert closed == [ghost]
    assert c.get_run(ghost).info.status == "KILLED" and c.get_run(run).info.status == "RUNNING"
    tracking.end_run(run)
