"""Against real services on 127.0.0.1 (infra/services.sh: `prefect server`, a process worker, `mlflow server`):
`prefect deploy --all` from infra/prefect.yaml, the full-recipe deployment run twice (second run served from the
cache), the single-stage mopd deployment with a non-default mopd.steps on references from the first run, the
nightly reproduction's champion alias, and a custom run of a stage deployment from the Prefect UI. (A flow-run
process SIGKILLed mid-stage and resumed by the next deployment run, for every stage: tests/reliability/
test_faults_prefect.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import (ROOT, drive, free_port, isolated_env, mlflow_client, pause_schedules, runs_of,
                               short_overrides)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

STAGES = {"sft", "expert-math", "expert-code", "expert-if", "serve-teachers", "student", "evaluate"}


class Services:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.pport, self.mport = free_port(), free_port()
        self.env = isolated_env(tmp, MOPD_SERVICES_DIR=str(tmp / "services"), PREFECT_PORT=str(self.pport),
                                MLFLOW_PORT=str(self.mport), MOPD_START_TIMEOUT="240",
                                # the worker asks for new runs every second (default 10 s: ~5 s lost a run)
                                PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="5")
        self.env.pop("MLFLOW_TRACKING_URI")
        self.api = f"http://127.0.0.1:{self.pport}/api"
        self.mlflow = f"http://127.0.0.1:{self.mport}"
        self.client_env = {**self.env, "PREFECT_API_URL": self.api, "MLFLOW_TRACKING_URI": self.mlflow}

    def sh(self, *args: str, timeout: float = 300) -> str:
        p = subprocess.run([str(ROOT / "infra/services.sh"), *args], cwd=ROOT, env=self.env, text=True,
                           capture_output=True, timeout=timeout)
        assert p.returncode == 0, f"services.sh {args}: {p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p.stdout

    def run_deployment(self, name: str, params: dict, timeout: int = 600) -> subprocess.CompletedProcess:
        return subprocess.run([str(ROOT / ".venv/bin/prefect"), "deployment", "run", name, "--params",
                               json.dumps(params), "--watch", "--watch-timeout", str(timeout)], cwd=ROOT,
                              env=self.client_env, text=True, capture_output=True, timeout=timeout + 60)

    @staticmethod
    def run_id(p: subprocess.CompletedProcess) -> str:
        """The id of the flow run a `prefect deployment run` started (its `UUID:` line)."""
        ids = [ln.split("UUID:", 1)[1].strip() for ln in p.stdout.splitlines() if "UUID:" in ln]
        assert ids, f"no flow run id in: {p.stdout[-2000:]}"
        return ids[0]

    def flow_runs(self, *ps: subprocess.CompletedProcess) -> list[dict]:
        """The flow runs these `prefect deployment run`s started, described (one driver process for all)."""
        return drive(self.tmp, [{"op": "flow_run", "id": self.run_id(p)} for p in ps], self.client_env, timeout=120,
                     tag="query")

    def flow_run(self, p: subprocess.CompletedProcess) -> dict:
        return self.flow_runs(p)[0]

    def runs(self, deployment: str) -> list[dict]:
        return drive(self.tmp, [{"op": "deployment_runs", "deployment": deployment}], self.client_env,
                     timeout=120, tag="query")[0]


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("svc")
    s = Services(tmp)
    try:
        s.sh("start", timeout=400)
        s.sh("deploy", timeout=300)
        # the nightly's schedule as deployed, then paused for the tests (pause_schedules says why)
        schedules = drive(tmp, [{"op": "schedules", "deployment": "full-recipe/nightly"}], s.client_env,
                          timeout=120, tag="sched")[0]
        assert schedules == [{"cron": "0 3 * * *", "timezone": "UTC", "active": True}], schedules
        pause_schedules(s.client_env)
        yield s
    finally:
        subprocess.run([str(ROOT / "infra/services.sh"), "stop"], cwd=ROOT, env=s.env, timeout=120)
        for f in ("worker.log", "prefect-server.log", "mlflow-server.log"):
            p = tmp / "services" / f
            if p.exists():
                print(f"--- {f} (tail)\n{p.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def recipe_runs(services):
    params = {"overrides": short_overrides(services.tmp / "runs")}
    t0 = time.monotonic()
    p1 = services.run_deployment("full-recipe/tiny", params)
    w1 = time.monotonic() - t0
    assert p1.returncode == 0, p1.stdout[-4000:] + p1.stderr[-2000:]
    t0 = time.monotonic()
    p2 = services.run_deployment("full-recipe/tiny", params)
    w2 = time.monotonic() - t0
    assert p2.returncode == 0, p2.stdout[-4000:] + p2.stderr[-2000:]
    runs = services.runs("full-recipe/tiny")  # these two and no other
    assert [r["id"] for r in runs] == [services.run_id(p1), services.run_id(p2)]
    return runs, (w1, w2)


def _family(client, flow_run_id: str):
    runs = runs_of(client, "t")
    parent = [r for r in runs if r.data.tags.get("prefect.flow_run_id") == flow_run_id
              and "mlflow.parentRunId" not in r.data.tags]
    kids = [r for r in runs if parent and r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id]
    return parent, kids


def test_full_recipe_deployment_tracks_every_stage(services, recipe_runs):
    (first, _), _ = recipe_runs
    assert first["state_type"] == "COMPLETED"
    assert {"t-report", "t-accuracy", "t-sft", "t-sft-mlflow", "t-student"} <= {a["key"] for a in
                                                                              first["artifacts"]}
    link = next(a for a in first["artifacts"] if a["key"] == "t-student-mlflow")
    assert services.mlflow in link["data"]  # a link artifact (stored as markdown) to the MLflow run
    c = mlflow_client(services.mlflow)
    parent, kids = _family(c, first["id"])
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    by = {r.data.tags["mlflow.runName"]: r for r in kids}
    assert set(by) == STAGES
    for st in ("sft", "expert-math", "expert-code", "expert-if", "student"):
        r = by[st]
        assert r.info.status == "FINISHED" and "loss" in r.data.metrics, st
        assert any(a.path == "plots/loss.png" for a in c.list_artifacts(r.info.run_id, "plots")), st
        assert r.data.params["git_sha"] and r.data.params["seed"] == "0"
    assert {"reward/math", "teacher_token_frac/if", "reverse_kl/math"} <= set(by["student"].data.metrics)
    mv = c.get_model_version("t-student", "1")
    assert mv.tags["input.init"] == "models:/t-sft/1"
    assert {mv.tags[f"input.teacher.{d}"] for d in ("math", "code", "if")} == {
        f"models:/t-expert-{d}/1" for d in ("math", "code", "if")}
    assert c.get_model_version("t-expert-if", "1").tags["input.init"] == "models:/t-sft/1"


def test_second_run_hits_the_cache(services, recipe_runs):
    (first, second), (w1, w2) = recipe_runs
    assert second["state_type"] == "COMPLETED"
    states = {t["name"]: t["state_name"] for t in second["task_runs"]}
    for st in ("sft", "expert-math", "expert-code", "expert-if", "mopd"):
        assert states[st] == "Cached", states
    c = mlflow_client(services.mlflow)
    _, kids = _family(c, second["id"])
    assert {r.data.tags["mlflow.runName"] for r in kids} <= {"serve-teachers"}  # nothing retrained
    assert second["total_run_time"] < first["total_run_time"]
    print(f"full-recipe deployment: first {w1:.1f} s, cached {w2:.1f} s (CLI wall, incl. worker polling)")


def test_raising_steps_through_a_deployment_continues_the_student(services, recipe_runs):
    """The one stage identity through a deployment: `mopd.steps` 3 → 5 reuses SFT and the experts and continues
    the student from its step-3 checkpoint; no stage folder is deleted."""
    rd = services.tmp / "runs" / "t"
    before = {p.name for p in rd.iterdir()}
    sft_weights = (rd / "sft" / "final" / "model.safetensors").read_bytes()
    p = services.run_deployment("full-recipe/tiny", {"overrides": short_overrides(services.tmp / "runs",
                                                                                  mopd_steps=5)})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    run = services.flow_run(p)
    states = {t["name"]: t["state_name"] for t in run["task_runs"]}
    for st in ("sft", "expert-math", "expert-code", "expert-if"):
        assert states[st] == "Cached", states
    assert states["mopd"] == "Completed"
    assert before <= {p.name for p in rd.iterdir()}
    assert (rd / "sft" / "final" / "model.safetensors").read_bytes() == sft_weights
    c = mlflow_client(services.mlflow)
    _, kids = _family(c, run["id"])
    student = next(r for r in kids if r.data.tags["mlflow.runName"] == "student")
    assert student.data.params["resumed_from_step"] == "3"
    assert [m.step for m in c.get_metric_history(student.info.run_id, "loss")] == [1, 2, 3, 4, 5]


def test_single_stage_mopd_deployment(services, recipe_runs):
    params = {"overrides": short_overrides(services.tmp / "runs"), "init": "models:/t-sft/1",
              "teacher_refs": {d: f"models:/t-expert-{d}@latest".replace("@latest", "/1")
                               for d in ("math", "code", "if")},
              "mopd": {"steps": 4}}
    p = services.run_deployment("mopd/tiny", params)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    run = services.flow_run(p)
    assert run["state_type"] == "COMPLETED" and run["parameters"]["mopd"]["steps"] == 4
    c = mlflow_client(services.mlflow)
    versions = sorted(c.search_model_versions("name='t-student'"), key=lambda v: int(v.version))
    new = versions[-1]
    assert int(new.version) >= 2
    assert new.tags["input.init"] == "models:/t-sft/1"
    assert new.tags["input.teacher.math"] == "models:/t-expert-math/1"
    r = c.get_run(new.run_id)
    assert r.data.params["mopd.steps"] == "4"
    assert len(c.get_metric_history(new.run_id, "loss")) == 4


VLLM_PY = Path(os.environ.get("MOPD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def _pids_gone(run_dir: Path, manifest: str) -> list[Path]:
    """Every `<stage>/<manifest>` under run_dir; asserts each server process it lists has exited."""
    found = sorted(run_dir.rglob(manifest))
    for m in found:
        for name, entry in json.loads(m.read_text()).items():
            assert not Path(f"/proc/{entry['pid']}").exists(), f"{name} ({m}) still runs"
    return found


@pytest.mark.skipif(not VLLM_PY.exists(), reason=f"vLLM environment missing ({VLLM_PY}): run infra/vllm_venv.sh")
def test_async_mopd_deployment_starts_and_stops_its_servers(services, recipe_runs):
    """The mopd stage deployment with runtime.placement=async: the student generates on its own vLLM
    server one weight version behind the trainer; the run completes, its MLflow run holds the async metrics and the
    overlap plot, the Prefect run a timeline table — and the student server is gone afterwards, also when the
    stage fails mid-run (mixture routing with kd_loss=jsd is refused at the first scoring call, after the server
    started)."""
    out = services.tmp / "runs-async"
    async_set = ["runtime.placement=async", "rollout.backend=served", f"teachers.serve_python={VLLM_PY}",
                 "async.max_staleness=1"]
    refs = {"init": "models:/t-sft/1", "teacher_refs": {d: f"models:/t-expert-{d}/1" for d in ("math", "code", "if")}}
    p = services.run_deployment("mopd/tiny", {"overrides": short_overrides(out) + async_set, **refs,
                                              "mopd": {"steps": 3}})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    run = services.flow_run(p)
    assert run["state_type"] == "COMPLETED"
    assert any(a["key"].endswith("-timeline") and a["type"] == "table" for a in run["artifacts"])
    c = mlflow_client(services.mlflow)
    new = max(c.search_model_versions("name='t-student'"), key=lambda v: int(v.version))
    assert [m.value for m in c.get_metric_history(new.run_id, "async/weight_version")] == [0, 0, 1]
    assert "async/trainer_idle_frac" in c.get_run(new.run_id).data.metrics
    assert any(a.path == "plots/overlap.png" for a in c.list_artifacts(new.run_id, "plots"))
    assert _pids_gone(out, "rollout/endpoints.json"), "no student server manifest written"

    failing = short_overrides(services.tmp / "runs-async-fail") + async_set + ["teachers.routing=mixture",
                                                                                "mopd.kd_loss=jsd"]
    p = services.run_deployment("mopd/tiny", {"overrides": failing, **refs, "mopd": {"steps": 3}})
    run = services.flow_run(p)
    assert run["state_type"] == "FAILED", run
    assert _pids_gone(services.tmp / "runs-async-fail", "rollout/endpoints.json"), "the server never started"


def test_nightly_promotes_champion_and_compares(services, recipe_runs):
    params = {"overrides": short_overrides(services.tmp / "runs", name="n")}
    ps = []
    for _ in range(2):
        ps.append(services.run_deployment("full-recipe/nightly", params))
        assert ps[-1].returncode == 0, ps[-1].stdout[-4000:] + ps[-1].stderr[-2000:]
    first, second = services.flow_runs(*ps)
    assert first["state_type"] == second["state_type"] == "COMPLETED"
    c = mlflow_client(services.mlflow)
    champ = c.get_model_version_by_alias("n-student", "champion")
    # refresh=[all]: the second nightly retrained every stage and registered a new student
    assert int(champ.version) == 2
    assert any(a["key"] == "n-champion-deltas" and a["type"] == "table" for a in second["artifacts"])
    parent, _ = _family_named(c, "n", second["id"])
    assert parent.data.tags["mopd.champion_result"] == "ok"
    assert "champion_delta/math" in parent.data.metrics


def _family_named(c, exp: str, flow_run_id: str):
    runs = runs_of(c, exp)
    parent = next(r for r in runs if r.data.tags.get("prefect.flow_run_id") == flow_run_id
                  and "mlflow.parentRunId" not in r.data.tags)
    return parent, [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]


BROWSER_DIR = ROOT / "tests/e2e/browser"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def test_ui_custom_run_of_a_stage_deployment(services, recipe_runs):
    """Headless Chromium opens the Prefect UI, starts the mopd stage deployment with a custom `steps`, and the
    run completes; the screenshots are kept under $MOPD_TEST_ARTIFACTS (default test-artifacts/)."""
    import shutil

    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: `make browser-deps` (apt-get install chromium) to run the UI test")
    if not shutil.which("node") or not (BROWSER_DIR / "node_modules/playwright-core").exists():
        pytest.skip("no node or playwright-core: `make browser-deps` (npm install in tests/e2e/browser)")
    # a stage deployment whose defaults point at the first run's models and the short recipe; the UI changes one
    # field of the `mopd` card
    import yaml

    spec = {"name": "mopd-ui-test", "pull": [{"prefect.deployments.steps.set_working_directory":
                                              {"directory": str(ROOT)}}],
            "deployments": [{"name": "ui", "entrypoint": "flows/stages.py:mopd_flow",
                             "work_pool": {"name": "mopd-process"},
                             # its own name: the student folders of the other tests' runs (steps 3..4) stay
                             # theirs, and 2 steps here is a fresh stage, not fewer steps than a trained one
                             "parameters": {"overrides": short_overrides(services.tmp / "runs", name="ui"),
                                            "init": "models:/t-sft/1",
                                            "teacher_refs": {d: f"models:/t-expert-{d}/1"
                                                             for d in ("math", "code", "if")}}}]}
    pf = services.tmp / "prefect-ui.yaml"
    pf.write_text(yaml.safe_dump(spec))
    p = subprocess.run([str(ROOT / ".venv/bin/prefect"), "--no-prompt", "deploy", "--prefect-file", str(pf), "-n",
                        "ui"], cwd=ROOT, env=services.client_env, text=True, capture_output=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    dep_id = drive(services.tmp, [{"op": "deployment_id", "deployment": "mopd/ui"}], services.client_env,
                   timeout=120, tag="depid")[0]
    art = Path(os.environ.get("MOPD_TEST_ARTIFACTS", ROOT / "test-artifacts"))
    art.mkdir(parents=True, exist_ok=True)
    shot = art / "prefect-ui-custom-run.png"
    ui = services.api.removesuffix("/api")
    p = subprocess.run(["node", str(BROWSER_DIR / "custom_run.mjs"), ui, dep_id, "Steps (Optional)", "2", str(shot)],
                       cwd=BROWSER_DIR, env=services.client_env, text=True, capture_output=True, timeout=660)
    print(p.stdout, p.stderr)  # the script's timeline (shown with -s or beside a failure)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert shot.exists()
    info = json.loads(p.stdout.strip().splitlines()[-1])
    run = drive(services.tmp, [{"op": "flow_run", "id": info["runId"]}], services.client_env, timeout=120,
                tag="uirun")[0]
    assert run["state_type"] == "COMPLETED"
    assert run["parameters"]["mopd"]["steps"] == 2  # the value typed into the form reached the flow
    c = mlflow_client(services.mlflow)
    newest = max(c.search_model_versions("name='ui-student'"), key=lambda v: int(v.version))
    assert c.get_run(newest.run_id).data.params["mopd.steps"] == "2"
