"""Benchmark: what the bubblewrap boundary costs per code test. The code verifier starts one sandboxed process per
(completion, test run), many times per step, so the per-run start-up is the number that matters.

Compares, in one process, interleaved so that machine load hits both alike:
- `none`  — `isolation: none`: the sandbox as it was before bubblewrap (util-linux unshare namespaces where
            permitted, a dropped uid, rlimits, the audit hook);
- `bwrap` — the default: the same child inside bubblewrap (+ seccomp where libseccomp is installed).

Each repeat runs `--runs` assert-style test runs (`run_python_tests`, one small function, two asserts) per mode,
sequentially (one core's latency), and reports the median and p90 wall time of a run. Writes
`benchmarks/results/sandbox_overhead.{json,md}` with the machine and its load average.

    .venv/bin/python benchmarks/sandbox_overhead.py [--repeats 3] [--runs 30]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mopd_core.domains.sandbox import run_python_tests, sandbox_layers  # noqa: E402

CODE = "def f(xs):\n    return sorted(xs)[::-1]\n"
TESTS = ["assert f([1, 3, 2]) == [3, 2, 1]", "assert f([]) == []"]


def _cpu() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "?"


def _one(mode: str) -> float:
    t0 = time.perf_counter()
    r = run_python_tests(CODE, TESTS, isolation=mode)
    wall = time.perf_counter() - t0
    if r.passed != (True, True):
        raise SystemExit(f"benchmark program failed under isolation={mode}: {r.result.stderr[-500:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", type=int, default=30, help="test runs per mode and repeat")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sandbox_overhead.json")
    args = ap.parse_args()
    modes = ("none", "bwrap")
    layers = {m: list(sandbox_layers(m)) for m in modes}  # probe (and warm) both before timing
    for m in modes:
        _one(m)
    load_before = os.getloadavg()
    reps: list[dict] = []
    for rep in range(args.repeats):
        walls: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.runs):
            for m in modes:  # interleaved: load changes hit both modes alike
                walls[m].append(_one(m))
        reps.append({m: {"median_ms": 1000 * statistics.median(w),
                         "p90_ms": 1000 * statistics.quantiles(w, n=10)[-1]} for m, w in walls.items()})
        print(f"repeat {rep}: " + ", ".join(f"{m} {reps[-1][m]['median_ms']:.0f} ms" for m in modes), flush=True)
    load_after = os.getloadavg()
    med = {m: statistics.median(r[m]["median_ms"] for r in reps) for m in modes}
    res = {"machine": f"{_cpu()}, {os.cpu_count()} cores, Linux {platform.release()}, Python "
                      f"{platform.python_version()}",
           "load_avg_before": load_before, "load_avg_after": load_after, "runs_per_repeat": args.runs,
           "repeats": reps, "median_ms": med, "overhead_ms": med["bwrap"] - med["none"], "layers": layers}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    md = ["# Code sandbox: per-run overhead of the bubblewrap boundary", "",
          f"`benchmarks/sandbox_overhead.py --repeats {args.repeats} --runs {args.runs}` on {res['machine']}; "
          f"load average (1/5/15 min) {', '.join(f'{x:.1f}' for x in load_before)} before, "
          f"{', '.join(f'{x:.1f}' for x in load_after)} after (a shared machine: absolute numbers move with it, "
          "the two modes are interleaved so the difference is fair).", "",
          "One run = one sandboxed process that runs a small function and two asserts (`run_python_tests`), "
          "start-up to exit, measured in the caller.", "",
          "| repeat | none: median ms | none: p90 ms | bwrap: median ms | bwrap: p90 ms |",
          "|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(reps):
        md.append(f"| {i} | {r['none']['median_ms']:.0f} | {r['none']['p90_ms']:.0f} | {r['bwrap']['median_ms']:.0f} "
                  f"| {r['bwrap']['p90_ms']:.0f} |")
    md += ["", f"Median of the repeats: none {med['none']:.0f} ms, bwrap {med['bwrap']:.0f} ms — the boundary costs "
           f"**{res['overhead_ms']:+.0f} ms per run** (compare with the repeats' spread: on a loaded machine a few "
           "tens of ms either way is noise).", "",
           f"Layers — none: {', '.join(layers['none'])}; bwrap: {', '.join(layers['bwrap'])}.", ""]
    args.out.with_suffix(".md").write_text("\n".join(md))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
