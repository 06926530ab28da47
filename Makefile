# Every target builds .venv on first use from pyproject.toml + constraints.txt (pinned).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The table's hot modules compiled in place by mypyc (setup.py; the list is functional_state/_compiled.py's
# MODULES): the editable install builds them, and $(NATIVE) rebuilds them whenever their source changes, since
# Python imports a module's .so before its .py. FUNCTIONAL_STATE_PURE=1 builds and tests pure Python instead.
NATIVE := $(VENV)/.compiled
COMPILED_SOURCES := $(shell sed -n 's/^    "\(functional_state\.[a-z_.]*\)",$$/\1/p' functional_state/_compiled.py | tr . / | sed 's/$$/.py/')
PURE_TREE := .pure-tree
NOTORCH := .venv-notorch
LOWEST := .venv-lowest

.PHONY: demo test test-pure test-lowest test-pythons test-newest docs notebooks lint typecheck check-core-install bench ab clean-venv

$(STAMP): pyproject.toml constraints.txt setup.py functional_state/_compiled.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# compat: a plain .pth path entry, which pyright and other static checkers follow (setuptools' default
	# editable finder is an import hook they cannot see). Builds the compiled modules in place, in pip's
	# isolated build environment; PIP_CONSTRAINT (unlike -c) reaches it, so mypy is the constraints.txt pin.
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m pip install -q -c constraints.txt -e '.[dev]' \
		--config-settings editable_mode=compat
	touch $(STAMP) $(NATIVE)

$(NATIVE): $(STAMP) $(COMPILED_SOURCES)
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m pip install -q --no-deps -e . --config-settings editable_mode=compat
	touch $(NATIVE)

# The optional C++ helpers over torch tensors (_compiled.py's NATIVE_TORCH): pip's isolated build has no torch,
# so they are built in place with the venv's torch, alone (the editable install compiled the mypyc modules).
TORCH_NATIVE := $(VENV)/.native-torch
$(TORCH_NATIVE): $(NATIVE) functional_state/memory/tensor_run_checks.cpp
	FUNCTIONAL_STATE_TORCH_HELPERS_ONLY=1 $(PY) setup.py -q build_ext --inplace
	touch $(TORCH_NATIVE)

# The demo installs only what it runs (torch, the CLI's rich/matplotlib/psutil, diffusers' Wan encoder,
# transformers' Qwen2 and Llama), with
# pip's progress shown; where `make test`'s full [dev] install is already there (a superset) it uses that.
# One torch/OpenMP thread: default threads oversubscribe a shared box.
DEMO_STAMP := $(VENV)/.installed-demo
$(DEMO_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "make demo: installing functional-state[torch,cli,diffusers,transformers] into $(VENV) (the first time only)"
	$(PY) -m pip install --progress-bar on -c constraints.txt -e '.[torch,cli,diffusers,transformers]' \
		--config-settings editable_mode=compat
	touch $(DEMO_STAMP)

demo: $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m functional_state demo $(DEMO_ARGS)

# The test runs spread over TEST_WORKERS pytest-xdist workers (CI's machine has two cores; TEST_WORKERS=0 runs
# one process). `--dist loadgroup`: each test module, and each of tests/conftest.py's named groups (Ray, the
# notebooks, the doctests), runs whole on one worker, in its own order; --no-loadscope-reorder hands the groups
# out in tests/conftest.py's order (its longest first), not by their number of tests.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# The whole suite on the compiled build (tests/test_compiled.py checks that it is the one imported). The
# compiled modules' sources are not collected for doctests: pytest refuses a module whose __file__ (the .so)
# is not the file it collects; they hold none (tests/test_compiled.py keeps it so).
test: lint typecheck check-core-install docs $(NATIVE) $(TORCH_NATIVE)
	FUNCTIONAL_STATE_EXPECT_COMPILED=1 $(PY) -m pytest -q -p no:cacheprovider $(XDIST) --doctest-modules --nbmake \
		$(addprefix --ignore=,$(COMPILED_SOURCES)) functional_state torch_bridge tests notebooks

# The pure-Python fallback on this interpreter, torch included: the tree without its compiled modules (a copy
# of the tracked and unignored files: the editable install's .so files sit beside the sources), run by the
# same venv (two xdist workers, as make test), on the tests of the table, the shell, checkpoints and the
# hypothesis machines. make test-newest
# runs every test that needs no torch on a pure build (Python 3.13), and make test-pythons the core ones.
PURE_TESTS = tests/test_compiled.py tests/test_records.py tests/test_manager*.py tests/test_table*.py tests/test_ledger*.py \
	tests/test_checkpoint*.py tests/test_shell*.py tests/test_*machine*.py
test-pure: $(STAMP)
	rm -rf $(PURE_TREE) && mkdir $(PURE_TREE)
	git ls-files -co --exclude-standard -z | xargs -0 cp -P --parents -t $(PURE_TREE)
	cd $(PURE_TREE) && FUNCTIONAL_STATE_PURE=1 $(CURDIR)/$(PY) -m pytest -q -p no:cacheprovider $(XDIST) $(PURE_TESTS)
	rm -rf $(PURE_TREE)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy on the package and tests/typing_usage.py (a user's code, with the README's torch block); pyright on that
# file from outside the tree, so the package resolves through the install (.pth) as in a user's project.
typecheck: $(STAMP)
	$(VENV)/bin/mypy
	tmp=$$(mktemp -d) && cp tests/typing_usage.py $$tmp/ && cd $$tmp && \
		$(CURDIR)/$(VENV)/bin/pyright --pythonpath $(CURDIR)/$(PY) typing_usage.py; rc=$$?; rm -rf $$tmp; exit $$rc

# The core installs and runs without torch: a fresh venv with no extras (jax comes from pip's cache).
check-core-install: $(STAMP)
	rm -rf $(NOTORCH)
	$(PYTHON) -m venv $(NOTORCH)
	$(NOTORCH)/bin/python -m pip install -q -c constraints.txt .
	$(NOTORCH)/bin/python scripts/check_core_without_torch.py
	cd scripts && ../$(NOTORCH)/bin/python -c 'import functional_state as fs; assert fs.COMPILED, "not compiled"'
	rm -rf build
	rm -rf $(NOTORCH)

# The API reference and guides in site/; any warning (a broken reference, a missing docstring page) fails it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict  # not --quiet: it hides the warnings --strict counts

# Executes notebooks/*.ipynb in place, outputs normalised (no timings, paths, addresses), to be committed:
# a rerun on unchanged code writes the same files; tests/test_notebooks.py checks the committed ones.
notebooks: $(STAMP)
	$(PY) scripts/execute_notebooks.py

# The lowest versions pyproject.toml allows (constraints-lowest.txt: each direct dependency at its floor;
# torch stays 2.13.0, the only torch wheel on CI's disk) in a fresh venv, on a smoke subset of the tests.
# The test tools keep their constraints.txt pins. The tests import the tree (cwd first on sys.path), so the
# install is built pure (FUNCTIONAL_STATE_PURE=1): compiling a copy nothing imports would only cost time.
LOWEST_TOOLS = $(shell grep -E '^(pytest|hypothesis|chex|packaging)==' constraints.txt)
LOWEST_TESTS = tests/test_packaging.py tests/test_accounting.py tests/test_parking.py tests/test_checkpoint.py \
	tests/test_bridge.py tests/test_cli.py tests/test_persist_handlers.py tests/test_checkpoint_empty.py
test-lowest:
	rm -rf $(LOWEST)
	$(PYTHON) -m venv $(LOWEST)
	FUNCTIONAL_STATE_PURE=1 $(LOWEST)/bin/python -m pip install -q --only-binary :all: -c constraints-lowest.txt \
		'.[torch,checkpoint,cli]' $(LOWEST_TOOLS)
	$(LOWEST)/bin/python -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|numpy|orbax-checkpoint|torch) '
	$(LOWEST)/bin/python -m pytest -q -p no:cacheprovider $(LOWEST_TESTS) -k 'not demo_runs_end_to_end'
	rm -rf build
	rm -rf $(LOWEST)

# The core install (no torch, no extras) on each newer CPython this machine has (pyenv's 3.12 and 3.13; one
# that is absent is skipped with a message): a fresh venv per interpreter, the package from this tree plus the
# test tools at their constraints.txt pins, the core check (scripts/check_core_without_torch.py), then with
# the [checkpoint] extra (orbax, no torch) the tests that import neither torch nor another extra. Pure Python
# (FUNCTIONAL_STATE_PURE=1): the tree's compiled modules are built for the venv's Python, so this interpreter
# imports their sources, and tests/test_compiled.py checks that it does. `step`'s donation check counts references, which CPython 3.12 changed (immortal objects): this is
# where a version difference shows.
PYTHONS ?= /root/.pyenv/versions/3.12.1/bin/python /root/.pyenv/versions/3.13.0/bin/python
PYTHONS_TOOLS = $(shell grep -E '^(pytest|hypothesis|chex)==' constraints.txt)
PYTHONS_TESTS = tests/test_compiled.py tests/test_step.py tests/test_array_ring.py tests/test_budget.py tests/test_config.py \
	tests/test_architecture.py tests/test_pytree_interop.py tests/test_shell_stress.py \
	tests/test_accounting_multidevice.py tests/test_manager_stateful.py
test-pythons:
	@for py in $(PYTHONS); do \
		if ! test -x $$py; then echo "test-pythons: $$py not found, skipped"; continue; fi; \
		v=$$($$py -c 'import sys; print("%d.%d" % sys.version_info[:2])'); venv=.venv-py$$v; \
		echo "test-pythons: Python $$v ($$py) in $$venv"; \
		rm -rf $$venv && $$py -m venv $$venv && \
		FUNCTIONAL_STATE_PURE=1 $$venv/bin/python -m pip install -q -c constraints.txt . $(PYTHONS_TOOLS) && \
		(cd scripts && ../$$venv/bin/python check_core_without_torch.py) && \
		FUNCTIONAL_STATE_PURE=1 $$venv/bin/python -m pip install -q -c constraints.txt '.[checkpoint]' && \
		FUNCTIONAL_STATE_PURE=1 $$venv/bin/python -m pytest -q -p no:cacheprovider $(PYTHONS_TESTS) || exit 1; \
		rm -rf build $$venv; \
	done

# The newest releases, as a new user's `pip install` gets them: jax, jaxlib, flax, orbax-checkpoint, equinox and
# numpy with no constraints (only pyproject.toml's ranges), on Python 3.13, without torch. The package is the
# wheel `python -m build` builds from the sdist it builds first; every test module runs against that install
# (the ones that need torch skip, saying why: tests/conftest.py), then the sdist is installed over it, and
# scripts/smoke_install.py checks each install from outside the tree. The test tools keep their pins. The
# wheel is the pure-Python one (FUNCTIONAL_STATE_PURE=1; a compiled wheel would be for the venv's Python,
# not 3.13): this is the fallback's full run, and tests/test_compiled.py checks that it is pure. The sdist
# installed over it afterwards is built on 3.13 as a user's pip builds it (compiled where a compiler is),
# and smoke_install.py imports that build.
NEWEST_PYTHON ?= /root/.pyenv/versions/3.13.0/bin/python
NEWEST := .venv-py-newest
NEWEST_TOOLS = $(shell grep -E '^(pytest|hypothesis|chex|mktestdocs)==' constraints.txt)
test-newest: $(STAMP)
	rm -rf $(NEWEST) dist
	FUNCTIONAL_STATE_PURE=1 $(PY) -m build -q --outdir dist . >/dev/null
	$(NEWEST_PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade "$$(ls dist/*.whl)[checkpoint,flax,equinox]" \
		jax jaxlib flax orbax-checkpoint equinox numpy $(NEWEST_TOOLS)
	$(NEWEST)/bin/python -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|numpy|flax|orbax-checkpoint|equinox) '
	! $(NEWEST)/bin/python -c 'import torch' 2>/dev/null
	cd scripts && ../$(NEWEST)/bin/python smoke_install.py
	FUNCTIONAL_STATE_PURE=1 $(NEWEST)/bin/pytest -q -p no:cacheprovider tests
	$(NEWEST)/bin/python -m pip install -q --no-deps --force-reinstall dist/*.tar.gz
	cd scripts && ../$(NEWEST)/bin/python smoke_install.py
	rm -rf build dist $(NEWEST)

# Rewrites BENCHMARKS.md (`functional-state bench` without --write only prints).
bench: $(STAMP) $(TORCH_NATIVE)
	$(PY) benchmarks/run.py --write $(BENCH)

ab: $(STAMP)
	$(PY) -m functional_state ab

clean-venv:
	rm -rf $(VENV) $(NOTORCH) $(LOWEST) .venv-py3.12 .venv-py3.13 $(NEWEST) $(PURE_TREE)
