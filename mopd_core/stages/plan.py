"""The stage plan: one `StageSpec` per stage — what it is (kind, round, domain), what it reads (its inputs as
stage strings and as model identities), what its result is (fingerprint + steps) and where it lives — and
`stage_plan`, the recipe's training stages in the order they run. The CLI's `run_recipe`, the `full-recipe`
Prefect flow, the stage tasks and the pre-flight all walk these specs; none computes a stage's identity or
folder on its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import RecipeConfig
from .identity import _eval_fp, _expert_fp, _mopd_fp, _sft_fp, base_identity
from .folder import claim_stage, output_identity, resume_step, stage_done
from .names import (expert_init_stage, parse_stage, round_dir, round_prefix, round_stage, stage_dir, stage_label,
                    student_init_stage)


@dataclass(frozen=True)
class StageSpec:
    """One stage of a recipe (or one started on its own)."""
    stage: str                # sft | expert:<d> | mopd | evaluate; round r ≥ 2: expert:<d>@r<r> | mopd@r<r>
    kind: str                 # sft | expert | mopd | evaluate
    domain: str               # an expert's domain, else ""
    round: int
    label: str                # sft | expert-<d> | student | evaluate; round r ≥ 2: r<r>-expert-<d> | r<r>-student
    fingerprint: str
    steps: int | None         # None for evaluate
    stage_dir: Path
    input_ids: dict[str, str] = field(default_factory=dict)  # role → model identity (`model_ref_id`)
    inputs: dict[str, str] = field(default_factory=dict)     # role → producing stage (plan only): init, teacher.<d>

    @property
    def output_id(self) -> str:
        """The identity of the model this stage produces (what its consumers' fingerprints take)."""
        return output_identity(self.fingerprint, self.steps)

    @property
    def parent(self) -> str | None:
        """The previous round's student a round r ≥ 2 stage descends from (lineage); None in round 1."""
        return None if self.round == 1 else round_stage("mopd", self.round - 1)

    @property
    def preflight_name(self) -> str:
        """How the pre-flight's messages and memory estimate name the stage: sft, expert-<d>, a student's label
        without its round, eval."""
        return {"sft": "sft", "expert": f"expert-{self.domain}", "evaluate": "eval"}.get(
            self.kind, self.label.removeprefix(round_prefix(self.round)))

    def done(self) -> dict | None:
        """The record of this stage finished (in its folder or set aside for its fingerprint), else None."""
        return stage_done(self.stage_dir, self.fingerprint, self.steps)

    def claim(self, meta: dict | None = None) -> dict | None:
        """Make the folder this stage's: a folder of another fingerprint set aside, one of this brought back."""
        return claim_stage(self.stage_dir, self.fingerprint, meta)

    def resume_step(self) -> int:
        """The step an interrupted run of this stage resumes from (0: starts afresh or is finished)."""
        return resume_step(self.stage_dir, self.fingerprint, self.steps)


def teacher_roles(inputs: dict) -> dict:
    """{domain: v} of the `teacher.<domain>` entries of a stage's inputs."""
    return {k.split(".", 1)[1]: v for k, v in inputs.items() if k.startswith("teacher.")}


def stage_spec(recipe: RecipeConfig, stage: str, input_ids: dict[str, str], inputs: dict[str, str] | None = None,
               *, name: str | None = None) -> StageSpec:
    """The spec of `stage` from its inputs' identities (`model_ref_id` of each input: `base`/`init`,
    `teacher.<domain>`, or eval labels; SFT's base defaults to `model.base`'s). `name`: a mopd-kind stage under
    its own name (the grpo baseline), labelled `<round prefix><name>` in `<round dir>/<name>`."""
    kind, domain, rnd = parse_stage(stage)
    ids = dict(input_ids)
    if kind == "sft":
        fp, steps = _sft_fp(recipe, ids.get("base") or base_identity(recipe)), recipe.sft.steps
    elif kind == "expert":
        fp, steps = _expert_fp(recipe, domain, ids["init"], rnd), recipe.expert.steps
    elif kind == "mopd":
        fp, steps = _mopd_fp(recipe, ids["init"], teacher_roles(ids), rnd), recipe.mopd.steps
    else:
        fp, steps = _eval_fp(recipe, ids), None
    label = stage_label(stage) if name is None else round_prefix(rnd) + name
    folder = stage_dir(recipe, stage) if name is None else round_dir(recipe, rnd) / name
    return StageSpec(stage, kind, domain, rnd, label, fp, steps, folder, ids, dict(inputs or {}))


def stage_plan(recipe: RecipeConfig) -> list[StageSpec]:
    """The recipe's training stages in the order they run: sft, then per round one expert per domain and the
    student. Each spec's inputs name the stages it reads (`init`; a student's `teacher.<domain>`; SFT's base is
    `model.base`) and its identity is chained from theirs, so every fingerprint is known before anything runs.
    Round r's experts start from round r−1's student; its student per `round_student_init`."""
    plan = [stage_spec(recipe, "sft", {})]
    made = {"sft": plan[0]}

    def add(stage: str, inputs: dict[str, str]) -> None:
        made[stage] = stage_spec(recipe, stage, {k: made[v].output_id for k, v in inputs.items()}, inputs)
        plan.append(made[stage])

    for rnd in range(1, recipe.rounds + 1):
        experts = {d: round_stage(f"expert:{d}", rnd) for d in recipe.expert_domains()}
        for s in experts.values():
            add(s, {"init": expert_init_stage(rnd)})
        add(round_stage("mopd", rnd), {"init": student_init_stage(recipe, rnd),
                                       **{f"teacher.{d}": s for d, s in experts.items()}})
    return plan


def plan_rounds(plan: list[StageSpec]) -> list[tuple[list[StageSpec], StageSpec]]:
    """The plan after SFT as (experts, student) per round, in order."""
    return [([s for s in plan if s.kind == "expert" and s.round == r],
             next(s for s in plan if s.kind == "mopd" and s.round == r))
            for r in sorted({s.round for s in plan if s.kind == "mopd"})]
