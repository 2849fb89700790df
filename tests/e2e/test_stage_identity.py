"""One stage identity for the CLI and Prefect: the Prefect cache key is derived from the engine's
fingerprint, the orchestration never deletes a stage folder, and a cached stage whose MLflow run is gone from the
tracking store is logged again from its folder.

Through the full-recipe flow (ephemeral Prefect, SQLite MLflow), in order:
1. the short recipe;
2. `mopd.steps` + 2: SFT and experts Cached, the student continues from its step-3 checkpoint (5 steps in all,
   not a retrain), nothing under the earlier stages changed;
3. other overrides (`sft.lr`): every stage retrains, the old folders are set aside as `<stage>@<fingerprint>`;
4. the config of 2 again: the set-aside folders are brought back and reused with their MLflow runs — no training;
5. the same run folder against a fresh MLflow store (and the old Prefect result cache): completes, and the new
   store holds every stage's run and registered model with lineage.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.e2e.helpers import drive, isolated_env, mlflow_client, runs_of, short_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

TRAINED = ["sft", "expert-math", "expert-code", "expert-if", "student"]
TASKS = {"sft": "sft", "expert-math": "expert-math", "expert-code": "expert-code", "expert-if": "expert-if",
         "student": "mopd"}


def tree_hash(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(d)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def finals(run_dir: Path | str) -> dict[str, str]:
    return {s: tree_hash(Path(run_dir) / s / "final") for s in TRAINED}


def listing(d: Path | str) -> list[str]:
    return sorted(p.name for p in Path(d).iterdir())


def states(res: dict) -> dict[str, str]:
    return {t["name"]: t["state_name"] for t in res["flow_run"]["task_runs"]}


def _run(overrides: list[str]) -> dict:
    return {"op": "run", "flow": "full-recipe", "kwargs": {"config": "tiny", "overrides": overrides}}


def _ok(res: dict, tmp: Path, tag: str) -> dict:
    assert res.get("ok"), (res.get("error"), res.get("traceback"), (tmp / f"{tag}.log").read_text()[-4000:])
    return res


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    """Runs 1-4 in one driver process (one Prefect start-up, not four), checks between them as driver calls;
    run 5 in a process of its own, as a user pointing the same folder at a new tracking store would."""
    tmp = tmp_path_factory.mktemp("identity")
    env = isolated_env(tmp)
    runs = tmp / "runs"
    rd = runs / "t"
    base, more = short_overrides(runs), short_overrides(runs, mopd_steps=5)
    me = "tests.e2e.test_stage_identity"
    fin = {"op": "call", "fn": f"{me}:finals", "args": [str(rd)]}
    res = drive(tmp, [_run(base), fin, _run(more), fin, _run(more + ["sft.lr=0.001"]),
                      {"op": "call", "fn": f"{me}:listing", "args": [str(rd)]}, _run(more), fin], env, timeout=1100,
                tag="r1-4")
    out = {"tmp": tmp, "env": env, "rd": rd}
    for k, v in zip(("r1", "f1", "r2", "f2", "r3", "ls3", "r4", "f4"), res):
        out[k] = _ok(v, tmp, "r1-4") if k.startswith("r") else v
    env5 = {**env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'fresh-mlflow.db'}"}
    out["env5"] = env5
    (r5,) = drive(tmp, [_run(more)], env5, timeout=900, tag="r5")
    out["r5"] = _ok(r5, tmp, "r5")
    return out


def test_raising_steps_continues_the_student_and_reuses_the_rest(story):
    st = states(story["r2"])
    for s in ("sft", "expert-math", "expert-code", "expert-if"):
        assert st[TASKS[s]] == "Cached", st
        assert story["f2"][s] == story["f1"][s]
    assert st["mopd"] == "Completed"
    student = story["r2"]["result"]["stages"]["student"]
    assert student["resumed_from_step"] == 3 and not student["retracked"]
    info = json.loads((story["rd"] / "student" / "stage.json").read_text())
    assert info["steps"] == 5 and info["status"] == "done" and info["results_version"] >= 1
    rows = [json.loads(x) for x in (story["rd"] / "student" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert story["f2"]["student"] != story["f1"]["student"]
    # the identity travels inside the model dir (and so through the registry)
    ident = json.loads((story["rd"] / "student" / "final" / "mopd_identity.json").read_text())
    assert ident["fingerprint"] == info["fingerprint"] and ident["steps"] == 5


def test_other_overrides_set_stages_aside_and_the_original_config_brings_them_back(story):
    st3 = states(story["r3"])
    assert all(st3[TASKS[s]] == "Completed" for s in TRAINED), st3
    ls = story["ls3"]
    for s in TRAINED:
        assert s in ls and any(n.startswith(f"{s}@") for n in ls), (s, ls)
    # back to the config of run 2: the same models, reused with their MLflow runs (no training, no new run)
    assert story["f4"] == story["f2"]
    r2, r4 = story["r2"]["result"]["stages"], story["r4"]["result"]["stages"]
    for s in TRAINED:
        assert r4[s]["run_id"] == r2[s]["run_id"] and r4[s]["ref"] == r2[s]["ref"], s
    ls4 = sorted(p.name for p in story["rd"].iterdir())
    for s in TRAINED:  # the other config's folders are kept aside in turn
        assert any(n.startswith(f"{s}@") for n in ls4), (s, ls4)


def test_fresh_tracking_store_gets_every_stage_logged_again(story):
    r5 = story["r5"]["result"]
    assert story["f4"] == finals(story["rd"])  # nothing retrained
    c = mlflow_client(story["env5"]["MLFLOW_TRACKING_URI"])
    runs = {r.data.tags.get("mlflow.runName"): r for r in runs_of(c, "t")
            if r.data.tags.get("mlflow.parentRunId") == r5["parent_run_id"]}
    for s in TRAINED:
        assert s in runs, sorted(runs)
        r = runs[s]
        assert r.info.status == "FINISHED" and r.data.tags["mopd.retracked"] == "true"
        assert len(c.get_metric_history(r.info.run_id, "loss")) >= 2, s  # metrics from the folder's metrics.jsonl
        assert r5["stages"][s]["run_id"] == r.info.run_id
        assert len(c.search_model_versions(f"name='t-{s}'")) == 1, s
    assert "evaluate" in runs
    import os

    os.environ["MLFLOW_TRACKING_URI"] = story["env5"]["MLFLOW_TRACKING_URI"]
    from tasks import tracking

    tree = tracking.lineage("models:/t-student/1")
    assert tree["inputs"]["init"]["ref"] == "models:/t-sft/1"
    assert tree["inputs"]["teacher.code"]["inputs"]["init"]["ref"] == "models:/t-sft/1"
