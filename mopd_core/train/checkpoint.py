"""Checkpoints of a training stage: `save_pretrained` weights + tokenizer, plus optimizer/scheduler/RNG/step
state, written to a temp dir and renamed so a crash mid-write never corrupts the last good checkpoint.

Stage folder layout::

    <stage>/stage.json            fingerprint of the stage's config + inputs, status (running/done), results
    <stage>/checkpoints/step-N/   model (with tokenizer) or, for a LoRA stage, adapter; loop_state.pt
    <stage>/final/                the finished model (what later stages consume)
    <stage>/metrics.jsonl         one JSON object per step
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from ..config import RESULTS_VERSION
from ..errors import StageStateError  # noqa: F401 - checkpoint.StageStateError stays the public name
from ..models import save_pretrained, writing
from ..models.lora import ADAPTER_DIR, has_lora, save_adapter

log = logging.getLogger("mopd")


def read_stage(stage_dir: Path) -> dict | None:
    p = Path(stage_dir) / "stage.json"
    return json.loads(p.read_text()) if p.exists() else None


# Written into a finished stage's final/ model dir: the model's identity travels with it (copied, moved, logged
# to MLflow and downloaded again), so a consumer's fingerprint is the same wherever the model lies.
MODEL_IDENTITY = "mopd_identity.json"


def write_stage(stage_dir: Path, info: dict) -> None:
    stage_dir = Path(stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    info.setdefault("results_version", RESULTS_VERSION)
    if info.get("status") == "done" and (stage_dir / "final").is_dir():
        write_json(stage_dir / "final" / MODEL_IDENTITY, {
            "stage": info.get("stage"), "fingerprint": info.get("fingerprint"), "steps": info.get("steps"),
            "results_version": info.get("results_version")})
    write_json(stage_dir / "stage.json", info)


def write_json(path: Path, obj: dict) -> None:
    """Write JSON atomically (temp file + rename): a crash never leaves half a record."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    tmp.replace(path)


def model_identity(model_dir: Path) -> dict | None:
    """The identity record of a model a stage produced (its final/ dir or a copy of it), or None."""
    p = Path(model_dir) / MODEL_IDENTITY
    if p.exists():
        return json.loads(p.read_text())
    info = read_stage(Path(model_dir).parent) if Path(model_dir).name == "final" else None  # older folders
    return {"fingerprint": info["fingerprint"], "steps": info.get("steps")} if info else None


def claim_stage(stage_dir: Path, fingerprint: str, meta: dict | None = None) -> dict | None:
    """Make `stage_dir` the folder of the stage with `fingerprint`; returns its record when it already holds that
    stage (to resume or reuse). A folder written under another fingerprint (the config or an upstream model
    changed) is never overwritten: it is set aside as `<stage>@<its fingerprint>`, and a folder set aside earlier
    under the requested fingerprint is brought back — switching configs back and forth retrains nothing."""
    stage_dir = Path(stage_dir)
    info = read_stage(stage_dir)
    if info is not None and info.get("fingerprint") != fingerprint:
        aside = stage_dir.with_name(f"{stage_dir.name}@{info.get('fingerprint')}")
        if aside.exists():  # an older copy of that same config: the current folder is at least as far along
            shutil.rmtree(aside)
        stage_dir.rename(aside)
        log.warning("%s was written under another config; kept as %s, this run starts its own", stage_dir, aside)
        info = None
    if info is None:
        back = stage_dir.with_name(f"{stage_dir.name}@{fingerprint}")
        if back.exists() and not stage_dir.exists():
            back.rename(stage_dir)
            log.info("%s: reusing the folder set aside for this config", stage_dir)
            return read_stage(stage_dir)
    if info is None:
        write_stage(stage_dir, {"fingerprint": fingerprint, "status": "running", **(meta or {})})
    return info


def stage_done(stage_dir: Path, fingerprint: str, steps: int | None = None) -> dict | None:
    """The record of a finished stage with `fingerprint` (and `steps`, when given) in `stage_dir` or in the folder
    set aside for that fingerprint (`<stage>@<fingerprint>`, which `claim_stage` brings back); None otherwise.
    Reads only: lets a caller skip expensive set-up (teacher servers) for a stage that would be reused."""
    stage_dir = Path(stage_dir)
    for d in (stage_dir, stage_dir.with_name(f"{stage_dir.name}@{fingerprint}")):
        info = read_stage(d)
        if (info and info.get("fingerprint") == fingerprint and info.get("status") == "done"
                and (steps is None or info.get("steps") == steps) and (d / "final").exists()):
            return info
    return None


def checkpoint_dirs(stage_dir: Path) -> list[Path]:
    root = Path(stage_dir) / "checkpoints"
    if not root.exists():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir() and d.name.startswith("step-") and
            (d / "loop_state.pt").exists()]
    return sorted(dirs, key=checkpoint_step)


def checkpoint_step(ckpt: str | Path) -> int:
    """The step a checkpoint folder holds, from its name: the loop's `step-000012`, TRL's `checkpoint-12`."""
    return int(Path(ckpt).name.split("-")[1])


def trainer_checkpoints(stage_dir: str | Path) -> list[Path]:
    """TRL's checkpoints of an SFT stage (`<stage>/trainer/checkpoint-N`), oldest first (by step, not name)."""
    root = Path(stage_dir) / "trainer"
    return sorted(root.glob("checkpoint-*"), key=checkpoint_step) if root.exists() else []


def last_checkpoint_step(stage_dir: str | Path) -> int:
    """The step of a stage's newest checkpoint (the loop's, else TRL's); 0 when it has none."""
    ck = checkpoint_dirs(stage_dir) or trainer_checkpoints(stage_dir)
    return checkpoint_step(ck[-1]) if ck else 0


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
    return torch.load(Path(ckpt) / "loop_state.pt", map_location="cpu", weights_only=False)
