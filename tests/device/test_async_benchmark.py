"""`benchmarks/async_pipeline.py` on a lent accelerator: the same benchmark as on the CPU machine,
trainer on the device and the student/teacher vLLM servers from this Python (`pip install -e .[vllm]`), short
enough for the device budget (8 MOPD steps per mode, seed 0). Checks what the CPU run checks: every mode trains
the same number of steps, k = 1 runs about one version behind with nothing dropped, and writes its JSON + table
(beside the CPU results, not over them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from device_common import record, require, require_vllm

pytestmark = pytest.mark.device
ROOT = Path(__file__).resolve().parents[2]


def test_async_pipeline_benchmark_on_device(tmp_path):
    kind = require()
    require_vllm()
    out = ROOT / "benchmarks" / "results" / f"async_pipeline_{kind}"
    env = {**os.environ, "MOPD_VLLM_PYTHON": sys.executable}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "async_pipeline.py"), "--device", kind, "--steps", "8",
           "--teachers", "http", "--run-dir", str(tmp_path / "runs"), "--out", str(out),
           "--set", "sft.steps=100", "--set", "expert.steps=10"]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, timeout=540)
    res = json.loads(out.with_suffix(".json").read_text())
    per = res["seeds"]["0"]
    assert {per[m]["steps"] for m in ("sync", "k1", "k2")} == {8}
    assert per["sync"]["staleness_mean"] == 0.0 and 0.5 < per["k1"]["staleness_mean"] <= 1.0
    assert per["k1"]["dropped"] == 0
    record("async_pipeline", kind=kind, **{m: {k: per[m][k] for k in ("steps_per_s", "trainer_idle_frac",
                                                                        "overlap_frac")} for m in ("sync", "k1", "k2")})
