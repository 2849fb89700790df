"""Stage identity: the fingerprint of everything that determines a stage's result — its config sections, the
seed and the identity of its input models — never paths or cadence (save/eval/logging intervals, timeouts, ports).
`steps` is kept apart (`StageSpec.steps`): raising it continues the stage rather than starting another.

Each fingerprint takes the input models' identities (`model_ref_id`), so the same function serves the engine
(local paths) and the orchestrator's cache keys (identities it already knows) — one stage identity. Every part
added after a stage kind existed is added only when its setting is used, so the stages of older configs keep
their fingerprints (the pinned tiny fingerprints in the tests).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..config import RecipeConfig, stage_fingerprint
from ..domains.build import kind_results_version
from ..runtime import device as devlib
from .folder import model_identity, output_identity

# Settings that do not change the trajectory of the steps already taken: left out of the stage fingerprint so
# that raising `steps` continues a finished stage from its last checkpoint instead of starting over.
TRAJECTORY_FREE = {"steps", "save_every", "eval_every", "keep_checkpoints"}

# TeachersConfig fields that change the teacher signal (the rest — pools, timeouts, ports — only change how it
# is fetched) and therefore belong in the mopd stage fingerprint.
TEACHER_RESULT_FIELDS = {"backend", "routing", "mixture_kind", "mixture_weights", "domain_mixture_weights",
                         "temperature", "server_dtype", "conflict", "conflict_nats", "share_prefix"}


def model_ref_id(path: str | Path) -> str:
    """Identity of an input model for fingerprints: the producing stage's fingerprint when the path is a stage's
    `final/` dir (so a retrained upstream invalidates downstream), else the path itself."""
    p = Path(path)
    # location-free for stage outputs: a copied, moved or registered-and-downloaded model keeps every downstream
    # stage reusable (the identity file travels inside the model dir)
    info = model_identity(p) if p.is_dir() else None
    if info:
        return output_identity(info["fingerprint"], info.get("steps"))
    if (p / "config.json").exists():  # a checkpoint dir: its config and weight sizes, not where it lies
        sizes = sorted((f.name, f.stat().st_size) for f in p.iterdir() if f.suffix in (".safetensors", ".bin"))
        return f"dir:{hashlib.sha256((p / 'config.json').read_bytes()).hexdigest()[:16]}:{sizes}"
    return str(p)  # a hub id


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


def expert_loop_config(recipe: RecipeConfig):
    """The loop config an expert stage runs: the `expert` section without teachers or a domain mix."""
    return recipe.expert.model_copy(update={"w_kd": 0.0, "mix": None})


def _expert_fp(recipe: RecipeConfig, domain: str, init_id: str, rnd: int = 1) -> str:
    cfg = expert_loop_config(recipe)
    return stage_fingerprint("expert", domain, recipe.seed, recipe.runtime.dtype, data_fingerprint_part(recipe),
                             recipe.rollout,
                             cfg.model_dump(exclude={"domains"} | TRAJECTORY_FREE), recipe.eval, init_id,
                             train_fingerprint_part(recipe), *behaviour_fingerprint_part(recipe),
                             *async_fingerprint_part(recipe), *round_fingerprint_part(rnd))


def _mopd_fp(recipe: RecipeConfig, init_id: str, teacher_ids: dict[str, str], rnd: int = 1) -> str:
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
