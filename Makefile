# medsafe_nb — the verbs a newcomer types. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
P      ?= demo
NPROC  ?= 2

.DEFAULT_GOAL := help
.PHONY: help install test test-nbs test-py check readme docs figures bench clean

help: ## list the verbs
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "  (figures take P=demo|smoke|paper; default P=demo)"

$(STAMP): requirements.txt setup.py settings.ini
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	@touch $(STAMP)

install: $(STAMP) ## create .venv and install the pinned requirements and the package (idempotent)

test: test-nbs test-py ## run the library notebooks (nbdev_test) and pytest tests/

test-nbs: $(STAMP)
	$(BIN)/nbdev_test --n_workers $(NPROC) --do_print --timing

test-py: $(STAMP)
	$(BIN)/python -m pytest -q tests

check: $(STAMP) ## prove notebooks and medsafe_nb/ agree: nbdev_clean + nbdev_export leave no git diff
	$(BIN)/nbdev_clean
	$(BIN)/nbdev_export
	@git diff --exit-code --stat -- nbs medsafe_nb || { echo "make check: notebooks and modules disagree (see diff above)"; exit 1; }
	@test -z "$$(git status --porcelain --untracked-files=all -- medsafe_nb)" || { git status --short -- medsafe_nb; echo "make check: untracked generated modules"; exit 1; }
	@echo "make check: notebooks and modules agree"

readme: $(STAMP) ## regenerate README.md from nbs/index.ipynb (nbconvert, no code shown)
	$(BIN)/jupyter nbconvert --log-level=WARN --to markdown --no-input --output-dir . --output README nbs/index.ipynb
	@sed -i -e :a -e '/^\n*$$/{$$d;N;ba' -e '}' README.md

docs: $(STAMP) ## render every notebook to HTML in _docs/ (nbconvert; Quarto optional)
	@mkdir -p _docs/analysis
	$(BIN)/jupyter nbconvert --log-level=WARN --to html --output-dir _docs nbs/*.ipynb
	$(BIN)/jupyter nbconvert --log-level=WARN --to html --output-dir _docs/analysis nbs/analysis/*.ipynb
	@echo "docs: open _docs/index.html"

figures: $(STAMP) ## run the analysis notebooks with papermill (P=demo|smoke|paper) and write figures/
	$(BIN)/python -m medsafe_nb.figures --params nbs/analysis/params/$(P).yaml

bench: $(STAMP) ## print the speed and memory benchmarks (bench/)
	@for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean: ## remove build outputs (keeps .venv, data/runs and the committed figures)
	rm -rf _docs _proc build dist *.egg-info .pytest_cache figures/executed
