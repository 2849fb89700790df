"""The objects one policy-loop step talks to, chosen once at stage start from the config (`build_roles`):

    source      where the step's scored samples come from   (source.InlineSource | source.AsyncSource)
    sync        how the trainer's weights reach the engine   (weight_sync.IdentitySync | EngineSync | ServedSync
                                                              | MergedSync), called by the phase scheduler
    scorer      rewards + the teachers' signal               (scorer.Scorer)
    objective   advantage and loss terms                     (objective.RewardObjective and its kin)
    updater     who updates and holds the optimizer          (updater.LocalUpdater | updater.RemoteUpdater)
    recovery    recovery per domain at each eval, and the    (recovery.RecoveryGate)
                gate that stops sampling a recovered domain

The loop (`train.loop`) then reads as sample → score → advantage → update → log/checkpoint, with no mode flags.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import torch

from ...models import compile_decoder_layers, load_model, model_shape, unwrap
from ...models.lora import ADAPTER_DIR, add_lora, load_adapter, merged_copy, trainable_parameters
from ...rollout.engines import build_rollout
from ...runtime import device as devlib
from ...runtime.phases import PhaseScheduler, check_colocated_fit, fsdp_gathered_bytes
from ..pipeline import AsyncPipeline
from ..update import enable_gradient_checkpointing
from .context import StageContext
from ...stages.folder import read_metrics
from .objective import Advantage, RewardObjective, build_objective
from .recovery import RecoveryGate, RecoveryRefs
from .scorer import Scorer
from .source import AsyncSource, Generator, InlineSource
from .updater import LocalUpdater, PolicyTrainer, RemoteUpdater
from .weight_sync import EngineSync, IdentitySync, MergedSync, ServedSync, WeightSync

log = logging.getLogger("mopd")


@dataclass
class Roles:
    model: torch.nn.Module        # the trained weights (with a remote updater: this process's sampling copy)
    updater: LocalUpdater | RemoteUpdater
    engine: Any                   # the rollout engine (`rollout.RolloutEngine`)
    sync: WeightSync
    phases: PhaseScheduler
    objective: RewardObjective
    scorer: Scorer
    source: InlineSource | AsyncSource
    recovery: RecoveryGate

    def close(self) -> None:
        """Stop the background work, put the optimizer back, release the engine's device memory."""
        self.source.close()
        self.phases.restore()
        self.engine.close()


def load_policy(ctx: StageContext, trainer: PolicyTrainer | None):
    """The trained model: float32 master weights whatever runtime.dtype (the compute dtype is autocast's, FSDP2's
    MixedPrecisionPolicy in the workers); with a trainer this is the sampling copy, filled with the workers'
    float32 weights. LoRA adapters are initialised from (seed, stage), not the global RNG."""
    model = load_model(ctx.model_src, ctx.device, devlib.TRAIN_MASTER_DTYPE)
    lora = ctx.cfg.lora
    if lora is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(random.Random(f"{ctx.recipe.seed}/{ctx.stage}/lora").getrandbits(63))
            add_lora(model, lora)
        if ctx.ckpts:
            load_adapter(model, ctx.last_ckpt / ADAPTER_DIR)
        n_params, n_train = param_counts(model)
        log.info("%s: LoRA r=%d alpha=%g on %s: %d trainable of %d parameters (%.2f %%)", ctx.stage, lora.r,
                 lora.alpha, lora.target_modules or "all-linear", n_train, n_params, 100.0 * n_train / n_params)
    model.train()
    if ctx.recipe.train.gradient_checkpointing and trainer is None:
        enable_gradient_checkpointing(model)
    if ctx.recipe.train.compile and trainer is None:  # training-mode forwards only; samplers stay eager
        compile_decoder_layers(model, ctx.kind)
    return model


def param_counts(model) -> tuple[int, int]:
    """(all parameters, trainable ones)."""
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in trainable_parameters(model))


def check_fit(ctx: StageContext, model, driver_copy: bool) -> None:
    """The phases' memory against the device budget, before any compute (the pre-flight's rule)."""
    rt, teachers = ctx.recipe.runtime, ctx.teachers
    in_process = {n: t.param_bytes for n, t in (teachers.teachers.items() if teachers is not None else [])
                  if t.in_process}
    n_params, _ = param_counts(model)
    # with FSDP2 CPU offload only the gathered units are on the device (the dtype: torch's by name)
    gathered = (fsdp_gathered_bytes(n_params, model_shape(unwrap(model).config.to_dict()),
                                    getattr(torch, rt.dtype).itemsize) if ctx.recipe.train.fsdp_cpu_offload else None)
    check_colocated_fit(kind=ctx.kind, limit_gib=rt.memory_limit_gib,
                        student_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                        optimizer_factor=2.0, teacher_bytes=in_process, teachers_offload=ctx.recipe.teachers.offload,
                        placement=rt.placement, shards=rt.num_workers if rt.strategy == "fsdp2" else 1,
                        driver_copy=driver_copy, gathered=gathered,
                        trainable_bytes=(sum(p.numel() * p.element_size() for p in trainable_parameters(model))
                                         if ctx.cfg.lora is not None else None))


def build_engine(ctx: StageContext, model) -> tuple[Any, WeightSync]:
    """The rollout engine and the weight-sync role that feeds it."""
    backend, lora = ctx.recipe.rollout.backend, ctx.cfg.lora
    if backend == "served":
        engine = build_rollout(ctx.recipe, model, ctx.tokenizer, ctx.device, model_path=ctx.model_src,
                               run_dir=ctx.stage_dir / "rollout", version=ctx.start)
        if lora is not None and ctx.start > 0:  # the servers started on the base: the resumed merged weights
            engine.sync_weights(model, version=ctx.start)
        return engine, ServedSync(engine, ctx.start)
    if lora is not None and backend == "hf":
        # the in-process engine samples from a plain copy holding the merged weights, at the plain model's speed,
        # not through the adapter matmuls of every layer (vLLM engines get them through `lora.export_state_dict`)
        merged = merged_copy(model)
        engine = build_rollout(ctx.recipe, merged, ctx.tokenizer, ctx.device)
        return engine, MergedSync(engine, merged, ctx.start)
    engine = build_rollout(ctx.recipe, model, ctx.tokenizer, ctx.device)
    return engine, (IdentitySync if backend == "hf" else EngineSync)(engine, ctx.start)


def build_roles(ctx: StageContext, trainer: PolicyTrainer | None) -> Roles:
    """Every role of the stage. The trainer (if any) is started here; the caller closes it."""
    model = load_policy(ctx, trainer)
    updater = RemoteUpdater(ctx, model, trainer) if trainer is not None else LocalUpdater(ctx, model)
    merged = ctx.cfg.lora is not None and ctx.recipe.rollout.backend == "hf"
    check_fit(ctx, model, driver_copy=trainer is not None or merged)
    updater.start()
    engine, sync = build_engine(ctx, model)
    phases = PhaseScheduler(kind=ctx.kind, device=ctx.device, model=model, opt=updater.opt, sync=sync,
                            teachers=ctx.teachers, placement=ctx.recipe.runtime.placement,
                            events_path=ctx.stage_dir / "phases.jsonl")
    objective = build_objective(ctx)
    gate = RecoveryGate(ctx.recovery_refs, ctx.cfg.recovery_targets(ctx.names), ctx.names)
    gate.restore(read_metrics(ctx.metrics_path))  # a resumed stage: the domains stopped before its checkpoint
    if ctx.recipe.runtime.placement == "async":  # the pipeline's threads score: no per-teacher phase turns
        scorer = Scorer(ctx, model, objective, engine.stop_ids())
        ac = ctx.recipe.async_
        pipeline = AsyncPipeline(sync=sync, generate=Generator(ctx, engine, weights=gate.mix), score=scorer.score,
                                 start=ctx.start,
                                 steps=ctx.cfg.steps, max_staleness=ac.max_staleness, queue_size=ac.queue_size,
                                 timeout_s=ac.timeout_s).start_threads()
        source = AsyncSource(ctx, pipeline, model)
    else:
        scorer = Scorer(ctx, model, objective, engine.stop_ids(), visit=phases.teacher)
        source = InlineSource(Generator(ctx, engine, phases.rollout, weights=gate.mix,
                                        top_logprobs=objective.sampler_top_k()), scorer)
    return Roles(model, updater, engine, sync, phases, objective, scorer, source, gate)


__all__ = ["Advantage", "RecoveryGate", "RecoveryRefs", "Roles", "StageContext", "build_roles", "load_policy",
           "param_counts"]
