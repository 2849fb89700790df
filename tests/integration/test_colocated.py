"""`runtime.placement: colocated` on the tiny model: the phase scheduler takes turns (rollout → each teacher in
turn → train), offloads optimizer state and gradients after training, never holds two teachers at once, logs
per-phase memory, and changes no number; the memory pre-flight refuses a plan that cannot fit, before compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mopd_core import recipe as R
from mopd_core.runtime.phases import ColocationError


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """SFT model + three different teachers (base, sft, and a perturbed sft)."""
    from mopd_core.config import load_config
    from mopd_core.models import load_model, load_tokenizer, save_pretrained
    from tests.conftest import tiny_overrides

    tmp = tmp_path_factory.mktemp("coloc")
    cfg = load_config("tiny", tiny_overrides(tmp / "runs") + ["mopd.steps=2", "mopd.save_every=1"])
    R.setup_runtime(cfg)
    torch.set_num_threads(1)
    base = R.base_model(cfg)
    sft = R.sft_stage(cfg, base, progress=False).model_dir
    m = load_model(sft)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * torch.randn_like(p))
    third = save_pretrained(m, load_tokenizer(sft), tmp / "perturbed")
    return cfg, sft, {"math": sft, "code": base, "if": third}


def _stage(cfg, sft, teachers, out: Path, **runtime):
    c = cfg.model_copy(update={"output_dir": str(out)}, deep=True)
    for k, v in runtime.items():
        section, field = k.split("__")
        setattr(getattr(c, section), field, v)
    return R.mopd_stage(c, sft, teachers, progress=False)


def test_colocated_phases_take_turns_and_change_no_number(trained, tmp_path):
    cfg, sft, teachers = trained
    co = _stage(cfg, sft, teachers, tmp_path / "co", runtime__placement="colocated", teachers__offload=True)
    events = _rows(co.stage_dir / "phases.jsonl")
    assert {e["step"] for e in events} == {1, 2}
    for step in (1, 2):
        ev = [e for e in events if e["step"] == step]
        # the order of one step: rollout, each teacher alone, train
        order = [e["phase"] for e in ev if e["at"] == "start"]
        assert order == ["rollout", "score", "score", "score", "train"], order
        scored = [e for e in ev if e["phase"] == "score" and e["at"] == "start"]
        assert sorted(e["teacher"] for e in scored) == ["code", "if", "math"]
        for e in scored:  # loaded alone, next to the student, and its bytes are counted
            assert e["teachers_resident"] == [e["teacher"]]
            assert e["teachers_mb"] > 0
        assert all(len(e["teachers_resident"]) <= 1 for e in ev)
        # after training, optimizer state and gradients are offloaded: the next phases hold only the weights
        end = next(e for e in ev if e["phase"] == "train" and e["at"] == "end")
        assert end["optim_mb"] == 0 and end["grads_mb"] == 0 and end["teachers_mb"] == 0
        start = next(e for e in ev if e["phase"] == "train" and e["at"] == "start")
        assert start["optim_mb"] > 0 or step == 1  # AdamW state exists from the first update on
        peak = next(e for e in ev if e["phase"] == "train" and e["at"] == "updated")
        assert peak["optim_mb"] == pytest.approx(2 * peak["weights_mb"]) and peak["grads_mb"] == peak["weights_mb"]
    rows = _rows(co.stage_dir / "metrics.jsonl")
    for r in rows:
        assert r["colocated/max_teachers_resident"] == 1
        assert r["mem/train/resident_mb"] > r["mem/rollout/resident_mb"] > 0
        assert r["mem/score/resident_mb"] > r["mem/rollout/resident_mb"]
        assert "mem/train/host_rss_mb" in r
    info = json.loads((co.stage_dir / "stage.json").read_text())
    assert info["placement"] == {"mode": "colocated", "max_teachers_resident": 1}

    # the same stage without offloading (disaggregated): identical numbers, every teacher resident throughout
    dis = _stage(cfg, sft, teachers, tmp_path / "dis", runtime__placement="disaggregated", teachers__offload=False)
    for a, b in zip(rows, _rows(dis.stage_dir / "metrics.jsonl")):
        for k in ("loss", "grad_norm", "reverse_kl/math", "reverse_kl/code", "reverse_kl/if", "reward/mean"):
            assert a[k] == b[k], k
        assert b["colocated/max_teachers_resident"] == 3
    from mopd_core.models import load_model

    sa, sb = load_model(co.model_dir).state_dict(), load_model(dis.model_dir).state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_colocated_resume_restores_offloaded_optimizer_state(trained, tmp_path):
    """A checkpoint written while the optimizer state was offloaded resumes to the same next step."""
    cfg, sft, teachers = trained
    full = _stage(cfg, sft, teachers, tmp_path / "full")
    c1 = cfg.model_copy(update={"output_dir": str(tmp_path / "part")}, deep=True)
    c1.mopd.steps = 1
    R.mopd_stage(c1, sft, teachers, progress=False)
    resumed = _stage(cfg, sft, teachers, tmp_path / "part")
    a, b = _rows(full.stage_dir / "metrics.jsonl"), _rows(resumed.stage_dir / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2]
    assert a[1]["loss"] == b[1]["loss"] and a[1]["grad_norm"] == b[1]["grad_norm"]
    assert [e["step"] for e in _rows(resumed.stage_dir / "phases.jsonl")].count(2) > 0


def test_plan_that_cannot_fit_fails_before_compute(trained, tmp_path):
    from mopd_core.models import load_model

    cfg, sft, teachers = trained
    w = sum(p.numel() * p.element_size() for p in load_model(sft).parameters()) / 2**30  # GiB, all models equal
    # 4w (train, + one micro-batch's activations) and 2w (student + one teacher) fit 4.5w; student + three resident
    # teachers (4w) + grads/optim do not
    from mopd_core import preflight
    from mopd_core.models import inspect_checkpoint, model_shape, model_widths

    conf = inspect_checkpoint(sft).config
    act = preflight.update_activation_bytes(cfg, "student", model_shape(conf), model_widths(conf))
    budget = 4.5 * w + act / 2**30
    ok = _stage(cfg, sft, teachers, tmp_path / "ok", runtime__memory_limit_gib=budget, teachers__offload=True)
    assert (ok.stage_dir / "final").exists()
    out = tmp_path / "no"
    with pytest.raises(ColocationError) as e:
        _stage(cfg, sft, teachers, out, runtime__memory_limit_gib=budget, teachers__offload=False)
    msg = str(e.value)
    assert "\n" not in msg and "runtime.memory_limit_gib" in msg and "teachers.offload" in msg and "3 teacher" in msg
    assert not (out / "t" / "student" / "metrics.jsonl").exists()
