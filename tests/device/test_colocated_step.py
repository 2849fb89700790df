"""A short colocated MOPD step on one accelerator: trainer, in-process vLLM rollout engine and a local teacher
take turns on the same device.

1. `test_colocated_mopd_step_with_vllm`: the step written out — wake + hand-over → generate → sleep → the
   teacher loads, scores, offloads → advantages (sampled-token reverse KL) → PPO update → next hand-over. Checks
   that the engine is on-policy (ratio ρ = 1 at the start of the update: its behaviour log-probs are the
   trainer's), that the update changed the policy, and that after the next hand-over the engine samples from the
   updated weights.
   Device memory is recorded at every phase.
2. `test_mopd_stage_colocated[hf|vllm]`: the real MOPD stage (`recipe.mopd_stage`, 2 steps) on the device with
   `runtime.placement=colocated`; the vllm case runs once the loop builds its engine with
   `rollout.engines.build_rollout` (skipped, naming why, before that).
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from device_common import (Timer, build_vllm_tiny, examples, free_bytes, logp_errors, perturb, record, require,
                           require_vllm)

pytestmark = pytest.mark.device

TOL = 1e-3


def _mem(kind: str) -> dict:
    from mopd_core.runtime.device import memory_stats

    st = memory_stats(kind)
    return {"allocated_mb": round(st.get("mem/device_allocated_mb", 0.0), 2), "free_mb": free_bytes(kind) / 2**20}


def test_colocated_mopd_step_with_vllm(tmp_path):
    kind = require()
    require_vllm()
    from mopd_core import algorithms as alg
    from mopd_core.config import TeachersConfig
    from mopd_core.models import load_model, load_tokenizer, save_pretrained
    from mopd_core.rollout import completion_logprobs
    from mopd_core.rollout.engines import VllmRollout
    from mopd_core.runtime.device import HostMirror, empty_cache
    from mopd_core.teachers import build_local_router

    dev = torch.device(kind, 0)
    path = build_vllm_tiny(tmp_path / "student")
    teacher = load_model(path)
    perturb(teacher, scale=0.3, seed=3)
    tpath = save_pretrained(teacher, load_tokenizer(path), tmp_path / "teacher")
    del teacher
    model = load_model(path, dev, "float32")
    model.train()
    tok = load_tokenizer(path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mirror = HostMirror(kind, dev)  # the loop's offload: reused page-locked host buffers
    router = build_local_router({"math": tpath}, TeachersConfig(offload=True), dev)
    phases: list[dict] = []

    def mark(phase):
        phases.append({"phase": phase, **_mem(kind)})

    eng = VllmRollout(model, tok, dev, 32, max_model_len=64, dtype="float32", gpu_memory_utilization=0.2,
                      enable_sleep_mode=True)
    try:
        mark("start")
        eng.sleep()
        mark("engine asleep")
        for step in range(2):
            with Timer(kind) as t_roll:  # rollout: wake the weights, hand over, wake the KV cache, sample, sleep
                eng.wake(["weights"])
                rep = eng.sync_weights(model)
                eng.wake(["kv_cache"])
                g = torch.Generator(device=dev).manual_seed(step)
                batch = eng.generate(examples(32), max_new_tokens=12, generator=g)
                mark(f"step{step}/rollout")
                eng.sleep()
            mark(f"step{step}/engine asleep")
            with Timer(kind) as t_score:
                routed = router.score(batch)
            mark(f"step{step}/scored")
            mask = batch.completion_mask.float()
            adv = alg.reverse_kl_advantages(routed.logp, batch.behaviour_logp, mask, clip=5.0)
            with Timer(kind) as t_train:
                mirror.restore(opt)  # the optimizer state comes back for the update only
                logp = completion_logprobs(model, batch)
                loss, m = alg.policy_loss(logp, batch.behaviour_logp, adv, mask)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                mark(f"step{step}/updated")
                opt.zero_grad(set_to_none=True)
                mirror.offload(opt)  # give the memory back to the engine for the next rollout
                empty_cache(kind)
            mark(f"step{step}/optimizer offloaded")
            # on-policy: the engine's behaviour log-probs are the trainer's own (ρ = 1 at the start)
            assert abs(m["ratio_mean"] - 1) < TOL and m["ratio_max"] < 1 + 5 * TOL, m
            record("colocated_step/step", kind=kind, step=step, loss=float(loss), ratio_mean=m["ratio_mean"],
                   ratio_max=m["ratio_max"], rollout_s=t_roll.s, score_s=t_score.s, train_s=t_train.s,
                   sync=rep, tokens=int(mask.sum()))
        # the last update is visible to the engine after the next hand-over
        model.eval()
        eng.wake()
        eng.sync_weights(model)
        b = eng.generate(examples(16), max_new_tokens=12, generator=torch.Generator(device=dev).manual_seed(9))
        mx, mean = logp_errors(model, b)
        assert mx < TOL, (mx, mean)
        asleep = [p for p in phases if p["phase"].endswith("engine asleep")]
        rollout = [p for p in phases if p["phase"].endswith("/rollout")]
        # asleep, the engine holds far less of the device than while it samples
        assert min(p["free_mb"] for p in asleep) > max(p["free_mb"] for p in rollout) + 1024
        record("colocated_step/phases", kind=kind, phases=phases, max_abs_err_after=mx)
    finally:
        eng.close()


def _loop_uses_build_rollout() -> bool:
    from mopd_core.train import loop

    return "build_rollout" in inspect.getsource(loop)


@pytest.mark.parametrize("backend", ["hf", "hf_graphed", "vllm"])
def test_mopd_stage_colocated(backend, tmp_path):
    kind = require()
    for mod in ("pydantic", "datasets", "yaml"):  # the recipe's stack (a bare accelerator image may lack it)
        pytest.importorskip(mod, reason=f"the MOPD stage needs `{mod}` (pip install -e .)")
    if backend == "vllm":
        require_vllm()
        if not _loop_uses_build_rollout():
            pytest.skip("mopd_core.train.loop does not build its engine with rollout.engines.build_rollout yet")
    from mopd_core import recipe as R
    from mopd_core.config import load_config
    from tests.conftest import tiny_overrides

    over = [o for o in tiny_overrides(tmp_path / "runs") if not o.startswith(("runtime.device", "model.tiny"))]
    over += [f"runtime.device={kind}", "runtime.placement=colocated", f"rollout.backend={backend}",
             # head_dim 64 (vLLM on GPU/NPU), 2 layers
             "model.tiny.hidden_size=128", "model.tiny.num_heads=2", "model.tiny.num_layers=2",
             "model.tiny.intermediate_size=256", "mopd.steps=2", "mopd.save_every=1"]
    cfg = load_config("tiny", over)
    R.setup_runtime(cfg)
    base = R.base_model(cfg)
    with Timer(kind) as t_sft:
        sft = R.sft_stage(cfg, base, progress=False).model_dir
    with Timer(kind) as t_mopd:
        out = R.mopd_stage(cfg, sft, {"math": sft, "code": base, "if": sft}, progress=False)
    rows = [json.loads(x) for x in (out.stage_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(rows) == 2 and all(r["loss"] == r["loss"] for r in rows)  # finite
    record("colocated_step/mopd_stage", kind=kind, backend=backend, sft_s=t_sft.s, mopd_s=t_mopd.s,
           metrics=rows[-1])
    assert (out.model_dir / "config.json").exists()
