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

from . import preflight
from .config import RecipeConfig, stage_fingerprint
from .errors import ConfigError
from .domains import build_domain
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
    from .domains import check_teacher_ids, load_examples_cached

    known = recipe.domain_names()
    for src in sorted({d.source for d in recipe.data.domains if not d.source.startswith("synthetic:")}):
        split = next((d.params.get("split") for d in recipe.data.domains if d.source == src), None)
        check_teacher_ids(load_examples_cached(src, split=split), known, source=src)
    specs = [d for d in recipe.data.domains if names is None or d.name in names]
    return {d.name: build_domain(d.name, d.source, d.params, eval_size=d.eval_size, seed=recipe.seed,
                                 verifier=d.verifier) for d in specs}


def model_ref_id(path: str | Path) -> str:
    """Identity of an input model for fingerprints: the producing stage's fingerprint when the path is a stage's
    `final/` dir (so a retrained upstream invalidates downstream), else the path itself."""
    from .train.checkpoint import read_stage

    p = Path(path)
    info = read_stage(p.parent) if p.name == "final" else None
    # location-free for stage outputs: a copied or moved run folder keeps every downstream stage reusable
    if info:
        return f"stage:{info['fingerprint']}:{info.get('steps')}"
    if (p / "config.json").exists():  # a checkpoint dir: its config and weight sizes, not where it lies
        import hashlib

        sizes = sorted((f.name, f.stat().st_size) for f in p.iterdir() if f.suffix in (".safetensors", ".bin"))
        return f"dir:{hashlib.sha256((p / 'config.json').read_bytes()).hexdigest()[:16]}:{sizes}"
    return str(p)  # a hub id


def base_model(recipe: RecipeConfig) -> Path | str:
    """`tiny` → build the tiny Llama + char tokenizer locally (no download); else the given id/path."""
    if recipe.model.base != "tiny":
        return recipe.model.base
    from .models import build_tiny

    return build_tiny(recipe.model, recipe.run_dir() / "base", seed=recipe.seed)


def sft_fingerprint(recipe: RecipeConfig, base: str | Path) -> str:
    sft_cfg = recipe.sft.model_dump(exclude={"eval_every", "eval_size", "logging_steps"})  # reporting only
    return stage_fingerprint("sft", recipe.seed, recipe.runtime.dtype, recipe.model, recipe.data, sft_cfg,
                             recipe.rollout.max_new_tokens, recipe.eval, model_ref_id(base))


def expert_fingerprint(recipe: RecipeConfig, domain: str, init: str | Path) -> str:
    from .train.loop import TRAJECTORY_FREE

    cfg = recipe.expert.model_copy(update={"w_kd": 0.0, "mix": None})
    return stage_fingerprint("expert", domain, recipe.seed, recipe.runtime.dtype, recipe.data, recipe.rollout,
                             cfg.model_dump(exclude={"domains"} | TRAJECTORY_FREE), recipe.eval, model_ref_id(init))


def mopd_fingerprint(recipe: RecipeConfig, student_init: str | Path, teachers: dict[str, str | Path]) -> str:
    from .train.loop import TRAJECTORY_FREE

    served = {k: model_ref_id(v) for k, v in sorted(teachers.items())}
    return stage_fingerprint("mopd", recipe.seed, recipe.runtime.dtype, recipe.data, recipe.rollout,
                             recipe.teachers.model_dump(include=TEACHER_RESULT_FIELDS),
                             recipe.mopd.model_dump(exclude=TRAJECTORY_FREE), recipe.eval,
                             model_ref_id(student_init), recipe.teachers.endpoints or served)


def sft_stage(recipe: RecipeConfig, base: str | Path | None = None, progress: bool = True) -> StageOutput:
    from .train.sft import run_sft

    t0 = time.perf_counter()
    preflight.check_stage(recipe, "sft", student=base)  # before the tiny base is built or any folder made
    base = base or base_model(recipe)
    domains = build_domains(recipe)
    fp = sft_fingerprint(recipe, base)
    res = run_sft(recipe=recipe, base_path=base, domains=domains, stage_dir=recipe.run_dir() / "sft",
                  fingerprint=fp, progress=progress)
    return StageOutput("sft", res.final_dir, recipe.run_dir() / "sft", res.eval, time.perf_counter() - t0,
                       res.history)


def expert_stage(recipe: RecipeConfig, domain: str, init: str | Path, progress: bool = True) -> StageOutput:
    """GRPO on one domain's prompts, reward = its verifier; evaluated on every domain (to see forgetting)."""
    from .train.loop import run_policy_loop

    t0 = time.perf_counter()
    all_domains = build_domains(recipe)
    if domain not in all_domains:
        raise ConfigError(f"expert domain '{domain}' is not in data.domains; known: {sorted(all_domains)}")
    preflight.check_stage(recipe, f"expert-{domain}", student=init, domains=all_domains)
    cfg = recipe.expert.model_copy(update={"w_kd": 0.0, "mix": None})
    fp = expert_fingerprint(recipe, domain, init)
    name = f"expert-{domain}"
    res = run_policy_loop(stage=name, loop_cfg=cfg, recipe=recipe, init_path=init,
                          domains={domain: all_domains[domain]}, eval_domains=all_domains,
                          stage_dir=recipe.run_dir() / name, fingerprint=fp, progress=progress)
    return StageOutput(name, res.final_dir, recipe.run_dir() / name, res.eval, time.perf_counter() - t0,
                       res.history)


# TeachersConfig fields that change the teacher signal (the rest — pools, timeouts, ports — only change how it
# is fetched) and therefore belong in the mopd stage fingerprint.
TEACHER_RESULT_FIELDS = {"backend", "routing", "mixture_kind", "mixture_weights", "domain_mixture_weights",
                         "temperature", "server_dtype"}


def teacher_max_seq_len(recipe: RecipeConfig) -> int:
    """The longest sequence a teacher scores: the student's prompt + completion budget (servers need one more)."""
    return recipe.max_seq_len()


def close_router(router) -> None:
    """Release what a router's scorers hold (HTTP clients and their thread pools); servers are not touched."""
    for t in getattr(router, "teachers", {}).values():
        close = getattr(t, "close", None)
        if close is not None:
            close()


def _serve(recipe: RecipeConfig, teachers: dict[str, str | Path], student_tok, run_dir: str | Path):
    """Start one vLLM server per teacher under `run_dir`, then pre-flight them; returns (servers, router). The
    servers are stopped again if anything fails."""
    from .models import tokenizer_fingerprint
    from .teachers.http import build_http_router
    from .teachers.serving import serve_teachers

    max_seq = teacher_max_seq_len(recipe)
    # fingerprints and the checkpoints' position limits are checked here, before any server starts
    servers = serve_teachers(teachers, recipe.teachers, run_dir, max_seq_len=max_seq,
                             student_fingerprint=tokenizer_fingerprint(student_tok))
    servers.start()
    try:
        return servers, build_http_router(servers, recipe.teachers, student_tok, max_seq_len=max_seq)
    except BaseException:
        servers.stop()
        raise


def start_teacher_servers(recipe: RecipeConfig, teachers: dict[str, str | Path], student: str | Path,
                          run_dir: str | Path, for_mopd: bool = True):
    """The `serve_teachers` stage: one vLLM OpenAI server per teacher checkpoint on 127.0.0.1 (free port,
    `--max-logprobs teachers.max_logprobs`, `--max-model-len` = prompt + completion + 1, the configured dtype,
    parallelism and GPU-memory fraction), logs under `<run_dir>/logs/`, manifest `<run_dir>/endpoints.json`.
    Pre-flight before returning: every teacher's tokenizer fingerprint equals the student's (checked before
    any start-up), each server is healthy, tokenizes a probe text like the student and accepts the student's
    longest sequence. Returns the started `serving.TeacherServers` — the caller stops it (`.stop()`); pass it
    to `mopd_stage(endpoints=…)` to train against it with supervised restarts. A previous manifest and logs
    in `run_dir` are removed first, so the folder describes these servers only. `for_mopd=False` (a serving
    check of some teachers, not a distillation run) skips the check that every domain has a teacher."""
    from .models import load_tokenizer

    if for_mopd and recipe.teachers.routing == "domain":  # a domain without a teacher fails now, not after start-up
        from .teachers import check_routing

        check_routing(recipe.domain_names(), teachers.keys())
    run_dir = Path(run_dir)
    shutil.rmtree(run_dir / "logs", ignore_errors=True)
    (run_dir / "endpoints.json").unlink(missing_ok=True)
    servers, router = _serve(recipe, teachers, load_tokenizer(student), run_dir)
    close_router(router)
    return servers


def supervise_teacher_servers(servers, seconds: float, poll_s: float = 5.0) -> dict[str, int]:
    """Keep started servers serving for `seconds`: every `poll_s` a dead one is restarted (bounded by
    teachers.restarts; then TeacherUnavailable). Returns the restarts per teacher."""
    deadline = time.monotonic() + float(seconds)
    while True:
        for tid in list(servers.servers):
            if servers.is_dead(tid):
                servers.restart(tid)
        left = deadline - time.monotonic()
        if left <= 0:
            return {tid: servers.restart_counts[tid] for tid in servers.servers}
        time.sleep(min(poll_s, left))


def check_teacher_endpoints(recipe: RecipeConfig, endpoints, student: str | Path) -> dict[str, dict]:
    """Pre-flight of existing servers (`teachers.endpoints`, a manifest or a TeacherServers): reachable, same
    tokenizer as the student, max-model-len large enough. Returns their manifest `{teacher_id: {url, model,
    fingerprint, max_model_len}}` (plus pid/log/restarts for servers started here)."""
    from .models import load_tokenizer
    from .teachers.http import build_http_router

    entries = _teacher_manifest(None, endpoints)
    router = build_http_router(endpoints, recipe.teachers, load_tokenizer(student),
                               max_seq_len=teacher_max_seq_len(recipe))
    try:
        return {tid: {**entries.get(tid, {}), "url": t.url, "model": t.model, "fingerprint": t.fingerprint,
                      "max_model_len": t.max_model_len} for tid, t in router.teachers.items()}
    finally:
        close_router(router)


def build_teachers(recipe: RecipeConfig, teachers: dict[str, str | Path], student: str | Path,
                   stage_dir: Path | None = None, endpoints=None):
    """A TeacherRouter for the configured backend, every pre-flight check done. Returns (router, servers):
    `servers` is the TeacherServers this call started (http backend, neither `endpoints` nor
    `teachers.endpoints` given), which the caller must stop; None otherwise.

    `endpoints`: teachers already running — a `serving.TeacherServers` (restarts dead servers) or a manifest
    (path or dict `{teacher_id: url | {url, …}}`); used as they are, nothing is started or stopped."""
    if endpoints is not None and recipe.teachers.backend != "http":
        from .teachers import TeacherError

        raise TeacherError("teacher endpoints were given but teachers.backend is "
                           f"'{recipe.teachers.backend}' — set teachers.backend=http")
    external = endpoints if endpoints is not None else recipe.teachers.endpoints  # TRL teacher_server_urls style
    if recipe.teachers.routing == "domain":  # before any server starts or model loads
        from .teachers import check_routing

        named = external.keys() if isinstance(external, dict) else (None if external else teachers.keys())
        if named is not None:
            check_routing(recipe.domain_names(), named)
    dinfo = devlib.resolve(recipe.runtime.device)
    if recipe.teachers.backend == "local":
        from .teachers import build_local_router

        return build_local_router(teachers, recipe.teachers, dinfo.torch_device, recipe.runtime.dtype), None
    from .models import load_tokenizer
    from .teachers.http import build_http_router

    student_tok = load_tokenizer(student)
    max_seq = teacher_max_seq_len(recipe)
    if external:
        return build_http_router(external, recipe.teachers, student_tok, max_seq_len=max_seq), None
    servers, router = _serve(recipe, teachers, student_tok, Path(stage_dir or recipe.run_dir()) / "teachers")
    return router, servers


def _teacher_manifest(servers, endpoints) -> dict:
    """What the stage's teachers were at its end (restart counts included when supervised)."""
    src = servers if servers is not None else endpoints
    if not src:
        return {}
    if hasattr(src, "manifest"):
        return src.manifest()
    if isinstance(src, (str, Path)):
        from .teachers.http import load_manifest

        return load_manifest(src)
    return {k: (v if isinstance(v, dict) else {"url": v}) for k, v in dict(src).items()}


def mopd_stage_done(recipe: RecipeConfig, student_init: str | Path, teachers: dict[str, str | Path],
                    stage_name: str = "student") -> dict | None:
    """The record of this mopd stage when its folder (or the one set aside for its fingerprint) already holds it
    finished with the configured steps: running it again would only reuse it — no teachers are needed."""
    from .train.checkpoint import stage_done

    return stage_done(recipe.run_dir() / stage_name, mopd_fingerprint(recipe, student_init, teachers),
                      recipe.mopd.steps)


def mopd_stage(recipe: RecipeConfig, student_init: str | Path, teachers: dict[str, str | Path],
               progress: bool = True, stage_name: str = "student", endpoints=None) -> StageOutput:
    """Multi-teacher on-policy distillation: the student samples on the domain mix; each sample is scored by
    its teacher (or a mixture); A = w_rl·A^R + w_kd·A^D. With `teachers.backend: http` the teachers are
    `endpoints` (already running: a `serving.TeacherServers` — supervised, dead servers are restarted — or an
    endpoint manifest path/dict; nothing is started or stopped), else `teachers.endpoints`, else vLLM servers
    started here and stopped when the stage ends (also on failure). A stage already finished with this
    fingerprint and step count is returned as it is, before any teacher is loaded or served.
    `StageOutput.teachers` is the teachers' manifest at the end (http: url, model, restarts, …)."""
    from .train.checkpoint import claim_stage
    from .train.loop import run_policy_loop

    t0 = time.perf_counter()
    domains = build_domains(recipe)
    fp = mopd_fingerprint(recipe, student_init, teachers)
    stage_dir = recipe.run_dir() / stage_name
    done = mopd_stage_done(recipe, student_init, teachers, stage_name)
    if done is not None:
        claim_stage(stage_dir, fp)  # brings back a folder set aside for this fingerprint; else a no-op
        log.info("%s: already finished (%s steps, fingerprint %s) in %s — reused, no teachers started", stage_name,
                 done.get("steps"), fp, stage_dir)
        return StageOutput(stage_name, stage_dir / "final", stage_dir, done.get("eval", {}),
                           time.perf_counter() - t0, [])
    preflight.check_stage(recipe, stage_name, student=student_init, teachers=teachers, domains=domains,
                          endpoints=endpoints)
    router, servers = (build_teachers(recipe, teachers, student_init, stage_dir, endpoints=endpoints)
                       if recipe.mopd.w_kd > 0 else (None, None))
    try:
        res = run_policy_loop(stage=stage_name, loop_cfg=recipe.mopd, recipe=recipe, init_path=student_init,
                              domains=domains, eval_domains=domains, stage_dir=stage_dir,
                              fingerprint=fp, teachers=router, progress=progress)
        manifest = (_teacher_manifest(servers, endpoints or recipe.teachers.endpoints)
                    if router is not None and recipe.teachers.backend == "http" else {})
    finally:
        if router is not None:
            close_router(router)
        if servers is not None:
            servers.stop()
    return StageOutput(stage_name, res.final_dir, stage_dir, res.eval, time.perf_counter() - t0, res.history,
                       teachers=manifest)


def grpo_baseline_stage(recipe: RecipeConfig, init: str | Path, progress: bool = True) -> StageOutput:
    """Multi-domain GRPO with MOPD's exact sampling budget (same steps, prompts, group size): the comparison
    that tells whether the teachers add anything beyond the rewards."""
    base = recipe.model_copy(deep=True)
    base.mopd = recipe.mopd.model_copy(update={"w_kd": 0.0, "w_rl": 1.0, "kd_loss": "sampled_rkl"})
    return mopd_stage(base, init, {}, progress=progress, stage_name="grpo-baseline")


def eval_stage(recipe: RecipeConfig, models: dict[str, str | Path]) -> dict[str, dict[str, dict[str, float]]]:
    from .train.loop import evaluate_checkpoint

    domains = build_domains(recipe)
    preflight.check_stage(recipe, "eval", models=models, domains=domains)
    return {label: evaluate_checkpoint(path, recipe, domains) for label, path in models.items()}


def run_recipe(recipe: RecipeConfig, progress: bool = True, restart: bool = False,
               baseline: bool = False) -> RecipeResult:
    """sft → one expert per domain → mopd (student from sft, teachers = experts) → evaluate."""
    from .evaluation import accuracy_table, plot_accuracy

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
    for d in recipe.expert_domains():
        out = expert_stage(recipe, d, outputs["sft"].model_dir, progress)
        outputs[out.stage] = out
        log.info("%s done in %.0fs", out.stage, out.wall_s)
    teachers = {d: outputs[f"expert-{d}"].model_dir for d in recipe.expert_domains()}
    outputs["student"] = mopd_stage(recipe, outputs["sft"].model_dir, teachers, progress)
    log.info("student done in %.0fs", outputs["student"].wall_s)
    if baseline:
        outputs["grpo-baseline"] = grpo_baseline_stage(recipe, outputs["sft"].model_dir, progress)
    te = time.perf_counter()
    models = {"base": base, **{k: v.model_dir for k, v in outputs.items()}}
    acc = eval_stage(recipe, models)
    wall = {k: v.wall_s for k, v in outputs.items()}
    wall["eval"] = time.perf_counter() - te
    wall["total"] = time.perf_counter() - t0
    table = accuracy_table(acc, "greedy", recipe.domain_names())
    (run_dir / "accuracy.md").write_text(table + "\n")
    plot_accuracy(acc, run_dir / "accuracy.png")
    import json

    (run_dir / "accuracy.json").write_text(json.dumps({"accuracy": acc, "wall_s": wall}, indent=2))
    return RecipeResult(outputs, acc, table, wall)
