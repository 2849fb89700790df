"""Checkpoints of a training stage: `save_pretrained` weights + tokenizer, plus optimizer/scheduler/RNG/step
state, written to a temp dir and renamed so a crash mid-write never corrupts the last good checkpoint. The stage
folder's layout, its `stage.json` record, the stage-done test and the checkpoint names are `stages.folder`'s.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch

from ..errors import StageStateError  # noqa: F401 - checkpoint.StageStateError stays the public name
from ..models import save_pretrained, writing
from ..models.lora import ADAPTER_DIR, has_lora, save_adapter
# the stage folder's record and checkpoint names, where the loop, SFT and the tests have always found them
from ..stages.folder import (MODEL_IDENTITY, checkpoint_dirs, checkpoint_step, claim_stage, finished,  # noqa: F401
                             last_checkpoint_step, model_identity, read_stage, stage_done, trainer_checkpoints,
                             write_json, write_stage)


def save_checkpoint(stage_dir: Path, step: int, model, tokenizer, optimizer, scheduler, extra: dict | None = None,
                    keep: int = 2, sharded=None) -> Path:
    """Write `checkpoints/step-N` whole into a temp dir, then rename it into place: a crash or a full disk
    (`DiskFullError`) leaves only the temp dir, removed, and every earlier checkpoint and final/ untouched. The
    oldest checkpoints beyond `keep` are deleted only after the new one is complete. `sharded(tmp_dir) -> dict`:
    the optimizer lives on workers (`optimizer` is None) — they write their shards into the temp dir, and the
    dict it returns (the scheduler's state) goes into `loop_state.pt`. A model with LoRA adapters writes only them
    (`adapter/`, PEFT's format; the optimizer state is the adapters' too): the frozen base is the stage's input."""
    root = Path(stage_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
    with writing(tmp, f"checkpoint {final}"):
        if has_lora(model):
            save_adapter(model, tmp / ADAPTER_DIR)
        else:
            save_pretrained(model, tokenizer, tmp / "model")
        remote = sharded(tmp) if sharded is not None else {}
        torch.save({"step": step, "optimizer": optimizer.state_dict() if optimizer is not None else None,
                    "scheduler": scheduler.state_dict() if scheduler is not None else remote.get("scheduler"),
                    "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "extra": extra or {}},
                   tmp / "loop_state.pt")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in checkpoint_dirs(stage_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_loop_state(ckpt: Path) -> dict[str, Any]:
    """The loop's optimizer/scheduler/step state of a checkpoint, or one line naming the file and how to resume
    from the checkpoint before it (a file cut short by a full disk or a kill mid-copy)."""
    p = Path(ckpt) / "loop_state.pt"
    try:
        st = torch.load(p, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises RuntimeError/EOFError/UnpicklingError/… for a damaged file
        raise StageStateError(f"{p}: unreadable ({e.__class__.__name__}: {' '.join(str(e).split())[:160]}) — "
                              f"delete {Path(ckpt)} to resume from the checkpoint before it (or from the start)"
                              ) from None
    if not isinstance(st, dict) or "step" not in st:
        raise StageStateError(f"{p}: not a loop state (no 'step') — delete {Path(ckpt)} to resume from the "
                              "checkpoint before it")
    return st
