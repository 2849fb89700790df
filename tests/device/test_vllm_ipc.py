"""CUDA-IPC hand-over to a vLLM engine on the same GPU: `VllmRollout(engine_process="separate")` runs vLLM's
engine core in its own process; `sync_weights` packs the trainer's weights bucket by bucket and hands each
bucket over as one CUDA IPC handle (`mopd_core.weights.CudaIpcTransport`): 0 bytes copied by the transport,
one handle and one `collective_rpc` per bucket, and the engine then samples from the new weights.

The model here is bfloat16 (the float32 path is `test_vllm_rollout.py`). Tolerance 5e-2 absolute per token:
bf16 keeps 8 mantissa bits (relative rounding 2^-9 ≈ 2e-3 per operation); HF (sdpa) and vLLM (flash attention,
fused qkv/gate-up) round at different points, so hidden states differ by a few 1e-3 relative after two layers;
both take log_softmax in float32 of bf16 logits, whose rounding alone is ~4e-3·|logit|. 5e-2 is ~10× that —
tight enough that loading the wrong weights (errors ≫ 0.1, checked below) fails it.
"""

from __future__ import annotations

import os

import pytest
import torch

from device_common import (Timer, build_vllm_tiny, examples, free_bytes, logp_errors, perturb, record, require,
                           require_vllm)

pytestmark = pytest.mark.device

TOL_BF16 = 5e-2
BUCKET = 256 << 10


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    require("cuda")
    require_vllm()
    from mopd_core.models import load_model, load_tokenizer
    from mopd_core.rollout.engines import VllmRollout

    path = build_vllm_tiny(tmp_path_factory.mktemp("ipc") / "tiny")
    dev = torch.device("cuda", 0)
    model = load_model(path, dev, "bfloat16").eval()
    tok = load_tokenizer(path)
    with Timer("cuda") as t:
        eng = VllmRollout(model, tok, dev, 32, max_model_len=64, dtype="bfloat16", seed=0,
                          gpu_memory_utilization=0.2, enable_sleep_mode=True, engine_process="separate",
                          transport="cuda_ipc", bucket_bytes=BUCKET)
    record("vllm_ipc/init", kind="cuda", seconds=t.s)
    yield model, tok, eng
    eng.close()


def _gen(eng, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return eng.generate(examples(32), max_new_tokens=16, temperature=1.0, generator=g)


def test_engine_runs_in_another_process(env):
    model, tok, eng = env
    pids = eng.llm.collective_rpc(lambda worker: os.getpid())
    assert pids and all(p != os.getpid() for p in pids)
    assert eng.transport == "cuda_ipc"


def test_bf16_logprobs_match_hf(env):
    model, tok, eng = env
    b = _gen(eng)
    mx, mean = logp_errors(model, b)
    record("vllm_ipc/logprobs_vs_hf", kind="cuda", dtype="bfloat16", max_abs_err=mx, mean_abs_err=mean,
           tokens=int(b.completion_mask.sum()))
    assert mx < TOL_BF16, (mx, mean)


def test_cuda_ipc_hand_over_to_the_engine(env):
    model, tok, eng = env
    old = _gen(eng, seed=1)
    perturb(model)
    stale, _ = logp_errors(model, old)
    assert stale > 4 * TOL_BF16  # the change is far outside the tolerance
    n_tensors = len(model.state_dict())
    with Timer("cuda") as t:
        rep = eng.sync_weights(model)
    new = _gen(eng, seed=1)
    mx, mean = logp_errors(model, new)
    record("vllm_ipc/sync_cuda_ipc", kind="cuda", seconds=t.s, bucket_bytes=BUCKET, **{k: rep[k] for k in (
        "transport", "tensors", "bytes_total", "bytes_copied", "bytes_packed", "messages", "rpc_calls",
        "load_method")}, max_abs_err_after=mx, mean_abs_err_after=mean)
    assert rep["transport"] == "cuda_ipc" and rep["bytes_copied"] == 0  # IPC: the engine maps our memory
    assert rep["bytes_packed"] == rep["bytes_total"]  # one device-side copy into the buckets
    assert 1 < rep["messages"] == rep["rpc_calls"] < rep["tensors"] == n_tensors  # one handle per bucket
    assert rep["load_method"] == "load_weights"
    assert not torch.equal(new.completion_ids, old.completion_ids)
    assert mx < TOL_BF16, (mx, mean)


def test_sleep_wake_across_processes(env):
    """The engine's memory lives in another process; `mem_get_info` sees the device-wide change."""
    model, tok, eng = env
    free0 = free_bytes("cuda")
    eng.sleep()
    free1 = free_bytes("cuda")
    eng.wake()
    free2 = free_bytes("cuda")
    record("vllm_ipc/sleep_wake", kind="cuda", freed_mb=(free1 - free0) / 2**20, rewoken_mb=(free1 - free2) / 2**20)
    assert free1 - free0 > 2**30 and free1 - free2 > 0.9 * (free1 - free0)
    b = _gen(eng, seed=2)
    mx, _ = logp_errors(model, b)
    assert mx < TOL_BF16
