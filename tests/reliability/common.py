"""Shared by the reliability battery: the CLI runner (a real subprocess or in-process through the same
`mopd_core.cli.main`), whole-tree hashes, the one-line-error check, waits on conditions (never fixed sleeps), a
stdlib fake of vLLM's OpenAI server, the listening sockets of a set of processes, and the signature of a finished
recipe run (accuracy table + every stage's final weights + its deterministic step metrics) that two runs must
share bit for bit."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
MOPD = ROOT / ".venv" / "bin" / "mopd"
BIN = MOPD.parent if MOPD.exists() else Path(sys.executable).parent  # prefect, mlflow for infra/services.sh
VLLM_PY = Path(os.environ.get("MOPD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
DOMAINS = ("math", "code", "if")
STAGES = ("sft", "expert-math", "expert-code", "expert-if", "student")
# distinctive values: a hit anywhere in MLflow/Prefect/run folders is a leak
SECRETS = {"HF_TOKEN": "hf_RELIABILITYsecret7f3c9a1e", "MLFLOW_TRACKING_PASSWORD": "mlflowPW-RELIABILITY-5d2b8e"}


def fault_overrides(out: Path, name: str = "f") -> list[str]:
    """The battery's shortened recipe: tiny_overrides-sized model, with enough steps that every training stage
    has a checkpoint before its end (SFT: TRL saves every max(steps // 4, 50) = 50 steps; RL: every 3), so a
    kill lands between two checkpoints and the rerun resumes instead of restarting."""
    ov = [o for o in tiny_overrides(out) if not o.startswith(("name=", "sft.steps=", "sft.logging_steps=",
                                                              "expert.steps=", "expert.save_every=",
                                                              "mopd.steps=", "mopd.save_every="))]
    return ov + [f"name={name}", "sft.steps=60", "sft.logging_steps=1", "expert.steps=12", "expert.save_every=3",
                 "mopd.steps=12", "mopd.save_every=3"]


def sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def base_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "MOPD_TRACEBACK"))}
    env.update({"PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1", "NO_PROXY": "127.0.0.1,localhost",
                "no_proxy": "127.0.0.1,localhost", "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


# ---------------------------------------------------------------- the CLI


@dataclass
class CliResult:
    rc: int
    stdout: str
    stderr: str
    wall_s: float
    via: str  # "subprocess" | "in-process"


def mopd_cmd() -> list[str]:
    return [str(MOPD)] if MOPD.exists() else [sys.executable, "-m", "mopd_core.cli"]


def _limit_file_size(n: int):
    def pre() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
    return pre


def run_cli(args: list[str], *, in_process: bool = False, env: dict | None = None, timeout: float = 300,
            cwd: Path = ROOT, fsize: int | None = None) -> CliResult:
    """`mopd ARGS` as a user runs it (a subprocess of .venv/bin/mopd), or in this process through the same
    `cli.main` — an exception escaping main() is what a subprocess would print as a traceback. `fsize`: the
    subprocess may write no file larger than that (a size-limited fake of a full disk)."""
    t0 = time.perf_counter()
    if not in_process or fsize:
        p = subprocess.run(mopd_cmd() + args, cwd=cwd, env=env or base_env(), capture_output=True, text=True,
                           timeout=timeout, preexec_fn=_limit_file_size(fsize) if fsize else None)
        return CliResult(p.returncode, p.stdout, p.stderr, time.perf_counter() - t0, "subprocess")
    from mopd_core import cli

    out, err = io.StringIO(), io.StringIO()
    before = list(logging.getLogger().handlers)
    old_env = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(args)
            except SystemExit as e:  # argparse
                rc = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 - what the user would see
                err.write(traceback.format_exc())
                rc = 1
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for h in logging.getLogger().handlers:  # basicConfig may have bound a handler to our buffer
            if h not in before:
                logging.getLogger().removeHandler(h)
    return CliResult(rc, out.getvalue(), err.getvalue(), time.perf_counter() - t0, "in-process")


def one_line_error(res: CliResult, *needles: str) -> str:
    """Exit 2; stderr is exactly one line, `error: …`, naming every needle; no traceback."""
    ctx = f"[{res.via}] rc={res.rc}\nstderr:\n{res.stderr[-3000:]}\nstdout:\n{res.stdout[-1000:]}"
    assert "Traceback" not in res.stderr, ctx
    assert res.rc == 2, ctx
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), f"stderr is not one `error:` line\n{ctx}"
    missing = [n for n in needles if n not in lines[0]]
    assert not missing, f"the error does not name {missing}: {lines[0]}"
    return lines[0]


# ---------------------------------------------------------------- hashes, waits


def tree_hash(root: Path) -> dict[str, str]:
    """Every entry under `root` (files by content, dirs, links by target): byte-identical ⇔ equal dicts, and a
    new file or folder shows up as a new key."""
    root = Path(root)
    if not root.exists():
        return {}
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def tree_diff(a: dict, b: dict) -> str:
    added = sorted(set(b) - set(a))
    gone = sorted(set(a) - set(b))
    changed = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    return f"added {added[:8]}, removed {gone[:8]}, changed {changed[:8]}"


def wait_for(cond: Callable[[], object], timeout: float, what: str, poll: float = 0.05,
             abort: Callable[[], str | None] | None = None):
    """Poll `cond` until it returns something truthy; `abort()` returning a message stops early (e.g. the
    watched process exited)."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if abort is not None:
            why = abort()
            if why:
                raise AssertionError(f"while waiting for {what}: {why}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def metric_rows(path: Path) -> list[dict]:
    """Rows of a metrics.jsonl (a line being written is skipped)."""
    out = []
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for ln in text.splitlines():
        try:
            out.append(json.loads(ln))
        except ValueError:
            pass
    return out


def last_step(stage_dir: Path) -> int:
    rows = metric_rows(Path(stage_dir) / "metrics.jsonl")
    return max((int(r.get("step", 0)) for r in rows), default=0)


def stage_status(stage_dir: Path) -> str | None:
    try:
        return json.loads((Path(stage_dir) / "stage.json").read_text()).get("status")
    except (OSError, ValueError):
        return None


def kill_step(case: str, lo: int, hi: int) -> int:
    """A random step in [lo, hi], seeded by the case name: the same on every run of the battery."""
    return random.Random(f"reliability/{case}").randint(lo, hi)


# ---------------------------------------------------------------- run signature


_TIMING = ("perf/", "mem/")
# the teacher-score cache's accounting: a resumed or rerun step finds its rows in the cache, so its teachers score
# fewer tokens (`teacher/<t>/tokens` counts the tokens a teacher really scored) — work done, not a training number
_WORK = ("/cache_hits", "/cache_misses", "/tokens")


def deterministic(row: dict) -> dict:
    """A metrics row without wall-clock and memory readings and the score cache's accounting (everything else is
    a function of the seed)."""
    return {k: v for k, v in row.items() if not k.startswith(_TIMING) and not k.endswith("_s")
            and not k.endswith("_mb") and not (k.startswith("teacher/") and k.endswith(_WORK))}


def file_sha(p: Path) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def run_signature(run_dir: Path) -> dict:
    """What two runs of the same config and seed must share: the accuracy table, every stage's final weights,
    every step's training metrics."""
    run_dir = Path(run_dir)
    acc = json.loads((run_dir / "accuracy.json").read_text())["accuracy"]
    weights = {s: file_sha(run_dir / s / "final" / "model.safetensors") for s in STAGES}
    metrics = {s: [deterministic(r) for r in metric_rows(run_dir / s / "metrics.jsonl")] for s in STAGES}
    return {"accuracy": acc, "weights": weights, "metrics": metrics}


def signature_diff(a: dict, b: dict) -> str:
    if a["accuracy"] != b["accuracy"]:
        return f"accuracy differs: {a['accuracy']} vs {b['accuracy']}"
    bad = [s for s in STAGES if a["weights"][s] != b["weights"][s]]
    if bad:
        return f"final weights differ in {bad}"
    for s in STAGES:
        ra, rb = a["metrics"][s], b["metrics"][s]
        if [r.get("step") for r in ra] != [r.get("step") for r in rb]:
            return f"{s}: steps logged {[r.get('step') for r in rb]} vs {[r.get('step') for r in ra]}"
        for x, y in zip(ra, rb):
            if x != y:
                keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
                return f"{s} step {x.get('step')}: {keys[:6]} differ"
    return ""


def stage_folders(run_dir: Path) -> set[str]:
    return {p.name for p in Path(run_dir).iterdir() if p.is_dir()} if Path(run_dir).exists() else set()


def finished_stages(run_dir: Path) -> set[str]:
    return {s for s in stage_folders(run_dir) if stage_status(Path(run_dir) / s) == "done"
            and (Path(run_dir) / s / "final").exists()}


# ---------------------------------------------------------------- processes and sockets


def proc_environ(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pids_with_env(marker: str) -> set[int]:
    """Live processes whose environment holds `marker` (NAME=value): everything a test's services started."""
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid() and marker in proc_environ(int(d.name)).split("\0"):
            if alive(int(d.name)):
                out.add(int(d.name))
    return out


def _hex_addr(h: str) -> str:
    ip, port = h.split(":")
    b = bytes.fromhex(ip)
    if len(b) == 4:
        return f"{'.'.join(str(x) for x in b[::-1])}:{int(port, 16)}"
    words = [b[i:i + 4][::-1] for i in range(0, 16, 4)]
    raw = b"".join(words)
    if raw[:12] == b"\0" * 10 + b"\xff\xff":
        return f"::ffff:{'.'.join(str(x) for x in raw[12:])}:{int(port, 16)}"
    import ipaddress

    return f"[{ipaddress.IPv6Address(raw)}]:{int(port, 16)}"


def listening(pids: set[int]) -> set[tuple[int, str]]:
    """(pid, address) of every TCP socket in LISTEN state held by `pids` (from /proc/net/tcp{,6} and the
    processes' fd tables — no `ss`/psutil needed)."""
    inode_addr = {}
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(f).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            parts = ln.split()
            if len(parts) > 9 and parts[3] == "0A":
                inode_addr[parts[9]] = _hex_addr(parts[1])
    out = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                t = os.readlink(fd)
            except OSError:
                continue
            if t.startswith("socket:[") and t[8:-1] in inode_addr:
                out.add((pid, inode_addr[t[8:-1]]))
    return out


def is_loopback(addr: str) -> bool:
    host = addr.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in ("::1", "localhost") or host.startswith("::ffff:127.")


def killpg(pid: int, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


# ---------------------------------------------------------------- a fake vLLM server


class FakeVLLM:
    """A stdlib `http.server` that answers like vLLM's OpenAI server (`GET /health`, `GET /v1/models`,
    `POST /tokenize`, `POST /v1/completions` with `prompt_logprobs`) — for the teacher faults a real server
    cannot be made to produce on demand. Tokenizes with the given checkpoint's tokenizer.

    `models`: the /v1/models entries ([] = serves no model); `max_model_len`; `id_shift`: added to every token
    id (a server with another vocabulary); `status`: {path: HTTP status} forced answers; `delay_s`: {path: s}."""

    def __init__(self, tokenizer_dir: Path, *, max_model_len: int = 128, models: list | None = None,
                 id_shift: int = 0, status: dict | None = None, delay_s: dict | None = None,
                 body: dict | None = None):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.max_model_len, self.id_shift = max_model_len, id_shift
        self.models = [{"id": "fake-teacher", "object": "model", "max_model_len": max_model_len}] \
            if models is None else models
        self.status, self.delay_s, self.body = status or {}, delay_s or {}, body or {}
        self.requests: list[str] = []
        self._stop = threading.Event()
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, code: int, obj) -> None:
                data = json.dumps(obj).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _handle(self, payload) -> None:
                path = self.path.split("?")[0]
                fake.requests.append(path)
                if fake.delay_s.get(path):
                    fake._stop.wait(fake.delay_s[path])
                if path in fake.status:
                    code = fake.status[path]
                    return self._send(code, fake.body.get(path) or {"object": "error", "message":
                                                                    f"fake error {code}", "code": code})
                if path == "/health":
                    return self._send(200, {})
                if path == "/v1/models":
                    return self._send(200, {"object": "list", "data": fake.models})
                if path == "/tokenize":
                    ids = fake.tok(payload.get("prompt", ""), add_special_tokens=False)["input_ids"]
                    return self._send(200, {"tokens": [i + fake.id_shift for i in ids], "count": len(ids),
                                            "max_model_len": fake.max_model_len})
                if path == "/v1/completions":
                    return self._send(200, fake.completions(payload))
                return self._send(404, {"detail": "Not Found"})

            def do_GET(self):  # noqa: N802
                self._handle({})

            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    payload = json.loads(self.rfile.read(n) or b"{}")
                except ValueError:
                    payload = {}
                self._handle(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def completions(self, payload: dict) -> dict:
        """Uniform log-probs over the vocabulary for every prompt position (shape as vLLM's)."""
        import math

        prompts = payload.get("prompt") or []
        prompts = prompts if prompts and isinstance(prompts[0], list) else [prompts]
        lp = -math.log(len(self.tok))
        choices = []
        for i, p in enumerate(prompts):
            plp = [None] + [{str(t): {"logprob": lp, "rank": 1, "decoded_token": ""}} for t in p[1:]]
            choices.append({"index": i, "text": "", "prompt_logprobs": plp, "finish_reason": "length"})
        return {"id": "cmpl-fake", "object": "text_completion", "model": "fake-teacher", "choices": choices}

    def __enter__(self) -> "FakeVLLM":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
