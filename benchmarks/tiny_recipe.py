"""Benchmark: the whole tiny recipe on this machine, plus a multi-domain GRPO baseline trained with exactly the
student's sampling budget (same steps × prompts × group size), so MOPD and plain RL are compared in one run.

Writes `benchmarks/results/tiny_recipe.json` (or --out) and a Markdown table beside it:
wall seconds per stage, tokens/s of rollout, teacher scoring and training, peak RSS, greedy accuracy table.

    .venv/bin/python benchmarks/tiny_recipe.py [--config tiny] [--set k=v ...] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _median(history: list[dict], key: str) -> float | None:
    vals = [r[key] for r in history if key in r]
    return statistics.median(vals) if vals else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/tiny_recipe.json"))
    ap.add_argument("--output-dir", default=str(ROOT / "runs/bench"), help="where the stages write")
    args = ap.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from mopd_core.config import load_config
    from mopd_core.evaluation import accuracy_table
    from mopd_core.recipe import run_recipe
    from mopd_core.runtime.device import peak_rss_mb

    cfg = load_config(args.config, [f"output_dir={args.output_dir}", *args.overrides])
    t0 = time.perf_counter()
    res = run_recipe(cfg, progress=False, restart=True, baseline=True)
    total = time.perf_counter() - t0

    expert_hist = [r for k, o in res.outputs.items() if k.startswith("expert-") for r in o.history]
    student_hist = res.outputs["student"].history
    rl_hist = expert_hist + student_hist + res.outputs["grpo-baseline"].history
    domains = cfg.domain_names()
    acc = {label: {d: res.accuracy[label][d]["greedy"] for d in domains} for label in res.accuracy}
    out = {
        "config": args.config, "overrides": args.overrides,
        "machine": {"python": platform.python_version(), "cpu_count": __import__("os").cpu_count(),
                    "torch_threads": __import__("torch").get_num_threads()},
        "accuracy": acc,
        "wall_s": {**{k: round(v, 2) for k, v in res.wall_s.items()}, "benchmark_total": round(total, 2)},
        "tokens_per_s": {
            "rollout": _median(rl_hist, "perf/rollout_tokens_per_s"),
            "teacher_scoring": _median(student_hist, "perf/score_tokens_per_s"),
            "train": _median(rl_hist, "perf/train_tokens_per_s"),
        },
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "student_vs_expert": {d: (acc["student"][d] / acc[f"expert-{d}"][d] if acc[f"expert-{d}"][d] else None)
                              for d in domains},
        "samples": {"student": cfg.mopd.steps * cfg.mopd.prompts_per_step * cfg.mopd.group_size,
                    "grpo-baseline": cfg.mopd.steps * cfg.mopd.prompts_per_step * cfg.mopd.group_size},
    }
    outp = Path(args.out)
    outp.parent.mkdir(parents=True, exist_ok=True)
    outp.write_text(json.dumps(out, indent=2))
    md = [f"# Tiny recipe benchmark ({args.config})", "",
          "Held-out greedy accuracy (%), 200 prompts per domain:", "",
          accuracy_table(res.accuracy, "greedy", domains), "",
          "| stage | wall s |", "|---|---:|", *[f"| {k} | {v:.1f} |" for k, v in out["wall_s"].items()], "",
          "| throughput | tokens/s |", "|---|---:|",
          *[f"| {k} | {v:.0f} |" for k, v in out["tokens_per_s"].items() if v is not None], "",
          f"Peak RSS: {out['peak_rss_mb']:.0f} MiB. Student / expert on the expert's domain: " +
          ", ".join(f"{d} {v:.0%}" for d, v in out["student_vs_expert"].items() if v is not None) + "."]
    outp.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
