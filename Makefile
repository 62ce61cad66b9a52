# make demo: set up (venv, CPU torch, the package) and run the main job.
# make test: set up (plus test extras) and run lint, type check and the test suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# the CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build
TORCH_SPEC ?= torch==2.13.0
PIP_INDEX ?= --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple

.PHONY: demo test test-slow lint typecheck setup setup-test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.torch: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_SPEC)" || $(BIN)/pip install -q $(PIP_INDEX) "$(TORCH_SPEC)"
	touch $@

$(VENV)/.setup: $(VENV)/.torch pyproject.toml
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.setup-test: $(VENV)/.torch pyproject.toml
	$(BIN)/pip install -q -e ".[test]"
	touch $@ $(VENV)/.setup

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test

demo: setup-test
	$(BIN)/normatlas demo

lint: setup-test
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: setup-test
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: setup-test
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
