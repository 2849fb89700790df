"""One device run's results as `device_checks.json` (everything) and `device_checks.md` (the figures a reader wants:
machine, date, every test's outcome, the gpu_scale stage per phase beside the estimates, MFU per length, TRL
beside our stage, and the other checks' headline numbers). `tests/device/run_all.sh` calls it last; the unit tests
call it on the CPU dry run's output.

    python tests/device/summarize.py TMP RESULTS_DIR RC T_START
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def machine() -> dict:
    out = {"host": platform.node(), "python": platform.python_version()}
    try:
        import torch

        from mopd_core.runtime import device as devlib

        out["torch"] = torch.__version__
        kind = devlib.resolve("auto").kind
        out["kind"] = kind
        if kind != "cpu":
            out["device"] = devlib.device_name(kind)
            out["device_memory_gib"] = round(devlib.mem_get_info(kind)[1] / 2**30, 1)
            out["cuda"] = torch.version.cuda
    except Exception as e:  # noqa: BLE001 - a broken stack is itself the finding
        out["torch"] = f"unavailable: {e}"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if smi.returncode == 0 and smi.stdout.strip():
            out["driver"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib import metadata

    for dist in ("transformers", "trl", "vllm", "vllm-ascend", "torch-npu", "liger-kernel"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def collect(tmp: Path, rc: int, t_start: int) -> dict:
    tests = []
    for xml in sorted(tmp.glob("*.xml")):
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome, detail = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    detail = (el.get("message") or el.text or "")[:500]
            tests.append({"file": xml.stem, "test": case.get("name"), "outcome": outcome,
                          "seconds": round(float(case.get("time") or 0), 2), **({"detail": detail} if detail else {})})
    rec = tmp / "records.jsonl"
    records = [json.loads(x) for x in rec.read_text().splitlines() if x.strip()] if rec.exists() else []
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        sha = ""
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    res = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git": sha, "machine": machine(),
           "wall_s": int(time.time()) - t_start, "ok": rc == 0 and not counts["failed"] and not counts["error"],
           "counts": counts, "tests": tests, "records": records}
    parts = tmp / "parts.json"
    if parts.exists():
        res["parts_s"] = json.loads(parts.read_text())
    if (tmp / "perf.json").exists():
        res["perf"] = json.loads((tmp / "perf.json").read_text())
        res["ok"] = res["ok"] and res["perf"].get("ok", True)
    return res


def _f(x, nd: int = 1, unit: str = "") -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:,.{nd}f}{unit}"
    return f"{x}{unit}"


def _stage_md(st: dict) -> list[str]:
    out = ["### MOPD stage at real size (`configs/gpu_scale.yaml` through `recipe.mopd_stage`)", "",
           f"{st.get('params', 0) / 1e9:.2f} B parameters, {st.get('prompts')} prompts × {st.get('group')} samples × "
           f"{st.get('max_new_tokens')} new tokens, rollout `{st.get('rollout_backend')}`; build "
           f"{_f(st.get('build_s'))} s, stage {_f(st.get('stage_s'))} s (of which load/eval/save "
           f"{_f(st.get('stage_other_s'))} s)." + (f" **{st['note']}**" if st.get("note") else "")
           + (f" **The stage failed after its steps: {st['stage_error']}**" if st.get("stage_error") else "")
           + (f" The fast sampler failed first: `{st['fast_rollout_error'][:200]}`." if st.get("fast_rollout_error")
              else ""), "",
           "| step | rollout s | score s | train s | step s | rollout tok/s | train tok/s |",
           "|---|---|---|---|---|---|---|"]
    for s in st.get("steps", []):
        out.append(f"| {s['step']} | {_f(s['perf/rollout_s'], 2)} | {_f(s['perf/score_s'], 2)} | "
                   f"{_f(s['perf/train_s'], 2)} | {_f(s['perf/step_s'], 2)} | "
                   f"{_f(s['perf/rollout_tokens_per_s'], 0)} | {_f(s['perf/train_tokens_per_s'], 0)} |")
    est, meas = st.get("estimate_mib", {}), st.get("phases_measured_mib", {})
    terms = est.get("terms_mib", {})
    what = {"rollout": "sampling", "score": "scoring", "train": "activations"}
    out += ["", "| phase | measured peak GiB | pre-flight estimate GiB | of which transient GiB | "
            "measured ÷ estimate |", "|---|---|---|---|---|"]
    for p in ("rollout", "score", "train"):
        m = (meas.get(p) or {}).get("peak_mib")
        out.append(f"| {p} | {_f(m / 1024 if m else None, 1)} | "
                   f"{_f(est.get('preflight', {}).get(p, 0) / 1024, 1)} | "
                   f"{_f(terms.get(what[p], 0) / 1024, 1)} ({what[p]}) | "
                   f"{_f((st.get('peak_over_estimate') or {}).get(p), 2)} |")
    return out + [""]


def _mfu_md(m: dict) -> list[str]:
    out = ["### MFU through the loop's `policy_update`", "",
           f"float32 master weights, bf16 autocast, chunked log-probs, AdamW; {m.get('flops_convention')}; datasheet "
           f"peak {_f(m.get('device_peak_tflops'), 0)} TFLOP/s, bf16 matmul measured in the same run "
           f"{_f(m.get('measured_matmul_tflops'), 0)} TFLOP/s; goal {m.get('goal_mfu')}.", "",
           "| tokens/seq | rows | compiled | checkpointing | s/step | tokens/s | TFLOP/s | MFU (datasheet) | "
           "MFU (measured matmul) | peak GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in m.get("runs", []):
        if "skipped" in r:
            out.append(f"| {r['seq']} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        out.append(f"| {r['seq']:,} | {r['rows']} | {r['compiled']} | {r['checkpointing']} | "
                   f"{_f(r['step_s_median'], 3)} | {_f(r['tokens_per_s'], 0)} | {_f(r['achieved_tflops'], 0)} | "
                   f"{_f(r.get('mfu'), 3)} | "
                   f"{_f(r.get('mfu_vs_measured_matmul'), 3)} | {_f(r.get('peak_mem_gib'), 1)} |")
    return out + [""]


def _trl_md(t: dict, st: dict | None) -> list[str]:
    out = ["### TRL `DistillationTrainer` on the same device", ""]
    if "skipped" in t:
        return out + [t["skipped"], ""]
    out.append(f"trl {t.get('trl')}, use_vllm=False, gradient checkpointing, bf16 {t.get('bf16')}, liger "
               f"{t.get('liger')}, β = 1; {t.get('size')}." + (f" **{t['oom']}**" if t.get("oom") else ""))
    out += ["", "| trainer | new tokens | s/step | generation s | teacher s | update s | tokens/s | peak GiB |",
            "|---|---|---|---|---|---|---|---|"]
    if t.get("steps"):
        s = t["steps"][-1]
        out.append(f"| TRL (step 2) | {t['max_new_tokens']} | {_f(s['step_s'], 2)} | {_f(s['gen_s'], 2)} | "
                   f"{_f(s['score_s'], 2)} | {_f(s['update_s'], 2)} | {_f(s['tokens_per_s'], 0)} | "
                   f"{_f(t.get('peak_mem_gib'), 1)} |")
    if st and st.get("steps"):
        s = st["steps"][-1]
        n = st["prompts"] * st["group"] * st["max_new_tokens"]
        peak = max(((v or {}).get("peak_mib") or 0) for v in st.get("phases_measured_mib", {}).values()) / 1024
        out.append(f"| ours (stage step {s['step']}) | {st['max_new_tokens']} | {_f(s['perf/step_s'], 2)} | "
                   f"{_f(s['perf/rollout_s'], 2)} | {_f(s['perf/score_s'], 2)} (3 teachers) | "
                   f"{_f(s['perf/train_s'], 2)} | {_f(n / s['perf/step_s'], 0)} | {_f(peak, 1)} |")
    return out + [""]


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = ["# Device checks", "",
             f"{res['when']} · git {res['git']} · {m.get('device', m.get('kind'))} "
             f"({m.get('device_memory_gib', '—')} GiB) · driver {m.get('driver', '—')} · torch {m.get('torch')} "
             f"(CUDA {m.get('cuda', '—')}) · transformers {m.get('transformers', '—')} · trl {m.get('trl', '—')} · "
             f"python {m.get('python')} · wall {res['wall_s']} s" + (f" (parts: {res['parts_s']})" if res.get("parts_s")
                                                                     else ""), "",
             f"Tests: {res['counts']}", "", "| file | test | outcome | s |", "|---|---|---|---|"]
    for t in res["tests"]:
        why = f": {t['detail'][:120].replace('|', '/')}" if t.get("detail") and t["outcome"] != "passed" else ""
        lines.append(f"| {t['file']} | {t['test']} | {t['outcome']}{why} | {t['seconds']} |")
    lines.append("")
    checks = (res.get("perf") or {}).get("checks", {})
    st = checks.get("stage")
    for name, c in checks.items():
        if "error" in c:
            lines += [f"### {name}: error", "", f"`{c['error'][:300]}`", ""]
        elif "skipped" in c and name != "trl":
            lines += [f"### {name}: skipped", "", c["skipped"], ""]
        elif name == "stage":
            lines += _stage_md(c)
        elif name == "mfu":
            lines += _mfu_md(c)
        elif name == "trl":
            lines += _trl_md(c, st if st and "error" not in st and "skipped" not in st else None)
        else:
            brief = {k: v for k, v in c.items() if not isinstance(v, (list, dict)) and k != "trace"}
            lines += [f"### {name}", "", "```", json.dumps(brief, indent=1, default=str), "```", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    tmp, out, rc, t_start = (argv or sys.argv[1:])[:4]
    res = collect(Path(tmp), int(rc), int(t_start))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_checks.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (out / "device_checks.md").write_text(markdown(res))
    print(f"device checks: {res['counts']} in {res['wall_s']} s -> {out}/device_checks.{{json,md}}")
    return 0


if __name__ == "__main__":
    ROOT = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
