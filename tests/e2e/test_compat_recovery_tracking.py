"""What a MOPD stage's MLflow run gets from the compatibility pre-flight and the recovery metric, on a throw-away
SQLite store (no Prefect server): the pre-flight's table as `compat.md` / `compat.json` (a passing run and one
the pre-flight stopped), and recovery curves streamed from a real tiny stage's metrics.jsonl, with their plot."""

from __future__ import annotations

import json

import pytest
import torch

from mopd_core import preflight
from mopd_core import recipe as R
from mopd_core.config import ModelConfig, load_config
from mopd_core.models import build_tiny
from mopd_core.teachers import LocalTeacher, TeacherRouter
from mopd_core.teachers.compat import CompatError
from mopd_core.train.loop import run_policy_loop
from mopd_core.train.roles import RecoveryRefs
from tasks import tracking
from tasks.stages import log_compat
from tests.conftest import tiny_overrides


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tmp_path


def _artifact(run_id: str, name: str, tmp_path) -> str:
    c = tracking.client()
    assert name in {a.path for a in c.list_artifacts(run_id)}
    return open(c.download_artifacts(run_id, name, str(tmp_path))).read()


def test_the_compat_table_of_a_passing_and_a_stopped_stage_is_in_its_run(store, tmp_path):
    torch.set_num_threads(1)
    student = build_tiny(ModelConfig(tiny={"hidden_size": 64, "num_layers": 1, "num_heads": 2,
                                           "intermediate_size": 64, "chat": True}), tmp_path / "s")
    cfg = load_config("tiny", ["model.tiny.chat=true", "data.chat.enabled=true", f"output_dir={tmp_path}",
                               "data.max_prompt_tokens=40"])
    domains = R.build_domains(cfg, ["math"])
    report = preflight.check_compatibility(cfg, TeacherRouter({"math": LocalTeacher("math", student, "cpu")}),
                                           student, domains)
    run = tracking.start_run("t", "student")
    log_compat(run, report)
    md = _artifact(run, "compat.md", tmp_path / "a")
    assert "| math | chat_template | pass |" in md and "## teacher 'math': probe conversation" in md
    assert json.loads(_artifact(run, "compat.json", tmp_path / "b"))["rows"][0]["check"] == "tokenizer"
    assert tracking.client().get_run(run).data.metrics["compat/failures"] == 0

    hot = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"temperature": 0.7})})
    with pytest.raises(CompatError) as e:
        preflight.check_compatibility(hot, TeacherRouter({"math": LocalTeacher("math", student, "cpu")}), student,
                                      domains)
    stopped = tracking.start_run("t", "student-stopped")
    log_compat(stopped, e.value.report)  # what mopd_task's on_end does when the stage failed its pre-flight
    assert "| math | temperature | fail | teacher τ=1, rollout.temperature=0.7" in \
        _artifact(stopped, "compat.md", tmp_path / "c")
    assert tracking.client().get_run(stopped).data.metrics["compat/failures"] == 1


def test_recovery_curves_of_a_real_tiny_stage_stream_into_its_run(store, tmp_path):
    cfg = load_config("tiny", tiny_overrides(tmp_path) + [
        "mopd.w_kd=0", "mopd.w_rl=1", "mopd.steps=3", "mopd.eval_every=1", "mopd.eval_size=4",
        "mopd.prompts_per_step=4"])
    R.setup_runtime(cfg)
    init = build_tiny(cfg.model, tmp_path / "init")
    domains = R.build_domains(cfg, ["math", "code"])
    refs = RecoveryRefs(sft={"math": {"greedy": 0.0}, "code": {"greedy": 0.0}},
                        expert={"math": {"greedy": 0.5}, "code": {"greedy": 0.25}})
    run = tracking.start_run("t", "student")
    tail = tracking.MetricsTail(run, tmp_path / "student" / "metrics.jsonl", every_s=0.2)
    res = run_policy_loop(stage="student", loop_cfg=cfg.mopd, recipe=cfg, init_path=init, domains=domains,
                          eval_domains=domains, stage_dir=tmp_path / "student", fingerprint="f", progress=False,
                          recovery=refs)
    rows = tail.close()
    c = tracking.client()
    for d, expert in (("math", 0.5), ("code", 0.25)):
        hist = c.get_metric_history(run, f"recovery/{d}")
        assert [m.step for m in hist] == [1, 2]  # the mid-training evals (step 3's is the stage's final eval)
        for m in hist:  # (student − 0) / (expert − 0), from the same row's eval
            acc = next(r for r in rows if r["step"] == m.step)[f"eval/{d}/greedy"]
            assert m.value == pytest.approx(acc / expert)
        assert res.recovery[d] == pytest.approx(res.eval[d]["greedy"] / expert)
    assert "recovery.png" in {p.name for p in tracking.plot_metrics(rows, tmp_path / "plots")}
