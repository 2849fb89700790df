#!/usr/bin/env bash
# Every device check (tests/device, marker `device`) in one prepared run, one pytest process per file (each vLLM
# engine starts in a fresh process: vLLM keeps process-wide state), then what happened (tests/device/summarize.py):
#   $RESULTS_DIR/device_checks.json — machine (device, driver, torch, …), date, per-test outcome/seconds/skip reason,
#   the measurements the tests recorded and perf_checks.py's figures; device_checks.md — the same as tables.
#
#   tests/device/run_all.sh                      # all files
#   tests/device/run_all.sh test_vllm_ipc.py     # some files (split a run that would outlast a time limit)
#   PY=python3 RESULTS_DIR=/tmp/x FILE_TIMEOUT=400 tests/device/run_all.sh
#   RESULTS_DIR=$OUT tests/device/run_all.sh quick  # on the lent device machine (the files come back): the checks
#                                                # new since the last run + perf_checks.py, ≤ 7 min on an H200
#   tests/device/run_all.sh perf                 # only the performance checks (tests/device/perf_checks.py: the
#                                                # gpu_scale MOPD stage, MFU through policy_update, TRL beside us,
#                                                # log-prob memory, hand-over, …); their JSON lands under "perf"
#   SKIP_PERF=1 tests/device/run_all.sh          # the pytest files only; PERF_BUDGET_S (default 300) caps perf,
#                                                # PERF_ONLY=stage,mfu picks checks, in that order
#   PERF_DRY_RUN=1 RESULTS_DIR=/tmp/x tests/device/run_all.sh quick   # the whole script on a CPU: the device
#                                                # tests skip, perf_checks.py runs its tiny shapes
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
RESULTS_DIR=${RESULTS_DIR:-benchmarks/results}
FILE_TIMEOUT=${FILE_TIMEOUT:-600}
TMP=$(mktemp -d "${TMPDIR:-/tmp}/mopd-device.XXXXXX")
export MOPD_DEVICE_RESULTS="$TMP/records.jsonl" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CACHE_ROOT="$TMP/vllm-cache" PYTHONUNBUFFERED=1 \
  MLFLOW_DISABLE_TELEMETRY=true PREFECT_HOME="$TMP/prefect" PYTHONHASHSEED=0 \
  TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$TMP/inductor}"
: >"$MOPD_DEVICE_RESULTS"
t_all=$(date +%s)

# carried wheels (tests/device/fetch_wheels.sh downloads them into .whl/ here): a bare accelerator image lacks
# pydantic, trl, datasets …; installed into a private folder, nothing of the image changed
PYVER=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if compgen -G ".whl/*.whl" >/dev/null && [ "$PYVER" != 3.12 ]; then
  echo "-- .whl/ holds wheels for Python 3.12 (tests/device/fetch_wheels.sh); this is $PYVER: not installed"
elif compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TMP/site" .whl/*.whl \
    || { echo "!! installing the carried wheels failed"; exit 2; }
  export PYTHONPATH="$TMP/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
t_install=$(( $(date +%s) - t_all ))

RUN_PERF=${SKIP_PERF:+0}; RUN_PERF=${RUN_PERF:-1}
if [ "$#" -eq 1 ] && [ "$1" = perf ]; then FILES=(); RUN_PERF=1
elif [ "$#" -eq 1 ] && [ "$1" = quick ]; then  # the files whose code changed since the last GPU run (2f7ce71), + perf
  FILES=(test_device_layer.py test_colocated_offload.py)
elif [ "$#" -gt 0 ]; then FILES=("$@"); RUN_PERF=0; else
  FILES=(test_device_layer.py test_cuda_ipc.py test_chunked_logprobs.py test_graphed_sampler_device.py test_fsdp2.py
         test_colocated_offload.py test_vllm_rollout.py test_vllm_ipc.py test_colocated_step.py test_async_benchmark.py)
fi

rc=0
t_tests=$(date +%s)
for f in "${FILES[@]+"${FILES[@]}"}"; do
  f=$(basename "$f")
  [ -f "tests/device/$f" ] || { echo "-- tests/device/$f: not in this checkout"; continue; }
  echo "== tests/device/$f ($(( $(date +%s) - t_all )) s in)"
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
t_tests=$(( $(date +%s) - t_tests ))

t_perf=$(date +%s)
if [ "$RUN_PERF" = 1 ]; then
  echo "== tests/device/perf_checks.py (budget ${PERF_BUDGET_S:-300} s${PERF_ONLY:+, only $PERF_ONLY}, $(( $(date +%s) - t_all )) s in)"
  timeout -k 20 "$(( ${PERF_BUDGET_S:-300} + 120 ))" "$PY" tests/device/perf_checks.py --out "$TMP/perf.json" \
    --budget-s "${PERF_BUDGET_S:-300}" --only "${PERF_ONLY:-}" ${PERF_DRY_RUN:+--dry-run} || rc=1
fi
t_perf=$(( $(date +%s) - t_perf ))
echo "{\"install\": $t_install, \"tests\": $t_tests, \"perf\": $t_perf}" >"$TMP/parts.json"

"$PY" tests/device/summarize.py "$TMP" "$RESULTS_DIR" "$rc" "$t_all"
rm -rf "$TMP"
exit $rc
