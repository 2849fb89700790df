"""`mopd` command line: run one stage or the whole recipe in one process.

    mopd recipe --config tiny [--set mopd.steps=50 ...] [--restart] [--baseline]
    mopd stage sft    --config tiny [--base PATH]
    mopd stage expert --config tiny --domain math --init runs/tiny/sft/final
    mopd stage mopd   --config tiny --init runs/tiny/sft/final --teacher math=PATH --teacher code=PATH ...
    mopd stage eval   --config tiny --model sft=PATH --model student=PATH
    mopd config show  --config tiny [--set ...]

Bad input (a `MopdError`) exits with status 2 and one line `error: <message>` naming the problem and the fix,
before any compute (`MOPD_TRACEBACK=1` adds the traceback). Anything else — a bug, a failure of the
infrastructure — keeps its traceback and exits 1.
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
    from .errors import ConfigError

    out: dict[str, str] = {}
    for it in items:
        k, sep, v = it.partition("=")
        k, v = k.strip(), v.strip()
        if not sep or not k or not v:
            raise ConfigError(f"{flag} '{it}' must look like NAME=PATH (e.g. {flag} math=runs/tiny/expert-math/final)")
        if k in out:
            raise ConfigError(f"{flag} {k}= is given twice ({out[k]} and {v}); give each name once")
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
    from .errors import MopdError, one_line

    try:
        return _run(args)
    except MopdError as e:  # the user's input: one line, exit 2; everything else propagates with its traceback
        if os.environ.get("MOPD_TRACEBACK"):
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2


_STAGE_FLAGS = {"sft": ("base",), "expert": ("domain", "init"), "mopd": ("init", "teacher"), "eval": ("model",),
                "all": ("base", "domain", "init", "teacher", "model")}


def _run(args) -> int:
    from .config import load_config
    from .errors import ConfigError

    cfg = load_config(args.config, args.overrides)
    progress = not args.no_progress
    if args.cmd == "config":
        import yaml

        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        return 0
    if args.cmd == "stage":  # the command line itself, checked before anything is set up
        given = [k for k in _STAGE_FLAGS["all"] if getattr(args, k)]
        wrong = [k for k in given if k not in _STAGE_FLAGS[args.stage]]
        if wrong:  # silently ignoring e.g. `--teacher` on `stage eval` would run something else than asked
            takes = ", ".join(f"--{k}" for k in _STAGE_FLAGS[args.stage])
            raise ConfigError(f"--{wrong[0]} is no option of `mopd stage {args.stage}` (it takes {takes})")
        teachers, models = _pairs(args.teacher, "--teacher"), _pairs(args.model, "--model")
        if args.stage == "expert" and not (args.domain and args.init):
            raise ConfigError("mopd stage expert needs --domain NAME and --init PATH")
        if args.stage == "mopd" and not (args.init and teachers):
            raise ConfigError("mopd stage mopd needs --init PATH and one --teacher ID=PATH per domain")
        if args.stage == "eval" and not models:
            raise ConfigError("mopd stage eval needs at least one --model LABEL=PATH")
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
        out = R.expert_stage(cfg, args.domain, args.init, progress)
    elif args.stage == "mopd":
        out = R.mopd_stage(cfg, args.init, teachers, progress)
    else:
        from .evaluation import accuracy_table

        acc = R.eval_stage(cfg, models)
        print(accuracy_table(acc, "greedy", cfg.domain_names()))
        print(json.dumps(acc))
        return 0
    print(json.dumps({"stage": out.stage, "model_dir": str(out.model_dir), "eval": out.eval,
                      "wall_s": round(out.wall_s, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
