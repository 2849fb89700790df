"""The async pipeline's queue (`runtime.staleness`): bounded staleness (k versions used, k + 1 dropped and
counted), back-pressure, a stall that names its producers, a producer's error reaching the trainer."""

from __future__ import annotations

import threading
import time

import pytest

from mopd_core.errors import InfraError
from mopd_core.runtime.staleness import PipelineStalledError, StalenessQueue


def _fill(q, versions, producer="gen-0"):
    for i, v in enumerate(versions):
        q.put(f"group{i}@v{v}", v, producer, size=8)


def test_a_sample_k_versions_old_is_used_and_one_k_plus_1_old_is_dropped():
    for k in (0, 1, 2):
        q = StalenessQueue(maxsize=16, max_staleness=k)
        V = 5
        _fill(q, [V - k - 1, V - k, V - k - 1, V])  # too old, exactly k old, too old, current
        got = q.take(2, V, timeout_s=1)
        assert [s.item for s in got] == ["group1@v%d" % (V - k), f"group3@v{V}"]
        assert q.dropped == 2 and q.dropped_samples == 16 and q.taken == 2 and q.depth() == 0
        m = StalenessQueue.staleness(got, V)
        assert m["async/staleness_max"] == k and m["async/staleness_mean"] == k / 2
        assert m[f"async/staleness_frac/{k}"] == (0.5 if k else 1.0)


def test_k0_takes_only_the_current_version_in_order():
    q = StalenessQueue(maxsize=8, max_staleness=0)
    _fill(q, [3, 3, 3])
    assert [s.item for s in q.take(3, 3, timeout_s=1)] == ["group0@v3", "group1@v3", "group2@v3"]


def test_the_trainer_never_waits_forever_and_names_the_stalled_producer():
    q = StalenessQueue(maxsize=4, max_staleness=1)
    q.register("student-server-0")
    q.register("teacher-math")
    _fill(q, [0], producer="student-server-0")
    t0 = time.monotonic()
    with pytest.raises(PipelineStalledError) as e:
        q.take(2, 0, timeout_s=0.3)
    assert time.monotonic() - t0 < 2
    msg = str(e.value)
    assert isinstance(e.value, InfraError) and "\n" not in msg
    assert "got 1" in msg and "'student-server-0'" in msg and "'teacher-math'" in msg and "async.timeout_s" in msg


def test_a_producer_error_reaches_the_trainer():
    q = StalenessQueue(maxsize=4, max_staleness=1)
    boom = RuntimeError("teacher 'code' died")
    q.close(boom)
    with pytest.raises(RuntimeError, match="teacher 'code' died"):
        q.take(1, 0, timeout_s=5)


def test_back_pressure_blocks_a_producer_until_the_trainer_takes():
    q = StalenessQueue(maxsize=2, max_staleness=0)
    _fill(q, [0, 0])
    done = threading.Event()

    def produce():
        q.put("third", 0, "gen-0")  # blocks: the queue is full
        done.set()

    th = threading.Thread(target=produce)
    th.start()
    assert not done.wait(0.2)  # still blocked
    assert len(q.take(1, 0, timeout_s=1)) == 1
    assert done.wait(2)
    th.join()
    assert q.depth() == 2
    with pytest.raises(PipelineStalledError, match="the queue stayed full"):
        q.put("fourth", 0, "gen-0", timeout_s=0.1)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        StalenessQueue(4, -1)
    with pytest.raises(ValueError, match="maxsize must be >= 1"):
        StalenessQueue(0, 1)
