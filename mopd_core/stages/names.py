"""Stage strings, labels and folders.

A stage string names a stage of one round: "sft", "expert:<domain>", "mopd", "evaluate" are round 1 (the
single-round recipe, its folders, labels and fingerprints exactly as before rounds existed); "expert:<domain>@r2"
and "mopd@r2" are round 2's. Round r ≥ 2 lives in `<run_dir>/r<r>/` and its labels (MLflow run names, registered
models `<name>-<label>`, accuracy-table rows) carry the prefix `r<r>-`.
"""

from __future__ import annotations

from pathlib import Path

from ..config import RecipeConfig

KINDS = ("sft", "expert", "mopd", "evaluate")


def parse_stage(stage: str) -> tuple[str, str, int]:
    """"expert:math@r2" → ("expert", "math", 2); "mopd" → ("mopd", "", 1)."""
    body, sep, r = stage.partition("@r")
    kind, _, domain = body.partition(":")
    if kind not in KINDS or (sep and (not r.isdigit() or int(r) < 2 or kind not in ("expert", "mopd"))):
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


def stage_dir(recipe: RecipeConfig, stage: str) -> Path:
    """The folder a stage ("sft", "expert:<domain>", "mopd", "evaluate", "expert:<domain>@r2", "mopd@r2") writes:
    `<output_dir>/<name>/<label>`, round r ≥ 2 in `<output_dir>/<name>/r<r>/<label without the prefix>`."""
    kind, domain, rnd = parse_stage(stage)
    if kind == "evaluate":
        return recipe.run_dir()
    return round_dir(recipe, rnd) / stage_label(stage).removeprefix(round_prefix(rnd))


def expert_init_stage(rnd: int) -> str:
    """The model round `rnd`'s experts start from: SFT in round 1, else round rnd−1's student."""
    return "sft" if rnd == 1 else round_stage("mopd", rnd - 1)


def student_init_stage(recipe: RecipeConfig, rnd: int) -> str:
    """The model round `rnd`'s student starts from: SFT in round 1; later rounds per `round_student_init`."""
    if rnd == 1 or recipe.student_init_of_round() == "sft":
        return "sft"
    return round_stage("mopd", rnd - 1)


def last_student_label(recipe: RecipeConfig) -> str:
    """The label of the recipe's final student (what the nightly champion comparison judges)."""
    return stage_label(round_stage("mopd", recipe.rounds))
