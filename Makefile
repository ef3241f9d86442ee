# The two commands a newcomer needs:  `make demo`  and  `make test`.
# Both create .venv on first use; nothing else is installed outside it. They install the
# export extras too (CTranslate2, transformers: ~19 s more), so that the export tests run.

PYTHON ?= python3
VENV   ?= .venv
# torch goes into a new .venv first, on its own: that keeps pip from resolving the range in
# pyproject.toml to another build. TORCH_BUILD picks the build:
#   auto  (the default) on Linux: cpu unless `nvidia-smi -L` lists a GPU, then PyPI's torch,
#         which on Linux x86_64 is the CUDA 13.0 build (a 0.5 GB wheel, several GB with its
#         CUDA libraries; NVIDIA driver 580 or newer: with an older one name cu126). Elsewhere
#         PyPI's torch (on macOS the CPU and MPS build).
#   cpu   torch==$(TORCH_VERSION)+cpu (~190 MB, no CUDA libraries) from $(TORCH_INDEX)/cpu
#   cu126 cu130 cu132 rocm7.2: that build, torch==$(TORCH_VERSION)+<build>, from $(TORCH_INDEX)/<build>
# On Linux x86_64 a named build is looked for among pip's own sources first (pip.conf's
# find-links and indexes: a local wheel, a mirror), then on download.pytorch.org: where that
# host is out of reach, pip spends minutes retrying it for every package. Elsewhere (aarch64,
# whose wheels there may lack the +cpu tag) torch==$(TORCH_VERSION) comes from that index only.
# --index-url, not --extra-index-url, as in PyTorch's instructions: torch's dependencies come
# from that index too, and nothing of that install from PyPI.
# On macOS cpu is PyPI's torch, and a CUDA or ROCm build is an error.
# TORCH overrides all of this with an exact requirement, installed from pip's own sources:
#   make TORCH='torch==2.5.1' test
# A torch already in .venv (any build) is left as it is: to change it, rm -r .venv first.
TORCH_VERSION ?= 2.13.0
TORCH_BUILD   ?= auto
# The builds that download.pytorch.org has for torch 2.13 (CUDA 12.6, 13.0, 13.2 and ROCm
# 7.2; cu128 ended with 2.11). Another TORCH_VERSION may need another list, e.g.
#   make TORCH_VERSION=2.7.1 TORCH_BUILDS='cpu cu118 cu126 cu128' TORCH_BUILD=cu128
TORCH_BUILDS  ?= cpu cu126 cu130 cu132 rocm7.2
TORCH_INDEX   ?= https://download.pytorch.org/whl
TORCH         ?=
EXPERIMENT ?= demo

BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
# DVC stages call `aiayn`, MLflow logs to the local SQLite file unless told otherwise.
# An absolute path, so that runs from `dvc exp run --queue/--temp` (a temporary copy of the
# repository) land in this repository's store.
export MLFLOW_TRACKING_URI ?= sqlite:///$(CURDIR)/mlflow.db

.PHONY: install demo test test-fast coverage params lint bench clean-data help

help:
	@echo "make demo    - set up .venv and run the pipeline on the built-in toy corpus (CPU, offline)"
	@echo "make test    - set up .venv and run the test suite (slow end-to-end tests included)"
	@echo "make test-fast - the test suite without the slow end-to-end tests"
	@echo "make coverage - the test suite under coverage.py: line coverage of aiayn/ and stages/"
	@echo "make install - set up .venv only: torch, then the project with its dev and export extras"
	@echo "make params EXPERIMENT=multi30k - compose params.yaml from conf/: demo, multi30k,"
	@echo "               multi30k_rdrop (CPUs with AMX), multi30k_rdrop_half (AVX512-BF16),"
	@echo "               wmt14_base, wmt14_big"
	@echo "make bench   - data-pipeline benchmark on a WMT14-sized synthetic corpus (long)"
	@echo "make lint    - ruff over aiayn, stages, tests and bench"
	@echo "make clean-data - remove the data stages' outputs (data/raw, vocab, survey, shards)"
	@echo "make test TORCH_BUILD=cpu - the torch build a new .venv gets: auto (the default: cpu without"
	@echo "               an NVIDIA GPU, else PyPI's CUDA build) or one of: $(TORCH_BUILDS)."
	@echo "               TORCH='torch==2.5.1' installs that requirement instead. An existing .venv keeps its torch."

# pip retries a refused connection by itself, but not a download cut short: that ends in
# "THESE PACKAGES DO NOT MATCH THE HASHES" and exit 1 (seen in CI). Another try fetches the
# whole file again.
PIP_TRIES ?= 3
PIP_SLEEP ?= 10
# A variable, because a comma inside $(call ...) would split the argument.
PROJECT := -e ".[dev,export]"
PIP_INSTALL := $(BIN)/python -m pip install --retries 10 --timeout 60
define pip_install
for try in $$(seq $(PIP_TRIES)); do \
  $(PIP_INSTALL) $(1) && exit 0; \
  echo "make: pip install failed (try $$try of $(PIP_TRIES)); a download cut short fails this way" >&2; \
  [ $$try -lt $(PIP_TRIES) ] && sleep $(PIP_SLEEP); \
done; exit 1
endef

# Prints the torch in .venv, e.g. "2.13.0+cpu (CPU only)"; fails where there is none.
TORCH_WHICH := import torch; v = torch.version; print(torch.__version__, \
  '(CUDA %s)' % v.cuda if v.cuda else '(ROCm %s)' % v.hip if getattr(v, 'hip', None) else '(CPU only)')
# Not empty when TORCH_BUILD is one word out of auto $(TORCH_BUILDS).
torch_build_ok = $(and $(filter 1,$(words $(TORCH_BUILD))),$(filter auto $(TORCH_BUILDS),$(TORCH_BUILD)))

# The torch install (see TORCH_BUILD above). One shell line: every branch ends in exit.
define install_torch
if found=$$($(BIN)/python -c "$(TORCH_WHICH)" 2>/dev/null); then \
  echo "make: $(VENV) has torch $$found: left as it is (another build: rm -r $(VENV), then make again)"; \
  exit 0; \
fi; \
req='$(TORCH)'; build='$(TORCH_BUILD)'; index=; \
if [ -n "$$req" ]; then \
  echo "make: installing TORCH=$$req from pip's own sources (TORCH_BUILD is not used)"; \
else \
  os=$$(uname -s); arch=$$(uname -m); \
  if [ "$$build" = auto ]; then \
    if [ "$$os" != Linux ]; then \
      build=pypi; echo "make: TORCH_BUILD=auto on $$os: PyPI's torch"; \
    elif nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then \
      build=pypi; echo "make: TORCH_BUILD=auto: nvidia-smi lists a GPU: PyPI's torch, the CUDA build" \
        "(13.0 on x86_64: NVIDIA driver 580 or newer; for an older one: rm -r $(VENV); make TORCH_BUILD=cu126 ...)"; \
    else \
      build=cpu; echo "make: TORCH_BUILD=auto: no GPU listed by nvidia-smi: the CPU build"; \
    fi; \
  fi; \
  case "$$os $$arch $$build" in \
    *" pypi") req=torch==$(TORCH_VERSION) ;; \
    "Darwin "*" cpu") req=torch==$(TORCH_VERSION); echo "make: on macOS PyPI's torch is the CPU (and MPS) build" ;; \
    Darwin*) echo "make: TORCH_BUILD=$$build: torch has no such build for macOS; use TORCH_BUILD=auto" >&2; exit 1 ;; \
    "Linux x86_64 "*) req=torch==$(TORCH_VERSION)+$$build; index=$(TORCH_INDEX)/$$build ;; \
    *) req=torch==$(TORCH_VERSION); index=$(TORCH_INDEX)/$$build ;; \
  esac; \
fi; \
if [ -n "$$index" ]; then \
  case "$$req" in *+*) \
    echo "make: looking for $$req among pip's own sources first (log: $(VENV)/torch-first-try.log)"; \
    if $(PIP_INSTALL) "$$req" >$(VENV)/torch-first-try.log 2>&1; then \
      tail -n 1 $(VENV)/torch-first-try.log; exit 0; \
    fi; \
    echo "make: pip has none of its own";; \
  esac; \
  echo "make: pip install --index-url $$index $$req"; \
  $(call pip_install,--index-url "$$index" "$$req"); \
fi; \
echo "make: pip install $$req"; \
$(call pip_install,"$$req")
endef

$(VENV)/.installed: pyproject.toml
	@$(if $(torch_build_ok),:,echo "make: TORCH_BUILD='$(TORCH_BUILD)' is not a torch build this Makefile knows." \
	  "Use one of: auto $(TORCH_BUILDS) (or TORCH='torch==...' for an exact requirement)" >&2; exit 2)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(install_torch)
	$(call pip_install,$(PROJECT))
	touch $@

install: $(VENV)/.installed

# The demo checks that it learned: the preset reaches sacreBLEU ~86-89; below 60 it fails.
demo: install
	dvc repro
	@echo
	aiayn results --min-bleu 60

# One test process per CPU core (pytest-xdist), tests handed out a few at a time: each
# process that runs an end-to-end test makes the session's pipeline run once. (Whole modules
# per process, --dist loadfile, made it once but took 11.1 min against 8.5–8.9 on 2 cores
# capped to AVX2, docs/results/README.md#make-test: the training and end-to-end modules then
# end the run alone.) PYTEST_WORKERS=1: one process.
PYTEST_WORKERS ?= auto
PYTEST_PARALLEL := $(if $(filter 1,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS))

test: install
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) --durations=15

test-fast: install
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) -m "not slow"

# Line coverage of aiayn/ and stages/ over the whole suite, the processes the tests start
# included ([tool.coverage] in pyproject.toml); about twice the suite's time.
coverage: install
	$(BIN)/python -m coverage erase
	$(BIN)/python -m coverage run -m pytest -q $(PYTEST_PARALLEL)
	$(BIN)/python -m coverage combine -q
	$(BIN)/python -m coverage report

params: install
	aiayn params $(EXPERIMENT)

lint: install
	$(BIN)/ruff check aiayn stages tests bench

bench: install
	$(BIN)/python -m bench.data_pipeline

clean-data:
	rm -rf data/raw data/vocab data/survey data/shards
