# The two commands a newcomer needs:  `make demo`  and  `make test`.
# Both create .venv on first use; nothing else is installed outside it. They install the
# export extras too (CTranslate2, transformers: ~19 s more), so that the export tests run.

PYTHON ?= python3
VENV   ?= .venv
# The torch build to install first. torch==2.13.0 is the CPU build on a CPU-only machine
# whose pip finds it locally, and the default CUDA build from PyPI elsewhere. Installing it
# before the project keeps pip from resolving the range in pyproject.toml to another build.
TORCH  ?= torch==2.13.0
EXPERIMENT ?= demo

BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
# DVC stages call `aiayn`, MLflow logs to the local SQLite file unless told otherwise.
# An absolute path, so that runs from `dvc exp run --queue/--temp` (a temporary copy of the
# repository) land in this repository's store.
export MLFLOW_TRACKING_URI ?= sqlite:///$(CURDIR)/mlflow.db

.PHONY: install demo test test-fast params lint bench clean-data help

help:
	@echo "make demo    - set up .venv and run the pipeline on the built-in toy corpus (CPU, offline)"
	@echo "make test    - set up .venv and run the test suite (slow end-to-end tests included)"
	@echo "make test-fast - the test suite without the slow end-to-end tests"
	@echo "make params EXPERIMENT=multi30k - compose params.yaml from conf/ (demo, multi30k, wmt14_base, wmt14_big)"
	@echo "make bench   - data-pipeline benchmark on a WMT14-sized synthetic corpus (long)"

# pip retries a refused connection by itself, but not a download cut short: that ends in
# "THESE PACKAGES DO NOT MATCH THE HASHES" and exit 1 (seen in CI). Another try fetches the
# whole file again.
PIP_TRIES ?= 3
PIP_SLEEP ?= 10
# A variable, because a comma inside $(call ...) would split the argument.
PROJECT := -e ".[dev,export]"
define pip_install
for try in $$(seq $(PIP_TRIES)); do \
  $(BIN)/python -m pip install --retries 10 --timeout 60 $(1) && exit 0; \
  echo "make: pip install failed (try $$try of $(PIP_TRIES)); a download cut short fails this way" >&2; \
  [ $$try -lt $(PIP_TRIES) ] && sleep $(PIP_SLEEP); \
done; exit 1
endef

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || { $(call pip_install,"$(TORCH)"); }
	$(call pip_install,$(PROJECT))
	touch $@

install: $(VENV)/.installed

demo: install
	dvc repro
	@echo
	aiayn results

test: install
	$(BIN)/python -m pytest -q --durations=15

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

params: install
	aiayn params $(EXPERIMENT)

lint: install
	$(BIN)/ruff check aiayn stages tests bench

bench: install
	$(BIN)/python -m bench.data_pipeline

clean-data:
	rm -rf data/raw data/vocab data/survey data/shards
