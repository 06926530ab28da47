# Every target builds .venv on first use from pyproject.toml + constraints.txt (pinned).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench ab clean-venv

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m functional_state demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --doctest-modules --nbmake functional_state torch_bridge tests notebooks

bench: $(STAMP)
	$(PY) benchmarks/run.py $(BENCH)

ab: $(STAMP)
	$(PY) -m functional_state ab

clean-venv:
	rm -rf $(VENV)
