"""Config: every preset validates, overrides apply, unknown keys and bad values fail naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from mopd_core.config import (CONFIG_DIR, ConfigError, RecipeConfig, apply_overrides, flatten, load_config,
                              stage_fingerprint)

PRESETS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def test_the_three_presets_exist():
    assert {"tiny", "open_mopd_smollm3", "ascend_colocate"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_validates(name):
    cfg = load_config(name)
    assert isinstance(cfg, RecipeConfig) and cfg.domain_names()


def test_open_mopd_preset_is_the_published_recipe():
    cfg = load_config("open_mopd_smollm3")
    assert cfg.model.base == "HuggingFaceTB/SmolLM3-3B"
    assert cfg.domain_names() == ["math", "code", "if"]
    assert [d.weight for d in cfg.data.domains] == [0.4, 0.4, 0.2]
    assert cfg.mopd.kd_loss == "sampled_rkl" and cfg.mopd.w_kd == 1.0
    assert cfg.rollout.max_new_tokens == 16384
    # the published protocol: chat template, the real verifiers, AIME24/25 mean@32 at T 0.6 / top_p 0.95 /
    # top_k 20, LiveCodeBench mean@10 (all tests pass), IFEval prompt-level strict
    assert cfg.data.chat.enabled
    assert {d.name: d.verifier for d in cfg.data.domains} == {"math": "math_verify", "code": "code_tests",
                                                              "if": "ifeval"}
    b = {s.name: s for d in cfg.data.domains for s in d.eval_sources}
    assert set(b) == {"aime24", "aime25", "livecodebench", "ifeval"}
    for name in ("aime24", "aime25"):
        assert (b[name].n, b[name].temperature, b[name].top_p, b[name].top_k) == (32, 0.6, 0.95, 20)
        assert b[name].headline() == "mean@32" and b[name].verifier_args == {"mode": "aime"}
    assert b["livecodebench"].headline() == "mean@10" and b["livecodebench"].verifier_args["scoring"] == "all"
    assert b["ifeval"].headline() == "prompt_strict" and b["ifeval"].temperature == 0


def test_every_field_has_a_description():
    def walk(model, path):
        for name, f in model.model_fields.items():
            assert f.description, f"{path}{name} has no description"
            ann = f.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann, f"{path}{name}.")
    walk(RecipeConfig, "")


def test_dotted_overrides_apply_with_yaml_types():
    cfg = load_config("tiny", ["mopd.steps=50", "teachers.routing=mixture", "mopd.kd_clip=null",
                               "data.domains.code.weight=0.7", "sft.mix={math: 1.0}"])
    assert cfg.mopd.steps == 50 and cfg.teachers.routing == "mixture" and cfg.mopd.kd_clip is None
    assert cfg.data.domains[1].weight == 0.7 and cfg.sft.mix == {"math": 1.0}


@pytest.mark.parametrize("override,needle", [
    (["mopd.stepz=5"], "unknown config key 'mopd.stepz'"),
    (["nonsense=1"], "unknown config key 'nonsense'"),
    (["mopd.steps=-1"], "mopd.steps"),
    (["teachers.routing=random"], "teachers.routing"),
    (["model.tiny.num_heads=12"], "head_dim=16"),
    (["mopd.mix={chemistry: 1}"], "unknown domain 'chemistry'"),
    (["data.domains.bio.weight=1"], "no list item 'bio'"),
    (["mopd.steps"], "key.path=value"),
    (["runtime.num_workers=2"], "runtime.num_workers=2 needs runtime.strategy=ddp or fsdp2"),
    (["runtime.strategy=zero3"], "runtime.strategy"),
])
def test_bad_config_is_one_line_naming_the_field(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", override)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_unknown_key_in_a_yaml_file(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text(Path(CONFIG_DIR / "tiny.yaml").read_text() + "\nmopdd: {steps: 3}\n")
    with pytest.raises(ConfigError, match="unknown config key 'mopdd'"):
        load_config(str(p))


def test_missing_preset_lists_known_ones():
    with pytest.raises(ConfigError, match="tiny"):
        load_config("no-such-preset")


def test_overrides_do_not_mutate_input_and_fingerprint_tracks_changes():
    data = {"a": {"b": 1}}
    out = apply_overrides(data, ["a.b=2", "a.c.d=x"])
    assert data == {"a": {"b": 1}} and out == {"a": {"b": 2, "c": {"d": "x"}}}
    a, b = load_config("tiny"), load_config("tiny", ["mopd.lr=1e-3"])
    assert stage_fingerprint(a.mopd) != stage_fingerprint(b.mopd)
    assert stage_fingerprint(a.sft) == stage_fingerprint(b.sft)
    assert flatten({"x": {"y": 1, "z": {"w": 2}}}) == {"x.y": 1, "x.z.w": 2}
    # domains and their benchmarks: keyed by name, every setting its own param (as overrides address them)
    cfg = load_config("open_mopd_smollm3")
    flat = flatten(cfg.model_dump(mode="json"))
    assert flat["data.domains.math.verifier_args.mode"] == "boxed"
    assert flat["data.domains.math.eval_sources.aime24.n"] == 32
    assert flat["data.domains.if.eval_sources.ifeval.metrics"] == ["prompt_strict", "prompt_loose", "inst_strict",
                                                                   "inst_loose"]
    assert not any(k == "data.domains" for k in flat)
    assert flatten({"l": [{"name": "a"}, {"name": "a"}]}) == {"l": [{"name": "a"}, {"name": "a"}]}  # not unique


@pytest.mark.parametrize("overrides,needle", [
    (["mopd.prompts_per_step=3", "mopd.group_size=1", "mopd.w_rl=0"],
     "3 rows do not split evenly over runtime.num_workers=2"),
])
def test_what_sharded_training_cannot_do_is_refused_before_compute(overrides, needle):
    """Checked by the loop's pre-flight (no worker started): one line naming the field and the fix."""
    from mopd_core.train.loop import check_loop_config

    # the Ray workers' update takes the sampled-token objective (tiny's default, topk_rkl, is refused there)
    cfg = load_config("tiny", ["runtime.num_workers=2", "runtime.strategy=fsdp2", "mopd.kd_loss=sampled_rkl",
                               *overrides])
    with pytest.raises(ConfigError) as e:
        check_loop_config("student", cfg.mopd, cfg, cfg.domain_names(), has_teachers=True)
    assert needle in str(e.value) and "\n" not in str(e.value)
    check_loop_config("student", cfg.mopd, load_config("tiny"), cfg.domain_names(), has_teachers=True)  # single
    jsd = load_config("tiny", ["runtime.num_workers=2", "runtime.strategy=fsdp2", "mopd.kd_loss=jsd"])
    check_loop_config("student", jsd.mopd, jsd, jsd.domain_names(), has_teachers=True)  # the workers take the JSD


def test_presets_say_how_they_scale():
    """Open-MOPD's SmolLM3-3B on 4 GPUs and the Ascend preset on 8 NPUs train under FSDP2 in bfloat16
    with chunked log-probs, a token budget per micro-batch and gradient checkpointing; their loops pass the
    sharded-training pre-flight (rows split evenly, no top-k JSD)."""
    from mopd_core.train.loop import check_loop_config

    for name, n, dev in (("open_mopd_smollm3", 4, "cuda"), ("ascend_colocate", 8, "npu")):
        cfg = load_config(name)
        rt, tr = cfg.runtime, cfg.train
        assert (rt.device, rt.num_workers, rt.strategy, rt.dtype) == (dev, n, "fsdp2", "bfloat16"), name
        assert tr.logprob_impl == "chunked" and tr.gradient_checkpointing, name
        assert tr.max_tokens_per_micro_batch >= cfg.max_seq_len(), name  # the longest row fits one pass
        check_loop_config("student", cfg.mopd, cfg, cfg.domain_names(), has_teachers=True)
        expert = cfg.expert.model_copy(update={"w_kd": 0.0, "mix": None})
        check_loop_config("expert-math", expert, cfg, ["math"], has_teachers=False)


def test_the_per_rank_estimate_of_the_open_mopd_preset():
    """The memory pre-flight on SmolLM3-3B's shape (3.08 B parameters, hidden 2048, 36 layers, vocabulary 128,256)
    and an 80 GiB GPU: the preset fits; the same with full-vocabulary log-probs does not, and the one-line error
    names the activations and their fixes; without sharding, a 40 GiB device refuses the optimizer state."""
    from mopd_core import preflight
    from mopd_core.runtime.phases import ColocationError

    smol = preflight._Model("--init", "smollm3", 65536, 3_075_098_624, shape=(2048, 36, 128256))

    def check(*overrides):
        cfg = load_config("open_mopd_smollm3", ["runtime.memory_limit_gib=80", *overrides])
        preflight.memory_needs(cfg, "student", "cuda", smol, {})

    check()
    with pytest.raises(ColocationError) as e:
        check("train.logprob_impl=full")
    msg = str(e.value)
    assert "phase 'train' needs" in msg and "activations of one micro-batch" in msg
    assert "train.gradient_checkpointing=true" in msg and "\n" not in msg
    with pytest.raises(ColocationError, match="shard it: runtime.strategy=fsdp2"):
        check("runtime.num_workers=1", "runtime.strategy=single", "runtime.memory_limit_gib=40")


def test_an_unset_kd_loss_is_the_dense_one_only_where_it_runs():
    """mopd.kd_loss left unset: dense top-K with local teachers in one synchronous process; the sampled-token
    objective where the dense one cannot run (http teachers, async, Ray workers, cross-tokenizer teachers); a value
    the user sets is kept (and refused later where it cannot run)."""
    assert load_config("tiny", []).mopd.kd_loss == "topk_rkl"
    for over in (["teachers.backend=http"], ["runtime.placement=async"], ["teachers.cross_tokenizer=[code]"]):
        assert load_config("tiny", over).mopd.kd_loss == "sampled_rkl", over
    assert load_config("tiny", ["teachers.backend=http", "mopd.kd_loss=topk_rkl"]).mopd.kd_loss == "topk_rkl"
    assert load_config("tiny", ["mopd.kd_loss=sampled_rkl"]).mopd.kd_loss == "sampled_rkl"
