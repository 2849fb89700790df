"""Flow parameters as pydantic models, derived from `mopd_core.config`, so the Prefect UI renders a form with
the engine's own field descriptions.

A section parameter (`sft`, `mopd`, …) has every field of its config model, each optional: a field left empty
keeps the preset's value, a field filled in overrides it. Order of application: the preset (`config`: a name in
configs/ or a YAML path) → `overrides` (dotted `key=value`, e.g. `model.tiny.hidden_size=64`) → the section
parameters → `name` / `seed` / `output_dir`. The merged config is validated by `mopd_core.config` before any
stage starts; an error names the parameter.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, model_serializer
from pydantic.json_schema import SkipJsonSchema

from mopd_core.config import (EvalConfig, ExpertRLConfig, MOPDConfig, RolloutConfig, RuntimeConfig, SFTConfig,
                              TeachersConfig, TrainConfig)


class _Partial(BaseModel):
    """Serialises without the empty fields: `SFTParams()` is `{}` (a deployment's default and the UI form then
    hold only what someone filled in)."""

    model_config = ConfigDict(extra="forbid")

    @model_serializer(mode="wrap")
    def _drop_empty(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


def _no_default(schema: dict) -> None:
    # no `"default": null` in the schema: the UI would put null into the form and reject it as not an integer
    schema.pop("default", None)


def partial_model(model: type[BaseModel], name: str, doc: str) -> type[BaseModel]:
    """`model` with every field optional (None = keep the preset's value), same descriptions. The JSON schema
    shows the field's own type (None is accepted but hidden), so the UI renders a plain input left empty."""
    fields: dict[str, Any] = {}
    for fname, f in model.model_fields.items():
        # a section inside a section (teachers.compat) has a default factory, not a default to show
        default = (f.default if f.default_factory is None and f.default is not None and not callable(f.default)
                   else None)
        desc = (f.description or "") + (f" (config default: {default})" if default is not None else "")
        fields[fname] = (Union[f.annotation, SkipJsonSchema[None]],
                         Field(None, description=desc.strip(), json_schema_extra=_no_default))
    m = create_model(name, __base__=_Partial, __doc__=doc, **fields)
    m.__module__ = __name__
    return m


RuntimeParams = partial_model(RuntimeConfig, "RuntimeParams",
                              "Device, dtype, threads, workers and sharding (empty = preset).")
TrainParams = partial_model(TrainConfig, "TrainParams",
                            "How the updates compute: log-probs, micro-batches, checkpointing (empty = preset).")
SFTParams = partial_model(SFTConfig, "SFTParams", "Mixed-domain SFT (empty = preset).")
RolloutParams = partial_model(RolloutConfig, "RolloutParams", "Sampling of the policy (empty = preset).")
ExpertParams = partial_model(ExpertRLConfig, "ExpertParams", "Per-domain expert GRPO (empty = preset).")
TeachersParams = partial_model(TeachersConfig, "TeachersParams", "Teacher scoring/routing (empty = preset).")
MOPDParams = partial_model(MOPDConfig, "MOPDParams", "Multi-teacher on-policy distillation (empty = preset).")
EvalParams = partial_model(EvalConfig, "EvalParams", "Held-out evaluation (empty = preset).")

SECTION_MODELS = {"runtime": RuntimeParams, "train": TrainParams, "sft": SFTParams, "rollout": RolloutParams,
                  "expert": ExpertParams, "teachers": TeachersParams, "mopd": MOPDParams, "eval": EvalParams}


class ChampionParams(BaseModel):
    """Nightly reproduction: compare the new student with the registered `<recipe>-student@champion`."""

    model_config = ConfigDict(extra="forbid")
    compare: bool = Field(False, description="Evaluate the champion next to the new student and compare.")
    tolerance: float = Field(0.05, ge=0, le=1, description="Largest allowed per-domain accuracy drop "
                             "(fraction, 0.05 = 5 points); a bigger drop fails the run.")
    promote: bool = Field(True, description="When no domain regressed, alias the new student `@champion`.")
    alias: str = Field("champion", description="The alias compared against and moved.")


def section_dict(value: Any) -> dict:
    """A section parameter (model, dict or None) → only the fields that were filled in."""
    if value is None:
        return {}
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return {k: v for k, v in dict(value).items() if v is not None}
