"""Truncated training rollouts (`rollout.top_p` < 1, `top_k`, `min_p`): the loop passes top_k /
min_p to the engine and replaces the engine's processed behaviour log-probs with the trainer's recomputed
`completion_logprobs` (the first PPO ratio is 1, `rollout/trunc_logp_gap` > 0 is logged); without truncation the
engine's batch goes to the update untouched and no extra forward runs; config validation, dump and fingerprints.
Two-step tiny MOPD runs (a seed-1 tiny model teaches every domain), a couple of seconds each."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import pytest
import torch

from mopd_core import recipe as R
from mopd_core import rollout as RO
from mopd_core.config import load_config
from mopd_core.errors import ConfigError
from mopd_core.models import build_tiny, forward, load_model
from mopd_core.train import roles as RL
from mopd_core.train import update as U
from tests.conftest import tiny_overrides
from tests.unit.test_chat_format import DEFAULT_FPS, INPUTS  # the default tiny stage fingerprints: one record

torch.set_num_threads(1)

_TIMING = ("perf/", "mem/")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The student's init (the tiny base, seed 0) and a teacher (seed 1) for every domain."""
    root = tmp_path_factory.mktemp("models")
    cfg = load_config("tiny", tiny_overrides(root))
    return build_tiny(cfg.model, root / "base", seed=0), build_tiny(cfg.model, root / "teacher", seed=1)


def _cfg(tmp_path: Path, extra=()):
    return load_config("tiny", tiny_overrides(tmp_path) + ["mopd.steps=2", "mopd.eval_size=2", "mopd.lr=1e-2",
                                                           *extra])


def _run(tmp_path, models, extra=(), monkeypatch=None, reference=True):
    """Two MOPD steps; returns (history, final weights hash, [(engine batch, generate kwargs)], [(update batch,
    the trainer's reference log-probs or None)]); `monkeypatch` spies on the engine and the update."""
    cfg = _cfg(tmp_path, extra)
    R.setup_runtime(cfg)
    torch.set_num_threads(1)
    base, teacher = models
    generated, updated = [], []
    if monkeypatch is not None:
        build, update = RL.build_rollout, U.policy_update

        def spy_build(*a, **k):
            eng = build(*a, **k)
            gen = eng.generate

            def generate(*ga, **gk):
                b = gen(*ga, **gk)
                generated.append((b, gk))
                return b
            eng.generate = generate
            return eng

        def spy_update(model, opt, sched, batch, *a, **k):
            updated.append((batch, _reference_logp(model, batch, cfg.rollout.temperature) if reference else None))
            return update(model, opt, sched, batch, *a, **k)
        monkeypatch.setattr(RL, "build_rollout", spy_build)
        monkeypatch.setattr(U, "policy_update", spy_update)
    out = R.mopd_stage(cfg, base, {d: teacher for d in cfg.domain_names()}, progress=False)
    sd = load_model(out.model_dir).state_dict()
    digest = hashlib.sha256(b"".join(sd[k].numpy().tobytes() for k in sorted(sd))).hexdigest()
    return out.history, digest, generated, updated


def _reference_logp(model, batch, temperature):
    """The trainer's untruncated log-probs of the batch now: fp32 as the loop computes them (`completion_logprobs`),
    and float64 — a double copy of the model, log_softmax(logits / T) written out here."""
    T = batch.completion_ids.shape[1]
    with torch.no_grad():
        f32 = RO.completion_logprobs(model, batch, temperature)
        ids, am = batch.input_ids(), batch.attention_mask()
        logits, _ = forward(copy.deepcopy(model).double(), ids, am, RO.position_ids(am), logits_to_keep=T + 1)
        lp = torch.log_softmax(logits[:, :-1].double() / temperature, dim=-1)  # position P-1+t predicts token t
        f64 = lp.gather(-1, batch.completion_ids[..., None])[..., 0] * batch.completion_mask
    return f32, f64


def _results(history):
    """The step metrics without timings and memory (they differ between identical runs)."""
    return [{k: v for k, v in r.items() if not k.startswith(_TIMING) and not k.endswith("score_s")} for r in history]


# ------------------------------------------------------------------------------------------------ truncated


# the teachers score at the sampling temperature (the compatibility pre-flight refuses τ 1 against 0.5)
@pytest.mark.parametrize("extra", [["rollout.top_k=5", "rollout.top_p=0.9"],
                                   ["rollout.min_p=0.5", "rollout.temperature=0.5", "teachers.temperature=0.5"]])
def test_truncated_rollout_trains_on_the_trainers_recomputed_behaviour_logprobs(tmp_path, models, monkeypatch,
                                                                                 extra):
    calls = []
    real = RO.completion_logprobs
    monkeypatch.setattr(RO, "completion_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    history, _, generated, updated = _run(tmp_path, models, extra, monkeypatch)
    cfg = _cfg(tmp_path, extra)
    assert len(history) == len(generated) == len(updated) == 2
    # one recompute per step (the spy's fp32 reference adds one call per step of its own)
    assert len(calls) == 2 + 2
    for row, (eng, kw), (upd, (ref32, ref64)) in zip(history, generated, updated):
        assert (kw["top_k"], kw["min_p"], kw["top_p"]) == (cfg.rollout.top_k, cfg.rollout.min_p, cfg.rollout.top_p)
        cm = eng.completion_mask.bool()
        assert upd is not eng and torch.equal(upd.completion_ids, eng.completion_ids)
        assert upd.behaviour_logp.dtype == eng.behaviour_logp.dtype and (upd.behaviour_logp[~cm] == 0).all()
        # the update's π_old is the trainer's own untruncated distribution ...
        assert torch.allclose(upd.behaviour_logp, ref32, atol=1e-6, rtol=0)
        assert torch.allclose(upd.behaviour_logp.double(), ref64, atol=1e-5, rtol=0)
        # ... which the engine's processed (renormalised truncated) log-probs exceed by log(mass kept) ≥ 0
        diff = (eng.behaviour_logp - upd.behaviour_logp)[cm]
        assert (diff >= -1e-5).all() and diff.max() > 1e-3
        assert row["rollout/trunc_logp_gap"] > 0
        assert row["rollout/trunc_logp_gap"] == pytest.approx(float(diff.double().mean()), rel=1e-6)
        # one minibatch, fully on-policy: the first (only) update's ratio is 1 up to float rounding
        assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and abs(row["approx_kl"]) < 1e-6
        assert row["grad_norm"] > 0


# ------------------------------------------------------------------------------------------------ untruncated


def test_without_truncation_the_engines_batch_is_used_as_it_is_and_no_extra_forward_runs(tmp_path, models,
                                                                                      monkeypatch):
    monkeypatch.setattr(RO, "completion_logprobs", lambda *a, **k: pytest.fail("an extra forward ran"))
    monkeypatch.setattr(U, "recompute_behaviour_logp", lambda *a, **k: pytest.fail("recompute without truncation"))
    history, digest, generated, updated = _run(tmp_path / "a", models, monkeypatch=monkeypatch, reference=False)
    assert len(generated) == len(updated) == 2
    for row, (eng, kw), (upd, _) in zip(history, generated, updated):
        assert upd is eng  # the engine's batch, behaviour log-probs and all, untouched
        assert (kw["top_k"], kw["min_p"], kw["top_p"]) == (0, 0.0, 1.0)
        assert "rollout/trunc_logp_gap" not in row
    monkeypatch.undo()
    # the same recipe with the settings given explicitly at their "off" values: the identical run, bit for bit
    again, digest_again, _, _ = _run(tmp_path / "b", models, ["rollout.top_k=0", "rollout.min_p=0.0",
                                                              "rollout.top_p=1.0"])
    assert _results(again) == _results(history) and digest_again == digest
    assert history[0]["grad_norm"] > 0  # the steps really moved the weights


# ------------------------------------------------------------------------------------------------ config


def test_default_dump_and_fingerprints_are_unchanged():
    cfg = load_config("tiny")
    assert {s: R.stage_spec(cfg, s, INPUTS).fingerprint for s in DEFAULT_FPS} == DEFAULT_FPS
    dump = cfg.rollout.model_dump()
    assert "top_k" not in dump and "min_p" not in dump and not cfg.rollout.truncates
    assert R.behaviour_fingerprint_part(cfg) == []
    on = load_config("tiny", ["rollout.top_k=20", "rollout.min_p=0.05"])
    assert (on.rollout.model_dump()["top_k"], on.rollout.model_dump()["min_p"]) == (20, 0.05)
    fps = {s: R.stage_spec(on, s, INPUTS).fingerprint for s in DEFAULT_FPS}
    assert fps["sft"] == DEFAULT_FPS["sft"]  # SFT reads only rollout.max_new_tokens
    assert all(fps[s] != DEFAULT_FPS[s] for s in ("expert:math", "mopd", "evaluate"))


def test_a_top_p_stage_trained_before_the_recompute_is_not_reused(monkeypatch):
    cfg = load_config("tiny", ["rollout.top_p=0.9"])
    assert cfg.rollout.truncates and R.behaviour_fingerprint_part(cfg) == [{"behaviour_logp": "trainer_recomputed"}]
    now = {s: R.stage_spec(cfg, s, INPUTS).fingerprint for s in DEFAULT_FPS}
    from mopd_core.stages import identity

    monkeypatch.setattr(identity, "behaviour_fingerprint_part", lambda recipe: [])  # the identity before the recompute
    before = {s: R.stage_spec(cfg, s, INPUTS).fingerprint for s in DEFAULT_FPS}
    assert now["expert:math"] != before["expert:math"] and now["mopd"] != before["mopd"]
    assert now["sft"] == before["sft"] and now["evaluate"] == before["evaluate"]  # they never train on it


@pytest.mark.parametrize("item,needle", [
    ("rollout.top_k=-1", "rollout.top_k"), ("rollout.top_k=2.5", "rollout.top_k"),
    ("rollout.min_p=-0.1", "rollout.min_p"), ("rollout.min_p=1", "rollout.min_p"),
    ("rollout.top_p=0", "rollout.top_p"),
])
def test_bad_truncation_settings_are_one_line_errors_naming_the_field(item, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [item])
    assert "\n" not in str(e.value) and needle in str(e.value)
