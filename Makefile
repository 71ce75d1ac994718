# slime-gateway: `make demo` runs the whole thing end to end, `make test` runs the suite. Both set up .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The CPU wheel of torch that lies on this machine's disk: a plain `torch` requirement would pull a multi-GB
# CUDA build. Only the client SDK and its tests use torch; the gateway itself needs none.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test lint format demo bench clean

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo: install
	PYTHON=$(PY) bash examples/demo.sh

bench: install
	$(PY) -m bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
