"""The one on-policy loop. Expert RL = the loop without teachers (w_kd = 0); MOPD = the loop with teachers
(w_kd > 0, optionally w_rl > 0 for reward + distillation).

Each step: sample prompts (domain mix) → rollout G samples each → verifier rewards and teacher scores →
advantages A = w_rl·A^R + w_kd·A^D (DESIGN §3) → PPO-clip update(s) → metrics; eval and checkpoint every N.

All randomness of step s is derived from (seed, stage name, s) — prompt choice and the sampling generator —
so a resumed run replays exactly the steps an uninterrupted one would have taken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import torch

from .. import algorithms as alg
from ..config import EvalConfig, PolicyLoopConfig, RecipeConfig
from ..errors import ConfigError, TrainingDivergedError
from ..domains.base import domain_rewards
from ..evaluation import EvalResult, eval_sources_of, evaluate, evaluate_model, truncated_flags
from ..algorithms.logprobs import LogitTransform
from ..models import (load_model, load_tokenizer, logit_transform, model_shape, save_pretrained, tokenizer_fingerprint,
                      unwrap)
from ..models.chat import carry_chat_template
from ..models.lora import ADAPTER_DIR, add_lora, load_adapter, merged_copy, refresh_merged, trainable_parameters
from ..rollout import RolloutBatch, score_completions
from ..rollout.engines import build_rollout
from ..runtime import device as devlib
from ..runtime.phases import PhaseScheduler, check_colocated_fit, fsdp_gathered_bytes
from .checkpoint import (StageStateError, checkpoint_dirs, checkpoint_step, claim_stage, finished, load_loop_state,
                         read_stage, save_checkpoint, write_stage)
from .microbatch import padded_positions, row_lengths, token_budget_micro_batches, trim
from .pipeline import Produced
from . import kd
from . import timeline
from .progress import StageProgress


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


class PolicyTrainer(Protocol):
    """The loop's update run elsewhere — `runtime.strategy` ddp/fsdp2 on Ray workers
    (`distributed.trainer.RayPolicyTrainer`, built by the stage functions one layer up). The loop keeps sampling,
    scoring, advantages, metrics and checkpoints; the trainer holds the trained weights and the optimizer."""

    def start(self, model_dir: str | Path, resume: str | Path | None = None,
              scheduler_state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Load `model_dir` (+ a checkpoint's sharded optimizer state) on the workers."""

    def update(self, batch: RolloutBatch, advantages: torch.Tensor, token_weights: torch.Tensor | None, *,
               temperature: float, seed: int, routed: Any = None) -> dict[str, float]:
        """`policy_update` of the whole batch; its metrics (loss, grad_norm, entropy, clip_frac, approx_kl, lr…,
        `jsd`). `routed`: the teachers' `RoutedScore` when the loss needs it (`kd_loss: jsd`), else None."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights, whole, on CPU (the driver's rollout engine samples from them)."""

    def save(self, path: str | Path) -> dict[str, Any]:
        """Write the optimizer state (sharded) under `path`; returns `{"scheduler": state, …}`."""

    def close(self) -> None:
        """Stop the workers; idempotent."""


# What a checkpoint of a stage trained by a `PolicyTrainer` holds beside model/ (torch.distributed.checkpoint).
SHARDED_OPTIMIZER = "optimizer"


def _section(loop_cfg: PolicyLoopConfig) -> str:
    from ..config import MOPDConfig

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
    """The distillation objective's combinations the loop cannot run (docs/architecture.md, "MOPD objectives"):
    one line each, before any compute."""
    sec, t, rt = _section(m), recipe.teachers, recipe.runtime
    new = m.kd_loss in ("topk_rkl", "full_jsd") or m.gap_following or m.reward_refresh or t.conflict != "none"
    if new and rt.strategy != "single":
        raise ConfigError(f"{stage}: {sec}.kd_loss={m.kd_loss} / gap_following / reward_refresh / teachers.conflict "
                          f"run in one process for now (the Ray workers' update does not take them); set "
                          f"runtime.strategy=single")
    if new and rt.placement == "async":
        raise ConfigError(f"{stage}: {sec}.kd_loss={m.kd_loss} / gap_following / reward_refresh / teachers.conflict "
                          "need the student's candidate pass beside the teachers', which the async pipeline's scorer "
                          "thread does not run; set runtime.placement=colocated or disaggregated")
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


def sample_prompts(domains: Mapping[str, object], weights: list[float], n: int, rng: random.Random):
    names = list(domains)
    picks = rng.choices(range(len(names)), weights=weights, k=n)
    out = []
    for i, name in enumerate(names):
        c = picks.count(i)
        if c:
            out.extend(domains[name].train_examples(c, rng))
    return out


def lr_lambda(warmup: int):
    return lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0


def _group_stats(values: torch.Tensor, groups: list[str], prefix: str) -> dict[str, float]:
    acc = defaultdict(list)
    for v, g in zip(values.tolist(), groups):
        acc[g].append(v)
    return {f"{prefix}/{g}": sum(v) / len(v) for g, v in acc.items()}


def run_policy_loop(*, stage: str, loop_cfg: PolicyLoopConfig, recipe: RecipeConfig, init_path: str | Path,
                    domains: Mapping[str, object], eval_domains: Mapping[str, object], stage_dir: str | Path,
                    fingerprint: str, teachers=None, on_step: Callable[[int, dict], None] | None = None,
                    progress: bool = True, trainer: PolicyTrainer | None = None) -> LoopResult:
    """Run (or resume, or reuse) one on-policy stage. `domains` are the prompt sources of training,
    `eval_domains` those reported at eval time; `teachers` a TeacherRouter (None for expert RL); `trainer` runs
    the update elsewhere (many devices; this process keeps a copy of the weights for rollout and eval). The loop
    closes the trainer when it ends."""
    stage_dir = Path(stage_dir)
    info = read_stage(stage_dir)
    if finished(info, fingerprint, loop_cfg.steps, stage_dir):
        return LoopResult(stage_dir / "final", info.get("eval", {}), [], loop_cfg.steps, stage_dir)
    check_loop_config(stage, loop_cfg, recipe, list(domains), teachers is not None)

    dinfo = devlib.resolve(recipe.runtime.device)
    device = dinfo.torch_device
    tokenizer = load_tokenizer(init_path)
    carry_chat_template(tokenizer, recipe.data.chat)  # the checkpoints carry an override template
    if teachers is not None:  # pre-flight before any compute: tokenizers and routing
        teachers.check(tokenizer_fingerprint(tokenizer), list(domains))
    names = list(domains)
    weights = recipe.mix_weights(loop_cfg, _section(loop_cfg), names)
    info = claim_stage(stage_dir, fingerprint, {"stage": stage, "init": str(init_path)})
    if finished(info, fingerprint, loop_cfg.steps, stage_dir):  # brought back from aside
        return LoopResult(stage_dir / "final", info.get("eval", {}), [], loop_cfg.steps, stage_dir)

    ckpts = checkpoint_dirs(stage_dir)
    start = 0
    model_src = init_path
    if ckpts and checkpoint_step(ckpts[-1]) > loop_cfg.steps:
        raise StageStateError(f"{stage_dir} already trained {checkpoint_step(ckpts[-1])} steps, "
                              f"more than the {loop_cfg.steps} asked for; ask for at least that many steps, restart "
                              f"the stage (`--restart`; in a Prefect flow `refresh`) or choose another name")
    st = load_loop_state(ckpts[-1]) if ckpts else {}  # optimizer + scheduler + step: read once
    lora = loop_cfg.lora
    if ckpts:  # resume — also extends a finished stage when only `steps` grew
        # LoRA checkpoints hold only the adapter: the frozen base is the stage's input model
        model_src = ckpts[-1] / "model" if lora is None else init_path
        start = st["step"]
    # float32 master weights whatever runtime.dtype (the compute dtype: autocast below, FSDP2's MixedPrecisionPolicy
    # in the workers); with a trainer this is the sampling copy, filled with the workers' float32 weights
    model = load_model(model_src, device, devlib.TRAIN_MASTER_DTYPE)
    if lora is not None:
        with torch.random.fork_rng(devices=[]):  # the adapters' init from (seed, stage), not the global RNG
            torch.manual_seed(random.Random(f"{recipe.seed}/{stage}/lora").getrandbits(63))
            add_lora(model, lora)
        if ckpts:
            load_adapter(model, ckpts[-1] / ADAPTER_DIR)
    model.train()
    if recipe.train.gradient_checkpointing and trainer is None:
        enable_gradient_checkpointing(model)
    amp = partial(devlib.autocast, dinfo.kind, recipe.runtime.dtype)  # a fresh context per use
    opt = sched = None
    if trainer is None:
        opt = torch.optim.AdamW(trainable_parameters(model), lr=loop_cfg.lr, betas=tuple(loop_cfg.betas),
                                weight_decay=loop_cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(loop_cfg.warmup_steps))
        if ckpts:
            if st.get("optimizer") is None:
                raise StageStateError(f"{ckpts[-1]} holds a sharded optimizer state (trained with "
                                      "runtime.strategy ddp/fsdp2); resume it with runtime.strategy ddp or fsdp2")
            opt.load_state_dict(st["optimizer"])
            if st.get("scheduler"):
                sched.load_state_dict(st["scheduler"])
    elif ckpts and st.get("optimizer") is not None:
        raise StageStateError(f"{ckpts[-1]} was trained in one process (runtime.strategy=single); resume it with "
                              "runtime.strategy=single, or restart the stage (`--restart`)")
    in_process = {n: t.param_bytes for n, t in (teachers.teachers.items() if teachers is not None else [])
                  if t.in_process}
    rt = recipe.runtime
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in trainable_parameters(model))
    if lora is not None:
        log.info("%s: LoRA r=%d alpha=%g on %s: %d trainable of %d parameters (%.2f %%)", stage, lora.r, lora.alpha,
                 lora.target_modules or "all-linear", n_trainable, n_params, 100.0 * n_trainable / n_params)
    # the same rule as the pre-flight's: with FSDP2 CPU offload only the gathered units are on the device
    gathered = (fsdp_gathered_bytes(n_params, model_shape(unwrap(model).config.to_dict()),
                                    getattr(torch, rt.dtype).itemsize) if recipe.train.fsdp_cpu_offload else None)
    # LoRA with the in-process engine: it samples from a plain copy holding the merged weights (refreshed before
    # each rollout and eval) at the plain model's speed, not through the adapter matmuls of every layer; the vllm
    # and served engines get the merged weights through their own hand-over (`lora.export_state_dict`)
    merged_rollout = lora is not None and recipe.rollout.backend == "hf"
    check_colocated_fit(kind=dinfo.kind, limit_gib=rt.memory_limit_gib,
                        student_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                        optimizer_factor=2.0, teacher_bytes=in_process, teachers_offload=recipe.teachers.offload,
                        placement=rt.placement, shards=rt.num_workers if rt.strategy == "fsdp2" else 1,
                        driver_copy=trainer is not None or merged_rollout, gathered=gathered,
                        trainable_bytes=(sum(p.numel() * p.element_size() for p in trainable_parameters(model))
                                         if lora is not None else None))
    try:
        if trainer is not None:
            desc = trainer.start(ckpts[-1] / "model" if ckpts else init_path,
                                 resume=ckpts[-1] / SHARDED_OPTIMIZER if ckpts else None,
                                 scheduler_state=st.get("scheduler"))
            rec = read_stage(stage_dir) or {}
            rec["distributed"] = desc  # where the workers ran (node, pid, device, bytes per rank)
            write_stage(stage_dir, rec)
        served = recipe.rollout.backend == "served"
        async_mode = recipe.runtime.placement == "async"
        merged = merged_copy(model) if merged_rollout else None

        def sampler():
            """The module rollout and eval sample from: the trainer's, or the merged copy brought up to date."""
            if merged is None:
                return model
            refresh_merged(merged, model)
            return merged

        engine = build_rollout(recipe, model if merged is None else merged, tokenizer, device,
                               **({"model_path": model_src, "run_dir": stage_dir / "rollout", "version": start}
                                  if served else {}))
        if served and lora is not None and start > 0:  # the servers started on the base: the resumed merged weights
            engine.sync_weights(model, version=start)
        # the served engine's weights are handed over by the loop itself, with the step as their version
        # (the merged copy is refreshed by the loop: the scheduler's hand-over would swap in the trainer's module)
        phases = PhaseScheduler(kind=dinfo.kind, device=device, model=model, opt=opt,
                                engine=None if served or merged is not None else engine, teachers=teachers,
                                placement=recipe.runtime.placement, events_path=stage_dir / "phases.jsonl")
        metrics_path = stage_dir / "metrics.jsonl"
        timeline_path = stage_dir / "timeline.jsonl"  # when each step's phases ran (train.timeline)
        _truncate_metrics(metrics_path, start)
        _truncate_metrics(timeline_path, start)
        clock = timeline.Clock()
        _truncate_metrics(phases.events_path, start)
        eval_cfg = recipe.eval
        max_new = recipe.rollout.max_new_tokens
        eval_new = eval_cfg.max_new_tokens or max_new
        history: list[dict] = []
        last_eval: dict = {}
        G = loop_cfg.group_size
        stop_ids = engine.stop_ids()  # a completion that ends without one of them was cut off by the budget
        # only domains whose rewards depend on it (zero_if_truncated) need the flags
        flag_cut_offs = any(getattr(d, "uses_truncation", False) for d in domains.values())
        top_k = loop_cfg.jsd_top_k if (teachers is not None and loop_cfg.kd_loss == "jsd") else 0
        distil = teachers is not None and loop_cfg.w_kd > 0
        dense = distil and loop_cfg.kd_loss == "topk_rkl"
        full_jsd = distil and loop_cfg.kd_loss == "full_jsd"
        conflict = recipe.teachers.conflict if distil else "none"
        # advantage-form distillation the update may recompute or that gap/conflict scale: built as a KDPlan
        planned = distil and (dense or loop_cfg.reward_refresh or loop_cfg.gap_following or conflict != "none")
        gaps = kd.restore_gaps(metrics_path, names) if loop_cfg.gap_following else None
        ro = recipe.rollout

        def generate_step(step: int) -> Produced:
            """The step's prompts and samples — all randomness from (seed, stage, step)."""
            rng = random.Random(f"{recipe.seed}/{stage}/{step}")
            prompts = sample_prompts(domains, weights, loop_cfg.prompts_per_step, rng)
            examples = [e for e in prompts for _ in range(G)]
            gen = torch.Generator(device=device).manual_seed(rng.getrandbits(63))
            t0, c0 = time.perf_counter(), clock.now()
            # the phase scheduler is the trainer thread's: in async mode this runs in the generator thread
            with (contextlib.nullcontext() if async_mode else phases.rollout()), amp():
                # behaviour log-probs in the compute dtype of the update
                batch = engine.generate(examples, max_new_tokens=max_new, temperature=ro.temperature,
                                        top_p=ro.top_p, top_k=ro.top_k, min_p=ro.min_p, generator=gen,
                                        batch_size=ro.batch_size)
            return Produced(step, rng, batch, time.perf_counter() - t0, version=step,
                            times={"generate": [c0, clock.now()]})

        def score_step(p: Produced) -> None:
            """Rewards and teacher scores of the step's samples (`p.scored`)."""
            batch, sc = p.batch, p.scored
            c0 = clock.now()
            if ro.truncates:  # off (the defaults): no extra forward, the engine's log-probs as they are
                t0 = time.perf_counter()
                p.batch, sc["trunc"] = recompute_behaviour_logp(model, batch, ro.temperature,
                                                                recipe.train.logprob_impl, loop_cfg.micro_batch_size,
                                                                amp, packed=recipe.train.packing)
                sc["trunc"]["perf/behaviour_logp_s"] = time.perf_counter() - t0
                batch = p.batch
            cut_off = truncated_flags(batch, max_new, stop_ids) if flag_cut_offs else None
            sc["rewards"] = torch.tensor(_rewards(domains, batch, cut_off), dtype=torch.float32, device=device)
            t0 = time.perf_counter()
            before = teachers.stats() if teachers is not None else {}
            visit = None if async_mode else phases.teacher
            if teachers is not None and dense:
                (sc["routed"], *sc["dense"]) = kd.dense_candidates(
                    model, batch, teachers, kind=loop_cfg.kd_candidates, k=loop_cfg.kd_top_k,
                    temperature=ro.temperature, impl=recipe.train.logprob_impl,
                    micro_batch_size=loop_cfg.micro_batch_size, amp=amp, packed=recipe.train.packing, visit=visit)
            elif full_jsd:  # ℓᵀ and the hidden states from one forward per teacher
                sc["routed"], sc["full"] = kd.FullJSD.from_router(teachers, batch, visit)
            else:
                sc["routed"] = (teachers.score(batch, top_k=top_k, visit=visit) if teachers is not None else None)
            sc["t_score"] = time.perf_counter() - t0
            sc["teacher_stats"] = _teacher_stat_deltas(before, teachers.stats()) if teachers is not None else {}
            p.times["score"] = [c0, clock.now()]

        pipeline = None
        if async_mode:
            from .pipeline import AsyncPipeline

            ac = recipe.async_
            pipeline = AsyncPipeline(engine=engine, generate=generate_step, score=score_step, start=start,
                                     steps=loop_cfg.steps, max_staleness=ac.max_staleness,
                                     queue_size=ac.queue_size, timeout_s=ac.timeout_s).start_threads()

        bar = StageProgress(stage, loop_cfg.steps, start, enabled=progress)
        try:
            for step in range(start, loop_cfg.steps):
                t_step = time.perf_counter()
                phases.begin_step(step + 1)
                m: dict[str, float] = {}
                if pipeline is not None:
                    produced, am = pipeline.take(step)
                    m.update(am)
                else:
                    if served and engine.version != step:  # the previous update's weights, as version `step`
                        t0 = time.perf_counter()
                        rep = engine.sync_weights(model, version=step)
                        m.update({"perf/weight_sync_s": time.perf_counter() - t0,
                                  "weights/bytes_copied": float(rep["bytes_copied"])})
                    elif merged is not None and step > start:  # the copy is current at the start
                        t0 = time.perf_counter()
                        m.update({"weights/bytes_copied": float(refresh_merged(merged, model)),
                                  "perf/weight_sync_s": time.perf_counter() - t0})
                    produced = generate_step(step)
                    score_step(produced)
                rng, batch, t_roll = produced.rng, produced.batch, produced.t_roll
                rewards, routed, t_score = (produced.scored[k] for k in ("rewards", "routed", "t_score"))
                trunc = produced.scored.get("trunc", {})
                mask = batch.completion_mask.float()
                # decoupled PPO (async): samples of an older version get the trainer's current log-probs as the
                # proximal policy; the behaviour log-probs stay in the advantage and the importance weight
                proximal = None
                if pipeline is not None and produced.version != step:
                    t0 = time.perf_counter()
                    proximal, _ = recompute_behaviour_logp(model, batch, ro.temperature, recipe.train.logprob_impl,
                                                           loop_cfg.micro_batch_size, amp,
                                                           packed=recipe.train.packing)
                    proximal = proximal.behaviour_logp
                    m["perf/proximal_logp_s"] = time.perf_counter() - t0

                adv = torch.zeros_like(mask)
                if loop_cfg.w_rl > 0:
                    a_rl = alg.grpo_advantages(rewards, G, scale_by_std=loop_cfg.scale_by_std)
                    adv = adv + loop_cfg.w_rl * a_rl[:, None] * mask
                    m["adv/rl_abs_mean"] = float(a_rl.abs().mean())
                group_ids = torch.tensor([names.index(e.teacher_id) for e in batch.examples], device=device)
                plan = None
                if planned:
                    adv, plan, pm, gaps = _kd_plan(loop_cfg, conflict, recipe.teachers.conflict_nats, routed,
                                                   produced.scored.get("dense"), batch, mask, adv, group_ids, names,
                                                   gaps)
                    m.update(pm)
                elif routed is not None and loop_cfg.kd_loss == "sampled_rkl":
                    a_kd = alg.reverse_kl_advantages(routed.logp, batch.behaviour_logp, mask, clip=loop_cfg.kd_clip)
                    adv = adv + loop_cfg.w_kd * a_kd
                    m["adv/kd_mean"] = float((a_kd * mask).sum() / mask.sum().clamp(min=1))
                token_w = alg.balance_weights(loop_cfg.balance, group_ids, mask)
                if routed is not None:  # each domain's share of the tokens and of the weighted advantage mass
                    m.update(_domain_shares(adv, token_w, mask, group_ids, names))

                t0, c_train = time.perf_counter(), clock.now()
                with phases.train():
                    if trainer is None:
                        with amp():
                            upd = policy_update(model, opt, sched, batch, adv, mask, token_w, routed, loop_cfg,
                                                recipe.rollout.temperature, rng, recipe.train.logprob_impl,
                                                recipe.train.max_tokens_per_micro_batch,
                                                packed=recipe.train.packing, proximal=proximal,
                                                is_cap=recipe.async_.is_cap, is_mode=recipe.async_.is_mode,
                                                plan=plan, full=produced.scored.get("full"))
                    else:  # the workers update; this copy follows them (the next rollout samples from it)
                        upd = trainer.update(batch, adv, token_w, temperature=recipe.rollout.temperature,
                                             seed=rng.getrandbits(31),
                                             routed=routed if loop_cfg.kd_loss == "jsd" else None)
                        with torch.no_grad():
                            model.load_state_dict(trainer.state_dict())
                t_train = time.perf_counter() - t0
                if not all(math.isfinite(upd[k]) for k in ("loss", "grad_norm")):
                    last = checkpoint_dirs(stage_dir)
                    raise NonFiniteLossError(
                        f"{stage}: non-finite loss/gradient at step {step + 1} (loss={upd['loss']}, grad_norm="
                        f"{upd['grad_norm']}); stopped without saving — last good checkpoint: "
                        f"{last[-1] if last else 'none'} (lower the lr or check the data)")
                if pipeline is not None:  # version step + 1, for the generator to load when it needs it
                    m.update(pipeline.publish(step + 1, model))
                timeline.append(timeline_path, {"step": step + 1, "version": produced.version, **produced.times,
                                                "train": [c_train, clock.now()]})

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
                    m.update(produced.scored["teacher_stats"])
                    m["perf/score_s"] = t_score
                    m["perf/score_tokens_per_s"] = n_tok * (len(routed.per_teacher) if teachers.routing == "mixture"
                                                            else 1) / max(t_score, 1e-9)
                m.update(upd)
                m.update(trunc)
                dt = time.perf_counter() - t_step
                seq_tok = n_tok + int(batch.prompt_mask.sum())
                if pipeline is not None:  # the share of the step the trainer waited for samples
                    m["async/trainer_idle_frac"] = min(1.0, m["async/trainer_wait_s"] / max(dt, 1e-9))
                m.update({"perf/rollout_s": t_roll, "perf/train_s": t_train, "perf/step_s": dt,
                          "perf/tokens_per_s": n_tok / dt, "perf/rollout_tokens_per_s": n_tok / max(t_roll, 1e-9),
                          "perf/train_tokens_per_s": seq_tok * loop_cfg.minibatches / max(t_train, 1e-9),
                          "lr": sched.get_last_lr()[0] if sched is not None else upd["lr"]})
                m.update(devlib.memory_stats(dinfo.kind))
                m.update(phases.end_step())
                if step == start:  # once per run: what each phase holds (MLflow has the series)
                    held = ", ".join(f"{p} {m[f'mem/{p}/resident_mb']:.3g}" for p in ("rollout", "score", "train")
                                     if f"mem/{p}/resident_mb" in m)
                    measured = ", ".join(f"{k.split('/')[1]} {v:.0f}" for k, v in m.items()
                                         if k.startswith("mem/") and k.count("/") == 2
                                         and not k.endswith("resident_mb"))
                    log.info("%s: %s memory per phase (MiB held on the device: %s; measured %s)", stage,
                             recipe.runtime.placement, held, measured)

                done = step + 1
                if loop_cfg.eval_every and done % loop_cfg.eval_every == 0 and done < loop_cfg.steps:
                    with amp():
                        last_eval = evaluate_model(sampler(), tokenizer, eval_domains, eval_cfg, device, eval_new,
                                                   recipe.seed, loop_cfg.eval_size, chat=recipe.data.chat)
                    for d, r in last_eval.items():
                        for k, v in r.items():
                            m[f"eval/{d}/{k}"] = v
                row = {"step": done, **m}
                history.append(row)
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                if on_step:
                    on_step(done, m)
                bar.update(done, m)
                if done % loop_cfg.save_every == 0 and done < loop_cfg.steps:
                    save_checkpoint(stage_dir, done, model, tokenizer, opt, sched, keep=loop_cfg.keep_checkpoints,
                                    sharded=_sharded_writer(trainer))
        finally:
            bar.close()
            if pipeline is not None:
                pipeline.close()
            phases.restore()
            engine.close()  # a vLLM engine releases its device memory; the HF engine has nothing to close

        log.info("%s: %s", stage, phases.summary())
        with amp():
            last_eval = evaluate_model(sampler(), tokenizer, eval_domains, eval_cfg, device, eval_new, recipe.seed,
                                       loop_cfg.eval_size, chat=recipe.data.chat)
        final_dir = save_pretrained(model, tokenizer, stage_dir / "final")
        # the last checkpoint repeats final/ plus the optimizer state: raising `steps` later continues from it
        save_checkpoint(stage_dir, loop_cfg.steps, model, tokenizer, opt, sched, keep=loop_cfg.keep_checkpoints,
                        sharded=_sharded_writer(trainer))
        info = read_stage(stage_dir) or {}
        info.update({"status": "done", "final_dir": str(final_dir), "eval": last_eval, "steps": loop_cfg.steps,
                     "teacher_stats": teachers.stats() if teachers is not None else {},
                     "placement": {"mode": recipe.runtime.placement,
                                   "max_teachers_resident": phases.max_teachers_resident},
                     **({"rollout": {"backend": "served", **engine.manifest(), **engine.stats}} if served else {}),
                     **({"lora": {**lora.model_dump(mode="json"), "trainable_params": n_trainable,
                                  "total_params": n_params}} if lora is not None else {})})
        write_stage(stage_dir, info)
        return LoopResult(final_dir, last_eval, history, start, stage_dir)
    finally:
        if trainer is not None:
            trainer.close()


def recompute_behaviour_logp(model, batch: RolloutBatch, temperature: float, impl: str = "chunked",
                             micro_batch_size: int | None = None, amp=contextlib.nullcontext, *,
                             packed: bool = False) -> tuple[RolloutBatch, dict[str, float]]:
    """`batch` with its behaviour log-probs replaced by the trainer's `completion_logprobs` (no gradient, in `amp`),
    and `rollout/trunc_logp_gap`: the mean over completion tokens of (engine's − recomputed), ≥ 0.

    With truncated sampling (rollout.top_p < 1, top_k > 0 or min_p > 0) the engines report processed log-probs
    (the renormalised truncated distribution, vLLM's processed_logprobs), which exceed the trainer's untruncated
    log_softmax(logits / T) by log(mass kept): used as π_old they make the first PPO ratio exp(−gap) instead of 1
    and shift the reverse-KL advantage by the gap. verl recomputes old_log_prob with the actor (the rollout's
    log-probs serve only its importance-sampling correction) and TRL's GRPO takes the old log-probs from the model,
    so the ratio and the advantage compare the trainer's distribution with itself. With a `PolicyTrainer` the
    driver's `model` holds the workers' weights of this step (reloaded after each update), so it scores for them.
    """
    from .. import rollout as rollout_mod  # looked up at call time (tests count the forwards)

    with torch.no_grad(), amp():
        logp = rollout_mod.completion_logprobs(model, batch, temperature, impl=impl,
                                               micro_batch_size=micro_batch_size, packed=packed)
    cm = batch.completion_mask.bool()
    logp = torch.where(cm, logp, torch.zeros_like(logp)).to(batch.behaviour_logp.dtype)  # 0 where masked
    n = int(cm.sum())
    gap = float((batch.behaviour_logp.double() - logp.double())[cm].sum()) / n if n else 0.0
    return dataclasses.replace(batch, behaviour_logp=logp), {"rollout/trunc_logp_gap": gap}


def enable_gradient_checkpointing(model) -> None:
    """transformers' activation checkpointing per decoder layer, non-reentrant (torch's recommended mode: works
    with FSDP2, with inputs that need no grad and under autocast). The rollout engines sample in eval mode, where
    transformers keeps the KV cache on."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _sharded_writer(trainer: PolicyTrainer | None):
    """What `save_checkpoint` calls with its temp dir when a trainer holds the optimizer: the workers write their
    shards there (inside the same atomic rename as model/), the scheduler state goes into the loop's record."""
    if trainer is None:
        return None

    def write(tmp: Path) -> dict:
        return {"scheduler": trainer.save(tmp / SHARDED_OPTIMIZER)["scheduler"]}
    return write


def _rewards(domains, batch: RolloutBatch, truncated: list[bool] | None = None) -> list[float]:
    """Each row's reward from its domain; `truncated` flags reach the verifiers (zero_if_truncated)."""
    out = [0.0] * batch.size
    by_dom = defaultdict(list)
    for i, e in enumerate(batch.examples):
        by_dom[e.teacher_id].append(i)
    for d, rows in by_dom.items():
        rs = domain_rewards(domains[d], [batch.examples[i] for i in rows], [batch.texts[i] for i in rows],
                            None if truncated is None else [truncated[i] for i in rows])
        for i, r in zip(rows, rs):
            out[i] = float(r)
    return out


_STAT_METRICS = (("seconds", "score_s"), ("tokens", "tokens"), ("requests", "requests"), ("retries", "retries"),
                 ("restarts", "restarts"))


def _teacher_stat_deltas(before: dict, after: dict) -> dict[str, float]:
    """teacher/<t>/{score_s,tokens,requests,retries,restarts}: this step's share of each teacher's counters."""
    out = {}
    for t, st in after.items():
        b = before.get(t, {})
        for key, name in _STAT_METRICS:
            if key in st:
                out[f"teacher/{t}/{name}"] = float(st[key] - b.get(key, 0))
    return out


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


def _domain_shares(adv, token_w, mask, group_ids, names: list[str]) -> dict[str, float]:
    """`token_share/<d>`: the domain's share of the completion tokens; `grad_share/<d>`: its share of
    Σ w_t·|A_t| (token weights × advantage magnitude, summed over a dense loss's slots) — Open-MOPD's diagnosis
    of a short-answer domain that holds many prompts but few gradient tokens."""
    a = (adv.sum(-1) if adv.dim() == 3 else adv).abs() * mask
    if token_w is not None:
        a = a * token_w
    tok, mass = mask.sum(-1), a.sum(-1)
    out = {}
    for d, n in enumerate(names):
        rows = group_ids == d
        if rows.any():
            out[f"token_share/{n}"] = float(tok[rows].sum() / tok.sum().clamp(min=1))
            out[f"grad_share/{n}"] = float(mass[rows].sum() / mass.sum()) if float(mass.sum()) > 0 else 0.0
    return out


def _kd_plan(cfg: PolicyLoopConfig, conflict: str, nats: float, routed, dense, batch: RolloutBatch, mask, adv,
             group_ids, names: list[str], gaps):
    """The step's advantage with the distillation term as a `kd.KDPlan` (dense top-K, reward refresh,
    gap-following, teacher conflict): `(advantage [B,T] or [B,T,S], plan, metrics, running gaps)`. `adv` holds the
    GRPO part `[B,T]`."""
    m: dict[str, float] = {}
    n_tok = mask.sum().clamp(min=1)
    if dense is not None:
        slot_ids, kd_valid, rl_slot, old, teacher = dense
        anchor = old[..., -1]  # the student's log-prob of the sampled token before the update
    else:
        teacher, anchor = routed.logp, batch.behaviour_logp
    keep = torch.ones_like(mask)
    if conflict != "none":
        tnames = list(routed.per_teacher)
        per = torch.stack([routed.per_teacher[n][1] for n in tnames])  # mixture: every teacher scored every row
        hit, pick = alg.teacher_conflict(per, anchor, mask, nats)
        if conflict == "mask":
            keep = keep * (~hit).to(keep.dtype)
        elif dense is not None:  # the picked teacher's log-probs of every slot
            per_s = torch.stack([torch.cat([routed.per_teacher_support[n], routed.per_teacher[n][1].unsqueeze(-1)], -1)
                                 for n in tnames]).to(teacher.dtype)
            chosen = per_s.gather(0, pick[None, ..., None].expand((1,) + per_s.shape[1:]))[0]
            teacher = torch.where(hit.unsqueeze(-1), chosen, teacher)
        else:
            teacher = torch.where(hit, per.gather(0, pick[None])[0], teacher)
        m["conflict/frac"] = float(hit.sum() / n_tok)
    if dense is not None:
        a_kd = alg.topk_rkl_advantages(old, teacher, kd_valid, mask, cfg.kd_clip)
    else:
        a_kd = alg.reverse_kl_advantages(teacher, batch.behaviour_logp, mask, clip=cfg.kd_clip)
    m["adv/kd_mean"] = float(((a_kd.sum(-1) if dense is not None else a_kd) * mask).sum() / n_tok)
    scale = torch.ones_like(mask)
    if cfg.gap_following:
        g = alg.domain_gaps(a_kd, group_ids, mask, len(names))
        gaps = alg.ema_gaps(gaps, g.tolist(), cfg.gap_momentum)
        scales = alg.gap_scales(gaps, *cfg.gap_clip)
        scale = torch.tensor(scales, dtype=mask.dtype, device=mask.device)[group_ids].unsqueeze(-1).expand_as(mask)
        for n, gm, sc in zip(names, gaps, scales):
            if gm is not None:
                m[f"gap/m/{n}"], m[f"gap/scale/{n}"] = gm, sc
    factor = cfg.w_kd * scale * keep  # exactly w_kd where no scale or conflict applies
    if dense is None:
        plan = kd.KDPlan(False, teacher, factor, adv, cfg.kd_clip, cfg.reward_refresh)
        return adv + factor * a_kd, plan, m, gaps
    rl_adv = rl_slot.to(adv.dtype) * adv.unsqueeze(-1)  # the GRPO outcome term on the sampled token's slot only
    plan = kd.KDPlan(True, teacher, factor, rl_adv, cfg.kd_clip, cfg.reward_refresh, slot_ids, old, kd_valid,
                     kd_valid | rl_slot)
    m["kd/candidates_per_token"] = float((kd_valid & mask.bool().unsqueeze(-1)).sum() / n_tok)
    return rl_adv + factor.unsqueeze(-1) * a_kd, plan, m, gaps


def policy_update(model, opt, sched, batch: RolloutBatch, adv, mask, token_w, routed, cfg: PolicyLoopConfig,
            temperature: float, rng: random.Random, logprob_impl: str = "chunked",
            max_tokens: int | None = None, agree: Callable[[int], int] | None = None,
            packed: bool = False, kd_scale: float = 1.0, proximal: torch.Tensor | None = None,
            is_cap: float | None = None, is_mode: str = "truncate", plan: "kd.KDPlan | None" = None,
            full: "kd.FullJSD | None" = None) -> dict[str, float]:
    """`cfg.minibatches` optimizer steps over the batch; gradient accumulation over micro-batches with each
    micro-loss scaled by its token share, so the objective is the token-mean over the whole minibatch.
    `logprob_impl` is train.logprob_impl (`rollout.score_completions`). `max_tokens` is
    train.max_tokens_per_micro_batch: micro-batches by a token budget, each cut to its own longest row
    (`train.microbatch`), instead of `cfg.micro_batch_size` rows at the batch's full width. Under DDP/FSDP2 every
    rank must run as many forward/backward passes (each runs collectives), which a token budget does not
    guarantee: `agree(n)` returns the ranks' largest count (an all-reduce, as verl's dynamic batch size does), and
    a rank with fewer runs the rest as zero-weight passes over one of its rows. `perf/pad_frac`: the padding
    share of the positions all forwards computed (the zero-weight passes count as computed). `packed`
    (`train.packing`): each micro-batch's rows back to back without padding (`rollout.pack_rows`), the budget
    counting real tokens. `kd_scale` multiplies the JSD term (a Ray worker's `world · n_local / n_global`, the
    factor its token weights carry for the policy loss, so the ranks' mean is the whole batch's token mean).
    `proximal` ([B,T], async stale samples): the decoupled PPO objective's proximal log-probs, with the importance
    weight π_prox/π_behav capped at `is_cap` as `is_mode` says (`algorithms.policy_loss`). `plan`: the dense top-K
    loss (`adv` is then `[B,T,S]` over its slots) and/or reward refresh (`kd.KDPlan`); `full`: the teachers' hidden
    states of kd_loss=full_jsd, whose divergence joins the loss like the top-k JSD."""
    B = batch.size
    order = list(range(B))
    if cfg.minibatches > 1:
        rng.shuffle(order)
    mbs = [order[i::cfg.minibatches] for i in range(cfg.minibatches)]
    agg = defaultdict(float)
    use_jsd = routed is not None and cfg.kd_loss == "jsd"
    lens = row_lengths(batch) if max_tokens is not None else None
    computed = real = 0
    dense = plan is not None and plan.dense
    refresh = plan is not None and plan.refresh
    if full is not None:
        head = unwrap(model).get_output_embeddings()
        softcap, scale = logit_transform(model)
        s_tr = LogitTransform(temperature, softcap, scale)
    for mb_i, mb in enumerate(mbs):
        opt.zero_grad(set_to_none=True)
        n_mb = float(mask[mb].sum()) or 1.0
        if max_tokens is not None:
            micros = token_budget_micro_batches(mb, *lens, max_tokens, packed=packed)
            if agree is not None:  # [] = a zero-weight pass that keeps this rank in step with the others
                micros += [[] for _ in range(agree(len(micros)) - len(micros))]
        else:
            micro = cfg.micro_batch_size or len(mb)
            micros = [mb[s:s + micro] for s in range(0, len(mb), micro)]
        for rows in micros:
            idle = not rows
            rows = rows or mb[:1]
            if max_tokens is not None:
                sub, t = trim(batch, rows)
            else:  # today's layout, untouched: the batch's full width (same numbers as before the budget)
                sub, t = batch.select(rows), batch.completion_ids.shape[1]
            c, r = padded_positions(sub)
            c = r if packed else c  # packed: only the real tokens are computed
            computed, real = computed + c, real + (0 if idle else r)
            sup = routed.topk_ids[rows, :t] if use_jsd else plan.slot_ids[rows, :t] if dense else None
            sc = score_completions(model, sub, temperature, impl=logprob_impl, entropy=True, support_ids=sup,
                                   packed=packed, hidden=full is not None)
            logp, ent = sc.logp, sc.entropy
            mk = mask[rows, :t]
            tw = token_w[rows, :t] if token_w is not None else None
            a = adv[rows, :t]
            if refresh and mb_i > 0 and not idle:  # the first minibatch's weights made the stored advantage
                a = plan.advantage((sc.support_logp if dense else logp).detach(), rows, t, mk)
                diff = (a - adv[rows, :t]).abs()
                agg["refresh/kd_adv_change"] += float((diff.sum(-1) if dense else diff).mul(mk).sum()) / n_mb
            if dense:
                loss, met = alg.dense_policy_loss(sc.support_logp, plan.old_logp[rows, :t], a, plan.slots[rows, :t],
                                                  mk, cfg.clip_low, cfg.clip_high, token_weights=tw)
            else:
                dec = {} if proximal is None else {"proximal_logp": proximal[rows, :t], "is_cap": is_cap,
                                                   "is_mode": is_mode}
                loss, met = alg.policy_loss(logp, sub.behaviour_logp, a, mk, cfg.clip_low, cfg.clip_high,
                                            token_weights=tw, **dec)
            # weight by tokens, not by micro-batch count: the minibatch's token mean (0: a pass only to stay in step)
            share = 0.0 if idle else float(mk.sum()) / n_mb
            total = loss * share
            if use_jsd:
                s_sup, t_sup = alg.support_from_gathered(sc.support_logp, logp, routed.topk_ids[rows, :t],
                                                         routed.topk_logp[rows, :t], sub.completion_ids,
                                                         routed.logp[rows, :t])
                jsd = alg.generalized_jsd(s_sup, t_sup, cfg.jsd_beta, mk)
                total = total + cfg.w_kd * jsd * share * kd_scale
                agg["jsd"] += float(jsd.detach()) * share * kd_scale / len(mbs)
            if full is not None:
                jsd = full.divergence(sc.hidden, head, s_tr, rows, mk.bool(), cfg.jsd_beta) / max(float(mk.sum()), 1.0)
                total = total + cfg.w_kd * jsd * share * kd_scale
                agg["jsd"] += float(jsd.detach()) * share * kd_scale / len(mbs)
            total.backward()
            with torch.no_grad():
                agg["entropy"] += 0.0 if idle else float((ent * mk).sum()) / n_mb / len(mbs)
            for k in ("clip_frac", "approx_kl", "ratio_mean") + (() if proximal is None else
                                                                 ("is_weight_mean", "is_capped_frac", "behaviour_kl")):
                agg[k] += met.get(k, 0.0) * share / len(mbs)
            agg["loss"] += float(total.detach()) / len(mbs)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn  # FSDP2: a DTensor (already reduced)
        agg["grad_norm"] += float(gn) / len(mbs)
        agg["perf/pad_frac"] = 1.0 - real / max(computed, 1)
        agg["perf/micro_batches"] += float(len(micros))
        if not (math.isfinite(agg["loss"]) and math.isfinite(float(gn))):
            opt.zero_grad(set_to_none=True)
            return dict(agg)
        opt.step()
        sched.step()
    return dict(agg)


def _truncate_metrics(path: Path, upto_step: int) -> None:
    """On resume, drop rows after the checkpoint so the JSONL holds each step exactly once."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= upto_step]
    path.write_text("".join(ln + "\n" for ln in keep))


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
