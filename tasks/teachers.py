"""The `serve_teachers` stage as Prefect tasks: start the teacher servers (through `mopd_core.teachers.lifecycle`),
hand them to the mopd task, keep them serving, stop them.

Teacher modes (`teachers.backend` / `teachers.endpoints`):
- `colocated` (`backend: local`): nothing is served; the mopd stage loads the experts in-process. The task checks
  the tokenizers only.
- `served` (`backend: http`, no endpoints): one vLLM server per expert, started and pre-flighted by
  `serve_teachers_task`, stopped by `stop_teachers` in the flow's `finally` (also when the flow fails).
- `external` (`backend: http` + `teachers.endpoints`): servers someone else runs; pre-flighted, never started or
  stopped here.

The started `mopd_core.serving.VllmServers` stays in this process (tasks are threads of the flow-run process),
registered by its manifest path (`serving.live`): the mopd task looks it up by the path it is given and trains
against the supervisor, so a dead server is restarted. The manifest path is a plain task argument outside the mopd
cache key — the student's identity stays its model references, never ports, URLs or pids.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Mapping

from prefect import get_run_logger, task

from mopd_core.serving import live as live_teachers  # the one registry of live servers, by manifest path

from . import tracking
from .common import local_path, publish_stage, refs_cache_dir
from .context import RETRY, prefect_tags

def servers_dir(cfg, rnd: int = 1) -> Path:
    """Where the recipe run's served teachers (of round `rnd`) keep logs, manifest, HOME and caches."""
    from mopd_core.recipe import round_dir

    return (round_dir(cfg, rnd) / "serve-teachers").resolve()


def _student_reused(cfg, student: Mapping[str, Any], refs: Mapping[str, Mapping[str, Any]], student_path: Path,
                    teacher_paths: Mapping[str, Path], refresh: bool, rnd: int = 1) -> str | None:
    """Why the mopd task will need no teacher (it reuses a finished stage), or None when it will train. Mirrors
    the mopd task: `refresh` discards the folder, else the engine's fingerprint check decides (the one stage
    identity). A wrong "reused" costs nothing but time: the mopd stage then starts its own servers."""
    from mopd_core import recipe as R

    if cfg.mopd.w_kd <= 0:
        return "mopd.w_kd = 0: the student trains on rewards only, without teachers"
    if refresh:
        return None
    info = R.mopd_stage_done(cfg, student_path, dict(teacher_paths), rnd=rnd)
    if info is None:
        return None
    stage_dir = R.stage_dir(cfg, R.round_stage("mopd", rnd))
    return (f"the student stage is already finished in {stage_dir} ({info.get('steps')} steps, fingerprint "
            f"{info.get('fingerprint')}): the mopd task reuses it")


def _log_server_files(run_id: str, manifest_path: str | None, manifest: Mapping[str, Mapping[str, Any]]) -> None:
    if manifest_path and Path(manifest_path).exists():
        tracking.log_artifact(run_id, manifest_path, "teachers")
    for entry in manifest.values():
        log = entry.get("log")
        if log and Path(log).exists():
            tracking.log_artifact(run_id, log, "teachers/logs")


def _manifest_md(mode: str, manifest: Mapping[str, Mapping[str, Any]], note: str) -> str:
    lines = [f"# serve-teachers\n\nmode: **{mode}**  \n{note}\n"]
    if manifest:
        lines += ["| teacher | url | model | max_model_len | pid | restarts |", "|---|---|---|---:|---:|---:|"]
        for t, e in sorted(manifest.items()):
            lines.append(f"| {t} | {e.get('url')} | `{e.get('model')}` | {e.get('max_model_len', '–')} | "
                         f"{e.get('pid') or '–'} | {e.get('restarts', 0) if e.get('pid') else '–'} |")
    return "\n".join(lines)


def _log_inputs(run_id: str, cfg, mode: str, out: Mapping[str, Mapping[str, str]], student_fp: str,
                fps: Mapping[str, str]) -> None:
    tc = cfg.teachers
    tracking.log_params(run_id, {"teachers.backend": tc.backend, "teachers.routing": tc.routing,
                                 "teachers.mode": mode, "teachers.server_dtype": tc.server_dtype,
                                 "teachers.max_logprobs": tc.max_logprobs,
                                 "teachers.tensor_parallel_size": tc.tensor_parallel_size,
                                 "teachers.gpu_memory_utilization": tc.gpu_memory_utilization,
                                 "max_model_len": cfg.max_seq_len() + 1,
                                 **{f"input.teacher.{k}": v["ref"] for k, v in out.items()}})
    tracking.set_tags(run_id, {"student_tokenizer": student_fp, **{f"tokenizer.{k}": v for k, v in fps.items()}})


def _log_served(run_id: str, got, t0: float) -> None:
    if got.manifest_path:
        _log_server_files(run_id, got.manifest_path, got.manifest)
        tracking.set_tags(run_id, {"mopd.teachers_started": str(got.servers is not None).lower(),
                                   "mopd.teachers_manifest": got.manifest_path})
        tracking.log_metric_rows(run_id, [{"step": 0, "startup_s": time.perf_counter() - t0,
                                           "teachers": len(got.manifest)}])


def _failed(run_id: str, got, cfg, rnd: int, mode: str) -> None:
    """A failed start-up or check: stop what was started, keep the servers' logs as the evidence."""
    if got is not None and got.servers is not None:
        got.servers.stop()
    try:
        logs = servers_dir(cfg, rnd) / "logs"
        if mode == "served" and logs.exists():
            tracking.log_artifact(run_id, logs, "teachers/logs")
    except Exception:  # noqa: BLE001 - the original error matters more
        pass
    tracking.end_run(run_id, "FAILED")


@task(name="serve_teachers", task_run_name="serve-teachers", **RETRY)
def serve_teachers_task(cfg, teachers: dict, student: dict, parent_run_id: str | None = None,
                        refresh: bool = False, for_mopd: bool = True, stage: str = "mopd") -> dict:
    """Make every teacher reachable for scoring and check it against the student, before any training.

    `served` mode starts one vLLM server per expert (`mopd_core.teachers.lifecycle.provide`: tokenizer
    fingerprints and max-model-len checked before any start-up; health, `/tokenize` probe and length checked
    after), logs the endpoint manifest and every server's log to this task's `serve-teachers` MLflow run and
    publishes a Markdown artifact teacher → url/model/max_model_len/pid. No server starts when the mopd task will
    reuse a finished student stage (`refresh` = the student is retrained: always start). The caller must call
    `stop_teachers(result)` (a flow's `finally`). `for_mopd=False` (the serve-teachers flow): some teachers may
    be served alone, so not every domain needs one. `stage`: the mopd stage they serve ("mopd", or "mopd@r<r>":
    that round's servers keep their files under `<run_dir>/r<r>/serve-teachers`, MLflow run `r<r>-serve-teachers`).

    Returns `{"teachers": {domain: ref}, "manifest": path | None, "mode", "started", "run_id"}`; `teachers`
    feeds the mopd task's inputs (its cache key), `manifest` its `endpoints` argument."""
    from mopd_core.recipe import parse_stage, round_prefix
    from mopd_core.teachers import lifecycle

    logger = get_run_logger()
    mode = lifecycle.teachers_mode(cfg.teachers)
    rnd = parse_stage(stage)[2]
    label = round_prefix(rnd) + "serve-teachers"
    run_id = tracking.start_run(cfg.name, label, parent_run_id,
                                tags={"mopd.stage": label, "mopd.teachers_mode": mode, **prefect_tags()})
    got, link = None, None
    try:
        link = tracking.run_url(run_id)
        cache = refs_cache_dir(cfg)
        student_path = local_path(student, cache)
        paths = {name: local_path(ref, cache) for name, ref in sorted(teachers.items())}
        out = {name: {"ref": ref["ref"], "path": str(paths[name])} for name, ref in sorted(teachers.items())}
        _log_inputs(run_id, cfg, mode, out,
                    *lifecycle.check_tokenizers(student_path, paths, own=cfg.teachers.cross_tokenizer))
        why = (_student_reused(cfg, student, out, student_path, paths, refresh, rnd) if mode != "colocated"
               else None)
        if why:
            tracking.set_tags(run_id, {"mopd.teachers_started": "false", "mopd.teachers_skipped": why[:5000]})
        t0 = time.perf_counter()
        got = lifecycle.provide(cfg, paths, student_path, servers_dir(cfg, rnd), for_mopd=for_mopd, skip=why)
        _log_served(run_id, got, t0)
        tracking.end_run(run_id)
    except BaseException:
        _failed(run_id, got, cfg, rnd, mode)
        raise
    logger.info("teachers (%s): %s — %s", mode, ", ".join(sorted(out)), got.note)
    for t, e in sorted(got.manifest.items()):
        logger.info("teacher %s: %s model=%s max_model_len=%s pid=%s", t, e.get("url"), e.get("model"),
                    e.get("max_model_len"), e.get("pid"))
    publish_stage(label, cfg.name, _manifest_md(mode, got.manifest, got.note), link)
    return {"teachers": out, "manifest": got.manifest_path, "mode": mode, "started": got.servers is not None,
            "run_id": run_id}


def restart_counts(manifest: Mapping[str, Mapping[str, Any]] | None) -> dict[str, int]:
    return {t: int(e.get("restarts") or 0) for t, e in (manifest or {}).items() if isinstance(e, Mapping)}


def record_restarts(run_id: str, manifest: Mapping[str, Mapping[str, Any]] | None) -> dict[str, int]:
    """Total restarts per teacher as tags (`mopd.teacher_restarts` JSON, `mopd.teacher.<t>.restarts`) and
    metrics (`teacher_restarts_total/<t>`) of an MLflow run."""
    counts = restart_counts(manifest)
    if counts:
        tracking.set_tags(run_id, {"mopd.teacher_restarts": json.dumps(counts, sort_keys=True),
                                   **{f"mopd.teacher.{t}.restarts": n for t, n in counts.items()}})
        tracking.log_metric_rows(run_id, [{"step": 0, **{f"teacher_restarts_total/{t}": n
                                                         for t, n in counts.items()}}])
    return counts


def release_teachers(served: Mapping[str, Any] | None, logger=None) -> dict[str, int]:
    """Stop the servers `serve_teachers_task` started for `served` (idempotent). Before stopping: the final
    manifest (restart counts) and every server log go to the serve-teachers MLflow run — a failed upload is
    logged, never keeps a server alive. Returns the restarts per teacher."""
    import logging

    logger = logger or logging.getLogger("mopd")
    servers = live_teachers((served or {}).get("manifest"))
    if servers is None:
        return {}
    counts: dict[str, int] = {}
    try:
        try:
            servers.write_manifest()
            manifest = servers.manifest()
            counts = restart_counts(manifest)
            run_id = served.get("run_id")
            if run_id:
                _log_server_files(run_id, str(servers.manifest_path), manifest)
                record_restarts(run_id, manifest)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not upload the teacher server logs to MLflow: %s", e)
    finally:
        pids = servers.all_pids()
        servers.stop()
        left = [p for p in pids if Path(f"/proc/{p}").exists()]
        logger.info("stopped %d teacher server(s) (pids %s)%s", len(servers.servers), pids,
                    f"; still present: {left}" if left else "")
    return counts


@task(name="stop_teachers", task_run_name="stop-teachers")
def stop_teachers_task(served: dict) -> dict:
    """Upload the servers' logs and final manifest to MLflow, then stop every server (by process group)."""
    return release_teachers(served, get_run_logger())


def stop_teachers(served: Mapping[str, Any] | None) -> None:
    """For a flow's `finally`: the `stop_teachers` task (visible in the UI), falling back to a plain call so the
    servers go whatever happens to the task run. A no-op when nothing was started."""
    if not served or not served.get("started"):
        return
    try:
        stop_teachers_task(dict(served))
    except Exception as e:  # noqa: BLE001 - the servers must go; the flow's own outcome stands
        import logging

        logging.getLogger("mopd").warning("stop_teachers task failed (%s); stopping the servers directly", e)
        release_teachers(served)
    except BaseException:
        release_teachers(served)
        raise


@task(name="keep_teachers", task_run_name="keep-teachers")
def keep_teachers_task(served: dict, seconds: float) -> dict:
    """Keep the started servers serving for `seconds`, restarting a dead one (bounded by teachers.restarts)."""
    from mopd_core.teachers import lifecycle

    servers = live_teachers(served.get("manifest"))
    if servers is None:
        return {}
    logger = get_run_logger()
    logger.info("serving %d teacher(s) for %.0f s: %s", len(servers.servers), seconds,
                ", ".join(f"{t}={e['url']}" for t, e in sorted(servers.manifest().items())))
    return lifecycle.supervise(servers, seconds)
