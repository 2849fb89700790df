"""The sharded update on a real accelerator (nccl on CUDA, hccl on NPU): `distributed.cluster.fully_shard_model`
(torch FSDP2) over a one-rank process group of this device — the loop's own `policy_update` with chunked
log-probs equals the unsharded update within float32 rounding; in bfloat16 (`MixedPrecisionPolicy`) the master
shards stay float32 and the loss stays close; the optimizer shards go through `torch.distributed.checkpoint`
and back; peak device memory of both precisions is recorded. Ray is not needed (the lent image has none). The
CPU equivalents, with 2 gloo ranks on Ray: `tests/integration/test_distributed.py`."""

from __future__ import annotations

import gc
import os
import random
import socket

import pytest
import torch

from device_common import build_vllm_tiny, examples, record, require

pytestmark = pytest.mark.device


@pytest.fixture(scope="module")
def world():
    """A one-rank process group on the accelerator's backend."""
    import torch.distributed as dist

    from mopd_core.runtime import device as devlib

    kind = require()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = devlib.resolve(kind)
    dist.init_process_group(dev.dist_backend, rank=0, world_size=1,
                            device_id=dev.torch_device if kind != "cpu" else None)
    yield dev
    dist.destroy_process_group()


def _batch(path, dev):
    from mopd_core.models import load_model, load_tokenizer
    from mopd_core.rollout import HFRollout

    model, tok = load_model(path, dev), load_tokenizer(path)
    batch = HFRollout(model, tok, dev).generate(examples(16), max_new_tokens=8,
                                                generator=torch.Generator(device=dev).manual_seed(0))
    return batch


def _update(path, info, batch, shard: bool, dtype: str = "float32", cpu_offload: bool = False):
    import torch.distributed as dist

    from mopd_core.algorithms import grpo_advantages
    from mopd_core.config import PolicyLoopConfig
    from mopd_core.distributed.cluster import fully_shard_model
    from mopd_core.models import load_model
    from mopd_core.runtime import device as devlib
    try:  # the loop's update, wherever the roles split puts it
        from mopd_core.train.update import policy_update
    except ImportError:
        from mopd_core.train.loop import policy_update

    dev = info.torch_device
    model = load_model(path, dev, "float32").train()
    if shard:
        fully_shard_model(model, dist.group.WORLD, info.kind, dtype, cpu_offload=cpu_offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _s: 1.0)  # no warm-up
    mask = batch.completion_mask.float()
    adv = grpo_advantages(torch.tensor([1.0, 0.0] * 8, device=dev), 2)[:, None] * mask
    devlib.synchronize(info.kind)
    devlib.reset_peak_memory_stats(info.kind)
    amp = devlib.autocast(info.kind, "float32" if shard else dtype)
    with amp:
        met = policy_update(model, opt, sched, batch, adv, mask, None, None, PolicyLoopConfig(micro_batch_size=8),
                            1.0, random.Random(0))
    devlib.synchronize(info.kind)
    met["peak_mb"] = devlib.memory_stats(info.kind).get("mem/device_peak_mb", 0.0)
    return model, opt, met


def _full(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def test_fsdp2_update_equals_the_unsharded_one_and_bf16_keeps_fp32_masters(world, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    path = build_vllm_tiny(tmp_path / "tiny")
    batch = _batch(path, world.torch_device)
    dev = world
    ref, _, m_ref = _update(path, dev, batch, shard=False)
    got, opt, m_got = _update(path, dev, batch, shard=True)
    want = {k: v.detach().cpu() for k, v in ref.state_dict().items()}
    full = _full(got)
    worst = max((full[k] - want[k]).abs().max().item() for k in want)
    assert m_ref["grad_norm"] > 0 and worst < 1e-5
    assert m_got["loss"] == pytest.approx(m_ref["loss"], rel=1e-4, abs=1e-6)

    # optimizer shards through torch.distributed.checkpoint and back into a fresh sharded model
    dcp.save({"optimizer": get_optimizer_state_dict(got, opt)}, checkpoint_id=str(tmp_path / "optim"))
    again, opt2, _ = _update(path, dev, batch, shard=True)
    state = {"optimizer": get_optimizer_state_dict(again, opt2)}
    dcp.load(state, checkpoint_id=str(tmp_path / "optim"))
    set_optimizer_state_dict(again, opt2, optim_state_dict=state["optimizer"])
    a = get_optimizer_state_dict(got, opt)["state"]
    b = get_optimizer_state_dict(again, opt2)["state"]
    assert all(torch.equal(a[k]["exp_avg"].to_local(), b[k]["exp_avg"].to_local()) for k in a)

    bf, _, m_bf = _update(path, dev, batch, shard=True, dtype="bfloat16")
    assert {p.to_local().dtype for p in bf.parameters()} == {torch.float32}  # master shards
    assert m_bf["loss"] == pytest.approx(m_ref["loss"], rel=0.1, abs=1e-3)
    amp_ref, _, m_amp = _update(path, dev, batch, shard=False, dtype="bfloat16")
    # train.fsdp_cpu_offload: the shards and AdamW state on the host, the same update (its memory is measured where
    # the optimizer state dominates: the next test; at this shape the offload's own buffers outweigh the state)
    off, _, m_off = _update(path, dev, batch, shard=True, cpu_offload=True)
    assert {p.to_local().device.type for p in off.parameters()} == {"cpu"}
    full_off = _full(off)
    assert max((full_off[k] - want[k]).abs().max().item() for k in want) < 1e-5
    record("fsdp2_update", device=world.kind, max_abs_fsdp2_vs_unsharded=worst, loss_fp32=m_ref["loss"],
           loss_fsdp2_bf16=m_bf["loss"], loss_autocast_bf16=m_amp["loss"], peak_mb_unsharded_fp32=m_ref["peak_mb"],
           peak_mb_fsdp2_fp32=m_got["peak_mb"], peak_mb_fsdp2_bf16=m_bf["peak_mb"],
           peak_mb_autocast_bf16=m_amp["peak_mb"], peak_mb_fsdp2_cpu_offload=m_off["peak_mb"])


def test_fsdp2_cpu_offload_holds_less_device_memory_where_the_optimizer_state_dominates(world, tmp_path):
    """A model wide enough (1024 hidden, 4 layers, 4096 MLP: ~67 M parameters, ~1 GiB of float32 weights,
    gradients and AdamW state) against a few hundred tokens of activations: on the device, FSDP2 holds all of that
    state; with `train.fsdp_cpu_offload` only one gathered unit at a time (`runtime.phases.fsdp_gathered_bytes`).
    Offloading must at least halve the peak, and change the update by no more than float32 rounding."""
    from mopd_core.config import ModelConfig
    from mopd_core.models import build_tiny, inspect_checkpoint, model_shape
    from mopd_core.runtime import device as devlib
    from mopd_core.runtime.phases import fsdp_gathered_bytes

    cfg = ModelConfig(tiny={"hidden_size": 1024, "num_layers": 4, "num_heads": 16, "intermediate_size": 4096,
                            "max_position_embeddings": 128})
    path = build_tiny(cfg, tmp_path / "wide")
    batch = _batch(path, world.torch_device)
    on, opt_on, m_on = _update(path, world, batch, shard=True)
    want = {k: v.detach().cpu() for k, v in _full(on).items()}
    n = sum(p.numel() for p in on.parameters())
    del on, opt_on  # its device state must not count in the offloaded run's peak:
    gc.collect()  # FSDP2's hooks hold the module in reference cycles that `del` alone does not free
    devlib.empty_cache(world.kind)
    left_mb = devlib.memory_stats(world.kind).get("mem/device_allocated_mb", 0.0)
    off, _, m_off = _update(path, world, batch, shard=True, cpu_offload=True)
    worst = max((v - want[k]).abs().max().item() for k, v in _full(off).items())
    state_mb = n * 4 * 4 / 2**20  # weights + gradients + two AdamW moments, float32
    gathered_mb = fsdp_gathered_bytes(n, model_shape(inspect_checkpoint(path).config), 4) / 2**20
    record("fsdp2_cpu_offload_memory", device=world.kind, params=n, state_mb=state_mb, gathered_unit_mb=gathered_mb,
           peak_mb_on_device=m_on["peak_mb"], peak_mb_cpu_offload=m_off["peak_mb"], max_abs_diff=worst,
           allocated_mb_before_offload_run=left_mb)
    assert m_on["peak_mb"] > 0.9 * state_mb  # the state really is what the on-device run holds
    assert m_off["peak_mb"] < 0.5 * m_on["peak_mb"], (m_off["peak_mb"], m_on["peak_mb"], left_mb)
    assert worst < 1e-5
