"""Stages on the tiny model for a few steps: parameters change, losses stay finite, checkpoints reload to
identical logits, a resumed run's next step equals an uninterrupted run's, bad input fails before compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mopd_core import recipe as R
from mopd_core.models import load_model, load_tokenizer
from tests.conftest import perturbed_teachers
from mopd_core.train.checkpoint import checkpoint_dirs


def _params(path):
    return {k: v.clone() for k, v in load_model(path).state_dict().items()}


def _changed(a, b) -> int:
    return sum(not torch.equal(a[k], b[k]) for k in a)


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """One tiny SFT shared by the tests of this module (each then trains its own RL stage from it)."""
    from mopd_core.config import load_config
    from tests.conftest import tiny_overrides, with_short_domain

    cfg = with_short_domain(load_config("tiny", tiny_overrides(tmp_path_factory.mktemp("sft")) +
                                        ["sft.eval_every=4", "sft.eval_size=4"]))
    R.setup_runtime(cfg)
    torch.set_num_threads(1)
    base = R.base_model(cfg)
    out = R.sft_stage(cfg, base, progress=False)
    return cfg, base, out


def test_sft_changes_parameters_and_logs_finite_loss(sft_run):
    cfg, base, out = sft_run
    assert _changed(_params(base), _params(out.model_dir)) == len(_params(base))
    assert not out.reused and R.sft_stage(cfg, base, progress=False).reused  # the second call trains nothing
    rows = _rows(out.stage_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert 0.0 <= rows[1]["eval/math/greedy"] <= 1.0 and "eval/math/greedy" not in rows[0]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert set(out.eval) == {"math", "code", "if", "short"}
    info = json.loads((out.stage_dir / "stage.json").read_text())
    assert info["status"] == "done"


def test_checkpoint_reloads_to_identical_logits(sft_run):
    _, _, out = sft_run
    m1, m2 = load_model(out.model_dir).eval(), load_model(out.model_dir).eval()
    tok = load_tokenizer(out.model_dir)
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(m1(input_ids=ids).logits, m2(input_ids=ids).logits)


def test_expert_rl_updates_and_logs_design_metrics(sft_run):
    cfg, _, sft = sft_run
    out = R.expert_stage(cfg, "short", sft.model_dir, progress=False)
    assert _changed(_params(sft.model_dir), _params(out.model_dir)) > 0
    rows = _rows(out.stage_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("reward/short", "length/short", "loss", "grad_norm", "entropy", "clip_frac",
                    "perf/tokens_per_s", "perf/rollout_s", "perf/train_s", "perf/pad_frac", "mem/host_rss_mb"):
            assert key in r, key
        assert 0.0 <= r["reward/short"] <= 1.0
        assert torch.isfinite(torch.tensor(r["loss"]))
        assert not any(k.startswith("reward/math") for k in r)  # the expert only sees its own domain
    # the last checkpoint holds the final weights and the optimizer state
    ck = checkpoint_dirs(out.stage_dir)[-1]
    assert ck.name == "step-000003"
    st = torch.load(ck / "loop_state.pt", weights_only=False)
    assert st["step"] == 3 and st["optimizer"]["state"]


def test_token_budget_micro_batches_train_the_same_first_step_with_less_padding(sft_run, tmp_path):
    """train.max_tokens_per_micro_batch through the real loop: step 1 (same rollouts, same weights) has the loss
    and gradient norm of the padded single micro-batch, in more, less padded forwards."""
    cfg, _, sft = sft_run
    rows = {}
    for name, budget in (("padded", None), ("budget", 64)):
        c = cfg.model_copy(update={"output_dir": str(tmp_path / name)}, deep=True)
        c.train.max_tokens_per_micro_batch = budget
        rows[name] = _rows(R.expert_stage(c, "short", sft.model_dir, progress=False).stage_dir / "metrics.jsonl")
    a, b = rows["padded"][0], rows["budget"][0]
    for k in ("loss", "grad_norm", "entropy", "clip_frac"):
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    assert a["perf/micro_batches"] == 1 and b["perf/micro_batches"] > 1
    assert 0.0 <= b["perf/pad_frac"] < a["perf/pad_frac"] < 1.0
    assert len(rows["budget"]) == 3


def test_mopd_routes_each_sample_to_its_teacher(sft_run, tmp_path):
    cfg, _, sft = sft_run
    cfg = cfg.model_copy(update={"output_dir": str(tmp_path)})
    teachers = perturbed_teachers(cfg, sft.model_dir, tmp_path)
    out = R.mopd_stage(cfg, sft.model_dir, teachers, progress=False)
    assert _changed(_params(sft.model_dir), _params(out.model_dir)) > 0
    assert not out.reused and R.mopd_stage(cfg, sft.model_dir, teachers, progress=False).reused
    rows = _rows(out.stage_dir / "metrics.jsonl")
    assert len(rows) == 3
    for r in rows:
        fr = {k: v for k, v in r.items() if k.startswith("teacher_token_frac/")}
        assert fr and abs(sum(fr.values()) - 1.0) < 1e-6
        assert any(k.startswith("reverse_kl/") for k in r)
        assert "adv/kd_mean" in r and "perf/score_s" in r


def test_mopd_mixture_and_jsd_modes_run(sft_run, tmp_path):
    cfg, _, sft = sft_run
    teachers = perturbed_teachers(cfg, sft.model_dir, tmp_path)
    c1 = cfg.model_copy(update={"output_dir": str(tmp_path / "mix")}, deep=True)
    c1.teachers.routing, c1.teachers.mixture_kind = "mixture", "geometric"
    c1.mopd.steps = 2
    out = R.mopd_stage(c1, sft.model_dir, teachers, progress=False)
    r = _rows(out.stage_dir / "metrics.jsonl")[-1]
    assert abs(r["teacher_token_frac/math"] - 1 / 4) < 1e-6  # every teacher scores every token
    c2 = cfg.model_copy(update={"output_dir": str(tmp_path / "jsd")}, deep=True)
    c2.mopd.kd_loss, c2.mopd.jsd_beta, c2.mopd.steps, c2.mopd.balance = "jsd", 0.5, 2, "tokens"
    out = R.mopd_stage(c2, sft.model_dir, teachers, progress=False)
    r = _rows(out.stage_dir / "metrics.jsonl")[-1]
    assert r["jsd"] > 0 and torch.isfinite(torch.tensor(r["loss"]))


class _Stop(Exception):
    pass


def test_resumed_run_next_step_equals_uninterrupted(sft_run, tmp_path):
    cfg, _, sft = sft_run
    cfg = cfg.model_copy(update={"output_dir": str(tmp_path / "a")}, deep=True)
    cfg.expert.steps, cfg.expert.save_every = 4, 2
    full = R.expert_stage(cfg, "short", sft.model_dir, progress=False)
    full_rows = _rows(full.stage_dir / "metrics.jsonl")

    cfg_b = cfg.model_copy(update={"output_dir": str(tmp_path / "b")}, deep=True)
    from mopd_core.train import loop as L

    orig = L.run_policy_loop

    def interrupted(**kw):
        def on_step(step, m):
            if step == 3:  # after the step-2 checkpoint, before step 4
                raise _Stop
        return orig(**kw, on_step=on_step)

    L_run = R.__dict__.get("run_policy_loop")
    assert L_run is None  # recipe imports the loop lazily, so patching the module attribute is enough
    L.run_policy_loop = interrupted
    try:
        with pytest.raises(_Stop):
            R.expert_stage(cfg_b, "short", sft.model_dir, progress=False)
    finally:
        L.run_policy_loop = orig
    stage_b = Path(cfg_b.output_dir) / cfg_b.name / "expert-short"
    assert [c.name for c in checkpoint_dirs(stage_b)] == ["step-000002"]
    resumed = R.expert_stage(cfg_b, "short", sft.model_dir, progress=False)
    rows_b = _rows(stage_b / "metrics.jsonl")
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]  # the interrupted step 3 is not duplicated
    assert full_rows[2]["grad_norm"] > 0  # the steps compared really trained
    for key in ("loss", "reward/short", "grad_norm", "length/short"):
        assert rows_b[2][key] == pytest.approx(full_rows[2][key], rel=1e-5, abs=1e-7), key
        assert rows_b[3][key] == pytest.approx(full_rows[3][key], rel=1e-5, abs=1e-7), key
    a, b = _params(full.model_dir), _params(resumed.model_dir)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


def test_finished_stage_is_reused_and_other_config_set_aside(sft_run, tmp_path):
    cfg, _, sft = sft_run
    cfg = cfg.model_copy(update={"output_dir": str(tmp_path)}, deep=True)
    cfg.expert.steps = 1
    first = R.expert_stage(cfg, "short", sft.model_dir, progress=False)
    weights = first.model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    again = R.expert_stage(cfg, "short", sft.model_dir, progress=False)
    assert (again.model_dir / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not retrained
    # the output says so (a benchmark must not report the look-up's seconds as the stage's training time)
    assert not first.reused and again.reused
    old_fp = json.loads((first.stage_dir / "stage.json").read_text())["fingerprint"]

    other = cfg.model_copy(deep=True)
    other.expert.lr = 1e-3
    assert not R.expert_stage(other, "short", sft.model_dir, progress=False).reused  # another config: trained;
    # the old folder is kept
    aside = first.stage_dir.with_name(f"expert-short@{old_fp}")
    assert (aside / "final" / "model.safetensors").stat().st_mtime_ns == mtime
    new_fp = json.loads((first.stage_dir / "stage.json").read_text())["fingerprint"]
    assert new_fp != old_fp

    back = R.expert_stage(cfg, "short", sft.model_dir, progress=False)  # switching back retrains nothing
    assert (back.model_dir / "model.safetensors").stat().st_mtime_ns == mtime and back.reused
    assert first.stage_dir.with_name(f"expert-short@{new_fp}").exists() and not aside.exists()


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(sft_run, tmp_path, monkeypatch):
    cfg, _, sft = sft_run
    cfg = cfg.model_copy(update={"output_dir": str(tmp_path)}, deep=True)
    cfg.expert.steps, cfg.expert.save_every = 4, 2
    from mopd_core import algorithms as alg
    from mopd_core.train import loop as L

    real = alg.policy_loss
    calls = {"n": 0}

    def poisoned(*a, **kw):
        calls["n"] += 1
        loss, met = real(*a, **kw)
        return (loss * float("nan"), met) if calls["n"] == 3 else (loss, met)

    monkeypatch.setattr(alg, "policy_loss", poisoned)
    with pytest.raises(L.NonFiniteLossError, match=r"step 3\b.*step-000002"):
        R.expert_stage(cfg, "short", sft.model_dir, progress=False)
    stage = Path(cfg.output_dir) / cfg.name / "expert-short"
    cks = checkpoint_dirs(stage)
    assert [c.name for c in cks] == ["step-000002"]
    m = load_model(cks[0] / "model")
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert not (stage / "final").exists()


def test_raising_steps_continues_a_finished_stage(sft_run, tmp_path):
    """steps 2 → 4 resumes from the step-2 checkpoint and ends where a fresh 4-step run ends."""
    cfg, _, sft = sft_run
    short = cfg.model_copy(update={"output_dir": str(tmp_path / "x")}, deep=True)
    short.expert.steps, short.expert.save_every = 2, 100
    R.expert_stage(short, "short", sft.model_dir, progress=False)
    longer = short.model_copy(deep=True)
    longer.expert.steps = 4
    ext = R.expert_stage(longer, "short", sft.model_dir, progress=False)
    assert [r["step"] for r in _rows(ext.stage_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    fresh_cfg = longer.model_copy(update={"output_dir": str(tmp_path / "y")}, deep=True)
    fresh = R.expert_stage(fresh_cfg, "short", sft.model_dir, progress=False)
    a, b = _params(ext.model_dir), _params(fresh.model_dir)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    fewer = short.model_copy(deep=True)
    fewer.expert.steps = 1
    from mopd_core.train.checkpoint import StageStateError

    with pytest.raises(StageStateError, match="already trained 4 steps"):
        R.expert_stage(fewer, "short", sft.model_dir, progress=False)
