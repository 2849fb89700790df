"""The whole recipe as one flow: sft → experts (one per domain, concurrently) → serve_teachers → mopd →
evaluate → report (→ champion comparison in the nightly reproduction). With `teachers.backend: http` the
teacher servers live from serve_teachers to the end of the mopd stage and are stopped in a `finally`."""

from __future__ import annotations


from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.params import (ChampionParams, EvalParams, ExpertParams, MOPDParams, RolloutParams, RuntimeParams,
                          SFTParams, TeachersParams, TrainParams, section_dict)
from tasks.common import experts_concurrently
from tasks.runs import (close_recipe_run, compare_to_champion, find_champion, open_recipe_run, report_task,
                        validate_parameters)
from tasks.stages import as_ref, evaluate_task, expert_task, mopd_task, sft_task
from tasks.teachers import serve_teachers_task, stop_teachers


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
) -> dict:
    """Run the recipe. `config`: preset name (configs/) or YAML path; `overrides`: dotted key=value;
    section parameters override single fields; `refresh`: stages to retrain (`sft`, `expert-<d>`, `student`,
    `evaluate`, `all`); `champion`: compare with `<name>-student@champion` (nightly); `concurrent_experts`:
    None = at the same time on an accelerator, or on CPU when each expert has a core (runtime.num_threads=1)."""
    sections = {k: section_dict(v) for k, v in dict(runtime=runtime, train=train, sft=sft, rollout=rollout,
                                                   expert=expert, teachers=teachers, mopd=mopd, eval=eval).items()}
    cfg, _, _ = validate_parameters("full-recipe", config, overrides, sections,
                                    {"name": name, "seed": seed, "output_dir": output_dir}, refresh=refresh)
    champion = champion or ChampionParams()
    fresh = set(refresh or [])

    def opts(task_obj, stage: str, run_name: str):
        return task_obj.with_options(task_run_name=run_name)

    def is_fresh(stage: str) -> bool:
        return "all" in fresh or stage in fresh

    parent = open_recipe_run(cfg, "full-recipe", {"refresh": ",".join(sorted(fresh)) or "-"})
    try:
        args = ("sft", cfg, {}, parent, is_fresh("sft"))
        # a stage is reused (task state Cached) while its folder and MLflow run still hold its result
        s = opts(sft_task, "sft", "sft").submit(*args).result()
        stages = {"sft": s}
        domains = cfg.expert_domains()
        eargs = {d: (f"expert:{d}", cfg, {"init": as_ref(s)}, parent, is_fresh(f"expert-{d}")) for d in domains}
        if experts_concurrently(cfg, concurrent_experts):
            futs = {d: opts(expert_task, f"expert-{d}", f"expert-{d}").submit(*eargs[d]) for d in domains}
            experts = {d: f.result() for d, f in futs.items()}
        else:
            experts = {d: opts(expert_task, f"expert-{d}", f"expert-{d}").submit(*eargs[d]).result()
                       for d in domains}
        stages.update({f"expert-{d}": r for d, r in experts.items()})
        # teachers.backend=http: vLLM servers from here until the student is trained (none when it is reused)
        served = serve_teachers_task(cfg, {d: as_ref(r) for d, r in experts.items()}, as_ref(s), parent,
                                     is_fresh("student"))
        try:
            margs = ("mopd", cfg, {"init": as_ref(s), **{f"teacher.{d}": r for d, r in served["teachers"].items()}},
                     parent, is_fresh("student"))
            ep = {"endpoints": served["manifest"]}
            student = opts(mopd_task, "student", "mopd").submit(*margs, **ep).result()
        finally:
            stop_teachers(served)  # every server it started, also when the stage failed
        stages["student"] = student
        champ = find_champion(cfg, champion.alias) if champion.compare else None
        models = {"base": None, "sft": as_ref(s), **{f"expert-{d}": as_ref(r) for d, r in experts.items()},
                  "student": as_ref(student), **({"champion": champ} if champ else {})}
        models = {k: v for k, v in models.items() if v is not None}
        if cfg.model.base == "tiny":
            models = {"base": {"ref": str((cfg.run_dir() / "base").resolve()),
                               "path": str((cfg.run_dir() / "base").resolve())}, **models}
        ev = opts(evaluate_task, "evaluate", "evaluate").submit("evaluate", cfg, models, parent,
                                                                is_fresh("evaluate")).result()
        report = report_task(cfg, parent, ev, stages)
        result = {"parent_run_id": parent, "stages": stages, "accuracy": ev["accuracy"], "table": ev["table"],
                  "report": report}
        if champion.compare:
            result["champion"] = compare_to_champion(cfg, parent, ev["accuracy"], student["ref"],
                                                     champ and champ["ref"], champion.tolerance, champion.promote,
                                                     champion.alias)
    except BaseException:
        close_recipe_run(parent, "FAILED")
        raise
    close_recipe_run(parent, "FINISHED")
    return result
