"""Shared by the e2e tests: an isolated environment (nothing written outside tmp dirs), free ports, the short
tiny recipe, and a subprocess driver for flows."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolated_env(tmp: Path, **extra: str) -> dict:
    """Prefect, MLflow, HF, Ray state under `tmp`; no analytics, no telemetry, no network beyond loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update({
        "PREFECT_HOME": str(tmp / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_EXTRA_LOGGERS": "mopd", "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "true",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}", "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HOME": str(tmp / "hf"),
        "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(tmp / "ray"), "PYTHONHASHSEED": "0",
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
    })
    env.update(extra)
    return env


def short_overrides(out_dir: Path, name: str = "t", mopd_steps: int = 3, mopd_save_every: int = 2) -> list[str]:
    """The tiny recipe cut to seconds per stage (a 2-layer, 64-wide model, a few steps)."""
    return [
        f"output_dir={out_dir}", f"name={name}", "runtime.device=cpu", "runtime.num_threads=1",
        "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
        "model.tiny.intermediate_size=128",
        "sft.steps=6", "sft.batch_size=16", "sft.logging_steps=2",
        "expert.steps=3", "expert.prompts_per_step=4", "expert.group_size=4", "expert.save_every=2",
        f"mopd.steps={mopd_steps}", "mopd.prompts_per_step=6", "mopd.group_size=2",
        f"mopd.save_every={mopd_save_every}",
        "rollout.max_new_tokens=6", "data.domains.math.eval_size=8", "data.domains.code.eval_size=8",
        "data.domains.if.eval_size=8",
    ]


def drive_start(tmp: Path, ops: list[dict], env: dict, tag: str = "drive") -> tuple[subprocess.Popen, Path, Path]:
    """Start the driver on `ops` without waiting (for tests that act while a flow runs); `drive_results` reads
    what it wrote."""
    spec, out = tmp / f"{tag}-spec.json", tmp / f"{tag}-out.json"
    spec.write_text(json.dumps({"ops": ops}))
    log = tmp / f"{tag}.log"
    with log.open("w") as f:
        p = subprocess.Popen([PY, str(ROOT / "tests/e2e/driver.py"), str(spec), str(out)], cwd=ROOT, env=env,
                             stdout=f, stderr=subprocess.STDOUT)
    return p, out, log


def drive_results(p: subprocess.Popen, out: Path, log: Path, timeout: float = 600) -> list[dict]:
    p.wait(timeout=timeout)
    if not out.exists():
        raise AssertionError(f"driver exited {p.returncode} without results; log:\n{log.read_text()[-4000:]}")
    return json.loads(out.read_text())


def drive(tmp: Path, ops: list[dict], env: dict, timeout: float = 600, tag: str = "drive") -> list[dict]:
    p, out, log = drive_start(tmp, ops, env, tag)
    try:
        return drive_results(p, out, log, timeout)
    finally:
        if p.poll() is None:
            p.kill()


def mlflow_client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def pause_schedules(client_env: dict) -> None:
    """Pause every deployment schedule (and delete the runs they scheduled ahead). The nightly's cron (03:00 UTC)
    would otherwise start a full default recipe on the test worker whenever a suite runs across it: it did once in
    CI, loading both cores and adding a third run to the nightly test's count."""
    p = subprocess.run([str(ROOT / ".venv/bin/prefect"), "--no-prompt", "deployment", "schedule", "pause", "--all"],
                       cwd=ROOT, env=client_env, text=True, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]


def runs_of(client, experiment: str) -> list:
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], max_results=1000) if exp else []


def vllm_processes(needle: str) -> list[dict]:
    """Live (non-zombie) vLLM processes of a test: the command line mentions vllm (a server) or the environment
    holds the VLLM_* variables servers.py sets (its engine-core/worker children, renamed `VLLM::EngineCore`), and
    the command line or environment mentions `needle` (the test's tmp dir)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (d / "environ").read_bytes().decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        is_vllm = "vllm" in cmd.lower() or "VLLM_CONFIG_ROOT=" in environ
        if state != "Z" and is_vllm and (needle in cmd or needle in environ):
            out.append({"pid": int(d.name), "cmdline": cmd[:300]})
    return out


def pid_alive(pid: int) -> bool:
    """A process with this pid exists and is no zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
