"""What every role of one stage reads: the stage's settings, where it writes, its device, and where it resumes."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Mapping

import torch

from ...config import PolicyLoopConfig, RecipeConfig
from ...runtime import device as devlib
from .. import timeline


@dataclass
class StageContext:
    """One policy stage's fixed facts (built once by `loop.run_policy_loop`, read by the roles)."""

    stage: str
    cfg: PolicyLoopConfig
    recipe: RecipeConfig
    stage_dir: Path
    init_path: Path | str
    domains: Mapping[str, Any]
    eval_domains: Mapping[str, Any]
    mix: list[float]                         # the domains' sampling weights
    tokenizer: Any
    dinfo: Any                               # runtime.device.DeviceInfo
    teachers: Any = None                     # a TeacherRouter (None: expert RL)
    start: int = 0                           # the step resumed from (0: a fresh stage)
    ckpts: list[Path] = field(default_factory=list)
    state: dict = field(default_factory=dict)  # the last checkpoint's loop state (optimizer, scheduler, step)
    recovery_refs: Any = None                # MOPD: SFT and expert accuracies (`roles.recovery.RecoveryRefs`)
    clock: timeline.Clock = field(default_factory=timeline.Clock)

    @property
    def names(self) -> list[str]:
        return list(self.domains)

    @property
    def device(self) -> torch.device:
        return self.dinfo.torch_device

    @property
    def kind(self) -> str:
        return self.dinfo.kind

    @property
    def last_ckpt(self) -> Path | None:
        return self.ckpts[-1] if self.ckpts else None

    @property
    def model_src(self) -> Path | str:
        """Where the trained weights load from: the last checkpoint's model/, else the stage's input. LoRA
        checkpoints hold only the adapter: the frozen base is the stage's input model."""
        return self.ckpts[-1] / "model" if self.ckpts and self.cfg.lora is None else self.init_path

    @property
    def metrics_path(self) -> Path:
        return self.stage_dir / "metrics.jsonl"

    @property
    def timeline_path(self) -> Path:
        return self.stage_dir / "timeline.jsonl"  # when each step's phases ran (train.timeline)

    def amp(self):
        """A fresh autocast context in the compute dtype (float32 master weights whatever runtime.dtype)."""
        return partial(devlib.autocast, self.kind, self.recipe.runtime.dtype)()

    def step_rng(self, step: int) -> random.Random:
        """All randomness of step `step` from (seed, stage, step): a resumed run replays the same steps."""
        return random.Random(f"{self.recipe.seed}/{self.stage}/{step}")
