"""Weight hand-over across processes and into a model: host shared memory to a spawned process (the NPU path,
really shared), torch.distributed broadcast between 2 gloo processes, and the tiny Llama's weights through
every CPU transport — the receiving model computes the same logits."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
from datetime import timedelta
from pathlib import Path

import torch

from mopd_core.weights import (CollectiveTransport, InProcessTransport, SafetensorsTransport, SharedMemoryTransport,
                               pack_buckets)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def state_for_test() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(33, 17, generator=g)
    w[0, 0] = float("nan")
    return {"w": w, "w_t": torch.randn(9, 4, generator=g).t(), "bf": torch.randn(70, generator=g).bfloat16(),
            "half": torch.randn(5, 5, generator=g).half(), "mask": torch.rand(11, generator=g) > 0.5,
            "idx": torch.arange(-3, 12, dtype=torch.int64), "scalar": torch.tensor(1.25)}


def _join(procs, timeout=90):
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    return [p.exitcode for p in procs]


# ---------------------------------------------------------------- shared memory to another process

def _shm_receiver(message: dict, ref_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    ref = torch.load(ref_path)
    got = SharedMemoryTransport().receive(message)
    ok = {n: bool(torch.equal(bits(got.tensors[n]), bits(t))) for n, t in ref.items()}
    got.tensors["w"][1, 1] = 12345.0  # written through the mapping: the sender's process must see it
    Path(out_path).write_text(json.dumps({"ok": ok, "report": got.report.to_dict()}))


def test_shared_memory_hand_over_to_spawned_process(tmp_path):
    state = state_for_test()
    torch.save(state, tmp_path / "ref.pt")
    packed = pack_buckets(state, 1024)
    tr = SharedMemoryTransport(tmp_path / "shm")
    sent = tr.send(packed)
    mine = SharedMemoryTransport().receive(sent.message).tensors  # this process' own mapping of the segments
    assert mine["w"][1, 1].item() != 12345.0
    p = mp.get_context("spawn").Process(target=_shm_receiver,
                                        args=(sent.message, str(tmp_path / "ref.pt"), str(tmp_path / "out.json")))
    p.start()
    assert _join([p]) == [0]
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["ok"] == {n: True for n in state}
    assert res["report"]["bytes_copied"] == 0 and res["report"]["messages"] == len(packed) > 1
    assert mine["w"][1, 1].item() == 12345.0  # same memory, not a copy
    tr.release()


# ---------------------------------------------------------------- collective broadcast, 2 gloo processes

def _collective_worker(rank: int, port: int, ref_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        tr = CollectiveTransport(src=0)
        if rank == 0:
            ref = torch.load(ref_path)
            reports = [tr.send(pack_buckets(ref, 512)).report.to_dict(), tr.send(ref).report.to_dict()]
            Path(out_dir, "sender.json").write_text(json.dumps(reports))
        else:
            bucketed, per_tensor = tr.receive(), tr.receive()
            torch.save({"bucketed": bucketed.tensors, "per_tensor": per_tensor.tensors},
                       Path(out_dir, "received.pt"))
            Path(out_dir, "receiver.json").write_text(json.dumps([bucketed.report.to_dict(),
                                                                  per_tensor.report.to_dict()]))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_collective_broadcast_two_gloo_processes(tmp_path):
    state = state_for_test()
    torch.save(state, tmp_path / "ref.pt")
    ctx, port = mp.get_context("spawn"), _free_port()
    procs = [ctx.Process(target=_collective_worker, args=(r, port, str(tmp_path / "ref.pt"), str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    assert _join(procs) == [0, 0]
    got = torch.load(tmp_path / "received.pt")
    for kind in ("bucketed", "per_tensor"):
        assert set(got[kind]) == set(state)
        for n, t in state.items():
            r = got[kind][n]
            assert r.dtype == t.dtype and r.shape == t.shape and torch.equal(bits(r), bits(t)), (kind, n)
    send = json.loads((tmp_path / "sender.json").read_text())
    recv = json.loads((tmp_path / "receiver.json").read_text())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    n_buckets = len(pack_buckets(state, 512))
    assert [r["messages"] for r in send] == [1 + n_buckets, 1 + len(state)] == [r["messages"] for r in recv]
    assert all(r["bytes_copied"] == nbytes for r in send + recv)
    assert n_buckets < len(state)


# ---------------------------------------------------------------- the tiny model

def _tiny_pair(tmp_path):
    from mopd_core.config import ModelConfig, TinyModelConfig
    from mopd_core.models import build_tiny, build_tiny_model, build_tiny_tokenizer, load_model

    cfg = ModelConfig(tiny=TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128))
    src = load_model(build_tiny(cfg, tmp_path / "tiny", seed=0))
    tok = build_tiny_tokenizer()
    dst = build_tiny_model(cfg.tiny, len(tok), tok.pad_token_id, tok.eos_token_id, seed=1)
    ids = torch.randint(3, len(tok), (2, 12), generator=torch.Generator().manual_seed(0))
    return src.eval(), dst.eval(), ids


@torch.no_grad()
def test_tiny_model_weights_through_cpu_transports(tmp_path):
    src, dst, ids = _tiny_pair(tmp_path)
    want = src(ids).logits
    assert not torch.equal(dst(ids).logits, want)
    state = {n: p.detach() for n, p in src.state_dict().items()}

    def check(tensors):
        dst.load_state_dict(tensors)
        assert torch.equal(dst(ids).logits, want)
        for p in dst.parameters():
            p.data.normal_()  # scramble between transports so each one must really deliver

    # in-process: the receiver holds the trainer's own tensors (same storage); load_state_dict then copies
    # them into the rollout model's parameters (assign=True would share them instead)
    got = InProcessTransport().receive(InProcessTransport().send(state).message)
    assert got.report.bytes_copied == 0
    assert all(got.tensors[n].data_ptr() == t.data_ptr() for n, t in state.items())
    check(got.tensors)
    for tr in (SafetensorsTransport(tmp_path / "file"), SharedMemoryTransport(tmp_path / "shm")):
        for payload in (pack_buckets(state, 64 << 10), state):
            check(tr.receive(tr.send(payload).message).tensors)
        tr.release()
