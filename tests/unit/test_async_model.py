"""`benchmarks/async_model.py`, the discrete-event model of sync vs async MOPD: its limits hold exactly."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "async_model", Path(__file__).resolve().parents[2] / "benchmarks" / "async_model.py")
am = importlib.util.module_from_spec(_spec)
sys.modules["async_model"] = am  # dataclasses resolve their annotations through it
_spec.loader.exec_module(am)


def test_sync_is_the_sum_of_the_phases():
    c = am.Costs(gen=1.2, score=0.4, train=0.6, sync=0.1)
    p = am.simulate(c, mode="sync", steps=10, chunks=8)
    assert p.seconds == pytest.approx(10 * 2.3) and p.max_staleness_seen == 0
    assert p.trainer_idle == pytest.approx(1 - 0.6 / 2.3)


@pytest.mark.parametrize("gen,score,train", [(1.2, 0.4, 0.6), (0.3, 0.2, 1.0), (0.5, 0.9, 0.4)])
def test_async_approaches_the_slowest_resource_and_staleness_stays_within_k(gen, score, train):
    c = am.Costs(gen=gen, score=score, train=train, sync=0.05)
    sync = am.simulate(c, mode="sync", steps=200, chunks=16)
    bound = max(gen, score, train + 0.05)  # per step: no pipeline can beat its slowest stage
    for k in (0, 1, 2, 4):
        p = am.simulate(c, mode="async", k=k, steps=200, chunks=16)
        assert p.max_staleness_seen <= k
        assert bound * 200 - 1e-9 <= p.seconds <= sync.seconds + 1e-9
        if k >= 1:  # one step of staleness is enough to overlap every phase here
            assert p.seconds / 200 == pytest.approx(bound, rel=0.03)
    k0 = am.simulate(c, mode="async", k=0, steps=200, chunks=16)
    assert k0.max_staleness_seen == 0 and k0.seconds < sync.seconds  # overlap within a step only


def test_more_devices_scale_their_phase():
    c = am.Costs(gen=2.0, score=1.0, train=1.0)
    one = am.simulate(c, mode="sync", steps=5, chunks=4)
    four = am.simulate(c, mode="sync", servers=4, teachers=4, workers=4, efficiency=0.5, steps=5, chunks=4)
    assert four.seconds == pytest.approx(5 * (0.5 + 0.25 + 0.5))
    assert one.seconds == pytest.approx(5 * 4.0)


def test_bad_inputs_are_refused():
    c = am.Costs(1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="mode must be sync or async"):
        am.simulate(c, mode="fast")
    with pytest.raises(ValueError, match="queue_size=2 is below one step's 4 chunks"):
        am.simulate(c, chunks=4, queue_size=2)
