"""Stage tasks: each wraps one `mopd_core.recipe` stage function with a Prefect cache key (stage config + input
model references + code version), retries for transient errors only, an MLflow child run (params, streamed
step metrics, plots, registered model with lineage tags) and Prefect artifacts (summary + MLflow link)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from prefect import get_run_logger, task

from . import tracking
from .common import (STAGE_SECTIONS, cache_key_fn, eval_table, local_path, metrics_summary, prepare_stage_dir,
                     publish_stage, refs_cache_dir, stage_key, write_sidecar)
from .context import RETRY, prefect_tags
from .teachers import live_teachers, record_restarts

CACHED = dict(cache_key_fn=cache_key_fn, persist_result=True, **RETRY)


def _last_checkpoint_step(stage_dir: Path) -> int:
    from mopd_core.train.checkpoint import last_checkpoint_step, read_stage

    info = read_stage(stage_dir) or {}
    if info.get("status") == "done":
        return 0
    return last_checkpoint_step(stage_dir)


def _run_stage(*, stage: str, label: str, cfg, inputs: Mapping[str, Mapping[str, Any]], parent_run_id: str | None,
               refresh: bool, stage_dir: Path, registered: str | None, engine: Callable[[dict], Any],
               sections: tuple[str, ...], data_domains: list[str],
               on_end: Callable[[str, Any], None] | None = None) -> dict:
    """`on_end(run_id, stage_output | None)`: extra tracking before the child run ends (None: the stage failed)."""
    from mopd_core.recipe import setup_runtime

    logger = get_run_logger()
    key = stage_key(stage, cfg, inputs)
    prepare_stage_dir(stage_dir, key, refresh, logger)
    resumed = _last_checkpoint_step(stage_dir)
    if resumed:
        logger.info("%s: resuming from the checkpoint of step %d", label, resumed)
    setup_runtime(cfg)
    run_id = tracking.start_run(cfg.name, label, parent_run_id,
                                tags={"mopd.stage": label, "mopd.cache_key": key, **prefect_tags()})
    link = out = None
    try:
        link = tracking.run_url(run_id)
        logger.info("%s: MLflow run %s", label, link)
        tracking.log_params(run_id, tracking.stage_params(cfg, sections, {k: v["ref"] for k, v in inputs.items()},
                                                          {"resumed_from_step": resumed, "stage": label}))
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
        ev = out.eval
        tracking.log_eval(run_id, ev)
        tracking.log_metric_rows(run_id, [{"step": 0, "wall_s": wall}])
        tracking.log_plots(run_id, tracking.plot_metrics(rows, stage_dir / "plots"))
        tracking.log_text(run_id, eval_table(ev), "eval.md")
        model_uri = None
        if registered:
            from mopd_core.train.checkpoint import read_stage

            info = read_stage(stage_dir) or {}
            tags = {**{f"{tracking.INPUT_TAG_PREFIX}{k}": v["ref"] for k, v in inputs.items()},
                    "mopd.stage": label, "mopd.recipe": cfg.name, "mopd.cache_key": key,
                    "mopd.stage_fingerprint": info.get("fingerprint", ""), "mopd.code_version":
                    tracking.code_version(), "mopd.git_sha": tracking.git_sha(), "mopd.seed": cfg.seed,
                    **{f"eval.{d}.{m}": v for d, r in ev.items() for m, v in r.items()}}
            model_uri = tracking.log_model(run_id, out.model_dir, registered, tags)
            tracking.set_tags(run_id, {"mopd.registered_model": model_uri})
            logger.info("%s: registered %s", label, model_uri)
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
              "path": str(Path(out.model_dir).resolve()), "stage_dir": str(stage_dir.resolve()), "eval": ev,
              "wall_s": wall, "run_id": run_id, "key": key, "resumed_from_step": resumed,
              "steps_logged": len(rows)}
    write_sidecar(stage_dir, key, result)
    publish_stage(label, cfg.name, f"# {label}\n\nmodel: `{result['ref']}`  \nwall: {wall:.1f} s"
                  + (f"  \nresumed from step {resumed}" if resumed else "")
                  + f"\n\n## held-out accuracy (%)\n\n{eval_table(ev)}\n\n## step metrics\n\n"
                  + metrics_summary(rows), link)
    return result


def as_ref(result: Mapping[str, Any]) -> dict:
    """A stage result → the reference the next stage takes."""
    return {"ref": result["ref"], "path": result["path"]}


@task(name="sft", **CACHED)
def sft_task(stage: str, cfg, inputs: dict, parent_run_id: str | None = None, refresh: bool = False) -> dict:
    from mopd_core import recipe as R

    def engine(local: dict):
        return R.sft_stage(cfg, local.get("base") or R.base_model(cfg), progress=True)

    return _run_stage(stage=stage, label="sft", cfg=cfg, inputs=inputs, parent_run_id=parent_run_id,
                      refresh=refresh, stage_dir=cfg.run_dir() / "sft",
                      registered=tracking.registered_name(cfg.name, "sft"), engine=engine,
                      sections=("runtime",) + STAGE_SECTIONS["sft"], data_domains=cfg.domain_names())


@task(name="expert_rl", **CACHED)
def expert_task(stage: str, cfg, inputs: dict, parent_run_id: str | None = None, refresh: bool = False) -> dict:
    from mopd_core import recipe as R

    domain = stage.split(":", 1)[1]
    label = f"expert-{domain}"
    return _run_stage(stage=stage, label=label, cfg=cfg, inputs=inputs, parent_run_id=parent_run_id,
                      refresh=refresh, stage_dir=cfg.run_dir() / label,
                      registered=tracking.registered_name(cfg.name, label),
                      # experts run concurrently: rich draws one live bar per process, so log lines only there
                      engine=lambda local: R.expert_stage(cfg, domain, local["init"],
                                                          progress=not sys.stderr.isatty()),
                      sections=("runtime",) + STAGE_SECTIONS["expert"], data_domains=[domain])


@task(name="mopd", **CACHED)
def mopd_task(stage: str, cfg, inputs: dict, parent_run_id: str | None = None, refresh: bool = False,
              endpoints: str | None = None) -> dict:
    """`endpoints`: the manifest path `serve_teachers_task` returned (None: the stage serves its teachers itself
    or uses teachers.endpoints). The live servers of that manifest in this process are used with supervision
    (dead servers restarted); a manifest from elsewhere is used as external endpoints. Not part of the cache
    key (ports and pids are no identity of the student)."""
    from mopd_core import recipe as R

    live = live_teachers(endpoints)

    def engine(local: dict):
        teachers = {k.split(".", 1)[1]: v for k, v in local.items() if k.startswith("teacher.")}
        return R.mopd_stage(cfg, local["init"], teachers, progress=True,
                            endpoints=live if live is not None else endpoints)

    def on_end(run_id: str, out) -> None:
        manifest = (out.teachers if out is not None else None) or (live.manifest() if live is not None else None)
        counts = record_restarts(run_id, manifest)
        if any(counts.values()):
            get_run_logger().warning("teacher server restarts during the stage: %s", counts)

    return _run_stage(stage=stage, label="student", cfg=cfg, inputs=inputs, parent_run_id=parent_run_id,
                      refresh=refresh, stage_dir=cfg.run_dir() / "student",
                      registered=tracking.registered_name(cfg.name, "student"), engine=engine,
                      sections=("runtime",) + STAGE_SECTIONS["mopd"], data_domains=cfg.domain_names(),
                      on_end=on_end)


@task(name="evaluate", **CACHED)
def evaluate_task(stage: str, cfg, inputs: dict, parent_run_id: str | None = None, refresh: bool = False) -> dict:
    """Held-out accuracy of every model given ({label: ref}); writes accuracy.{md,json,png} of the run."""
    from mopd_core import recipe as R
    from mopd_core.evaluation import accuracy_table, plot_accuracy

    logger = get_run_logger()
    key = stage_key(stage, cfg, inputs)
    R.setup_runtime(cfg)
    run_id = tracking.start_run(cfg.name, "evaluate", parent_run_id,
                                tags={"mopd.stage": "evaluate", "mopd.cache_key": key, **prefect_tags()})
    try:
        tracking.log_params(run_id, tracking.stage_params(cfg, STAGE_SECTIONS["evaluate"],
                                                          {k: v["ref"] for k, v in inputs.items()}))
        local = {k: local_path(v, refs_cache_dir(cfg)) for k, v in inputs.items()}
        t0 = time.perf_counter()
        acc = R.eval_stage(cfg, local)
        wall = time.perf_counter() - t0
        table = accuracy_table(acc, "greedy", cfg.domain_names())
        out = cfg.run_dir()
        out.mkdir(parents=True, exist_ok=True)
        (out / "accuracy.md").write_text(table + "\n")
        (out / "accuracy.json").write_text(json.dumps({"accuracy": acc, "models": {k: v["ref"] for k, v in
                                                                                   inputs.items()}}, indent=2))
        plot_accuracy(acc, out / "accuracy.png")
        tracking.log_metric_rows(run_id, [{"step": 0, "wall_s": wall, **{
            f"accuracy/{label}/{d}/{m}": v for label, r in acc.items() for d, dm in r.items()
            for m, v in dm.items()}}])
        for f in ("accuracy.md", "accuracy.json", "accuracy.png"):
            tracking.log_artifact(run_id, out / f)
        tracking.end_run(run_id)
    except BaseException:
        tracking.end_run(run_id, "FAILED")
        raise
    logger.info("held-out accuracy:\n%s", table)
    return {"accuracy": acc, "table": table, "run_id": run_id, "key": key, "wall_s": wall,
            "models": {k: v["ref"] for k, v in inputs.items()}, "dir": str(out.resolve())}
