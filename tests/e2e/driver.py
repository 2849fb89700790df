"""Run flows / query Prefect in a subprocess for the e2e tests (each process gets its own Prefect settings:
ephemeral mode or PREFECT_API_URL). `python tests/e2e/driver.py SPEC.json OUT.json`.

SPEC: {"ops": [{"op": "run", "flow": "full-recipe", "kwargs": {...}}, {"op": "flow_run", "id": "..."},
              {"op": "vllm_procs", "needle": "/tmp/..."}, {"op": "call", "fn": "module:function", "args": [...]}]}
OUT: one result per op: flow runs with their state, task runs (name, state) and artifacts (key, type).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

FLOWS = {
    "full-recipe": ("flows.full_recipe", "full_recipe"),
    "sft": ("flows.stages", "sft_flow"),
    "expert-rl": ("flows.stages", "expert_rl_flow"),
    "serve-teachers": ("flows.stages", "serve_teachers_flow"),
    "mopd": ("flows.stages", "mopd_flow"),
    "evaluate": ("flows.stages", "evaluate_flow"),
}


def describe_flow_run(flow_run_id: str) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, \
        FlowRunFilterId

    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(flow_run_id)
        trs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
        return {
            "id": str(fr.id), "name": fr.name, "state_type": fr.state.type.value if fr.state else None,
            "state_name": fr.state.name if fr.state else None,
            "message": fr.state.message if fr.state else None, "parameters": fr.parameters,
            "deployment_id": str(fr.deployment_id) if fr.deployment_id else None,
            "start_time": str(fr.start_time), "end_time": str(fr.end_time),
            "total_run_time": fr.total_run_time.total_seconds() if fr.total_run_time else None,
            "task_runs": [{"name": t.name, "state_type": t.state.type.value if t.state else None,
                           "state_name": t.state.name if t.state else None} for t in trs],
            "artifacts": [{"key": a.key, "type": a.type, "data": a.data if isinstance(a.data, str) else
                           json.dumps(a.data)} for a in arts],
        }


def deployment_runs(name: str) -> list[dict]:
    """Every flow run of deployment `flow/deployment`, oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as c:
        dep = c.read_deployment_by_name(name)
        runs = c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))
    runs = sorted(runs, key=lambda r: str(r.created))
    return [describe_flow_run(str(r.id)) for r in runs]


def schedules(name: str) -> list[dict]:
    """The schedules of deployment `flow/deployment`: cron, timezone, active."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        dep = c.read_deployment_by_name(name)
    return [{"cron": s.schedule.cron, "timezone": s.schedule.timezone, "active": s.active} for s in dep.schedules]


def champion_check(op: dict) -> dict:
    """The nightly comparison on given accuracies (a champion far better than the student): a flow around the
    compare_to_champion task, as the full recipe runs it."""
    from prefect import flow

    from tasks import tracking
    from tasks.runs import build_config, compare_to_champion

    @flow(name="champion-check")
    def champion_check_flow(accuracy: dict, tolerance: float):
        cfg = build_config("tiny", op["overrides"], {}, {})
        parent = tracking.start_run(cfg.name, "champion-check")
        try:
            return compare_to_champion(cfg, parent, accuracy, "models:/t-student/2", "models:/t-student/1",
                                       tolerance, True, "champion")
        finally:
            tracking.end_run(parent)

    state = champion_check_flow(op["accuracy"], op["tolerance"], return_state=True)
    out = {"ok": state.is_completed(), "message": state.message}
    try:
        out["result"] = state.result()
    except BaseException as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    out["flow_run"] = describe_flow_run(str(state.state_details.flow_run_id))
    return out


def run_flow(op: dict) -> dict:
    import importlib
    import time

    mod, fn = FLOWS[op["flow"]]
    f = getattr(importlib.import_module(mod), fn)
    t0 = time.perf_counter()
    state = f(**op.get("kwargs", {}), return_state=True)
    wall = time.perf_counter() - t0
    out = {"wall_s": wall, "ok": state.is_completed(), "message": state.message}
    try:
        out["result"] = json.loads(json.dumps(state.result(), default=str))
    except BaseException as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    out["flow_run"] = describe_flow_run(str(state.state_details.flow_run_id))
    return out


def vllm_procs(op: dict) -> dict:
    """Inside the driver process, before it exits (and before serving/servers.py's atexit safety net could stop
    anything): the live vLLM processes whose command line mentions `needle`, and the server groups
    (`serving.VllmServers`) still registered as running."""
    from tests.e2e.helpers import vllm_processes

    out = {"procs": vllm_processes(op["needle"])}
    try:
        from mopd_core import serving

        out["registered"] = len(serving.live_groups())
    except Exception as e:  # noqa: BLE001
        out["registered_error"] = str(e)
    return out


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    results = []
    for op in spec["ops"]:
        try:
            if op["op"] == "run":
                results.append(run_flow(op))
            elif op["op"] == "deployment_runs":
                results.append(deployment_runs(op["deployment"]))
            elif op["op"] == "schedules":
                results.append(schedules(op["deployment"]))
            elif op["op"] == "champion_check":
                results.append(champion_check(op))
            elif op["op"] == "deployment_id":
                from prefect.client.orchestration import get_client

                with get_client(sync_client=True) as c:
                    results.append(str(c.read_deployment_by_name(op["deployment"]).id))
            elif op["op"] == "vllm_procs":
                results.append(vllm_procs(op))
            elif op["op"] == "flow_run":
                results.append(describe_flow_run(op["id"]))
            elif op["op"] == "call":  # a test's own check between flow runs of one driver, e.g. hashing a folder
                import importlib

                mod, fn = op["fn"].split(":")
                results.append(getattr(importlib.import_module(mod), fn)(*op.get("args", [])))
            else:
                raise ValueError(op)
        except BaseException as e:  # noqa: BLE001
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        Path(sys.argv[2]).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
