"""Benchmark: held-out greedy accuracy of every kept checkpoint of a finished policy stage (and its `final/`), to see
how much a stage's result moves over its last steps — e.g. whether the learning bar reads a settled model or a
point of a noisy plateau.

    .venv/bin/python benchmarks/eval_checkpoints.py --stage runs/bench/seed2/tiny/student --seed 2 \\
        [--domains math,code,if] [--set k=v ...]

One JSON line per checkpoint on stdout: {"stage", "checkpoint", "eval": {domain: greedy}}. `--seed` must be the
run's (the held-out split follows it).
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
    ap.add_argument("--stage", required=True, help="a finished stage folder (checkpoints/step-*/model, final/)")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--domains", default=None, help="comma-separated; default every domain of the config")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args(argv)
    from mopd_core import recipe as R
    from mopd_core.config import load_config
    from mopd_core.train.loop import evaluate_checkpoint

    cfg = load_config(args.config, [f"seed={args.seed}", *args.overrides])
    R.setup_runtime(cfg)
    doms = R.build_domains(cfg, args.domains.split(",") if args.domains else None)
    stage = Path(args.stage)
    for ck in [*sorted(stage.glob("checkpoints/step-*/model")), stage / "final"]:
        res = evaluate_checkpoint(ck, cfg, doms)
        print(json.dumps({"stage": str(stage), "checkpoint": str(ck.relative_to(stage)),
                          "eval": {d: v["greedy"] for d, v in res.scores.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
