"""`train.pipeline.AsyncPipeline` scheduling, with a recording stand-in for the student servers (the real ones:
tests/integration/test_async_mopd.py): which version generates each step, back-pressure, errors and stalls."""

from __future__ import annotations

import threading
import time

import pytest

from mopd_core.runtime.staleness import PipelineStalledError
from mopd_core.train.pipeline import AsyncPipeline, Produced
from mopd_core.train.roles.weight_sync import ServedSync


class _Batch:
    size = 4


class _Engine:
    """Records what the pipeline asks of a `ServedRollout`: versions written, loaded and generated with."""

    def __init__(self, start: int = 0):
        self.version, self.written, self.loaded = start, [], []

    def write_version(self, model, version):
        self.written.append(version)
        return {"seconds": 0.0, "bytes": 8}

    def load_version(self, version):
        self.loaded.append(version)
        self.version = version
        return {"seconds": 0.0}

    def prune(self, keep_from):
        pass


def _pipe(engine, k, steps=6, start=0, gen_s=0.0, fail_at=None, hang_at=None, timeout_s=30.0, queue_size=None):
    seen = {}

    def generate(s):
        if s == fail_at:
            raise ValueError(f"generation of step {s} broke")
        if s == hang_at:
            time.sleep(60)
        time.sleep(gen_s)
        seen[s] = engine.version
        return Produced(s, None, _Batch())

    return AsyncPipeline(sync=ServedSync(engine), generate=generate, score=lambda p: None, start=start, steps=steps,
                         max_staleness=k, queue_size=queue_size, timeout_s=timeout_s), seen


@pytest.mark.parametrize("k", [0, 1, 2])
def test_step_s_is_generated_by_version_s_minus_k(k):
    eng = _Engine()
    pipe, seen = _pipe(eng, k)
    pipe.start_threads()
    try:
        for s in range(6):
            p, m = pipe.take(s)
            assert p.step == s and p.version == max(0, s - k)
            assert m["async/staleness_max"] == s - p.version <= k
            assert m["async/dropped"] == 0
            pipe.publish(s + 1, model={})
    finally:
        pipe.close()
    assert seen == {s: max(0, s - k) for s in range(6)}  # the servers held exactly that version
    assert eng.written == [1, 2, 3, 4, 5, 6]


def test_resume_starts_at_the_checkpoint_version():
    eng = _Engine(start=3)
    pipe, seen = _pipe(eng, 2, steps=6, start=3)
    pipe.start_threads()
    try:
        for s in range(3, 6):
            p, _ = pipe.take(s)
            pipe.publish(s + 1, model={})
    finally:
        pipe.close()
    assert seen == {3: 3, 4: 3, 5: 3}  # nothing older than the checkpoint exists


def test_generation_never_runs_more_than_queue_size_steps_ahead():
    eng = _Engine()
    pipe, seen = _pipe(eng, 4, steps=8, queue_size=2)
    pipe.start_threads()
    try:
        time.sleep(0.5)  # the trainer takes nothing: generation stops after two steps
        assert sorted(seen) == [0, 1]
        pipe.take(0)
        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(seen) == [0, 1, 2]
    finally:
        pipe.close()


def test_a_producer_error_reaches_the_trainer_with_its_traceback():
    pipe, _ = _pipe(_Engine(), 1, fail_at=1)
    pipe.start_threads()
    try:
        pipe.take(0)
        pipe.publish(1, model={})
        with pytest.raises(ValueError, match="generation of step 1 broke"):
            pipe.take(1)
    finally:
        pipe.close()


def test_a_hung_generator_is_named_when_the_trainer_times_out():
    pipe, _ = _pipe(_Engine(), 1, hang_at=0, timeout_s=0.5)
    pipe.start_threads()
    t0 = time.monotonic()
    try:
        with pytest.raises(PipelineStalledError, match=r"generator: generating step 1 .* for \d+ s"):
            pipe.take(0)
    finally:
        threading.Thread(target=pipe.close, daemon=True).start()  # the hung thread is a daemon
    assert time.monotonic() - t0 < 5
