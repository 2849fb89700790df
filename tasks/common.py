"""What every stage task shares: cache keys, the transient-error retry rule, model references, artifacts."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

from . import tracking

# config sections that determine each stage's result (the engine's fingerprints use the same ones)
STAGE_SECTIONS = {
    "sft": ("model", "data", "sft", "rollout", "eval"),
    "expert": ("data", "rollout", "expert", "eval"),
    "serve_teachers": ("teachers",),
    "mopd": ("data", "rollout", "teachers", "mopd", "eval"),
    "evaluate": ("data", "rollout", "eval"),
}
SIDECAR = "orchestration.json"


class ParameterError(ValueError):
    """A bad flow parameter; the message starts with the parameter's name."""


class RegressionError(RuntimeError):
    """The nightly student fell behind the champion beyond the tolerance."""


# ---------------------------------------------------------------- model references between tasks
# A reference travels as {"ref": "models:/t-sft/1" | "/abs/checkpoint", "path": "/abs/local/dir" | None}:
# `ref` is what lineage tags and cache keys record, `path` a local copy when one is known.


def ref_identity(ref: Mapping[str, Any]) -> str:
    from mopd_core.recipe import model_ref_id

    if tracking.is_model_uri(ref["ref"]):
        return ref["ref"]
    return model_ref_id(ref.get("path") or ref["ref"])


def local_path(ref: Mapping[str, Any], cache_dir: Path) -> Path:
    p = ref.get("path")
    if p and (Path(p) / "config.json").exists():
        return Path(p)
    return tracking.resolve_model_ref(ref["ref"], cache_dir)[0]


def refs_cache_dir(cfg) -> Path:
    return (cfg.run_dir() / "refs").resolve()


# ---------------------------------------------------------------- cache keys


def stage_key(stage: str, cfg, inputs: Mapping[str, Mapping[str, Any]], extra: Any = None) -> str:
    """(stage, its config sections, seed, dtype, output location, input model identities, code version)."""
    dump = cfg.model_dump(mode="json")
    blob = {
        "stage": stage, "extra": extra, "seed": cfg.seed, "dtype": cfg.runtime.dtype,
        "run_dir": str(cfg.run_dir().resolve()),
        "sections": {s: dump[s] for s in STAGE_SECTIONS[stage.split(":")[0]]},
        "inputs": {k: ref_identity(v) for k, v in sorted(inputs.items())},
        "code": tracking.code_version(),
    }
    return f"mopd-{stage.replace(':', '-')}-" + hashlib.sha256(
        json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:24]


def cache_key_fn(context, parameters: Mapping[str, Any]) -> str:
    """Prefect cache key of a stage task: its parameters `stage`, `cfg`, `inputs` (not the MLflow parent)."""
    return stage_key(parameters["stage"], parameters["cfg"], parameters.get("inputs") or {},
                     parameters.get("extra"))


def prepare_stage_dir(stage_dir: Path, key: str, refresh: bool, logger) -> None:
    """Before a stage runs: `refresh` discards its folder; a finished folder made by another cache key (other
    inputs or code) is discarded too, so the engine does not reuse it under a new identity. An interrupted one
    (status running) is left for the engine to resume."""
    from mopd_core.train.checkpoint import read_stage

    if not stage_dir.exists():
        return
    if refresh:
        logger.info("refresh: discarding %s", stage_dir)
        shutil.rmtree(stage_dir)
        return
    info = read_stage(stage_dir) or {}
    side = stage_dir / SIDECAR
    if info.get("status") == "done" and side.exists() and json.loads(side.read_text()).get("key") != key:
        logger.info("%s was produced from other inputs or code; retraining", stage_dir)
        shutil.rmtree(stage_dir)


def write_sidecar(stage_dir: Path, key: str, result: Mapping[str, Any]) -> None:
    (stage_dir / SIDECAR).write_text(json.dumps({"key": key, **result}, indent=2, default=str))


# ---------------------------------------------------------------- retries


_TRANSIENT_TEXT = ("database is locked", "connection refused", "connection reset", "temporarily unavailable",
                   "timed out", "503", "502", "504", "too many requests")


# a Ray worker/node lost; httpx's transport failures (connection refused/reset, timeouts) — matched by name so
# that neither library is imported here
_RAY_LOST = {"RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError", "NodeDiedError",
             "ObjectLostError", "OwnerDiedError", "LocalRayletDiedError", "RaySystemError", "GetTimeoutError"}
# OSErrors that a retry cannot fix: a path, a permission, a full or read-only disk
_PERMANENT_ERRNO = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.EEXIST,
                    errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENAMETOOLONG}


def is_transient(exc: BaseException | None) -> bool:
    """Retried: `InfraError` (a teacher server gone after its restarts, a lost worker, the tracking store down)
    and connection/timeout failures. Never retried: `MopdError` (the user's input — config, data, models,
    teachers, a full disk, diverged training), flow-parameter and regression errors, and bugs."""
    from mopd_core.errors import InfraError, MopdError

    if exc is None:
        return False
    if isinstance(exc, (MopdError, ParameterError, RegressionError)):
        return False
    if isinstance(exc, (InfraError, ConnectionError, TimeoutError)):
        return True
    mro = type(exc).__mro__
    if any(c.__name__ == "TransportError" and c.__module__.startswith("httpx") for c in mro):
        return True
    if any(c.__name__ in _RAY_LOST and c.__module__.startswith("ray") for c in mro):
        return True
    if isinstance(exc, OSError):
        return exc.errno not in _PERMANENT_ERRNO and not isinstance(
            exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError))
    text = str(exc).lower()
    return type(exc).__name__ in ("MlflowException", "RestException", "OperationalError") and any(
        t in text for t in _TRANSIENT_TEXT)


def retry_transient(task, task_run, state) -> bool:
    try:
        exc = state.result(raise_on_failure=False)
    except BaseException as e:  # noqa: BLE001 - the state's exception is what we want
        exc = e
    return is_transient(exc if isinstance(exc, BaseException) else None)


# ---------------------------------------------------------------- Prefect artifacts


def artifact_key(*parts: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")[:100]


def metrics_summary(rows: list[dict], max_keys: int = 40) -> str:
    """Markdown table of the first and last value of each step metric."""
    if not rows:
        return "_no step metrics_"
    keys = [k for k in rows[-1] if k != "step" and isinstance(rows[-1][k], (int, float))][:max_keys]
    first = rows[0]
    lines = [f"| metric | step {first.get('step', 0)} | step {rows[-1].get('step', len(rows))} |",
             "|---|---:|---:|"]
    for k in keys:
        a = first.get(k)
        lines.append(f"| {k} | {_fmt(a)} | {_fmt(rows[-1][k])} |")
    return "\n".join(lines)


def _fmt(v) -> str:
    return "–" if not isinstance(v, (int, float)) else f"{v:.4g}"


def eval_table(ev: Mapping[str, Mapping[str, float]]) -> str:
    if not ev:
        return "_no eval_"
    metrics = sorted({m for r in ev.values() for m in r})
    lines = ["| domain | " + " | ".join(metrics) + " |", "|---|" + "---:|" * len(metrics)]
    for d, r in ev.items():
        lines.append(f"| {d} | " + " | ".join(f"{100 * r[m]:.1f}" if m in r else "–" for m in metrics) + " |")
    return "\n".join(lines)


def publish_stage(stage: str, recipe_name: str, summary_md: str, run_link: str | None) -> None:
    from prefect.artifacts import create_link_artifact, create_markdown_artifact

    key = artifact_key(recipe_name, stage)
    create_markdown_artifact(markdown=summary_md, key=key, description=f"{stage} summary")
    if run_link:
        if run_link.startswith("http"):
            create_link_artifact(link=run_link, link_text=f"MLflow run of {stage}", key=key + "-mlflow",
                                 description=f"MLflow run of {stage}")
        else:
            create_markdown_artifact(markdown=f"MLflow run: `{run_link}`", key=key + "-mlflow",
                                     description=f"MLflow run of {stage}")


def adhoc_config(cfg, stage: str, inputs: Mapping[str, Mapping[str, Any]]):
    """A single stage started on its own writes under `<output_dir>/<name>/stages/<key>/`, so a run with other
    parameters or inputs never collides with the full recipe's stage folders (and the same one is reused)."""
    key = stage_key(stage, cfg, inputs)
    return cfg.model_copy(update={"output_dir": str(Path(cfg.output_dir) / cfg.name / "stages" / key[-12:])})


def experts_concurrently(cfg, requested: bool | None) -> bool:
    """Whether the expert stages run at the same time (threads of the flow-run process). `None` = auto: yes on
    an accelerator; on CPU only when each expert is pinned to one thread and there is a core for each — torch's
    OpenMP threads spin-wait under contention and concurrent multi-threaded experts run many times slower."""
    import os

    if requested is not None:
        return requested
    from mopd_core.runtime import device as devlib

    try:
        kind = devlib.resolve(cfg.runtime.device).kind
    except Exception:  # noqa: BLE001 - the stage itself reports a bad device
        return False
    if kind != "cpu":
        return True
    n = len(cfg.expert_domains())
    return cfg.runtime.num_threads == 1 and (os.cpu_count() or 1) >= n
