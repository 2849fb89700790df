"""`mopd` command line: run one stage or the whole recipe in one process.

    mopd recipe --config tiny [--set mopd.steps=50 ...] [--restart] [--baseline]
    mopd stage sft    --config tiny [--base PATH]
    mopd stage expert --config tiny --domain math --init runs/tiny/sft/final
    mopd stage mopd   --config tiny --init runs/tiny/sft/final --teacher math=PATH --teacher code=PATH ...
    mopd stage eval   --config tiny --model sft=PATH --model student=PATH
    mopd config show  --config tiny [--set ...]

Bad input exits with status 2 and one line naming the problem, before any compute.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default="tiny", help="preset name in configs/ or a YAML path")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. mopd.steps=50 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of progress bars")


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for it in items:
        if "=" not in it:
            raise ValueError(f"{flag} '{it}' must look like NAME=PATH")
        k, v = it.split("=", 1)
        out[k] = v
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mopd", description="Multi-Teacher On-Policy Distillation recipe")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recipe", help="sft → experts → mopd → eval in one process")
    _common(r)
    r.add_argument("--restart", action="store_true", help="discard this recipe's previous outputs first")
    r.add_argument("--baseline", action="store_true", help="also train the multi-domain GRPO baseline")
    s = sub.add_parser("stage", help="run one stage")
    s.add_argument("stage", choices=["sft", "expert", "mopd", "eval"])
    _common(s)
    s.add_argument("--base", help="sft: base model path/id (default: model.base)")
    s.add_argument("--domain", help="expert: the domain to train an expert for")
    s.add_argument("--init", help="expert/mopd: the initial model (checkpoint dir)")
    s.add_argument("--teacher", action="append", default=[], metavar="ID=PATH", help="mopd: a teacher")
    s.add_argument("--model", action="append", default=[], metavar="LABEL=PATH", help="eval: a model")
    c = sub.add_parser("config", help="show the resolved config")
    c.add_argument("action", choices=["show"])
    _common(c)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("transformers", "httpx", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return _run(args)
    except Exception as e:  # user-facing errors: one line, exit 2; real bugs keep their traceback
        from .errors import NAMED_ERRORS, USER_ERRORS

        if isinstance(e, USER_ERRORS) and not os.environ.get("MOPD_TRACEBACK"):
            hint = "" if isinstance(e, NAMED_ERRORS) else " (MOPD_TRACEBACK=1 shows where it was raised)"
            print(f"error: {e}{hint}", file=sys.stderr)
            return 2
        raise


def _run(args) -> int:
    from .config import load_config

    cfg = load_config(args.config, args.overrides)
    progress = not args.no_progress
    if args.cmd == "config":
        import yaml

        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        return 0
    from . import recipe as R

    R.setup_runtime(cfg)
    if args.cmd == "recipe":
        res = R.run_recipe(cfg, progress=progress, restart=args.restart, baseline=args.baseline)
        print("\nHeld-out greedy accuracy (%):\n" + res.table)
        print("\nwall seconds: " + ", ".join(f"{k}={v:.0f}" for k, v in res.wall_s.items()))
        print(f"outputs: {cfg.run_dir()}")
        return 0
    if args.stage == "sft":
        out = R.sft_stage(cfg, args.base, progress)
    elif args.stage == "expert":
        if not args.domain or not args.init:
            raise ValueError("mopd stage expert needs --domain NAME and --init PATH")
        out = R.expert_stage(cfg, args.domain, args.init, progress)
    elif args.stage == "mopd":
        if not args.init or not args.teacher:
            raise ValueError("mopd stage mopd needs --init PATH and one --teacher ID=PATH per domain")
        out = R.mopd_stage(cfg, args.init, _pairs(args.teacher, "--teacher"), progress)
    else:
        from .evaluation import accuracy_table

        models = _pairs(args.model, "--model")
        if not models:
            raise ValueError("mopd stage eval needs at least one --model LABEL=PATH")
        acc = R.eval_stage(cfg, models)
        print(accuracy_table(acc, "greedy", cfg.domain_names()))
        print(json.dumps(acc))
        return 0
    print(json.dumps({"stage": out.stage, "model_dir": str(out.model_dir), "eval": out.eval,
                      "wall_s": round(out.wall_s, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
