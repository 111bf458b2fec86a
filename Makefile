# One entry point for people and CI. `make test` is the test command README gives; .ci/run calls it.
# Each target creates (or reuses) a local virtual environment and installs what it needs: torch==2.13.0
# first (the CPU build; a looser pin could pull several GB of CUDA packages), then streamwatch itself
# with the extra the target needs: `demo` only the demo extra (in .venv-demo), every other target the
# dev extra (in .venv).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_VENV ?= .venv-demo
DEMO_PY := $(DEMO_VENV)/bin/python
PYTEST_ARGS ?=
DEMO_ARGS ?=
DIVERGENCE_ARGS ?=
GPU_OUT ?= benchmarks/results/gpu
DRY_RUN ?=
SOURCES := pyproject.toml setup.py streamwatch/_schema.py streamwatch/_fused.c streamwatch/_fused_body.h streamwatch/_fused_module.c

.PHONY: env demo test lint format bench bench-divergence bench-gpu dashboards clean

$(VENV)/.installed: $(SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

env: $(VENV)/.installed

$(DEMO_VENV)/.installed: $(SOURCES)
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_PY) -m pip install --quiet torch==2.13.0
	$(DEMO_PY) -m pip install --quiet -e '.[demo]'
	touch $@

# The first-run command: a real training run with the live view, /metrics and a run file; it keeps
# serving /metrics after training until Ctrl-C. Installs the demo extra only (rich, matplotlib).
demo: $(DEMO_VENV)/.installed
	$(DEMO_PY) -m streamwatch demo $(DEMO_ARGS)

# pytest exits 5 when it collected nothing: that is a failure here, never a pass.
test: env
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests; a test run must run tests" >&2; exit 1; fi; \
	exit $$rc

lint: env
	$(PY) -m ruff check streamwatch tests benchmarks setup.py .ci
	$(PY) -m ruff format --check streamwatch tests benchmarks setup.py .ci
	$(PY) -m mypy streamwatch
	$(PY) .ci/sizes.py

format: env
	$(PY) -m ruff check --fix streamwatch tests benchmarks setup.py .ci
	$(PY) -m ruff format streamwatch tests benchmarks setup.py .ci

# Regenerate the Grafana dashboards (dashboards/*.json) from dashboards/generate.py; commit the result.
dashboards: env
	$(PY) dashboards/generate.py

bench: env
	$(PY) -m pytest benchmarks -o python_files='bench_*.py' -p no:cacheprovider --benchmark-only \
		--benchmark-columns=min,median,mean,rounds $(PYTEST_ARGS)

# The divergence suite (benchmarks/divergence/): each detector's steps of warning before a run diverges and its
# false alarms on healthy runs, as a Markdown table (docs/detectors.md). CPU, a few minutes; not part of `test`.
bench-divergence: env
	$(PY) benchmarks/divergence/run.py $(DIVERGENCE_ARGS)

# The GPU check (benchmarks/gpu/all.sh, about 7 minutes on one GPU): environment, CUDA tests, launch counts,
# overhead ratios, a compiled model (run.py: results.json, results.md, log.txt); where a step's time goes
# (where.py), the Triton main loops' instructions per element (instructions.py, no GPU needed) and block
# shapes (tiles.py), all into $(GPU_OUT). OLD_KERNELS=REV: tiles.py and instructions.py also take REV's
# kernels. DRY_RUN=1: every part on the CPU at toy sizes, in about a minute (CI runs it). On a GPU machine
# run benchmarks/gpu/all.sh with its own python3 instead: .venv's torch is the CPU build.
OLD_KERNELS ?=
bench-gpu: env
	DRY_RUN=$(DRY_RUN) PY=$(PY) benchmarks/gpu/all.sh $(GPU_OUT) $(OLD_KERNELS)

clean:
	rm -rf $(VENV) $(DEMO_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .benchmarks
