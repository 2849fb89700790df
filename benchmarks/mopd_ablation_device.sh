#!/usr/bin/env bash
# benchmarks/mopd_ablation.py on the lent GPU machine (the 2-core CPU machine trains one tiny_imbalanced SFT model
# in ~7 min idle, ~60 min when shared by the other agents' jobs): per seed, two invocations side by side — the
# second waits for the seed's SFT model and experts and reuses them (stage fingerprints) — then --collect merges
# them. Needs the carried wheels (tests/device/fetch_wheels.sh → .whl, name `.whl` in the run's carry).
#
#   OUT=/some/dir benchmarks/mopd_ablation_device.sh        # SEEDS, VGROUPS (variant lists), LIMIT_S to change
set -uo pipefail
cd "$(dirname "$0")/.."
OUTD=${OUT:-runs/abl-device}
RUN=${RUN_DIR:-/tmp/abl}
SEEDS=${SEEDS:-0 1 2 3 4}
# variant groups, one invocation each per seed: the first trains the seed's stages, the others wait for them;
# by default mopd_ablation.py's TABLE (the CPU table's rows) in two halves, read from the script (no copy to drift)
TABLE_HALVES='import sys; sys.path[:0] = ["benchmarks"]; from mopd_ablation import TABLE as t; h = (len(t) + 1) // 2
print(",".join(t[:h]), ",".join(t[h:]))'
VGROUPS=${VGROUPS:-$("${PY:-python3}" -c "$TABLE_HALVES")}
LIMIT_S=${LIMIT_S:-470}
PY=${PY:-python3}
mkdir -p "$OUTD" "$RUN"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "!! installing the carried wheels failed"; exit 2; }
  export PYTHONPATH="/tmp/site:$PWD"
fi
export PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
nvidia-smi -L; "$PY" -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'
SET=(--set runtime.device=cuda --set runtime.num_threads=1)
read -r -a G <<<"$VGROUPS"
for s in $SEEDS; do
  timeout "$LIMIT_S" "$PY" benchmarks/mopd_ablation.py --seeds "$s" --variants "${G[0]}" "${SET[@]}" \
    --output-dir "$RUN" --out "$RUN/g0s$s.json" >"$RUN/g0s$s.log" 2>&1 &
  for i in $(seq 1 $(( ${#G[@]} - 1 ))); do
    ( t0=$(date +%s)
      until grep -qs '"status": "done"' "$RUN/seed$s/tiny_imbalanced/expert-ifshort/stage.json"; do
        sleep 3; [ $(( $(date +%s) - t0 )) -lt $(( LIMIT_S - 30 )) ] || exit 0; done
      timeout $(( LIMIT_S - $(date +%s) + t0 )) "$PY" benchmarks/mopd_ablation.py --seeds "$s" --variants "${G[$i]}" \
        "${SET[@]}" --output-dir "$RUN" --out "$RUN/g${i}s$s.json" >"$RUN/g${i}s$s.log" 2>&1 ) &
  done
done
wait
tail -n 3 "$RUN"/*.log
"$PY" benchmarks/mopd_ablation.py --collect "$RUN"/g*.json --output-dir "$RUN" --out "$OUTD/mopd_ablation.json"
tar czf "$OUTD/parts.tgz" -C "$RUN" $(cd "$RUN" && ls ./*.json ./*.log)
