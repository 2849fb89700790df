"""Helpers shared by the device checks (imported as `device_common`; pytest puts this folder on sys.path)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

PROMPTS = ["12+34=", "rev:abcde=", "sort:31425=", "upper:abcd=", "7-3=", "rep3:ab=", "99+1=", "rev:xy="]


def accelerator() -> str | None:
    from mopd_core.runtime.device import cuda_available, npu_available

    if cuda_available():
        return "cuda"
    if npu_available():
        return "npu"
    return None


def require(kind: str | None = None) -> str:
    """Skip unless an accelerator (of `kind`, when given) is present; returns its kind."""
    acc = accelerator()
    if acc is None:
        pytest.skip("needs a CUDA/NPU accelerator")
    if kind is not None and acc != kind:
        pytest.skip(f"needs {kind}, this machine has {acc}")
    return acc


def require_vllm() -> None:
    from mopd_core.rollout.engines import vllm_importable

    if not vllm_importable():
        pytest.skip("vllm is not installed (pip install -e .[vllm] on CUDA, .[npu] on Ascend)")


def build_vllm_tiny(out: Path, seed: int = 0) -> Path:
    """The tiny model in a shape vLLM serves on GPU/NPU: head_dim 64, 2 layers, ~0.3 M parameters."""
    from mopd_core.config import ModelConfig
    from mopd_core.models import build_tiny

    cfg = ModelConfig(tiny={"hidden_size": 128, "num_layers": 2, "num_heads": 2, "intermediate_size": 256,
                            "max_position_embeddings": 128})
    return build_tiny(cfg, out, seed=seed)


def examples(n: int, teacher_id: str = "math") -> list:
    return [SimpleNamespace(prompt=PROMPTS[i % len(PROMPTS)], teacher_id=teacher_id) for i in range(n)]


@torch.no_grad()
def logp_errors(model, batch) -> tuple[float, float]:
    """(max, mean) |engine behaviour log-prob − `completion_logprobs(model)`| over the sampled tokens."""
    from mopd_core.rollout import completion_logprobs

    was = model.training
    model.eval()
    ref = completion_logprobs(model, batch)
    model.train(was)
    m = batch.completion_mask.bool()
    d = (ref.float() - batch.behaviour_logp.float())[m].abs()
    return float(d.max()), float(d.mean())


@torch.no_grad()
def perturb(model, scale: float = 0.5, seed: int = 7) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
        p.add_(scale * noise * p.float().abs().mean().to(p.dtype))


def free_bytes(kind: str) -> int:
    from mopd_core.runtime.device import mem_get_info, synchronize

    synchronize(kind)
    return mem_get_info(kind)[0]


def record(check: str, **data) -> None:
    """Append one measurement to `$MOPD_DEVICE_RESULTS` (JSON lines; `run_all.sh` collects them)."""
    path = os.environ.get("MOPD_DEVICE_RESULTS")
    if not path:
        return
    row = {"check": check, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **data}
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


class Timer:
    def __init__(self, kind: str | None = None):
        self.kind = kind

    def __enter__(self):
        from mopd_core.runtime.device import synchronize

        if self.kind:
            synchronize(self.kind)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        from mopd_core.runtime.device import synchronize

        if self.kind:
            synchronize(self.kind)
        self.s = time.perf_counter() - self.t0
