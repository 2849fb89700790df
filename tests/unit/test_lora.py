"""LoRA on the policy (`expert.lora` / `mopd.lora`, `models.lora`): a policy step changes only the adapters (every
base tensor bit-equal); the merged weights equal the adapted model (float64); the adapter checkpoint round-trips
(and is PEFT's own format); `final/` is a plain HF model without lora keys; config, fingerprints, refusals and the
memory estimate."""

from __future__ import annotations

import random

import pytest
import torch

from mopd_core import recipe as R
from mopd_core.config import ConfigError, LoRAConfig, PolicyLoopConfig, load_config
from mopd_core.errors import ModelError
from mopd_core.models import lora as L
from mopd_core.models import save_pretrained
from mopd_core.rollout import RolloutBatch
from mopd_core.train.loop import policy_update
from tests.conftest import tiny_overrides

torch.set_num_threads(1)
V = 64


def _model(dtype=torch.float64, seed=0):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=48, head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cfg).to(dtype)


def _perturb_b(model, seed=1):
    """Non-zero B (a fresh adapter has B = 0 and merges to the base exactly, which would prove nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _batch(B=4, P=3, T=5, seed=3):
    g = torch.Generator().manual_seed(seed)
    cm = torch.ones(B, T, dtype=torch.long)
    cm[0, 3:] = 0
    return RolloutBatch(torch.randint(1, V, (B, P), generator=g), torch.ones(B, P, dtype=torch.long),
                        torch.randint(1, V, (B, T), generator=g) * cm, cm,
                        (-torch.rand(B, T, generator=g, dtype=torch.float64) * 4) * cm, list(range(B)), [""] * B)


def _ids():
    return torch.randint(1, V, (3, 7), generator=torch.Generator().manual_seed(5))


def test_a_policy_step_changes_only_the_adapters():
    model = _model()
    L.add_lora(model, LoRAConfig(r=4, alpha=8))
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert base and adapters and all(not p.requires_grad for n, p in model.named_parameters() if n in base)
    trainable = L.trainable_parameters(model)
    assert {id(p) for p in trainable} == {id(p) for n, p in model.named_parameters() if n in adapters}
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    batch = _batch()
    mask = batch.completion_mask.double()
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * mask
    cfg = PolicyLoopConfig(grad_clip=1e9, lora=LoRAConfig(r=4, alpha=8))
    for step in range(2):
        out = policy_update(model, opt, sched, batch, adv, mask, None, None, cfg, 1.0, random.Random(step))
        assert torch.isfinite(torch.tensor(out["loss"]))
        now = dict(model.named_parameters())
        for n, before in base.items():  # bit-equal, and never given a gradient
            assert torch.equal(now[n], before), n
            assert now[n].grad is None, n
        if step == 0:  # B = 0 at init: only B has a gradient in the first step (∂L/∂A ∝ B)
            assert all(not torch.equal(now[n], adapters[n]) for n in adapters if "lora_B" in n)
    now = dict(model.named_parameters())
    assert all(not torch.equal(now[n], adapters[n]) for n in adapters)  # after two steps, A moved as well


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"]], ids=["all-linear", "q,v"])
def test_merged_weights_equal_the_adapted_model_float64(targets):
    model = _model()
    plain_keys = set(model.state_dict())
    L.add_lora(model, LoRAConfig(r=4, alpha=16, dropout=0.1, target_modules=targets))
    _perturb_b(model)
    layers = L.lora_layers(model)
    assert {n.rsplit(".", 1)[1] for n in layers} == (set(targets) if targets else
                                                      {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"})  # never lm_head
    merged = L.export_state_dict(model)
    assert set(merged) == plain_keys  # the base model's names: no base_layer / lora_ keys
    from mopd_core.rollout.served import _state_dict  # what the student servers (and async publish) are handed

    assert set(_state_dict(model)) == plain_keys
    plain = _model(seed=9)  # other weights: everything must come from `merged`
    plain.load_state_dict(merged, strict=True)
    model.eval(), plain.eval()  # eval: the adapter's dropout is off, as in rollout
    with torch.no_grad():
        a, b = model(_ids()).logits, plain(_ids()).logits
    assert (a - b).abs().max().item() < 1e-10
    # and the merge is not the base: the adapters are in it
    base = _model()
    with torch.no_grad():
        assert (base(_ids()).logits - a).abs().max().item() > 1e-3
    # the hf engine's plain copy: no adapter layers, the same logits, and it follows the adapters when refreshed
    copy = L.merged_copy(model)
    assert not L.has_lora(copy) and set(copy.state_dict()) == plain_keys and not L.trainable_parameters(copy)
    _perturb_b(model, seed=2)
    with torch.no_grad():
        assert (copy(_ids()).logits - a).abs().max().item() < 1e-10
        assert L.refresh_merged(copy, model) > 0
        assert (copy(_ids()).logits - model(_ids()).logits).abs().max().item() < 1e-10


def test_a_fresh_adapter_merges_to_the_base_exactly():
    model = _model(torch.float32)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    L.add_lora(model, LoRAConfig(r=2))
    merged = L.export_state_dict(model)
    assert all(torch.equal(merged[k], ref[k]) for k in ref)


def test_adapter_checkpoint_round_trip_in_peft_format(tmp_path):
    from peft import PeftModel

    cfg = LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "down_proj"])
    model = _model()
    L.add_lora(model, cfg)
    _perturb_b(model)
    out = L.save_adapter(model, tmp_path / "adapter")
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", L.ADAPTER_WEIGHTS}
    saved = L.adapter_state_dict(model)
    torch.manual_seed(123)  # another adapter init: the loaded values must replace it
    other = L.add_lora(_model(), cfg)
    L.load_adapter(other, out)
    back = L.adapter_state_dict(other)
    assert set(back) == set(saved) and all(torch.equal(back[k], saved[k]) for k in saved)
    with torch.no_grad():
        assert torch.equal(other.eval()(_ids()).logits, model.eval()(_ids()).logits)
    # PEFT itself reads it: the adapter folder is a standard one
    peft_model = PeftModel.from_pretrained(_model(), str(out)).eval()
    with torch.no_grad():
        assert (peft_model(_ids()).logits - model(_ids()).logits).abs().max().item() < 1e-12
    with pytest.raises(ModelError, match="does not match"):
        L.load_adapter(L.add_lora(_model(), LoRAConfig(r=4, target_modules=["q_proj"])), out)
    with pytest.raises(ModelError, match="holds no LoRA adapter"):
        L.load_adapter(L.add_lora(_model(), cfg), tmp_path)


def test_final_dir_is_a_plain_hf_model(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from mopd_core.models import build_tiny_tokenizer

    model = _model(torch.float32)
    L.add_lora(model, LoRAConfig(r=4))
    _perturb_b(model)
    final = save_pretrained(model, build_tiny_tokenizer(), tmp_path / "final")
    assert not (final / "adapter_config.json").exists()
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys == set(_model(torch.float32).state_dict())
    assert not any("lora" in k or "base_layer" in k for k in keys)
    plain, info = AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert not L.has_lora(plain)
    with torch.no_grad():
        assert (plain.eval()(_ids()).logits - model.eval()(_ids()).logits).abs().max().item() < 1e-5


# --------------------------------------------------------------------------------- config, identity, refusals


def test_lora_is_off_by_default_and_fingerprinted_only_when_set(tmp_path):
    cfg = load_config("tiny", tiny_overrides(tmp_path))
    assert cfg.expert.lora is None and "lora" not in cfg.expert.model_dump() and "lora" not in cfg.mopd.model_dump()
    ids = {"init": "stage:abc:3", "teacher.math": "stage:m:3", "teacher.code": "stage:c:3", "teacher.if": "stage:i:3"}

    def fp(c):
        return {s: R.stage_spec(c, s, ids).fingerprint for s in ("sft", "expert:math", "mopd")}

    base = fp(cfg)
    on = load_config("tiny", tiny_overrides(tmp_path) + ["expert.lora={}"])
    assert on.expert.lora == LoRAConfig()
    f = fp(on)
    assert f["expert:math"] != base["expert:math"] and f["sft"] == base["sft"] and f["mopd"] == base["mopd"]
    r8 = load_config("tiny", tiny_overrides(tmp_path) + ["expert.lora.r=8"])  # a dotted key creates the section
    assert r8.expert.lora.r == 8 and fp(r8)["expert:math"] not in (base["expert:math"], f["expert:math"])
    m = fp(load_config("tiny", tiny_overrides(tmp_path) + ["mopd.lora.alpha=8"]))
    assert m["mopd"] != base["mopd"] and m["expert:math"] == base["expert:math"]
    with pytest.raises(ConfigError, match="expert.lora.r"):
        load_config("tiny", ["expert.lora.r=0"])


def test_unsupported_combinations_fail_in_one_line(tmp_path):
    from mopd_core.train.loop import check_loop_config

    cfg = load_config("tiny", tiny_overrides(tmp_path) + ["expert.lora={}", "runtime.strategy=ddp",
                                                          "runtime.num_workers=2"])
    with pytest.raises(ConfigError) as e:
        check_loop_config("expert-math", cfg.expert, cfg, ["math"], has_teachers=False)
    msg = str(e.value)
    assert "expert.lora" in msg and "runtime.strategy=single" in msg and "\n" not in msg
    with pytest.raises(ConfigError) as e:
        L.add_lora(_model(), LoRAConfig(target_modules=["nope_proj"]))
    assert "lora.target_modules" in str(e.value) and "\n" not in str(e.value)


def test_memory_estimate_gives_optimizer_state_to_the_adapters_only(tmp_path):
    from mopd_core import preflight
    from mopd_core.models import build_tiny_tokenizer
    from mopd_core.runtime.phases import ColocationError, check_colocated_fit

    gib = 2**30
    kw = dict(kind="cpu", limit_gib=2.5, student_bytes=gib, optimizer_factor=2.0, teacher_bytes={},
              teachers_offload=True, placement="colocated")
    with pytest.raises(ColocationError):  # full fine-tuning: weights + grads + 2 moments = 4 GiB
        check_colocated_fit(**kw)
    need = check_colocated_fit(**kw, trainable_bytes=gib // 100)  # LoRA: 1 GiB + 3 × 10 MiB
    assert need["train"] == pytest.approx(1024 + 3 * 1024 / 100, rel=1e-3)
    # the pre-flight counts exactly the adapters the loop will train
    model = _model(torch.float32)
    save_pretrained(model, build_tiny_tokenizer(), tmp_path / "m")
    cfg = LoRAConfig(r=4, target_modules=["q_proj", "up_proj"])
    stu = preflight._Model("--init", str(tmp_path / "m"), None, None)
    want = sum(p.numel() for p in L.trainable_parameters(L.add_lora(model, cfg)))
    assert preflight._lora_params(load_config("tiny"), stu, cfg) == want == 2 * 4 * ((32 + 32) + (32 + 48))
