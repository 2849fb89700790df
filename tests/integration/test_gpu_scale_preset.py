"""The `gpu_scale` preset (a real-size MOPD stage for one accelerator) at tiny widths on the CPU: the same sections
through the same code — a Qwen3-architecture student and three teachers built locally from different seeds, a
character tokenizer padded to a fixed vocabulary with a chat template, completions sampled to the full budget past
EOS (`rollout.ignore_eos`), bf16 autocast, chunked log-probs, token-budget micro-batches, colocated phases
with one teacher resident at a time — run by `recipe.mopd_stage` through `tests/device/gpu_scale_stage.py`, the
driver the device checks run at the real size."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "device"))

from gpu_scale_stage import TINY, run_stage  # noqa: E402

from mopd_core.config import ConfigError, load_config  # noqa: E402


def test_gpu_scale_preset_runs_a_mopd_stage_at_tiny_widths(tmp_path):
    cfg = load_config("gpu_scale", TINY + [f"output_dir={tmp_path}"])
    res = run_stage(cfg)
    steps = res["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in steps)
    # ignore_eos: every completion has exactly the budget's length, whatever the random model sampled
    lengths = [v for s in steps for k, v in s.items() if k.startswith("length/")]
    assert lengths and all(v == cfg.rollout.max_new_tokens for v in lengths)
    # micro-batches under the token budget, each cut to its own longest row: only the prompts' few pads computed
    assert all(s["perf/pad_frac"] < 0.1 and s["perf/micro_batches"] >= 2 for s in steps)
    run = cfg.run_dir()
    built = json.loads((run / "base" / "config.json").read_text())
    assert built["model_type"] == "qwen3" and built["vocab_size"] == 4096 and built["tie_word_embeddings"]
    tok = json.loads((run / "base" / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok.get("chat_template", "") or (run / "base" / "chat_template.jinja").exists()
    # three teachers of the same shape, different seeds: different weights
    from safetensors.torch import load_file

    w = {d: load_file(str(run / f"teacher-{d}" / "model.safetensors")) for d in ("math", "code", "if")}
    k = "model.layers.0.mlp.up_proj.weight"
    assert w["math"][k].dtype == torch.bfloat16 and not torch.equal(w["math"][k], w["code"][k])
    # colocated: one teacher at a time; every phase recorded, with the estimates beside them
    stage = json.loads((Path(res["stage_dir"]) / "stage.json").read_text())
    assert stage["placement"]["max_teachers_resident"] == 1
    est = res["estimate_mib"]
    assert set(res["phases_measured_mib"]) == {"rollout", "score", "train"}
    fp32 = res["params"] * 4 / 2**20
    terms = est["terms_mib"]  # the pre-flight counts the sampler's cache, a teacher's forward, the activations
    assert min(terms["sampling"], terms["scoring"], terms["activations"]) > 0
    assert est["preflight"]["rollout"] == pytest.approx(fp32 + terms["sampling"], rel=1e-6)
    assert est["preflight"]["train"] == pytest.approx(4 * fp32 + terms["activations"], rel=1e-6)
    # the scheduler's own bookkeeping (deterministic on CPU) is what the pre-flight counts for weights/optimizer
    held = res["phases_measured_mib"]
    assert held["rollout"]["resident_mib"] == pytest.approx(fp32, rel=1e-3)
    assert held["train"]["resident_mib"] == pytest.approx(4 * fp32, rel=1e-3)


def test_ignore_eos_needs_the_hf_backend():
    with pytest.raises(ConfigError, match="rollout.ignore_eos"):
        load_config("gpu_scale", ["rollout.backend=vllm"])


def test_hf_engine_samples_past_eos_only_when_asked():
    from types import SimpleNamespace

    from mopd_core.config import TinyModelConfig
    from mopd_core.models import build_tiny_model, build_tiny_tokenizer
    from mopd_core.rollout import HFRollout

    tok = build_tiny_tokenizer(chat=True, vocab_size=200)
    assert len(tok) == 200 and tok.convert_ids_to_tokens(199) == "<|x199|>"
    assert tok("12+3=")["input_ids"] == build_tiny_tokenizer(chat=True)("12+3=")["input_ids"]
    model = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, arch="qwen3"), len(tok),
                             tok.pad_token_id, tok.eos_token_id, seed=0)
    ex = [SimpleNamespace(prompt="12+3=", teacher_id="math")] * 3
    out = {}
    for ignore in (False, True):
        eng = HFRollout(model, tok, "cpu", ignore_eos=ignore)
        # a stand-in for a model that always ends at once: every id is a stop id
        eng.stop_ids = lambda: list(range(len(tok)))
        out[ignore] = eng.generate(ex, max_new_tokens=5, generator=torch.Generator().manual_seed(0))
    assert out[False].completion_mask.sum(1).tolist() == [1, 1, 1]
    assert out[True].completion_mask.sum(1).tolist() == [5, 5, 5]
    # the same draws: the ignoring engine's first token is the one the other stopped on
    assert torch.equal(out[True].completion_ids[:, 0], out[False].completion_ids[:, 0])


def test_built_model_dir_is_rebuilt_when_the_shape_changes(tmp_path):
    from mopd_core.config import ModelConfig
    from mopd_core.models import build_tiny

    small = ModelConfig(tiny={"hidden_size": 64, "num_layers": 1, "num_heads": 2, "arch": "qwen3"})
    out = build_tiny(small, tmp_path / "m")
    first = (out / "model.safetensors").stat().st_mtime_ns
    assert build_tiny(small, tmp_path / "m") == out and (out / "model.safetensors").stat().st_mtime_ns == first
    wider = small.model_copy(update={"tiny": small.tiny.model_copy(update={"hidden_size": 128})})
    build_tiny(wider, tmp_path / "m")
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 128
