"""CUDA IPC weight hand-over on a real GPU: the receiver is another process that maps the
sender's device buffers through one handle per bucket — the exact bits arrive, 0 bytes are copied, and a write
by the receiver is seen by the sender (same device memory)."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from mopd_core.weights import CudaIpcTransport, pack_buckets

pytestmark = pytest.mark.device


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def _state(device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    s = {f"layers.{i}.w": torch.randn(64, 32, generator=g) for i in range(40)}
    s.update({"bf": torch.randn(1000, generator=g).bfloat16(), "mask": torch.rand(33, generator=g) > 0.5,
              "idx": torch.arange(7, dtype=torch.int64), "w_t": torch.randn(16, 8, generator=g).t()})
    return {n: t.to(device) for n, t in s.items()}


def _receiver(message, ref_path: str, out_path: str) -> None:
    ref = torch.load(ref_path)
    got = CudaIpcTransport().receive(message)
    ok = {n: bool(torch.equal(_bits(got.tensors[n]), _bits(t))) for n, t in ref.items()}
    on_gpu = all(t.is_cuda for t in got.tensors.values())
    got.tensors["layers.0.w"][0, 0] = 4242.0  # written into the sender's memory
    torch.cuda.synchronize()
    Path(out_path).write_text(json.dumps({"ok": ok, "on_gpu": on_gpu, "report": got.report.to_dict()}))


def test_cuda_ipc_hand_over_to_another_process(tmp_path, accelerator):
    if accelerator != "cuda":
        pytest.skip("CUDA IPC needs a CUDA GPU")
    state = _state("cuda")
    torch.save({n: t.cpu() for n, t in state.items()}, tmp_path / "ref.pt")
    packed = pack_buckets(state, 64 << 10)
    tr = CudaIpcTransport()
    sent = tr.send(packed)
    assert sent.report.bytes_copied == 0 and sent.report.messages == len(packed) < len(state)
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_receiver, args=(sent.message, str(tmp_path / "ref.pt"), str(tmp_path / "out.json")))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["ok"] == {n: True for n in state} and res["on_gpu"]
    assert res["report"]["bytes_copied"] == 0 and res["report"]["messages"] == len(packed)
    torch.cuda.synchronize()
    assert packed.get("layers.0.w")[0, 0].item() == 4242.0  # the same device memory, not a copy
    tr.release()
