"""The whole recipe as one flow: sft → experts (one per domain, concurrently) → serve_teachers → mopd →
evaluate → report (→ champion comparison in the nightly reproduction). With `teachers.backend: http` the
teacher servers live from serve_teachers to the end of the mopd stage and are stopped in a `finally`.
With `rounds` ≥ 2 (multi-round MOPD) experts → serve_teachers → mopd repeat once per round, round r's experts
starting from round r−1's student (`mopd_core.recipe.recipe_plan`); every round is evaluated, the last round's
student is the one the champion comparison judges."""

from __future__ import annotations


from prefect import flow

from mopd_core import recipe as R
from prefect.task_runners import ThreadPoolTaskRunner

from flows.params import (ChampionParams, EvalParams, ExpertParams, MOPDParams, RolloutParams, RuntimeParams,
                          SFTParams, TeachersParams, TrainParams, section_dict)
from tasks.common import experts_concurrently
from tasks.runs import (close_recipe_run, compare_to_champion, find_champion, open_recipe_run, report_task,
                        validate_parameters)
from tasks.stages import as_ref, evaluate_task, expert_task, mopd_task, round_lineage, sft_task
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
        by_stage = {"sft": s}  # stage string ("sft", "expert:math@r2", "mopd@r2", …) → its result
        domains = cfg.expert_domains()
        student = s
        for rnd in range(1, cfg.rounds + 1):
            parent_student = None if rnd == 1 else by_stage[R.round_stage("mopd", rnd - 1)]
            estage = {d: R.round_stage(f"expert:{d}", rnd) for d in domains}
            elabel = {d: R.stage_label(st) for d, st in estage.items()}
            einit = as_ref(by_stage[R.expert_init_stage(rnd)])
            eargs = {d: (estage[d], cfg, {"init": einit}, parent, is_fresh(elabel[d])) for d in domains}
            ekw = {"lineage": round_lineage(estage[domains[0]], parent_student)} if rnd > 1 else {}
            if experts_concurrently(cfg, concurrent_experts):
                futs = {d: opts(expert_task, elabel[d], elabel[d]).submit(*eargs[d], **ekw) for d in domains}
                experts = {d: f.result() for d, f in futs.items()}
            else:
                experts = {d: opts(expert_task, elabel[d], elabel[d]).submit(*eargs[d], **ekw).result()
                           for d in domains}
            by_stage.update({estage[d]: r for d, r in experts.items()})
            stages.update({elabel[d]: r for d, r in experts.items()})
            mstage = R.round_stage("mopd", rnd)
            mlabel = R.stage_label(mstage)
            sinit = as_ref(by_stage[R.student_init_stage(cfg, rnd)])
            # teachers.backend=http: vLLM servers from here until the student is trained (none when it is reused)
            serve = serve_teachers_task if rnd == 1 else serve_teachers_task.with_options(
                task_run_name=R.round_prefix(rnd) + "serve-teachers")
            served = serve(cfg, {d: as_ref(r) for d, r in experts.items()}, sinit, parent, is_fresh(mlabel),
                           **({"stage": mstage} if rnd > 1 else {}))
            try:
                margs = (mstage, cfg, {"init": sinit, **{f"teacher.{d}": r for d, r in served["teachers"].items()}},
                         parent, is_fresh(mlabel))
                mkw = {"endpoints": served["manifest"],
                       **({"lineage": round_lineage(mstage, parent_student)} if rnd > 1 else {})}
                student = opts(mopd_task, mlabel, R.round_prefix(rnd) + "mopd").submit(*margs, **mkw).result()
            finally:
                stop_teachers(served)  # every server it started, also when the stage failed
            by_stage[mstage] = stages[mlabel] = student
        last = R.last_student_label(cfg)
        champ = find_champion(cfg, champion.alias) if champion.compare else None
        models = {"base": None, **{k: as_ref(v) for k, v in stages.items()},
                  **({"champion": champ} if champ else {})}
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
                                                     champion.alias, student_label=last)
    except BaseException:
        close_recipe_run(parent, "FAILED")
        raise
    close_recipe_run(parent, "FINISHED")
    return result
