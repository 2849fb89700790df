"""A colocated MOPD stage through the recipe's own functions with `rollout.backend: hf_graphed` (its CPU path: the
static cache, the decode step uncaptured) gives the `hf` stage's numbers: same samples for the seed, so the same
metrics (the second step's through the first update's weights) up to the float rounding of the masked full-length
attention (~5e-7 in a log-prob; AdamW's first steps amplify it in near-zero-gradient weights, so the weights are
compared through the metrics, not element by element). The captured variant of this
stage is tests/device/test_colocated_step.py (`hf_graphed`)."""

from __future__ import annotations

import json
import math

from mopd_core import recipe as R
from mopd_core.config import load_config
from tests.conftest import perturbed_teachers, tiny_overrides


def _stage(tmp_path, backend: str, sft_dir=None, teachers=None):
    cfg = load_config("tiny", tiny_overrides(tmp_path / backend) + [
        "runtime.placement=colocated", f"rollout.backend={backend}", "mopd.steps=2", "mopd.save_every=2"])
    R.setup_runtime(cfg)
    if sft_dir is None:
        sft_dir = R.sft_stage(cfg, R.base_model(cfg), progress=False).model_dir
        # teachers that disagree with the student: real advantages (with the student's own weights the loss is
        # float noise around 0, and no comparison means anything)
        teachers = perturbed_teachers(cfg, sft_dir, tmp_path)
    out = R.mopd_stage(cfg, sft_dir, teachers, progress=False)
    rows = [json.loads(x) for x in (out.stage_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return (sft_dir, teachers), rows


def test_mopd_stage_with_the_graphed_engine_equals_the_hf_stage(tmp_path):
    (sft, teachers), hf_rows = _stage(tmp_path, "hf")
    _, g_rows = _stage(tmp_path, "hf_graphed", sft, teachers)
    assert len(hf_rows) == len(g_rows) == 2
    for a, b in zip(hf_rows, g_rows):
        for k in ("loss", "grad_norm"):
            assert math.isfinite(a[k]) and math.isclose(a[k], b[k], rel_tol=1e-3), (k, a[k], b[k])
    assert abs(hf_rows[0]["loss"]) > 1e-4  # the teachers disagree: a loss that is not float noise
