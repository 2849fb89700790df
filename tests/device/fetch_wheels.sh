#!/usr/bin/env bash
# The wheels the lent accelerator machine lacks, for Python 3.12 on x86-64 Linux, into .whl/ (git-ignored through
# .git/info/exclude, carried with the device run: name `.whl` in the run's carry; tests/device/run_all.sh installs
# them into a private folder). Its image has torch 2.11, transformers 5.17, accelerate, peft, triton, numpy,
# pandas, pyarrow, pyyaml, httpx, pytest — and not these (4.5 MB together):
#   pydantic + pydantic_core, annotated_types, typing_inspection   mopd_core.config
#   trl                                                              perf_checks.py trl (DistillationTrainer)
#   datasets + dill, multiprocess                                    mopd_core (quiet_hf), trl
# Not carried: liger-kernel (TRL's use_liger_kernel patches transformers' model code; unverified against
# transformers 5.17, and a failure there would cost the run's TRL figures), ray (its wheel is over the 64 MiB a
# run carries), vllm (hundreds of MB).
#
#   tests/device/fetch_wheels.sh            # run here, in the repository root, before the device run
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"  # a worktree's .git is a file: the common dir's
grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >>"$EXCLUDE"
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 \
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
ls -la .whl
du -sh .whl
