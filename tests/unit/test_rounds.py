"""Multi-round MOPD without training: the stage plan, folders, labels (registered names) and fingerprints of
rounds=2 against rounds=1, and the one-line errors of bad round settings."""

from __future__ import annotations

import pytest

from mopd_core import recipe as R
from mopd_core.stages import identity as S
from mopd_core.config import load_config
from mopd_core.errors import ConfigError
from tests.conftest import tiny_overrides

INPUTS = {"init": "stage:abc:3", "teacher.math": "stage:m:3", "teacher.code": "stage:c:3", "teacher.if": "stage:i:3"}


@pytest.fixture
def cfgs(tmp_path):
    return load_config("tiny", tiny_overrides(tmp_path)), load_config("tiny", tiny_overrides(tmp_path) + ["rounds=2"])


def test_one_round_plan_is_the_single_round_recipe(cfgs):
    one, _ = cfgs
    teachers = {f"teacher.{d}": f"expert:{d}" for d in ("math", "code", "if")}
    assert [(s.stage, s.inputs) for s in R.stage_plan(one)] == [
        ("sft", {}), ("expert:math", {"init": "sft"}), ("expert:code", {"init": "sft"}),
        ("expert:if", {"init": "sft"}), ("mopd", {"init": "sft", **teachers})]
    assert [s.label for s in R.stage_plan(one)] == ["sft", "expert-math", "expert-code", "expert-if", "student"]
    assert R.last_student_label(one) == "student"


def test_two_round_plan_chains_round_two_to_round_one_student(cfgs, tmp_path):
    one, two = cfgs
    plan = {s.stage: s.inputs for s in R.stage_plan(two)}
    assert R.stage_plan(two)[:5] == R.stage_plan(one)  # round 1 as it was: the same stages, inputs and identities
    assert plan["expert:math@r2"] == {"init": "mopd"}  # experts re-trained from round 1's student
    assert plan["mopd@r2"] == {"init": "mopd", **{f"teacher.{d}": f"expert:{d}@r2" for d in ("math", "code", "if")}}
    fresh = two.model_copy(update={"round_student_init": "sft"})
    assert {s.stage: s.inputs for s in R.stage_plan(fresh)}["mopd@r2"]["init"] == "sft"
    assert [R.stage_label(s) for s in list(plan)[5:]] == ["r2-expert-math", "r2-expert-code", "r2-expert-if",
                                                          "r2-student"]
    assert R.last_student_label(two) == "r2-student"
    run = tmp_path / "t"
    assert R.stage_dir(two, "expert:math@r2") == run / "r2" / "expert-math"
    assert R.stage_dir(two, "mopd@r2") == run / "r2" / "student"
    assert R.stage_dir(two, "mopd") == run / "student" and R.stage_dir(two, "expert:if") == run / "expert-if"
    assert R.parse_stage("expert:code@r3") == ("expert", "code", 3)
    for bad in ("mopd@r1", "sft@r2", "mopd@rx", "student"):
        with pytest.raises(ValueError):
            R.parse_stage(bad)


def test_round_one_identities_are_unchanged_and_round_two_differs(cfgs):
    one, two = cfgs
    for s in ("sft", "expert:math", "mopd", "evaluate"):
        a, b = R.stage_spec(one, s, INPUTS), R.stage_spec(two, s, INPUTS)
        assert (a.fingerprint, a.stage_dir, a.label) == (b.fingerprint, b.stage_dir, b.label), s
    # the same inputs in round 2: another stage (another name → other prompts and samples), another folder
    r1, r2 = R.stage_spec(two, "expert:math", INPUTS), R.stage_spec(two, "expert:math@r2", INPUTS)
    assert r2.fingerprint != r1.fingerprint and r2.label == "r2-expert-math" and r2.steps == r1.steps
    m1, m2 = R.stage_spec(two, "mopd", INPUTS), R.stage_spec(two, "mopd@r2", INPUTS)
    assert m2.fingerprint != m1.fingerprint and m2.label == "r2-student"
    # the parent's identity is part of round 2's: a retrained round-1 student invalidates round 2
    other = R.stage_spec(two, "expert:math@r2", {**INPUTS, "init": "stage:zzz:3"})
    assert other.fingerprint != r2.fingerprint
    # engine and orchestrator agree (expert_fingerprint takes the input model, stage_spec its identity)
    assert S._expert_fp(two, "math", "stage:abc:3", 2) == r2.fingerprint


def test_rounds_leave_one_round_dumps_alone_and_bad_values_fail_in_one_line(cfgs, tmp_path):
    one, two = cfgs
    assert "rounds" not in one.model_dump(mode="json") and "round_student_init" not in one.model_dump()
    assert two.model_dump(mode="json")["rounds"] == 2
    for ov, words in ((["rounds=0"], "rounds=0"), (["rounds=-1"], "at least one round"),
                      (["round_student_init=sft"], "round_student_init=sft has no effect with rounds=1"),
                      (["rounds=2", "round_student_init=latest"], "round_student_init")):
        with pytest.raises(ConfigError) as e:
            load_config("tiny", tiny_overrides(tmp_path) + ov)
        msg = str(e.value)
        assert words in msg and "\n" not in msg, msg


def test_cli_round_flag_errors_are_one_line(capsys, tmp_path):
    from mopd_core.cli import main

    sets = [a for o in tiny_overrides(tmp_path) for a in ("--set", o)]
    assert main(["stage", "eval", *sets, "--model", "a=b", "--round", "2"]) == 2
    assert "--round is no option of `mopd stage eval`" in capsys.readouterr().err
    assert main(["stage", "expert", *sets, "--domain", "math", "--init", str(tmp_path), "--round", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --round 0") and "\n" not in err
    assert main(["recipe", *sets, "--set", "rounds=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "rounds=0" in err and "\n" not in err
