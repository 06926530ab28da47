# Every target builds .venv on first use from pyproject.toml + constraints.txt (pinned).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NOTORCH := .venv-notorch

.PHONY: demo test lint typecheck check-core-install bench ab clean-venv

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m functional_state demo

test: lint typecheck check-core-install
	$(PY) -m pytest -q -p no:cacheprovider --doctest-modules --nbmake functional_state torch_bridge tests notebooks

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The core installs and runs without torch: a fresh venv with no extras (jax comes from pip's cache).
check-core-install: $(STAMP)
	rm -rf $(NOTORCH)
	$(PYTHON) -m venv $(NOTORCH)
	$(NOTORCH)/bin/python -m pip install -q -c constraints.txt .
	$(NOTORCH)/bin/python scripts/check_core_without_torch.py
	rm -rf build
	rm -rf $(NOTORCH)

bench: $(STAMP)
	$(PY) benchmarks/run.py $(BENCH)

ab: $(STAMP)
	$(PY) -m functional_state ab

clean-venv:
	rm -rf $(VENV) $(NOTORCH)
