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

CONFIG ?= tiny
SET ?=

.PHONY: recipe test test-unit test-integration bench venv clean

$(BIN)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip $(PIPQ)
	# CPU torch first (a local wheel here); the constraint keeps every later install from swapping it
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0 $(PIPQ)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]' $(PIPQ)
	touch $@

venv: $(BIN)/.installed

recipe: venv
	$(BIN)/mopd recipe --config $(CONFIG) $(foreach s,$(SET),--set $(s))

test: venv
	$(BIN)/python -m pytest tests -q

test-unit: venv
	$(BIN)/python -m pytest tests/unit -q

test-integration: venv
	$(BIN)/python -m pytest tests/integration -q

bench: venv
	$(BIN)/python benchmarks/tiny_recipe.py

clean:
	rm -rf runs .pytest_cache
