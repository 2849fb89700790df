"""The pure helpers of the peer benchmarks (`benchmarks/peer_stats.py`, the summaries and tables of
`benchmarks/vs_trl.py` and `benchmarks/sample_efficiency.py`): spreads, paired ratios, table rendering and the
90 %-crossing / seesaw detection, on hand-made numbers whose answers are known."""

from __future__ import annotations

import importlib.util
import math
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


ps = _load("peer_stats")
vs = _load("vs_trl")


def test_mean_std_matches_statistics_and_one_value_has_no_spread():
    vals = [0.31, 0.29, 0.40]
    m, s = ps.mean_std(vals)
    assert m == pytest.approx(statistics.fmean(vals)) and s == pytest.approx(statistics.stdev(vals))
    assert ps.mean_std([0.5]) == (0.5, None)
    assert math.isnan(ps.mean_std([])[0])
    assert ps.fmt_pm([1.0, 3.0], 1) == "2.0 ± 1.4"
    assert ps.fmt_pm([0.5], 1, 100) == "50.0 (n=1)"
    assert ps.fmt_pm([], 1) == "–"


def test_paired_ratios_pair_by_repeat():
    # TRL s/step ÷ ours s/step, repeat by repeat: load that hit both runs of a repeat cancels
    assert ps.paired_ratios([0.6, 1.2], [0.2, 0.3]) == pytest.approx([3.0, 4.0])
    with pytest.raises(ValueError):
        ps.paired_ratios([1.0], [1.0, 2.0])


def test_md_table_renders_and_checks_widths():
    t = ps.md_table(["a", "b"], [["x", 1], ["y", None]])
    assert t.splitlines() == ["| a | b |", "|---|---:|", "| x | 1 |", "| y | – |"]
    with pytest.raises(ValueError):
        ps.md_table(["a", "b"], [["x"]])


def test_first_crossing_is_the_first_measured_point_at_or_above_target():
    xs = [0, 2560, 5120, 7680]
    assert ps.first_crossing(xs, [0.40, 0.70, 0.80, 0.78], 0.72) == 5120
    assert ps.first_crossing(xs, [0.40, 0.72, 0.80, 0.78], 0.72) == 2560  # equality counts
    assert ps.first_crossing(xs, [0.40, 0.50, 0.60, 0.70], 0.72) is None
    with pytest.raises(ValueError):
        ps.first_crossing(xs, [0.1], 0.5)


def test_seesaw_finds_one_domain_falling_while_another_rises():
    xs = [0, 10, 20, 30]
    curves = {"math": [0.5, 0.6, 0.50, 0.7], "code": [0.5, 0.5, 0.62, 0.6], "if": [0.5, 0.51, 0.52, 0.53]}
    ev = ps.seesaw_events(curves, xs, 0.05)
    # 10→20: math −0.10 while code +0.12; 20→30 math rises but nothing falls ≥ 0.05 (code −0.02)
    assert [(e["from"], e["to"], e["fell"], e["rose"]) for e in ev] == [(10, 20, "math", "code")]
    assert ev[0]["drop"] == pytest.approx(0.10) and ev[0]["gain"] == pytest.approx(0.12)
    assert ps.seesaw_events(curves, xs, 0.2) == []
    assert ps.max_drawdown(curves["math"]) == pytest.approx(0.10)
    assert ps.max_drawdown([0.1, 0.2, 0.3]) == 0.0


def _run(arm, rep, step_s, gen, score, acc, tokens=2000, n=4):
    steps = [{"step_s": 9.0, "gen_s": 5.0, "score_s": 1.0, "update_s": 3.0, "tokens": tokens}]  # warm-up, left out
    steps += [{"step_s": step_s, "gen_s": gen, "score_s": score, "update_s": step_s - gen - score,
               "tokens": tokens} for _ in range(n - 1)]
    return {"arm": arm, "repeat": rep, "steps": steps, "peak_rss_mib": 900.0, "eval": acc, "samples": 256 * n}


def test_vs_trl_summary_pairs_repeats_and_leaves_out_the_warm_up_step():
    runs = [_run("trl_b1", 0, 0.64, 0.3, 0.1, {"math": 0.775}), _run("ours_rkl", 0, 0.2, 0.1, 0.02, {"math": 0.79}),
            _run("trl_b1", 1, 0.96, 0.4, 0.1, {"math": 0.765}), _run("ours_rkl", 1, 0.3, 0.15, 0.03, {"math": 0.77})]
    s = vs.summarise(runs)
    assert s["arms"]["ours_rkl"]["step_s"] == pytest.approx([0.2, 0.3])  # step 1 (9 s) left out
    assert s["arms"]["trl_b1"]["tok_s"] == pytest.approx([2000 / 0.64, 2000 / 0.96])
    r = s["ratios"]["ours_rkl/trl_b1"]
    assert r["speed"] == pytest.approx([3.2, 3.2])
    assert r["acc_diff_points"] == pytest.approx([1.5, 0.5])
    assert r["phases"]["gen"] == pytest.approx([3.0, 0.4 / 0.15]) and r["phases"]["score"] == pytest.approx([5, 10 / 3])
    res = {"machine": {"cpu": "cpu", "cores": 2, "threads": 1, "torch": "t", "trl": "x"}, "steps": 4,
           "prompts": 32, "group": 8, "max_new_tokens": 10, "repeats": [0, 1], "arms": ["trl_b1", "ours_rkl"],
           "load": [1.0, 3.0], "wall_s": 60.0, "summary": s, "notes": ["a note"], "profile": {}}
    md = vs.render(res)
    assert "| ours MOPD, 1 teacher, sampled-token RKL (math) | 0.250 ± 0.071 |" in md
    assert "3.20 ± 0.00×" in md and "speed ≥ 3× — met" in md and "≥ TRL − 1 point — met" in md
    assert "a note" in md and "AsyncDistillationTrainer cannot run" in md


def test_vs_trl_three_teacher_ratio_sums_the_three_trl_runs():
    runs = [_run("ours_3t", 0, 0.3, 0.1, 0.1, {"math": 0.8, "code": 0.9, "if": 0.85}, n=10)]
    for d, n in (("math", 4), ("code", 3), ("if", 3)):
        runs.append(_run(f"trl_{d}", 0, 0.6, 0.3, 0.1, {d: 0.8}, n=n))
    r = vs.summarise(runs)["ratios"]["ours_3t/trl_3x"]
    trl_wall = 3 * 9.0 + (3 + 2 + 2) * 0.6  # every step counts here, warm-ups included, on both sides
    assert r["speed"] == pytest.approx([trl_wall / (9.0 + 9 * 0.3)])
    assert r["acc_diff_points"]["code"] == pytest.approx([10.0])


def test_sample_efficiency_analysis_crossings_and_seesaw():
    se = _load("sample_efficiency")
    xs = [0, 2560, 5120]
    build = {"sft_eval": {d: {"greedy": 0.4} for d in ("math", "code", "if")},
             "expert_eval": {"math": {"math": {"greedy": 0.9}}, "code": {"code": {"greedy": 0.8}},
                             "if": {"if": {"greedy": 1.0}}}}
    runs = [{"method": "mopd", "seed": 0, "samples": xs,
             "curves": {"math": [0.4, 0.82, 0.85], "code": [0.4, 0.6, 0.75], "if": [0.4, 0.7, 0.8]}},
            {"method": "grpo", "seed": 0, "samples": xs,
             "curves": {"math": [0.4, 0.7, 0.6], "code": [0.4, 0.5, 0.73], "if": [0.4, 0.5, 0.6]}}]
    res = {"build": build, "domains": ["math", "code", "if"], "runs": runs}
    a = se.analyse(res, 0.05)
    assert a["targets"]["math"] == pytest.approx(0.81)
    assert a["cross"]["mopd"] == {"math": [2560], "code": [5120], "if": [None]}
    assert a["cross"]["grpo"]["math"] == [None]
    assert [(e["fell"], e["rose"]) for e in a["seesaw"]["grpo"][0]] == [("math", "code"), ("math", "if")]
    assert a["seesaw"]["mopd"] == [[]]
    assert a["drawdown"]["grpo"]["math"] == pytest.approx([0.1])
    res.update(analysis=a, machine={"cpu": "c", "cores": 2, "threads": 1, "torch": "t"}, steps=20, per_step=256,
               mix={"math": 0.4}, eval_every=10, eval_size="all", seeds=[0], seesaw_delta=0.05, wall_s=60.0)
    md = se.render(res)
    assert "| mopd | 2560 (n=1) | 5120 (n=1) | not reached (1/1 runs) |" in md
    assert "| grpo | 2 | e.g. math −10.0 while code +23.0 (2560→5120 samples) |" in md
    # GRPO's samples ÷ MOPD's per seed; a method that never reached the target counts as its budget (a bound)
    assert a["ratio"]["math"] == [{"mopd": 2560, "grpo": None, "ratio": 2.0, "bound": "≥"}]
    assert a["ratio"]["if"] == [{"mopd": None, "grpo": None, "ratio": None, "bound": "neither reached"}]
    assert "| math | 2560 / never → ≥2.0× | 2.0 (n=1) |" in md


def test_sample_efficiency_ratio_pairs_runs_by_seed():
    se = _load("sample_efficiency")
    build = {"sft_eval": {"caps": {"greedy": 0.0}}, "expert_eval": {"caps": {"caps": {"greedy": 1.0}}}}
    runs = [{"method": m, "seed": s, "samples": [0, 1000, 2000, 3000, 4000, 5000], "curves": {"caps": c}}
            for m, s, c in (("mopd", 0, [0, 0.95, 1, 1, 1, 1]), ("grpo", 0, [0, 0, 0, 0.2, 0.5, 0.91]),
                            ("mopd", 1, [0, 0.5, 0.92, 1, 1, 1]), ("grpo", 1, [0, 0, 0, 0, 0.93, 1]))]
    a = se.analyse({"build": build, "domains": ["caps"], "runs": runs}, 0.05)
    assert [x["ratio"] for x in a["ratio"]["caps"]] == [5.0, 2.0]
    assert [x["bound"] for x in a["ratio"]["caps"]] == ["=", "="]


def test_vs_trl_time_to_accuracy_and_its_acceptance_lines():
    build = {"sft_eval": {"math": {"greedy": 0.4}}, "expert_eval": {"math": {"math": {"greedy": 0.8}}}}  # target 0.72
    runs = []
    for rep in range(5):
        o = _run("ours", rep, 0.2, 0.1, 0.02, {"math": 0.8}, n=10)
        o["curve"] = [[0, 0.4, 0.0], [5, 0.73, 2.0], [10, 0.80 + 0.001 * rep, 4.0]]
        t = _run("trl_b1", rep, 0.4, 0.2, 0.05, {"math": 0.78}, n=10)
        # TRL reaches the target only at step 10 (6 s), and one seed never does
        t["curve"] = [[0, 0.4, 0.0], [5, 0.6, 3.0], [10, 0.70 if rep == 4 else 0.75 + 0.02 * rep, 6.0]]
        runs += [o, t]
    s = vs.summarise(runs, build)
    tta = s["tta"]
    assert tta["target"] == pytest.approx(0.72)
    assert tta["arms"]["ours"]["reach_s"] == [2.0] * 5 and tta["arms"]["ours"]["reach_samples"] == [5 * 256.0] * 5
    assert tta["arms"]["trl_b1"]["reach_s"] == [6.0, 6.0, 6.0, 6.0, None]
    assert vs.time_to([[0, 0.1, 0.0], [5, 0.5, 1.0]], 0.6) is None
    res = {"machine": {"cpu": "cpu", "cores": 2, "threads": 1, "torch": "t", "trl": "x"}, "steps": 10,
           "prompts": 32, "group": 8, "max_new_tokens": 10, "repeats": list(range(5)), "arms": ["ours", "trl_b1"],
           "load": [1.0, 3.0], "wall_s": 60.0, "summary": s, "notes": [], "profile": {}, "runs": runs}
    md = vs.render(res)
    assert "| step 0 | step 5 | step 10 |" in md
    assert "final held-out accuracy ≥ TRL β = 1's mean: met (80.2 vs 76.4 %)" in md
    assert "spread ≤ half of TRL's or ≤ 2 points: met (std 0.2 vs 4.2 points)" in md
    assert "| TRL DistillationTrainer β=1 (math) | 5 | 40.0 ± 0.0 | 60.0 ± 0.0 | 76.4 ± 4.2 |" in md
    assert "≤ TRL's ÷ 1.5: met (2.0 ± 0.0 vs 6.0 ± 0.0 (4/5 seeds) s, ratio 3.00×)" in md
    assert "≥ 5 seeds per arm: met (5 and 5)" in md


@pytest.mark.parametrize("kind,ratio", [("constant", 0.0), ("cosine", 0.1), ("linear", 0.0)])
def test_trl_trains_at_our_learning_rate_step_by_step(kind, ratio):
    """The TRL arm's transformers scheduler for our `lr_schedule` (`vs_trl.trl_lr_schedule`): over the benchmark's
    30 steps its rate is within one step's decay (lr / 30) of ours at every step (transformers' progress is step /
    max_steps, ours reaches the floor at the last step), and a linear decay to a floor it cannot express is
    refused."""
    import torch
    from transformers import get_scheduler

    from mopd_core.config import PolicyLoopConfig
    from mopd_core.train.update import lr_lambda

    c = PolicyLoopConfig(steps=30, lr=1.0, lr_schedule=kind, min_lr_ratio=ratio)
    name, kw = vs.trl_lr_schedule(c)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_scheduler(name, opt, num_warmup_steps=0, num_training_steps=30, scheduler_specific_kwargs=kw)
    theirs = []
    for _ in range(30):
        theirs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    ours = [lr_lambda(c)(s) for s in range(30)]
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1 / 30 + 1e-12, (ours, theirs)
    with pytest.raises(SystemExit, match="linear with min_lr_ratio"):
        vs.trl_lr_schedule(PolicyLoopConfig(lr_schedule="linear", min_lr_ratio=0.1))
