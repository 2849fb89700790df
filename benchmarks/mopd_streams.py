"""Benchmark: more MOPD streams of one seed — the tiny recipe's MOPD stage rerun from a finished run's SFT model and
experts under other stage names (a stage's sampling derives from (seed, stage name, step), so each name is another
sampling stream; the eval set, init and teachers stay the seed's). It measures how much of a seed's result is the
draw of its stream, e.g. when one seed misses the learning bar by less than the eval's noise.

    .venv/bin/python benchmarks/mopd_streams.py --stages runs/bench/seed2/tiny --seed 2 --reps 1,2 \\
        [--objective default|sampled_rkl|topk_rkl|...] [--output-dir runs/streams] [--set k=v ...]

Stage `student-<objective>-rep<r>`; one JSON line per stream (greedy held-out accuracy per domain) on stdout and in
`<output-dir>/seed<N>/s<N>-<objective>-rep<r>.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--stages", required=True, help="a finished run's stage folder: sft/, expert-<domain>/")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--reps", default="1,2")
    ap.add_argument("--objective", default="default", help="mopd.kd_loss, or `default` (the config's own)")
    ap.add_argument("--output-dir", default=str(ROOT / "runs/streams"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args(argv)
    from mopd_core import recipe as R
    from mopd_core.config import load_config

    stages, out = Path(args.stages), Path(args.output_dir) / f"seed{args.seed}"
    over = [f"output_dir={out}", f"seed={args.seed}", *args.overrides]
    if args.objective != "default":
        over.append(f"mopd.kd_loss={args.objective}")
    cfg = load_config(args.config, over)
    R.setup_runtime(cfg)
    experts = {d: stages / f"expert-{d}" / "final" for d in cfg.domain_names()}
    for rep in [int(r) for r in args.reps.split(",")]:
        res = R.mopd_stage(cfg, stages / "sft" / "final", experts, progress=False,
                           stage_name=f"student-{args.objective}-rep{rep}")
        row = {"seed": args.seed, "rep": rep, "obj": args.objective, "kd_loss": cfg.mopd.kd_loss,
               "eval": {k: v["greedy"] for k, v in res.eval.items()}}
        out.mkdir(parents=True, exist_ok=True)
        (out / f"s{args.seed}-{args.objective}-rep{rep}.json").write_text(json.dumps(row))
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
