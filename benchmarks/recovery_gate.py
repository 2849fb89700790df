"""Demonstration: recovery as a live metric and `mopd.stop_at_recovery` on the tiny preset's math domain.

Takes a finished tiny-preset SFT stage folder and expert-math stage folder (each with `final/` and `stage.json`;
`benchmarks/tiny_recipe.py` makes them), distils a math-only student from the SFT model with the expert as its
teacher (the preset's MOPD settings, `mopd.eval_every` evals), lets the gate end the stage once math's recovery
(student − SFT) / (expert − SFT) reaches `--stop`, then streams the stage's metrics.jsonl into a throw-away MLflow
store and reads the `recovery/math` curve back. One seed: it shows the wiring on a real recipe, it claims no
quality (the bar is benchmarks/tiny_recipe.py's).

Writes `benchmarks/results/recovery_gate_tiny.{json,md}` (or --out).

    .venv/bin/python benchmarks/recovery_gate.py --sft RUN/sft --expert RUN/expert-math [--stop 0.5]
        [--steps 120] [--eval-every 10] [--threads 1] [--work /tmp/recovery_gate] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MATH = ("data.domains=[{name: math, source: 'synthetic:math', weight: 1.0, eval_size: 200, "
        "params: {digits: 2, digits_b: 1, weak_tasks: ['-'], weak_rate: 0.65}}]")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft", required=True, type=Path)
    ap.add_argument("--expert", required=True, type=Path)
    ap.add_argument("--stop", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/recovery_gate"))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/recovery_gate_tiny.json")
    a = ap.parse_args()
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{a.work / 'mlflow.db'}")
    from mopd_core import recipe as R
    from mopd_core.config import load_config
    from tasks import tracking

    cfg = load_config("tiny", [MATH, "sft.mix=null", "mopd.mix=null", f"output_dir={a.work}", "name=gate",
                               f"runtime.num_threads={a.threads}", f"mopd.steps={a.steps}",
                               f"mopd.eval_every={a.eval_every}", f"mopd.stop_at_recovery={a.stop}"])
    R.setup_runtime(cfg)
    run = cfg.run_dir()
    for name, src in (("sft", a.sft), ("expert-math", a.expert)):  # copies: the sources are left as they are
        if not (run / name).exists():
            shutil.copytree(src, run / name, ignore=shutil.ignore_patterns("checkpoints", "trainer"))
    load = os.getloadavg()
    t0 = time.perf_counter()
    out = R.mopd_stage(cfg, run / "sft" / "final", {"math": run / "expert-math" / "final"}, progress=False)
    wall = time.perf_counter() - t0
    info = json.loads((out.stage_dir / "stage.json").read_text())
    rows = [json.loads(x) for x in (out.stage_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rid = tracking.start_run("recovery-gate", "student")
    tracking.log_metric_rows(rid, rows)
    curve = [(m.step, m.value) for m in tracking.client().get_metric_history(rid, "recovery/math")]
    tracking.end_run(rid)
    refs = {k: json.loads((run / k / "stage.json").read_text())["eval"]["math"]["greedy"]
            for k in ("sft", "expert-math")}
    res = {"references_math_greedy": refs, "stop_at_recovery": a.stop, "steps_asked": a.steps,
           "eval_every": a.eval_every, "recovery_curve_mlflow": curve,
           "eval_curve": [(r["step"], r["eval/math/greedy"]) for r in rows if "eval/math/greedy" in r],
           "stopped": info["recovery"]["stopped"], "last_step": info["recovery"]["last_step"],
           "final_eval": out.eval, "final_recovery": out.recovery, "wall_s": wall,
           "compat_failures": len(out.compat.failures()),
           "machine": {"cpu": platform.processor() or platform.machine(), "threads": a.threads,
                       "loadavg_at_start": load}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(_markdown(res, cfg))
    print(a.out.with_suffix(".md").read_text())
    return 0


def _markdown(res: dict, cfg) -> str:
    refs = res["references_math_greedy"]
    lines = ["# Recovery gate on the tiny preset's math domain (one seed, a demonstration)", "",
             f"Student distilled from the tiny preset's SFT model by its expert-math (preset MOPD settings, math only),"
             f" eval every {res['eval_every']} steps on the 200 held-out math prompts, `mopd.stop_at_recovery="
             f"{res['stop_at_recovery']}`, at most {res['steps_asked']} steps. Machine: {res['machine']['cpu']}, "
             f"{res['machine']['threads']} torch thread(s), load average at start "
             f"{', '.join(f'{x:.1f}' for x in res['machine']['loadavg_at_start'])}; wall {res['wall_s']:.0f} s.", "",
             "References (their stage records, 200 prompts): SFT math "
             f"{refs['sft']:.3f}, expert-math {refs['expert-math']:.3f}.",
             "",
             "| step | math greedy | recovery/math (read back from MLflow) |", "|---|---|---|"]
    acc = dict(res["eval_curve"])
    lines += [f"| {s} | {acc.get(s, float('nan')):.3f} | {v:.3f} |" for s, v in res["recovery_curve_mlflow"]]
    final = res["final_recovery"].get("math", float("nan"))
    lines += ["", f"Stopped: {res['stopped']} (the stage's last step: {res['last_step']}). Final eval: math "
              f"{res['final_eval']['math']['greedy']:.3f}, recovery {final:.3f}."
              f" Compatibility pre-flight failures: {res['compat_failures']}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
