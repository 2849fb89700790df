"""One flow per stage, each startable alone (UI, CLI, deployment) from model references: an MLflow registered
model (`models:/name/version`, `models:/name@alias`) or a checkpoint dir. A stage started alone writes under
`<output_dir>/<name>/stages/<key>/` and registers its model like the full recipe does (`<name>-<stage>`)."""

from __future__ import annotations

from prefect import flow

from mopd_core.stages import round_prefix, round_stage, stage_label

from flows.params import (EvalParams, ExpertParams, MOPDParams, RolloutParams, RuntimeParams, SFTParams,
                          TeachersParams, TrainParams, section_dict)
from tasks.common import ParameterError, adhoc_config
from tasks.runs import close_recipe_run, open_recipe_run, validate_parameters
from tasks.stages import evaluate_task, expert_task, mopd_task, round_lineage, sft_task
from tasks.teachers import keep_teachers_task, serve_teachers_task, stop_teachers


def _top(name, seed, output_dir) -> dict:
    return {"name": name, "seed": seed, "output_dir": output_dir}


def _round_stage(stage: str, rnd: int) -> str:
    """A later MOPD round's stage string (`expert:math@r2`, `mopd@r2`): registered as `<name>-r2-…`."""
    if not isinstance(rnd, int) or rnd < 1:
        raise ParameterError(f"parameter 'round': {rnd!r} — give the MOPD round this stage belongs to (1, 2, …)")
    return round_stage(stage, rnd)


def _in_parent(cfg, flow_name: str, body, params: dict):
    parent = open_recipe_run(cfg, flow_name, params)
    try:
        out = body(parent)
    except BaseException:
        close_recipe_run(parent, "FAILED")
        raise
    close_recipe_run(parent, "FINISHED")
    return out


@flow(name="sft", description="Mixed-domain SFT of a base model.")
def sft_flow(config: str = "tiny", overrides: list[str] | None = None, name: str | None = None,
             seed: int | None = None, output_dir: str | None = None, base: str | None = None,
             runtime: RuntimeParams = RuntimeParams(), sft: SFTParams = SFTParams(),
             rollout: RolloutParams = RolloutParams(), eval: EvalParams = EvalParams(),  # noqa: A002
             refresh: bool = False, train: TrainParams = TrainParams()) -> dict:
    """`base`: a model reference; empty = the config's `model.base` (`tiny` is built locally)."""
    sections = {k: section_dict(v) for k, v in dict(runtime=runtime, sft=sft, rollout=rollout, eval=eval,
                                                   train=train).items()}
    cfg, refs, _ = validate_parameters("sft", config, overrides, sections, _top(name, seed, output_dir),
                                       refs={"base": base} if base else None)
    cfg = adhoc_config(cfg, "sft", refs)
    return _in_parent(cfg, "sft", lambda parent: sft_task.submit(
        "sft", cfg, refs, parent, refresh).result(), {"input.base": base or cfg.model.base})


@flow(name="expert-rl", description="GRPO expert for one domain from an SFT model.")
def expert_rl_flow(domain: str, init: str, config: str = "tiny", overrides: list[str] | None = None,
                   name: str | None = None, seed: int | None = None, output_dir: str | None = None,
                   runtime: RuntimeParams = RuntimeParams(), expert: ExpertParams = ExpertParams(),
                   rollout: RolloutParams = RolloutParams(), eval: EvalParams = EvalParams(),  # noqa: A002
                   refresh: bool = False, train: TrainParams = TrainParams(),
                   round: int = 1) -> dict:  # noqa: A002 - the recipe's word for it
    """`domain`: one of the recipe's domains; `init`: the SFT model reference (round ≥ 2: the previous round's
    student, e.g. `models:/<name>-student/1`); `round`: the MOPD round the expert belongs to — round ≥ 2 is
    registered as `<name>-r<round>-expert-<domain>`, tagged `mopd.round` and `mopd.parent` (= `init`)."""
    stage = _round_stage(f"expert:{domain}", round)  # before anything else runs
    sections = {k: section_dict(v) for k, v in dict(runtime=runtime, expert=expert, rollout=rollout,
                                                   eval=eval, train=train).items()}
    cfg, refs, _ = validate_parameters("expert-rl", config, overrides, sections, _top(name, seed, output_dir),
                                       refs={"init": init})
    if domain not in cfg.domain_names():
        raise ParameterError(f"parameter 'domain': '{domain}' is no domain of the recipe; known: "
                             f"{cfg.domain_names()}")
    cfg = adhoc_config(cfg, stage, refs)
    kw = {"lineage": round_lineage(stage, refs["init"])} if round > 1 else {}
    return _in_parent(cfg, "expert-rl", lambda parent: expert_task.with_options(
        task_run_name=stage_label(stage)).submit(stage, cfg, refs, parent, refresh, **kw).result(),
        {"input.init": init, "domain": domain, **({"round": round} if round > 1 else {})})


@flow(name="serve-teachers",
      description="Start the expert teachers' vLLM servers (teachers.backend=http), pre-flight them against the "
                  "student, keep them up for keep_running_s, stop them; or check colocated teachers' tokenizers.")
def serve_teachers_flow(teacher_refs: dict[str, str], student: str, config: str = "tiny",
                        overrides: list[str] | None = None, name: str | None = None,
                        teachers: TeachersParams = TeachersParams(), keep_running_s: float = 0.0) -> dict:
    """`teacher_refs`: {domain: model reference}; `student`: the student's model reference.

    A flow run owns what it starts: no server outlives it. With `teachers.backend: http` (and no
    `teachers.endpoints`) the run starts one vLLM server per teacher on 127.0.0.1, checks each (health,
    tokenizer fingerprint and `/tokenize` probe against the student, max-model-len ≥ prompt + completion + 1),
    publishes the endpoint manifest (Prefect artifact; MLflow run `serve-teachers` with the manifest and every
    server log), then **stops them**. `keep_running_s` = 0 (default) makes it a pre-flight check (~30 s per
    teacher on CPU); > 0 keeps the servers serving that many seconds first (dead ones restarted, at most
    teachers.restarts), e.g. for a trainer outside this flow pointed at the manifest's URLs
    (`teachers.endpoints`). The recipe's own training never depends on this flow: `full-recipe` and `mopd`
    start and stop their servers themselves. With `teachers.endpoints` the given servers are checked only;
    with `backend: local` only the tokenizers are checked.

    Returns `{"teachers": {domain: ref}, "manifest": path, "endpoints": {teacher: {url, model, max_model_len,
    pid, restarts, …}}, "mode", "started", "served_s"}` — `endpoints` as they were while serving; after the
    run those URLs no longer answer."""
    import json
    import time
    from pathlib import Path

    cfg, refs, trefs = validate_parameters("serve-teachers", config, overrides,
                                           {"teachers": section_dict(teachers)}, _top(name, None, None),
                                           refs={"student": student}, teacher_refs=teacher_refs)
    if keep_running_s < 0:
        raise ParameterError(f"parameter 'keep_running_s': {keep_running_s} < 0")
    # its own folder (`<output_dir>/<name>/stages/<key>/serve-teachers/`): never the logs of a recipe's servers
    cfg = adhoc_config(cfg, "serve_teachers", {"student": refs["student"],
                                               **{f"teacher.{d}": r for d, r in trefs.items()}})

    def body(parent):
        # refresh=True: start the servers whatever a student stage in that folder says
        served = serve_teachers_task(cfg, trefs, refs["student"], parent, True, for_mopd=False)
        t0 = time.monotonic()
        try:
            if served["started"] and keep_running_s > 0:
                keep_teachers_task(served, keep_running_s)
            m = served["manifest"]
            endpoints = json.loads(Path(m).read_text()) if m and Path(m).exists() else {}
        finally:
            stop_teachers(served)
        return {**served, "endpoints": endpoints, "served_s": time.monotonic() - t0}

    return _in_parent(cfg, "serve-teachers", body, {**{f"input.teacher.{k}": v for k, v in teacher_refs.items()},
                                                    "keep_running_s": keep_running_s})


@flow(name="mopd",
      description="Multi-teacher on-policy distillation of a student (from SFT) with expert teachers.")
def mopd_flow(init: str, teacher_refs: dict[str, str], config: str = "tiny", overrides: list[str] | None = None,
              name: str | None = None, seed: int | None = None, output_dir: str | None = None,
              runtime: RuntimeParams = RuntimeParams(), mopd: MOPDParams = MOPDParams(),
              teachers: TeachersParams = TeachersParams(), rollout: RolloutParams = RolloutParams(),
              eval: EvalParams = EvalParams(), refresh: bool = False,  # noqa: A002
              train: TrainParams = TrainParams(), round: int = 1) -> dict:  # noqa: A002 - the recipe's word
    """`init`: the student's starting model (usually `models:/<name>-sft@...`); `teacher_refs`:
    {domain: expert model reference}. With `teachers.backend: http` the run starts the teachers' vLLM servers
    (serve_teachers) before the stage and stops them after it, also when it fails; none when the stage is reused.
    `round` ≥ 2: a later MOPD round's student (`init` = the previous round's student, teachers = that round's
    experts), registered as `<name>-r<round>-student`, tagged `mopd.round` and `mopd.parent` (= `init`)."""
    stage = _round_stage("mopd", round)  # before anything else runs
    sections = {k: section_dict(v) for k, v in dict(runtime=runtime, mopd=mopd, teachers=teachers,
                                                   rollout=rollout, eval=eval, train=train).items()}
    cfg, refs, trefs = validate_parameters("mopd", config, overrides, sections, _top(name, seed, output_dir),
                                           refs={"init": init}, teacher_refs=teacher_refs)
    inputs = {"init": refs["init"], **{f"teacher.{d}": r for d, r in trefs.items()}}
    cfg = adhoc_config(cfg, stage, inputs)
    later = {"stage": stage} if round > 1 else {}
    kw = {"lineage": round_lineage(stage, refs["init"])} if round > 1 else {}

    def body(parent):
        served = serve_teachers_task(cfg, trefs, refs["init"], parent, refresh, **later)
        try:
            inputs2 = {"init": refs["init"], **{f"teacher.{d}": r for d, r in served["teachers"].items()}}
            return mopd_task.with_options(task_run_name=round_prefix(round) + "mopd").submit(
                stage, cfg, inputs2, parent, refresh, endpoints=served["manifest"], **kw).result()
        finally:
            stop_teachers(served)  # every server it started, also when the stage failed

    return _in_parent(cfg, "mopd", body, {"input.init": init, **({"round": round} if round > 1 else {}),
                                          **{f"input.teacher.{k}": v for k, v in teacher_refs.items()}})


@flow(name="evaluate", description="Held-out per-domain accuracy of any set of models.")
def evaluate_flow(models: dict[str, str], config: str = "tiny", overrides: list[str] | None = None,
                  name: str | None = None, seed: int | None = None, output_dir: str | None = None,
                  runtime: RuntimeParams = RuntimeParams(), rollout: RolloutParams = RolloutParams(),
                  eval: EvalParams = EvalParams()) -> dict:  # noqa: A002
    """`models`: {label: model reference}."""
    sections = {k: section_dict(v) for k, v in dict(runtime=runtime, rollout=rollout, eval=eval).items()}
    cfg, refs, _ = validate_parameters("evaluate", config, overrides, sections, _top(name, seed, output_dir),
                                       refs={f"models.{k}": v for k, v in models.items()})
    inputs = {k.removeprefix("models."): v for k, v in refs.items()}
    cfg = adhoc_config(cfg, "evaluate", inputs)
    return _in_parent(cfg, "evaluate", lambda parent: evaluate_task.submit("evaluate", cfg, inputs, parent).result(),
                      {})
