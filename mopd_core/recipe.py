"""Stage functions — the engine's public entry points. The CLI calls them in order (`mopd recipe`); the Prefect
tasks call the same functions one by one. Stages pass model references (checkpoint dirs), never objects.

Each stage owns `<output_dir>/<name>/<stage>/` and a fingerprint of everything that determines its result
(its config sections, the seed, and the identity of its input models). Re-running a finished stage with the
same fingerprint reuses it; an interrupted one resumes from its last checkpoint; a folder written under another
fingerprint is set aside as `<stage>@<fingerprint>`, never overwritten.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from . import preflight
from .config import RecipeConfig
from .errors import ConfigError
from .domains import DomainError, build_domain
from .models import run_tokenizer
from .runtime import device as devlib
from .stages import (StageSpec, base_identity, expert_loop_config, model_ref_id, read_stage, round_stage, stage_plan,
                     stage_spec, teacher_roles)
# the stage plan's names, where callers holding `recipe` (the CLI, benchmarks, tests) have always found them
from .stages import (TEACHER_RESULT_FIELDS, behaviour_fingerprint_part, data_fingerprint_part,  # noqa: F401
                     expert_fingerprint, last_student_label, mopd_fingerprint, parse_stage, round_dir, round_prefix,
                     sft_fingerprint, stage_dir, stage_label, train_fingerprint_part)

log = logging.getLogger("mopd")


@dataclass
class StageOutput:
    stage: str
    model_dir: Path
    stage_dir: Path
    eval: dict = field(default_factory=dict)
    wall_s: float = 0.0
    history: list = field(default_factory=list)
    teachers: dict = field(default_factory=dict)  # mopd, http backend: the teachers' manifest at the stage's end
    compat: object = None  # mopd with teachers: the compatibility pre-flight's `teachers.compat.CompatReport`
    recovery: dict = field(default_factory=dict)  # mopd: recovery per domain at the final eval (`train.roles`)
    reused: bool = False  # found finished and returned as it is: wall_s is the look-up's, not a training's


@dataclass
class RecipeResult:
    outputs: dict[str, StageOutput]
    accuracy: dict[str, dict[str, dict[str, float]]]
    table: str
    wall_s: dict[str, float]


def setup_runtime(recipe: RecipeConfig) -> None:
    from .models import quiet_hf

    quiet_hf()
    devlib.configure_threads(recipe.runtime.num_threads)
    devlib.seed_everything(recipe.seed)
    if recipe.runtime.deterministic:
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)


def build_domains(recipe: RecipeConfig, names: list[str] | None = None) -> dict:
    """Every domain of the recipe (or `names`). Dataset sources are checked whole first: a row whose
    teacher_id is no domain of the recipe is an error naming it — never silently dropped."""
    from .domains import check_teacher_ids
    from .domains.dataset import domain_examples

    known = recipe.domain_names()
    readers = recipe.dataset_readers()
    for d in recipe.data.domains:  # each with its own column map
        if not d.source.startswith("synthetic:"):
            shared = len(readers[d.source]) > 1
            try:
                rows = domain_examples(d.source, d.params, d.name, shared=shared)
            except DomainError as e:
                if shared and "teacher_id" in str(e):
                    raise DomainError(f"{e} (domains {', '.join(readers[d.source])} share this file: each row "
                                      "needs the teacher_id of its domain, or give each domain its own file)") from None
                raise
            check_teacher_ids(rows, known, source=d.source)
    specs = [d for d in recipe.data.domains if names is None or d.name in names]
    keep = overlong_prompt_filter(recipe) if recipe.data.filter_overlong_prompts else None
    return {d.name: build_domain(d.name, d.source, d.params, eval_size=d.eval_size, seed=recipe.seed,
                                 verifier=d.verifier, verifier_args=d.verifier_args,
                                 shared=len(readers.get(d.source, ())) > 1,
                                 prompt_filter=None if keep is None else
                                 (lambda exs, src, name=d.name: keep(exs, f"domain '{name}' ({src})")))
            for d in specs}


def overlong_prompt_filter(recipe: RecipeConfig):
    """`(examples, source) -> kept`: drops the prompts over data.max_prompt_tokens as the rollout renders them
    (`rollout.prompt_ids` with `data.chat`), logging the count (`domains.dataset.filter_long_prompts`)."""
    from .domains.dataset import filter_long_prompts
    from .rollout import prompt_ids

    tok = run_tokenizer(recipe.model)

    def keep(examples, source):
        lengths = {id(e): len(ids) for e, ids in zip(examples, prompt_ids(tok, examples, chat=recipe.data.chat))}
        return filter_long_prompts(examples, recipe.data.max_prompt_tokens, lambda e: lengths[id(e)],
                                   source=source)[0]
    return keep


def base_model(recipe: RecipeConfig) -> Path | str:
    """`tiny` → build the tiny Llama + char tokenizer locally (no download); else the given id/path."""
    if recipe.model.base != "tiny":
        return recipe.model.base
    from .models import build_tiny

    return build_tiny(recipe.model, recipe.run_dir() / "base", seed=recipe.seed)


def sft_stage(recipe: RecipeConfig, base: str | Path | None = None, progress: bool = True) -> StageOutput:
    from .train.sft import run_sft

    t0 = time.perf_counter()
    domains = build_domains(recipe)
    spec = stage_spec(recipe, "sft", {} if base is None else {"base": base_identity(recipe, base)})
    preflight.check_stage(recipe, spec, domains=domains, student=base)  # before the tiny base is built
    base = base or base_model(recipe)
    trainer = None
    if recipe.runtime.strategy != "single":  # TRL's Trainer in runtime.num_workers processes on Ray
        from .distributed.sft import distributed_sft

        trainer = distributed_sft(recipe)
    res = run_sft(recipe=recipe, base_path=base, domains=domains, stage_dir=spec.stage_dir,
                  fingerprint=spec.fingerprint, progress=progress, trainer=trainer)
    return StageOutput(spec.label, res.final_dir, spec.stage_dir, res.eval, time.perf_counter() - t0,
                       res.history, reused=res.reused)


def policy_trainer(recipe: RecipeConfig, loop_cfg, stage: str):
    """Where the on-policy update runs: None = in the loop's process (`runtime.strategy: single`); else Ray
    workers under DDP/FSDP2 (`distributed.trainer`; nothing starts until the loop needs it)."""
    if recipe.runtime.strategy == "single":
        return None
    from .distributed.trainer import RayPolicyTrainer

    return RayPolicyTrainer(recipe, loop_cfg, stage)


def expert_stage(recipe: RecipeConfig, domain: str, init: str | Path, progress: bool = True,
                 rnd: int = 1) -> StageOutput:
    """GRPO on one domain's prompts, reward = its verifier; evaluated on every domain (to see forgetting).
    `rnd` ≥ 2: the expert of that round (`init` = round rnd−1's student), in `<run_dir>/r<rnd>/expert-<domain>`."""
    from .train.loop import run_policy_loop

    t0 = time.perf_counter()
    all_domains = build_domains(recipe)
    if domain not in all_domains:
        raise ConfigError(f"expert domain '{domain}' is not in data.domains; known: {sorted(all_domains)}")
    spec = stage_spec(recipe, round_stage(f"expert:{domain}", rnd), {"init": model_ref_id(init)})
    preflight.check_stage(recipe, spec, student=init, domains=all_domains)
    cfg = expert_loop_config(recipe)
    res = run_policy_loop(stage=spec.label, loop_cfg=cfg, recipe=recipe, init_path=init,
                          domains={domain: all_domains[domain]}, eval_domains=all_domains,
                          stage_dir=spec.stage_dir, fingerprint=spec.fingerprint, progress=progress,
                          trainer=policy_trainer(recipe, cfg, spec.label))
    return StageOutput(spec.label, res.final_dir, spec.stage_dir, res.eval, time.perf_counter() - t0, res.history,
                       reused=res.reused)


def mopd_spec(recipe: RecipeConfig, student_init: str | Path, teachers: Mapping[str, str | Path],
              stage_name: str = "student", rnd: int = 1) -> StageSpec:
    """The spec of a mopd-kind stage from its models: the student of round `rnd` (`stage_name` "student") or
    the grpo baseline, in `<round dir>/<stage_name>`."""
    ids = {"init": model_ref_id(student_init), **{f"teacher.{k}": model_ref_id(v) for k, v in teachers.items()}}
    return stage_spec(recipe, round_stage("mopd", rnd), ids, name=stage_name)


def _finished_eval(where: Path | StageSpec) -> dict | None:
    """The final eval of a finished stage: the record beside a model (`where` = its stage folder, whatever config
    made it), or the record of a planned stage when it is finished with its fingerprint."""
    info = where.done() if isinstance(where, StageSpec) else read_stage(where)
    return info.get("eval") or None if info and info.get("status") == "done" else None


def recovery_references(recipe: RecipeConfig, student_init: str | Path, teachers: Mapping[str, str | Path],
                        rnd: int = 1):
    """The accuracies a MOPD stage's recovery is measured against, from the stages' records: each domain's
    expert (the teacher's own stage folder when it is a `final/` dir, else the recipe's expert stage of round
    `rnd`) and the SFT model (the recipe's sft stage; in round 1 also the student's own folder). With
    `mopd.stop_at_recovery` a gated domain without both is refused here, before any compute."""
    from .train.roles import RecoveryRefs

    refs = RecoveryRefs()
    plan = {s.stage: s for s in stage_plan(recipe)}
    init = Path(student_init)
    for where in ([plan["sft"]] if "sft" in plan else []) + ([init.parent] if rnd == 1 and init.name == "final"
                                                              else []):
        ev = _finished_eval(where)
        if ev is not None:
            refs.sft, refs.sources["sft"] = dict(ev), str(where.stage_dir if isinstance(where, StageSpec) else where)
            break
    for d in recipe.domain_names():
        spec = plan.get(round_stage(f"expert:{d}", rnd))
        t = Path(teachers[d]) if d in teachers else None
        for where in ([t.parent] if t is not None and t.name == "final" else []) + ([spec] if spec else []):
            ev = _finished_eval(where)
            if ev is not None and d in ev:
                folder = where.stage_dir if isinstance(where, StageSpec) else where
                refs.expert[d], refs.sources[f"expert-{d}"] = dict(ev[d]), str(folder)
                break
    missing = [d for d in recipe.mopd.recovery_targets(recipe.domain_names()) if d not in refs.domains]
    if missing:
        raise ConfigError(f"mopd.stop_at_recovery gates domain '{missing[0]}', but no finished SFT and expert-"
                          f"{missing[0]} stage records its eval (looked in {refs.sources.get('sft', 'the sft stage')} "
                          "and the expert's folder) — run the recipe's sft and expert stages first, or drop the "
                          "domain from mopd.stop_at_recovery")
    absent = [d for d in recipe.domain_names() if d not in refs.domains]
    if absent:
        log.info("recovery not logged for %s: no finished SFT / expert stage record with its eval", absent)
    return refs


def recovery_of(recipe: RecipeConfig, accuracy: Mapping[str, Mapping], row: str) -> dict[str, float]:
    """Recovery of the evaluation row `row` (a student, the champion) against the same evaluation's `sft` row and
    the last round's expert rows, per domain that has both, and `total` (`evaluation.recovery`); {} when `row` or
    `sft` was not evaluated."""
    from .evaluation import recovery

    experts = {d: stage_label(round_stage(f"expert:{d}", recipe.rounds)) for d in recipe.domain_names()}
    experts = {d: label for d, label in experts.items() if label in accuracy}
    if row not in accuracy or "sft" not in accuracy or not experts:
        return {}
    return recovery(accuracy, row, "sft", experts, domains=list(experts))


def mopd_stage_done(recipe: RecipeConfig, student_init: str | Path, teachers: dict[str, str | Path],
                    stage_name: str = "student", rnd: int = 1) -> dict | None:
    """The record of this mopd stage when its folder (or the one set aside for its fingerprint) already holds it
    finished with the configured steps: running it again would only reuse it — no teachers are needed."""
    return mopd_spec(recipe, student_init, teachers, stage_name, rnd).done()


def mopd_stage(recipe: RecipeConfig, student_init: str | Path, teachers: dict[str, str | Path],
               progress: bool = True, stage_name: str = "student", endpoints=None, rnd: int = 1,
               scorers=None) -> StageOutput:
    """Multi-teacher on-policy distillation: the student samples on the domain mix; each sample is scored by
    its teacher (or a mixture); A = w_rl·A^R + w_kd·A^D. With `teachers.backend: http` the teachers are
    `endpoints` (already running: a `serving.VllmServers` — supervised, dead servers are restarted — or an
    endpoint manifest path/dict; nothing is started or stopped), else `teachers.endpoints`, else vLLM servers
    started here and stopped when the stage ends (also on failure). A stage already finished with this
    fingerprint and step count is returned as it is, before any teacher is loaded or served.
    `StageOutput.teachers` is the teachers' manifest at the end (http: url, model, restarts, …). `rnd` ≥ 2: the
    student of that round, in `<run_dir>/r<rnd>/<stage_name>`, labelled `r<rnd>-<stage_name>`. `scorers`
    (teachers.backend local): `{name: Teacher}` built by the caller instead of loading `teachers` (e.g.
    `teachers.retokenized.RetokenizedCopy`); `teachers` still names their checkpoints (identity, pre-flight)."""
    from .teachers.lifecycle import open_teachers
    from .train.loop import final_recovery, run_policy_loop

    t0 = time.perf_counter()
    recipe.check_teacher_ids(teachers)
    domains = build_domains(recipe)
    spec = mopd_spec(recipe, student_init, teachers, stage_name, rnd)
    done = spec.done()
    if done is not None:
        spec.claim()  # brings back a folder set aside for this fingerprint; else a no-op
        log.info("%s: already finished (%s steps, fingerprint %s) in %s — reused, no teachers started", spec.label,
                 done.get("steps"), spec.fingerprint, spec.stage_dir)
        return StageOutput(spec.label, spec.stage_dir / "final", spec.stage_dir, done.get("eval", {}),
                           time.perf_counter() - t0, [], recovery=final_recovery(done), reused=True)
    preflight.check_stage(recipe, spec, student=student_init, teachers=teachers, domains=domains,
                          endpoints=endpoints)
    refs = recovery_references(recipe, student_init, teachers, rnd)  # stop_at_recovery without them: fails here
    trainer = policy_trainer(recipe, recipe.mopd, spec.label)
    local = scorers
    if recipe.mopd.w_kd > 0 and recipe.teachers.placement == "workers":  # on the trainers' devices
        from .distributed.teachers import worker_teachers

        local = worker_teachers(trainer, dict(teachers), recipe.teachers, recipe.runtime.dtype,
                                recipe.train.logprob_impl)
    ts = (open_teachers(recipe, teachers, student_init, spec.stage_dir, endpoints=endpoints, local=local)
          if recipe.mopd.w_kd > 0 else None)
    try:
        # tokenizer, chat template, EOS, determinism, log-prob mode, temperature: before the folder is claimed
        compat = preflight.check_compatibility(recipe, ts.router, student_init, domains) if ts is not None else None
        res = run_policy_loop(stage=spec.label, loop_cfg=recipe.mopd, recipe=recipe, init_path=student_init,
                              domains=domains, eval_domains=domains, stage_dir=spec.stage_dir,
                              fingerprint=spec.fingerprint, teachers=ts.router if ts is not None else None,
                              progress=progress, trainer=trainer, recovery=refs)
        manifest = ts.manifest() if ts is not None else {}
    finally:
        if ts is not None:
            ts.close()  # the scorers' clients; the servers only when this stage started them
    if compat is not None:
        (spec.stage_dir / "compat.md").write_text(compat.markdown())
    return StageOutput(spec.label, res.final_dir, spec.stage_dir, res.eval, time.perf_counter() - t0, res.history,
                       teachers=manifest, compat=compat, recovery=res.recovery, reused=res.reused)


def grpo_baseline_stage(recipe: RecipeConfig, init: str | Path, progress: bool = True) -> StageOutput:
    """Multi-domain GRPO with MOPD's exact sampling budget (same steps, prompts, group size): the comparison
    that tells whether the teachers add anything beyond the rewards."""
    base = recipe.model_copy(deep=True)
    # every step of the budget: the recovery gate would give the baseline a budget of its own
    base.mopd = recipe.mopd.model_copy(update={"w_kd": 0.0, "w_rl": 1.0, "kd_loss": "sampled_rkl",
                                               "stop_at_recovery": None})
    return mopd_stage(base, init, {}, progress=progress, stage_name="grpo-baseline")


def eval_stage(recipe: RecipeConfig, models: dict[str, str | Path], out_dir: str | Path | None = None,
               extra: dict | None = None):
    """Evaluate every model ({label: checkpoint}) on each domain's benchmarks (`eval_sources`) or held-out split;
    an `evaluation.EvalReport`. With `out_dir`: its files written there (`EvalReport.write`; `extra` goes into
    accuracy.json). Every benchmark file is read and checked before the first model loads."""
    from .evaluation import eval_report, eval_sources_of, load_benchmarks
    from .train.loop import evaluate_checkpoint

    domains = build_domains(recipe)
    sources = eval_sources_of(recipe)
    # read, validated and their verifiers built once for every model (and the pre-flight)
    benchmarks = {d: load_benchmarks(d, specs, recipe.eval.eval_size) for d, specs in sources.items()}
    spec = stage_spec(recipe, "evaluate", {k: model_ref_id(v) for k, v in models.items()})
    preflight.check_stage(recipe, spec, models=models, domains=domains, benchmarks=benchmarks)
    acc, rows = {}, []
    for label, path in models.items():
        res = evaluate_checkpoint(path, recipe, domains, benchmarks=benchmarks)
        acc[label] = res.scores
        rows.extend({"model": label, **r} for r in res.rows)
    rep = eval_report(acc, rows, recipe.domain_names(), sources)
    if out_dir is not None:
        rep.write(out_dir, extra)
    return rep


def run_planned_stage(recipe: RecipeConfig, spec: StageSpec, models: Mapping[str, str | Path],
                      progress: bool = True, base: str | Path | None = None) -> StageOutput:
    """One training stage of `stage_plan`, given the models of the stages before it ({stage string: model})."""
    paths = {role: models[s] for role, s in spec.inputs.items()}
    if spec.kind == "sft":
        return sft_stage(recipe, base, progress)
    if spec.kind == "expert":
        return expert_stage(recipe, spec.domain, paths["init"], progress, rnd=spec.round)
    return mopd_stage(recipe, paths["init"], teacher_roles(paths), progress, rnd=spec.round)


def run_recipe(recipe: RecipeConfig, progress: bool = True, restart: bool = False,
               baseline: bool = False) -> RecipeResult:
    """The stages of `stage_plan` in order — sft → one expert per domain → mopd (student from sft, teachers =
    experts), with `rounds` ≥ 2 each later round re-training every expert from the previous round's student and
    distilling a new student from them — then evaluate: every model of every round (one table row each)."""
    setup_runtime(recipe)
    run_dir = recipe.run_dir()
    domains = build_domains(recipe)  # validates every data source before any compute
    plan = stage_plan(recipe)
    preflight.check_recipe(recipe, plan, domains)  # the base model, context, prompt lengths, output_dir
    if restart and run_dir.exists():
        shutil.rmtree(run_dir)
    outputs: dict[str, StageOutput] = {}
    models: dict[str, Path] = {}  # stage string → its model
    t0 = time.perf_counter()
    base = base_model(recipe)
    for spec in plan:
        out = run_planned_stage(recipe, spec, models, progress, base=base)
        models[spec.stage], outputs[out.stage] = out.model_dir, out
        log.info("%s %s in %.0fs", out.stage, "reused (already finished)" if out.reused else "done", out.wall_s)
    if baseline:
        outputs["grpo-baseline"] = grpo_baseline_stage(recipe, outputs["sft"].model_dir, progress)
    te = time.perf_counter()
    rep = eval_stage(recipe, {"base": base, **{k: v.model_dir for k, v in outputs.items()}})
    wall = {k: v.wall_s for k, v in outputs.items()}
    wall["eval"] = time.perf_counter() - te
    wall["total"] = time.perf_counter() - t0
    rep.write(run_dir, extra={"wall_s": wall})
    return RecipeResult(outputs, rep.accuracy, rep.table, wall)
