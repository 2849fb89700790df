"""What every stage task shares: cache keys, the transient-error retry rule, model references, artifacts."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

from mopd_core.stages import StageSpec, finished, model_ref_id, read_stage, stage_spec, write_json

from . import tracking

# config sections logged as each stage's MLflow params (what the stage ran with — its identity is the engine's
# fingerprint, `stage_key`)
STAGE_SECTIONS = {
    "sft": ("model", "data", "sft", "rollout", "eval", "train"),
    "expert": ("data", "rollout", "expert", "eval", "train"),
    "mopd": ("data", "rollout", "teachers", "mopd", "eval", "train"),
    "evaluate": ("data", "rollout", "eval"),
}
SIDECAR = "orchestration.json"  # in a stage folder: the cache key + the task result (MLflow run, registered model)
EVAL_SIDECAR = "evaluate.json"  # the same for the evaluate task, in the run folder


class ParameterError(ValueError):
    """A bad flow parameter; the message starts with the parameter's name."""


class RegressionError(RuntimeError):
    """The nightly student fell behind the champion beyond the tolerance."""


# ---------------------------------------------------------------- model references between tasks
# A reference travels as {"ref": "models:/t-sft/1" | "/abs/checkpoint", "path": "/abs/local/dir" | None}:
# `ref` is what lineage tags and cache keys record, `path` a local copy when one is known.


def local_path(ref: Mapping[str, Any], cache_dir: Path) -> Path:
    p = ref.get("path")
    if p and (Path(p) / "config.json").exists():
        return Path(p)
    return tracking.resolve_model_ref(ref["ref"], cache_dir)[0]


def refs_cache_dir(cfg) -> Path:
    return (cfg.run_dir() / "refs").resolve()


# ---------------------------------------------------------------- one stage identity
# The engine's fingerprint (config that determines the result, seed, input model identities, RESULTS_VERSION) is
# the only identity of a stage. There is no second cache: Prefect's result cache is off for the stage tasks, and
# each task first checks the stage folder's sidecar — its key (`stage_key`: fingerprint + target steps + run
# folder) and the MLflow run and model version it recorded. While the folder holds that finished stage and the
# tracking store still has its run, the task ends `Cached` with the recorded result. Otherwise the task runs and
# the engine reuses (brings back, continues) the stage by its fingerprint — a deleted folder, a folder set aside
# by another config or a fresh MLflow store never yields a stale result; nothing here deletes a stage folder
# except an explicit `refresh`.


def input_identities(inputs: Mapping[str, Mapping[str, Any]], cfg) -> dict[str, str]:
    return {k: ref_identity(v, cfg) for k, v in sorted(inputs.items())}


def ref_identity(ref: Mapping[str, Any], cfg=None) -> str:
    """The engine's identity of an input model (`model_ref_id` of its local copy; a registry reference without
    one is resolved — downloaded once into the run's refs cache — since its identity file travels with it)."""
    p = ref.get("path")
    if p and Path(p).exists():
        return model_ref_id(p)
    if tracking.is_model_uri(ref["ref"]):
        if cfg is None:
            return ref["ref"]
        return model_ref_id(local_path(ref, refs_cache_dir(cfg)))
    return model_ref_id(ref["ref"])


def spec_of(stage: str, cfg, inputs: Mapping[str, Mapping[str, Any]]) -> StageSpec:
    """The engine's spec of `stage` (a stage string) with these input references."""
    return stage_spec(cfg, stage, input_identities(inputs, cfg))


def stage_key(spec: StageSpec, cfg) -> str:
    """(stage, engine fingerprint, target steps, run folder) of `spec`: what the stage's result is and where it
    lies."""
    blob = {"stage": spec.stage, "fingerprint": spec.fingerprint, "steps": spec.steps,
            "run_dir": str(cfg.run_dir().resolve())}
    return f"mopd-{spec.stage.replace(':', '-')}-" + hashlib.sha256(
        json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:24]


def sidecar_path(spec: StageSpec) -> Path:
    return spec.stage_dir / (EVAL_SIDECAR if spec.kind == "evaluate" else SIDECAR)


def read_sidecar(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_sidecar(path: Path, key: str, result: Mapping[str, Any]) -> None:
    write_json(Path(path), {"key": key, **result})


def tracked_result(spec: StageSpec, key: str) -> dict | None:
    """The recorded result of this stage when it is still true: the sidecar has this key, the stage folder (in
    place, not set aside) is the finished stage of `spec`, and the MLflow run and registered model it names
    exist in the current tracking store. None otherwise (the task must run)."""
    side = read_sidecar(sidecar_path(spec))
    if not side or side.get("key") != key:
        return None
    if spec.kind != "evaluate":
        where = Path(side.get("stage_dir", ""))
        if not finished(read_stage(where), spec.fingerprint, spec.steps, where):
            return None
    if not Path(side.get("path") or side.get("dir") or "").exists():
        return None
    if not run_exists(side.get("run_id")):
        return None
    ref = side.get("ref")
    if ref and tracking.is_model_uri(ref) and not model_exists(ref, side.get("run_id")):
        return None
    return side


def run_exists(run_id: str | None) -> bool:
    """Whether the tracking store has this run (a reset or new store does not)."""
    if not run_id:
        return False
    try:
        tracking.client().get_run(run_id)
        return True
    except Exception as e:  # noqa: BLE001 - MLflow raises MlflowException(RESOURCE_DOES_NOT_EXIST) and others
        if "RESOURCE_DOES_NOT_EXIST" in str(e) or "not found" in str(e).lower():
            return False
        raise  # the store is unreachable: an infrastructure failure, retried, never "missing"


def model_exists(ref: str, run_id: str | None = None) -> bool:
    """Whether the registry has this version (and it was registered from `run_id`: a reset store may reuse the
    version number for another model)."""
    try:
        mv = tracking.model_version(ref)
    except tracking.ModelRefError:
        return False
    return run_id is None or mv.run_id == run_id


def discard_stage(stage_dir: Path, logger) -> None:
    """`refresh`: the explicit way to discard a stage's folder and retrain it."""
    if stage_dir.exists():
        logger.info("refresh: discarding %s", stage_dir)
        shutil.rmtree(stage_dir)


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


EVAL_ROWS_SHOWN = 200  # per-row results in the Prefect table; all of them are in MLflow's eval_rows.jsonl


def publish_eval_tables(cfg, rep) -> None:
    """The eval stage's benchmark results as Prefect tables: one row per model × benchmark (every metric, %),
    and the first per-completion results of the benchmarks (prompt, completion, extracted answer, reward)."""
    from prefect.artifacts import create_table_artifact

    if not rep.benchmarks:
        return
    create_table_artifact(table=rep.benchmarks, key=artifact_key(cfg.name, "benchmarks"),
                          description="eval_sources benchmarks, every metric (%)")
    rows = [r for r in rep.rows if not str(r.get("benchmark", "")).startswith("heldout:")]
    shown = [{"model": r["model"], "benchmark": r["benchmark"], "row": r["row"], "sample": r["sample"],
              "prompt": _short(r["prompt"]), "completion": _short(r["completion"]),
              "extracted": _short(r.get("extracted")), "reward": r["reward"], "truncated": r["truncated"]}
             for r in rows[:EVAL_ROWS_SHOWN]]
    create_table_artifact(table=shown, key=artifact_key(cfg.name, "eval-rows"),
                          description=f"per-completion results ({len(shown)} of {len(rows)}; all in the MLflow "
                          "evaluate run's eval_rows.jsonl)")


def _short(v, n: int = 160) -> str:
    """A prompt (string, or chat messages: the last user turn — `models.chat.preview`) or text, cut to `n`."""
    from mopd_core.models.chat import preview

    if v is None:
        return ""
    v = preview(v, n + 1)
    return v if len(v) <= n else v[:n - 1] + "…"


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
    """A single stage started on its own writes under `<output_dir>/<name>/stages/<fingerprint>/`, so a run with
    other parameters or inputs never collides with the full recipe's stage folders, the same one is reused, and
    raising `steps` continues it (steps are no part of the fingerprint). Registry inputs are identified by their
    reference here (nothing is downloaded while composing the flow)."""
    ids = {k: (v["ref"] if tracking.is_model_uri(v["ref"]) else ref_identity(v)) for k, v in sorted(inputs.items())}
    if stage == "serve_teachers":
        fp = hashlib.sha256(json.dumps(ids, sort_keys=True).encode()).hexdigest()[:16]
    else:
        fp = stage_spec(cfg, stage, ids).fingerprint
    return cfg.model_copy(update={"output_dir": str(Path(cfg.output_dir) / cfg.name / "stages" / fp[:12])})


def experts_concurrently(cfg, requested: bool | None) -> bool:
    """Whether the expert stages run at the same time (threads of the flow-run process). `None` = auto: yes on
    an accelerator; on CPU only when each expert is pinned to one thread and there is a core for each — torch's
    OpenMP threads spin-wait under contention and concurrent multi-threaded experts run many times slower."""
    import os

    if requested is not None:
        return requested
    if cfg.runtime.strategy != "single":  # each expert's update already spans runtime.num_workers devices
        return False
    from mopd_core.runtime import device as devlib

    try:
        kind = devlib.resolve(cfg.runtime.device).kind
    except Exception:  # noqa: BLE001 - the stage itself reports a bad device
        return False
    if kind != "cpu":
        return True
    n = len(cfg.expert_domains())
    return cfg.runtime.num_threads == 1 and (os.cpu_count() or 1) >= n
