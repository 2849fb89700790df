"""The expert and MOPD stages with their update on real Ray workers under real torch FSDP2 / DDP (gloo, 2 CPU
workers; no mocks): the same losses and weights as one process within 1e-5, about half the parameter and
optimizer bytes per rank, a killed worker named in the error with the last checkpoint intact, a resume equal to
an uninterrupted run, and the same on a two-node Ray cluster started on this machine (`ray start`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mopd_core import recipe as R
from mopd_core.errors import WorkerLostError
from mopd_core.models import load_model
from mopd_core.train.checkpoint import checkpoint_dirs

pytest.importorskip("ray")

DIST = ["runtime.num_workers=2", "runtime.strategy=fsdp2", "runtime.ray_timeout_s=240"]


def _params(path):
    return {k: v.clone() for k, v in load_model(path).state_dict().items()}


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _worst(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _cfg(tmp_path, extra=()):
    from tests.conftest import short_cfg

    return short_cfg(tmp_path, ["expert.steps=4", *extra])


@pytest.fixture(scope="module")
def sft_dir(short_sft_dir):
    return short_sft_dir


@pytest.fixture(scope="module")
def single_expert(sft_dir, tmp_path_factory):
    """The reference: 4 expert steps in one process."""
    cfg = _cfg(tmp_path_factory.mktemp("single"))
    return R.expert_stage(cfg, "short", sft_dir, progress=False)


@pytest.fixture(scope="module")
def fsdp_expert(sft_dir, tmp_path_factory):
    """The same 4 steps on 2 FSDP2 workers (uninterrupted: the resume test compares against it)."""
    cfg = _cfg(tmp_path_factory.mktemp("fsdp"), DIST)
    return R.expert_stage(cfg, "short", sft_dir, progress=False)


def test_fsdp2_expert_equals_one_process_with_half_the_bytes_per_rank(single_expert, fsdp_expert):
    ref, got = _rows(single_expert.stage_dir / "metrics.jsonl"), _rows(fsdp_expert.stage_dir / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert ref[0]["grad_norm"] > 0 and ref[-1]["approx_kl"] >= 0
    for a, b in zip(ref, got):  # the same rollouts (driver-side, same weights) and the same update
        for k in ("reward/short", "length/short"):
            assert b[k] == a[k], k
        for k in ("loss", "grad_norm", "entropy", "clip_frac"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (b["step"], k)
    w_ref, w_got = _params(single_expert.model_dir), _params(fsdp_expert.model_dir)
    assert _worst(w_ref, w_got) < 1e-5
    # the sharding is real: each rank held half the parameters and half the AdamW moments
    full_mb = sum(v.numel() * v.element_size() for v in w_ref.values()) / 2**20
    last = got[-1]
    assert last["dist/workers"] == 2
    assert last["dist/param_mb_per_rank"] == pytest.approx(full_mb / 2, rel=0.02)
    assert last["dist/optim_mb_per_rank"] == pytest.approx(full_mb, rel=0.02)  # 2 moments × 1/2
    info = json.loads((fsdp_expert.stage_dir / "stage.json").read_text())
    ws = info["distributed"]["workers"]
    assert info["distributed"]["strategy"] == "fsdp2" and [w["rank"] for w in ws] == [0, 1]
    assert len({w["pid"] for w in ws} | {os.getpid()}) == 3  # two worker processes besides this one
    # the checkpoint holds the whole model and one optimizer shard per rank
    ck = checkpoint_dirs(fsdp_expert.stage_dir)[-1]
    assert (ck / "model" / "model.safetensors").exists()
    assert sorted(p.name for p in (ck / "optimizer").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.parametrize("kd_loss,placement", [("sampled_rkl", "driver"), ("jsd", "workers")])
def test_fsdp2_mopd_equals_one_process(sft_dir, single_expert, tmp_path, kd_loss, placement):
    """MOPD with a local teacher per domain (the single-process expert for all of them): the reverse-KL
    advantage (computed by the driver) with the teachers in the driver; and the JSD loss over the teachers'
    top-k, which the workers compute inside the update from their rows of the teachers' scores, with the
    teachers themselves as Ray actors on the workers' bundles (`teachers.placement=workers`)."""
    teachers = {d: single_expert.model_dir for d in ("math", "code", "if", "short")}
    outs = {}
    for name, extra in (("single", []), ("fsdp2", DIST + [f"teachers.placement={placement}"])):
        beta = ["mopd.jsd_beta=0.5"] if kd_loss == "jsd" else []  # read by the JSD loss only (else refused)
        cfg = _cfg(tmp_path / name, ["mopd.w_rl=1.0", f"mopd.kd_loss={kd_loss}", *beta] + extra)
        outs[name] = R.mopd_stage(cfg, sft_dir, teachers, progress=False)
    ref, got = (_rows(outs[n].stage_dir / "metrics.jsonl") for n in ("single", "fsdp2"))
    keys = ("loss", "grad_norm", "adv/kd_mean") if kd_loss == "sampled_rkl" else ("loss", "grad_norm", "jsd")
    assert len(got) == 3 and ref[-1][keys[-1]] != 0
    per_teacher = sorted(k for k in ref[-1] if k.startswith("reverse_kl/")
                         or (k.startswith("teacher/") and k.endswith("/tokens")))
    assert any(k.startswith("reverse_kl/") for k in per_teacher), sorted(ref[-1])
    for a, b in zip(ref, got):
        for k in keys + tuple(per_teacher):  # every teacher scored the same rows to the same numbers
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (b["step"], k)
    assert _worst(_params(outs["single"].model_dir), _params(outs["fsdp2"].model_dir)) < 1e-5
    man = outs["fsdp2"].teachers
    if placement == "workers":  # teacher i on bundle i mod 2, each in its own actor process (those asked)
        order = list(teachers)
        assert len(man) >= 2 and {man[d]["bundle"] for d in man} == {0, 1}, man
        assert all(man[d]["bundle"] == order.index(d) % 2 for d in man), man
        assert len({m["pid"] for m in man.values()}) == len(man) and all(m["param_bytes"] > 0 for m in man.values())
    else:
        assert man == {}


def test_fsdp2_cpu_offload_equals_on_device_shards(sft_dir, fsdp_expert, tmp_path):
    """train.fsdp_cpu_offload: torch's CPUOffloadPolicy keeps the shards and the optimizer on the host — on
    CPU the same memory, so this checks the wiring and that the numbers do not move (on a GPU the device check
    measures the memory it frees)."""
    cfg = _cfg(tmp_path, DIST + ["train.fsdp_cpu_offload=true"])
    # not part of the stage identity: a finished stage is reused whichever way its shards lived
    assert R.expert_fingerprint(cfg, "short", sft_dir) == R.expert_fingerprint(_cfg(tmp_path, DIST), "short",
                                                                                sft_dir)
    got = R.expert_stage(cfg, "short", sft_dir, progress=False)
    from mopd_core.train.checkpoint import read_stage

    # what torch FSDP2 applied on each rank (its param group's policy), not what was asked
    assert [w["cpu_offload"] for w in read_stage(got.stage_dir)["distributed"]["workers"]] == [True, True]
    assert [w["cpu_offload"] for w in read_stage(fsdp_expert.stage_dir)["distributed"]["workers"]] == [False, False]
    ref, rows = _rows(fsdp_expert.stage_dir / "metrics.jsonl"), _rows(got.stage_dir / "metrics.jsonl")
    for a, b in zip(ref, rows, strict=True):
        for k in ("loss", "grad_norm", "entropy"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (b["step"], k)
    assert _worst(_params(fsdp_expert.model_dir), _params(got.model_dir)) < 1e-6


def _digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def test_killed_worker_is_named_and_resume_equals_uninterrupted(sft_dir, fsdp_expert, tmp_path):
    import ray

    from mopd_core.train import loop as L

    cfg = _cfg(tmp_path, DIST)
    orig = L.run_policy_loop
    killed = []

    def interrupted(**kw):
        def on_step(step, m):
            if step == 3:  # after the step-2 checkpoint: SIGKILL-like death of rank 1
                name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                            if a["name"].endswith("-train-1"))
                killed.append(name)
                ray.kill(ray.get_actor(name))
        return orig(**kw, on_step=on_step)

    L.run_policy_loop = interrupted
    try:
        with pytest.raises(WorkerLostError) as err:
            R.expert_stage(cfg, "short", sft_dir, progress=False)
    finally:
        L.run_policy_loop = orig
    assert killed and killed[0] in str(err.value) and "resume" in str(err.value)
    assert not ray.is_initialized()  # the stage's own Ray was shut down after the failure
    stage = Path(cfg.output_dir) / cfg.name / "expert-short"
    assert [c.name for c in checkpoint_dirs(stage)] == ["step-000002"]
    before = _digest(checkpoint_dirs(stage)[0])
    assert any(k.startswith("optimizer/") for k in before)

    resumed = R.expert_stage(cfg, "short", sft_dir, progress=False)
    rows = _rows(stage / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    full = _rows(fsdp_expert.stage_dir / "metrics.jsonl")
    for k in ("loss", "grad_norm", "reward/short"):
        assert rows[3][k] == pytest.approx(full[3][k], rel=1e-5, abs=1e-7), k
    assert _worst(_params(fsdp_expert.model_dir), _params(resumed.model_dir)) < 1e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def two_node_ray():
    """A real two-node Ray cluster on this machine: a head and a second node (`ray start --block`, each its own
    raylet and object store, one CPU each — so one worker per node). The fixture joins it only to wait until
    both nodes are alive, then leaves; the stage joins through `runtime.ray_address`. Teardown stops exactly
    these two nodes (their process groups), never another Ray on the machine."""
    import signal
    import time

    import ray

    ray_bin = str(Path(sys.executable).with_name("ray"))
    tmp = tempfile.mkdtemp(prefix="mopd-2n-", dir="/tmp")
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    common = ["--block", "--disable-usage-stats", "--num-cpus=1", "--node-ip-address=127.0.0.1"]
    nodes = []
    try:
        for extra in (["--head", f"--port={port}", f"--temp-dir={tmp}", "--include-dashboard=false"],
                      [f"--address=127.0.0.1:{port}"]):
            nodes.append(subprocess.Popen([ray_bin, "start", *extra, *common], env=env, start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=open(Path(tmp) / "start.log", "ab")))
            if extra[0] == "--head":  # the second node needs the head's GCS up
                deadline = time.monotonic() + 180
                while True:
                    try:
                        with socket.create_connection(("127.0.0.1", port), timeout=1):
                            break
                    except OSError:
                        assert nodes[0].poll() is None, (Path(tmp) / "start.log").read_text()[-2000:]
                        assert time.monotonic() < deadline, "ray head did not come up"
                        time.sleep(0.5)
        address = f"127.0.0.1:{port}"
        os.environ["RAY_AUTH_MODE"] = "disabled"
        ray.init(address=address)
        deadline = time.monotonic() + 180
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            assert time.monotonic() < deadline, f"second Ray node did not join: {ray.nodes()}"
            time.sleep(0.5)
        ray.shutdown()  # the stage joins through runtime.ray_address itself
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for n in reversed(nodes):
            try:
                os.killpg(n.pid, signal.SIGTERM)
                n.wait(timeout=60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(n.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def test_two_node_cluster_one_worker_per_node(sft_dir, single_expert, two_node_ray, tmp_path):
    cfg = _cfg(tmp_path, DIST + [f"runtime.ray_address={two_node_ray}", "runtime.ray_placement=STRICT_SPREAD",
                                 "expert.steps=2"])
    out = R.expert_stage(cfg, "short", sft_dir, progress=False)
    ws = json.loads((out.stage_dir / "stage.json").read_text())["distributed"]["workers"]
    assert len({w["node_id"] for w in ws}) == 2  # the rendezvous really crossed nodes
    ref = _rows(single_expert.stage_dir / "metrics.jsonl")[:2]
    for a, b in zip(ref, _rows(out.stage_dir / "metrics.jsonl")):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)


def test_fsdp2_in_bfloat16_with_a_token_budget(sft_dir, tmp_path):
    """The presets' combination: FSDP2 gathers parameters in bf16 (MixedPrecisionPolicy) over float32 master
    shards, and micro-batches by a token budget, the ranks agreeing on the number of passes (a deadlock would hit
    the collective timeout). Compared with one process under autocast on the same first batch (the driver samples
    both): another bf16 computation, so close, not equal."""
    extra = ["runtime.dtype=bfloat16", "train.max_tokens_per_micro_batch=40", "expert.steps=2"]
    outs = {n: R.expert_stage(_cfg(tmp_path / n, extra + x), "short", sft_dir, progress=False)
            for n, x in (("single", []), ("fsdp2", DIST))}
    a, b = (_rows(outs[n].stage_dir / "metrics.jsonl") for n in ("single", "fsdp2"))
    assert b[0]["reward/short"] == a[0]["reward/short"]  # the same first rollout
    for k in ("loss", "grad_norm", "entropy"):
        assert b[0][k] == pytest.approx(a[0][k], rel=0.1, abs=1e-3), k
    assert b[0]["perf/micro_batches"] >= 2
    from safetensors import safe_open

    with safe_open(str(outs["fsdp2"].model_dir / "model.safetensors"), "pt") as f:  # gathered master weights
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    assert _worst(_params(outs["fsdp2"].model_dir), _params(outs["single"].model_dir)) < 5e-3


def test_sft_on_two_processes_through_trl_and_accelerate(tmp_path, caplog):
    """Distributed SFT: TRL's SFTTrainer in 2 Ray processes joined by accelerate (gloo), the global batch split
    over them. One metrics row per logged step (the main process writes), TRL's checkpoints, a final
    model that loads, moved from the base and with a falling loss."""
    cfg = _cfg(tmp_path, DIST)
    base = R.base_model(cfg)
    out = R.sft_stage(cfg, base, progress=False)
    rows = _rows(out.stage_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert (out.stage_dir / "trainer").exists() and json.loads((out.stage_dir / "stage.json").read_text())[
        "status"] == "done"
    assert _worst(_params(base), _params(out.model_dir)) > 1e-3
    where = json.loads((out.stage_dir / "stage.json").read_text())["distributed"]
    assert where["num_workers"] == 2 and [w["rank"] for w in where["workers"]] == [0, 1]
    assert where["num_processes"] == 2  # accelerate saw both
    # accelerate shards with FSDP on accelerators only; on CPU both run DDP (gloo), and the stage says so
    assert (where["distributed_type"], where["fsdp_version"]) == ("MULTI_CPU", None)
    assert "accelerate has no FSDP on CPU" in caplog.text
    assert len({w["pid"] for w in where["workers"]} - {os.getpid()}) == 2  # two training processes, not this one
