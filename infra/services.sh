#!/usr/bin/env bash
# Local services on 127.0.0.1: a Prefect server, an MLflow server and a process worker for the `mopd-process`
# pool; stopped by PID. State (PIDs, logs, DBs, artifacts) lives in $MOPD_SERVICES_DIR (default .services/).
#
#   infra/services.sh start     # prints the env to use them:  source .services/env
#   infra/services.sh deploy    # prefect deploy --all (infra/prefect.yaml) against $PREFECT_API_URL
#   infra/services.sh stop
#   infra/services.sh status
#
# Remote services: skip `start`, export PREFECT_API_URL (e.g. http://prefect.internal:4200/api) and
# MLFLOW_TRACKING_URI (e.g. http://mlflow.internal:5000), run `deploy`, and start a worker on the training
# machine:  prefect worker start --pool mopd-process
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${MOPD_SERVICES_DIR:-$ROOT/.services}"
BIN="${MOPD_BIN:-$ROOT/.venv/bin}"
HOST=127.0.0.1
PREFECT_PORT="${PREFECT_PORT:-4200}"
MLFLOW_PORT="${MLFLOW_PORT:-5000}"
POOL="${MOPD_POOL:-mopd-process}"
mkdir -p "$DIR"
export PREFECT_HOME="${PREFECT_HOME:-$DIR/prefect}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_LOGGING_EXTRA_LOGGERS="${PREFECT_LOGGING_EXTRA_LOGGERS:-mopd}"
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
export NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}" no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}"

wait_http() {  # url seconds name
  local t=0
  until "$BIN/python" - "$1" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=3).read()
PY
  do
    t=$((t + 1)); [ "$t" -ge "$2" ] && { echo "$3 not healthy after $2 s: $1 (log: $DIR/$3.log)" >&2; tail -20 "$DIR/$3.log" >&2; return 1; }
    sleep 1
  done
}

alive() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

launch() {  # name cmd...: own session (process group = its PID) so stop reaches its children too
  local name=$1; shift
  if alive "$name"; then echo "$name already running (pid $(cat "$DIR/$name.pid"))"; return 0; fi
  setsid "$@" >"$DIR/$name.log" 2>&1 < /dev/null &
  echo $! >"$DIR/$name.pid"
  echo "$name started (pid $!, log $DIR/$name.log)"
}

stop_one() {  # name signal grace_s
  local name=$1 sig=$2 grace=$3 pid
  [ -f "$DIR/$name.pid" ] || return 0
  pid=$(cat "$DIR/$name.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill "-$sig" -- "-$pid" 2>/dev/null || kill "-$sig" "$pid" 2>/dev/null || true
    for _ in $(seq 1 "$grace"); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true; fi
    echo "$name stopped (pid $pid)"
  fi
  rm -f "$DIR/$name.pid"
}

write_env() {
  cat >"$DIR/env" <<ENV
export PREFECT_API_URL=http://$HOST:$PREFECT_PORT/api
export MLFLOW_TRACKING_URI=http://$HOST:$MLFLOW_PORT
export PREFECT_HOME=$PREFECT_HOME
export PREFECT_SERVER_ANALYTICS_ENABLED=false
ENV
}

case "${1:-}" in
  start)
    # the UI asks the API at PREFECT_UI_API_URL (default: port 4200 whatever --port says)
    launch prefect-server env PREFECT_SERVER_API_HOST="$HOST" PREFECT_SERVER_API_PORT="$PREFECT_PORT" \
      PREFECT_UI_API_URL="http://$HOST:$PREFECT_PORT/api" \
      "$BIN/prefect" server start --host "$HOST" --port "$PREFECT_PORT"
    launch mlflow-server "$BIN/mlflow" server --host "$HOST" --port "$MLFLOW_PORT" \
      --backend-store-uri "sqlite:///$DIR/mlflow.db" --artifacts-destination "$DIR/mlartifacts" --workers 1
    wait_http "http://$HOST:$PREFECT_PORT/api/health" "${MOPD_START_TIMEOUT:-120}" prefect-server
    wait_http "http://$HOST:$MLFLOW_PORT/health" "${MOPD_START_TIMEOUT:-120}" mlflow-server
    write_env
    export PREFECT_API_URL="http://$HOST:$PREFECT_PORT/api" MLFLOW_TRACKING_URI="http://$HOST:$MLFLOW_PORT"
    "$BIN/prefect" work-pool inspect "$POOL" >/dev/null 2>&1 || "$BIN/prefect" work-pool create "$POOL" --type process >/dev/null
    export MOPD_ROOT="$ROOT"
    (cd "$ROOT" && launch worker "$BIN/prefect" worker start --pool "$POOL" --type process)
    echo "Prefect UI: http://$HOST:$PREFECT_PORT   MLflow UI: http://$HOST:$MLFLOW_PORT"
    echo "use them from a shell:  source $DIR/env"
    ;;
  deploy)
    [ -f "$DIR/env" ] && [ -z "${PREFECT_API_URL:-}" ] && source "$DIR/env"
    : "${PREFECT_API_URL:?set PREFECT_API_URL or run '$0 start' first}"
    cd "$ROOT"
    MOPD_ROOT="$ROOT" "$BIN/prefect" --no-prompt deploy --all --prefect-file infra/prefect.yaml
    ;;
  stop)
    stop_one worker INT 20      # graceful first; an idle Prefect 3.9.1 worker ignores SIGINT/SIGTERM (measured: >60 s), so 20 s then KILL
    stop_one mlflow-server TERM 15
    stop_one prefect-server TERM 15
    ;;
  status)
    for n in prefect-server mlflow-server worker; do
      if alive "$n"; then echo "$n: running (pid $(cat "$DIR/$n.pid"))"; else echo "$n: stopped"; fi
    done
    ;;
  *) echo "usage: $0 start|deploy|stop|status" >&2; exit 2 ;;
esac
