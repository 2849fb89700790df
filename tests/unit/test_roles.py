"""Each role of the policy loop (`mopd_core.train.roles`) alone: the weight-sync strategies and the phase scheduler
that calls them, the objective's choice and advantages, the scorer's rewards, the sources and the updaters. The
stand-in engines and trainer below only record what they are asked (the real vLLM engine, the student's servers
and the Ray workers are exercised by the integration tests); the models, optimizers and phase scheduler are real."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from mopd_core import algorithms as alg
from mopd_core import recipe as R
from mopd_core.config import LoRAConfig, load_config
from mopd_core.models import build_tiny, load_model, load_tokenizer
from mopd_core.models.lora import add_lora, export_state_dict, merged_copy
from mopd_core.rollout import HFRollout
from mopd_core.runtime import device as devlib
from mopd_core.runtime.phases import PhaseScheduler
from mopd_core.train.checkpoint import StageStateError
from mopd_core.train.pipeline import Produced
from mopd_core.train.roles import StageContext, load_policy
from mopd_core.train.roles.objective import (FullJSDLoss, JSDLoss, PlannedKD, RewardObjective, SampledKD,
                                             ScoredObjective, build_objective)
from mopd_core.train.roles.scorer import Scorer
from mopd_core.train.roles.source import Generator, InlineSource
from mopd_core.train.roles.updater import LocalUpdater, RemoteUpdater
from mopd_core.train.roles.weight_sync import EngineSync, IdentitySync, MergedSync, ServedSync
from tests.conftest import tiny_overrides


class RecordingEngine:
    """Stand-in for an engine with its own weights (vLLM in-process / the student's servers): records calls."""

    def __init__(self, version: int = 0) -> None:
        self.version, self.calls = version, []

    def sync_weights(self, model=None, version=None):
        self.calls.append(("sync", version))
        if version is not None:
            self.version = version
        return {"bytes_copied": 7}

    def sleep(self, level=None):
        self.calls.append(("sleep", None))

    def write_version(self, model, version):
        self.calls.append(("write", version))
        return {"seconds": 0.5, "bytes": 11}

    def load_version(self, version):
        self.calls.append(("load", version))
        self.version = version
        return {"seconds": 0.1}

    def prune(self, keep_from):
        self.calls.append(("prune", keep_from))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("roles")
    cfg = load_config("tiny", tiny_overrides(tmp))
    R.setup_runtime(cfg)
    torch.set_num_threads(1)
    return cfg, build_tiny(cfg.model, tmp / "init")


def _ctx(tiny, tmp_path: Path, section: str = "expert", teachers=None, **over) -> StageContext:
    cfg, init = tiny
    recipe = cfg.model_copy(deep=True)
    loop_cfg = getattr(recipe, section).model_copy(update=over)
    domains = R.build_domains(recipe, ["math"])
    return StageContext("s", loop_cfg, recipe, tmp_path, init, domains, domains, [1.0], load_tokenizer(init),
                        devlib.resolve("cpu"), teachers)


# ------------------------------------------------------------------------------------------------ weight sync

def test_engine_sync_hands_over_every_rollout_and_sleeps_only_when_colocated(tiny, tmp_path):
    model = load_model(tiny[1])
    eng = RecordingEngine()
    s = EngineSync(eng)
    m = s.push(model, 3)
    assert eng.calls == [("sync", None)] and s.version == 3 and m["weights/bytes_copied"] == 7.0
    s.after_rollout(colocated=False)
    s.after_rollout(colocated=True)
    assert eng.calls[1:] == [("sleep", None)]


def test_identity_sync_moves_no_bytes_and_keeps_sampling_the_trainers_module(tiny):
    model = load_model(tiny[1])
    eng = HFRollout(model, load_tokenizer(tiny[1]), torch.device("cpu"))
    m = IdentitySync(eng).push(model, 1)
    assert m["weights/bytes_copied"] == 0.0 and eng.model is model


def test_served_sync_skips_the_version_the_servers_hold_and_splits_publish_and_load(tiny):
    model = load_model(tiny[1])
    eng = RecordingEngine(version=2)
    s = ServedSync(eng, 2)
    assert s.push(model, 2) == {} and eng.calls == []
    m = s.push(model, 3)
    assert eng.calls == [("sync", 3)] and s.version == 3 and m["weights/bytes_copied"] == 7.0
    eng.calls.clear()
    assert s.publish(model, 4) == {"perf/publish_s": 0.5, "weights/bytes_written": 11.0}
    assert s.load(4) == {"seconds": 0.1} and s.load(4) == {}
    assert eng.calls == [("write", 4), ("load", 4), ("prune", 4)]


def test_merged_sync_refreshes_the_plain_copy_when_the_version_moves(tiny):
    cfg, init = tiny
    model = load_model(init)
    torch.manual_seed(0)
    add_lora(model, LoRAConfig(r=2, alpha=4))
    merged = merged_copy(model)
    s = MergedSync(None, merged, version=5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.1)
    assert s.push(model, 5) == {}  # the copy is current for the version it was made at
    assert s.push(model, 6)["weights/bytes_copied"] > 0
    want = export_state_dict(model)
    got = merged.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert s.sampler(model) is merged


def test_phase_scheduler_calls_the_weight_sync_with_the_steps_version(tiny):
    model = load_model(tiny[1])
    eng = RecordingEngine()
    ph = PhaseScheduler(kind="cpu", device=torch.device("cpu"), model=model, opt=None, sync=ServedSync(eng),
                        placement="colocated")
    ph.begin_step(1)
    with ph.rollout(0):  # the servers hold version 0 already
        pass
    ph.begin_step(2)
    with ph.rollout(1):
        pass
    m = ph.end_step()
    assert eng.calls == [("sync", 1)] and m["weights/bytes_copied"] == 7.0 and "perf/weight_sync_s" in m


# ------------------------------------------------------------------------------------------------ objective

class _Teachers:
    """Stand-in router: only its presence matters to `build_objective`."""


@pytest.mark.parametrize("over,teachers,kind", [
    ({}, None, RewardObjective),
    ({"kd_loss": "sampled_rkl"}, _Teachers(), SampledKD),
    ({"kd_loss": "sampled_rkl", "w_kd": 0.0, "w_rl": 1.0}, _Teachers(), SampledKD),
    ({"kd_loss": "jsd"}, _Teachers(), JSDLoss),
    ({"kd_loss": "full_jsd"}, _Teachers(), FullJSDLoss),
    ({"kd_loss": "full_jsd", "w_kd": 0.0, "w_rl": 1.0}, _Teachers(), ScoredObjective),
    ({"kd_loss": "topk_rkl"}, _Teachers(), PlannedKD),
    ({"kd_loss": "sampled_rkl", "gap_following": True}, _Teachers(), PlannedKD),
])
def test_build_objective_picks_one_class_per_config(tiny, tmp_path, over, teachers, kind):
    ctx = _ctx(tiny, tmp_path, "mopd", teachers, **over)
    assert type(build_objective(ctx)) is kind


def _batch_parts(tiny):
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    behaviour = -torch.rand(4, 3, generator=g)
    teacher = -torch.rand(4, 3, generator=g)

    class B:  # the fields the objectives read
        examples = [type("E", (), {"teacher_id": "math"})() for _ in range(4)]
        behaviour_logp = behaviour
    return B(), mask, teacher


def test_reward_objective_is_grpo_times_w_rl(tiny, tmp_path):
    ctx = _ctx(tiny, tmp_path, "expert", group_size=2, w_rl=0.5)
    batch, mask, _ = _batch_parts(tiny)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    m = {}
    a = RewardObjective(ctx).advantage({"rewards": rewards, "routed": None}, batch, mask, m)
    want = 0.5 * alg.grpo_advantages(rewards, 2, scale_by_std=ctx.cfg.scale_by_std)[:, None] * mask
    assert torch.equal(a.adv, want) and a.plan is None and a.routed is None and "adv/rl_abs_mean" in m


def test_sampled_kd_adds_the_clipped_reverse_kl_and_reports_token_shares(tiny, tmp_path):
    ctx = _ctx(tiny, tmp_path, "mopd", _Teachers(), group_size=2, w_rl=0.0, w_kd=2.0, kd_clip=0.3)
    batch, mask, teacher = _batch_parts(tiny)
    routed = type("Routed", (), {"logp": teacher, "span_cut": None})()
    m = {}
    a = SampledKD(ctx).advantage({"rewards": torch.zeros(4), "routed": routed}, batch, mask, m)
    want = 2.0 * ((teacher - batch.behaviour_logp).clamp(-0.3, 0.3) * mask)
    assert torch.allclose(a.adv, want, atol=1e-7)
    assert m["token_share/math"] == 1.0 and m["grad_share/math"] == 1.0 and "adv/kd_mean" in m


# ------------------------------------------------------------------------------------------------ source + scorer

def test_inline_source_generates_in_the_rollout_phase_and_scores_rewards(tiny, tmp_path):
    ctx = _ctx(tiny, tmp_path, "expert", prompts_per_step=2, group_size=2)
    model = load_policy(ctx, None)
    eng = HFRollout(model, ctx.tokenizer, ctx.device)
    phases = []
    src = InlineSource(Generator(ctx, eng, phase=lambda step: phases.append(step) or torch.no_grad()),
                       Scorer(ctx, model, RewardObjective(ctx), eng.stop_ids()))
    p, m = src.take(3)
    assert phases == [3] and m == {} and p.step == p.version == 3 and p.batch.size == 4
    assert p.scored["rewards"].shape == (4,) and p.scored["routed"] is None and p.scored["teacher_stats"] == {}
    again, _ = src.take(3)  # the step's randomness is (seed, stage, step): the same samples again
    assert torch.equal(again.batch.completion_ids, p.batch.completion_ids)
    assert src.after_update(4, model) == {}


# ------------------------------------------------------------------------------------------------ updaters

def test_lr_schedule_warms_up_then_decays_to_the_floor_at_the_last_optimizer_step():
    import math

    from mopd_core.config import PolicyLoopConfig
    from mopd_core.train.update import lr_lambda

    const = lr_lambda(PolicyLoopConfig(steps=10, warmup_steps=4))
    assert [const(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]  # the warm-up as before
    # cosine over steps × minibatches optimizer steps (the scheduler steps per minibatch): 1 right after the
    # warm-up, min_lr_ratio at the last one, never below it, never rising
    c = PolicyLoopConfig(steps=10, minibatches=2, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    f = [lr_lambda(c)(s) for s in range(25)]
    assert f[:3] == [0.5, 1.0, 1.0] and f[19] == pytest.approx(0.1, abs=1e-12) and min(f) == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[1:], f[2:]))
    assert f[2 + 8] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 8 / 17)), abs=1e-12)
    lin = lr_lambda(PolicyLoopConfig(steps=5, lr_schedule="linear"))
    assert [lin(s) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    with pytest.raises(ValueError, match="min_lr_ratio=0.1 has no effect with lr_schedule=constant"):
        PolicyLoopConfig(min_lr_ratio=0.1)
    # the warm-up counts optimizer steps, as the scheduler does: 15 fits a 10-step stage at K=2 (20 of them)
    assert PolicyLoopConfig(steps=10, minibatches=2, warmup_steps=15).warmup_steps == 15
    with pytest.raises(ValueError, match="warmup_steps=21 > the stage's 20 optimizer steps"):
        PolicyLoopConfig(steps=10, minibatches=2, warmup_steps=21)
    # the defaults stay out of the config dump: a run that does not set them keeps its stage fingerprint
    dump = PolicyLoopConfig().model_dump()
    assert "lr_schedule" not in dump and "min_lr_ratio" not in dump


def test_local_updater_steps_the_weights_and_refuses_a_sharded_checkpoint(tiny, tmp_path):
    ctx = _ctx(tiny, tmp_path, "expert", prompts_per_step=2, group_size=2, lr=1e-2)
    model = load_policy(ctx, None)
    eng = HFRollout(model, ctx.tokenizer, ctx.device)
    src = InlineSource(Generator(ctx, eng), Scorer(ctx, model, RewardObjective(ctx), eng.stop_ids()))
    p, _ = src.take(0)
    mask = p.batch.completion_mask.float()
    adv = RewardObjective(ctx).advantage({"rewards": torch.tensor([1.0, 0.0, 0.0, 1.0]), "routed": None}, p.batch,
                                         mask, {})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    up = LocalUpdater(ctx, model)
    upd = up.update(p.batch, adv, random.Random(0), None)
    assert upd["grad_norm"] > 0 and up.lr(upd) == pytest.approx(1e-2 * min(1.0, 2 / ctx.cfg.warmup_steps)
                                                                if ctx.cfg.warmup_steps else 1e-2)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    sharded = _ctx(tiny, tmp_path, "expert")
    sharded.ckpts, sharded.state = [tmp_path / "checkpoints" / "step-000001"], {"optimizer": None, "step": 1}
    with pytest.raises(StageStateError, match="sharded optimizer state"):
        LocalUpdater(sharded, model)


class RecordingTrainer:
    """Stand-in `PolicyTrainer` (the Ray one needs a cluster): returns fixed weights, records the seed."""

    def __init__(self, weights):
        self.weights, self.seeds, self.closed = weights, [], 0

    def start(self, model_dir, resume=None, scheduler_state=None):
        return {"model_dir": str(model_dir)}

    def update(self, batch, advantages, token_weights, *, temperature, seed, routed=None):
        self.seeds.append(seed)
        return {"loss": 0.0, "grad_norm": 1.0, "lr": 0.25}

    def state_dict(self):
        return self.weights

    def close(self):
        self.closed += 1


def test_remote_updater_copies_the_workers_weights_back_and_records_where_they_ran(tiny, tmp_path):
    ctx = _ctx(tiny, tmp_path, "expert")
    model = load_model(tiny[1])
    target = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    tr = RecordingTrainer(target)
    up = RemoteUpdater(ctx, model, tr)
    up.start()
    assert (tmp_path / "stage.json").exists() and "distributed" in (tmp_path / "stage.json").read_text()
    from mopd_core.train.roles.objective import Advantage

    upd = up.update(None, Advantage(torch.zeros(1), None), random.Random(7), None)
    assert tr.seeds == [random.Random(7).getrandbits(31)] and up.lr(upd) == 0.25
    assert all(torch.equal(v, target[k]) for k, v in model.state_dict().items())
    one_process = _ctx(tiny, tmp_path, "expert")
    one_process.ckpts, one_process.state = [tmp_path / "step-000001"], {"optimizer": {"state": {}}, "step": 1}
    with pytest.raises(StageStateError, match="in one process"):
        RemoteUpdater(one_process, model, tr)


def test_produced_carries_the_steps_rng_after_its_draws(tiny, tmp_path):
    ctx = _ctx(tiny, tmp_path, "expert", prompts_per_step=1, group_size=2)
    model = load_model(tiny[1])
    p = Generator(ctx, HFRollout(model, ctx.tokenizer, ctx.device))(0)
    assert isinstance(p, Produced) and p.times["generate"][0] <= p.times["generate"][1]
    fresh = ctx.step_rng(0)
    assert p.rng.random() != fresh.random()  # the prompt and seed draws were taken from it
