"""Benchmark: the tiny recipe with `train.logprob_impl: full` and with `chunked`, same machine and seeds.

The bar for the chunked log-probs on the tiny workload: every cell of the held-out table within 3 points
of the `full` run's, and the stages it touches (experts + student: the RL/MOPD updates, local teacher scoring,
behaviour recompute) not more than 10 % slower. SFT goes through TRL and does not read `train.logprob_impl`
(its fingerprint leaves the `train` section out), so per seed it is trained once, by the first run, and reused
by the second: the wall seconds compared are the expert and student stages only.

Each impl is one `benchmarks/tiny_recipe.py` run (its JSON + Markdown under benchmarks/results/ as
`tiny_recipe_logprob_<impl>.*`) into one fresh folder per invocation, the runs one after another (never at
once: they would share the cores). Writes `benchmarks/results/logprob_impl_recipe.{json,md}`.

    .venv/bin/python benchmarks/logprob_impl_recipe.py [--seeds 0] [--jobs N] [--order full,chunked]
        [--noise-floor] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MAX_CELL_POINTS = 3.0   # |chunked - full| per model × domain, accuracy points
MAX_SLOWDOWN = 0.10     # chunked RL-stage wall over full's, minus 1


def _rl_wall(seed_row: dict) -> float:
    w = seed_row["wall_s"]
    return sum(v for k, v in w.items() if k.startswith("expert-") or k == "student")


def _rows(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def divergence(out_dir: Path, seed: int, order: list[str], against: str = "newest") -> dict[str, dict]:
    """Per RL stage, where the two runs' trajectories part: the first run's folder was set aside by the second
    (`<stage>@<fingerprint>`). The relative loss difference at step 1 (the same weights and rollouts, only the
    log-prob arithmetic differs) and the first step where it exceeds 1e-3 (from then on the runs sample
    different tokens and are two trajectories). `against`: which set-aside folder the live one is compared with
    when there are several (`oldest`: the first run's)."""
    out = {}
    for second in sorted((out_dir / f"seed{seed}").glob("*/*/metrics.jsonl")):
        stage = second.parent.name
        if "@" in stage or not (stage.startswith("expert-") or stage == "student"):
            continue
        firsts = sorted(second.parent.parent.glob(f"{stage}@*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
        if not firsts:
            continue
        first = firsts[-1] if against == "newest" else firsts[0]
        a, b = _rows(first), _rows(second)
        rel = [abs(x["loss"] - y["loss"]) / max(abs(x["loss"]), 1e-12) for x, y in zip(a, b)]
        part = next((i + 1 for i, r in enumerate(rel) if r > 1e-3), None)
        out[stage] = {"steps": len(rel), "step1_rel_loss_diff": rel[0] if rel else None, "parts_at_step": part,
                      "runs": {order[0]: str(first.parent), order[1]: str(second.parent)}}
    return out


def cell_diffs(a: dict, b: dict) -> dict:
    """b − a per model × domain of one seed, accuracy points."""
    return {m: {d: 100 * (b["accuracy"][m][d] - a["accuracy"][m][d]) for d in a["domains"]} for m in a["accuracy"]}


def compare(res: dict[str, dict], out_dir: Path | None = None, order: list[str] | None = None) -> dict:
    """Per seed and cell the accuracy difference, per seed the RL-stage walls; the bar."""
    full, chunked = res["full"], res["chunked"]
    per_seed = []
    for a, b in zip(full["per_seed"], chunked["per_seed"]):
        assert a["seed"] == b["seed"]
        cells = cell_diffs(a, b)
        wf, wc = _rl_wall(a), _rl_wall(b)
        per_seed.append({"seed": a["seed"], "cells_points": cells,
                         "max_abs_points": max(abs(v) for r in cells.values() for v in r.values()),
                         "rl_wall_s": {"full": wf, "chunked": wc}, "slowdown": wc / wf - 1,
                         "cpu_s": {"full": a.get("cpu_s"), "chunked": b.get("cpu_s")},
                         "train_tokens_per_s": {"full": a["tokens_per_s"]["train"],
                                                "chunked": b["tokens_per_s"]["train"]},
                         "bar": {"full": a["passed"], "chunked": b["passed"]},
                         "divergence": divergence(out_dir, a["seed"], order) if out_dir is not None else {}})
    worst = max(s["max_abs_points"] for s in per_seed)
    slow = [s["slowdown"] for s in per_seed]
    # the seeds' mean per cell: a float change makes a 300-step RL run another trajectory, so one seed's cell
    # mixes the impl's effect with that trajectory noise; the mean over seeds averages the noise down
    models, domains = list(per_seed[0]["cells_points"]), list(next(iter(per_seed[0]["cells_points"].values())))
    mean_cells = {m: {d: statistics.fmean(s["cells_points"][m][d] for s in per_seed) for d in domains}
                  for m in models}
    worst_mean = max(abs(v) for r in mean_cells.values() for v in r.values())
    checks = [{"check": f"every cell within {MAX_CELL_POINTS:g} points (each seed)", "value": worst,
               "ok": worst <= MAX_CELL_POINTS + 1e-9},
              {"check": f"every cell's mean over the seeds within {MAX_CELL_POINTS:g} points", "value": worst_mean,
               "ok": worst_mean <= MAX_CELL_POINTS + 1e-9},
              {"check": f"chunked RL stages at most {MAX_SLOWDOWN:.0%} slower (mean over seeds)",
               "value": statistics.fmean(slow), "ok": statistics.fmean(slow) <= MAX_SLOWDOWN}]
    return {"per_seed": per_seed, "checks": checks, "mean_cells_points": mean_cells,
            "passed": all(c["ok"] for c in checks),
            "slowdown": {"mean": statistics.fmean(slow), "std": statistics.stdev(slow) if len(slow) > 1 else 0.0}}


def markdown(cmp: dict, res: dict, order: list[str]) -> str:
    mach = res["full"]["machine"]
    domains = res["full"]["per_seed"][0]["domains"]
    models = list(res["full"]["per_seed"][0]["accuracy"])
    lines = ["# Tiny recipe: `train.logprob_impl` full vs chunked", "",
             f"Seeds {', '.join(str(s['seed']) for s in cmp['per_seed'])}; {mach['cpu_model']} ({mach['cpu_count']} "
             f"cores; torch {mach['torch']} {mach['torch_cpu_capability']}, "
             f"{'/'.join(map(str, mach['torch_threads']))} thread(s)); runs one after another in the order "
             f"{' → '.join(order)}, SFT trained by the first and reused by the second; load average "
             f"{res[order[0]]['load_average_1m']['start']} at the start, {res[order[-1]]['load_average_1m']['end']} "
             "at the end.", "",
             "Held-out greedy accuracy (%), full → chunked (difference in points):", "",
             "| seed | model | " + " | ".join(domains) + " |", "|---:|---|" + "---:|" * len(domains)]
    for s, a, b in zip(cmp["per_seed"], res["full"]["per_seed"], res["chunked"]["per_seed"]):
        for m in models:
            lines.append(f"| {s['seed']} | {m} | " + " | ".join(
                f"{100 * a['accuracy'][m][d]:.1f} → {100 * b['accuracy'][m][d]:.1f} ({s['cells_points'][m][d]:+.1f})"
                for d in domains) + " |")
    lines += ["", "| seed | RL stages wall s, full | chunked | chunked / full | CPU s full | CPU s chunked | "
              "train tokens/s full | chunked | learning bar full / chunked |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in cmp["per_seed"]:
        tf, tc = s["train_tokens_per_s"]["full"], s["train_tokens_per_s"]["chunked"]
        lines.append(f"| {s['seed']} | {s['rl_wall_s']['full']:.1f} | {s['rl_wall_s']['chunked']:.1f} | "
                     f"{1 + s['slowdown']:.3f} | {s['cpu_s']['full']} | {s['cpu_s']['chunked']} | "
                     f"{tf or 0:.0f} | {tc or 0:.0f} | "
                     f"{'PASS' if s['bar']['full'] else 'FAIL'} / {'PASS' if s['bar']['chunked'] else 'FAIL'} |")
    lines += ["", "Where the trajectories part (relative loss difference at step 1, when the two runs hold the same "
              "weights and rollouts, and the first step it exceeds 1e-3 — after it they sample different tokens; "
              "the student also starts from teachers that already differ):", "",
              "| seed | stage | steps | step-1 rel. loss diff | parts at step |", "|---:|---|---:|---:|---:|"]
    for s in cmp["per_seed"]:
        for st, d in s["divergence"].items():
            lines.append(f"| {s['seed']} | {st} | {d['steps']} | {d['step1_rel_loss_diff']:.1e} | "
                         f"{d['parts_at_step'] or 'never'} |")
    fl = cmp.get("noise_floor")
    if fl:
        lines += ["", f"Noise floor: `full` once more with `{fl['override']}` — the same token-mean loss summed in "
                  "another order, no other change — against the first `full` run (points):", "",
                  "| seed | model | " + " | ".join(domains) + " |", "|---:|---|" + "---:|" * len(domains)]
        for s in fl["per_seed"]:
            for m in models:
                lines.append(f"| {s['seed']} | {m} | "
                             + " | ".join(f"{s['cells_points'][m][d]:+.1f}" for d in domains) + " |")
        lines += ["", "| seed | stage | step-1 rel. loss diff | parts at step |", "|---:|---|---:|---:|"]
        for s in fl["per_seed"]:
            for st, d in s["divergence"].items():
                lines.append(f"| {s['seed']} | {st} | {d['step1_rel_loss_diff']:.1e} | "
                             f"{d['parts_at_step'] or 'never'} |")
        lines += ["", f"Largest cell difference: full vs chunked {cmp['checks'][0]['value']:.1f} points, full vs full "
                  f"(another summation order) {fl['worst']:.1f} points."]
    lines += ["", "CPU s are the whole process's (the first run includes SFT). Goals:", ""]
    lines += [f"- {'PASS' if c['ok'] else 'FAIL'} {c['check']}: "
              + (f"{c['value']:.1f} points" if "cell" in c["check"] else f"{c['value']:+.1%}") for c in cmp["checks"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--jobs", type=int, default=1, help="seeds at once within each run (tiny_recipe.py --jobs; "
                    "fair on 2 cores with --set runtime.num_threads=1)")
    ap.add_argument("--order", default="full,chunked", help="which impl runs first (and trains SFT)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--output-dir", default=None, help="default runs/bench-logprob/<time> (fresh per invocation)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks/results"))
    ap.add_argument("--noise-floor", action="store_true",
                    help="a third run, full with another micro-batch split (summation order only), against the "
                         "first: how far two runs that differ only in float rounding drift apart")
    args = ap.parse_args(argv)
    order = [x.strip() for x in args.order.split(",")]
    if sorted(order) != ["chunked", "full"]:
        ap.error(f"--order must name full and chunked once each (got {args.order!r})")
    if args.noise_floor and order[0] != "full":
        ap.error("--noise-floor compares against the first run: use --order full,chunked")
    out_dir = Path(args.output_dir or ROOT / "runs/bench-logprob" / time.strftime("%Y%m%d-%H%M%S"))
    results = Path(args.results)
    res = {}
    for i, impl in enumerate(order):
        out = results / f"tiny_recipe_logprob_{impl}.json"
        cmd = [sys.executable, str(ROOT / "benchmarks/tiny_recipe.py"), "--seeds", args.seeds, "--output-dir",
               str(out_dir), "--out", str(out), "--jobs", str(args.jobs), f"--set=train.logprob_impl={impl}",
               *[f"--set={o}" for o in args.overrides], *(["--reuse"] if i else [])]
        print(f"[{impl}] {' '.join(cmd)}", flush=True)
        rc = subprocess.run(cmd).returncode
        if not out.exists():
            print(f"[{impl}] the recipe run wrote no {out} (exit {rc})", file=sys.stderr)
            return 1
        res[impl] = json.loads(out.read_text())
    cmp = compare(res, out_dir, order)  # before a third run sets the second's folders aside
    if args.noise_floor:
        from mopd_core.config import load_config

        budget = load_config("tiny", args.overrides).train.max_tokens_per_micro_batch or 1024
        override = f"train.max_tokens_per_micro_batch={2 * budget}"
        out = results / "tiny_recipe_logprob_floor.json"
        cmd = [sys.executable, str(ROOT / "benchmarks/tiny_recipe.py"), "--seeds", args.seeds, "--output-dir",
               str(out_dir), "--out", str(out), "--jobs", str(args.jobs), "--set=train.logprob_impl=full",
               f"--set={override}",
               *[f"--set={o}" for o in args.overrides], "--reuse"]
        print(f"[noise floor] {' '.join(cmd)}", flush=True)
        subprocess.run(cmd)
        if not out.exists():
            print(f"[noise floor] the recipe run wrote no {out}", file=sys.stderr)
            return 1
        floor = json.loads(out.read_text())
        rows = [{"seed": a["seed"], "cells_points": cell_diffs(a, b),
                 "divergence": divergence(out_dir, a["seed"], ["full", "full (floor)"], against="oldest")}
                for a, b in zip(res["full"]["per_seed"], floor["per_seed"])]
        cmp["noise_floor"] = {"override": override, "per_seed": rows,
                              "worst": max(abs(v) for r in rows for c in r["cells_points"].values()
                                           for v in c.values())}
    result = {"order": order, "seeds": res["full"]["seeds"], "overrides": args.overrides,
              "output_dir": str(out_dir), **cmp, "machine": res["full"]["machine"]}
    (results / "logprob_impl_recipe.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(cmp, res, order)
    (results / "logprob_impl_recipe.md").write_text(md + "\n")
    print(md)
    return 0 if cmp["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
