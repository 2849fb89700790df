"""A tiny expert RL stage with LoRA (`expert.lora`) through the real loop: the checkpoints hold only the adapter
and the adapters' optimizer state, raising `steps` resumes from the adapter checkpoint and ends where a fresh run
ends, `final/` is a plain HF model (no lora keys) that differs from the input model, and the run logs throughput
and memory as full fine-tuning does; that `final/` then serves as every teacher of a MOPD stage whose student
trains with LoRA too (`mopd.lora`)."""

from __future__ import annotations

import json

import torch

from mopd_core import recipe as R
from mopd_core.models import load_model
from mopd_core.models.lora import ADAPTER_DIR, ADAPTER_WEIGHTS
from mopd_core.train.checkpoint import checkpoint_dirs
from tests.conftest import short_cfg


def test_lora_expert_trains_adapters_resumes_and_writes_a_plain_final(short_sft_dir, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    cfg = short_cfg(tmp_path / "a", ["expert.lora.r=4", "expert.lora.alpha=8", "expert.lr=5e-3",
                                     "expert.steps=2", "expert.save_every=1", "expert.keep_checkpoints=3",
                                     "eval.eval_size=4"])
    R.setup_runtime(cfg)
    torch.set_num_threads(1)
    R.expert_stage(cfg, "short", short_sft_dir, progress=False)
    longer = cfg.model_copy(deep=True)
    longer.expert.steps = 3  # continues from the step-2 adapter checkpoint
    out = R.expert_stage(longer, "short", short_sft_dir, progress=False)

    cks = checkpoint_dirs(out.stage_dir)
    assert [c.name for c in cks] == ["step-000001", "step-000002", "step-000003"]
    for ck in cks:  # the adapter only: no model/ copy of the frozen base
        assert sorted(p.name for p in ck.iterdir()) == [ADAPTER_DIR, "loop_state.pt"]
        assert (ck / ADAPTER_DIR / ADAPTER_WEIGHTS).exists()
    with safe_open(str(cks[-1] / ADAPTER_DIR / ADAPTER_WEIGHTS), "pt") as f:
        n_adapter = len(list(f.keys()))
    st = torch.load(cks[-1] / "loop_state.pt", weights_only=False)
    assert st["step"] == 3 and len(st["optimizer"]["state"]) == n_adapter  # AdamW state of the adapters only
    info = json.loads((out.stage_dir / "stage.json").read_text())
    assert info["lora"]["r"] == 4 and 0 < info["lora"]["trainable_params"] < info["lora"]["total_params"] / 5

    rows = [json.loads(x) for x in (out.stage_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["perf/tokens_per_s"] > 0 and r["mem/host_rss_mb"] > 0 and r["grad_norm"] > 0 for r in rows)

    # final/: a plain HF model, the merged weights, not the input model
    with safe_open(str(out.model_dir / "model.safetensors"), "pt") as f:
        assert not any("lora" in k or "base_layer" in k for k in f.keys())
    final, load = AutoModelForCausalLM.from_pretrained(out.model_dir, output_loading_info=True)
    assert not any(load[k] for k in ("missing_keys", "unexpected_keys"))
    a, b = final.state_dict(), load_model(short_sft_dir).state_dict()
    assert set(a) == set(b) and any(not torch.equal(a[k], b[k]) for k in a)

    # resuming from the adapter checkpoint ends where an uninterrupted run ends
    fresh = R.expert_stage(longer.model_copy(update={"output_dir": str(tmp_path / "b")}, deep=True), "short",
                           short_sft_dir, progress=False)
    c = load_model(fresh.model_dir).state_dict()
    assert max((a[k] - c[k]).abs().max().item() for k in a) < 1e-6

    # the LoRA expert's final/ as a (plain, local) teacher of a LoRA student
    m_cfg = longer.model_copy(update={"output_dir": str(tmp_path / "m")}, deep=True)
    m_cfg.mopd.lora = m_cfg.expert.lora
    m_cfg.mopd.lr, m_cfg.mopd.steps = 5e-3, 2
    student = R.mopd_stage(m_cfg, short_sft_dir, {d: out.model_dir for d in m_cfg.domain_names()}, progress=False)
    info = json.loads((student.stage_dir / "stage.json").read_text())
    assert info["lora"]["trainable_params"] > 0
    rows = [json.loads(x) for x in (student.stage_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(any(k.startswith("reverse_kl/") for k in r) for r in rows)  # distilled
    s = load_model(student.model_dir).state_dict()
    assert any(not torch.equal(s[k], b[k]) for k in s)
