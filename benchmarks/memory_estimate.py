"""Benchmark: the memory pre-flight's estimate of each phase beside the peaks a device run measured.

Reads a device-check record (`tests/device/run_all.sh` → device_checks.json: the `gpu_scale` MOPD stage's per-phase
peaks and the MFU runs' peaks through `policy_update`) and recomputes, with this checkout's estimator
(`preflight.recipe_memory`, `runtime.phases.activation_bytes`), what the pre-flight predicts for the same
configuration: so a change of the estimator is judged against measurements without a device. The goal (issue
text of the device checks): every phase within ±25 %.

    .venv/bin/python benchmarks/memory_estimate.py [--record benchmarks/results/device_checks.json]
        [--out benchmarks/results/memory_estimate.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 2**30


def stage_rows(rec: dict) -> list[dict]:
    """The gpu_scale stage: the pre-flight's per-phase estimate for its overrides, beside the measured peaks."""
    from mopd_core import preflight
    from mopd_core.config import load_config

    st = rec["perf"]["checks"]["stage"]
    over = [o for o in st["overrides"] if not o.startswith("runtime.device")]
    cfg = load_config("gpu_scale", over + ["runtime.memory_limit_gib=1000"])
    est = preflight.recipe_memory(cfg, rec["machine"]["kind"])
    rows = []
    for key, need in est["needs_mib"].items():
        phase = key.split(" ", 1)[0]
        meas = st["phases_measured_mib"][phase]["peak_mib"]
        rows.append({"what": f"gpu_scale stage: {phase}", "measured_gib": meas / 1024, "estimate_gib": need / 1024,
                     "ratio": meas / need})
    return rows


def mfu_rows(rec: dict) -> list[dict]:
    """The MFU runs (`policy_update` alone): float32 weights + gradients + AdamW, one micro-batch's activations
    and autocast's bf16 weight copy — the train phase's estimate at their shapes."""
    from mopd_core.config import load_config
    from mopd_core.runtime.phases import activation_bytes

    t = load_config("gpu_scale", []).model.tiny
    m = rec["perf"]["checks"]["mfu"]
    n = m["params_total"]
    kv = (t.num_kv_heads or t.num_heads) * (t.hidden_size // t.num_heads)
    rows = []
    for r in m["runs"]:
        tokens = r["tokens_per_step"] // int(r["micro_batches"])
        act = activation_bytes(tokens, t.hidden_size, t.num_layers, t.vocab_size, dtype_bytes=2,
                               checkpointing=r["checkpointing"], intermediate=t.intermediate_size, kv_dim=kv)
        need = (16 * n + 2 * n + act) / GIB
        rows.append({"what": f"policy_update {r['rows']}×{r['seq']}, compiled {r['compiled']}",
                     "measured_gib": r["peak_mem_gib"], "estimate_gib": need, "ratio": r["peak_mem_gib"] / need})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", default=str(ROOT / "benchmarks/results/device_checks.json"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/memory_estimate.json"))
    args = ap.parse_args(argv)
    rec = json.loads(Path(args.record).read_text())
    rows = stage_rows(rec) + mfu_rows(rec)
    for r in rows:
        r["within_25pct"] = abs(r["ratio"] - 1) <= 0.25
    m = rec["machine"]
    res = {"record": str(Path(args.record).relative_to(ROOT)), "measured_on": rec["when"], "code_measured": rec["git"],
           "device": m["device"], "torch": m["torch"], "rows": rows}
    out = Path(args.out)
    out.write_text(json.dumps(res, indent=1) + "\n")
    md = ["# Memory pre-flight vs measured peaks", "",
          f"Measured {rec['when']} on {m['device']} (torch {m['torch']}, record `{res['record']}`); the estimates "
          "are this checkout's pre-flight (`preflight.recipe_memory`, `runtime.phases.activation_bytes`) for the "
          "same configuration. Goal: within ±25 %.", "",
          "| what | measured peak GiB | pre-flight estimate GiB | measured ÷ estimate | within ±25 % |",
          "|---|---:|---:|---:|---|"]
    md += [f"| {r['what']} | {r['measured_gib']:.1f} | {r['estimate_gib']:.1f} | {r['ratio']:.2f} | "
           f"{'yes' if r['within_25pct'] else 'no'} |" for r in rows]
    md += ["", "The estimate counts transformers' eager layers; compiled layers (`train.compile`) save about half "
           "the activations, so a compiled update sits below it (an upper bound, as a pre-flight should be)."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
