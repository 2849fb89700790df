"""The MOPD objectives in the one policy loop on the tiny model: Open-MOPD's dense top-K reverse KL with
gap-following and reward refresh (two minibatches) trains, logs its per-domain gaps and scales, and the
full-vocabulary JSD and the teacher-conflict policy run through the same stage."""

from __future__ import annotations

import json

import torch

from mopd_core import recipe as R
from mopd_core.config import load_config
from mopd_core.models import load_model
from tests.conftest import perturbed_teachers, tiny_overrides


def test_topk_rkl_gap_following_and_refresh_train_and_log(tmp_path):
    cfg = load_config("tiny", tiny_overrides(tmp_path) + [
        "sft.steps=2", "mopd.steps=2", "mopd.kd_loss=topk_rkl", "mopd.kd_top_k=4", "mopd.gap_following=true",
        "mopd.reward_refresh=true", "mopd.minibatches=2", "mopd.balance=tokens", "mopd.w_rl=0.5"])
    R.setup_runtime(cfg)
    torch.set_num_threads(1)
    sft = R.sft_stage(cfg, R.base_model(cfg), progress=False).model_dir
    teachers = perturbed_teachers(cfg, sft, tmp_path)
    out = R.mopd_stage(cfg, sft, teachers, progress=False)
    before, after = load_model(sft).state_dict(), load_model(out.model_dir).state_dict()
    assert sum(not torch.equal(before[k], after[k]) for k in before) > 0
    rows = [json.loads(x) for x in (out.stage_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(rows) == 2
    for r in rows:
        doms = [d for d in cfg.domain_names() if f"gap/m/{d}" in r]
        assert doms and all(f"gap/scale/{d}" in r for d in doms)
        assert all(0.05 <= r[f"gap/scale/{d}"] <= 20 for d in doms)
        assert 1.0 <= r["kd/candidates_per_token"] <= 4.0
        assert "refresh/kd_adv_change" in r and "adv/kd_mean" in r and torch.isfinite(torch.tensor(r["loss"]))
        assert abs(sum(r[f"grad_share/{d}"] for d in doms) - 1) < 1e-6
    # the second step's running gap continues the first (EMA with momentum 0.9)
    d = next(d for d in cfg.domain_names() if f"gap/m/{d}" in rows[0] and f"gap/m/{d}" in rows[1])
    assert rows[1][f"gap/m/{d}"] != rows[0][f"gap/m/{d}"]
    assert rows[1]["refresh/kd_adv_change"] > 0  # the second minibatch saw a student the first had moved

    # full-vocabulary JSD and the conflict policy of a mixture, one step each, through the same stage
    c2 = cfg.model_copy(update={"output_dir": str(tmp_path / "full")}, deep=True)
    c2.mopd.kd_loss, c2.mopd.jsd_beta, c2.mopd.steps = "full_jsd", 0.5, 1
    c2.mopd.gap_following = c2.mopd.reward_refresh = False
    r = json.loads((R.mopd_stage(c2, sft, teachers, progress=False).stage_dir / "metrics.jsonl").read_text()
                   .splitlines()[-1])
    assert r["jsd"] > 0
    # a mixture's conflicting tokens take the most conservative teacher's target over every candidate
    c3 = cfg.model_copy(update={"output_dir": str(tmp_path / "conflict")}, deep=True)
    c3.teachers.routing, c3.teachers.conflict, c3.teachers.conflict_nats = "mixture", "consensus", 0.01
    c3.mopd.steps = 1
    r = json.loads((R.mopd_stage(c3, sft, teachers, progress=False).stage_dir / "metrics.jsonl").read_text()
                   .splitlines()[-1])
    assert 0 < r["conflict/frac"] < 1
    # the union of the student's and the teacher's top-K (two student passes, the teacher scores both)
    c4 = cfg.model_copy(update={"output_dir": str(tmp_path / "union")}, deep=True)
    c4.mopd.kd_candidates, c4.mopd.steps = "union", 1
    r = json.loads((R.mopd_stage(c4, sft, teachers, progress=False).stage_dir / "metrics.jsonl").read_text()
                   .splitlines()[-1])
    assert 4.0 <= r["kd/candidates_per_token"] <= 8.0
