"""The one stage identity: what goes into a stage's fingerprint and what does not."""

from __future__ import annotations

import shutil

import pytest

from mopd_core import config as C
from mopd_core import recipe as R
from mopd_core.stages import identity as S
from mopd_core.config import load_config
from mopd_core.train.checkpoint import MODEL_IDENTITY, write_stage
from tests.conftest import tiny_overrides


@pytest.fixture
def cfg(tmp_path):
    return load_config("tiny", tiny_overrides(tmp_path))


def _ids(cfg, **kw):
    return {s: R.stage_spec(cfg, s, {"init": "stage:abc:3", "teacher.math": "stage:m:3",
                                         "teacher.code": "stage:c:3", "teacher.if": "stage:i:3", **kw})
            for s in ("sft", "expert:math", "mopd")}


def test_cadence_paths_and_steps_are_no_part_of_the_fingerprint(cfg, tmp_path):
    base = _ids(cfg)
    same = cfg.model_copy(deep=True)
    same.output_dir = str(tmp_path / "elsewhere")
    same.sft.logging_steps, same.sft.eval_every = 3, 0
    same.expert.save_every = same.mopd.save_every = 7
    same.mopd.steps, same.expert.steps = 99, 42
    same.teachers.request_timeout_s = 999.0
    for s, ident in _ids(same).items():
        assert ident.fingerprint == base[s].fingerprint, s
    assert _ids(same)["mopd"].steps == 99 != base["mopd"].steps  # steps travel beside the fingerprint


def test_result_fields_inputs_seed_and_results_version_are(cfg, monkeypatch):
    base = _ids(cfg)
    other = cfg.model_copy(deep=True)
    other.mopd.lr = 1e-3
    assert _ids(other)["mopd"].fingerprint != base["mopd"].fingerprint
    assert _ids(other)["sft"].fingerprint == base["sft"].fingerprint
    assert _ids(cfg, init="stage:zzz:3")["expert:math"].fingerprint != base["expert:math"].fingerprint
    assert _ids(cfg.model_copy(update={"seed": 1}))["sft"].fingerprint != base["sft"].fingerprint
    monkeypatch.setattr(C, "RESULTS_VERSION", C.RESULTS_VERSION + 1)
    assert all(_ids(cfg)[s].fingerprint != base[s].fingerprint for s in base)


def test_engine_and_orchestrator_compute_the_same_fingerprint(cfg, tmp_path):
    base = R.base_model(cfg)
    assert R.stage_spec(cfg, "sft", {}).fingerprint == R.sft_fingerprint(cfg, base)  # known before the build
    final = tmp_path / "t" / "sft" / "final"
    shutil.copytree(base, final)
    write_stage(final.parent, {"stage": "sft", "fingerprint": "f00", "status": "done", "steps": 6})
    assert (final / MODEL_IDENTITY).exists()
    ident = R.stage_spec(cfg, "expert:math", {"init": R.model_ref_id(final)})
    assert ident.fingerprint == R.expert_fingerprint(cfg, "math", final)
    # the identity travels with the model dir: a copy elsewhere (a registry download) is the same input
    moved = tmp_path / "download" / "model"
    shutil.copytree(final, moved)
    assert R.model_ref_id(moved) == R.model_ref_id(final) == "stage:f00:6"
    assert R.expert_fingerprint(cfg, "math", moved) == ident.fingerprint


def test_benchmarks_change_only_the_eval_identity_and_a_template_counts_by_content(tmp_path):
    """eval_sources are what the eval stage measures, not what a stage trains: adding one leaves SFT, the experts
    and MOPD reusable and changes the evaluate fingerprint. A chat-template override counts by its content: an
    edited file is another identity, the same file elsewhere is not."""
    from mopd_core.config import load_config

    real = "data/real_mini/math.jsonl"
    dom = f"data.domains=[{{name: math, source: {real}, verifier: math_verify, eval_size: 4}}]"
    ov = [o for o in tiny_overrides(tmp_path) if not o.startswith("data.domains")] + [
        dom, "sft.mix=null", "mopd.mix=null", "data.max_prompt_tokens=200"]
    base = load_config("tiny", ov)
    bench = load_config("tiny", ov[:-3] + [
        f"data.domains=[{{name: math, source: {real}, verifier: math_verify, eval_size: 4, eval_sources: "
        f"[{{name: m, source: {real}, verifier: math_verify}}]}}]", *ov[-3:]])
    for s, ident in _ids(bench).items():
        assert ident.fingerprint == _ids(base)[s].fingerprint, s
    assert S._eval_fp(bench, {"student": "x"}) != S._eval_fp(base, {"student": "x"})

    def with_template(path):
        return load_config("tiny", ov + ["model.tiny.chat=true", "data.chat.enabled=true",
                                         f"data.chat.chat_template={path}"])
    a, b = tmp_path / "a.jinja", tmp_path / "b.jinja"
    a.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    b.write_text(a.read_text())
    fa, fb = _ids(with_template(a))["sft"].fingerprint, _ids(with_template(b))["sft"].fingerprint
    assert fa == fb  # the same template under another path
    b.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert _ids(with_template(b))["sft"].fingerprint != fa  # an edited template
