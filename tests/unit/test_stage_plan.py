"""The stage plan (`mopd_core.stages`): the identities it chains from the config are the ones the engine computes
from the folders the stages really write, and the folder record — done test, set aside, brought back, resume
step — behaves as the stages rely on."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from mopd_core import stages as S
from mopd_core.config import load_config
from tests.conftest import tiny_overrides


def _finish(spec: S.StageSpec) -> Path:
    """A finished stage folder as the engine leaves it (final/ with its identity file), without training."""
    (spec.stage_dir / "final").mkdir(parents=True, exist_ok=True)
    S.write_stage(spec.stage_dir, {"stage": spec.label, "fingerprint": spec.fingerprint, "status": "done",
                                   "steps": spec.steps})
    return spec.stage_dir / "final"


@pytest.mark.parametrize("student_init", ["previous", "sft"])
def test_the_plan_chains_the_identities_the_engine_computes_from_real_folders(tmp_path, student_init):
    cfg = load_config("tiny", tiny_overrides(tmp_path) + ["rounds=2", f"round_student_init={student_init}"])
    plan = S.stage_plan(cfg)
    assert [s.label for s in plan] == ["sft", "expert-math", "expert-code", "expert-if", "student",
                                       "r2-expert-math", "r2-expert-code", "r2-expert-if", "r2-student"]
    made = {}
    for spec in plan:  # each stage's fingerprint from the models its inputs really produced (paths, not ids)
        paths = {role: made[s] for role, s in spec.inputs.items()}
        if spec.kind == "sft":
            assert spec.fingerprint == S.sft_fingerprint(cfg, cfg.run_dir() / "base")
        elif spec.kind == "expert":
            assert spec.fingerprint == S.expert_fingerprint(cfg, spec.domain, paths["init"], spec.round)
        else:
            assert spec.fingerprint == S.mopd_fingerprint(cfg, paths["init"], S.teacher_roles(paths), spec.round)
        assert spec.stage_dir == S.stage_dir(cfg, spec.stage) and spec.done() is None
        made[spec.stage] = _finish(spec)
        assert S.model_ref_id(made[spec.stage]) == spec.output_id and spec.done() is not None
    student2 = plan[-1]
    assert student2.parent == "mopd" and plan[4].parent is None
    assert student2.inputs["init"] == ("mopd" if student_init == "previous" else "sft")
    rounds = S.plan_rounds(plan)
    assert [([e.stage for e in ex], st.stage) for ex, st in rounds] == [
        (["expert:math", "expert:code", "expert:if"], "mopd"),
        (["expert:math@r2", "expert:code@r2", "expert:if@r2"], "mopd@r2")]


def _tree(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def test_done_set_aside_bring_back_and_resume_live_in_the_folder_record(tmp_path):
    d = tmp_path / "run" / "expert-math"
    assert S.resume_step(d, "a", 4) == 0 and S.stage_done(d, "a", 4) is None
    assert S.claim_stage(d, "a", {"stage": "expert-math"}) is None  # a fresh folder, recorded as running
    for step in (2, 4):
        (d / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
        (d / "checkpoints" / f"step-{step:06d}" / "loop_state.pt").write_bytes(b"x")
    assert S.resume_step(d, "a", 6) == 4  # interrupted: resumes from its newest checkpoint
    (d / "final").mkdir()
    S.write_stage(d, {**S.read_stage(d), "status": "done", "steps": 4})
    assert S.finished(S.read_stage(d), "a", 4, d) and not S.finished(S.read_stage(d), "a", 6, d)
    assert S.resume_step(d, "a", 4) == 0 and S.resume_step(d, "a", 6) == 4  # raising steps continues it
    before = _tree(d)
    assert S.claim_stage(d, "b") is None  # another config: the finished folder is set aside, byte-identical
    assert _tree(d.with_name("expert-math@a")) == before and S.read_stage(d)["fingerprint"] == "b"
    assert S.stage_done(d, "a", 4) is not None and S.stage_done(d, "b", 4) is None  # found aside, read only
    assert S.resume_step(d, "a", 4) == 0
    d_b = _tree(d)
    assert S.claim_stage(d, "a")["status"] == "done"  # switching back: brought back, nothing retrained
    assert _tree(d) == before and _tree(d.with_name("expert-math@b")) == d_b
