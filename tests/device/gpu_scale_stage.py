"""The `gpu_scale` preset's MOPD stage through the recipe's own function (`recipe.mopd_stage`), with what it cost:
per step the seconds of each phase, per phase the device's peak memory beside the pre-flight's estimate
(`runtime.phases.check_colocated_fit`, as the loop and the pre-flight compute it, plus the two terms they leave
out — the sampler's KV cache and a teacher's forward — named separately).

The student (seed `recipe.seed`) and one teacher per domain (seeds `recipe.seed + 1…`) are built locally at the
preset's shape (`models.build_tiny`, on the device: a billion-parameter model initialises in a second there), the
SFT stage skipped: the student is the built base.

    from gpu_scale_stage import TINY, run_stage      # tests/device on sys.path (pytest, perf_checks.py)
    res = run_stage(load_config("gpu_scale", TINY + [f"output_dir={tmp}"]))

Used by `perf_checks.py stage` (the real size on the device) and `tests/integration/test_gpu_scale_preset.py`
(TINY: the same preset at tiny widths on the CPU).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

# The preset at tiny widths (CI, CPU): every section as the preset has it — Qwen3 architecture, chat template,
# padded vocabulary, ignore_eos, bf16 autocast, chunked log-probs, token-budget micro-batches, colocated
# phases — only the widths, lengths and counts shrink.
TINY = ["runtime.device=cpu", "runtime.num_threads=1", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
        "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=128",
        "model.tiny.max_position_embeddings=128", "model.tiny.vocab_size=4096", "rollout.max_new_tokens=24",
        "mopd.prompts_per_step=2", "mopd.group_size=2", "train.max_tokens_per_micro_batch=128",
        "eval.max_new_tokens=4"]


def build_models(recipe, device=None) -> tuple[Path, dict[str, Path]]:
    """The student (`<run_dir>/base`, seed `recipe.seed`) and a teacher per expert domain
    (`<run_dir>/teacher-<domain>`, seeds `recipe.seed + 1 + i`), built at `model.tiny`'s shape (reused when
    already there)."""
    from mopd_core.models import build_tiny, build_tiny_tokenizer

    run = recipe.run_dir()
    t = recipe.model.tiny
    tok = build_tiny_tokenizer(chat=t.chat, vocab_size=t.vocab_size)  # once for all four
    base = build_tiny(recipe.model, run / "base", seed=recipe.seed, device=device, tokenizer=tok)
    teachers = {d: build_tiny(recipe.model, run / f"teacher-{d}", seed=recipe.seed + 1 + i, device=device,
                              tokenizer=tok)
                for i, d in enumerate(recipe.expert_domains())}
    return base, teachers


def estimate_mib(recipe, base: Path, teachers: dict[str, Path], kind: str) -> dict[str, dict[str, float]]:
    """Per phase (MiB) what the pre-flight estimates (`preflight.stage_memory`: float32 master weights + gradients
    + AdamW, one micro-batch's activations and autocast's weight copy, the sampler's KV cache and weight copies,
    a bf16 teacher and its forward, one at a time), and its transient terms."""
    from mopd_core import preflight

    est = preflight.stage_memory(recipe, "student", kind, base, teachers)
    return {"preflight": _phase_keys(est["needs_mib"]), "terms_mib": est["terms_mib"]}


def _phase_keys(need: dict[str, float]) -> dict[str, float]:
    """`score (math)` → `score`: one key per phase."""
    return {k.split(" ", 1)[0]: v for k, v in need.items()}


def measured_phases(stage_dir: Path) -> dict[str, dict]:
    """Per phase: the largest device peak of its turns (`phases.jsonl` end records: the scheduler resets the peak
    at each phase's start; MiB, None on cpu) and the most the scheduler held in any of its records
    (resident_mb: weights, gradients, optimizer state, loaded teachers)."""
    out: dict[str, dict] = {}
    for line in (stage_dir / "phases.jsonl").read_text().splitlines():
        ev = json.loads(line)
        ph = out.setdefault(ev["phase"], {"peak_mib": None, "resident_mib": 0.0})
        ph["resident_mib"] = max(ph["resident_mib"], ev["resident_mb"])
        if ev["at"] == "end" and "device_peak_mb" in ev:
            ph["peak_mib"] = max(ph["peak_mib"] or 0.0, ev["device_peak_mb"])
    return out


def run_stage(recipe, device=None) -> dict:
    """Build the models, run `recipe.mopd_stage`, and return seconds per step and phase, peak memory per phase
    beside the estimates (ratio measured / estimate), and the stage's wall split into build, stage and its
    load/eval/save remainder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mopd_core import recipe as R
    from mopd_core.models import num_parameters

    R.setup_runtime(recipe)
    t0 = time.perf_counter()
    base, teachers = build_models(recipe, device)
    build_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    stage_dir, error = recipe.run_dir() / "student", None
    try:
        stage_dir = R.mopd_stage(recipe, base, teachers, progress=False).stage_dir
    except Exception as e:  # noqa: BLE001 - e.g. a full disk at the final save: the steps' figures are on disk
        if not (stage_dir / "metrics.jsonl").exists():
            raise
        error = f"{type(e).__name__}: {str(e)[:300]}"
    stage_s = time.perf_counter() - t1
    rows = [json.loads(x) for x in (stage_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    keys = ("step", "perf/rollout_s", "perf/score_s", "perf/train_s", "perf/step_s", "perf/rollout_tokens_per_s",
            "perf/train_tokens_per_s", "perf/micro_batches", "perf/pad_frac", "perf/optim_offload_s",
            "perf/optim_restore_s", "loss", "grad_norm", "adv/kd_mean")
    steps = [{**{k: r.get(k) for k in keys}, **{k: v for k, v in r.items() if k.startswith("length/")}}
             for r in rows]
    with torch.device("meta"):
        n = num_parameters(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(base))))
    from mopd_core.runtime.device import kind_of

    est = estimate_mib(recipe, base, teachers, kind_of(device) if device is not None else "cpu")
    meas = measured_phases(stage_dir)
    ratios = {p: (meas[p]["peak_mib"] / est["preflight"][p]
                  if p in meas and meas[p]["peak_mib"] and est["preflight"].get(p) else None)
              for p in ("rollout", "score", "train")}
    loop_s = sum(s["perf/step_s"] or 0.0 for s in steps)
    from torch._dynamo.utils import counters  # lib: torch 2.x — did train.compile's layers run compiled?

    compiled = {k: dict(counters[k]) for k in ("stats", "frames", "graph_break", "recompiles") if counters.get(k)}
    return {"params": n, "steps": steps, "dynamo_counters": compiled,
            "phases_measured_mib": meas, "estimate_mib": est, "peak_over_estimate": ratios,
            "within_25pct": {p: (None if r is None else abs(r - 1) <= 0.25) for p, r in ratios.items()},
            "build_s": build_s, "stage_s": stage_s, "stage_other_s": stage_s - loop_s,
            "stage_dir": str(stage_dir), **({"stage_error": error} if error else {})}
