"""A stage's folder and its record — the one place that says whether a stage is finished, sets a folder written
under another fingerprint aside and brings it back, and decides where an interrupted stage resumes.

Stage folder layout::

    <stage>/stage.json            fingerprint of the stage's config + inputs, status (running/done), results
    <stage>/checkpoints/step-N/   the policy loop's checkpoints (model or LoRA adapter; loop_state.pt)
    <stage>/trainer/checkpoint-N/ SFT's checkpoints (TRL's own)
    <stage>/final/                the finished model (what later stages consume), with its identity file
    <stage>/metrics.jsonl         one JSON object per step

A folder written under another fingerprint is never overwritten: it is set aside as `<stage>@<fingerprint>`
beside it and brought back when that fingerprint is asked for again.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from ..config import RESULTS_VERSION

from ..errors import StageStateError

log = logging.getLogger("mopd")

# Written into a finished stage's final/ model dir: the model's identity travels with it (copied, moved, logged
# to MLflow and downloaded again), so a consumer's fingerprint is the same wherever the model lies.
MODEL_IDENTITY = "mopd_identity.json"


def read_json_record(p: Path, recover: str) -> dict:
    """A JSON state file of ours, or one line naming it and how to recover (`recover`): a file cut short by a
    full disk, edited by hand or written by something else must not end a resume in a decoder traceback."""
    try:
        obj = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StageStateError(f"{p}: unreadable ({e.__class__.__name__}: {e}) — {recover}") from None
    if not isinstance(obj, dict):
        raise StageStateError(f"{p}: not a JSON object (got {type(obj).__name__}) — {recover}")
    return obj


def read_metrics(path: Path) -> list[dict]:
    """The rows of a stage's metrics.jsonl. A last line cut short (a kill or full disk mid-write) is dropped: it
    is past the last checkpoint, which a resume cuts back to anyway. A bad line before it is one error naming
    the file and line."""
    if not Path(path).exists():
        return []
    lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    rows = []
    for i, ln in enumerate(lines):
        try:
            row = json.loads(ln)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                log.warning("%s: last line cut short (%r…) — dropped", path, ln[:40])
                break
            row = None
        if not isinstance(row, dict):
            raise StageStateError(f"{path}: line {i + 1} is not a JSON object of step metrics — delete that line "
                                  "(or the file, losing the curve but not the weights) and run again")
        rows.append(row)
    return rows


def read_stage(stage_dir: Path) -> dict | None:
    p = Path(stage_dir) / "stage.json"
    if not p.exists():
        return None
    info = read_json_record(p, f"move {Path(stage_dir)} away (or delete it) and run the stage again")
    if not isinstance(info.get("fingerprint", ""), str):
        raise StageStateError(f"{p}: 'fingerprint' is not a string — move {Path(stage_dir)} away and run the "
                              "stage again")
    return info


def write_json(path: Path, obj: dict) -> None:
    """Write JSON atomically (temp file + rename): a crash never leaves half a record."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    tmp.replace(path)


def write_stage(stage_dir: Path, info: dict) -> None:
    stage_dir = Path(stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    info.setdefault("results_version", RESULTS_VERSION)
    if info.get("status") == "done" and (stage_dir / "final").is_dir():
        write_json(stage_dir / "final" / MODEL_IDENTITY, {
            "stage": info.get("stage"), "fingerprint": info.get("fingerprint"), "steps": info.get("steps"),
            "results_version": info.get("results_version")})
    write_json(stage_dir / "stage.json", info)


def output_identity(fingerprint: str, steps: int | None) -> str:
    """The identity of the model a stage produced, as consumers' fingerprints take it (`model_ref_id`)."""
    return f"stage:{fingerprint}:{steps}"


def model_identity(model_dir: Path) -> dict | None:
    """The identity record of a model a stage produced (its final/ dir or a copy of it), or None."""
    p = Path(model_dir) / MODEL_IDENTITY
    if p.exists():
        return read_json_record(p, f"delete it to identify {Path(model_dir)} by its weights, or copy the model "
                                   "again from its stage's final/")
    info = read_stage(Path(model_dir).parent) if Path(model_dir).name == "final" else None  # older folders
    return {"fingerprint": info["fingerprint"], "steps": info.get("steps")} if info else None


def aside_dir(stage_dir: Path, fingerprint: str) -> Path:
    """Where a folder written under `fingerprint` is kept while another config uses `stage_dir`."""
    return Path(stage_dir).with_name(f"{Path(stage_dir).name}@{fingerprint}")


def finished(info: dict | None, fingerprint: str, steps: int | None, stage_dir: Path) -> bool:
    """The stage-done test: `info` (the record of `stage_dir`) is this stage — `fingerprint` — finished with
    `steps` (None: any count) and its final/ model is there."""
    return bool(info and info.get("fingerprint") == fingerprint and info.get("status") == "done"
                and (steps is None or info.get("steps") == steps) and (Path(stage_dir) / "final").is_dir())


def stage_done(stage_dir: Path, fingerprint: str, steps: int | None = None) -> dict | None:
    """The record of a finished stage with `fingerprint` (and `steps`, when given) in `stage_dir` or in the folder
    set aside for that fingerprint (which `claim_stage` brings back); None otherwise. Reads only: lets a caller
    skip expensive set-up (teacher servers) for a stage that would be reused."""
    for d in (Path(stage_dir), aside_dir(stage_dir, fingerprint)):
        info = read_stage(d)
        if finished(info, fingerprint, steps, d):
            return info
    return None


def claim_stage(stage_dir: Path, fingerprint: str, meta: dict | None = None) -> dict | None:
    """Make `stage_dir` the folder of the stage with `fingerprint`; returns its record when it already holds that
    stage (to resume or reuse). A folder written under another fingerprint (the config or an upstream model
    changed) is never overwritten: it is set aside as `<stage>@<its fingerprint>`, and a folder set aside earlier
    under the requested fingerprint is brought back — switching configs back and forth retrains nothing."""
    stage_dir = Path(stage_dir)
    info = read_stage(stage_dir)
    if info is not None and info.get("fingerprint") != fingerprint:
        aside = aside_dir(stage_dir, info.get("fingerprint"))
        if aside.exists():  # an older copy of that same config: the current folder is at least as far along
            shutil.rmtree(aside)
        stage_dir.rename(aside)
        log.warning("%s was written under another config; kept as %s, this run starts its own", stage_dir, aside)
        info = None
    if info is None:
        back = aside_dir(stage_dir, fingerprint)
        if back.exists() and not stage_dir.exists():
            back.rename(stage_dir)
            log.info("%s: reusing the folder set aside for this config", stage_dir)
            return read_stage(stage_dir)
    if info is None:
        write_stage(stage_dir, {"fingerprint": fingerprint, "status": "running", **(meta or {})})
    return info


# ---------------------------------------------------------------- checkpoint names and the resume decision


def checkpoint_step(ckpt: str | Path) -> int:
    """The step a checkpoint folder holds, from its name: the loop's `step-000012`, TRL's `checkpoint-12`."""
    return int(Path(ckpt).name.split("-")[1])


def checkpoint_dirs(stage_dir: Path) -> list[Path]:
    """The policy loop's complete checkpoints of a stage, oldest first."""
    root = Path(stage_dir) / "checkpoints"
    if not root.exists():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir() and d.name.startswith("step-") and
            (d / "loop_state.pt").exists()]
    return sorted(dirs, key=checkpoint_step)


def trainer_checkpoints(stage_dir: str | Path) -> list[Path]:
    """TRL's checkpoints of an SFT stage (`<stage>/trainer/checkpoint-N`), oldest first (by step, not name)."""
    root = Path(stage_dir) / "trainer"
    return sorted(root.glob("checkpoint-*"), key=checkpoint_step) if root.exists() else []


def last_checkpoint_step(stage_dir: str | Path) -> int:
    """The step of a stage's newest checkpoint (the loop's, else TRL's); 0 when it has none."""
    ck = checkpoint_dirs(stage_dir) or trainer_checkpoints(stage_dir)
    return checkpoint_step(ck[-1]) if ck else 0


def resume_step(stage_dir: Path, fingerprint: str, steps: int | None) -> int:
    """The step the engine will resume this stage from: 0 when it starts afresh (no folder, or one of another
    fingerprint, which is set aside) or is finished at `steps` (reused); else its newest checkpoint's step."""
    info = read_stage(stage_dir)
    if not info or info.get("fingerprint") != fingerprint or finished(info, fingerprint, steps, stage_dir):
        return 0
    return last_checkpoint_step(stage_dir)
