"""The imbalanced pair of configs/tiny_imbalanced.yaml: `mathchain` (a worked running sum, judged
by the `final_answer` verifier) and `ifshort` (one-digit answers over mathchain's characters) — answers recomputed
here, generation deterministic by seed, the answer-length ratio the benchmark relies on, and the preset."""

from __future__ import annotations

import functools
import json
import random
import re

import pytest

from mopd_core.config import load_config
from mopd_core.domains import DomainError, Example, build_domain, get_verifier
from mopd_core.errors import ConfigError


def _chain(prompt: str) -> str:
    m = re.fullmatch(r"(r?sum):(\d{2,6})=", prompt)
    assert m, prompt
    digits = [int(c) for c in (m[2] if m[1] == "sum" else m[2][::-1])]
    steps, acc = [], digits[0]
    for d in digits[1:]:
        steps.append(f"{acc}+{d}={acc + d}")
        acc += d
    assert acc == sum(digits)
    return ",".join(steps) + f";{acc}"


def _short(prompt: str) -> str:
    m = re.fullmatch(r"(mu|um):(\d{5})=", prompt)
    assert m, prompt
    return m[2][0] if m[1] == "mu" else m[2][-1]


def test_answers_are_right_and_both_tasks_occur():
    mc = build_domain("mathchain", "synthetic:mathchain", eval_size=50, seed=1)
    ifs = build_domain("ifshort", "synthetic:ifshort", eval_size=50, seed=1)
    for dom, expect in ((mc, _chain), (ifs, _short)):
        exs = dom.train_examples(400, random.Random(0)) + dom.eval_examples()
        assert all(e.answer == expect(e.prompt) and e.teacher_id == dom.name for e in exs)
        assert len({e.prompt.split(":")[0] for e in exs}) == 2


@pytest.mark.parametrize("kind", ["mathchain", "ifshort"])
def test_generation_is_deterministic_by_seed_and_never_trains_on_eval(kind):
    a = build_domain(kind, f"synthetic:{kind}", eval_size=100, seed=4)
    b = build_domain(kind, f"synthetic:{kind}", eval_size=100, seed=4)
    c = build_domain(kind, f"synthetic:{kind}", eval_size=100, seed=5)
    assert a.eval_examples() == b.eval_examples() != c.eval_examples()
    assert a.train_examples(200, random.Random(9)) == b.train_examples(200, random.Random(9))
    assert a.train_examples(200, random.Random(9)) != a.train_examples(200, random.Random(8))
    ev = {e.prompt for e in a.eval_examples()}
    assert not ev & {e.prompt for e in a.train_examples(3000, random.Random(0))}


def test_the_preset_loads_and_its_answers_differ_at_least_8x_in_length():
    cfg = load_config("tiny_imbalanced")
    assert cfg.domain_names() == ["mathchain", "ifshort"]
    assert cfg.model == load_config("tiny").model  # the same tiny model
    assert cfg.mopd.mix["ifshort"] >= 0.2  # the short domain holds >= 20 % of the prompts
    specs = {d.name: d for d in cfg.data.domains}
    lengths = {}
    for name, d in specs.items():
        dom = build_domain(name, d.source, d.params, eval_size=d.eval_size, seed=cfg.seed)
        exs = dom.train_examples(2000, random.Random(0))
        lengths[name] = sum(len(e.answer) for e in exs) / len(exs)
        # every SFT completion, stray "." and EOS included, fits the rollout budget
        assert max(len(e.fields.get("completion", e.answer)) for e in exs) + 1 <= cfg.rollout.max_new_tokens
        assert max(len(e.prompt) for e in exs) <= cfg.data.max_prompt_tokens
    assert lengths["mathchain"] >= 8 * lengths["ifshort"], lengths
    # the weak demonstrator is on (the RL headroom over SFT) and only on one task of each domain
    assert {n: d.params["weak_tasks"] for n, d in specs.items()} == {"mathchain": ["rsum"], "ifshort": ["first"]}


def test_the_preset_rejects_an_unknown_domain_param_naming_it():
    with pytest.raises((ConfigError, DomainError), match="terms"):
        build_domain("mathchain", "synthetic:mathchain", {"terms": 9}, eval_size=10)
    with pytest.raises(DomainError, match="length"):
        build_domain("ifshort", "synthetic:ifshort", {"length": 1}, eval_size=10)


def test_mathchain_reward_checks_the_final_answer_and_optionally_the_chain():
    dom = build_domain("mathchain", "synthetic:mathchain", eval_size=10, seed=0)
    ex = Example(prompt="sum:482=", teacher_id="mathchain", answer="4+8=12,12+2=14;14")
    assert dom.reward(ex, "4+8=12,12+2=14;14") == 1.0
    assert dom.reward(ex, " 2+8=10,10+4=14; 14\n") == 1.0  # another valid order, whitespace
    assert dom.reward(ex, "4+8=12,12+2=15;14") == 1.0  # final answer only by default
    for wrong in ("4+8=12,12+2=14;14.", "4+8=12,12+2=14;15", "14", "4+8=12,12+2=14", ""):
        assert dom.reward(ex, wrong) == 0.0, wrong
    strict = build_domain("mathchain", "synthetic:mathchain", {"check_chain": True}, eval_size=10)
    assert strict.reward(ex, "4+8=12,12+2=14;14") == 1.0
    for bad in ("4+8=12,12+2=15;14", "4+8=12,13+1=14;14", "4+8=13,13+1=14;14", "4+8=12,x;14", ";14"):
        assert strict.reward(ex, bad) == 0.0, bad


def test_each_weak_demonstrator_has_its_own_flaw_which_the_reward_rejects():
    mc = build_domain("mathchain", "synthetic:mathchain", {"weak_tasks": ["rsum"], "weak_rate": 1.0}, eval_size=10)
    ifs = build_domain("ifshort", "synthetic:ifshort", {"weak_tasks": ["first"], "weak_rate": 1.0}, eval_size=10)
    for dom, weak in ((mc, "rsum"), (ifs, "first")):
        exs = dom.train_examples(300, random.Random(0))
        flawed = [e for e in exs if "completion" in e.fields]
        assert {dom.task_of(e.prompt) for e in flawed} == {weak}  # every weak-task example, nothing else
        assert len(flawed) == sum(dom.task_of(e.prompt) == weak for e in exs)
        assert all(dom.reward(e, e.answer) == 1.0 for e in flawed)
        # rejected — unless ifshort's neighbouring digit happens to equal the first one
        wrong = [e for e in flawed if e.fields["completion"] != e.answer]
        assert len(wrong) > 0.8 * len(flawed) and all(dom.reward(e, e.fields["completion"]) == 0.0 for e in wrong)
    assert all(e.fields["completion"] == e.answer + "." for e in mc.train_examples(50, random.Random(1))
               if "completion" in e.fields)
    for e in ifs.train_examples(50, random.Random(1)):  # the neighbouring digit: the string's second
        if "completion" in e.fields:
            assert e.fields["completion"] == e.prompt.split(":")[1][1] and "." not in e.fields["completion"]


def test_ifshort_reward_is_exact_match():
    dom = build_domain("ifshort", "synthetic:ifshort", eval_size=10, seed=0)
    ex = Example(prompt="um:48213=", teacher_id="ifshort", answer="3")
    assert dom.reward(ex, "3") == 1.0 and dom.reward(ex, " 3\n") == 1.0
    assert dom.reward(ex, "3.") == 0.0 and dom.reward(ex, "1") == 0.0 and dom.reward(ex, "13") == 0.0
    assert dom.task_of("mu:48213=") == "first" and dom.task_of("um:48213=") == "last" and dom.task_of("x:1=") == ""


def test_ifshort_is_written_with_mathchain_characters_only():
    # no embedding row of its own: every update it gets is shared with the long domain, as in a real vocabulary
    # (the preset states it; the imbalance itself shows with letters of its own too)
    mc = build_domain("mathchain", "synthetic:mathchain", {"terms": 4}, eval_size=50, seed=0)
    ifs = build_domain("ifshort", "synthetic:ifshort", eval_size=50, seed=0)
    chars = lambda dom: {c for e in dom.train_examples(500, random.Random(0)) for c in e.prompt + e.answer}  # noqa: E731
    assert chars(ifs) <= chars(mc), chars(ifs) - chars(mc)


def test_final_answer_is_in_the_verifier_registry_with_checked_args():
    v = get_verifier("final_answer", sep="#")
    ex = Example(prompt="p", teacher_id="t", answer="work#42")
    assert v(ex, "other work#42") == 1.0 and v(ex, "#41") == 0.0 and v(ex, "42") == 0.0
    assert v.score(ex, "x#42").extracted == "42"
    with pytest.raises(DomainError, match="check_chain"):
        get_verifier("final_answer", check_chain="yes")
    with pytest.raises(DomainError, match="unknown verifier_args"):
        get_verifier("final_answer", mode="boxed")


def test_the_redrawn_ifshort_is_part_of_the_stage_identity_and_nothing_else_moves(monkeypatch):
    # ifshort draws other data than its first version from the same params: stages trained on it are retrained,
    # while every other recipe keeps its fingerprints (no global RESULTS_VERSION bump)
    from mopd_core.domains.build import kind_results_version
    from mopd_core.domains.synthetic import ShortInstructionDomain
    from mopd_core.recipe import data_fingerprint_part, sft_fingerprint

    marks = {d["name"]: d.get("kind_results_version") for d in data_fingerprint_part(load_config("tiny_imbalanced"))
             ["domains"]}
    assert marks == {"mathchain": None, "ifshort": 2}
    assert all("kind_results_version" not in d for d in data_fingerprint_part(load_config("tiny"))["domains"])
    assert kind_results_version("synthetic:math") == 1 and kind_results_version("data/x.jsonl") == 1
    imb, tiny = load_config("tiny_imbalanced"), load_config("tiny")
    now = sft_fingerprint(imb, "base"), sft_fingerprint(tiny, "base")
    monkeypatch.setattr(ShortInstructionDomain, "RESULTS_VERSION", 1)  # as the letters version was
    assert sft_fingerprint(imb, "base") != now[0] and sft_fingerprint(tiny, "base") == now[1]


@functools.cache
def _ablation_module():
    """benchmarks/mopd_ablation.py, loaded as a module once (benchmarks/ is no package)."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("mopd_ablation", bench / "mopd_ablation.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    return ab


def test_the_preset_runs_the_recommended_variant_and_the_ablation_spells_naive_out():
    # benchmarks/mopd_ablation.py: the preset's MOPD block is its best variant; naive is written out as overrides,
    # so neither moves when the preset's or the library's defaults (e.g. mopd.kd_loss) change
    import argparse

    ab = _ablation_module()
    args = argparse.Namespace(config="tiny_imbalanced", overrides=[], output_dir="runs/x")
    preset = load_config("tiny_imbalanced").mopd
    assert ab.variant_config(args, 0, ab.VARIANTS["k4_refresh_dense"][1]).mopd == preset
    knobs = ("kd_loss", "minibatches", "balance", "gap_following", "reward_refresh", "w_rl")
    assert all(k in preset.model_fields_set for k in knobs)  # written in the YAML, not taken from a default
    naive = ab.variant_config(args, 0, ab.VARIANTS["naive"][1]).mopd
    assert tuple(dict(naive)[k] for k in knobs) == ("sampled_rkl", 1, "none", False, False, 0.0)
    share = ab.variant_config(args, 0, ab.VARIANTS["share"][1]).mopd
    assert (share.balance, share.minibatches, share.kd_loss) == ("tokens", 1, "sampled_rkl")
    # the default run (TABLE) holds the paper's rows and the preset's variant, and only known variants
    assert set(ab.PAPER) | {"k4_refresh_dense"} <= set(ab.TABLE) <= set(ab.VARIANTS)


def test_merged_ablation_parts_report_their_summed_and_longest_wall_time():
    # parts merged by --collect may have run one after another: the table must not call the longest part's time
    # the whole benchmark's
    ab = _ablation_module()
    assert ab._wall({"wall_s": 90.0}) == "Wall time of the whole benchmark 1.5 min"
    assert ab._wall({"wall_s": 120.0, "parts_wall_s": [60.0, 120.0, 30.0]}) == \
        "Wall time: 3 parts, 3.5 min of job time in all, the longest 2.0 min"


def test_the_device_script_runs_the_cpu_tables_variants():
    # benchmarks/mopd_ablation_device.sh splits the variants into groups run side by side on the GPU; by default
    # they are the CPU table's rows, read from the benchmark: run the script's own line that makes them
    import re
    import subprocess
    import sys
    from pathlib import Path

    ab = _ablation_module()
    root = Path(__file__).resolve().parents[2]
    sh = (root / "benchmarks/mopd_ablation_device.sh").read_text()
    code = re.search(r"TABLE_HALVES='([^']+)'", sh).group(1)
    assert 'VGROUPS=${VGROUPS:-$("${PY:-python3}" -c "$TABLE_HALVES")}' in sh
    groups = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    assert len(groups.split()) == 2 and re.split(r"[ ,]", groups.strip()) == ab.TABLE


def _ablation_part(sft_wall: float | None, variant: str, wall: float | None) -> dict:
    """One --seeds 0 invocation's result as mopd_ablation.py writes it: two domains, one variant; a stage this
    invocation reused (trained by the other) carries no seconds."""
    acc = {"a": 0.5, "b": 0.5}
    return {"config": "tiny_imbalanced", "overrides": [], "seeds": [0], "variants": [variant], "domains": ["a", "b"],
            "metric": "mean@8", "torch_threads": 1, "wall_s": 200.0, "load_average_1m": {"start": 1.0, "end": 2.0},
            "skipped": {}, "command": f"--variants {variant}", "partial": None,
            "machine": {"cpu_model": "cpu", "cpu_count": 2, "torch": "t", "torch_cpu_capability": "c", "python": "3"},
            "per_seed": {"0": {"seed": 0, "wall_s": {} if sft_wall is None else {"sft": sft_wall},
                               "accuracy": {"sft": acc, "expert-a": {"a": 0.9, "b": 0.5},
                                            "expert-b": {"a": 0.5, "b": 0.9}},
                               "greedy": {}, "expert_own": {"a": 0.9, "b": 0.9},
                               "variants": {variant: {"accuracy": {"a": 0.7, "b": 0.7}, "total": 0.7,
                                                      "recovery": {"a": 0.5, "b": 0.5, "total": 0.5},
                                                      "wall_s": wall, "tokens": {}, "overrides": []}}}}}


def test_merged_parts_time_each_stage_by_the_invocation_that_trained_it(tmp_path):
    # two invocations side by side on one seed: the first trains SFT and `naive`, the second reuses SFT and a
    # `share` stage trained by an earlier run. The merged table times SFT by its trainer whichever part comes
    # first, and gives no seconds ('–') for a variant nobody here trained, not the look-up's near-zero
    ab = _ablation_module()
    trained, reused = _ablation_part(500.0, "naive", 120.0), _ablation_part(None, "share", None)
    for order in ((reused, trained), (trained, reused)):
        paths = []
        for i, part in enumerate(order):
            paths.append(tmp_path / f"p{i}.json")
            paths[-1].write_text(json.dumps(part))
        assert ab.collect([str(p) for p in paths], tmp_path / "out.json") == 0
        res = json.loads((tmp_path / "out.json").read_text())
        assert res["per_seed"]["0"]["wall_s"] == {"sft": 500.0}
        assert res["summary"]["variants"]["share"]["wall_s"]["mean"] is None
        md = (tmp_path / "out.md").read_text()
        assert "the seeds whose stage these invocations trained" in md and "sft 500." in md
        share_row = next(ln for ln in md.splitlines() if ln.startswith("| + token-share |"))
        assert share_row.endswith("| – | 29.22 |")
