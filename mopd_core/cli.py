"""`mopd` command line: run one stage or the whole recipe in one process.

    mopd recipe --config tiny [--set mopd.steps=50 ...] [--restart] [--baseline]   (--set rounds=2: two MOPD rounds)
    mopd stage sft    --config tiny [--base PATH]
    mopd stage expert --config tiny --domain math --init runs/tiny/sft/final
    mopd stage expert --config tiny --domain math --init runs/tiny/student/final --round 2   (a later MOPD round)
    mopd stage mopd   --config tiny --init runs/tiny/sft/final --teacher math=PATH --teacher code=PATH ...
    mopd stage eval   --config tiny --model sft=PATH --model student=PATH [--out DIR]
    mopd config show  --config tiny [--set ...]
    mopd data check   data/math.parquet [--schema verl] [--set prompt_field=question ...] [--name math]

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

# No network at run time: a model id resolves from the local Hugging Face cache only (a missing one is one error
# line at once, not a minute of retries against the hub). HF_HUB_OFFLINE=0 lets the hub be asked. Set before any
# import of huggingface_hub, which reads it once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
    s.add_argument("--round", type=int, default=None, metavar="R", help="expert/mopd: the MOPD round the stage "
                   "belongs to (R ≥ 2 writes <run_dir>/rR/…, e.g. an expert from round R−1's student)")
    s.add_argument("--out", default=None, metavar="DIR", help="eval: write accuracy.{md,json,png} and "
                   "eval_rows.jsonl (every completion, its extracted answer and reward) there")
    c = sub.add_parser("config", help="show the resolved config")
    c.add_argument("action", choices=["show"])
    _common(c)
    d = sub.add_parser("data", help="inspect a dataset source as the loader reads it")
    d.add_argument("action", choices=["check"])
    d.add_argument("source", help="a .jsonl / .json / .parquet file or a datasets save_to_disk directory")
    d.add_argument("--schema", help="auto (default), flat, verl, ifeval, livecodebench, deepcoder, taco, leetcode, "
                   "gsm8k or aime")
    d.add_argument("--set", "-s", dest="params", action="append", default=[], metavar="KEY=VALUE",
                   help="a dataset param as in data.domains[].params: prompt_field=question, "
                   "answer_field=reward_model.ground_truth, fields.tests=input_output, teacher_id_field=domain, "
                   "answer_join=', ', split=train (repeatable)")
    d.add_argument("--name", help="the domain name, the teacher_id of rows without one (default: the source's "
                   "file name without extension)")
    d.add_argument("--config", "-c", default=None, help="also render the first row as this preset feeds it: its "
                   "tokenizer (model.base) and data.chat (chat template, system prompt, suffix)")
    d.add_argument("--config-set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="an override of that preset, e.g. data.chat.enabled=true (repeatable)")
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


_STAGE_FLAGS = {"sft": ("base",), "expert": ("domain", "init", "round"), "mopd": ("init", "teacher", "round"),
                "eval": ("model",), "all": ("base", "domain", "init", "teacher", "model", "round")}


def _run(args) -> int:
    from .config import load_config
    from .errors import ConfigError

    if args.cmd == "data":
        return _data_check(args)
    cfg = load_config(args.config, args.overrides)
    progress = not args.no_progress
    if args.cmd == "config":
        import yaml

        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        return 0
    if args.cmd == "stage":  # the command line itself, checked before anything is set up
        given = [k for k in _STAGE_FLAGS["all"] if vars(args)[k] not in (None, [], "")]
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
        if args.round is not None and args.round < 1:
            raise ConfigError(f"--round {args.round}: give the MOPD round the stage belongs to (1, 2, …)")
    from . import recipe as R

    R.setup_runtime(cfg)
    if args.cmd == "recipe":
        res = R.run_recipe(cfg, progress=progress, restart=args.restart, baseline=args.baseline)
        print("\nAccuracy (%; greedy held-out, or the domain's benchmarks):\n" + res.table)
        print("\nwall seconds: " + ", ".join(f"{k}={v:.0f}" for k, v in res.wall_s.items()))
        print(f"outputs: {cfg.run_dir()}")
        return 0
    if args.stage == "sft":
        out = R.sft_stage(cfg, args.base, progress)
    elif args.stage == "expert":
        out = R.expert_stage(cfg, args.domain, args.init, progress, rnd=args.round or 1)
    elif args.stage == "mopd":
        out = R.mopd_stage(cfg, args.init, teachers, progress, rnd=args.round or 1)
    else:
        rep = R.eval_stage(cfg, models, args.out)
        print(rep.table)
        if rep.files:
            print(f"outputs: {', '.join(str(f) for f in rep.files.values())}")
        print(json.dumps(rep.accuracy))
        return 0
    print(json.dumps({"stage": out.stage, "model_dir": str(out.model_dir), "eval": out.eval,
                      "wall_s": round(out.wall_s, 1), "reused": out.reused}))
    return 0


# ---- mopd data check ----------------------------------------------------------------------------------------

def render_preview(example, cfg) -> str | None:
    """`mopd data check --config P`: the row's prompt rendered by the prompt formatter the recipe uses (P's
    tokenizer and `data.chat`), as text, with its token count; None without a preset."""
    if cfg is None:
        return None
    from .models.chat import PromptFormatter
    from .models import run_tokenizer

    fmt = PromptFormatter(run_tokenizer(cfg.model), cfg.data.chat)
    n = len(fmt.ids(example))
    return (f"{fmt.text(example)!r} ({n} tokens; data.max_prompt_tokens={cfg.data.max_prompt_tokens}"
            f"{', over it' if n > cfg.data.max_prompt_tokens else ''})")


def _preview(v, limit: int = 400):
    """A display copy of a row: long strings and lists shortened (LiveCodeBench rows carry megabytes of tests)."""
    if isinstance(v, str):
        return v if len(v) <= limit else f"{v[:limit]}… (+{len(v) - limit} chars)"
    if isinstance(v, dict):
        return {k: _preview(x, limit) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        head = [_preview(x, limit) for x in v[:5]]
        return head + [f"… (+{len(v) - 5} more)"] if len(v) > 5 else head
    return v


def _data_check(args) -> int:
    from collections import Counter
    from pathlib import Path

    from .config import apply_overrides
    from .domains.dataset import inspect_source
    from .domains.schemas import COLUMN_MAP_PARAMS
    from .errors import ConfigError

    params = apply_overrides({}, args.params)
    accepted = ("split", *COLUMN_MAP_PARAMS)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ConfigError(f"--set {unknown[0]}=…: not a dataset param of `mopd data check`; accepted: "
                          f"{', '.join(accepted)}")
    if args.schema is not None:
        if params.get("schema") not in (None, args.schema):
            raise ConfigError(f"--schema {args.schema} and --set schema={params['schema']} disagree; give one")
        params["schema"] = args.schema
    split = params.pop("split", None)
    name = args.name or Path(args.source).stem
    examples, info = inspect_source(args.source, split=split, column_map=params, default_teacher_id=name)
    how = {"given": "(given)", "recognised": "(recognised from the columns)",
           "fallback": "(no known schema matched: read as flat)"}[info.how]
    print(f"source:  {info.source}" + (f" (split {split})" if split else ""))
    print(f"schema:  {info.schema} {how}")
    print(f"columns: {', '.join(info.columns)}")
    print("mapping:")
    width = max(len(t) for t, _ in info.mapping)
    for target, src in info.mapping:
        print(f"  {target.ljust(width)}  <- {src}")
    print(f"rows:    {info.rows}")
    print("rows per teacher_id:")
    for tid, n in sorted(Counter(e.teacher_id for e in examples).items()):
        print(f"  {tid}: {n}")
    first = examples[0]
    print("first row (as an Example):")
    print(json.dumps(_preview(first.to_dict()), indent=2, ensure_ascii=False, default=str))
    print("prompt as chat messages" + (":" if first.is_chat else " (a string prompt is one user turn):"))
    for m in first.prompt_messages():
        print(f"  [{m['role']}] {_preview(m['content'])}")
    cfg = None
    if args.config is not None:
        from .config import load_config

        cfg = load_config(args.config, args.overrides)
    elif args.overrides:
        raise ConfigError("--config-set needs --config (the preset it overrides)")
    rendered = render_preview(first, cfg)
    print("rendered: " + (rendered if rendered is not None else "(give --config PRESET to render it as that recipe "
                          "feeds it: tokenizer and data.chat)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
