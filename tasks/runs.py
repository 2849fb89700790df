"""Tasks around the stages: parameter validation (before any stage), the MLflow parent run, the report and
the champion comparison of the nightly reproduction."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from prefect import get_run_logger, task

from . import tracking
from .common import ParameterError, RegressionError, artifact_key
from .context import prefect_tags


def build_config(config: str, overrides: list[str] | None, sections: Mapping[str, Any],
                 top: Mapping[str, Any]):
    """preset → overrides → section parameters → top-level fields; errors name the parameter."""
    import yaml

    from mopd_core.config import ConfigError, apply_overrides, config_from_dict, resolve_preset

    try:
        path = resolve_preset(config)
    except ConfigError as e:
        raise ParameterError(f"parameter 'config': {e}") from None
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ParameterError(f"parameter 'config': {path} is not valid YAML ({str(e).splitlines()[0]})") from None
    try:
        data = apply_overrides(data, overrides)
        config_from_dict(data, source=str(path))
    except ConfigError as e:
        raise ParameterError(f"parameter 'overrides': {e}") from None
    for name, fields in sections.items():
        if not fields:
            continue
        data.setdefault(name, {})
        data[name].update(fields)
        try:
            config_from_dict(data, source=f"parameter '{name}'")
        except ConfigError as e:
            raise ParameterError(str(e)) from None
    for k, v in top.items():
        if v is not None:
            data[k] = v
    try:
        return config_from_dict(data, source="parameters")
    except ConfigError as e:
        keys = [k for k, v in top.items() if v is not None]
        raise ParameterError(f"parameter {keys}: {e}") from None


def check_ref(param: str, ref: str | None) -> dict:
    if not ref:
        raise ParameterError(f"parameter '{param}': a model reference is required (models:/<name>/<version>, "
                             "models:/<name>@<alias> or a checkpoint dir)")
    try:
        return {"ref": tracking.canonical_ref(ref), "path": None}
    except tracking.ModelRefError as e:
        raise ParameterError(f"parameter '{param}': {e}") from None


def check_teacher_domains(cfg, teacher_domains: list[str], param: str) -> None:
    """Domain routing needs one teacher (expert) for every domain the student samples."""
    known = cfg.domain_names()
    for t in teacher_domains:
        if t not in known:
            raise ParameterError(f"parameter '{param}': teacher '{t}' is no domain of the recipe; known: {known}")
    if cfg.mopd.w_kd > 0 and cfg.teachers.routing == "domain":
        mix = cfg.prompt_mix(cfg.mopd)
        missing = [d for d in known if mix.get(d, 0) > 0 and d not in teacher_domains]
        if missing:
            raise ParameterError(f"parameter '{param}': domain(s) {missing} have no expert/teacher but the student "
                                 f"samples them with teachers.routing=domain; add one or set mopd.mix")
    if cfg.mopd.w_kd > 0 and not teacher_domains:
        raise ParameterError(f"parameter '{param}': mopd.w_kd > 0 needs at least one teacher")


@task(name="validate_parameters")
def validate_parameters(flow: str, config: str, overrides: list[str] | None, sections: Mapping[str, Any],
                        top: Mapping[str, Any], refs: Mapping[str, str | None] | None = None,
                        teacher_refs: Mapping[str, str] | None = None, refresh: list[str] | None = None):
    """Everything a flow can check before any stage: the preset, overrides, section fields, model references
    and teacher domains. Returns (config, {param: ref}, {domain: ref})."""
    cfg = build_config(config, overrides, sections, top)
    from mopd_core.errors import MopdError
    from mopd_core.recipe import build_domains

    try:
        build_domains(cfg)  # data sources load and their teacher_ids are known domains
    except MopdError as e:  # DataError/ConfigError: the user's data; anything else is a bug and propagates
        raise ParameterError(f"parameter 'config' (data.domains): {e}") from None
    checked = {k: check_ref(k, v) for k, v in (refs or {}).items()}
    teachers = {d: check_ref(f"teacher_refs.{d}", r) for d, r in (teacher_refs or {}).items()}
    if flow == "mopd":
        check_teacher_domains(cfg, list(teachers), "teacher_refs")
    if flow == "full-recipe":
        check_teacher_domains(cfg, cfg.expert_domains(), "expert.domains")
    from mopd_core.stages import stage_plan

    stages = {"sft", "student", "evaluate", "all", *[f"expert-{d}" for d in cfg.domain_names()],
              *[s.label for s in stage_plan(cfg)]}  # a later round's r<r>-expert-<d>, r<r>-student
    for r in refresh or []:
        if r not in stages:
            raise ParameterError(f"parameter 'refresh': unknown stage '{r}'; use any of {sorted(stages)}")
    get_run_logger().info("parameters ok: %s (%s)", cfg.name, config)
    return cfg, checked, teachers


def _is_alive_via_prefect(run) -> bool | None:
    """A RUNNING MLflow run whose Prefect flow run is in a final state is dead (e.g. SIGKILLed)."""
    fr = run.data.tags.get("prefect.flow_run_id")
    if not fr:
        return None
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as c:
            state = c.read_flow_run(fr).state
        if state is None:
            return None
        if state.is_final():
            return False
        return None  # running/pending per Prefect: let the host/pid check decide
    except Exception:  # noqa: BLE001
        return None


@task(name="open_recipe_run", **{"retries": 2, "retry_delay_seconds": 5})
def open_recipe_run(cfg, flow: str, extra_params: Mapping[str, Any] | None = None) -> str:
    """Close runs left RUNNING by a killed process, then start the parent run of this recipe run."""
    from mopd_core.config import flatten

    logger = get_run_logger()
    closed = tracking.reap_stale_runs(cfg.name, is_alive=_is_alive_via_prefect)
    if closed:
        logger.info("closed %d MLflow run(s) left RUNNING by a killed process: %s", len(closed), closed)
    run_id = tracking.start_run(cfg.name, f"{flow}", None, tags={"mopd.flow": flow, **prefect_tags()})
    tracking.log_params(run_id, {**flatten(cfg.model_dump(mode="json")), "code_version": tracking.code_version(),
                                 "git_sha": tracking.git_sha(), **(extra_params or {})})
    logger.info("MLflow parent run: %s", tracking.run_url(run_id))
    return run_id


@task(name="close_recipe_run")
def close_recipe_run(run_id: str, status: str = "FINISHED", tags: Mapping[str, Any] | None = None) -> None:
    if tags:
        tracking.set_tags(run_id, tags)
    tracking.end_run(run_id, status)


@task(name="report")
def report_task(cfg, parent_run_id: str, evaluation: dict, stages: Mapping[str, dict]) -> str:
    """The recipe's table and plot on the parent run and as Prefect artifacts, with links to every stage run."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from mopd_core.evaluation import domain_value

    acc = evaluation["accuracy"]
    d = Path(evaluation["dir"])
    for f in ("accuracy.md", "accuracy.json", "accuracy.png"):
        if (d / f).exists():
            tracking.log_artifact(parent_run_id, d / f)
    tracking.log_metric_rows(parent_run_id, [{"step": 0, **{
        f"accuracy/{label}/{dom}/{m}": v for label, r in acc.items() for dom, dm in r.items()
        for m, v in dm.items()}}])
    cached = sorted(k for k, v in stages.items() if v.get("run_id") and
                    tracking.client().get_run(v["run_id"]).data.tags.get(tracking.PARENT_TAG) != parent_run_id)
    tracking.set_tags(parent_run_id, {"mopd.cached_stages": ",".join(cached) or "-",
                                      **{f"mopd.model.{k}": v["ref"] for k, v in stages.items() if "ref" in v}})
    lines = [f"# {cfg.name}: accuracy (%)", "", evaluation["table"], "", "## stages", "",
             "| stage | model | MLflow run | cached |", "|---|---|---|---|"]
    for k, v in stages.items():
        rid = v.get("run_id")
        lines.append(f"| {k} | `{v.get('ref', '')}` | {tracking.run_url(rid) if rid else ''} | "
                     f"{'yes' if k in cached else 'no'} |")
    lines += ["", f"parent MLflow run: {tracking.run_url(parent_run_id)}"]
    md = "\n".join(lines)
    create_markdown_artifact(markdown=md, key=artifact_key(cfg.name, "report"), description="recipe report")
    # a domain's headline: greedy on its held-out split, else the mean of its benchmarks' headlines
    rows = [{"model": label, **{dom: _pct(domain_value(dm)) for dom, dm in r.items()}} for label, r in acc.items()]
    create_table_artifact(table=rows, key=artifact_key(cfg.name, "accuracy"),
                          description="accuracy (%): greedy held-out, or the domain's benchmark score")
    tracking.log_text(parent_run_id, md, "report.md")
    return md


def _pct(v: float | None) -> float:
    return round(100 * v, 2) if v is not None else float("nan")


@task(name="find_champion")
def find_champion(cfg, alias: str) -> dict | None:
    """`<name>-student@alias`; with R ≥ 2 rounds the last round's `<name>-r<R>-student@alias` (a champion is a
    student of as many rounds)."""
    from mopd_core.stages import last_student_label

    name = tracking.registered_name(cfg.name, last_student_label(cfg))
    v = tracking.alias_version(name, alias)
    return {"ref": f"models:/{name}/{v}", "path": None} if v else None


@task(name="compare_to_champion")
def compare_to_champion(cfg, parent_run_id: str, accuracy: dict, student_ref: str, champion_ref: str | None,
                        tolerance: float, promote: bool, alias: str, student_label: str = "student") -> dict:
    """Per-domain deltas of the new student against the champion (evaluated on the same held-out prompts in
    this run). A drop beyond `tolerance` fails the run naming domain and delta; otherwise the new student
    becomes the champion. `student_label`: the accuracy row judged — the last round's student."""
    from prefect.artifacts import create_table_artifact

    from mopd_core.evaluation import domain_value
    from mopd_core.recipe import recovery_of

    logger = get_run_logger()
    name, version, _ = tracking.parse_model_uri(student_ref) if tracking.is_model_uri(student_ref) else (
        None, None, None)
    new = {d: domain_value(r) for d, r in accuracy[student_label].items()}
    # recovery (x − SFT) / (expert − SFT) against this evaluation's sft and expert rows, beside the accuracy
    rec = {"student": recovery_of(cfg, accuracy, student_label), "champion": recovery_of(cfg, accuracy, "champion")}
    tracking.log_metric_rows(parent_run_id, [{"step": 0, **{f"recovery/{who}/{d}": v for who, r in rec.items()
                                                            for d, v in r.items()}}])
    if champion_ref is None or "champion" not in accuracy:
        deltas, bad = {}, []
        logger.info("no %s@%s yet: the new student becomes it", tracking.registered_name(cfg.name, student_label),
                    alias)
    else:
        old = {d: domain_value(r) for d, r in accuracy["champion"].items()}
        deltas, bad = tracking.champion_deltas(new, old, tolerance)
        create_table_artifact(
            table=[{"domain": d, "student": round(100 * new[d], 2), "champion": round(100 * old[d], 2),
                    "delta_points": round(100 * dv, 2), "ok": dv >= -tolerance,
                    "student_recovery": _ratio(rec["student"].get(d)),
                    "champion_recovery": _ratio(rec["champion"].get(d))} for d, dv in deltas.items()],
            key=artifact_key(cfg.name, "champion-deltas"), description=f"student vs {champion_ref}")
        tracking.log_metric_rows(parent_run_id, [{"step": 0, **{f"champion_delta/{d}": v
                                                                for d, v in deltas.items()}}])
    tracking.set_tags(parent_run_id, {"mopd.champion": champion_ref or "-",
                                      "mopd.champion_result": "regressed" if bad else "ok"})
    if bad:
        msg = f"student {student_ref} regressed against {champion_ref}: " + "; ".join(bad)
        tracking.set_tags(parent_run_id, {"mopd.regression": msg[:5000]})
        raise RegressionError(msg)
    if promote and name:
        tracking.set_alias(name, alias, version)
        logger.info("%s is now @%s", student_ref, alias)
    return {"deltas": deltas, "champion": champion_ref, "promoted": bool(promote and name), "recovery": rec}


def _ratio(v: float | None) -> float | None:
    """A recovery for a table cell: 3 decimals; None where it is undefined (no expert row, expert = SFT)."""
    return round(v, 3) if v is not None and math.isfinite(v) else None
