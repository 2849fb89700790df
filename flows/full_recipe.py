"""The whole recipe as one flow: sft → experts (one per domain, concurrently) → serve_teachers → mopd →
evaluate → report (→ champion comparison in the nightly reproduction). With `teachers.backend: http` the
teacher servers live from serve_teachers to the end of the mopd stage and are stopped in a `finally`.
With `rounds` ≥ 2 (multi-round MOPD) experts → serve_teachers → mopd repeat once per round, round r's experts
starting from round r−1's student. The flow walks `mopd_core.stages.stage_plan`; every round is evaluated, the
last round's student is the one the champion comparison judges."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from mopd_core.stages import StageSpec, last_student_label, plan_rounds, round_prefix, stage_plan, teacher_roles

from flows.params import (ChampionParams, EvalParams, ExpertParams, MOPDParams, RolloutParams, RuntimeParams,
                          SFTParams, TeachersParams, TrainParams, section_dict)
from tasks.common import experts_concurrently
from tasks.runs import (close_recipe_run, compare_to_champion, find_champion, open_recipe_run, report_task,
                        validate_parameters)
from tasks.stages import as_ref, evaluate_task, expert_task, mopd_task, round_lineage, sft_task
from tasks.teachers import serve_teachers_task, stop_teachers

Results = dict[str, dict]  # stage string ("sft", "expert:math@r2", "mopd@r2", …) → its task's result


@flow(name="full-recipe", task_runner=ThreadPoolTaskRunner(max_workers=4),
      description="sft → experts → serve_teachers → mopd → evaluate → report; cached and resumable.")
def full_recipe(
    config: str = "tiny",
    overrides: list[str] | None = None,
    name: str | None = None,
    seed: int | None = None,
    output_dir: str | None = None,
    runtime: RuntimeParams = RuntimeParams(),
    train: TrainParams = TrainParams(),
    sft: SFTParams = SFTParams(),
    rollout: RolloutParams = RolloutParams(),
    expert: ExpertParams = ExpertParams(),
    teachers: TeachersParams = TeachersParams(),
    mopd: MOPDParams = MOPDParams(),
    eval: EvalParams = EvalParams(),  # noqa: A002 - the config section's name
    refresh: list[str] | None = None,
    champion: ChampionParams = ChampionParams(),
    concurrent_experts: bool | None = None,
    rounds: int | None = None,
) -> dict:
    """Run the recipe. `config`: preset name (configs/) or YAML path; `overrides`: dotted key=value;
    section parameters override single fields; `refresh`: stages to retrain (`sft`, `expert-<d>`, `student`,
    `evaluate`, `all`; a later round's `r<r>-expert-<d>`, `r<r>-student`); `champion`: compare the last round's
    student with `<name>-student@champion` (`<name>-r<R>-student@champion` with R rounds; nightly);
    `concurrent_experts`: None = at the same time on an accelerator, or on CPU when each expert has a core
    (runtime.num_threads=1); `rounds`: MOPD rounds (empty = the preset's, 1 unless it says otherwise)."""
    sections = {k: section_dict(v) for k, v in dict(runtime=runtime, train=train, sft=sft, rollout=rollout,
                                                   expert=expert, teachers=teachers, mopd=mopd, eval=eval).items()}
    cfg, _, _ = validate_parameters("full-recipe", config, overrides, sections,
                                    {"name": name, "seed": seed, "output_dir": output_dir, "rounds": rounds},
                                    refresh=refresh)
    fresh = set(refresh or [])
    parent = open_recipe_run(cfg, "full-recipe", {"refresh": ",".join(sorted(fresh)) or "-"})
    try:
        plan = stage_plan(cfg)
        # a stage is reused (task state Cached) while its folder and MLflow run still hold its result
        results: Results = {"sft": _submit(sft_task, plan[0], cfg, {}, parent, fresh).result()}
        for experts, student in plan_rounds(plan):
            results.update(_experts(experts, cfg, results, parent, fresh, concurrent_experts))
            results[student.stage] = _student(student, cfg, results, parent, fresh)
        result = _evaluate(cfg, parent, {s.label: results[s.stage] for s in plan}, champion or ChampionParams(),
                           fresh)
    except BaseException:
        close_recipe_run(parent, "FAILED")
        raise
    close_recipe_run(parent, "FINISHED")
    return result


def _submit(task_obj, spec: StageSpec, cfg, inputs: dict, parent: str, fresh: set[str], run_name: str | None = None,
            **kw: Any):
    """`task_obj` for `spec` under its label (or `run_name`), retrained when `refresh` names it."""
    return task_obj.with_options(task_run_name=run_name or spec.label).submit(
        spec.stage, cfg, inputs, parent, "all" in fresh or spec.label in fresh, **kw)


def _inputs(spec: StageSpec, results: Results) -> dict[str, dict]:
    """The references of the models `spec` reads, from the results of the stages that made them."""
    return {role: as_ref(results[stage]) for role, stage in spec.inputs.items()}


def _lineage(spec: StageSpec, results: Results) -> dict:
    """A round r ≥ 2 stage's lineage tags (its round, the previous round's student); none in round 1."""
    return {"lineage": round_lineage(spec.stage, results[spec.parent])} if spec.parent else {}


def _experts(specs: list[StageSpec], cfg, results: Results, parent: str, fresh: set[str],
             concurrent: bool | None) -> Results:
    """One round's experts: at the same time when `tasks.common.experts_concurrently` says so, else in turn."""
    def submit(spec: StageSpec):
        return _submit(expert_task, spec, cfg, _inputs(spec, results), parent, fresh, **_lineage(spec, results))

    if experts_concurrently(cfg, concurrent):
        futures = {s.stage: submit(s) for s in specs}
        return {k: f.result() for k, f in futures.items()}
    return {s.stage: submit(s).result() for s in specs}


def _student(spec: StageSpec, cfg, results: Results, parent: str, fresh: set[str]) -> dict:
    """One round's student. teachers.backend=http: the experts' vLLM servers live from here until the student
    is trained (none when it is reused), stopped also when the stage fails."""
    refs = _inputs(spec, results)
    later = spec.round > 1
    serve = serve_teachers_task.with_options(task_run_name=round_prefix(spec.round) + "serve-teachers") \
        if later else serve_teachers_task
    served = serve(cfg, teacher_roles(refs), refs["init"], parent, "all" in fresh or spec.label in fresh,
                   **({"stage": spec.stage} if later else {}))
    try:
        inputs = {"init": refs["init"], **{f"teacher.{d}": r for d, r in served["teachers"].items()}}
        return _submit(mopd_task, spec, cfg, inputs, parent, fresh, round_prefix(spec.round) + "mopd",
                       endpoints=served["manifest"], **_lineage(spec, results)).result()
    finally:
        stop_teachers(served)  # every server it started, also when the stage failed


def _evaluate(cfg, parent: str, stages: dict[str, dict], champion: ChampionParams, fresh: set[str]) -> dict:
    """Every model of the recipe (+ the base, + the champion) evaluated, the report, the champion comparison."""
    last = last_student_label(cfg)
    champ = find_champion(cfg, champion.alias) if champion.compare else None
    models = {k: as_ref(v) for k, v in stages.items()} | ({"champion": champ} if champ else {})
    if cfg.model.base == "tiny":
        base = str((cfg.run_dir() / "base").resolve())
        models = {"base": {"ref": base, "path": base}, **models}
    ev = evaluate_task.with_options(task_run_name="evaluate").submit(
        "evaluate", cfg, models, parent, "all" in fresh or "evaluate" in fresh).result()
    report = report_task(cfg, parent, ev, stages)
    result = {"parent_run_id": parent, "stages": stages, "accuracy": ev["accuracy"], "table": ev["table"],
              "report": report}
    if champion.compare:
        result["champion"] = compare_to_champion(cfg, parent, ev["accuracy"], stages[last]["ref"],
                                                 champ and champ["ref"], champion.tolerance, champion.promote,
                                                 champion.alias, student_label=last)
    return result
