# gravac: every target sets itself up on a fresh machine (see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Torch to install: the CPU build (a wheel that installs offline on our machines) where no CUDA
# GPU is present, the default release otherwise. Override: make test TORCH_SPEC='torch==2.14.1'
HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_SPEC ?= $(if $(HAS_CUDA),torch,torch==2.13.0)
STAMP := $(VENV)/.gravac-installed

.PHONY: demo test check lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): setup.cfg pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev,lab,integrations]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gravac demo --compare-dense

# every test (CI); `check`: the edit loop's fast subset, no test that launches a process
test: $(STAMP)
	$(PY) -m pytest -q

check: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check gravac gravac_lab tests examples benchmarks scripts
	$(VENV)/bin/ruff format --check gravac gravac_lab tests examples benchmarks scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

bench: $(STAMP)
	$(VENV)/bin/gravac bench compressors

clean:
	rm -rf $(VENV) runs build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
