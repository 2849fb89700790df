"""The recipe as Prefect flows in ephemeral mode (no server) against a local SQLite MLflow store: one parent run
and a child per stage with params, step metrics and plots; registered models whose tags walk the lineage from
the student back to SFT; Prefect artifacts; a second run served from the cache; bad parameters fail before any
stage, naming the parameter. The recipe runs two MOPD rounds (`rounds=2`): round 2's experts and
student are tracked, registered with lineage to round 1's student and reused by the second run like round 1."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import drive, isolated_env, mlflow_client, runs_of, short_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROUND2 = ["r2-expert-math", "r2-expert-code", "r2-expert-if", "r2-student"]
STAGES = {"sft", "expert-math", "expert-code", "expert-if", "serve-teachers", "student", "evaluate",
          *ROUND2, "r2-serve-teachers"}
TRAINED = ["sft", "expert-math", "expert-code", "expert-if", "student", *ROUND2]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flows")
    env = isolated_env(tmp)
    kw = {"config": "tiny", "overrides": short_overrides(tmp / "runs") + ["rounds=2"]}
    res = drive(tmp, [{"op": "run", "flow": "full-recipe", "kwargs": kw},
                      {"op": "run", "flow": "full-recipe", "kwargs": kw}], env, timeout=800)
    return tmp, env, res


def test_first_run_tracks_every_stage(two_runs):
    tmp, env, (first, _) = two_runs
    assert first["ok"], first
    c = mlflow_client(env["MLFLOW_TRACKING_URI"])
    parent_id = first["result"]["parent_run_id"]
    runs = [r for r in runs_of(c, "t") if r.info.run_id == parent_id
            or r.data.tags.get("mlflow.parentRunId") == parent_id]
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = {r.data.tags["mlflow.runName"]: r for r in runs if r.data.tags.get("mlflow.parentRunId")}
    assert set(children) == STAGES
    assert all(r.info.status == "FINISHED" for r in children.values())
    p = parents[0]
    assert {"accuracy/student/math/greedy", "accuracy/r2-student/math/greedy",
            "accuracy/r2-expert-if/if/greedy"} <= set(p.data.metrics)
    assert {"git_sha", "code_version", "seed", "mopd.steps"} <= set(p.data.params)
    for stage in TRAINED:
        r = children[stage]
        assert r.data.params["seed"] == "0" and r.data.params["git_sha"] and r.data.params["code_version"]
        hist_key = "loss"
        assert len(c.get_metric_history(r.info.run_id, hist_key)) >= 2, stage
        arts = {a.path for a in c.list_artifacts(r.info.run_id, "plots")}
        assert "plots/loss.png" in arts, (stage, arts)
        assert any(k.startswith("final_eval/") for k in r.data.metrics)
        assert r.inputs.dataset_inputs, stage  # training data logged as inputs
    exp = children["expert-math"]
    assert exp.data.params["input.init"] == "models:/t-sft/1"
    assert {"reward/math", "entropy", "perf/tokens_per_s"} <= set(exp.data.metrics)
    st = children["student"]
    assert {"teacher_token_frac/math", "reverse_kl/code", "reward/if"} <= set(st.data.metrics)
    assert {a.path for a in c.list_artifacts(st.info.run_id, "plots")} >= {
        "plots/reward.png", "plots/teacher_token_frac.png", "plots/reverse_kl.png"}
    assert "accuracy.png" in {a.path for a in c.list_artifacts(children["evaluate"].info.run_id)}


def test_registered_models_carry_lineage(two_runs):
    tmp, env, (first, _) = two_runs
    import os

    os.environ["MLFLOW_TRACKING_URI"] = env["MLFLOW_TRACKING_URI"]
    from tasks import tracking

    for name in ("t-sft", "t-expert-math", "t-expert-code", "t-expert-if", "t-student", *[f"t-{r}" for r in ROUND2]):
        assert str(tracking.model_version(f"models:/{name}/1").version) == "1"
    tree = tracking.lineage("models:/t-student/1")
    assert tree["inputs"]["init"]["ref"] == "models:/t-sft/1"
    assert set(tree["inputs"]) == {"init", "teacher.math", "teacher.code", "teacher.if"}
    assert tree["inputs"]["teacher.code"]["inputs"]["init"]["ref"] == "models:/t-sft/1"
    # round 2: its experts start from round 1's student, its student continues it; both say so in their tags
    r2 = tracking.lineage("models:/t-r2-student/1")
    assert r2["inputs"]["init"]["ref"] == "models:/t-student/1"
    assert r2["inputs"]["teacher.math"]["ref"] == "models:/t-r2-expert-math/1"
    assert r2["inputs"]["teacher.math"]["inputs"]["init"]["ref"] == "models:/t-student/1"
    assert r2["inputs"]["teacher.if"]["inputs"]["init"]["inputs"]["init"]["ref"] == "models:/t-sft/1"
    for name in ("t-r2-student", "t-r2-expert-code"):
        tags = tracking.model_version(f"models:/{name}/1").tags
        assert tags["mopd.round"] == "2" and tags["mopd.parent"] == "models:/t-student/1", tags
    assert "mopd.round" not in tracking.model_version("models:/t-student/1").tags  # round 1 tagged as before
    # a registered version resolves to a loadable local checkpoint
    path, canon = tracking.resolve_model_ref("models:/t-student/1", tmp / "dl")
    assert canon == "models:/t-student/1" and (path / "config.json").exists()


def test_prefect_artifacts_and_cached_rerun(two_runs):
    tmp, env, (first, second) = two_runs
    keys = {a["key"] for a in first["flow_run"]["artifacts"]}
    assert {"t-sft", "t-sft-mlflow", "t-student", "t-report", "t-accuracy"} <= keys
    assert second["ok"], second
    states = {t["name"]: t["state_name"] for t in second["flow_run"]["task_runs"]}
    for stage in ("sft", "expert-math", "expert-code", "expert-if", "mopd", "evaluate", *ROUND2[:3], "r2-mopd"):
        assert states[stage] == "Cached", states
    # no stage retrained: no new child runs, no new model versions
    c = mlflow_client(env["MLFLOW_TRACKING_URI"])
    pid2 = second["result"]["parent_run_id"]
    kids2 = [r for r in runs_of(c, "t") if r.data.tags.get("mlflow.parentRunId") == pid2]
    assert {r.data.tags["mlflow.runName"] for r in kids2} <= {"serve-teachers", "r2-serve-teachers"}
    assert len(c.search_model_versions("name='t-student'")) == 1
    assert len(c.search_model_versions("name='t-r2-student'")) == 1
    assert second["result"]["stages"]["student"]["ref"] == "models:/t-student/1"
    assert second["result"]["stages"]["r2-student"]["ref"] == "models:/t-r2-student/1"
    assert second["wall_s"] < first["wall_s"]


def test_bad_parameters_fail_before_any_stage(tmp_path):
    env = isolated_env(tmp_path)
    ov = short_overrides(tmp_path / "runs")
    ops = [
        {"op": "run", "flow": "full-recipe", "kwargs": {"config": "no-such-preset"}},
        {"op": "run", "flow": "mopd", "kwargs": {"config": "tiny", "overrides": ov, "init": "models:/t-sft/7",
                                                 "teacher_refs": {}}},
        {"op": "run", "flow": "mopd", "kwargs": {"config": "tiny", "overrides": ov, "init": str(tmp_path),
                                                 "teacher_refs": {}}},
        {"op": "run", "flow": "full-recipe", "kwargs": {"config": "tiny", "overrides": ov,
                                                        "expert": {"domains": ["math", "code"]}}},
        {"op": "run", "flow": "full-recipe", "kwargs": {"config": "tiny", "overrides": ov,
                                                        "mopd": {"steps": -1}}},
        {"op": "run", "flow": "expert-rl", "kwargs": {"config": "tiny", "overrides": ov, "domain": "math",
                                                      "init": "models:/t-student/1", "round": 0}},
        {"op": "run", "flow": "full-recipe", "kwargs": {"config": "tiny", "overrides": ov + ["rounds=0"]}},
    ]
    acc = {"student": {"math": {"greedy": 0.50}, "code": {"greedy": 0.61}, "if": {"greedy": 0.70}},
           "champion": {"math": {"greedy": 0.75}, "code": {"greedy": 0.60}, "if": {"greedy": 0.70}}}
    ops.append({"op": "champion_check", "overrides": ov, "accuracy": acc, "tolerance": 0.05})
    res = drive(tmp_path, ops, env, timeout=400)
    champ = res.pop()
    # the nightly comparison: a drop beyond the tolerance fails the run, naming domain and delta
    assert not champ["ok"] and champ["flow_run"]["state_type"] == "FAILED"
    assert "RegressionError" in champ["error"] and "domain 'math'" in champ["error"]
    assert "-25.0 points" in champ["error"] and "'code'" not in champ["error"]
    assert any(a["key"] == "t-champion-deltas" for a in champ["flow_run"]["artifacts"])
    want = ["parameter 'config'", "parameter 'init'", "parameter 'init'", "parameter 'expert.domains'",
            "parameter 'mopd'", "parameter 'round'", "parameter 'overrides'"]
    for r, w in zip(res, want):
        assert not r["ok"]
        fr = r["flow_run"]
        assert fr["state_type"] == "FAILED"
        assert w in (r.get("error") or "") and w in (fr["message"] or "") or w in (r.get("error") or ""), (w, r)
        started = {t["name"] for t in fr["task_runs"]}
        assert not started & {"sft", "mopd", "expert-math", "open_recipe_run"}, started
    assert "have no expert" in res[3]["error"]
    assert "rounds=0" in res[6]["error"] and "at least one round" in res[6]["error"]
