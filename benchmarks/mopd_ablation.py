"""Benchmark: Open-MOPD's ablation (arXiv 2608.19098, table "M-OPD ablation") on `configs/tiny_imbalanced.yaml`.

Per seed: SFT once, one RL expert per domain once, then every MOPD variant from that same SFT model and those
same experts (each variant its own stage folder `student-<variant>`, so the shared stages are trained once and
reused through the recipe's fingerprints), each evaluated on the held-out prompts (mean@8 at T=1, and greedy).
The variants, as in the paper's table (cumulative where it writes "+"):

    naive          sampled-token reverse KL (β=1), one optimizer step per rollout batch, no reward term
    share          + token-share balancing              mopd.balance=tokens
    share_gap      + gap-following                      + mopd.gap_following=true
    k4             naive with K=4 minibatches           mopd.minibatches=4
    k4_share_gap   + share + gap at K=4
    k4_refresh     + reward refresh (on share + gap, K=4) + mopd.reward_refresh=true
    dense          naive with the dense top-K reverse KL  mopd.kd_loss=topk_rkl (vs `naive`: sampled)

and beyond the paper's table (the goal: a variant that recovers ≥ 90 % on every seed): K=4 with share alone,
the reward term on (w_rl=1, the seeds' RL + distillation objective), K=8, and the dense top-K objective under
share + gap at K=4 with and without reward refresh — `k4_refresh_dense` is configs/tiny_imbalanced.yaml's own
MOPD setting. Every variant states its objective's knobs (naive's values, then its changes), so no variant
depends on the preset's defaults or on `mopd.kd_loss`'s; the budget (steps, prompts, samples) is the preset's.
By default the table runs `TABLE` (the paper's rows, the preset's and its nearest rivals); `--variants all` runs
every variant.

A variant whose config keys this checkout does not have yet (its overrides fail validation) is skipped and the
table says why. Per variant: per-domain accuracy, the total (mean over domains), recovery
(student − SFT) / (expert − SFT) per domain and for the total (expert total = the mean of each expert on its own
domain), and each domain's share of the completion tokens and of the gradient mass Σ w_t·|A_t|
(`token_share/<d>`, `grad_share/<d>`: token-share weights and gap-following scales included; the mean over
the stage's steps in metrics.jsonl); mean ± std over the seeds; whether
Open-MOPD's ordering holds (naive < +share < +gap; K=4 share+gap > naive; refresh best) and by how much.

Writes `benchmarks/results/mopd_ablation.{json,md}` after every finished variant (labelled partial until the
last one), so an interrupted run leaves what it measured.

    .venv/bin/python benchmarks/mopd_ablation.py [--seeds 0,1] [--variants naive,share,...] [--set k=v ...]
        [--output-dir runs/bench-ablation] [--out benchmarks/results/mopd_ablation.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from peer_stats import mean_std  # noqa: E402
from tiny_recipe import machine_info  # noqa: E402  (the machine line every benchmark table carries)

SHARE_GAP = ["mopd.balance=tokens", "mopd.gap_following=true"]
# naive MOPD spelled out (each variant starts from it): the preset's own defaults are the recommended variant
NAIVE = ["mopd.kd_loss=sampled_rkl", "mopd.kd_clip=5.0", "mopd.minibatches=1", "mopd.balance=none",
         "mopd.gap_following=false", "mopd.reward_refresh=false", "mopd.w_kd=1.0", "mopd.w_rl=0.0", "mopd.lr=1.0e-4"]
LR2 = "mopd.lr=2.0e-4"  # the learning budget: at 1e-4 × 40 steps (the preset before) balancing was nearly zero-sum
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "naive": ("naive (sampled-token RKL)", []),
    "share": ("+ token-share", ["mopd.balance=tokens"]),
    "share_gap": ("+ gap-following", SHARE_GAP),
    "k4": ("K=4 minibatches", ["mopd.minibatches=4"]),
    "k4_share_gap": ("+ share + gap, K=4", ["mopd.minibatches=4", *SHARE_GAP]),
    "k4_refresh": ("+ reward refresh (share + gap, K=4)", ["mopd.minibatches=4", *SHARE_GAP,
                                                          "mopd.reward_refresh=true"]),
    "dense": ("dense top-K RKL (naive otherwise)", ["mopd.kd_loss=topk_rkl"]),
    # beyond the paper's table: the seeds' joint objective (AReaL: RL loss + distillation loss; the verifier's
    # reward is per sequence, so a one-token answer's reward advantage is as large as a long one's) and more
    # optimizer steps per rollout batch
    "k4_share": ("K=4 + token-share (no gap)", ["mopd.minibatches=4", "mopd.balance=tokens"]),
    "k4_share_gap_rl": ("+ share + gap, K=4, + reward w_rl=1", ["mopd.minibatches=4", *SHARE_GAP, "mopd.w_rl=1"]),
    "k4_refresh_rl": ("+ refresh (share + gap, K=4), + reward w_rl=1",
                      ["mopd.minibatches=4", *SHARE_GAP, "mopd.reward_refresh=true", "mopd.w_rl=1"]),
    "k8_share_gap": ("+ share + gap, K=8", ["mopd.minibatches=8", *SHARE_GAP]),
    "k8_refresh": ("+ refresh (share + gap, K=8)", ["mopd.minibatches=8", *SHARE_GAP, "mopd.reward_refresh=true"]),
    # Open-MOPD's own objective is the dense top-K reverse KL: for a one-token answer it scores every candidate
    # digit of every sample, where the sampled-token estimate sees one
    "k4_share_gap_dense": ("+ share + gap, K=4, dense top-K RKL",
                           ["mopd.minibatches=4", *SHARE_GAP, "mopd.kd_loss=topk_rkl"]),
    "k4_refresh_dense": ("+ refresh (share + gap, K=4), dense top-K RKL",
                         ["mopd.minibatches=4", *SHARE_GAP, "mopd.reward_refresh=true", "mopd.kd_loss=topk_rkl"]),
    "k4_share_gap_dense_rl": ("+ share + gap, K=4, dense top-K RKL, + reward w_rl=1",
                              ["mopd.minibatches=4", *SHARE_GAP, "mopd.kd_loss=topk_rkl", "mopd.w_rl=1"]),
    "k8_share_gap_dense_rl": ("+ share + gap, K=8, dense top-K RKL, + reward w_rl=1",
                              ["mopd.minibatches=8", *SHARE_GAP, "mopd.kd_loss=topk_rkl", "mopd.w_rl=1"]),
    "k8_refresh_dense": ("+ refresh (share + gap, K=8), dense top-K RKL",
                         ["mopd.minibatches=8", *SHARE_GAP, "mopd.reward_refresh=true", "mopd.kd_loss=topk_rkl"]),
    # the same objectives at twice the learning rate: on the CPU's seed 1 every variant at 1e-4 that gave ifshort
    # its share took it from mathchain (share + gap, K=4, dense + reward: 78 / 82 % recovered)
    "k4_share_gap_dense_rl_lr2": ("+ share + gap, K=4, dense top-K RKL, + reward w_rl=1, lr 2e-4",
                                  ["mopd.minibatches=4", *SHARE_GAP, "mopd.kd_loss=topk_rkl", "mopd.w_rl=1", LR2]),
    "k4_refresh_dense_lr2": ("+ refresh (share + gap, K=4), dense top-K RKL, lr 2e-4",
                             ["mopd.minibatches=4", *SHARE_GAP, "mopd.reward_refresh=true", "mopd.kd_loss=topk_rkl",
                              LR2]),
}
# the default run: Open-MOPD's rows, the preset's variant and its nearest rivals (the others cost ~2 min of a
# core per seed each; run them by name or with `--variants all`)
TABLE = ["naive", "share", "share_gap", "k4", "k4_share_gap", "k4_refresh", "dense", "k4_share_gap_dense",
         "k4_refresh_dense", "k4_share_gap_dense_rl"]
# Open-MOPD's numbers for the same rows (SmolLM3-3B, total of AIME/LCB/IFEval; MixSFT 25.67, experts 32.35)
PAPER = {"naive": 28.05, "share": 29.22, "share_gap": 29.94, "k4": 29.28, "k4_share_gap": 30.43,
         "k4_refresh": 31.24}

WINDOWS = ((0, 10), (10, 20), (20, 10**9))  # step windows of the sampled-reward curve (0-based, half-open)

log = logging.getLogger("mopd.ablation")


def _mean_std(vals: list[float]) -> dict:
    """`peer_stats.mean_std` in the dict form the JSON keeps (one seed: std 0.0, as the committed tables have)."""
    if not vals:  # e.g. recovery where no seed's expert beat SFT
        return {"mean": None, "std": None, "n": 0}
    m, sd = mean_std(vals)
    return {"mean": m, "std": 0.0 if sd is None else sd, "n": len(vals)}


def _per_domain(accs: list[dict[str, float]], domains: list[str]) -> dict:
    """Mean ± std over the seeds of each domain's accuracy and of the total (the mean over the domains)."""
    row = {d: _mean_std([a[d] for a in accs]) for d in domains}
    row["total"] = _mean_std([statistics.fmean(a[d] for d in domains) for a in accs])
    return row


def _rows(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def token_shares(stage_dir: Path, domains: list[str]) -> dict:
    """Mean over the stage's steps of each domain's token share and gradient share (metrics.jsonl)."""
    rows = _rows(stage_dir / "metrics.jsonl")
    out = {}
    for key in ("token_share", "grad_share"):
        # a step without a domain's prompts has no key for it: that domain's share there is 0
        logged = [r for r in rows if any(f"{key}/{d}" in r for d in domains)]
        vals = {d: [r.get(f"{key}/{d}", 0.0) for r in logged] for d in domains}
        if logged:
            out[key] = {d: statistics.fmean(v) for d, v in vals.items()}
    # the learning curve: the student's sampled (T=1) reward per domain over windows of steps — how fast each
    # domain is served, which the held-out accuracy at the end hides once every variant has converged
    n = len(rows)
    for lo, hi in WINDOWS:
        win = rows[lo:min(hi, n)] if lo < n else []
        vals = {d: [r[f"reward/{d}"] for r in win if f"reward/{d}" in r] for d in domains}
        if all(vals.values()):
            out.setdefault("reward_curve", {})[f"{lo + 1}-{min(hi, n)}"] = {d: statistics.fmean(v)
                                                                             for d, v in vals.items()}
    lengths = {d: [r[f"length/{d}"] for r in rows if f"length/{d}" in r] for d in domains}
    out["length"] = {d: statistics.fmean(v) for d, v in lengths.items() if v}
    for key in ("scale", "m"):  # gap-following: the per-domain advantage scale and running gap m_d
        gap = {d: [r[f"gap/{key}/{d}"] for r in rows if f"gap/{key}/{d}" in r] for d in domains}
        if all(gap.values()):
            out[f"gap_{key}"] = {d: statistics.fmean(v) for d, v in gap.items()}
    return out


def recovery(acc: dict[str, float], sft: dict[str, float], expert: dict[str, float]) -> dict:
    """(student − SFT) / (expert − SFT) per domain and for the total (`evaluation.recovery`, the eval table's);
    None where the expert is no better than SFT."""
    from mopd_core.evaluation import recovery as rec

    res = {"student": {d: {"greedy": a} for d, a in acc.items()}, "sft": {d: {"greedy": a} for d, a in sft.items()},
           **{f"expert-{d}": {d: {"greedy": a}} for d, a in expert.items()}}
    out = rec(res, "student", "sft", {d: f"expert-{d}" for d in sft}, domains=list(sft))
    return {k: (None if math.isnan(v) else v) for k, v in out.items()}


def variant_config(args, seed: int, extra: list[str]):
    from mopd_core.config import load_config

    # one folder per seed: the seeds' stages never meet, so seeds may run as parallel invocations (--collect)
    return load_config(args.config, [*NAIVE, *args.overrides, f"output_dir={Path(args.output_dir) / f'seed{seed}'}",
                                     f"seed={seed}", *extra])


def run_seed(args, seed: int, variants: list[str], result: dict, write) -> None:
    from mopd_core.errors import ConfigError
    from mopd_core.recipe import base_model, eval_stage, expert_stage, mopd_stage, setup_runtime, sft_stage

    cfg = variant_config(args, seed, [])
    setup_runtime(cfg)
    domains = cfg.domain_names()
    seed_res = result["per_seed"].setdefault(str(seed), {"seed": seed, "wall_s": {}, "accuracy": {},
                                                         "variants": {}})

    def accuracy(label: str, path) -> dict[str, float]:
        """The headline metric per domain (`result["metric"]`); the greedy one too, kept under "greedy"."""
        t0 = time.perf_counter()
        rep = eval_stage(cfg, {label: path})
        seed_res["wall_s"][f"eval-{label}"] = round(time.perf_counter() - t0, 1)
        seed_res.setdefault("greedy", {})[label] = {d: rep.accuracy[label][d]["greedy"] for d in domains}
        return {d: rep.accuracy[label][d][result["metric"]] for d in domains}

    # a stage is timed by the invocation that trains it; a reused one (trained by an earlier invocation, or by one
    # beside this one) keeps what that one measured, or none
    t0 = time.perf_counter()
    sft = sft_stage(cfg, base_model(cfg), progress=False)
    if not sft.reused:
        seed_res["wall_s"]["sft"] = round(time.perf_counter() - t0, 1)
    if "sft" not in seed_res["accuracy"]:
        seed_res["accuracy"]["sft"] = accuracy("sft", sft.model_dir)
    experts = {}
    for d in cfg.expert_domains():
        t0 = time.perf_counter()
        out = expert_stage(cfg, d, sft.model_dir, progress=False)
        if not out.reused:
            seed_res["wall_s"][f"expert-{d}"] = round(time.perf_counter() - t0, 1)
        experts[d] = out.model_dir
        if f"expert-{d}" not in seed_res["accuracy"]:
            seed_res["accuracy"][f"expert-{d}"] = accuracy(f"expert-{d}", out.model_dir)
    sft_acc = seed_res["accuracy"]["sft"]
    own = {d: seed_res["accuracy"][f"expert-{d}"][d] for d in domains}
    seed_res["expert_own"] = own
    write()
    for v in variants:
        label, extra = VARIANTS[v]
        if v in seed_res["variants"]:  # measured by an earlier invocation (--resume)
            continue
        try:
            vcfg = variant_config(args, seed, extra)
        except ConfigError as e:  # a key this checkout does not have yet
            result["skipped"][v] = str(e)
            log.warning("seed %s: variant %s skipped: %s", seed, v, e)
            continue
        t0 = time.perf_counter()
        out = mopd_stage(vcfg, sft.model_dir, experts, progress=False, stage_name=f"student-{v}")
        wall = time.perf_counter() - t0
        acc = accuracy(v, out.model_dir)
        seed_res["variants"][v] = {"accuracy": acc, "total": statistics.fmean(acc.values()),
                                   "recovery": recovery(acc, sft_acc, own),
                                   "wall_s": None if out.reused else round(wall, 1),
                                   "tokens": token_shares(out.stage_dir, domains), "overrides": extra}
        log.info("seed %s %s: %s (%.0f s)", seed, v, {d: round(100 * a, 1) for d, a in acc.items()}, wall)
        write()


def summarize(result: dict) -> dict:
    seeds = list(result["per_seed"].values())
    if not seeds or not seeds[0]["accuracy"]:
        return {}
    domains = result["domains"]
    summ: dict = {"models": {}, "variants": {}}
    for m in seeds[0]["accuracy"]:
        summ["models"][m] = _per_domain([s["accuracy"][m] for s in seeds if m in s["accuracy"]], domains)
    own = [s["expert_own"] for s in seeds if "expert_own" in s]
    if own:
        summ["models"]["experts (own domain)"] = _per_domain(own, domains)
    for v in VARIANTS:
        runs = [s["variants"][v] for s in seeds if v in s["variants"]]
        if not runs:
            continue
        row = _per_domain([r["accuracy"] for r in runs], domains)
        row["recovery"] = {k: _mean_std([r["recovery"][k] for r in runs if r["recovery"][k] is not None])
                           for k in [*domains, "total"]}
        for key in ("token_share", "grad_share"):
            if all(key in r["tokens"] for r in runs):
                row[key] = {d: _mean_std([r["tokens"][key][d] for r in runs]) for d in domains}
        curves = [r["tokens"].get("reward_curve", {}) for r in runs]
        wins = [w for w in curves[0] if all(w in c for c in curves)]
        row["reward_curve"] = {w: {d: _mean_std([c[w][d] for c in curves]) for d in domains} for w in wins}
        row["wall_s"] = _mean_std([r["wall_s"] for r in runs if r["wall_s"] is not None])  # None: reused
        summ["variants"][v] = row
    # greedy accuracy of every model and variant beside the headline metric (the same when that is greedy)
    labels = [*seeds[0]["accuracy"], *(v for v in VARIANTS if any(v in s["variants"] for s in seeds))]
    summ["greedy"] = {}
    for m in labels:
        vals = [s["greedy"][m] for s in seeds if m in s.get("greedy", {})]
        if vals:
            summ["greedy"][m] = _per_domain(vals, domains)
    summ["ordering"] = ordering(summ["variants"])
    return summ


def ordering(rows: dict) -> list[dict]:
    """Open-MOPD's claims, each checked on the mean total over the seeds (differences in accuracy points)."""
    tot = {v: r["total"]["mean"] for v, r in rows.items()}
    claims = [("naive < + token-share", "naive", "share"), ("+ token-share < + gap-following", "share", "share_gap"),
              ("K=4 share + gap > naive", "naive", "k4_share_gap"),
              ("K=4 share + gap > K=4", "k4", "k4_share_gap")]
    out = []
    for text, lo, hi in claims:
        if lo in tot and hi in tot:
            diff = 100 * (tot[hi] - tot[lo])
            out.append({"claim": text, "holds": diff > 0, "points": diff})
        else:
            out.append({"claim": text, "holds": None, "points": None})
    if "k4_refresh" in tot and len(tot) > 1:
        best_other = max((t, v) for v, t in tot.items() if v != "k4_refresh")
        diff = 100 * (tot["k4_refresh"] - best_other[0])
        out.append({"claim": "reward refresh best", "holds": diff > 0, "points": diff, "vs": best_other[1]})
    else:
        out.append({"claim": "reward refresh best", "holds": None, "points": None})
    return out


def _pm(x: dict, scale: float = 100.0, fmt: str = "{:.1f}") -> str:
    if not x or x.get("n", 0) == 0:
        return "–"
    return f"{fmt.format(scale * x['mean'])} ± {fmt.format(scale * x['std'])}"


SHORT_BAR, TOTAL_BAR = 0.85, 0.90  # the bar: every seed recovers ≥ 90 % of the total, the short domain ≥ 85 %


def _per_seed_recovery(result: dict, domains: list[str]) -> list[str]:
    """Recovery of the total and of the shortest-answer domain on each seed (a mean hides one seed far below), and
    whether the variant clears the bar on every seed."""
    seeds = sorted(result["per_seed"], key=int)
    lengths = {d: [] for d in domains}
    for sr in result["per_seed"].values():
        for vr in sr["variants"].values():
            for d, n in (vr.get("tokens", {}).get("length") or {}).items():
                lengths.setdefault(d, []).append(n)
    short = min(domains, key=lambda d: statistics.fmean(lengths[d]) if lengths.get(d) else math.inf)
    lines = [f"Recovery per seed, total / {short} (%); the bar: ≥ {TOTAL_BAR:.0%} of the total and ≥ {SHORT_BAR:.0%} "
             f"of {short} on every seed:", "",
             "| variant | " + " | ".join(f"seed {s}" for s in seeds) + " | every seed clears it |",
             "|---|" + "---:|" * len(seeds) + "---|"]
    for v in result["variants"]:
        recs = [result["per_seed"][s]["variants"].get(v, {}).get("recovery") for s in seeds]
        if not any(recs):
            continue
        cells = [f"{100 * r['total']:.0f} / {100 * r[short]:.0f}" if r else "–" for r in recs]
        ok = all(r and r["total"] >= TOTAL_BAR and r[short] >= SHORT_BAR for r in recs)
        label = VARIANTS[v][0] if v in VARIANTS else v
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {'yes' if ok else 'no'} |")
    return lines


def _accelerator(result: dict) -> str:
    acc = result.get("accelerator")
    return f"; training and sampling on {acc}" if acc else ""


def _secs(wall: dict) -> str:
    """A mean wall time in seconds; '–' where every run of it was reused (timed by none of these invocations)."""
    return "–" if wall["mean"] is None else f"{wall['mean']:.0f}"


def _wall(result: dict) -> str:
    """The wall-time sentence: one invocation's, or for merged parts their sum and the longest (how the parts
    overlapped is not recorded: side by side, the benchmark took about the longest; one after another, the sum)."""
    parts = result.get("parts_wall_s")
    if not parts:
        return f"Wall time of the whole benchmark {result['wall_s'] / 60:.1f} min"
    return (f"Wall time: {len(parts)} parts, {sum(parts) / 60:.1f} min of job time in all, the longest "
            f"{max(parts) / 60:.1f} min")


def markdown(result: dict) -> str:
    summ, mach, domains = result.get("summary") or {}, result["machine"], result["domains"]
    seeds = sorted(int(s) for s in result["per_seed"])
    state = "PARTIAL — " + result["partial"] if result.get("partial") else "complete"
    lines = [f"# Open-MOPD ablation on `{result['config']}` ({state})", "",
             f"Seeds {', '.join(map(str, seeds))}; {mach['cpu_model']} ({mach['cpu_count']} cores; torch "
             f"{mach['torch']} {mach['torch_cpu_capability']}, {result['torch_threads']} thread(s)); python "
             f"{mach['python']}{_accelerator(result)}. {_wall(result)} (load average "
             f"{result['load_average_1m']['start']} at the start, {result['load_average_1m']['end']} at the end, "
             "this benchmark's own processes included; above one per core the wall times are upper bounds)."
             + (f" Overrides: `{' '.join(result['overrides'])}`." if result["overrides"] else ""), "",
             "Command(s), in order (`--resume` runs only what the earlier ones lacked): "
             + "; ".join(f"`{i['command']}` (commit {(i.get('commit') or '?')[:8]})"
                         for i in result.get("invocations") or [{"command": result["command"]}]), ""]
    if not summ:
        return "\n".join(lines + ["No finished stage yet."])
    metric = result.get("metric", "greedy")
    what = "greedy" if metric == "greedy" else \
        f"{metric} (sampled at T=1, the mean over {metric[5:]} samples per prompt)"
    lines += [f"Held-out accuracy (%), {what}, mean ± std over the seeds; total = mean over the domains:", "",
              "| model | " + " | ".join(domains) + " | total |", "|---|" + "---:|" * (len(domains) + 1)]
    for m, r in summ["models"].items():
        lines.append(f"| {m} | " + " | ".join(_pm(r[d]) for d in [*domains, "total"]) + " |")
    lines += ["", "MOPD variants, all from the same SFT model and experts of each seed. Recovery = (student − SFT) / "
              "(expert − SFT), % (Open-MOPD: naive 35.6 %, + refresh 83.4 %); token share = the domain's share of "
              "the completion tokens, grad share = of Σ w_t·|A_t| (token-share weights and gap-following scales "
              "included) (%, mean over steps):", "",
              "| variant | " + " | ".join(domains) + " | total | " + " | ".join(f"recovery {d}" for d in domains)
              + " | recovery total | " + " | ".join(f"token share {d}" for d in domains) + " | "
              + " | ".join(f"grad share {d}" for d in domains) + " | MOPD wall s | paper total |",
              "|---|" + "---:|" * (4 * len(domains) + 4)]
    for v, (label, _) in VARIANTS.items():
        r = summ["variants"].get(v)
        if r is None and v not in result["skipped"] and v not in result["variants"]:
            continue  # not asked for
        if r is None:
            why = f"skipped: {result['skipped'][v]}" if v in result["skipped"] else "not run (yet)"
            lines.append(f"| {label} | {why} |" + " |" * (4 * len(domains) + 3))
            continue
        ts, ls = r.get("token_share", {}), r.get("grad_share", {})
        lines.append(f"| {label} | " + " | ".join(_pm(r[d]) for d in [*domains, "total"]) + " | "
                     + " | ".join(_pm(r["recovery"][k], fmt="{:.0f}") for k in [*domains, "total"]) + " | "
                     + " | ".join(_pm(ts.get(d, {})) for d in domains) + " | "
                     + " | ".join(_pm(ls.get(d, {})) for d in domains) + " | "
                     + f"{_secs(r['wall_s'])} | {PAPER.get(v, '–')} |")
    curve_rows = [(VARIANTS[v][0], r["reward_curve"]) for v, r in summ["variants"].items() if r.get("reward_curve")]
    if curve_rows:
        wins = list(curve_rows[0][1])
        lines += ["", *_per_seed_recovery(result, domains)]
        lines += ["", "How fast each domain is served: the student's sampled (T=1) reward during MOPD, mean over "
                  "windows of steps (%, mean ± std over the seeds):", "",
                  "| variant | " + " | ".join(f"{d} steps {w}" for w in wins for d in domains) + " |",
                  "|---|" + "---:|" * (len(wins) * len(domains))]
        for label, c in curve_rows:
            lines.append(f"| {label} | " + " | ".join(_pm(c[w][d]) if w in c else "–" for w in wins
                                                     for d in domains) + " |")
    if metric != "greedy" and summ.get("greedy"):
        lines += ["", "The same models, greedy (%; greedy decoding turns any probability above one half into the "
                  "answer, so it hides a domain served only part of the way):", "",
                  "| model | " + " | ".join(domains) + " | total |", "|---|" + "---:|" * (len(domains) + 1)]
        for m, r in summ["greedy"].items():
            lines.append(f"| {VARIANTS[m][0] if m in VARIANTS else m} | "
                         + " | ".join(_pm(r[d]) for d in [*domains, "total"]) + " |")
    lines += ["", "Open-MOPD's ordering, on the mean total over the seeds:", ""]
    naive = summ["variants"].get("naive")
    if naive and naive["recovery"]["total"].get("n"):
        spread = max(r["total"]["std"] for r in summ["variants"].values())
        rec = {k: 100 * naive["recovery"][k]["mean"] for k in [*domains, "total"] if naive["recovery"][k].get("n")}
        lines += [f"Naive MOPD recovers {rec['total']:.0f} % of the total headroom here (Open-MOPD: 35.6 %); per "
                  "domain " + ", ".join(f"{d} {rec[d]:.0f} %" for d in domains if d in rec)
                  + (" — little is left for the fixes to win" if rec["total"] > 80 else "")
                  + f". Differences between variants below the seeds' spread (std of a total up to "
                  f"{100 * spread:.1f} points, 200 held-out prompts per domain) are not evidence either way.", ""]
    for c in summ.get("ordering", []):
        if c["holds"] is None:
            lines.append(f"- {c['claim']}: not measurable (a variant was skipped or not run)")
        else:
            vs = f" (vs {c['vs']})" if "vs" in c else ""
            verdict = "holds" if c["holds"] else "does NOT hold"
            lines.append(f"- {c['claim']}: {verdict} ({c['points']:+.1f} points{vs})")
    walls = {}
    for s in result["per_seed"].values():
        for k, w in s["wall_s"].items():
            walls.setdefault(k, []).append(w)
    trained = ", ".join(f"{k} {statistics.fmean(v):.0f}" for k, v in walls.items() if not k.startswith("eval-"))
    lines += ["", "Stage wall seconds, mean over the seeds whose stage these invocations trained (a stage reused "
              "from an earlier run is not timed): " + (trained or "none, every stage was reused") + "."]
    if result["skipped"]:
        lines += ["", "Skipped variants (their config keys do not exist in this checkout):", ""]
        lines += [f"- `{v}`: {why}" for v, why in result["skipped"].items()]
    return "\n".join(lines)


def collect(paths: list[str], outp: Path, output_dir: Path | None = None) -> int:
    parts = [json.loads(Path(p).read_text()) for p in paths]
    metrics = {p.get("metric", "greedy") for p in parts}
    if len(metrics) > 1:
        raise SystemExit(f"--collect: the parts measured different metrics {sorted(metrics)}; rerun them alike")
    for p in parts:  # re-read each finished variant's metrics.jsonl (what this version of the script reports)
        for sk, sr in p["per_seed"].items():
            for v, vr in sr["variants"].items():
                found = sorted(Path(output_dir).glob(f"seed{sk}/*/student-{v}")) if output_dir else []
                if found:
                    vr["tokens"] = token_shares(found[0], p["domains"])
    res = dict(parts[0])
    res["per_seed"] = {}
    for p in parts:  # one seed's variants may be split over invocations that shared its SFT model and experts
        for k, v in p["per_seed"].items():
            have = res["per_seed"].setdefault(k, {**v, "variants": {}, "wall_s": {}, "accuracy": {}})
            have["variants"].update(v["variants"])
            for key in ("wall_s", "accuracy", "greedy"):  # only the invocation that trained a stage timed it
                have[key] = {**(v.get(key) or {}), **have.get(key, {})}
    res["variants"] = [v for v in VARIANTS if any(v in s["variants"] for s in res["per_seed"].values())]
    res["seeds"] = sorted(int(k) for k in res["per_seed"])
    res["skipped"] = {k: v for p in parts for k, v in p["skipped"].items()}
    res["invocations"] = [i for p in parts for i in (p.get("invocations") or [{"command": p["command"]}])]
    res["command"] = " & ".join(p["command"] for p in parts) + " (side by side), then --collect"
    res["wall_s"] = max(p["wall_s"] for p in parts)
    res["parts_wall_s"] = [p["wall_s"] for p in parts]
    res["load_average_1m"] = {"start": max(p["load_average_1m"]["start"] for p in parts),
                              "end": max(p["load_average_1m"]["end"] for p in parts)}
    partial = [f"seed {','.join(map(str, p['seeds']))}: {p['partial']}" for p in parts if p.get("partial")]
    res["partial"] = "; ".join(partial) or None
    res["summary"] = summarize(res)
    outp.write_text(json.dumps(res, indent=2) + "\n")
    outp.with_suffix(".md").write_text(markdown(res) + "\n")
    print(markdown(res))
    return 0


def _accelerator_name(cfg) -> str | None:
    """The GPU the stages ran on (None on a CPU), with the library versions that set its float paths."""
    import torch

    from mopd_core.runtime.device import resolve

    if resolve(cfg.runtime.device).kind != "cuda":
        return None
    import transformers

    return (f"{torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"transformers {transformers.__version__})")


def _git_head() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny_imbalanced")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--variants", default=",".join(TABLE), help="comma-separated names, or `all`")
    ap.add_argument("--output-dir", default=str(ROOT / "runs/bench-ablation"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/mopd_ablation.json"))
    ap.add_argument("--resume", action="store_true",
                    help="keep what --out already holds (same --output-dir) and run only the variants it lacks, e.g. "
                         "ones skipped before their config keys existed; the wall time adds up the invocations")
    ap.add_argument("--collect", nargs="+", metavar="JSON",
                    help="run nothing: merge the per-seed results of invocations that ran side by side (one --seeds "
                         "each) into --out; the table gives their summed and longest wall times")
    args = ap.parse_args(argv)
    if args.collect:
        return collect(args.collect, Path(args.out), Path(args.output_dir))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    variants = list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not seeds:
        ap.error(f"unknown variants {bad}; known: {', '.join(VARIANTS)}, or all" if bad else "--seeds needs a seed")
    import torch

    from mopd_core.config import load_config

    cfg = load_config(args.config, args.overrides)  # a bad config or override fails here, before any compute
    outp = Path(args.out)
    outp.parent.mkdir(parents=True, exist_ok=True)
    t0, load0 = time.perf_counter(), os.getloadavg()
    result = {"config": args.config, "overrides": args.overrides, "seeds": seeds, "variants": variants,
              "command": "python benchmarks/mopd_ablation.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "domains": cfg.domain_names(), "per_seed": {}, "skipped": {}, "machine": machine_info(),
              # sampled accuracy when the preset asks for it (Open-MOPD reports avg@k): greedy decoding turns any
              # probability above one half into a right answer, which hides a domain served only half way
              "metric": f"mean@{cfg.eval.mean_at_k}" if cfg.eval.mean_at_k else "greedy",
              "torch_threads": cfg.runtime.num_threads or torch.get_num_threads(), "partial": "started",
              "accelerator": _accelerator_name(cfg)}
    result["invocations"] = [{"command": result["command"], "commit": _git_head()}]
    prior_wall = 0.0
    if args.resume and outp.exists():
        prev = json.loads(outp.read_text())
        if prev.get("config") != args.config or prev.get("overrides") != args.overrides:
            ap.error(f"--resume: {outp} was written for --config {prev.get('config')} --set {prev.get('overrides')}")
        if prev.get("metric", "greedy") != result["metric"]:
            ap.error(f"--resume: {outp} holds {prev.get('metric', 'greedy')} accuracies, this config gives "
                     f"{result['metric']}; start a fresh --out")
        result["per_seed"], prior_wall = prev["per_seed"], prev.get("wall_s", 0.0)
        result["invocations"] = (prev.get("invocations") or [{"command": prev["command"], "commit": None}]) + \
            result["invocations"]
        load0 = (prev.get("load_average_1m", {}).get("start", load0[0]),)

    def write(final: bool = False) -> None:
        result["wall_s"] = round(prior_wall + time.perf_counter() - t0, 1)
        result["load_average_1m"] = {"start": round(load0[0], 2), "end": round(os.getloadavg()[0], 2)}
        done = sum(len(s["variants"]) for s in result["per_seed"].values())
        if not final:
            result["partial"] = (f"{done} of {len(seeds) * len(variants)} variant runs finished "
                                 f"({len(result['skipped'])} skipped); the run was still going")
        result["summary"] = summarize(result)
        outp.write_text(json.dumps(result, indent=2) + "\n")
        outp.with_suffix(".md").write_text(markdown(result) + "\n")

    for s in seeds:
        run_seed(args, s, variants, result, write)
    result["partial"] = None
    write(final=True)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
