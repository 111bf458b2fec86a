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

# The GPU check (benchmarks/gpu/run.py, about 5 minutes on one GPU): environment, CUDA tests, launch counts,
# overhead ratios, a compiled model, into $(GPU_OUT) (results.json, results.md, log.txt); then where a step's
# time goes (where.py: where.json, ~1 minute) and the Triton block shapes (tiles.py: tiles.json, ~1 minute).
# OLD_KERNELS=REV: tiles.py also times REV's kernels (--old), and instructions.py counts both (no GPU needed).
# DRY_RUN=1: every part on the CPU at toy sizes, in about a minute (CI runs it).
OLD_KERNELS ?=
bench-gpu: env
	PYTHONPATH=. $(PY) benchmarks/gpu/run.py --out $(GPU_OUT) $(if $(DRY_RUN),--dry-run)
	PYTHONPATH=. $(PY) benchmarks/gpu/where.py --out $(GPU_OUT) $(if $(DRY_RUN),--dry-run) > $(GPU_OUT)/where.md
	$(if $(OLD_KERNELS),git show $(OLD_KERNELS):streamwatch/_triton_kernels.py > $(GPU_OUT)/old_kernels.py)
	$(PY) benchmarks/gpu/instructions.py --json $(GPU_OUT)/instructions.json \
		$(if $(OLD_KERNELS),--old $(GPU_OUT)/old_kernels.py) > $(GPU_OUT)/instructions.md
	$(if $(DRY_RUN),TRITON_INTERPRET=1 STREAMWATCH_KERNEL=triton) PYTHONPATH=. $(PY) benchmarks/gpu/tiles.py \
		--out $(GPU_OUT) --budget 90 $(if $(DRY_RUN),--dry-run) $(if $(OLD_KERNELS),--old $(GPU_OUT)/old_kernels.py) \
		> $(GPU_OUT)/tiles.txt

clean:
	rm -rf $(VENV) $(DEMO_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .benchmarks
