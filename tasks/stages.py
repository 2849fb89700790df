"""Stage tasks: each wraps one `mopd_core.recipe` stage function with the one stage identity (the engine's
fingerprint: a finished stage whose folder and MLflow run are current ends `Cached`, see tasks/common.py),
retries for transient errors only, an MLflow child run (params, streamed step metrics, plots, registered model
with lineage tags) and Prefect artifacts (summary + MLflow link)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from mopd_core.stages import parse_stage, read_stage, teacher_roles

from . import tracking
from .common import (STAGE_SECTIONS, artifact_key, discard_stage, eval_table, local_path, metrics_summary,
                     publish_eval_tables, publish_stage, refs_cache_dir, sidecar_path, spec_of, stage_key,
                     tracked_result, write_sidecar)
from .context import RETRY, prefect_tags
from .teachers import live_teachers, record_restarts

# No Prefect result cache: the stage folder (the engine's fingerprint) + its sidecar (the MLflow run) are the one
# cache, checked first thing in each task; a reused stage's task run ends in a `Cached` state. Call the tasks
# with `.submit(...).result()` (a direct call would hand back that state object).
CACHED = dict(cache_policy=NO_CACHE, **RETRY)


def cached(result: dict, message: str):
    """The task run's final state for a stage reused as it is: named `Cached` in the UI, `result` as its value."""
    return Completed(name="Cached", data=result, message=message)


def _reuse(spec, key: str, refresh: bool, logger) -> tuple[Any, bool]:
    """(the `Cached` state when the stage's folder and its MLflow run still hold its result, else None; whether
    the folder holds the stage finished — then, without a current run, it is logged and registered again from
    the folder: params, metrics.jsonl, plots, eval, model with lineage tags). `refresh` discards the folder."""
    if refresh:
        discard_stage(spec.stage_dir, logger)
        return None, False
    if spec.done() is None:
        return None, False
    spec.claim()  # brings back a folder set aside for this fingerprint
    side = tracked_result(spec, key)
    if side is None:
        return None, True
    msg = f"{spec.label}: finished stage {spec.stage_dir} and its MLflow run {side['run_id']} are current — reused"
    logger.info(msg)
    return cached({k: v for k, v in side.items() if k != "key"}, msg), True


def _run_stage(*, spec, cfg, inputs: Mapping[str, Mapping[str, Any]], parent_run_id: str | None, refresh: bool,
               registered: str | None, engine: Callable[[dict], Any], sections: tuple[str, ...],
               data_domains: list[str], on_end: Callable[[str, Any], None] | None = None,
               lineage: Mapping[str, Any] | None = None) -> dict:
    """Run the engine's stage of `spec` (`engine(local input paths)`) in an MLflow child run. `on_end(run_id,
    stage_output | None)`: extra tracking before the child run ends (None: the stage failed). `lineage`: extra
    tags of the stage's run and registered model, also logged as params (a later round's `mopd.round` and
    `mopd.parent`, the previous round's student)."""
    from mopd_core.recipe import setup_runtime

    logger, label, stage_dir = get_run_logger(), spec.label, spec.stage_dir
    key = stage_key(spec, cfg)
    reused, retracked = _reuse(spec, key, refresh, logger)
    if reused is not None:
        return reused
    resumed = spec.resume_step()
    if retracked:
        logger.info("%s: already trained in %s (fingerprint %s) — logging it to the tracking store again",
                    label, stage_dir, spec.fingerprint)
    elif resumed:
        logger.info("%s: resuming from the checkpoint of step %d", label, resumed)
    setup_runtime(cfg)
    lineage = dict(lineage or {})
    run_id = tracking.start_run(cfg.name, label, parent_run_id,
                                tags={"mopd.stage": label, "mopd.cache_key": key, "mopd.stage_fingerprint":
                                      spec.fingerprint, "mopd.retracked": str(retracked).lower(),
                                      **lineage, **prefect_tags()})
    link = out = None
    try:
        link = tracking.run_url(run_id)
        logger.info("%s: MLflow run %s", label, link)
        tracking.log_params(run_id, tracking.stage_params(cfg, sections, {k: v["ref"] for k, v in inputs.items()},
                                                          {"resumed_from_step": resumed, "stage": label, **lineage}))
        tracking.log_datasets(run_id, cfg, data_domains)
        local = {k: local_path(v, refs_cache_dir(cfg)) for k, v in inputs.items()}
        tail = tracking.MetricsTail(run_id, stage_dir / "metrics.jsonl")
        t0 = time.perf_counter()
        try:
            out = engine(local)
        finally:
            rows = tail.close()
        wall = time.perf_counter() - t0
        if on_end is not None:
            on_end(run_id, out)
        overlap = _log_outputs(spec, cfg, run_id, out, rows, wall)
        model_uri = _register(spec, cfg, run_id, out, registered, inputs, key, lineage) if registered else None
        tracking.end_run(run_id, "FINISHED")
    except BaseException as e:
        if on_end is not None and out is None:
            try:
                on_end(run_id, None)
            except Exception:  # noqa: BLE001 - the stage's own error is the one to report
                logger.warning("%s: tracking after the failure failed", label, exc_info=True)
        tracking.end_run(run_id, "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    result = {"stage": label, "ref": model_uri or str(Path(out.model_dir).resolve()),
              "path": str(Path(out.model_dir).resolve()), "stage_dir": str(stage_dir.resolve()), "eval": out.eval,
              "wall_s": wall, "run_id": run_id, "resumed_from_step": resumed, "retracked": retracked,
              "steps_logged": len(rows), "fingerprint": spec.fingerprint}
    write_sidecar(sidecar_path(spec), key, result)
    publish_stage(label, cfg.name, _summary(result, overlap, rows), link)
    return result


def _log_outputs(spec, cfg, run_id: str, out, rows: list[dict], wall: float) -> str:
    """A finished stage's eval, wall time, step-metric plots and timeline in its MLflow run; returns the timeline's
    overlap line for the summary."""
    tracking.log_eval(run_id, out.eval)
    tracking.log_metric_rows(run_id, [{"step": 0, "wall_s": wall}])
    tracking.log_plots(run_id, tracking.plot_metrics(rows, spec.stage_dir / "plots"))
    overlap = publish_timeline(spec.label, cfg.name, run_id, spec.stage_dir)
    tracking.log_text(run_id, eval_table(out.eval), "eval.md")
    return overlap


def _register(spec, cfg, run_id: str, out, registered: str, inputs: Mapping[str, Mapping[str, Any]], key: str,
              lineage: Mapping[str, Any]) -> str:
    """The stage's model in the registry as `registered`, tagged with its inputs, identity, seed and eval."""
    info = read_stage(spec.stage_dir) or {}
    tags = {**{f"{tracking.INPUT_TAG_PREFIX}{k}": v["ref"] for k, v in inputs.items()},
            "mopd.stage": spec.label, "mopd.recipe": cfg.name, "mopd.cache_key": key,
            "mopd.stage_fingerprint": info.get("fingerprint", ""), "mopd.results_version":
            info.get("results_version", ""), "mopd.git_sha": tracking.git_sha(), "mopd.seed": cfg.seed,
            **lineage, **{f"eval.{d}.{m}": v for d, r in out.eval.items() for m, v in r.items()}}
    model_uri = tracking.log_model(run_id, out.model_dir, registered, tags)
    tracking.set_tags(run_id, {"mopd.registered_model": model_uri})
    get_run_logger().info("%s: registered %s", spec.label, model_uri)
    return model_uri


def _summary(result: Mapping[str, Any], overlap: str, rows: list[dict]) -> str:
    resumed = result["resumed_from_step"]
    return (f"# {result['stage']}\n\nmodel: `{result['ref']}`  \nwall: {result['wall_s']:.1f} s"
            + (f"  \nresumed from step {resumed}" if resumed else "")
            + ("  \nreused from its folder (logged to this tracking store again)" if result["retracked"] else "")
            + f"\n\n## held-out accuracy (%)\n\n{eval_table(result['eval'])}\n\n"
            + (f"## phases over time\n\n{overlap}\n\n" if overlap else "")
            + "## step metrics\n\n" + metrics_summary(rows))


def publish_timeline(label: str, recipe_name: str, run_id: str, stage_dir: Path) -> str:
    """An RL stage's `timeline.jsonl` (when generation, scoring and each update ran) as the `overlap.png` Gantt
    chart in its MLflow run and a per-step Prefect table; returns a Markdown line of busy/overlap fractions for
    the stage summary ("" for a stage without a timeline)."""
    from prefect.artifacts import create_table_artifact

    from mopd_core.train import timeline

    rows = timeline.read(stage_dir / "timeline.jsonl")
    if not rows:
        return ""
    png = timeline.plot(rows, stage_dir / "plots" / "overlap.png", label)
    tracking.log_plots(run_id, [png])
    summ = timeline.summary(rows)
    tracking.log_metric_rows(run_id, [{"step": 0, **{f"timeline/{k}": v for k, v in summ.items()}}])
    table = [{"step": r["step"], "version": r.get("version"),
              **{f"{lane}_{end}": round(r[lane][i], 3) for lane in timeline.LANES if r.get(lane)
                 for i, end in enumerate(("start_s", "end_s"))}} for r in rows]
    create_table_artifact(table=table, key=artifact_key(recipe_name, label) + "-timeline",
                          description=f"{label}: when each step's generation, scoring and update ran (seconds)")
    return (f"overlap (≥ 2 phases at once): {100 * summ['overlap_frac']:.0f} % of {summ['wall_s']:.1f} s; busy: "
            + ", ".join(f"{lane} {100 * summ[lane + '_busy_frac']:.0f} %" for lane in timeline.LANES)
            + " (`overlap.png` in the MLflow run)")


def log_compat(run_id: str, report) -> None:
    """The compatibility pre-flight's table (`compat.md`: rows and both sides' renderings of the probe;
    `compat.json`) in the stage's run, and its failure count as a metric; nothing without a report."""
    if report is None:
        return
    tracking.log_text(run_id, report.markdown(), "compat.md")
    tracking.log_text(run_id, json.dumps(report.to_json(), indent=2), "compat.json")
    tracking.log_metric_rows(run_id, [{"step": 0, "compat/failures": len(report.failures()),
                                       "compat/warnings": len(report.warnings())}])


def as_ref(result: Mapping[str, Any]) -> dict:
    """A stage result → the reference the next stage takes."""
    return {"ref": result["ref"], "path": result["path"]}


def round_lineage(stage: str, parent: Mapping[str, Any] | None) -> dict | None:
    """The lineage tags of a round r ≥ 2 stage: its round and the previous round's student (`parent`, a stage
    result or reference) it descends from; None in round 1 (its runs and models are tagged as before rounds)."""
    rnd = parse_stage(stage)[2]
    if rnd == 1:
        return None
    return {"mopd.round": rnd, **({"mopd.parent": parent["ref"]} if parent else {})}


@task(name="sft", **CACHED)
def sft_task(stage: str, cfg, inputs: dict, parent_run_id: str | None = None, refresh: bool = False) -> dict:
    from mopd_core import recipe as R

    def engine(local: dict):
        return R.sft_stage(cfg, local.get("base") or R.base_model(cfg), progress=True)

    return _run_stage(spec=spec_of(stage, cfg, inputs), cfg=cfg, inputs=inputs, parent_run_id=parent_run_id,
                      refresh=refresh, registered=tracking.registered_name(cfg.name, "sft"), engine=engine,
                      sections=("runtime",) + STAGE_SECTIONS["sft"], data_domains=cfg.domain_names())


@task(name="expert_rl", **CACHED)
def expert_task(stage: str, cfg, inputs: dict, parent_run_id: str | None = None, refresh: bool = False,
                lineage: dict | None = None) -> dict:
    """`stage`: "expert:<domain>" (round 1) or "expert:<domain>@r<r>" (round r: `init` = round r−1's student)."""
    from mopd_core import recipe as R

    spec = spec_of(stage, cfg, inputs)
    return _run_stage(spec=spec, cfg=cfg, inputs=inputs, parent_run_id=parent_run_id, refresh=refresh,
                      registered=tracking.registered_name(cfg.name, spec.label),
                      # experts run concurrently: rich draws one live bar per process, so log lines only there
                      engine=lambda local: R.expert_stage(cfg, spec.domain, local["init"],
                                                          progress=not sys.stderr.isatty(), rnd=spec.round),
                      sections=("runtime",) + STAGE_SECTIONS["expert"], data_domains=[spec.domain], lineage=lineage)


@task(name="mopd", **CACHED)
def mopd_task(stage: str, cfg, inputs: dict, parent_run_id: str | None = None, refresh: bool = False,
              endpoints: str | None = None, lineage: dict | None = None) -> dict:
    """`stage`: "mopd" (round 1) or "mopd@r<r>". `endpoints`: the manifest path `serve_teachers_task` returned
    (None: the stage serves its teachers itself or uses teachers.endpoints). The live servers of that manifest in
    this process are used with supervision (dead servers restarted); a manifest from elsewhere is used as
    external endpoints. Not part of the cache key (ports and pids are no identity of the student)."""
    from mopd_core import recipe as R

    from mopd_core.teachers.compat import CompatError

    live = live_teachers(endpoints)
    spec = spec_of(stage, cfg, inputs)
    failed: dict = {}  # the compatibility report of a stage its pre-flight stopped

    def engine(local: dict):
        try:
            return R.mopd_stage(cfg, local["init"], teacher_roles(local), progress=True,
                                endpoints=live if live is not None else endpoints, rnd=spec.round)
        except CompatError as e:
            failed["compat"] = e.report
            raise

    def on_end(run_id: str, out) -> None:
        manifest = (out.teachers if out is not None else None) or (live.manifest() if live is not None else None)
        counts = record_restarts(run_id, manifest)
        if any(counts.values()):
            get_run_logger().warning("teacher server restarts during the stage: %s", counts)
        log_compat(run_id, out.compat if out is not None else failed.get("compat"))
        if out is not None and out.recovery:  # the final eval's (the mid-training ones stream with the metrics)
            tracking.log_metric_rows(run_id, [{"step": cfg.mopd.steps, **{f"recovery/{d}": v
                                                                          for d, v in out.recovery.items()}}])

    return _run_stage(spec=spec, cfg=cfg, inputs=inputs, parent_run_id=parent_run_id, refresh=refresh,
                      registered=tracking.registered_name(cfg.name, spec.label), engine=engine,
                      sections=("runtime",) + STAGE_SECTIONS["mopd"], data_domains=cfg.domain_names(),
                      on_end=on_end, lineage=lineage)


@task(name="evaluate", **CACHED)
def evaluate_task(stage: str, cfg, inputs: dict, parent_run_id: str | None = None, refresh: bool = False) -> dict:
    """Held-out accuracy of every model given ({label: ref}); writes accuracy.{md,json,png} of the run."""
    from mopd_core import recipe as R

    logger = get_run_logger()
    spec = spec_of(stage, cfg, inputs)
    key = stage_key(spec, cfg)
    if not refresh:
        side = tracked_result(spec, key)
        if side is not None:
            msg = f"evaluate: the same models were evaluated in MLflow run {side['run_id']} — reused"
            logger.info(msg)
            return cached({k: v for k, v in side.items() if k != "key"}, msg)
    R.setup_runtime(cfg)
    run_id = tracking.start_run(cfg.name, "evaluate", parent_run_id,
                                tags={"mopd.stage": "evaluate", "mopd.cache_key": key, **prefect_tags()})
    try:
        tracking.log_params(run_id, tracking.stage_params(cfg, STAGE_SECTIONS["evaluate"],
                                                          {k: v["ref"] for k, v in inputs.items()}))
        local = {k: local_path(v, refs_cache_dir(cfg)) for k, v in inputs.items()}
        t0 = time.perf_counter()
        rep = R.eval_stage(cfg, local)
        wall = time.perf_counter() - t0
        acc, table = rep.accuracy, rep.table
        out = cfg.run_dir()
        files = rep.write(out, extra={"models": {k: v["ref"] for k, v in inputs.items()}})
        tracking.log_metric_rows(run_id, [{"step": 0, "wall_s": wall, **{
            f"accuracy/{label}/{d}/{m}": v for label, r in acc.items() for d, dm in r.items()
            for m, v in dm.items()}}])
        for f in files.values():  # eval_rows.jsonl: every completion with its extracted answer and reward
            tracking.log_artifact(run_id, f)
        publish_eval_tables(cfg, rep)
        tracking.end_run(run_id)
    except BaseException:
        tracking.end_run(run_id, "FAILED")
        raise
    logger.info("held-out accuracy:\n%s", table)
    result = {"accuracy": acc, "table": table, "run_id": run_id, "wall_s": wall,
              "models": {k: v["ref"] for k, v in inputs.items()}, "dir": str(out.resolve())}
    write_sidecar(sidecar_path(spec), key, result)
    return result
