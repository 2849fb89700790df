"""The Ray runtime (`mopd_core.distributed.cluster`) on real Ray and real gloo, no mocks: 2 data-parallel training
workers on CPU bundles update the tiny student exactly like a single process on the whole batch, hand their
weights to the rollout instances by collective broadcast, and those sample the same tokens as a single-process
run with the same weights and seed. The NPU placement path is exercised through Ray logical resources (no NPU
runtime). Bad input fails in one line, and teardown leaves no actor and no placement group behind."""

from __future__ import annotations

import random
import shutil
import tempfile
import time

import pytest
import torch

from mopd_core.distributed.cluster import ClusterError, ClusterSpec, WorkerGroup, init_ray

ray = pytest.importorskip("ray")

SEED = 1234
PROMPTS = ["12+34=", "sort:31425=", "rev:abcde=", "upper:abcd=", "7-5=", "rep3:ab=", "55+11=", "sort:4213="]


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray for the module: 2 CPUs and 2 logical NPUs; a short temp dir (socket paths ≤ 107 bytes)."""
    tmp = tempfile.mkdtemp(prefix="mopd-ray-", dir="/tmp")
    init_ray(num_cpus=2, resources={"NPU": 2}, tmp_dir=tmp)
    yield ray.cluster_resources()
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """The tiny student (64 wide, 2 layers), built once for the module."""
    from mopd_core.config import ModelConfig, TinyModelConfig
    from mopd_core.models import build_tiny

    cfg = ModelConfig(tiny=TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128))
    return str(build_tiny(cfg, tmp_path_factory.mktemp("cluster") / "tiny", seed=0))


def _loop_cfg():
    """Loop settings shared by the workers and the single-process reference."""
    from mopd_core.config import PolicyLoopConfig

    # micro-batches of 2 rows: each rank runs 2 backward passes per step, gradients accumulate across them
    return PolicyLoopConfig(lr=1e-3, micro_batch_size=2, grad_clip=1.0, clip_low=0.2, clip_high=0.2)


def _fixed_batch(path):
    """8 sampled rows from the initial student + fixed GRPO advantages (groups of 2)."""
    from mopd_core.algorithms import grpo_advantages
    from mopd_core.models import load_model, load_tokenizer
    from mopd_core.rollout import HFRollout
    from mopd_core.distributed.cluster import Prompt

    model, tok = load_model(path), load_tokenizer(path)
    batch = HFRollout(model, tok, "cpu").generate([Prompt(p) for p in PROMPTS], max_new_tokens=6,
                                                  generator=torch.Generator().manual_seed(7))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0, 1.0])
    return batch, grpo_advantages(rewards, 2)


def _reference_update(path, batch, adv, steps):
    """The same update in one process on the whole batch (the loop's own `policy_update`)."""
    from mopd_core.models import load_model
    from mopd_core.train.loop import lr_lambda, policy_update

    cfg = _loop_cfg()
    model = load_model(path).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    mask = batch.completion_mask.float()
    mets = [policy_update(model, opt, sched, batch, adv[:, None] * mask, mask, None, None, cfg, 1.0, random.Random(0))
            for _ in range(steps)]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, mets


def _reference_samples(path, state, prompts, seed):
    """Single-process HFRollout samples of `prompts` with weights `state` and generator seed `seed`."""
    from mopd_core.models import load_model, load_tokenizer
    from mopd_core.rollout import HFRollout
    from mopd_core.distributed.cluster import Prompt

    model, tok = load_model(path), load_tokenizer(path)
    model.load_state_dict(state)
    return HFRollout(model, tok, "cpu").generate([Prompt(p) for p in prompts], max_new_tokens=8,
                                                 generator=torch.Generator().manual_seed(seed))


def _assert_torn_down(group: WorkerGroup, n_actors: int, pg_id: str):
    """No actor of the group alive, its placement group removed, every resource free again."""
    from ray.util.placement_group import placement_group_table

    names = {group.actor_name(r, i) for r in ("train", "rollout") for i in range(n_actors)}
    deadline = time.monotonic() + 15
    while True:
        alive = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)} & names
        free = ray.available_resources()
        total = ray.cluster_resources()
        if not alive and all(free.get(r, 0) == total[r] for r in ("CPU", "NPU")):
            break
        assert time.monotonic() < deadline, f"left over after stop(): actors {alive}, resources {free}"
        time.sleep(0.2)
    assert placement_group_table()[pg_id]["state"] == "REMOVED"


def test_ddp_training_then_collective_hand_over_samples_like_single_process(ray_cluster, tiny_path):
    """Acceptance: 2 gloo ranks train data-parallel, hand weights over by broadcast, sample like one process."""
    t_start = time.perf_counter()
    batch, adv = _fixed_batch(tiny_path)
    init, _ = _reference_update(tiny_path, batch, adv, steps=0)
    want, want_mets = _reference_update(tiny_path, batch, adv, steps=2)
    spec = ClusterSpec(num_workers=2, kind="cpu", bucket_bytes=64 * 1024, num_threads=1, dist_timeout_s=120)
    group = WorkerGroup(spec, tiny_path, loop_cfg=_loop_cfg())
    t0 = time.perf_counter()
    with group:
        t_up = time.perf_counter() - t0
        pg_id = group.pg.id.hex()
        info = group.worker_info
        assert [w["rank"] for w in info] == [0, 1, 2, 3]
        assert {w["backend"] for w in info} == {"gloo"} and {w["torch_threads"] for w in info} == {1}
        assert info[2]["node_id"] == info[0]["node_id"]

        steps = [group.train_step(batch, adv, seed=SEED) for _ in range(2)]
        got = group.state_dict(0)
        # (a) the weights moved
        assert max((got[k] - init[k]).abs().max().item() for k in init) > 1e-4
        # (b) both ranks hold bit-identical weights
        d = group.digests()
        assert d["train"][0] == d["train"][1]
        # (c) DDP over 2 ranks == one process on the whole batch (float32; only summation order differs)
        worst = max((got[k] - want[k]).abs().max().item() for k in want)
        assert worst < 1e-5, worst
        for got_m, ref_m in zip(steps, want_mets):  # global metrics from per-rank ones
            for k in ("loss", "grad_norm", "entropy", "clip_frac", "approx_kl"):
                assert got_m[k] == pytest.approx(ref_m[k], rel=1e-4, abs=1e-6), k
        assert want_mets[1]["approx_kl"] > 0  # the 2nd step is off-policy: the ratio really moved
        assert all(s["allreduce_bytes"] > 0 and s["tokens"] == int(batch.completion_mask.sum()) for s in steps)

        # (e) the collective hand-over: bytes on the wire, one broadcast per bucket (+1 for the layouts)
        from mopd_core.weights import plan_buckets

        sync = group.sync_weights()
        n_buckets = len(plan_buckets([(k, tuple(v.shape), v.dtype, "cpu") for k, v in got.items()], 64 * 1024))
        nbytes = sum(v.numel() * v.element_size() for v in got.values())
        assert sync["transport"] == "collective" and sync["buckets"] == n_buckets > 1
        assert sync["messages"] == n_buckets + 1  # broadcast_object_list(layouts) + one broadcast per bucket
        assert sync["bytes_total"] == nbytes and sync["bytes_sent"] == nbytes
        assert sync["bytes_received"] == 2 * nbytes  # two rollout instances, each received every byte
        assert all(r["messages"] == n_buckets + 1 for r in sync["receive"])
        assert sync["digests"] == [d["train"][0]] * 2 == group.digests()["rollout"]

        # (d) next samples on the rollout instances == single process with the same weights and seed
        one, rep = group.generate(PROMPTS, seed=SEED, max_new_tokens=8, instance=1)
        ref = _reference_samples(tiny_path, got, PROMPTS, SEED)
        assert torch.equal(one.completion_ids, ref.completion_ids)
        assert torch.equal(one.completion_mask, ref.completion_mask)
        assert torch.allclose(one.behaviour_logp, ref.behaviour_logp, atol=1e-6)
        assert rep["tokens"] == int(ref.completion_mask.sum()) > 0 and rep["bytes"] > 0
        # sharded over both instances: chunk i (4 prompts) seeded SEED + i
        both, rep2 = group.generate(PROMPTS, seed=SEED, max_new_tokens=8)
        assert rep2["instances"] == 2
        for i in range(2):
            r = _reference_samples(tiny_path, got, PROMPTS[4 * i:4 * i + 4], SEED + i)
            T = r.completion_ids.shape[1]
            assert torch.equal(both.completion_ids[4 * i:4 * i + 4, :T], r.completion_ids)
            assert not both.completion_mask[4 * i:4 * i + 4, T:].any()
    # (g) teardown leaves nothing behind
    _assert_torn_down(group, 2, pg_id)
    wall = time.perf_counter() - t_start
    print(f"\ncluster: test wall {wall:.1f}s, group start {t_up:.1f}s, train steps "
          f"{[round(s['seconds'], 3) for s in steps]}s (all-reduce {steps[0]['allreduce_bytes']} B/step/rank), "
          f"sync {sync['seconds']:.3f}s: {nbytes} B in {n_buckets} buckets to 2 instances, "
          f"max |ddp - single| {worst:.2e}")


def test_npu_placement_through_ray_logical_resources_without_npu_runtime(ray_cluster, tiny_path):
    """kind=npu on logical {"NPU": 2}: NPU bundles, Ray's ASCEND_RT_VISIBLE_DEVICES per worker, a tp=2 group
    as one rollout instance on bundle 0 — while the workers compute on CPU with gloo (no torch_npu)."""
    spec = ClusterSpec(num_workers=2, kind="npu", device="cpu", tp=2, transport="shared_memory",
                       bucket_bytes=128 * 1024, dist_timeout_s=120)
    group = WorkerGroup(spec, tiny_path, loop_cfg=_loop_cfg())
    with group:
        pg_id = group.pg.id.hex()
        from ray.util.placement_group import placement_group_table

        assert list(placement_group_table()[pg_id]["bundles"].values()) == [{"NPU": 1.0}, {"NPU": 1.0}]
        t0, t1, r0 = group.worker_info
        assert len(group.rollouts) == 1 and r0["rank"] == 2
        assert t0["accelerator_ids"] != t1["accelerator_ids"]  # one NPU each
        assert r0["accelerator_ids"] == t0["accelerator_ids"]  # rollout instance colocated on bundle 0
        for w in (t0, t1, r0):
            assert w["visible_devices"] == {"ASCEND_RT_VISIBLE_DEVICES": ",".join(w["accelerator_ids"])}
            assert w["device"] == "cpu" and w["backend"] == "gloo"
        # while this group holds both NPUs, another one cannot get any: a clear error after pg_timeout_s
        t = time.perf_counter()
        with pytest.raises(ClusterError, match=r"not ready after 1s.*NPU"):
            WorkerGroup(ClusterSpec(num_workers=1, kind="npu", device="cpu", pg_timeout_s=1), tiny_path).start()
        assert time.perf_counter() - t < 10
        # the message-based (NPU) hand-over: the trainer on the instance's bundle sends through /dev/shm
        sync = group.sync_weights()
        assert sync["transport"] == "shared_memory" and sync["bytes_sent"] == sync["bytes_total"] > 0
        assert sync["messages"] == sync["buckets"] > 1 and sync["bytes_received"] == 0  # mapped, not copied
        assert sync["digests"] == group.digests()["train"][:1]
    _assert_torn_down(group, 2, pg_id)


def test_bad_input_is_one_clear_line_and_leaves_nothing(ray_cluster, tiny_path):
    """More workers than devices, unknown kind, bad tp/device/transport/path: one line each, nothing started."""
    t = time.perf_counter()
    with pytest.raises(ClusterError, match=r"cluster.num_workers=3 needs 3 NPU .* has 2 .*resources"):
        WorkerGroup(ClusterSpec(num_workers=3, kind="npu", device="cpu"), tiny_path).start()
    assert time.perf_counter() - t < 5
    with pytest.raises(ClusterError, match=r"cluster.num_workers=3 needs 3 CPU .* has 2 .*num_cpus"):
        WorkerGroup(ClusterSpec(num_workers=3, kind="cpu"), tiny_path).start()
    with pytest.raises(ClusterError, match=r"cluster.kind='tpu' is not one of cpu, cuda, npu") as e:
        ClusterSpec(kind="tpu").validate()
    assert "\n" not in str(e.value)
    with pytest.raises(ClusterError, match=r"cluster.tp=3 must .* divide cluster.num_workers=2"):
        ClusterSpec(num_workers=2, tp=3).validate()
    with pytest.raises(ClusterError, match=r"cluster.device=cuda needs GPU bundles; set cluster.kind=cuda"):
        ClusterSpec(kind="cpu", device="cuda").validate()
    with pytest.raises(ClusterError, match=r"transport=collective .* same cuda device.*cuda_ipc"):
        ClusterSpec(kind="cuda", transport="collective").validate()
    from mopd_core.config import PolicyLoopConfig

    with pytest.raises(ClusterError, match=r"kd_loss=jsd: train_step needs the teachers' scores with top-k"):
        WorkerGroup(ClusterSpec(), tiny_path, loop_cfg=PolicyLoopConfig(kd_loss="jsd", w_kd=1.0)).train_step(
            None, torch.zeros(2))
    with pytest.raises(ClusterError, match=r"model_path .*\(no config\.json\)"):
        WorkerGroup(ClusterSpec(), tiny_path + "-missing")
    assert not ray.util.list_named_actors(all_namespaces=True)
    assert ray.available_resources().get("NPU") == 2 and ray.available_resources().get("CPU") == 2


def test_importing_mopd_core_does_not_import_ray():
    """Ray is imported lazily inside functions; prefect never."""
    import subprocess
    import sys

    code = ("import sys, mopd_core, mopd_core.distributed.cluster, mopd_core.weights, mopd_core.rollout; "
            "assert 'ray' not in sys.modules and 'prefect' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_a_worker_failing_at_start_tears_the_group_down(ray_cluster, tmp_path):
    """Workers die in their constructor (a checkpoint whose config.json is not a model config): start() raises
    the worker's error and leaves no actor or placement group behind."""
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    group = WorkerGroup(ClusterSpec(num_workers=1, kind="npu", device="cpu"), str(bad))
    with pytest.raises(Exception, match="cannot load model"):
        group.start()
    assert group.pg is None and not group.actors
    deadline = time.monotonic() + 15
    while ray.util.list_named_actors(all_namespaces=True) or ray.available_resources().get("NPU") != 2:
        assert time.monotonic() < deadline, "actors or NPU bundles left after a failed start"
        time.sleep(0.2)
