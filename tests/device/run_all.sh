#!/usr/bin/env bash
# Every device check (tests/device, marker `device`) in one prepared run, one pytest process per file (each vLLM
# engine starts in a fresh process: vLLM keeps process-wide state), then one JSON of what happened:
#   benchmarks/results/device_checks.json — machine, per-test outcome/seconds/skip reason, and the measurements
#   the tests recorded (bytes handed over, handles, device memory freed by sleep, timings, log-prob errors).
#
#   tests/device/run_all.sh                      # all files
#   tests/device/run_all.sh test_vllm_ipc.py     # some files (split a run that would outlast a time limit)
#   PY=python3 OUT=/tmp/x.json FILE_TIMEOUT=400 tests/device/run_all.sh
#   OUT=$OUT/device_checks.json tests/device/run_all.sh   # on the lent device machine: the JSON comes back
#   tests/device/run_all.sh perf                 # only the performance checks (tests/device/perf_checks.py:
#                                                # 1.7B-class MFU, 16k-token log-prob memory, CUDA IPC hand-over
#                                                # vs the HBM copy floor, a colocated MOPD step) — ≤ 8 min on an
#                                                # H200 without vLLM; their JSON lands under "perf"
#   SKIP_PERF=1 tests/device/run_all.sh          # the pytest files only; PERF_BUDGET_S (default 420) caps perf
#
# Python: $PY, else .venv/bin/python, else python3 (a bare accelerator image: torch + transformers + pytest run
# the device-layer and CUDA-IPC checks; the vLLM checks need vllm — `pip install -e .[vllm]` — and skip without).
#
# Exit status: 0 when nothing failed (skips are fine: without an accelerator, or without vllm, checks skip
# and say why). Budget on an H200 with vllm installed: ~1 min per vLLM engine start, ~6-8 min in all.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PY=${PY:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT=${OUT:-benchmarks/results/device_checks.json}
FILE_TIMEOUT=${FILE_TIMEOUT:-600}
TMP=$(mktemp -d "${TMPDIR:-/tmp}/mopd-device.XXXXXX")
export MOPD_DEVICE_RESULTS="$TMP/records.jsonl" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CACHE_ROOT="$TMP/vllm-cache" PYTHONUNBUFFERED=1 \
  MLFLOW_DISABLE_TELEMETRY=true PREFECT_HOME="$TMP/prefect"
: >"$MOPD_DEVICE_RESULTS"

RUN_PERF=${SKIP_PERF:+0}; RUN_PERF=${RUN_PERF:-1}
if [ "$#" -eq 1 ] && [ "$1" = perf ]; then FILES=(); RUN_PERF=1
elif [ "$#" -gt 0 ]; then FILES=("$@"); RUN_PERF=0; else
  FILES=(test_device_layer.py test_cuda_ipc.py test_chunked_logprobs.py test_graphed_sampler.py test_fsdp2.py
         test_vllm_rollout.py test_vllm_ipc.py
         test_colocated_step.py test_async_benchmark.py)
fi

rc=0
t_all=$(date +%s)
for f in "${FILES[@]+"${FILES[@]}"}"; do
  f=$(basename "$f")
  echo "== tests/device/$f"
  timeout -k 20 "$FILE_TIMEOUT" "$PY" -m pytest "tests/device/$f" -m device -q -rs -p no:cacheprovider \
    --junitxml="$TMP/${f%.py}.xml" -o junit_family=xunit2
  r=$?
  case $r in
    0|5) ;;                                   # passed / all skipped or none collected
    124|137) echo "!! $f ran past ${FILE_TIMEOUT}s"; rc=1 ;;
    *) rc=1 ;;
  esac
  echo "$f $r" >>"$TMP/exit_codes"
done

if [ "$RUN_PERF" = 1 ]; then
  echo "== tests/device/perf_checks.py (budget ${PERF_BUDGET_S:-420} s)"
  timeout -k 20 "$(( ${PERF_BUDGET_S:-420} + 120 ))" "$PY" tests/device/perf_checks.py --out "$TMP/perf.json" \
    --budget-s "${PERF_BUDGET_S:-420}" || rc=1
fi

"$PY" - "$TMP" "$OUT" "$rc" "$t_all" <<'EOF'
import json, os, platform, subprocess, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

tmp, out, rc, t_all = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
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
records = [json.loads(x) for x in (tmp / "records.jsonl").read_text().splitlines() if x.strip()]
machine = {"host": platform.node(), "python": platform.python_version()}
try:
    import torch
    machine["torch"] = torch.__version__
    if torch.cuda.is_available():
        machine["device"] = torch.cuda.get_device_name(0)
        machine["device_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
except Exception as e:  # noqa: BLE001
    machine["torch"] = f"unavailable: {e}"
from importlib import metadata
for dist in ("vllm", "vllm-ascend", "torch-npu", "transformers"):
    try:
        machine[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
try:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    sha = ""
counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
res = {"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "git": sha, "machine": machine, "wall_s": int(time.time()) - t_all,
       "ok": rc == 0 and not counts["failed"] and not counts["error"], "counts": counts, "tests": tests,
       "records": records}
if (tmp / "perf.json").exists():  # tests/device/perf_checks.py: MFU, log-prob memory, hand-over, MOPD step
    res["perf"] = json.loads((tmp / "perf.json").read_text())
    res["ok"] = res["ok"] and res["perf"].get("ok", True)
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(res, indent=1, default=str) + "\n")
print(f"device checks: {counts} in {res['wall_s']} s -> {out}")
EOF
rm -rf "$TMP"
exit $rc
