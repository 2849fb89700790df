"""Recovery as a live metric and a gate (`train.roles.recovery`, `mopd.stop_at_recovery`): values against a hand
computation, the gate stopping a domain's sampling (the role with a scripted eval, and a real tiny run whose
stage ends once every domain stopped), its restore on resume, the references read from stage records, and bad
input refused in one line."""

from __future__ import annotations

import json
import math
import random

import pytest

from mopd_core import recipe as R
from mopd_core.config import load_config
from mopd_core.errors import ConfigError
from mopd_core.models import build_tiny
from mopd_core.stages import stage_plan, write_stage
from mopd_core.train.loop import run_policy_loop
from mopd_core.train.roles import RecoveryGate, RecoveryRefs
from mopd_core.train.roles.source import sample_prompts
from tests.conftest import tiny_overrides

REFS = RecoveryRefs(sft={"math": {"greedy": 0.40}, "code": {"greedy": 0.50}, "if": {"greedy": 0.30}},
                    expert={"math": {"greedy": 0.90}, "code": {"greedy": 0.70}, "if": {"greedy": 0.30}})
NAMES = ["math", "code", "if"]


def _scores(math_, code, if_=0.3):
    return {"math": {"greedy": math_}, "code": {"greedy": code}, "if": {"greedy": if_}}


def test_recovery_values_match_a_hand_computation():
    gate = RecoveryGate(REFS, {}, NAMES)
    m = gate.observe(10, _scores(0.65, 0.55))
    assert m["recovery/math"] == pytest.approx((0.65 - 0.40) / (0.90 - 0.40))  # 0.5
    assert m["recovery/code"] == pytest.approx((0.55 - 0.50) / (0.70 - 0.50))  # 0.25
    # the total: mean student − mean SFT over mean expert − mean SFT, on the three domains
    assert m["recovery/total"] == pytest.approx(((0.65 + 0.55 + 0.3) / 3 - 0.4) / ((0.9 + 0.7 + 0.3) / 3 - 0.4))
    assert "recovery/if" not in m  # the expert did not move off SFT: undefined, not logged
    assert math.isnan(gate.values(_scores(0.65, 0.55))["if"])
    assert RecoveryGate(None, {}, NAMES).observe(10, _scores(0.65, 0.55)) == {}  # no references: nothing


def test_the_gate_stops_a_domain_at_its_target_and_the_stage_when_all_stopped():
    gate = RecoveryGate(REFS, {"math": 0.5, "code": 0.9}, NAMES)
    mix = [0.4, 0.4, 0.2]
    assert "recovery_stop/math" not in gate.observe(10, _scores(0.60, 0.55))  # 0.4 < 0.5
    assert gate.mix(mix) == mix
    m = gate.observe(20, _scores(0.66, 0.60))  # math 0.52 ≥ 0.5; code 0.5 < 0.9
    assert m["recovery_stop/math"] == 1.0 and "recovery_stop/code" not in m
    assert gate.stopped == {"math": 20} and gate.mix(mix) == [0.0, 0.4, 0.2]
    rng = random.Random(0)
    doms = {n: _Domain(n) for n in NAMES}
    assert {e for e in sample_prompts(doms, gate.mix(mix), 500, rng)} == {"code", "if"}  # math never sampled
    gate.observe(30, _scores(0.50, 0.70))  # a stopped domain stays stopped when its recovery drops again
    assert gate.stopped == {"math": 20, "code": 30}
    assert list(gate.steps(30, 40, mix)) == list(range(30, 40))  # 'if' (no target) still trains
    assert list(gate.steps(30, 40, [0.5, 0.5, 0.0])) == []  # every domain in the mix stopped: the stage ends
    resumed = RecoveryGate(REFS, {"math": 0.5, "code": 0.9}, NAMES)
    resumed.restore([{"step": 10}, {"step": 20, "recovery_stop/math": 1.0},
                     {"step": 30, "recovery_stop/math": 1.0, "recovery_stop/code": 1.0}])
    assert resumed.stopped == gate.stopped


class _Domain:
    def __init__(self, name):
        self.name = name

    def train_examples(self, n, rng):
        return [self.name] * n


@pytest.mark.parametrize("over, msg", [
    (["mopd.stop_at_recovery=0"], "mopd: stop_at_recovery=0.0 is outside (0, 1.5]"),
    (["mopd.stop_at_recovery=1.6"], "mopd: stop_at_recovery=1.6 is outside (0, 1.5]"),
    (["mopd.stop_at_recovery={math: -1}"], "mopd: stop_at_recovery.math=-1.0 is outside (0, 1.5]"),
    (["mopd.stop_at_recovery={chem: 0.9}"], "mopd.stop_at_recovery names unknown domain 'chem'; known: ['code', "
                                            "'if', 'math'] — name a domain of data.domains or give one number for all"),
    (["mopd.eval_every=0", "mopd.stop_at_recovery=0.9"], "stop_at_recovery acts on the mid-training evals, but "
                                                         "eval_every=0"),
])
def test_bad_stop_at_recovery_is_one_line(over, msg, tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["mopd.eval_every=10", *over])
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_references_come_from_the_stage_records_and_a_gated_domain_without_them_is_refused(tmp_path):
    cfg = load_config("tiny", tiny_overrides(tmp_path) + ["mopd.eval_every=1", "mopd.stop_at_recovery={code: 0.8}"])
    plan = {s.stage: s for s in stage_plan(cfg)}

    def done(spec, scores, fingerprint=None):
        (spec.stage_dir / "final").mkdir(parents=True)
        write_stage(spec.stage_dir, {"status": "done", "fingerprint": fingerprint or spec.fingerprint,
                                     "steps": spec.steps, "eval": scores})

    done(plan["sft"], _scores(0.4, 0.5))
    done(plan["expert:math"], _scores(0.9, 0.6))
    done(plan["expert:code"], _scores(0.5, 0.8), fingerprint="another-config")  # not this recipe's expert
    with pytest.raises(ConfigError) as e:  # code's expert has no record of its own: refused before any compute
        R.recovery_references(cfg, "elsewhere/final", {})
    assert str(e.value).startswith("mopd.stop_at_recovery gates domain 'code', but no finished SFT and expert-code "
                                   "stage records its eval")
    # a teacher given as a stage's final/ dir: its own record, whatever config made it
    refs = R.recovery_references(cfg, "elsewhere/final", {"code": plan["expert:code"].stage_dir / "final"})
    assert refs.domains == ["math", "code"]
    assert refs.expert == {"math": {"greedy": 0.9}, "code": {"greedy": 0.8}}  # each expert on its own domain
    assert refs.sources == {"sft": str(plan["sft"].stage_dir), "expert-math": str(plan["expert:math"].stage_dir),
                            "expert-code": str(plan["expert:code"].stage_dir)}


def test_recovery_of_an_evaluation_row_against_its_sft_and_expert_rows(tmp_path):
    cfg = load_config("tiny", tiny_overrides(tmp_path))
    acc = {"sft": _scores(0.4, 0.5), "expert-math": _scores(0.9, 0.6), "expert-code": _scores(0.5, 0.7),
           "student": _scores(0.65, 0.6), "champion": _scores(0.9, 0.5)}
    rec = R.recovery_of(cfg, acc, "student")
    assert rec["math"] == pytest.approx(0.5) and rec["code"] == pytest.approx(0.5) and "if" not in rec
    assert R.recovery_of(cfg, acc, "champion")["math"] == pytest.approx(1.0)
    assert R.recovery_of(cfg, {"student": acc["student"]}, "student") == {}  # no sft row: nothing to say


def test_a_real_run_stops_sampling_each_recovered_domain_and_ends_when_all_have(tmp_path):
    """Two domains, one step between evals; the references are planted so that math recovers at the first eval
    whatever the student scores (SFT −1, expert 0: any accuracy ≥ 0 is recovery ≥ 1) while code cannot (SFT 1,
    expert 2) until the test's second stage gates only math. The stage logs recovery per domain, stops sampling
    math after its first eval, and a stage gating every domain ends there."""
    cfg = load_config("tiny", tiny_overrides(tmp_path) + [
        "mopd.w_kd=0", "mopd.w_rl=1", "mopd.steps=4", "mopd.eval_every=1", "mopd.eval_size=4",
        "mopd.prompts_per_step=4", "mopd.stop_at_recovery={math: 1.0}"])
    R.setup_runtime(cfg)
    init = build_tiny(cfg.model, tmp_path / "init")
    domains = R.build_domains(cfg, ["math", "code"])
    refs = RecoveryRefs(sft={"math": {"greedy": -1.0}, "code": {"greedy": 1.0}},
                        expert={"math": {"greedy": 0.0}, "code": {"greedy": 2.0}})
    res = run_policy_loop(stage="student", loop_cfg=cfg.mopd, recipe=cfg, init_path=init, domains=domains,
                          eval_domains=domains, stage_dir=tmp_path / "student", fingerprint="f", progress=False,
                          recovery=refs)
    rows = [json.loads(x) for x in (tmp_path / "student" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # code has no target: all steps run
    assert all("recovery/math" in r and "recovery/code" in r for r in rows[:3])  # every mid-training eval
    assert rows[0]["recovery/math"] >= 1.0 and rows[0]["recovery_stop/math"] == 1.0
    assert all(not any(k.startswith("reward/math") for k in r) for r in rows[1:])  # no math prompt after step 1
    assert all("reward/code" in r for r in rows)
    info = json.loads((tmp_path / "student" / "stage.json").read_text())["recovery"]
    assert info["stopped"] == {"math": 1} and info["last_step"] == 4 and set(res.recovery) >= {"math", "code"}

    every = cfg.model_copy(update={"mopd": cfg.mopd.model_copy(update={"stop_at_recovery": 1.0})})
    refs_all = RecoveryRefs(sft={"math": {"greedy": -1.0}, "code": {"greedy": -1.0}},
                            expert={"math": {"greedy": 0.0}, "code": {"greedy": 0.0}})
    run_policy_loop(stage="student", loop_cfg=every.mopd, recipe=every, init_path=init, domains=domains,
                    eval_domains=domains, stage_dir=tmp_path / "all", fingerprint="g", progress=False,
                    recovery=refs_all)
    rows = [json.loads(x) for x in (tmp_path / "all" / "metrics.jsonl").read_text().splitlines()]
    info = json.loads((tmp_path / "all" / "stage.json").read_text())
    assert [r["step"] for r in rows] == [1]  # both recovered at the first eval: the stage ended there
    assert info["status"] == "done" and info["recovery"]["stopped"] == {"math": 1, "code": 1}
    assert info["recovery"]["last_step"] == 1 and (tmp_path / "all" / "final").is_dir()
