"""Stage functions — the engine's public entry points. The CLI calls them in order (`mopd recipe`); the Prefect
tasks call the same functions one by one. Stages pass model references (checkpoint dirs), never objects.

Each stage owns `<output_dir>/<name>/<stage>/` and a fingerprint of everything that determines its result
(its config sections, the seed, and the identity of its input models). Re-running a finished stage with the
same fingerprint reuses it; an interrupted one resumes from its last checkpoint; a folder written under another
fingerprint is set aside as `<stage>@<fingerprint>`, never overwritten.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import preflight
from .config import RecipeConfig, stage_fingerprint
from .errors import ConfigError
from .domains import DomainError, build_domain
from .domains.build import kind_results_version
from .runtime import device as devlib

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


def run_tokenizer(recipe: RecipeConfig):
    """The tokenizer every stage of the recipe uses (the base model's, which SFT saves with its model; teachers
    must share it): the tiny one as `base_model` builds it (in memory, nothing written), else `model.base`'s
    loaded as the stages load it (no download)."""
    from .models import build_tiny_tokenizer, load_tokenizer

    if recipe.model.base == "tiny":
        return build_tiny_tokenizer(chat=recipe.model.tiny.chat)
    return load_tokenizer(recipe.model.base)


def overlong_prompt_filter(recipe: RecipeConfig):
    """`(examples, source) -> kept`: drops the prompts over data.max_prompt_tokens as the rollout renders them
    (`rollout.prompt_ids` with `data.chat`), logging the count (`domains.dataset.filter_long_prompts`)."""
    from .domains.dataset import filter_long_prompts
    from .rollout import prompt_ids

    tok = run_tokenizer(recipe)

    def keep(examples, source):
        lengths = {id(e): len(ids) for e, ids in zip(examples, prompt_ids(tok, examples, chat=recipe.data.chat))}
        return filter_long_prompts(examples, recipe.data.max_prompt_tokens, lambda e: lengths[id(e)],
                                   source=source)[0]
    return keep


def model_ref_id(path: str | Path) -> str:
    """Identity of an input model for fingerprints: the producing stage's fingerprint when the path is a stage's
    `final/` dir (so a retrained upstream invalidates downstream), else the path itself."""
    from .train.checkpoint import model_identity

    p = Path(path)
    # location-free for stage outputs: a copied, moved or registered-and-downloaded model keeps every downstream
    # stage reusable (the identity file travels inside the model dir)
    info = model_identity(p) if p.is_dir() else None
    if info:
        return f"stage:{info['fingerprint']}:{info.get('steps')}"
    if (p / "config.json").exists():  # a checkpoint dir: its config and weight sizes, not where it lies
        sizes = sorted((f.name, f.stat().st_size) for f in p.iterdir() if f.suffix in (".safetensors", ".bin"))
        return f"dir:{hashlib.sha256((p / 'config.json').read_bytes()).hexdigest()[:16]}:{sizes}"
    return str(p)  # a hub id


def base_model(recipe: RecipeConfig) -> Path | str:
    """`tiny` → build the tiny Llama + char tokenizer locally (no download); else the given id/path."""
    if recipe.model.base != "tiny":
        return recipe.model.base
    from .models import build_tiny

    return build_tiny(recipe.model, recipe.run_dir() / "base", seed=recipe.seed)


# Each fingerprint takes the input models' identities (`model_ref_id`), so the same function serves the engine
# (local paths) and the orchestrator's cache keys (identities it already knows) — one stage identity.
def _sft_fp(recipe: RecipeConfig, base_id: str) -> str:
    sft_cfg = recipe.sft.model_dump(exclude={"eval_every", "eval_size", "logging_steps"})  # reporting only
    return stage_fingerprint("sft", recipe.seed, recipe.runtime.dtype, recipe.model, data_fingerprint_part(recipe),
                             sft_cfg, recipe.rollout.max_new_tokens, recipe.eval, base_id,
                             *([precision_fingerprint_part(recipe)] if recipe.runtime.dtype != "float32" else []))


def train_fingerprint_part(recipe: RecipeConfig) -> dict:
    """The `train` section as the RL fingerprints take it: `max_tokens_per_micro_batch` only when set, so a config
    that does not use it keeps the identity (and the finished stages) it had before the field existed."""
    unset = {"max_tokens_per_micro_batch"} if recipe.train.max_tokens_per_micro_batch is None else set()
    unset |= set() if recipe.train.packing else {"packing"}  # likewise: configs without it keep their identity
    # recompute and where the shards live are exact: not part of the identity
    part = recipe.train.model_dump(mode="json", exclude=unset | {"gradient_checkpointing", "fsdp_cpu_offload"})
    return {**part, **precision_fingerprint_part(recipe)}


def precision_fingerprint_part(recipe: RecipeConfig) -> dict:
    """Training in bfloat16 keeps float32 master weights (`runtime.device.autocast`); stages trained before that
    held bfloat16 parameters. Marked only for a non-float32 dtype, so float32 stages keep their identity."""
    return {} if recipe.runtime.dtype == "float32" else {"master_weights": devlib.TRAIN_MASTER_DTYPE}


def data_fingerprint_part(recipe: RecipeConfig, benchmarks: bool = False) -> dict:
    """`data` as the fingerprints take it. The training stages leave each domain's `eval_sources` out: benchmarks
    change what the eval stage measures, not what a stage trains (adding AIME25 must not retrain SFT). A
    chat-template override file counts by its content, not its path (an edited template is another rendering;
    the same template moved is not). Configs without either dump as before, so their fingerprints stay."""
    d = recipe.data.model_dump(mode="json")
    for dom in d["domains"]:
        if not benchmarks:
            dom.pop("eval_sources", None)
        if (v := kind_results_version(dom.get("source"))) > 1:  # a redrawn synthetic kind; others dump as before
            dom["kind_results_version"] = v
    tpl = (d.get("chat") or {}).get("chat_template")
    if tpl:
        p = Path(tpl)
        d["chat"]["chat_template"] = ("sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()[:16]
                                      if p.is_file() else tpl)  # unreadable: the formatter names it
    return d


def behaviour_fingerprint_part(recipe: RecipeConfig) -> list[dict]:
    """With truncated sampling the policy loop recomputes the behaviour log-probs with the trainer's model (before,
    a top_p < 1 stage trained on the engine's processed ones): marked in the expert/mopd fingerprints then, and
    only then, so untruncated stages keep their identity and truncated ones are retrained, not reused."""
    return [{"behaviour_logp": "trainer_recomputed"}] if recipe.rollout.truncates else []


def async_fingerprint_part(recipe: RecipeConfig) -> list[dict]:
    """`runtime.placement: async` trains step s on samples of weight version s − k (and, for stale ones, the
    decoupled loss): its trajectory-determining settings join the expert/mopd fingerprints then, and only then.
    `queue_size` and `timeout_s` do not change which version generates a step (`train.pipeline`)."""
    if recipe.runtime.placement != "async":
        return []
    return [{"async": recipe.async_.model_dump(include={"max_staleness", "is_cap", "is_mode"})}]


def round_fingerprint_part(rnd: int) -> list[dict]:
    """A round r ≥ 2 stage samples under another stage name (`r2-expert-math`: the loop draws its prompts and
    samples from (seed, stage name, step)), so its round is part of its identity; round 1 adds nothing and keeps
    every fingerprint it had before rounds existed. The parent's identity comes in through the input model
    (`model_ref_id` of round r−1's student holds that stage's fingerprint)."""
    return [{"round": rnd}] if rnd > 1 else []


def _expert_fp(recipe: RecipeConfig, domain: str, init_id: str, rnd: int = 1) -> str:
    from .train.loop import TRAJECTORY_FREE

    cfg = recipe.expert.model_copy(update={"w_kd": 0.0, "mix": None})
    return stage_fingerprint("expert", domain, recipe.seed, recipe.runtime.dtype, data_fingerprint_part(recipe),
                             recipe.rollout,
                             cfg.model_dump(exclude={"domains"} | TRAJECTORY_FREE), recipe.eval, init_id,
                             train_fingerprint_part(recipe), *behaviour_fingerprint_part(recipe),
                             *async_fingerprint_part(recipe), *round_fingerprint_part(rnd))


def _mopd_fp(recipe: RecipeConfig, init_id: str, teacher_ids: dict[str, str], rnd: int = 1) -> str:
    from .train.loop import TRAJECTORY_FREE

    return stage_fingerprint("mopd", recipe.seed, recipe.runtime.dtype, data_fingerprint_part(recipe),
                             recipe.rollout,
                             recipe.teachers.model_dump(include=TEACHER_RESULT_FIELDS),
                             recipe.mopd.model_dump(exclude=TRAJECTORY_FREE), recipe.eval,
                             init_id, recipe.teachers.endpoints or dict(sorted(teacher_ids.items())),
                             train_fingerprint_part(recipe), *behaviour_fingerprint_part(recipe),
                             *async_fingerprint_part(recipe), *round_fingerprint_part(rnd))


def _eval_fp(recipe: RecipeConfig, model_ids: dict[str, str]) -> str:
    return stage_fingerprint("evaluate", recipe.seed, recipe.runtime.dtype,
                             data_fingerprint_part(recipe, benchmarks=True), recipe.rollout, recipe.eval,
                             dict(sorted(model_ids.items())))


def base_identity(recipe: RecipeConfig, base: str | Path | None = None) -> str:
    """Identity of the SFT stage's base model: the locally built tiny model is known from its config and seed
    before it exists (so a cache key computed before the first build equals every later one)."""
    if recipe.model.base == "tiny" and (base is None or Path(base).resolve() == (recipe.run_dir() / "base").resolve()):
        return "tiny:" + stage_fingerprint(recipe.model, recipe.seed)
    return model_ref_id(base if base is not None else recipe.model.base)


def sft_fingerprint(recipe: RecipeConfig, base: str | Path) -> str:
    return _sft_fp(recipe, base_identity(recipe, base))


def expert_fingerprint(recipe: RecipeConfig, domain: str, init: str | Path, rnd: int = 1) -> str:
    return _expert_fp(recipe, domain, model_ref_id(init), rnd)


def mopd_fingerprint(recipe: RecipeConfig, student_init: str | Path, teachers: dict[str, str | Path],
                     rnd: int = 1) -> str:
    return _mopd_fp(recipe, model_ref_id(student_init), {k: model_ref_id(v) for k, v in teachers.items()}, rnd)


@dataclass(frozen=True)
class StageIdentity:
    """What a stage's result is (fingerprint + the step count it trains to) and where it lives."""
    stage: str          # sft | expert-<domain> | student | evaluate; round r ≥ 2: r<r>-expert-<domain> | r<r>-student
    fingerprint: str
    steps: int | None   # None for evaluate
    stage_dir: Path


# ---------------------------------------------------------------- rounds (multi-round MOPD)
# A stage string names a stage of one round: "sft", "expert:<domain>", "mopd", "evaluate" are round 1 (the
# single-round recipe, its folders, labels and fingerprints exactly as before rounds existed); "expert:<domain>@r2"
# and "mopd@r2" are round 2's. Round r ≥ 2 lives in `<run_dir>/r<r>/` and its labels (MLflow run names, registered
# models `<name>-<label>`, accuracy-table rows) carry the prefix `r<r>-`.


def parse_stage(stage: str) -> tuple[str, str, int]:
    """"expert:math@r2" → ("expert", "math", 2); "mopd" → ("mopd", "", 1)."""
    body, sep, r = stage.partition("@r")
    kind, _, domain = body.partition(":")
    if kind not in ("sft", "expert", "mopd", "evaluate") or (sep and (not r.isdigit() or int(r) < 2
                                                                      or kind not in ("expert", "mopd"))):
        raise ValueError(f"unknown stage {stage!r}")  # a caller's bug, not user input
    return kind, domain, int(r) if sep else 1


def round_stage(stage: str, rnd: int) -> str:
    """The stage string of `stage` ("expert:<domain>", "mopd") in round `rnd`."""
    return stage if rnd == 1 else f"{stage}@r{rnd}"


def round_prefix(rnd: int) -> str:
    return "" if rnd == 1 else f"r{rnd}-"


def round_dir(recipe: RecipeConfig, rnd: int) -> Path:
    """Where round `rnd`'s experts and student live: the run folder itself for round 1, else `<run_dir>/r<rnd>`."""
    return recipe.run_dir() if rnd == 1 else recipe.run_dir() / f"r{rnd}"


def stage_label(stage: str) -> str:
    """How a stage is named in folders, tables, MLflow runs and registered models (`<name>-<label>`):
    sft, expert-math, student; round 2: r2-expert-math, r2-student."""
    kind, domain, rnd = parse_stage(stage)
    base = {"sft": "sft", "expert": f"expert-{domain}", "mopd": "student", "evaluate": "evaluate"}[kind]
    return round_prefix(rnd) + base


def expert_init_stage(rnd: int) -> str:
    """The model round `rnd`'s experts start from: SFT in round 1, else round rnd−1's student."""
    return "sft" if rnd == 1 else round_stage("mopd", rnd - 1)


def student_init_stage(recipe: RecipeConfig, rnd: int) -> str:
    """The model round `rnd`'s student starts from: SFT in round 1; later rounds per `round_student_init`."""
    if rnd == 1 or recipe.student_init_of_round() == "sft":
        return "sft"
    return round_stage("mopd", rnd - 1)


def recipe_plan(recipe: RecipeConfig) -> list[tuple[str, dict[str, str]]]:
    """The training stages in the order they run, each with its inputs as stage strings: `init` and, for a
    student, `teacher.<domain>` (SFT's base model is implicit). One round: sft, experts, mopd — as before."""
    plan: list[tuple[str, dict[str, str]]] = [("sft", {})]
    for rnd in range(1, recipe.rounds + 1):
        experts = {d: round_stage(f"expert:{d}", rnd) for d in recipe.expert_domains()}
        plan += [(s, {"init": expert_init_stage(rnd)}) for s in experts.values()]
        plan.append((round_stage("mopd", rnd), {"init": student_init_stage(recipe, rnd),
                                                 **{f"teacher.{d}": s for d, s in experts.items()}}))
    return plan


def last_student_label(recipe: RecipeConfig) -> str:
    """The label of the recipe's final student (what the nightly champion comparison judges)."""
    return stage_label(round_stage("mopd", recipe.rounds))


def stage_dir(recipe: RecipeConfig, stage: str) -> Path:
    """The folder a stage ("sft", "expert:<domain>", "mopd", "evaluate", "expert:<domain>@r2", "mopd@r2") writes:
    `<output_dir>/<name>/<label>`, round r ≥ 2 in `<output_dir>/<name>/r<r>/<label without the prefix>`."""
    kind, domain, rnd = parse_stage(stage)
    if kind == "evaluate":
        return recipe.run_dir()
    return round_dir(recipe, rnd) / stage_label(stage).removeprefix(round_prefix(rnd))


def stage_identity(recipe: RecipeConfig, stage: str, input_ids: dict[str, str]) -> StageIdentity:
    """The identity of `stage` ("sft", "expert:<domain>", "mopd", "evaluate", or a later round's
    "expert:<domain>@r<r>", "mopd@r<r>") from its inputs' identities (`model_ref_id` of each input: `base`/`init`,
    `teacher.<domain>`, or eval labels). Paths and cadence fields (save/eval/logging intervals, timeouts, ports)
    are no part of it; `steps` is kept apart because raising it continues the stage (same fingerprint) rather
    than starting another."""
    kind, domain, rnd = parse_stage(stage)
    where = stage_dir(recipe, stage)
    label = stage_label(stage)
    if kind == "sft":
        base = input_ids.get("base") or base_identity(recipe)
        return StageIdentity("sft", _sft_fp(recipe, base), recipe.sft.steps, where)
    if kind == "expert":
        return StageIdentity(label, _expert_fp(recipe, domain, input_ids["init"], rnd), recipe.expert.steps, where)
    if kind == "mopd":
        teachers = {k.split(".", 1)[1]: v for k, v in input_ids.items() if k.startswith("teacher.")}
        return StageIdentity(label, _mopd_fp(recipe, input_ids["init"], teachers, rnd), recipe.mopd.steps, where)
    return StageIdentity("evaluate", _eval_fp(recipe, dict(input_ids)), None, where)


def sft_stage(recipe: RecipeConfig, base: str | Path | None = None, progress: bool = True) -> StageOutput:
    from .train.sft import run_sft

    t0 = time.perf_counter()
    preflight.check_stage(recipe, "sft", student=base)  # before the tiny base is built or any folder made
    base = base or base_model(recipe)
    domains = build_domains(recipe)
    fp = sft_fingerprint(recipe, base)
    trainer = None
    if recipe.runtime.strategy != "single":  # TRL's Trainer in runtime.num_workers processes on Ray
        from .distributed.sft import distributed_sft

        trainer = distributed_sft(recipe)
    res = run_sft(recipe=recipe, base_path=base, domains=domains, stage_dir=recipe.run_dir() / "sft",
                  fingerprint=fp, progress=progress, trainer=trainer)
    return StageOutput("sft", res.final_dir, recipe.run_dir() / "sft", res.eval, time.perf_counter() - t0,
                       res.history)


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
    stage = round_stage(f"expert:{domain}", rnd)
    name, where = stage_label(stage), stage_dir(recipe, stage)
    preflight.check_stage(recipe, f"expert-{domain}", student=init, domains=all_domains, stage_dir=where)
    cfg = recipe.expert.model_copy(update={"w_kd": 0.0, "mix": None})
    fp = expert_fingerprint(recipe, domain, init, rnd)
    res = run_policy_loop(stage=name, loop_cfg=cfg, recipe=recipe, init_path=init,
                          domains={domain: all_domains[domain]}, eval_domains=all_domains,
                          stage_dir=where, fingerprint=fp, progress=progress,
                          trainer=policy_trainer(recipe, cfg, name))
    return StageOutput(name, res.final_dir, where, res.eval, time.perf_counter() - t0, res.history)


# TeachersConfig fields that change the teacher signal (the rest — pools, timeouts, ports — only change how it
# is fetched) and therefore belong in the mopd stage fingerprint.
TEACHER_RESULT_FIELDS = {"backend", "routing", "mixture_kind", "mixture_weights", "domain_mixture_weights",
                         "temperature", "server_dtype", "conflict", "conflict_nats"}


def mopd_stage_done(recipe: RecipeConfig, student_init: str | Path, teachers: dict[str, str | Path],
                    stage_name: str = "student", rnd: int = 1) -> dict | None:
    """The record of this mopd stage when its folder (or the one set aside for its fingerprint) already holds it
    finished with the configured steps: running it again would only reuse it — no teachers are needed."""
    from .train.checkpoint import stage_done

    return stage_done(round_dir(recipe, rnd) / stage_name, mopd_fingerprint(recipe, student_init, teachers, rnd),
                      recipe.mopd.steps)


def mopd_stage(recipe: RecipeConfig, student_init: str | Path, teachers: dict[str, str | Path],
               progress: bool = True, stage_name: str = "student", endpoints=None, rnd: int = 1) -> StageOutput:
    """Multi-teacher on-policy distillation: the student samples on the domain mix; each sample is scored by
    its teacher (or a mixture); A = w_rl·A^R + w_kd·A^D. With `teachers.backend: http` the teachers are
    `endpoints` (already running: a `serving.VllmServers` — supervised, dead servers are restarted — or an
    endpoint manifest path/dict; nothing is started or stopped), else `teachers.endpoints`, else vLLM servers
    started here and stopped when the stage ends (also on failure). A stage already finished with this
    fingerprint and step count is returned as it is, before any teacher is loaded or served.
    `StageOutput.teachers` is the teachers' manifest at the end (http: url, model, restarts, …). `rnd` ≥ 2: the
    student of that round, in `<run_dir>/r<rnd>/<stage_name>`, labelled `r<rnd>-<stage_name>`."""
    from .teachers.lifecycle import open_teachers
    from .train.checkpoint import claim_stage
    from .train.loop import run_policy_loop

    t0 = time.perf_counter()
    domains = build_domains(recipe)
    fp = mopd_fingerprint(recipe, student_init, teachers, rnd)
    stage_dir = round_dir(recipe, rnd) / stage_name
    label = round_prefix(rnd) + stage_name
    done = mopd_stage_done(recipe, student_init, teachers, stage_name, rnd)
    if done is not None:
        claim_stage(stage_dir, fp)  # brings back a folder set aside for this fingerprint; else a no-op
        log.info("%s: already finished (%s steps, fingerprint %s) in %s — reused, no teachers started", label,
                 done.get("steps"), fp, stage_dir)
        return StageOutput(label, stage_dir / "final", stage_dir, done.get("eval", {}),
                           time.perf_counter() - t0, [])
    preflight.check_stage(recipe, stage_name, student=student_init, teachers=teachers, domains=domains,
                          endpoints=endpoints, stage_dir=stage_dir)
    trainer = policy_trainer(recipe, recipe.mopd, label)
    local = None
    if recipe.mopd.w_kd > 0 and recipe.teachers.placement == "workers":  # on the trainers' devices
        from .distributed.teachers import worker_teachers

        local = worker_teachers(trainer, dict(teachers), recipe.teachers, recipe.runtime.dtype,
                                recipe.train.logprob_impl)
    ts = (open_teachers(recipe, teachers, student_init, stage_dir, endpoints=endpoints, local=local)
          if recipe.mopd.w_kd > 0 else None)
    try:
        res = run_policy_loop(stage=label, loop_cfg=recipe.mopd, recipe=recipe, init_path=student_init,
                              domains=domains, eval_domains=domains, stage_dir=stage_dir,
                              fingerprint=fp, teachers=ts.router if ts is not None else None, progress=progress,
                              trainer=trainer)
        manifest = ts.manifest() if ts is not None else {}
    finally:
        if ts is not None:
            ts.close()  # the scorers' clients; the servers only when this stage started them
    return StageOutput(label, res.final_dir, stage_dir, res.eval, time.perf_counter() - t0, res.history,
                       teachers=manifest)


def grpo_baseline_stage(recipe: RecipeConfig, init: str | Path, progress: bool = True) -> StageOutput:
    """Multi-domain GRPO with MOPD's exact sampling budget (same steps, prompts, group size): the comparison
    that tells whether the teachers add anything beyond the rewards."""
    base = recipe.model_copy(deep=True)
    base.mopd = recipe.mopd.model_copy(update={"w_kd": 0.0, "w_rl": 1.0, "kd_loss": "sampled_rkl"})
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
    preflight.check_stage(recipe, "eval", models=models, domains=domains, benchmarks=benchmarks)
    acc, rows = {}, []
    for label, path in models.items():
        res = evaluate_checkpoint(path, recipe, domains, benchmarks=benchmarks)
        acc[label] = res.scores
        rows.extend({"model": label, **r} for r in res.rows)
    rep = eval_report(acc, rows, recipe.domain_names(), sources)
    if out_dir is not None:
        rep.write(out_dir, extra)
    return rep


def run_recipe(recipe: RecipeConfig, progress: bool = True, restart: bool = False,
               baseline: bool = False) -> RecipeResult:
    """sft → one expert per domain → mopd (student from sft, teachers = experts) → evaluate. With `rounds` ≥ 2
    each later round re-trains every expert from the previous round's student and distils a new student from
    them (`recipe_plan`); every model of every round is evaluated (one table row each)."""

    setup_runtime(recipe)
    run_dir = recipe.run_dir()
    build_domains(recipe)  # validates every data source before any compute
    preflight.check_stage(recipe, "recipe")  # the base model, context, prompt lengths, output_dir
    if restart and run_dir.exists():
        shutil.rmtree(run_dir)
    outputs: dict[str, StageOutput] = {}
    t0 = time.perf_counter()
    base = base_model(recipe)
    outputs["sft"] = sft_stage(recipe, base, progress)
    log.info("sft done in %.0fs", outputs["sft"].wall_s)
    done = {"sft": outputs["sft"]}  # by stage string
    for stage, inputs in recipe_plan(recipe)[1:]:
        kind, domain, rnd = parse_stage(stage)
        init = done[inputs["init"]].model_dir
        if kind == "expert":
            out = expert_stage(recipe, domain, init, progress, rnd=rnd)
        else:
            teachers = {k.split(".", 1)[1]: done[v].model_dir for k, v in inputs.items() if k.startswith("teacher.")}
            out = mopd_stage(recipe, init, teachers, progress, rnd=rnd)
        done[stage] = outputs[out.stage] = out
        log.info("%s done in %.0fs", out.stage, out.wall_s)
    if baseline:
        outputs["grpo-baseline"] = grpo_baseline_stage(recipe, outputs["sft"].model_dir, progress)
    te = time.perf_counter()
    models = {"base": base, **{k: v.model_dir for k, v in outputs.items()}}
    rep = eval_stage(recipe, models)
    wall = {k: v.wall_s for k, v in outputs.items()}
    wall["eval"] = time.perf_counter() - te
    wall["total"] = time.perf_counter() - t0
    rep.write(run_dir, extra={"wall_s": wall})
    acc, table = rep.accuracy, rep.table
    return RecipeResult(outputs, acc, table, wall)
