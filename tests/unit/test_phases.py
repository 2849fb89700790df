"""The colocated memory pre-flight: each phase's need from tensor sizes, per placement and teacher offload."""

from __future__ import annotations

import pytest

from mopd_core.runtime.phases import ColocationError, check_colocated_fit

MB = 2**20


def _need(placement, offload, limit_gib=None):
    return check_colocated_fit(kind="cpu", limit_gib=limit_gib, student_bytes=100 * MB, optimizer_factor=2.0,
                               teacher_bytes={"math": 80 * MB, "code": 120 * MB}, teachers_offload=offload,
                               placement=placement)


def test_phase_needs_per_placement():
    # colocated + offload: train 4w; rollout w; score w + the largest teacher
    assert _need("colocated", True) == {"train": 400, "rollout": 100, "score (code)": 220}
    # disaggregated: the training state stays through every phase
    assert _need("disaggregated", True) == {"train": 400, "rollout": 400, "score (code)": 520}
    # no offload: both teachers resident in every phase
    assert _need("colocated", False) == {"train": 600, "rollout": 300, "score (all teachers)": 300}


def test_over_budget_names_phase_and_fix():
    budget = 450 / 1024  # GiB: colocated+offload (max 400 MiB) fits, no offload (600) does not
    _need("colocated", True, budget)
    with pytest.raises(ColocationError) as e:
        _need("colocated", False, budget)
    msg = str(e.value)
    assert "phase 'train' needs 0.586 GiB" in msg and "budget is 0.439 GiB" in msg and "2 teacher(s) all " \
        "resident (teachers.offload=false)" in msg and "\n" not in msg


def test_fsdp2_shards_the_training_state_and_the_error_says_so():
    """Per rank under FSDP2: (weights + grads + AdamW) / N, plus the driver's copy of the weights for rollout."""
    kw = dict(kind="cpu", student_bytes=100 * MB, optimizer_factor=2.0, teacher_bytes={}, teachers_offload=True,
              placement="colocated")
    assert check_colocated_fit(limit_gib=None, shards=4, driver_copy=True, **kw)["train"] == 100 + 100
    assert check_colocated_fit(limit_gib=None, shards=1, **kw)["train"] == 400
    check_colocated_fit(limit_gib=250 / 1024, shards=4, driver_copy=True, **kw)  # fits sharded
    with pytest.raises(ColocationError) as e:
        check_colocated_fit(limit_gib=250 / 1024, shards=1, **kw)
    msg = str(e.value)
    assert "phase 'train' needs 0.391 GiB per device" in msg and "runtime.strategy=fsdp2" in msg
    assert "\n" not in msg
