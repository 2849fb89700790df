"""The device layer (`mopd_core.runtime.device`) on the accelerator that is present — the CUDA path, or the NPU
path for real (`torch_npu`, `hccl`, `ASCEND_RT_VISIBLE_DEVICES`, `torch.npu.*` memory). On CPU machines the NPU
path is checked at its boundary with a fake torch_npu (`tests/unit/test_npu_guard.py`, "npu boundary")."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from device_common import record, require

pytestmark = pytest.mark.device
ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dist_backend_one_rank_group():
    kind = require()
    import torch.distributed as dist

    from mopd_core.runtime import device as D

    backend = D.dist_backend(kind)
    assert backend == {"cuda": "nccl", "npu": "hccl"}[kind]
    dev = torch.device(kind, 0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_port()}", world_size=1, rank=0)
    try:
        x = torch.ones(4, device=dev)
        dist.all_reduce(x)
        assert x.tolist() == [1.0] * 4
    finally:
        dist.destroy_process_group()


def test_memory_stats_follow_allocations():
    kind = require()
    from mopd_core.runtime import device as D

    dev = torch.device(kind, 0)
    D.empty_cache(kind)
    D.reset_peak_memory_stats(kind)
    a0 = D.memory_stats(kind)["mem/device_allocated_mb"]
    free0 = D.mem_get_info(kind)[0]
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    D.synchronize(kind)
    st = D.memory_stats(kind)
    free1 = D.mem_get_info(kind)[0]
    assert st["mem/device_allocated_mb"] - a0 >= 255 and st["mem/device_peak_mb"] >= st["mem/device_allocated_mb"]
    assert st["mem/device_reserved_mb"] >= st["mem/device_allocated_mb"]
    assert free0 - free1 >= 200 * 2**20
    del x
    D.empty_cache(kind)
    D.reset_peak_memory_stats(kind)
    after = D.memory_stats(kind)
    assert after["mem/device_peak_mb"] < st["mem/device_peak_mb"] - 200
    record("device_layer/memory", kind=kind, allocated_mb=st["mem/device_allocated_mb"] - a0,
           free_drop_mb=(free0 - free1) / 2**20)


def test_visible_devices_env_restricts_a_child():
    kind = require()
    from mopd_core.runtime import device as D

    env = dict(os.environ, **D.set_visible_devices(kind, [0]))
    assert D.visible_devices_env(kind) in env
    probe = ("import mopd_core.runtime.device as D, torch; i = D.resolve('auto'); "
             "print(i.kind, D.device_module(i.kind).device_count())")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == [kind, "1"]


def _shm_receiver(message, kind: str, ref_path: str, out_path: str) -> None:
    from mopd_core.weights import SharedMemoryTransport

    ref = torch.load(ref_path)
    got = SharedMemoryTransport().receive(message, device=f"{kind}:0")
    ok = {n: bool(torch.equal(got.tensors[n].cpu(), t)) for n, t in ref.items()}
    on_dev = all(t.device.type == kind for t in got.tensors.values())
    Path(out_path).write_text(json.dumps({"ok": ok, "on_device": on_dev, "report": got.report.to_dict()}))


def test_handover_transport_by_device(tmp_path):
    """cuda → CUDA IPC (test_cuda_ipc.py); npu has no device IPC → host shared memory onto the NPU in another
    process, bit-exact — the path `VllmRollout(engine_process="separate")` takes on Ascend."""
    kind = require()
    from mopd_core.runtime import device as D
    from mopd_core.weights import SharedMemoryTransport, pack_buckets

    assert D.ipc_supported(kind) == (kind == "cuda")
    assert D.handover_transport(kind, same_process=False) == ("cuda_ipc" if kind == "cuda" else "shared_memory")
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(64, 32, generator=g) for i in range(8)}
    state["bf"] = torch.randn(100, generator=g).bfloat16()
    torch.save(state, tmp_path / "ref.pt")
    packed = pack_buckets({n: t.to(f"{kind}:0") for n, t in state.items()}, 8 << 10)
    tr = SharedMemoryTransport(directory=tmp_path / "shm")
    sent = tr.send(packed)
    p = mp.get_context("spawn").Process(target=_shm_receiver, args=(sent.message, kind, str(tmp_path / "ref.pt"),
                                                                      str(tmp_path / "out.json")))
    p.start()
    p.join(300)
    tr.release()
    assert p.exitcode == 0
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["ok"] == {n: True for n in state} and res["on_device"]
    assert res["report"]["bytes_copied"] == packed.nbytes  # host segment → device, once
    record("device_layer/shm_handover", kind=kind, bytes=packed.nbytes, buckets=len(packed),
           send_s=sent.report.seconds, receive_s=res["report"]["seconds"])
