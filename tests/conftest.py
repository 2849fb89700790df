"""Shared fixtures. Tests run offline, single-threaded (the CI box has 2 cores and OpenMP spin-waits under
contention), and write only under pytest's tmp dirs."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import pytest
import torch

torch.set_num_threads(1)


def tiny_overrides(tmp_path) -> list[str]:
    """A recipe small enough for seconds-long integration tests (a 2-layer, 64-wide model)."""
    return [
        f"output_dir={tmp_path}", "name=t", "runtime.device=cpu", "runtime.num_threads=1",
        "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
        "model.tiny.intermediate_size=128",
        "sft.steps=6", "sft.batch_size=16", "sft.logging_steps=2",
        "expert.steps=3", "expert.prompts_per_step=4", "expert.group_size=4", "expert.save_every=2",
        "mopd.steps=3", "mopd.prompts_per_step=6", "mopd.group_size=2", "mopd.save_every=2",
        "rollout.max_new_tokens=6", "data.domains.math.eval_size=8", "data.domains.code.eval_size=8",
        "data.domains.if.eval_size=8",
    ]


def perturbed_teachers(cfg, sft_dir, tmp_path) -> dict:
    """Cheap stand-in teachers: the SFT weights plus a different small perturbation per domain."""
    from mopd_core.models import load_model, load_tokenizer

    out = {}
    for i, d in enumerate(cfg.domain_names()):
        m = load_model(sft_dir)
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=g))
        dst = tmp_path / f"teacher-{d}"
        m.save_pretrained(dst)
        load_tokenizer(sft_dir).save_pretrained(dst)
        out[d] = dst
    return out


@pytest.fixture
def tiny_cfg(tmp_path):
    from mopd_core.config import load_config

    return load_config("tiny", tiny_overrides(tmp_path))


from mopd_core.domains import MathDomain, register_domain  # noqa: E402


@register_domain("short")
class ShortDomain(MathDomain):
    """Test-only domain: math prompts, reward 1 when the completion has at most 2 characters — a signal an
    almost untrained model already gets sometimes, so a few RL steps on it really move the weights."""

    kind = "short"

    def reward(self, example, completion: str) -> float:
        return float(len(completion.strip()) <= 2)


def with_short_domain(cfg):
    from mopd_core.config import config_from_dict

    d = cfg.model_dump()
    d["data"]["domains"].append({"name": "short", "source": "synthetic:short", "weight": 1.0, "eval_size": 8})
    return config_from_dict(d)


def short_cfg(tmp_path, extra=()):
    """The integration recipe with the `short` domain (RL on it moves the weights within a few steps)."""
    from mopd_core.config import load_config

    return with_short_domain(load_config("tiny", tiny_overrides(tmp_path) + list(extra)))


@pytest.fixture(scope="module")
def short_sft_dir(tmp_path_factory):
    """One tiny SFT of `short_cfg` per test module that trains RL stages from it."""
    from mopd_core import recipe as R

    cfg = short_cfg(tmp_path_factory.mktemp("sft"))
    R.setup_runtime(cfg)
    torch.set_num_threads(1)
    return R.sft_stage(cfg, R.base_model(cfg), progress=False).model_dir
