"""Benchmark: the whole tiny recipe once per seed, checked against the learning bar, with mean ± std per cell.

Seeds stand in for machines: `seed` changes the model's init, the training data and the sampling, so a preset
whose table agrees across seeds does not hang on one machine's floating-point paths. For every seed the bar is

    each expert  >= SFT + 15 points on its own domain
    student      >= 90 % of each expert on that expert's domain
    student      >  SFT on every domain

and the script prints PASS/FAIL per seed and exits 1 if any seed fails. Each seed runs in its own process
(`--jobs 2` runs two at once — fair on 2 cores only with `runtime.num_threads: 1`). `--baseline` adds the
multi-domain GRPO baseline trained with exactly the student's sampling budget (off by default: +4 min a seed).

Writes `benchmarks/results/tiny_recipe.json` (or --out) and a Markdown table beside it: mean ± std of the
held-out greedy accuracy per model × domain, the per-seed rows and bar, wall seconds per stage, tokens/s,
peak RSS and the machine (CPU model, SIMD flags, torch threads and version).

    .venv/bin/python benchmarks/tiny_recipe.py [--seeds 0,1,2] [--jobs N] [--baseline] [--config tiny]
        [--set k=v ...] [--out PATH] [--output-dir DIR] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EXPERT_GAIN = 0.15  # expert - sft on its own domain, accuracy as a fraction
STUDENT_RATIO = 0.90  # student / expert on the expert's domain
# the SIMD/matrix features that pick torch's CPU kernels (and so the floating-point paths)
_FLAG_RE = re.compile(r"^(avx2|avx512\w*|amx\w*|fma|f16c|avx_vnni)$")


def _median(history: list[dict], key: str) -> float | None:
    vals = [r[key] for r in history if key in r]
    return statistics.median(vals) if vals else None


def machine_info() -> dict:
    import torch

    model, flags = None, []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = val.strip()
            elif key.strip() == "flags" and not flags:
                flags = sorted(f for f in val.split() if _FLAG_RE.match(f))
    except OSError:  # not Linux
        pass
    return {"cpu_model": model or platform.processor() or None, "cpu_flags": flags, "cpu_count": os.cpu_count(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def check_bar(acc: dict[str, dict[str, float]], domains: list[str]) -> list[dict]:
    """One row per condition of the learning bar: what was compared and whether it held."""
    rows = []
    sft, student = acc["sft"], acc["student"]
    for d in domains:
        exp = acc[f"expert-{d}"][d]
        rows.append({"check": f"expert-{d} >= sft + {EXPERT_GAIN * 100:.0f} on {d}", "value": exp,
                     "threshold": sft[d] + EXPERT_GAIN, "ok": exp >= sft[d] + EXPERT_GAIN - 1e-9})
        rows.append({"check": f"student >= {STUDENT_RATIO:.0%} of expert-{d} on {d}", "value": student[d],
                     "threshold": STUDENT_RATIO * exp, "ok": student[d] >= STUDENT_RATIO * exp - 1e-9})
        rows.append({"check": f"student > sft on {d}", "value": student[d], "threshold": sft[d],
                     "ok": student[d] > sft[d]})
    for r in rows:  # how far from the edge, in accuracy: the robustness a seed (or machine) has left
        r["margin"] = r["value"] - r["threshold"]
    return rows


def run_one(args) -> int:
    """Worker: one seed, in this process; writes its result JSON to --worker-out."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    import torch

    from mopd_core.config import load_config
    from mopd_core.recipe import run_recipe
    from mopd_core.runtime.device import peak_rss_mb

    cfg = load_config(args.config, [f"output_dir={args.output_dir}", *args.overrides, f"seed={args.worker}"])
    t0 = time.perf_counter()
    res = run_recipe(cfg, progress=False, restart=not args.reuse, baseline=args.baseline)
    total = time.perf_counter() - t0
    rl_keys = [k for k in res.outputs if k.startswith("expert-") or k in ("student", "grpo-baseline")]
    rl_hist = [r for k in rl_keys for r in res.outputs[k].history]
    domains = cfg.domain_names()
    acc = {label: {d: res.accuracy[label][d]["greedy"] for d in domains} for label in res.accuracy}
    bar = check_bar(acc, domains)
    out = {
        "seed": args.worker, "torch_threads": torch.get_num_threads(), "accuracy": acc, "bar": bar,
        "passed": all(r["ok"] for r in bar),
        "student_vs_expert": {d: (acc["student"][d] / acc[f"expert-{d}"][d] if acc[f"expert-{d}"][d] else None)
                              for d in domains},
        "wall_s": {**{k: round(v, 2) for k, v in res.wall_s.items()}, "process_total": round(total, 2)},
        "tokens_per_s": {"rollout": _median(rl_hist, "perf/rollout_tokens_per_s"),
                         "teacher_scoring": _median(res.outputs["student"].history, "perf/score_tokens_per_s"),
                         "train": _median(rl_hist, "perf/train_tokens_per_s")},
        "peak_rss_mb": round(peak_rss_mb(), 1),
        # user + sys CPU seconds of this process: on a busy machine the wall times grow, this much less (still
        # inflated by shared caches and SMT siblings, so with one torch thread an upper bound of the idle wall)
        "cpu_s": round(sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), 1),
        # held-out greedy accuracy during training (stages' eval_every > 0): shows whether each stage stops where
        # its curve is flat, i.e. whether a machine that is a little faster or slower would end elsewhere
        "curves": {k: [{"step": r["step"], **{d: r[f"eval/{d}/greedy"] for d in domains if f"eval/{d}/greedy" in r}}
                       for r in o.history if any(f"eval/{d}/greedy" in r for d in domains)]
                   for k, o in res.outputs.items()},
        "reused_stages": args.reuse,
        "domains": domains,
        "config": cfg.model_dump(mode="json"),
    }
    Path(args.worker_out).write_text(json.dumps(out, indent=2))
    return 0


def _mean_std(vals: list[float]) -> tuple[float, float]:
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def summarize(per_seed: list[dict]) -> dict:
    models = list(per_seed[0]["accuracy"])
    domains = per_seed[0]["domains"]
    acc = {m: {d: dict(zip(("mean", "std"), _mean_std([s["accuracy"][m][d] for s in per_seed])))
               for d in domains} for m in models}
    stages = [k for k in per_seed[0]["wall_s"]]
    wall = {k: dict(zip(("mean", "std"), _mean_std([s["wall_s"][k] for s in per_seed]))) for k in stages}
    return {"accuracy": acc, "wall_s": wall}


def _pct(mean: float, std: float) -> str:
    return f"{100 * mean:.1f} ± {100 * std:.1f}"


def markdown(result: dict) -> str:
    per_seed, summ, mach = result["per_seed"], result["summary"], result["machine"]
    domains = per_seed[0]["domains"]
    seeds = [s["seed"] for s in per_seed]
    threads = sorted({s["torch_threads"] for s in per_seed})
    lines = [f"# Tiny recipe benchmark ({result['config']})", "",
             f"Seeds {', '.join(map(str, seeds))}; {mach['cpu_model']} ({mach['cpu_count']} cores, "
             f"{' '.join(mach['cpu_flags']) or 'no listed SIMD flags'}; torch {mach['torch']} "
             f"{mach['torch_cpu_capability']}, {'/'.join(map(str, threads))} thread(s)), python {mach['python']}; "
             f"{result['jobs']} seed(s) at a time; load average {result['load_average_1m']['start']} at the start, "
             f"{result['load_average_1m']['end']} at the end."
             + (f" Overrides: `{' '.join(result['overrides'])}`." if result["overrides"] else ""), "",
             "Held-out greedy accuracy (%), mean ± std over the seeds:", "",
             "| model | " + " | ".join(domains) + " |", "|---|" + "---:|" * len(domains)]
    for m, r in summ["accuracy"].items():
        lines.append(f"| {m} | " + " | ".join(_pct(r[d]["mean"], r[d]["std"]) for d in domains) + " |")
    lines += ["", "Per seed (%): SFT, each expert on its own domain, student — and the learning bar "
              f"(expert ≥ SFT + {EXPERT_GAIN * 100:.0f}, student ≥ {STUDENT_RATIO:.0%} of the expert, "
              "student > SFT everywhere):", "",
              "| seed | " + " | ".join(f"sft {d}" for d in domains) + " | "
              + " | ".join(f"expert {d}" for d in domains) + " | " + " | ".join(f"student {d}" for d in domains)
              + " | student/expert | smallest margin | bar |",
              "|---:|" + "---:|" * (3 * len(domains) + 2) + "---|"]
    for s in per_seed:
        a = s["accuracy"]
        ratio = " / ".join(f"{v:.0%}" if v is not None else "–" for v in s["student_vs_expert"].values())
        failed = [r["check"] for r in s["bar"] if not r["ok"]]
        tight = min(s["bar"], key=lambda r: r["margin"])
        lines.append(f"| {s['seed']} | " + " | ".join(f"{100 * a['sft'][d]:.1f}" for d in domains) + " | "
                     + " | ".join(f"{100 * a[f'expert-{d}'][d]:.1f}" for d in domains) + " | "
                     + " | ".join(f"{100 * a['student'][d]:.1f}" for d in domains)
                     + f" | {ratio} | {100 * tight['margin']:+.1f} ({tight['check']})"
                     + f" | {'PASS' if s['passed'] else 'FAIL: ' + '; '.join(failed)} |")
    lines += ["", "| stage | wall s (mean ± std) | " + " | ".join(f"seed {x}" for x in seeds) + " |",
              "|---|---:|" + "---:|" * len(seeds)]
    for k, v in summ["wall_s"].items():
        lines.append(f"| {k} | {v['mean']:.1f} ± {v['std']:.1f} | "
                     + " | ".join(f"{s['wall_s'][k]:.1f}" for s in per_seed) + " |")
    tps = {k: [s["tokens_per_s"][k] for s in per_seed if s["tokens_per_s"][k] is not None]
           for k in per_seed[0]["tokens_per_s"]}
    cpu = [f"seed {s['seed']} {s['cpu_s']:.0f} s" for s in per_seed if "cpu_s" in s]
    if cpu:
        lines += ["", "CPU time (user + sys) per seed: " + ", ".join(cpu) + "."]
    lines += ["", "| throughput (median per seed, mean over seeds) | tokens/s |", "|---|---:|",
              *[f"| {k} | {statistics.fmean(v):.0f} |" for k, v in tps.items() if v], "",
              f"Peak RSS per seed: {max(s['peak_rss_mb'] for s in per_seed):.0f} MiB at most. "
              f"Result: {'PASS' if result['passed'] else 'FAIL'} "
              f"({sum(s['passed'] for s in per_seed)}/{len(per_seed)} seeds pass the bar)."]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one recipe run each")
    ap.add_argument("--jobs", type=int, default=1, help="seeds run at once (each in its own process)")
    ap.add_argument("--baseline", action="store_true", help="also train the multi-domain GRPO baseline")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse finished stages of an earlier run in --output-dir (default: start fresh; reused "
                         "stages report their reuse time, not their training time)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/tiny_recipe.json"))
    ap.add_argument("--output-dir", default=str(ROOT / "runs/bench"), help="stages write <dir>/seed<N>/<name>/")
    ap.add_argument("--collect", action="store_true",
                    help="run nothing: summarize the seeds' result.json files already in --output-dir")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        return run_one(args)
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--seeds must be comma-separated integers (got {args.seeds!r})")
    if not seeds or len(set(seeds)) != len(seeds):
        ap.error(f"--seeds needs distinct seeds (got {args.seeds!r})")
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")
    from mopd_core.config import load_config

    load_config(args.config, args.overrides)  # a bad config or override fails here, before any seed runs

    out_root = Path(args.output_dir)
    out_root.mkdir(parents=True, exist_ok=True)
    pending, running, done, failed = ([] if args.collect else list(seeds)), {}, {}, []
    if args.collect:
        for s in seeds:
            p = out_root / f"seed{s}" / "result.json"
            if p.exists():
                done[s] = json.loads(p.read_text())
            else:
                failed.append(s)
                print(f"seed {s}: no {p}", flush=True)
    t0, load0 = time.perf_counter(), os.getloadavg()
    while pending or running:
        while pending and len(running) < args.jobs:
            s = pending.pop(0)
            sdir = out_root / f"seed{s}"
            sdir.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--config", args.config,
                   "--output-dir", str(sdir), "--worker", str(s), "--worker-out", str(sdir / "result.json"),
                   *[f"--set={o}" for o in args.overrides], *(["--baseline"] if args.baseline else []),
                   *(["--reuse"] if args.reuse else [])]
            # one seed at a time streams its log here; parallel seeds log to their folders
            log = None if args.jobs == 1 else open(sdir / "benchmark.log", "w")
            print(f"seed {s}: started" + (f", log {sdir / 'benchmark.log'}" if log else ""), flush=True)
            running[s] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None), log,
                          time.perf_counter())
        time.sleep(1.0)
        for s, (proc, log, ts) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[s]
            if log:
                log.close()
            res_path = out_root / f"seed{s}" / "result.json"
            if proc.returncode != 0 or not res_path.exists():
                failed.append(s)
                print(f"seed {s}: the recipe run failed (exit {proc.returncode})", flush=True)
                continue
            done[s] = json.loads(res_path.read_text())
            bad = [r["check"] for r in done[s]["bar"] if not r["ok"]]
            print(f"seed {s}: {'PASS' if not bad else 'FAIL (' + '; '.join(bad) + ')'} "
                  f"in {time.perf_counter() - ts:.0f} s", flush=True)
    if not done:
        print("no seed finished; nothing written", file=sys.stderr)
        return 1
    per_seed = [done[s] for s in seeds if s in done]
    result = {
        "config": args.config, "overrides": args.overrides, "seeds": seeds, "failed_seeds": failed,
        "jobs": args.jobs, "baseline": args.baseline,
        "bar": {"expert_gain": EXPERT_GAIN, "student_ratio": STUDENT_RATIO, "student_above_sft": True},
        "passed": not failed and all(s["passed"] for s in per_seed),
        "machine": {**machine_info(), "torch_threads": sorted({s["torch_threads"] for s in per_seed})},
        "benchmark_wall_s": round(time.perf_counter() - t0, 1),
        # other work on the machine slows every stage down (the wall times), not the accuracies
        "load_average_1m": {"start": round(load0[0], 2), "end": round(os.getloadavg()[0], 2)},
        "summary": summarize(per_seed),
        "per_seed": [{k: v for k, v in s.items() if k != "config"} for s in per_seed],
        "resolved_config": per_seed[0]["config"] | {"seed": None},
    }
    outp = Path(args.out)
    outp.parent.mkdir(parents=True, exist_ok=True)
    outp.write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    outp.with_suffix(".md").write_text(md + "\n")
    print(md)
    for s in per_seed:
        print(f"seed {s['seed']}: {'PASS' if s['passed'] else 'FAIL'}")
    for s in failed:
        print(f"seed {s}: FAIL (run failed)")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
