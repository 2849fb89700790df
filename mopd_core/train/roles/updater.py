"""The updater role: who holds the trained weights and the optimizer, and runs the update of a step.

- `LocalUpdater`: this process (`runtime.strategy: single`) — AdamW + warmup over the trainable parameters,
  `update.policy_update` on the whole batch, the optimizer state in the loop's checkpoints;
- `RemoteUpdater`: a `PolicyTrainer` elsewhere (`distributed.trainer.RayPolicyTrainer`: ddp/fsdp2 on Ray workers),
  whose weights are copied back into this process's sampling copy after every update (the Ray hand-over), and
  whose workers write their optimizer shards inside the loop's checkpoints.

Both answer the same calls (`start`, `update`, `lr`, `checkpoint`, `close`), so the loop never asks which it has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol

import torch

from ...rollout import RolloutBatch
from .. import update as update_mod  # `policy_update` looked up at call time (tests replace it)
from ..checkpoint import StageStateError, read_stage, save_checkpoint, write_stage
from ...models.lora import trainable_parameters
from .context import StageContext
from .objective import Advantage

# What a checkpoint of a stage trained by a `PolicyTrainer` holds beside model/ (torch.distributed.checkpoint).
SHARDED_OPTIMIZER = "optimizer"


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


class LocalUpdater:
    """The update in this process; `opt`/`sched` are the phase scheduler's to offload between updates."""

    def __init__(self, ctx: StageContext, model) -> None:
        c, st = ctx.cfg, ctx.state
        self.ctx, self.model = ctx, model
        self.opt = torch.optim.AdamW(trainable_parameters(model), lr=c.lr, betas=tuple(c.betas),
                                     weight_decay=c.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, update_mod.lr_lambda(c))
        if ctx.ckpts:
            if st.get("optimizer") is None:
                raise StageStateError(f"{ctx.last_ckpt} holds a sharded optimizer state (trained with "
                                      "runtime.strategy ddp/fsdp2); resume it with runtime.strategy ddp or fsdp2")
            self.opt.load_state_dict(st["optimizer"])
            if st.get("scheduler"):
                self.sched.load_state_dict(st["scheduler"])

    def start(self) -> None:
        """Nothing to start: the model and optimizer are here."""

    def update(self, batch: RolloutBatch, a: Advantage, rng, proximal: torch.Tensor | None) -> dict[str, float]:
        ctx, r = self.ctx, self.ctx.recipe
        mask = batch.completion_mask.float()
        with ctx.amp():
            return update_mod.policy_update(
                self.model, self.opt, self.sched, batch, a.adv, mask, a.token_w, a.routed, ctx.cfg,
                r.rollout.temperature, rng, r.train.logprob_impl, r.train.max_tokens_per_micro_batch,
                packed=r.train.packing, proximal=proximal, is_cap=r.async_.is_cap, is_mode=r.async_.is_mode,
                plan=a.plan, full=a.full)

    def lr(self, upd: dict[str, float]) -> float:
        return self.sched.get_last_lr()[0]

    def checkpoint(self, step: int, tokenizer) -> Path:
        return save_checkpoint(self.ctx.stage_dir, step, self.model, tokenizer, self.opt, self.sched,
                               keep=self.ctx.cfg.keep_checkpoints)

    def close(self) -> None:
        """Nothing to stop."""


class RemoteUpdater:
    """A `PolicyTrainer` updates; `model` (this process's copy: rollout and eval sample from it) follows it."""

    opt = sched = None  # the optimizer lives on the workers

    def __init__(self, ctx: StageContext, model, trainer: PolicyTrainer) -> None:
        if ctx.ckpts and ctx.state.get("optimizer") is not None:
            raise StageStateError(f"{ctx.last_ckpt} was trained in one process (runtime.strategy=single); resume "
                                  f"it with runtime.strategy=single, or restart the stage (move {ctx.stage_dir} away; "
                                  "`mopd recipe --restart`)")
        self.ctx, self.model, self.trainer = ctx, model, trainer

    def start(self) -> None:
        """Load the stage's weights (and a checkpoint's optimizer shards) on the workers; where they ran goes into
        the stage record (node, pid, device, bytes per rank)."""
        ck = self.ctx.last_ckpt
        desc = self.trainer.start(ck / "model" if ck else self.ctx.init_path,
                                  resume=ck / SHARDED_OPTIMIZER if ck else None,
                                  scheduler_state=self.ctx.state.get("scheduler"))
        rec = read_stage(self.ctx.stage_dir) or {}
        rec["distributed"] = desc
        write_stage(self.ctx.stage_dir, rec)

    def update(self, batch: RolloutBatch, a: Advantage, rng, proximal: torch.Tensor | None) -> dict[str, float]:
        upd = self.trainer.update(batch, a.adv, a.token_w, temperature=self.ctx.recipe.rollout.temperature,
                                  seed=rng.getrandbits(31), routed=a.routed)
        with torch.no_grad():  # the Ray hand-over: the workers' weights into the sampling copy
            self.model.load_state_dict(self.trainer.state_dict())
        return upd

    def lr(self, upd: dict[str, float]) -> float:
        return upd["lr"]

    def checkpoint(self, step: int, tokenizer) -> Path:
        """The driver writes model/ whole; the workers write their optimizer shards inside the same atomic rename,
        the scheduler state goes into the loop's record."""
        def sharded(tmp: Path) -> dict:
            return {"scheduler": self.trainer.save(tmp / SHARDED_OPTIMIZER)["scheduler"]}
        return save_checkpoint(self.ctx.stage_dir, step, self.model, tokenizer, None, None,
                               keep=self.ctx.cfg.keep_checkpoints, sharded=sharded)

    def close(self) -> None:
        self.trainer.close()
