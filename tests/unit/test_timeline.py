"""train.timeline: busy and overlap fractions of the loop's phases, and the Gantt chart."""

from __future__ import annotations

import pytest

from mopd_core.train import timeline


def test_a_synchronous_loop_never_overlaps():
    rows = [{"step": s + 1, "version": s, "generate": [3 * s, 3 * s + 1], "score": [3 * s + 1, 3 * s + 2],
             "train": [3 * s + 2, 3 * s + 3]} for s in range(4)]
    m = timeline.summary(rows)
    assert m["wall_s"] == 12
    assert m["overlap_frac"] == 0.0  # phases that touch do not overlap
    assert m["generate_busy_frac"] == m["score_busy_frac"] == m["train_busy_frac"] == pytest.approx(1 / 3)


def test_overlap_is_the_time_two_or_more_lanes_are_busy():
    # generate [0,4], score [1,3], train [2,6]: ≥ 2 busy on [1,4] → 3 of 6 s; a lane's own steps merge
    rows = [{"step": 1, "generate": [0, 2], "score": [1, 3], "train": [2, 6]},
            {"step": 2, "generate": [2, 4]}]
    m = timeline.summary(rows)
    assert m["wall_s"] == 6
    assert m["overlap_frac"] == pytest.approx(3 / 6)
    assert m["generate_busy_frac"] == pytest.approx(4 / 6)
    assert m["train_busy_frac"] == pytest.approx(4 / 6)
    assert timeline.summary([]) == {}


def test_rows_round_trip_and_plot(tmp_path):
    p = tmp_path / "timeline.jsonl"
    rows = [{"step": 1, "version": 0, "generate": [0.0, 1.0], "score": [1.0, 1.5], "train": [1.5, 2.0]},
            {"step": 2, "version": 0, "generate": [1.0, 2.0], "score": [2.0, 2.4], "train": [2.4, 3.0]}]
    for r in rows:
        timeline.append(p, r)
    assert timeline.read(p) == rows
    png = timeline.plot(rows, tmp_path / "plots" / "overlap.png", "student")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert timeline.plot([], tmp_path / "none.png") is None
