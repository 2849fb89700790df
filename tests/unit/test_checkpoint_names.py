"""Checkpoint-name parsing lives in one place (`train/checkpoint.py`): the loop's `step-NNNNNN` and TRL's
`checkpoint-N` folders are ordered by step, not by name (checkpoint-10 is newer than checkpoint-9)."""

from __future__ import annotations

from mopd_core.train.checkpoint import checkpoint_dirs, checkpoint_step, last_checkpoint_step, trainer_checkpoints


def test_checkpoint_step_reads_both_name_forms():
    assert checkpoint_step("runs/t/student/checkpoints/step-000012") == 12
    assert checkpoint_step("runs/t/sft/trainer/checkpoint-250") == 250


def test_trainer_checkpoints_sort_by_step_and_the_loop_wins(tmp_path):
    assert trainer_checkpoints(tmp_path) == [] and last_checkpoint_step(tmp_path) == 0
    for n in (9, 10, 2):
        (tmp_path / "trainer" / f"checkpoint-{n}").mkdir(parents=True)
    assert [p.name for p in trainer_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-9", "checkpoint-10"]
    assert last_checkpoint_step(tmp_path) == 10
    for n in (3, 20):
        (tmp_path / "checkpoints" / f"step-{n:06d}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-000003" / "loop_state.pt").touch()  # step-000020 is incomplete
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step-000003"]
    assert last_checkpoint_step(tmp_path) == 3
