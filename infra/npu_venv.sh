#!/usr/bin/env bash
# The Ascend NPU environment: the pipeline with torch-npu and vllm-ascend of one release, in its own venv
# (their torch, 2.10.0, differs from the CPU pin of .venv). Pins: infra/npu-constraints.txt (vllm-ascend 0.23.0,
# torch 2.10.0, torch-npu 2.10.0.post4). Needs CANN 9.1.0 on the host, set up first
# (`source /usr/local/Ascend/ascend-toolkit/set_env.sh`); Python 3.10-3.12.
#
#   infra/npu_venv.sh                   # creates .venv-npu;  NPU_VENV=/path PY=python3.11 infra/npu_venv.sh
#   .venv-npu/bin/mopd recipe --config ascend_colocate
#
# What it downloads: torch 2.10.0 (CPU build from download.pytorch.org on x86_64, PyPI's on aarch64),
# torch-npu, vLLM 0.23.0 built from its source without a device (VLLM_TARGET_DEVICE=empty: no CUDA torch),
# vllm-ascend 0.23.0 (a wheel on x86_64; on aarch64 pip builds it from source against CANN), and the pipeline's
# own dependencies. Idempotent: exits 0 at once when the venv already imports torch_npu and vllm_ascend.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${NPU_VENV:-$ROOT/.venv-npu}"
PY="${PY:-python3}"
CONS="$ROOT/infra/npu-constraints.txt"
MARK="$VENV/.mopd-npu-ok"

if [ -z "${ASCEND_TOOLKIT_HOME:-}" ] && [ ! -d /usr/local/Ascend/ascend-toolkit ]; then
  echo "error: CANN not found (ASCEND_TOOLKIT_HOME unset, no /usr/local/Ascend/ascend-toolkit): install CANN 9.1.0" \
       "and run 'source /usr/local/Ascend/ascend-toolkit/set_env.sh' first (torch-npu breaks 'import torch' without it)" >&2
  exit 2
fi
if ! "$PY" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))'; then
  echo "error: vllm-ascend 0.23.0 needs Python 3.10-3.12 ($PY is $("$PY" -V 2>&1)); set PY=python3.11" >&2
  exit 2
fi
check() {
  "$VENV/bin/python" -c "import torch, torch_npu, vllm_ascend, mopd_core; assert torch.npu.is_available()" \
    >/dev/null 2>&1
}
if [ -f "$MARK" ] && [ "$(cat "$MARK")" = "$(sha256sum "$CONS" | cut -c1-16)" ] && check; then
  echo "npu venv ok: $VENV"; exit 0
fi

rm -f "$MARK"
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -c "$CONS")
"$VENV/bin/pip" install -q --upgrade pip
# x86_64: PyPI's torch 2.10.0 is the CUDA build; the NPU stack wants the CPU one (vllm-ascend's install guide)
if [ "$(uname -m)" = x86_64 ]; then export PIP_EXTRA_INDEX_URL="https://download.pytorch.org/whl/cpu"; fi
"${PIP[@]}" torch torch-npu torchvision torchaudio cmake ninja packaging setuptools-scm wheel jinja2
# vLLM of the same version, without a device (built against the torch above): vllm-ascend plugs the NPU in
VLLM_TARGET_DEVICE=empty "${PIP[@]}" --no-binary vllm --no-build-isolation vllm
"${PIP[@]}" vllm-ascend
"${PIP[@]}" -e "$ROOT[npu,domains]"
if ! check; then
  echo "npu venv at $VENV: torch_npu / vllm_ascend do not import or see no NPU — see the output above" >&2
  "$VENV/bin/python" -c "import torch, torch_npu, vllm_ascend; print(torch.npu.device_count(), 'NPUs')" >&2 || true
  exit 1
fi
sha256sum "$CONS" | cut -c1-16 > "$MARK"
echo "npu venv ready: $VENV (vllm-ascend 0.23.0, torch 2.10.0, torch-npu 2.10.0.post4)"
