"""Secrets: every process of the battery's services (and so every flow run of the Prefect faults and the soak,
and the `mopd recipe` runs of the CLI faults) ran with HF_TOKEN and MLFLOW_TRACKING_PASSWORD set to distinctive
values. Scanned afterwards — none may hold them: every MLflow run's params, tags and metric names, every
registered model version's tags, every artifact (downloaded), every Prefect log line, flow run (parameters,
state messages), artifact and deployment through the API, and every file the battery wrote (run folders, the
services' databases and logs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reliability.common import SECRETS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def _hits(text: str | bytes, where: str, found: list) -> None:
    b = text if isinstance(text, bytes) else str(text).encode(errors="replace")
    for name, value in SECRETS.items():
        if value.encode() in b:
            found.append(f"{name} in {where}")


def test_no_secret_in_mlflow_prefect_or_run_folders(services, reliability_tmp, tmp_path, case):
    from tests.e2e.helpers import mlflow_client

    case["category"] = "secrets"
    c = mlflow_client(services.mlflow)
    if len(c.search_experiments()) < 2:  # run alone: give the scan a recipe run to look at
        from tests.conftest import tiny_overrides

        ov = [o for o in tiny_overrides(reliability_tmp / "secrets") if not o.startswith("name=")] + ["name=x"]
        assert services.wait_final(services.create_run("full-recipe/tiny", {"overrides": ov})) == "COMPLETED"
    found, n = [], {"mlflow runs": 0, "artifacts": 0, "model versions": 0, "prefect logs": 0, "flow runs": 0,
                    "prefect artifacts": 0, "files": 0}
    for exp in c.search_experiments():
        _hits(json.dumps({"name": exp.name, "tags": exp.tags}), f"experiment {exp.name}", found)
        for r in c.search_runs([exp.experiment_id], max_results=5000):
            n["mlflow runs"] += 1
            where = f"run {r.info.run_id} ({r.data.tags.get('mlflow.runName')})"
            _hits(json.dumps({"params": r.data.params, "tags": r.data.tags, "metrics": list(r.data.metrics)}),
                  where, found)
            if not c.list_artifacts(r.info.run_id):
                continue
            local = Path(c.download_artifacts(r.info.run_id, "", str(tmp_path / r.info.run_id)))  # all of them
            for f in (x for x in local.rglob("*") if x.is_file()):
                n["artifacts"] += 1
                _hits(f.read_bytes(), f"{where} artifact {f.relative_to(local)}", found)
    for rm in c.search_registered_models():
        for mv in c.search_model_versions(f"name='{rm.name}'"):
            n["model versions"] += 1
            _hits(json.dumps({"tags": mv.tags, "desc": mv.description, "source": mv.source}),
                  f"model {rm.name}/{mv.version}", found)

    logs = services.logs()
    n["prefect logs"] = len(logs)
    _hits(json.dumps(logs), "Prefect logs", found)
    frs = services.rest("POST", "/flow_runs/filter", {"limit": 200})
    n["flow runs"] = len(frs)
    _hits(json.dumps(frs), "Prefect flow runs", found)
    arts = services.rest("POST", "/artifacts/filter", {"limit": 200})
    n["prefect artifacts"] = len(arts)
    _hits(json.dumps(arts), "Prefect artifacts", found)
    _hits(json.dumps(services.rest("POST", "/deployments/filter", {"limit": 200})), "Prefect deployments", found)

    for f in Path(reliability_tmp).rglob("*"):
        if f.is_file() and not f.is_symlink():
            n["files"] += 1
            _hits(f.read_bytes(), f"file {f.relative_to(reliability_tmp)}", found)

    assert n["mlflow runs"] >= 7 and n["artifacts"] >= 20 and n["prefect logs"] >= 50, n  # the scan saw runs
    scanned = sum(n.values())
    case["detail"].update(found=len(found), scanned=scanned)
    case["message"] = "0 found in " + ", ".join(f"{v} {k}" for k, v in n.items()) if not found else \
        f"{len(found)} found: {found[:5]}"
    assert not found, found
