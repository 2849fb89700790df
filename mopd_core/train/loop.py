"""The one on-policy loop. Expert RL = the loop without teachers (w_kd = 0); MOPD = the loop with teachers
(w_kd > 0, optionally w_rl > 0 for reward + distillation).

Each step: sample prompts (domain mix) → rollout G samples each → verifier rewards and teacher scores →
advantages A = w_rl·A^R + w_kd·A^D → PPO-clip update(s) → metrics; eval and checkpoint every N. Each phase is
one call on a role object chosen once at stage start (`train.roles`: source, weight sync, scorer, objective,
updater), so the step reads the same in every mode.

All randomness of step s is derived from (seed, stage name, s) — prompt choice and the sampling generator —
so a resumed run replays exactly the steps an uninterrupted one would have taken.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch

from ..config import EvalConfig, MOPDConfig, PolicyLoopConfig, RecipeConfig
from ..errors import ConfigError, TrainingDivergedError
from ..evaluation import EvalResult, eval_sources_of, evaluate, evaluate_model
from ..models import load_model, load_tokenizer, save_pretrained, tokenizer_fingerprint
from ..models.chat import carry_chat_template
from ..stages.folder import read_metrics
from ..rollout import RolloutBatch
from ..rollout.engines import build_rollout
from ..runtime import device as devlib
from .checkpoint import (StageStateError, checkpoint_dirs, checkpoint_step, claim_stage, finished, load_loop_state,
                         read_stage, write_stage)
from . import kd
from . import timeline
from .progress import StageProgress
from .roles import RecoveryRefs, Roles, StageContext, build_roles, param_counts
from .roles.source import sample_prompts
from .roles.updater import SHARDED_OPTIMIZER, PolicyTrainer
from .update import enable_gradient_checkpointing, lr_lambda, policy_update, recompute_behaviour_logp

log = logging.getLogger("mopd")


class NonFiniteLossError(TrainingDivergedError):
    """Training produced a NaN/inf loss or gradient; the last good checkpoint is kept untouched."""


@dataclass
class LoopResult:
    final_dir: Path
    eval: dict[str, dict[str, float]]
    history: list[dict] = field(default_factory=list)
    resumed_from: int = 0
    stage_dir: Path | None = None
    recovery: dict[str, float] = field(default_factory=dict)  # MOPD: recovery per domain at the final eval
    reused: bool = False  # found finished and returned as it is (nothing trained)


def _section(loop_cfg: PolicyLoopConfig) -> str:
    return "mopd" if isinstance(loop_cfg, MOPDConfig) else "expert"


def check_loop_config(stage: str, loop_cfg: PolicyLoopConfig, recipe: RecipeConfig, names: list[str],
                      has_teachers: bool) -> None:
    """What makes a policy stage impossible whatever the model: a pre-flight check (no compute)."""
    sec = _section(loop_cfg)
    if loop_cfg.w_kd > 0 and not has_teachers:
        raise ConfigError(f"{stage}: {sec}.w_kd={loop_cfg.w_kd} needs teachers; give teachers or set "
                          f"{sec}.w_kd=0 for pure RL")
    if loop_cfg.w_kd == 0 and loop_cfg.w_rl == 0:
        raise ConfigError(f"{stage}: {sec}.w_rl and {sec}.w_kd are both 0 — nothing to learn from; set one > 0")
    recipe.mix_weights(loop_cfg, sec, names)
    rt = recipe.runtime
    if loop_cfg.w_kd > 0 and has_teachers:
        check_objective(stage, loop_cfg, recipe)
    if loop_cfg.lora is not None and rt.strategy != "single":
        raise ConfigError(f"{stage}: {sec}.lora trains adapters in this process; runtime.strategy={rt.strategy} "
                          f"does not carry them to the Ray workers — set runtime.strategy=single or remove "
                          f"{sec}.lora")
    if rt.placement == "async":
        if recipe.rollout.backend != "served":
            raise ConfigError(f"{stage}: runtime.placement=async needs rollout.backend=served (the student "
                              f"generates on its own servers while the trainer updates), not "
                              f"'{recipe.rollout.backend}'; set rollout.backend=served")
        if rt.strategy != "single":
            raise ConfigError(f"{stage}: runtime.placement=async runs with runtime.strategy=single for now "
                              f"(the decoupled loss's proximal log-probs are not sent to Ray workers yet); set "
                              f"runtime.strategy=single or runtime.placement=disaggregated")
        if recipe.rollout.truncates:
            raise ConfigError(f"{stage}: runtime.placement=async with truncated sampling (rollout.top_p < 1, top_k "
                              "or min_p) — the untruncated behaviour log-probs need the generating weights, which "
                              "the trainer has already updated; sample without truncation or use "
                              "runtime.placement=disaggregated")
    if rt.dtype == "float16":
        raise ConfigError(f"{stage}: runtime.dtype=float16 cannot train here (float16 gradients need loss scaling, "
                          "which the RL/MOPD update does not do); use runtime.dtype=bfloat16")
    if rt.strategy != "single":
        rows = loop_cfg.prompts_per_step * loop_cfg.group_size
        if rows % rt.num_workers:
            raise ConfigError(f"{stage}: {sec}.prompts_per_step × group_size = {rows} rows do not split evenly over "
                              f"runtime.num_workers={rt.num_workers} (every rank must run as many backward passes); "
                              f"make it a multiple of {rt.num_workers}")


def check_objective(stage: str, m: PolicyLoopConfig, recipe: RecipeConfig) -> None:
    """The distillation objective's combinations the loop cannot run (docs/objectives.md, "Combinations that are
    refused"): one line each, before any compute."""
    sec, t, rt = _section(m), recipe.teachers, recipe.runtime
    new = m.kd_loss in ("topk_rkl", "full_jsd") or m.gap_following or m.reward_refresh or t.conflict != "none"
    if new and rt.strategy != "single":
        raise ConfigError(f"{stage}: {sec}.kd_loss={m.kd_loss} / gap_following / reward_refresh / teachers.conflict "
                          f"run in one process for now (the Ray workers' update does not take them); set "
                          f"runtime.strategy=single or {sec}.kd_loss=sampled_rkl")
    if new and rt.placement == "async":
        raise ConfigError(f"{stage}: {sec}.kd_loss={m.kd_loss} / gap_following / reward_refresh / teachers.conflict "
                          "need the student's candidate pass beside the teachers', which the async pipeline's scorer "
                          f"thread does not run; set runtime.placement=colocated or disaggregated, or {sec}.kd_loss="
                          "sampled_rkl")
    if m.gap_following and not 0 < m.gap_clip[0] <= 1 <= m.gap_clip[1]:
        raise ConfigError(f"{stage}: {sec}.gap_clip={list(m.gap_clip)} must be [low, high] with 0 < low ≤ 1 ≤ high "
                          "(e.g. [0.05, 20])")
    if m.reward_refresh and m.minibatches < 2:
        raise ConfigError(f"{stage}: {sec}.reward_refresh recomputes the advantage between inner minibatch updates, "
                          f"but {sec}.minibatches={m.minibatches}; set {sec}.minibatches ≥ 2 or reward_refresh=false")
    if (m.reward_refresh or m.gap_following or t.conflict != "none") and m.kd_loss not in kd.ADVANTAGE_KD:
        raise ConfigError(f"{stage}: {sec}.reward_refresh / gap_following / teachers.conflict act on the distillation "
                          f"advantage, but {sec}.kd_loss={m.kd_loss} is a direct loss; use kd_loss sampled_rkl or "
                          "topk_rkl")
    if t.conflict != "none" and t.routing != "mixture":
        raise ConfigError(f"{stage}: teachers.conflict={t.conflict} compares the teachers of a mixture, but "
                          f"teachers.routing={t.routing} scores each token by one teacher; set teachers.routing="
                          "mixture or teachers.conflict=none")
    if m.kd_loss == "topk_rkl":
        if t.backend == "http" and m.kd_candidates != "teacher":
            raise ConfigError(f"{stage}: {sec}.kd_candidates={m.kd_candidates} needs the teachers' log-probs of the "
                              "student's top-K tokens, which a vLLM server's prompt_logprobs cannot return (only the "
                              f"sampled token and its own top-k); use teachers.backend=local or {sec}.kd_candidates="
                              "teacher")
        if m.kd_candidates != "student" and t.routing != "domain":
            raise ConfigError(f"{stage}: {sec}.kd_candidates={m.kd_candidates} takes each teacher's own top-K, which "
                              f"a mixture does not have; set teachers.routing=domain or {sec}.kd_candidates=student")
        if t.backend == "http" and m.kd_top_k > t.max_logprobs:
            raise ConfigError(f"{stage}: {sec}.kd_top_k={m.kd_top_k} exceeds teachers.max_logprobs="
                              f"{t.max_logprobs} (the servers' --max-logprobs): lower {sec}.kd_top_k or raise "
                              "teachers.max_logprobs")
    if m.kd_loss == "full_jsd":
        if t.backend != "local" or t.routing != "domain":
            raise ConfigError(f"{stage}: {sec}.kd_loss=full_jsd projects each local teacher's hidden states through "
                              f"its lm_head (a vLLM server returns top-k log-probs only, a mixture has no single "
                              f"head), but teachers.backend={t.backend}, routing={t.routing}; use teachers.backend="
                              f"local with routing=domain, or {sec}.kd_loss=jsd")
        if recipe.train.logprob_impl != "chunked":
            raise ConfigError(f"{stage}: {sec}.kd_loss=full_jsd runs on the chunked path; set "
                              "train.logprob_impl=chunked")
        try:
            import trl.kernels.chunked_divergence  # noqa: F401 — TRL's kernel, in TRL releases of 2026
        except ImportError:
            import trl

            raise ConfigError(f"{stage}: {sec}.kd_loss=full_jsd uses trl.kernels.chunked_divergence, which "
                              f"trl {trl.__version__} lacks: pip install -U 'trl>=1.16'") from None


def _group_stats(values: torch.Tensor, groups: list[str], prefix: str) -> dict[str, float]:
    acc = defaultdict(list)
    for v, g in zip(values.tolist(), groups):
        acc[g].append(v)
    return {f"{prefix}/{g}": sum(v) / len(v) for g, v in acc.items()}


def run_policy_loop(*, stage: str, loop_cfg: PolicyLoopConfig, recipe: RecipeConfig, init_path: str | Path,
                    domains: Mapping[str, object], eval_domains: Mapping[str, object], stage_dir: str | Path,
                    fingerprint: str, teachers=None, on_step: Callable[[int, dict], None] | None = None,
                    progress: bool = True, trainer: PolicyTrainer | None = None,
                    recovery: RecoveryRefs | None = None) -> LoopResult:
    """Run (or resume, or reuse) one on-policy stage. `domains` are the prompt sources of training,
    `eval_domains` those reported at eval time; `teachers` a TeacherRouter (None for expert RL); `trainer` runs
    the update elsewhere (many devices; this process keeps a copy of the weights for rollout and eval);
    `recovery`: the SFT and expert accuracies recovery is measured against (MOPD; None: not logged). The loop
    closes the trainer when it ends."""
    stage_dir = Path(stage_dir)
    info = read_stage(stage_dir)
    if finished(info, fingerprint, loop_cfg.steps, stage_dir):
        return LoopResult(stage_dir / "final", info.get("eval", {}), [], loop_cfg.steps, stage_dir,
                          final_recovery(info), reused=True)
    check_loop_config(stage, loop_cfg, recipe, list(domains), teachers is not None)
    try:
        ctx = _open_stage(stage, loop_cfg, recipe, init_path, domains, eval_domains, stage_dir, fingerprint,
                          teachers)
        if isinstance(ctx, LoopResult):  # brought back from aside
            return ctx
        ctx.recovery_refs = recovery
        for path in (ctx.metrics_path, ctx.timeline_path, stage_dir / "phases.jsonl"):
            _truncate_metrics(path, ctx.start)  # a resumed run's rows after its checkpoint go
        roles = build_roles(ctx, trainer)
        try:
            history = _run_steps(ctx, roles, on_step, progress)
        finally:
            roles.close()
        return _finish(ctx, roles, history)
    finally:
        if trainer is not None:
            trainer.close()


def _open_stage(stage, loop_cfg, recipe, init_path, domains, eval_domains, stage_dir: Path, fingerprint,
                teachers) -> StageContext | LoopResult:
    """Claim the stage dir and read where it resumes (a resume also extends a finished stage when only `steps`
    grew); a stage found finished is returned as its result."""
    dinfo = devlib.resolve(recipe.runtime.device)
    tokenizer = load_tokenizer(init_path)
    carry_chat_template(tokenizer, recipe.data.chat)  # the checkpoints carry an override template
    if teachers is not None:  # pre-flight before any compute: tokenizers and routing
        teachers.check(tokenizer_fingerprint(tokenizer), list(domains))
    mix = recipe.mix_weights(loop_cfg, _section(loop_cfg), list(domains))
    info = claim_stage(stage_dir, fingerprint, {"stage": stage, "init": str(init_path)})
    if finished(info, fingerprint, loop_cfg.steps, stage_dir):
        return LoopResult(stage_dir / "final", info.get("eval", {}), [], loop_cfg.steps, stage_dir,
                          final_recovery(info), reused=True)
    ckpts = checkpoint_dirs(stage_dir)
    if ckpts and checkpoint_step(ckpts[-1]) > loop_cfg.steps:
        raise StageStateError(f"{stage_dir} already trained {checkpoint_step(ckpts[-1])} steps, "
                              f"more than the {loop_cfg.steps} asked for; ask for at least that many steps, restart "
                              f"the stage (move {stage_dir} away; `mopd recipe --restart`; in a Prefect flow "
                              "`refresh`) or choose another name")
    st = load_loop_state(ckpts[-1]) if ckpts else {}  # optimizer + scheduler + step: read once
    return StageContext(stage, loop_cfg, recipe, stage_dir, init_path, domains, eval_domains, mix, tokenizer, dinfo,
                        teachers, st["step"] if ckpts else 0, ckpts, st)


def _run_steps(ctx: StageContext, r: Roles, on_step, progress: bool) -> list[dict]:
    """sample → score → advantage → update → log/checkpoint, once per step."""
    history: list[dict] = []
    bar = StageProgress(ctx.stage, ctx.cfg.steps, ctx.start, enabled=progress)
    try:
        for step in r.recovery.steps(ctx.start, ctx.cfg.steps, ctx.mix):  # ends early once all domains recovered
            t_step = time.perf_counter()
            r.phases.begin_step(step + 1)
            p, m = r.source.take(step)  # sampled and scored (rewards, teachers)
            mask = p.batch.completion_mask.float()
            adv = r.objective.advantage(p.scored, p.batch, mask, m)
            t0, c_train = time.perf_counter(), ctx.clock.now()
            with r.phases.train():
                upd = r.updater.update(p.batch, adv, p.rng, p.scored.get("proximal"))
            t_train = time.perf_counter() - t0
            _check_finite(ctx, upd, step + 1)
            m.update(r.source.after_update(step + 1, r.model))
            timeline.append(ctx.timeline_path, {"step": step + 1, "version": p.version, **p.times,
                                                "train": [c_train, ctx.clock.now()]})
            _step_metrics(ctx, r, p, adv.adv, mask, upd, m, t_step, t_train)
            _log_step(ctx, r, step + 1, m, history, on_step, bar)
            if (step + 1) % ctx.cfg.save_every == 0 and step + 1 < ctx.cfg.steps:
                r.updater.checkpoint(step + 1, ctx.tokenizer)
    finally:
        bar.close()
    return history


def _check_finite(ctx: StageContext, upd: dict[str, float], step: int) -> None:
    """Every step (not only at logging steps): a non-finite loss or gradient skipped the optimizer step; weights
    that became non-finite anyway stop the stage before it can checkpoint or finish them."""
    finite_weights = upd.pop("weights_finite", 1.0) > 0
    if not (finite_weights and all(math.isfinite(upd[k]) for k in ("loss", "grad_norm"))):
        last = checkpoint_dirs(ctx.stage_dir)
        raise NonFiniteLossError(
            f"{ctx.stage}: non-finite loss/gradient/weights at step {step} (loss={upd['loss']}, grad_norm="
            f"{upd['grad_norm']}, weights finite: {finite_weights}); stopped without saving — last good checkpoint: "
            f"{last[-1] if last else 'none'} (lower the lr or check the data)")


def _step_metrics(ctx: StageContext, r: Roles, p, adv, mask, upd: dict, m: dict, t_step: float,
                  t_train: float) -> None:
    """The step's row (into `m`): rewards, lengths, advantages, teachers, the update's, throughput, memory."""
    batch, sc = p.batch, p.scored
    rewards, routed, t_score = sc["rewards"], sc["routed"], sc["t_score"]
    n_tok = int(mask.sum())
    doms = [e.teacher_id for e in batch.examples]
    m.update(_group_stats(rewards, doms, "reward"))
    m["reward/mean"] = float(rewards.mean())
    m.update(_group_stats(mask.sum(1), doms, "length"))
    adv_tok = (adv.sum(-1) if adv.dim() == 3 else adv)[mask.bool()]
    m["adv/mean"] = float(adv_tok.mean()) if n_tok else 0.0
    m["adv/std"] = float(adv_tok.std()) if n_tok > 1 else 0.0
    if routed is not None:
        m.update(_teacher_metrics(routed, batch, mask))
        m.update(sc["teacher_stats"])
        m["perf/score_s"] = t_score
        m["perf/score_tokens_per_s"] = n_tok * (len(routed.per_teacher) if ctx.teachers.routing == "mixture"
                                                else 1) / max(t_score, 1e-9)
    m.update(upd)
    m.update(sc.get("trunc", {}))
    dt = time.perf_counter() - t_step
    seq_tok = n_tok + int(batch.prompt_mask.sum())
    if "async/trainer_wait_s" in m:  # the share of the step the trainer waited for samples
        m["async/trainer_idle_frac"] = min(1.0, m["async/trainer_wait_s"] / max(dt, 1e-9))
    m.update({"perf/rollout_s": p.t_roll, "perf/train_s": t_train, "perf/step_s": dt,
              "perf/tokens_per_s": n_tok / dt, "perf/rollout_tokens_per_s": n_tok / max(p.t_roll, 1e-9),
              "perf/train_tokens_per_s": seq_tok * ctx.cfg.minibatches / max(t_train, 1e-9),
              "lr": r.updater.lr(upd)})
    m.update(devlib.memory_stats(ctx.kind))
    m.update(r.phases.end_step())
    if p.step == ctx.start:  # once per run: what each phase holds (MLflow has the series)
        held = ", ".join(f"{ph} {m[f'mem/{ph}/resident_mb']:.3g}" for ph in ("rollout", "score", "train")
                         if f"mem/{ph}/resident_mb" in m)
        measured = ", ".join(f"{k.split('/')[1]} {v:.0f}" for k, v in m.items()
                             if k.startswith("mem/") and k.count("/") == 2 and not k.endswith("resident_mb"))
        log.info("%s: %s memory per phase (MiB held on the device: %s; measured %s)", ctx.stage,
                 ctx.recipe.runtime.placement, held, measured)


def _evaluate(ctx: StageContext, r: Roles) -> dict:
    """Scores on the eval domains, sampled from the current weights (a LoRA merged copy brought up to date)."""
    new = ctx.recipe.eval.max_new_tokens or ctx.recipe.rollout.max_new_tokens
    with ctx.amp():
        return evaluate_model(r.sync.sampler(r.model), ctx.tokenizer, ctx.eval_domains, ctx.recipe.eval, ctx.device,
                              new, ctx.recipe.seed, ctx.cfg.eval_size, chat=ctx.recipe.data.chat)


def _log_step(ctx: StageContext, r: Roles, done: int, m: dict, history: list, on_step, bar) -> None:
    """Eval every `eval_every` steps (not the last: the stage's final eval follows), then the row out."""
    if ctx.cfg.eval_every and done % ctx.cfg.eval_every == 0 and done < ctx.cfg.steps:
        scores = _evaluate(ctx, r)
        for d, res in scores.items():
            for k, v in res.items():
                m[f"eval/{d}/{k}"] = v
        m.update(r.recovery.observe(done, scores))  # recovery/<domain>; a recovered domain stops being sampled
    row = {"step": done, **m}
    history.append(row)
    with open(ctx.metrics_path, "a") as f:
        f.write(json.dumps(row) + "\n")
    if on_step:
        on_step(done, m)
    bar.update(done, m)


def _finish(ctx: StageContext, r: Roles, history: list[dict]) -> LoopResult:
    """The final eval, final/ and the last checkpoint (repeating final/ plus the optimizer state: raising `steps`
    later continues from it), and the stage record."""
    log.info("%s: %s", ctx.stage, r.phases.summary())
    last_eval = _evaluate(ctx, r)
    final_dir = save_pretrained(r.model, ctx.tokenizer, ctx.stage_dir / "final")
    r.updater.checkpoint(ctx.cfg.steps, ctx.tokenizer)
    info = read_stage(ctx.stage_dir) or {}
    info.update(r.recovery.record(last_eval, history[-1]["step"] if history else ctx.start))
    info.update({"status": "done", "final_dir": str(final_dir), "eval": last_eval, "steps": ctx.cfg.steps,
                 "teacher_stats": ctx.teachers.stats() if ctx.teachers is not None else {},
                 "placement": {"mode": ctx.recipe.runtime.placement,
                               "max_teachers_resident": r.phases.max_teachers_resident}, **r.sync.record()})
    lora = ctx.cfg.lora
    if lora is not None:
        n_params, n_trainable = param_counts(r.model)
        info["lora"] = {**lora.model_dump(mode="json"), "trainable_params": n_trainable, "total_params": n_params}
    write_stage(ctx.stage_dir, info)
    return LoopResult(final_dir, last_eval, history, ctx.start, ctx.stage_dir, final_recovery(info))


def final_recovery(info: dict | None) -> dict[str, float]:
    """Recovery per domain at a finished stage's final eval (its record), finite values only."""
    rec = ((info or {}).get("recovery") or {}).get("final") or {}
    return {d: v for d, v in rec.items() if math.isfinite(v)}


def _teacher_metrics(routed, batch: RolloutBatch, mask: torch.Tensor) -> dict[str, float]:
    """teacher_token_frac/<t> = tokens t scored ÷ all scored tokens; reverse_kl/<t> = mean(ℓ^old − ℓ^t)."""
    out = {}
    ntok = {n: float(mask[rows].sum()) for n, (rows, _) in routed.per_teacher.items()}
    total = sum(ntok.values()) or 1.0
    for name, (rows, lp) in routed.per_teacher.items():
        out[f"teacher_token_frac/{name}"] = ntok[name] / total
        if ntok[name]:
            mk = mask[rows]
            out[f"reverse_kl/{name}"] = float(((batch.behaviour_logp[rows] - lp) * mk).sum() / ntok[name])
    return out



def _truncate_metrics(path: Path, upto_step: int) -> None:
    """On resume, drop rows after the checkpoint so the JSONL holds each step exactly once (a damaged line: one
    error naming it, before anything is rewritten; the rewrite is atomic)."""
    if not path.exists():
        return
    keep = [r for r in read_metrics(path) if r.get("step", 0) <= upto_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    tmp.replace(path)


def evaluate_checkpoint(path, recipe: RecipeConfig, domains, eval_cfg: EvalConfig | None = None, *,
                        benchmarks=None) -> EvalResult:
    """Scores and per-row results of one checkpoint (`evaluation.evaluate`): each domain's `eval_sources`
    benchmarks (`benchmarks`: already loaded by `evaluation.load_benchmarks`, else loaded here), else its
    held-out split. Generation goes through `rollout.backend` (vLLM on GPU, sized for the longest benchmark
    budget), rendered and stopped as `data.chat` says."""
    dinfo = devlib.resolve(recipe.runtime.device)
    model = load_model(path, dinfo.torch_device, recipe.runtime.dtype).eval()
    tok = load_tokenizer(path)
    cfg = eval_cfg or recipe.eval
    new = cfg.max_new_tokens or recipe.rollout.max_new_tokens
    sources = eval_sources_of(recipe)
    engine = None
    if recipe.rollout.backend != "hf":
        budget = max([new] + [s.max_new_tokens or new for specs in sources.values() for s in specs])
        engine = build_rollout(recipe, model, tok, dinfo.torch_device,
                               max_model_len=recipe.data.max_prompt_tokens + budget)
    try:
        return evaluate(model, tok, domains, cfg, dinfo.torch_device, new, recipe.seed, chat=recipe.data.chat,
                        sources=sources, engine=engine, benchmarks=benchmarks)
    finally:
        if engine is not None:
            engine.close()


__all__ = ["LoopResult", "NonFiniteLossError", "PolicyTrainer", "SHARDED_OPTIMIZER",
           "check_loop_config", "check_objective", "enable_gradient_checkpointing", "evaluate_checkpoint", "kd",
           "lr_lambda", "policy_update", "recompute_behaviour_logp", "run_policy_loop", "sample_prompts"]
