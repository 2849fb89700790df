"""Mixed precision and activation memory on the tiny model: bfloat16 compute trains float32
master weights and optimizer state; gradient checkpointing and the ranks' zero-weight padding passes leave the
update unchanged."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mopd_core import recipe as R
from mopd_core.train.checkpoint import checkpoint_dirs, load_loop_state


def _cfg(tmp_path, extra=()):
    from tests.conftest import short_cfg

    return short_cfg(tmp_path, ["expert.steps=2", *extra])


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def sft_dir(short_sft_dir):
    return short_sft_dir


def test_bfloat16_computes_in_bf16_and_keeps_float32_master_weights(sft_dir, tmp_path):
    runs = {d: R.expert_stage(_cfg(tmp_path / d, [f"runtime.dtype={d}"]), "short", sft_dir, progress=False)
            for d in ("float32", "bfloat16")}
    bf = runs["bfloat16"]
    with safe_open(str(bf.model_dir / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}  # master weights, saved as trained
    st = load_loop_state(checkpoint_dirs(bf.stage_dir)[-1])
    moments = [v for s in st["optimizer"]["state"].values() for k, v in s.items() if k.startswith("exp_avg")]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    a, b = (_rows(runs[d].stage_dir / "metrics.jsonl")[0] for d in ("float32", "bfloat16"))
    # the same weights and prompts, another compute dtype: close, and not bit-equal (autocast was on)
    assert b["entropy"] != a["entropy"] and b["entropy"] == pytest.approx(a["entropy"], rel=0.1)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in _rows(bf.stage_dir / "metrics.jsonl"))


def test_float16_training_is_refused_before_compute(sft_dir, tmp_path):
    from mopd_core.errors import ConfigError

    with pytest.raises(ConfigError, match="runtime.dtype=float16 cannot train here.*use runtime.dtype=bfloat16"):
        R.expert_stage(_cfg(tmp_path, ["runtime.dtype=float16"]), "short", sft_dir, progress=False)
    assert not (tmp_path / "t" / "expert-short").exists()


def _update(sft_dir, *, checkpointing=False, agree=None, max_tokens=None):
    """One `policy_update` of a fixed sampled batch; returns the new weights and the metrics."""
    from mopd_core.algorithms import grpo_advantages
    from mopd_core.config import PolicyLoopConfig
    from mopd_core.distributed.cluster import Prompt
    from mopd_core.models import load_model, load_tokenizer
    from mopd_core.rollout import HFRollout
    from mopd_core.train.loop import enable_gradient_checkpointing, lr_lambda, policy_update

    torch.manual_seed(0)
    model, tok = load_model(sft_dir).train(), load_tokenizer(sft_dir)
    prompts = ["12+34=", "sort:3142=", "rev:abcd=", "upper:abcd=", "7-5=", "rep3:ab="]
    batch = HFRollout(model, tok, "cpu").generate([Prompt(p) for p in prompts for _ in range(2)],
                                                  max_new_tokens=6, generator=torch.Generator().manual_seed(3))
    if checkpointing:
        enable_gradient_checkpointing(model)
        assert model.is_gradient_checkpointing
    cfg = PolicyLoopConfig(lr=1e-3, micro_batch_size=4)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    mask = batch.completion_mask.float()
    adv = grpo_advantages(torch.tensor([1.0, 0.0] * 6), 2)[:, None] * mask
    met = policy_update(model, opt, sched, batch, adv, mask, None, None, cfg, 1.0, random.Random(0),
                        max_tokens=max_tokens, agree=agree)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, met


def _worst(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_gradient_checkpointing_gives_the_same_update(sft_dir):
    ref, m_ref = _update(sft_dir)
    got, m_got = _update(sft_dir, checkpointing=True)
    assert m_ref["grad_norm"] > 0 and _worst(ref, got) < 1e-6
    assert m_got["loss"] == pytest.approx(m_ref["loss"], rel=1e-6, abs=1e-9)


def test_zero_weight_passes_that_keep_ranks_in_step_change_nothing(sft_dir):
    """Under DDP/FSDP2 with a token budget a rank with fewer micro-batches runs extra zero-weight passes
    (`agree` = the ranks' largest count); here `agree` asks for 3 more than this process needs."""
    ref, m_ref = _update(sft_dir, max_tokens=40)
    got, m_got = _update(sft_dir, max_tokens=40, agree=lambda n: n + 3)
    assert m_got["perf/micro_batches"] == m_ref["perf/micro_batches"] + 3
    assert _worst(ref, got) < 1e-7 and m_got["loss"] == pytest.approx(m_ref["loss"], rel=1e-6)
    assert m_got["entropy"] == pytest.approx(m_ref["entropy"], rel=1e-6)
    assert m_got["perf/pad_frac"] > m_ref["perf/pad_frac"]  # the idle passes are computed work, none of it real
