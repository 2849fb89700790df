"""Benchmark: multi-round MOPD (Nemotron 3 Ultra style) on the tiny recipe — does a second round hold or improve
what the first reached, and does a re-run reuse both rounds?

For each seed, in its own process: `run_recipe` with `rounds=2` (round 1 = sft → experts → student as in
`benchmarks/tiny_recipe.py`; round 2 re-trains each expert by GRPO from round 1's student and distils a new
student from them), then the same recipe again over the same folder (the re-run: every stage must be reused,
no model file rewritten; its wall time is mostly the evaluation of the 10 models, which the CLI recipe always
redoes). The bar: round 2's student ≥ round 1's student − 2 points on every domain.

Writes `benchmarks/results/rounds.json` (or --out) and a Markdown table beside it: per seed and per domain the
held-out greedy accuracy of SFT, round 1 and round 2 experts (each on its own domain) and students, the round-2 −
round-1 deltas, the bar, wall seconds per stage, the re-run's wall and what it retrained (nothing, if reuse
works), and the machine and its load.

    .venv/bin/python benchmarks/rounds.py [--seeds 0,1] [--jobs 2] [--set k=v ...] [--output-dir DIR]
        [--round-student-init previous|sft] [--out PATH] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.peer_stats import mean_std  # noqa: E402
from benchmarks.tiny_recipe import machine_info  # noqa: E402

TOLERANCE = 0.02  # round 2's student may trail round 1's by at most 2 points on a domain


def _stamps(run_dir: Path) -> dict[str, int]:
    """mtime of every stage's final weights (both rounds): a re-run that rewrites none retrained nothing."""
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns
            for p in sorted(run_dir.glob("**/final/model.safetensors"))}


def run_one(args) -> int:
    """Worker: one seed, both rounds, then the re-run; writes its result JSON to --worker-out."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    import torch

    from mopd_core.config import load_config
    from mopd_core.recipe import run_recipe

    ov = [f"output_dir={args.output_dir}", *args.overrides, "rounds=2", f"seed={args.worker}",
          f"name=rounds-s{args.worker}"]
    if args.round_student_init:
        ov.append(f"round_student_init={args.round_student_init}")
    cfg = load_config(args.config, ov)
    t0 = time.perf_counter()
    res = run_recipe(cfg, progress=False, restart=not args.reuse)
    first = time.perf_counter() - t0
    before = _stamps(cfg.run_dir())
    t1 = time.perf_counter()
    again = run_recipe(load_config(args.config, ov), progress=False)
    rerun = time.perf_counter() - t1
    after = _stamps(cfg.run_dir())
    domains = cfg.domain_names()
    acc = {label: {d: res.accuracy[label][d]["greedy"] for d in domains} for label in res.accuracy}
    delta = {d: acc["r2-student"][d] - acc["student"][d] for d in domains}
    out = {
        "seed": args.worker, "torch_threads": torch.get_num_threads(), "domains": domains, "accuracy": acc,
        "round2_minus_round1": {"student": delta,
                                "expert_own_domain": {d: acc[f"r2-expert-{d}"][d] - acc[f"expert-{d}"][d]
                                                      for d in domains}},
        "passed": all(v >= -TOLERANCE - 1e-9 for v in delta.values()),
        "wall_s": {**{k: round(v, 2) for k, v in res.wall_s.items()}, "process_total": round(first, 2)},
        "rerun": {"wall_s": round(rerun, 2), "stage_wall_s": {k: round(v, 2) for k, v in again.wall_s.items()},
                  "model_files": len(before), "rewritten": sorted(k for k in after if before.get(k) != after[k]),
                  "same_accuracy": again.accuracy == res.accuracy},
        "cpu_s": round(sum(os.times()[:2]), 1),
        "reused_stages": args.reuse,
        "config": cfg.model_dump(mode="json"),
    }
    Path(args.worker_out).write_text(json.dumps(out, indent=2))
    return 0


def partial_seed(out_dir: Path, seed: int) -> dict | None:
    """What an unfinished seed's folders hold (`--collect`): each stage's status, steps and, when done, the
    held-out greedy accuracy its stage.json recorded (the same `evaluate_checkpoint` the final table uses)."""
    from mopd_core.config import load_config
    from mopd_core.stages import checkpoint_dirs, checkpoint_step, read_stage, stage_plan

    cfg = load_config("tiny", [f"output_dir={out_dir}", "rounds=2", f"seed={seed}", f"name=rounds-s{seed}"])
    if not cfg.run_dir().exists():
        return None
    stages = {}
    for spec in stage_plan(cfg):
        d = spec.stage_dir
        info = read_stage(d) or {}
        ck = checkpoint_dirs(d) if d.exists() else []
        stages[spec.label] = {"status": info.get("status", "not started"),
                                   "step": info.get("steps") if info.get("status") == "done" else
                                   (checkpoint_step(ck[-1]) if ck else 0),
                                   "eval": {k: v.get("greedy") for k, v in (info.get("eval") or {}).items()}
                                   if info.get("status") == "done" else {}}
    return {"seed": seed, "partial": True, "stages": stages}


def partial_markdown(result: dict) -> str:
    lines = []
    for p in result.get("partial", []):
        lines += ["", f"Seed {p['seed']} did not finish in the time available; its stages as its folders hold "
                  "them (held-out greedy %, from each finished stage's stage.json):", "",
                  "| stage | status | steps (last checkpoint) | math | code | if |", "|---|---|---:|---:|---:|---:|"]
        for k, v in p["stages"].items():
            ev = v["eval"]
            lines.append(f"| {k} | {v['status']} | {v['step']} | "
                         + " | ".join(f"{100 * ev[d]:.1f}" if ev.get(d) is not None else "–"
                                      for d in ("math", "code", "if")) + " |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    per_seed, mach = result["per_seed"], result["machine"]
    if not per_seed:
        return ("# Multi-round MOPD benchmark (tiny, rounds=2)\n\nNo seed finished." + partial_markdown(result)
                + "\n")
    domains = per_seed[0]["domains"]
    threads = sorted({s["torch_threads"] for s in per_seed})
    lines = ["# Multi-round MOPD benchmark (tiny, rounds=2)", "",
             f"Seeds {', '.join(str(s['seed']) for s in per_seed)}; {mach['cpu_model']} ({mach['cpu_count']} "
             f"cores; torch {mach['torch']}, {'/'.join(map(str, threads))} thread(s)); {result['jobs']} seed(s) at a "
             f"time under `nice`, on a machine shared with other jobs (load average "
             f"{result['load_average_1m']['start']} at the start, {result['load_average_1m']['end']} at the end): "
             "wall times are inflated by that load "
             f"and are not the idle machine's. round_student_init={result['round_student_init'] or 'previous'}."
             + (f" Overrides: `{' '.join(result['overrides'])}`." if result["overrides"] else ""), "",
             f"Bar: round 2's student ≥ round 1's student − {100 * TOLERANCE:.0f} points on every domain.", "",
             "Held-out greedy accuracy (%), "
             + ("mean ± std over the seeds" if len(per_seed) > 1 else "one seed, no spread")
             + " (experts: every domain, own domain in the per-seed table):", "",
             "| model | " + " | ".join(domains) + " |", "|---|" + "---:|" * len(domains)]
    for m in per_seed[0]["accuracy"]:
        cells = []
        for d in domains:
            mu, sd = mean_std([s["accuracy"][m][d] for s in per_seed])
            # one seed has no spread to show: a "± 0.0" would read as a measured one
            cells.append(f"{100 * mu:.1f} ± {100 * sd:.1f}" if len(per_seed) > 1 else f"{100 * mu:.1f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "Per seed (%): each expert on its own domain, the students, round 2 − round 1:", "",
              "| seed | domain | sft | expert r1 | expert r2 | student r1 | student r2 | Δ student | bar |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for s in per_seed:
        a = s["accuracy"]
        for d in domains:
            dv = s["round2_minus_round1"]["student"][d]
            lines.append(f"| {s['seed']} | {d} | {100 * a['sft'][d]:.1f} | {100 * a[f'expert-{d}'][d]:.1f} | "
                         f"{100 * a[f'r2-expert-{d}'][d]:.1f} | {100 * a['student'][d]:.1f} | "
                         f"{100 * a['r2-student'][d]:.1f} | {100 * dv:+.1f} | "
                         f"{'ok' if dv >= -TOLERANCE - 1e-9 else 'FAIL'} |")
    seeds = [s["seed"] for s in per_seed]
    lines += ["", "| stage | " + " | ".join(f"wall s, seed {x}" for x in seeds) + " |",
              "|---|" + "---:|" * len(seeds)]
    for k in per_seed[0]["wall_s"]:
        lines.append(f"| {k} | " + " | ".join(f"{s['wall_s'].get(k, float('nan')):.0f}" for s in per_seed) + " |")
    lines += ["", "Re-run over the same folders (every stage must be reused):", "",
              "| seed | re-run wall s | of which training stages s | of which eval s | model files | rewritten | "
              "same table |", "|---:|---:|---:|---:|---:|---|---|"]
    for s in per_seed:
        r = s["rerun"]
        stages = sum(v for k, v in r["stage_wall_s"].items() if k not in ("eval", "total"))
        lines.append(f"| {s['seed']} | {r['wall_s']:.1f} | {stages:.1f} | {r['stage_wall_s']['eval']:.1f} | "
                     f"{r['model_files']} | {', '.join(r['rewritten']) or 'none'} | {r['same_accuracy']} |")
    for note in result.get("notes", []):  # what happened during the run that the numbers alone do not say
        lines += ["", f"Note: {note}"]
    ok = [s["passed"] for s in per_seed]
    lines += ["", f"Result: {'PASS' if all(ok) else 'FAIL'} ({sum(ok)}/{len(ok)} seeds hold the bar)."
              + (f" Not run or not finished: seeds {result['missing']}." if result["missing"] else "")]
    return "\n".join(lines) + partial_markdown(result)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--round-student-init", choices=["previous", "sft"], default=None)
    ap.add_argument("--output-dir", default=str(ROOT / "runs" / "bench-rounds"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "rounds.json"))
    ap.add_argument("--reuse", action="store_true", help="keep finished stages of earlier runs")
    ap.add_argument("--collect", action="store_true", help="no training: write the results of the seeds' worker "
                    "JSONs in --output-dir, and of unfinished seeds what their stage folders hold")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        return run_one(args)
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    load0 = round(os.getloadavg()[0], 2)
    pending, running, done = list(seeds), [], {}
    env = {**os.environ, "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if args.collect:
        for seed in seeds:
            wout = out_dir / f"rounds_seed{seed}.json"
            done[seed] = json.loads(wout.read_text()) if wout.exists() else None
        pending = []
    while pending or running:
        while pending and len(running) < args.jobs:
            seed = pending.pop(0)
            wout = out_dir / f"rounds_seed{seed}.json"
            cmd = [sys.executable, __file__, "--worker", str(seed), "--worker-out", str(wout), "--config",
                   args.config, "--output-dir", str(out_dir)] + [a for o in args.overrides for a in ("--set", o)]
            cmd += (["--round-student-init", args.round_student_init] if args.round_student_init else [])
            cmd += ["--reuse"] if args.reuse else []
            log = (out_dir / f"rounds_seed{seed}.log").open("w")
            running.append((seed, wout, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)))
        time.sleep(5)
        for item in list(running):
            seed, wout, p = item
            if p.poll() is not None:
                running.remove(item)
                done[seed] = json.loads(wout.read_text()) if p.returncode == 0 and wout.exists() else None
                print(f"seed {seed}: {'done' if done[seed] else f'failed (exit {p.returncode})'}", flush=True)
    per_seed = [done[s] for s in seeds if done.get(s)]
    result = {"config": args.config, "overrides": args.overrides, "jobs": args.jobs,
              "round_student_init": args.round_student_init, "machine": machine_info(),
              "load_average_1m": {"start": load0, "end": round(os.getloadavg()[0], 2)},
              "missing": [s for s in seeds if not done.get(s)], "per_seed": per_seed,
              "partial": [p for p in (partial_seed(out_dir, s) for s in seeds if not done.get(s)) if p],
              "passed": bool(per_seed) and all(s["passed"] for s in per_seed)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    md = markdown(result)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
