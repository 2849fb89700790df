"""MOPD vs multi-domain GRPO at the same sampling budget: `benchmarks/sample_efficiency.py`.

From a preset's SFT model (`--config`, default the tiny recipe; seed 0, with its experts, built once and cached —
for `tiny` the same run dir as `benchmarks/vs_trl.py`), two stages run per seed with the same prompts × group
samples per step and the same domain mix (`--grpo-steps` gives GRPO a longer budget than MOPD's `--steps`, so
that its crossing is measured rather than bounded):
- `mopd`: the recipe's MOPD stage (three teachers, sampled-token reverse KL + the reward term, as `tiny` ships it);
- `grpo`: joint multi-domain GRPO — the expert RL config (lr, clip, group normalisation) on all domains at once,
  reward = each domain's verifier, no teachers (`w_kd=0`).
Each evaluates greedy held-out accuracy per domain every `--eval-every` steps (and the SFT start as 0 samples).
Reported: accuracy-vs-samples curves per domain (PNG), samples to reach 90 % of each expert's accuracy on its own
domain (first eval point at or above it), and the seesaw under joint GRPO (intervals in which one domain fell by
≥ `--seesaw-delta` while another rose by as much) with each domain's largest fall from its running peak.
Seeds are sampling streams (the loop seeds its prompts and samples by (seed, stage, step); we vary the stage name):
`recipe.seed` fixes the domains' train/held-out split, which the SFT model and experts were trained on.

    .venv/bin/python benchmarks/sample_efficiency.py   # tiny_sparse, seeds 0,1,2: MOPD 20 steps, GRPO 50, eval every 2
    .venv/bin/python benchmarks/sample_efficiency.py --config tiny --seeds 0,1 --steps 80 --grpo-steps 0 \
        --eval-every 10 --out benchmarks/results/sample_efficiency_tiny       # the tiny recipe's three domains

`configs/tiny_sparse.yaml` is the preset where the effect the recipe exists for shows: one sparse-reward domain
(`caps`, an answer rewarded only when all its letters are right), on which GRPO from SFT sees a reward in few
groups while the teacher scores every token. Each method runs with its own recipe's batch (GRPO the expert's,
MOPD the preset's `mopd`), so the x axis is samples, not steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import peer_stats as ps  # noqa: E402
import vs_trl  # noqa: E402
from tiny_recipe import machine_info  # noqa: E402

METHODS = ("mopd", "grpo")


def load_cfg(args, extra=()):
    """`--config` with the peers' base overrides (seed 0, cpu, threads); another preset than tiny builds under its
    own name (its run dir: run-dir/<config>), so the tiny build cached for vs_trl is reused and never overwritten."""
    from mopd_core.config import load_config

    name = [] if args.config == "tiny" else [f"name={args.config}"]
    return load_config(args.config, vs_trl.base_overrides(args) + name + list(extra))


def build_models(args) -> dict:
    """The preset's SFT model and experts, trained once and cached in the run dir (reused by fingerprint)."""
    from mopd_core import recipe as R

    cfg = load_cfg(args)
    R.setup_runtime(cfg)
    t0 = time.perf_counter()
    sft = R.sft_stage(cfg, R.base_model(cfg), progress=False)
    experts = {d: R.expert_stage(cfg, d, sft.model_dir, progress=False) for d in cfg.expert_domains()}
    return {"sft": str(sft.model_dir), "experts": {d: str(e.model_dir) for d, e in experts.items()},
            "sft_eval": sft.eval, "expert_eval": {d: e.eval for d, e in experts.items()},
            "build_s": time.perf_counter() - t0}


def method_steps(args, method: str) -> int:
    return args.grpo_steps if method == "grpo" and args.grpo_steps else args.steps


def stage_cfg(args, method: str):
    steps = method_steps(args, method)
    extra = args.grpo_set if method == "grpo" else []  # e.g. expert.prompts_per_step=16: GRPO at another batch
    cfg = load_cfg(args, [f"mopd.steps={steps}", f"mopd.save_every={steps}", f"mopd.eval_every={args.eval_every}",
                          "eval.mean_at_k=0", *extra])  # the curves are greedy; a preset's mean@k costs k samples
    if method == "grpo":  # the expert RL recipe on all domains jointly, at MOPD's budget and mix
        e = cfg.expert
        cfg.mopd = cfg.mopd.model_copy(update={
            "w_kd": 0.0, "w_rl": 1.0, "lr": e.lr, "warmup_steps": e.warmup_steps, "weight_decay": e.weight_decay,
            "betas": e.betas, "grad_clip": e.grad_clip, "clip_low": e.clip_low, "clip_high": e.clip_high,
            "scale_by_std": e.scale_by_std, "minibatches": e.minibatches,
            # and its batch: a group to find the rare rewarded sample in (tiny: the same 32 × 8 as MOPD's)
            "prompts_per_step": e.prompts_per_step, "group_size": e.group_size})
    return cfg


def run(args, build: dict, method: str, seed: int) -> dict:
    import torch

    from mopd_core import recipe as R

    cfg = stage_cfg(args, method)
    R.setup_runtime(cfg)
    torch.set_num_threads(args.threads)
    stage = f"se-{method}-s{seed}"
    shutil.rmtree(cfg.run_dir() / stage, ignore_errors=True)
    teachers = build["experts"] if method == "mopd" else {}
    t0 = time.perf_counter()
    out = R.mopd_stage(cfg, build["sft"], teachers, progress=False, stage_name=stage)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out.stage_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    per_step = cfg.mopd.prompts_per_step * cfg.mopd.group_size
    doms = list(build["sft_eval"])
    xs = [0] + [r["step"] * per_step for r in rows if f"eval/{doms[0]}/greedy" in r] + [cfg.mopd.steps * per_step]
    curves = {d: [build["sft_eval"][d]["greedy"]] + [r[f"eval/{d}/greedy"] for r in rows
                                                     if f"eval/{d}/greedy" in r] + [out.eval[d]["greedy"]]
              for d in doms}
    shutil.rmtree(out.stage_dir, ignore_errors=True)
    return {"method": method, "seed": seed, "samples": xs, "curves": curves, "wall_s": wall}


def analyse(res: dict, delta: float) -> dict:
    targets = {d: 0.9 * res["build"]["expert_eval"][d][d]["greedy"] for d in res["domains"]}
    out = {"targets": targets, "cross": {}, "final": {}, "seesaw": {}, "drawdown": {}}
    for m in METHODS:
        runs = [r for r in res["runs"] if r["method"] == m]
        if not runs:
            continue
        out["cross"][m] = {d: [ps.first_crossing(r["samples"], r["curves"][d], targets[d]) for r in runs]
                           for d in res["domains"]}
        out["final"][m] = {d: [r["curves"][d][-1] for r in runs] for d in res["domains"]}
        out["seesaw"][m] = [ps.seesaw_events(r["curves"], r["samples"], delta) for r in runs]
        out["drawdown"][m] = {d: [ps.max_drawdown(r["curves"][d]) for r in runs] for d in res["domains"]}
    seeds = sorted({r["seed"] for r in res["runs"]})
    out["ratio"] = {d: [sample_ratio(res, seed, d, targets[d]) for seed in seeds] for d in res["domains"]}
    return out


def sample_ratio(res: dict, seed: int, domain: str, target: float) -> dict | None:
    """GRPO's samples to the target ÷ MOPD's, for one seed (None until both ran). A method that never reached it
    counts as its whole budget, which makes the ratio a bound (`bound`: "≥" if only GRPO missed, "≤" if only MOPD)."""
    by = {r["method"]: r for r in res["runs"] if r["seed"] == seed}
    if set(by) != set(METHODS):
        return None
    x = {m: ps.first_crossing(by[m]["samples"], by[m]["curves"][domain], target) for m in METHODS}
    if x["mopd"] is None and x["grpo"] is None:
        return {"mopd": None, "grpo": None, "ratio": None, "bound": "neither reached"}
    bound = "≥" if x["grpo"] is None else "≤" if x["mopd"] is None else "="
    n = {m: x[m] if x[m] is not None else by[m]["samples"][-1] for m in METHODS}
    return {"mopd": x["mopd"], "grpo": x["grpo"], "ratio": n["grpo"] / n["mopd"], "bound": bound}


def _cross_str(vals: list) -> str:
    hit = [v for v in vals if v is not None]
    if not hit:
        return f"not reached ({len(vals)}/{len(vals)} runs)"
    s = ps.fmt_pm(hit, 0)
    return s if len(hit) == len(vals) else f"{s} ({len(vals) - len(hit)}/{len(vals)} runs never)"


def _budget(res: dict) -> str:
    steps = res.get("method_steps", {m: res["steps"] for m in METHODS})
    per = res.get("method_per_step", {m: res["per_step"] for m in METHODS})
    return "; ".join(f"{m} {steps[m]} steps × {per[m]} samples = {steps[m] * per[m]} samples"
                     for m in METHODS) + " per run"


def _load(res: dict) -> str:
    la = res.get("load_average_1m") or {}
    return f"{la.get('start', '?')} at the start, {la.get('end', '?')} at the end (1 min, 2 cores)"


def _ratio_str(x: dict | None) -> str:
    if x is None:
        return "–"
    if x["ratio"] is None:
        return x["bound"]
    cross = " / ".join("never" if x[m] is None else f"{x[m]:.0f}" for m in METHODS)
    return f"{cross} → {x['bound'] if x['bound'] != '=' else ''}{x['ratio']:.1f}×"


def render(res: dict) -> str:
    a, mc = res["analysis"], res["machine"]
    doms = res["domains"]
    lines = [f"# Sample efficiency: MOPD vs joint multi-domain GRPO ({mc['cpu']}, {mc['cores']} cores, "
             f"{mc['threads']} torch thread(s), torch {mc['torch']})", "",
             f"`benchmarks/sample_efficiency.py --config {res.get('config', 'tiny')}` — from the preset's SFT model "
             f"(seed 0); {_budget(res)}"
             + (f" (GRPO arm: `{' '.join(res['grpo_set'])}`)" if res.get("grpo_set") else "") + ", mix "
             f"{res['mix']}, held-out greedy accuracy every {res['eval_every']} steps ({res['eval_size']} prompts per "
             f"domain), seeds {res['seeds']} (sampling streams; mean ± std over them). Ran beside other jobs on the "
             f"2-core machine (accuracy does not depend on it; load average {_load(res)}). Total wall "
             f"{res['wall_s'] / 60:.1f} min. Curves: "
             f"`{res.get('png', 'sample_efficiency.png')}`.", "",
             "Experts on their own domain (90 % target): " + ", ".join(
                 f"{d} {100 * res['build']['expert_eval'][d][d]['greedy']:.1f} % → {100 * a['targets'][d]:.1f} %"
                 for d in doms) + "; SFT start: " + ", ".join(
                 f"{d} {100 * res['build']['sft_eval'][d]['greedy']:.1f} %" for d in doms) + ".", "",
             "## Samples to reach 90 % of the expert (first eval point at or above it)", ""]
    lines.append(ps.md_table(["method"] + doms, [[m] + [_cross_str(a["cross"][m][d]) for d in doms]
                                                  for m in METHODS if a["cross"].get(m)]))
    lines += ["", "## GRPO's samples ÷ MOPD's to reach 90 % of the expert, per seed", ""]
    seeds = sorted({r["seed"] for r in res["runs"]})
    lines.append(ps.md_table(["domain"] + [f"seed {s} (MOPD / GRPO samples)" for s in seeds] +
                             ["ratio, mean ± std"],
                             [[d] + [_ratio_str(x) for x in a["ratio"][d]] +
                              [ps.fmt_pm([x["ratio"] for x in a["ratio"][d] if x and x["ratio"]], 1)]
                              for d in doms]))
    lines += ["", "## Held-out greedy accuracy at the end of the budget (%)", ""]
    lines.append(ps.md_table(["method"] + doms, [[m] + [ps.fmt_pm(a["final"][m][d], 1, 100) for d in doms]
                                                  for m in METHODS if a["final"].get(m)]))
    lines += ["", f"## Seesaw (a domain falls ≥ {100 * res['seesaw_delta']:.0f} points between two evals while "
              "another rises as much) and each domain's largest fall from its running peak (points)", ""]
    rows = []
    for m in METHODS:
        if not a["seesaw"].get(m):
            continue
        ev = a["seesaw"][m]
        ex = [e for run in ev for e in run]
        example = (f"e.g. {ex[0]['fell']} −{100 * ex[0]['drop']:.1f} while {ex[0]['rose']} +{100 * ex[0]['gain']:.1f}"
                   f" ({ex[0]['from']}→{ex[0]['to']} samples)") if ex else "none"
        rows.append([m, " / ".join(str(len(r)) for r in ev), example] +
                    [ps.fmt_pm(a["drawdown"][m][d], 1, 100) for d in doms])
    lines.append(ps.md_table(["method", "seesaw intervals per seed", "first one"] +
                             [f"max fall {d}" for d in doms], rows))
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doms = res["domains"]
    fig, axes = plt.subplots(1, len(doms), figsize=(max(5 * len(doms), 7), 4), sharey=True, squeeze=False)
    axes = axes[0]
    colors = {"mopd": "tab:blue", "grpo": "tab:orange"}
    for ax, d in zip(axes, doms):
        for r in res["runs"]:
            ax.plot(r["samples"], [100 * y for y in r["curves"][d]], color=colors[r["method"]], alpha=0.8,
                    linestyle="-" if r["seed"] == res["seeds"][0] else "--",
                    label=f"{r['method']} seed {r['seed']}")
        ax.axhline(100 * res["analysis"]["targets"][d], color="gray", linestyle=":", label="90 % of expert")
        ax.set_title(d)
        ax.set_xlabel("samples")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out greedy accuracy (%)")
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"MOPD vs GRPO from SFT: samples to the expert ({res.get('config', 'tiny')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny_sparse", help="the preset (configs/<name>.yaml)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--grpo-steps", type=int, default=50, help="GRPO's budget in steps (0: --steps)")
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--grpo-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override of the GRPO arm only, e.g. expert.prompts_per_step=16 (its batch)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seesaw-delta", type=float, default=0.03)
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "bench-peers")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sample_efficiency")
    args = ap.parse_args(argv)
    args.run_dir = args.run_dir.resolve()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    import torch

    t_all = time.perf_counter()
    build = build_models(args)
    cfg = stage_cfg(args, "mopd")
    seeds = [int(s) for s in args.seeds.split(",")]
    res = {"machine": {"cpu": machine_info()["cpu_model"] or "unknown", "cores": os.cpu_count(),
                       "threads": args.threads, "torch": torch.__version__},
           "config": args.config, "grpo_set": args.grpo_set,
           "method_steps": {m: method_steps(args, m) for m in METHODS},
           "load_average_1m": {"start": round(os.getloadavg()[0], 2)},
           "png": args.out.with_suffix(".png").name, "command": " ".join(sys.argv),
           "steps": args.steps, "per_step": cfg.mopd.prompts_per_step * cfg.mopd.group_size,
           "method_per_step": {m: stage_cfg(args, m).mopd.prompts_per_step * stage_cfg(args, m).mopd.group_size
                               for m in METHODS},
           "eval_every": args.eval_every, "eval_size": cfg.mopd.eval_size or "all",
           "mix": cfg.prompt_mix(cfg.mopd), "seeds": seeds, "seesaw_delta": args.seesaw_delta,
           "domains": list(build["sft_eval"]), "build": build, "runs": []}
    for seed in seeds:
        for method in METHODS:  # interleaved, so both methods see the same machine
            r = run(args, build, method, seed)
            print(f"{method} seed {seed}: final " + ", ".join(f"{d} {100 * c[-1]:.1f}"
                                                              for d, c in r["curves"].items())
                  + f" ({r['wall_s']:.0f} s)", flush=True)
            res["runs"].append(r)
            res["analysis"] = analyse(res, args.seesaw_delta)
            res["wall_s"] = time.perf_counter() - t_all
            res["load_average_1m"]["end"] = round(os.getloadavg()[0], 2)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
            args.out.with_suffix(".md").write_text(render(res))
            plot(res, args.out.with_suffix(".png"))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
