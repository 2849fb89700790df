"""LoRA on the policy through PEFT (`expert.lora` / `mopd.lora`, `config.LoRAConfig`).

PEFT's `inject_adapter_in_model` puts its `lora.Linear` layers into the transformers model in place and freezes
every other parameter, so the loop keeps handling one plain `PreTrainedModel` (its `base_model` backbone, its
`lm_head`, `generate`-free sampling, gradient checkpointing) — no `PeftModel` wrapper whose `base_model` means
something else. What differs is what leaves the process:

- the weights handed to a rollout engine and saved as `final/` are the merged ones, `W + (α/r)·B·A` per adapted
  layer computed by PEFT's own `get_delta_weight` one layer at a time, under the base model's parameter names
  (`export_state_dict`): teachers, servers and the next stage load a plain HF model, no peft needed;
- a checkpoint holds only the adapter (`adapter/`: PEFT's `adapter_config.json` + `adapter_model.safetensors`,
  loadable by `PeftModel.from_pretrained` too) beside the optimizer state of the adapter parameters; resuming
  rebuilds base + adapter from the stage's input model.

Merging is never done in place (`merge_adapter`/`unmerge_adapter`): W + Δ − Δ is not W in floating point, and
the frozen base must stay bit-identical for the whole stage.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_ADAPTER = "default"  # PEFT's adapter name; one adapter per model here
# the key prefix `PeftModel.save_pretrained` writes (its wrapper's path to the model): our files load there too
_PEFT_PREFIX = "base_model.model."


def peft_config(cfg, base_name: str | None = None):
    """`config.LoRAConfig` → `peft.LoraConfig` (target_modules None = PEFT's `all-linear`: every linear layer but
    the output head)."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=list(cfg.target_modules) if cfg.target_modules else "all-linear",
                      bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_name)


def add_lora(model, cfg):
    """Inject fresh adapters into `model` in place (B = 0: the model computes exactly what it did) and freeze
    every base parameter. Returns the same model object. A `target_modules` entry that matches nothing is a
    `ConfigError` (PEFT's ValueError, one line)."""
    from peft import inject_adapter_in_model

    from ..errors import ConfigError

    try:
        name = getattr(model, "name_or_path", None)  # lib: transformers (a module built in memory has none)
        return inject_adapter_in_model(peft_config(cfg, name), model, adapter_name=_ADAPTER)
    except ValueError as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ConfigError(f"lora.target_modules={cfg.target_modules}: {first} — name modules of the model "
                          "(e.g. q_proj, v_proj) or leave it unset for every linear layer") from None


def lora_layers(model) -> dict[str, Any]:
    """{module name: PEFT LoRA layer} of `model` (empty for a model without adapters)."""
    if "peft" not in sys.modules:  # no adapter can exist before peft is imported: plain runs never import it
        return {}
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_lora(model) -> bool:
    return bool(lora_layers(model))


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """What the optimizer steps: every parameter of a plain model, the adapters of a LoRA one."""
    return [p for p in model.parameters() if p.requires_grad]


@torch.no_grad()
def export_state_dict(model) -> dict[str, torch.Tensor]:
    """The weights other processes and files get: `model.state_dict()` for a plain model; for a LoRA one the
    merged weights under the base model's names (`…q_proj.weight`, no `base_layer`/`lora_` keys). Only the adapted
    layers' merged tensors are new memory (one per adapted layer, as each is needed; the rest are the model's own
    tensors, as `state_dict()` gives them)."""
    layers = lora_layers(model)
    sd = model.state_dict()
    if not layers:
        return sd
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        owner = _owner(key, layers)
        if owner is None:
            out[key] = t
            continue
        rest = key[len(owner) + 1:]
        if not rest.startswith("base_layer."):
            continue  # lora_A / lora_B / … : folded into the base weight below
        name = f"{owner}.{rest[len('base_layer.'):]}"
        if rest == "base_layer.weight":
            # PEFT's own delta (scaling, fan_in_fan_out), added in at least float32 (bfloat16 bases) and cast back
            acc = torch.promote_types(t.dtype, torch.float32)
            t = (t.to(acc) + layers[owner].get_delta_weight(_ADAPTER).to(acc)).to(t.dtype)
        out[name] = t
    return out


def merged_copy(model):
    """A plain copy of a LoRA model (every PEFT layer replaced by its base layer) holding the merged weights, frozen,
    in eval mode: what an in-process engine samples from (`rollout.backend: hf`), at the speed of the plain model
    (no adapter matmuls per layer). Costs one more copy of the weights; `refresh_merged` keeps it current."""
    import copy

    out = copy.deepcopy(model)
    for name, layer in lora_layers(out).items():  # PEFT's unload, without merging into the trained model
        parent, _, child = name.rpartition(".")
        setattr(out.get_submodule(parent) if parent else out, child, layer.get_base_layer())
    if hasattr(out, "peft_config"):  # lib: peft
        del out.peft_config
    out.requires_grad_(False).eval()
    refresh_merged(out, model)
    return out


@torch.no_grad()
def refresh_merged(copy_model, model) -> int:
    """Write `model`'s merged weights into `merged_copy`'s adapted layers (the rest is the frozen base, equal
    already). Returns the bytes written."""
    n = 0
    for name, layer in lora_layers(model).items():
        w = layer.get_base_layer().weight
        acc = torch.promote_types(w.dtype, torch.float32)
        dst = copy_model.get_submodule(name).weight
        dst.copy_((w.to(acc) + layer.get_delta_weight(_ADAPTER).to(acc)).to(w.dtype))
        n += dst.numel() * dst.element_size()
    return n


def _owner(key: str, layers: dict[str, Any]) -> str | None:
    """The LoRA layer a state-dict key belongs to (its module path is a prefix of the key)."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in layers:
            return prefix
    return None


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, in PEFT's file naming (`…q_proj.lora_A.weight`)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=_ADAPTER)


def save_adapter(model, out_dir: str | Path) -> Path:
    """Write the adapter as `PeftModel.save_pretrained` does (`adapter_config.json` + `adapter_model.safetensors`,
    keys under `base_model.model.`), so `PeftModel.from_pretrained(base, dir)` loads it too."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {_PEFT_PREFIX + k: v.detach().to("cpu").contiguous() for k, v in adapter_state_dict(model).items()}
    save_file(sd, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    model.peft_config[_ADAPTER].save_pretrained(str(out))
    return out


def load_adapter(model, adapter_dir: str | Path) -> None:
    """Load a `save_adapter` folder into a model that already holds adapters of the same shape (`add_lora` with
    the same config). Every adapter tensor must be found: a mismatch is a `ModelError`."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from ..errors import ModelError

    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.exists():
        raise ModelError(f"'{adapter_dir}' holds no LoRA adapter ({ADAPTER_WEIGHTS}) — resume from a checkpoint "
                         "of a LoRA stage or restart the stage (move its folder away; `mopd recipe --restart`)")
    sd = {k.removeprefix(_PEFT_PREFIX): v for k, v in load_file(str(path)).items()}
    want = set(adapter_state_dict(model))
    if set(sd) != want:
        raise ModelError(f"the adapter in '{adapter_dir}' does not match the configured LoRA layers ({len(sd)} "
                         f"tensors, {len(want)} expected) — resume with the lora settings it was trained with or "
                         "restart the stage (move its folder away; `mopd recipe --restart`)")
    res = set_peft_model_state_dict(model, sd, adapter_name=_ADAPTER)
    bad = [k for k in getattr(res, "unexpected_keys", []) if "lora_" in k]  # lib: torch/peft load results
    if bad:
        raise ModelError(f"the adapter in '{adapter_dir}' has tensors the model lacks ({bad[0]}, …) — restart the "
                         "stage (move its folder away; `mopd recipe --restart`)")


def count_lora_params(model, cfg) -> int:
    """Adapter parameters `add_lora(model, cfg)` would add, from the model's module shapes only (works on a meta
    model: the pre-flight's memory estimate)."""
    import copy

    with torch.device("meta"):
        probe = copy.deepcopy(model).to("meta")
        add_lora(probe, cfg)
    return sum(p.numel() for p in trainable_parameters(probe))
