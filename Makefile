# The lab's commands. Each target does its own set-up (a .venv with the pinned dependencies).
#   make lab      set up, then open JupyterLab on notebooks/
#   make test     set up, then the whole test suite on the reference solutions, notebooks included
#   make grade    set up, then grade YOUR exercises (exercises/) and print a table
#   make bench    set up, then every benchmark in its quick setting
#   make setup    set up only
#   make browser  as root: install Chromium, Open MPI, MPICH and Slurm if missing (for the browser and two-host tests)
#   make test-stress   the whole suite while two busy loops keep both cores busy (bounded, always cleaned up)

SHELL  := /bin/bash
# OpenMP threads that spin while waiting make torch up to 10x slower when the cores are shared
# (several ranks, a busy laptop); sleeping threads cost nothing on an idle machine.
export OMP_WAIT_POLICY ?= PASSIVE
# Playwright drives the system's Chromium (/usr/bin/chromium): it must never fetch a browser of its own.
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD := 1
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.labkit-installed
# JupyterLab settings the lab ships (no "Jupyter news?" pop-up over the outputs, no kernel dialog)
OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json
# Debian packages for tests/test_browser.py and tests/test_multihost.py (skipped without them)
SYSTEM_PACKAGES := chromium openmpi-bin mpich slurm-wlm
# Warnings about the machine's extra package indexes are noise: keep pip's output readable.
PIP_QUIET := 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
# The installer of the set-up where it can stand in for pip (below)
UV_VERSION := 0.13.9

.PHONY: setup lab test test-stress grade bench notebooks-clean stubs help browser
.DEFAULT_GOAL := help

help:
	@sed -n '2,8p' Makefile

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "Python 3.10+ is needed (python3.11 recommended)"; exit 1; }
	@echo "Setting up $(VENV) with $(PYTHON) (first time: a few minutes)..."
	@# --without-pip: ensurepip alone takes 5 s; pip comes with the packages (uv) or from ensurepip (below)
	@test -x $(BIN)/python || $(PYTHON) -m venv --without-pip $(VENV)
	@# uv installs the same pins in about 10 s where pip takes about 50 (it downloads and unpacks in parallel).
	@# pip stays where uv cannot stand in for it: PIP_EXTRA given (uv orders extra indexes before the main one,
	@# so the README's CPU-index recipe would take PyPI's CUDA torch), uv not installable, or a uv plan with
	@# CUDA libraries (nvidia-*) where pip takes a CPU torch from its find-links (as on this project's machines).
	@links=$$(for l in $$PIP_FIND_LINKS; do printf -- '--find-links %s ' "$$l"; done); uv=$(VENV)/uv/bin/uv; \
	if [ -z "$(PIP_EXTRA)" ] && { [ -x $$uv ] || PIP_ROOT_USER_ACTION=ignore $(PYTHON) -m pip install -q \
	        --target $(VENV)/uv "uv==$(UV_VERSION)" $(PIP_QUIET); } && [ -x $$uv ] \
	   && plan=$$($$uv pip install --dry-run --python $(BIN)/python $$links -e ".[test]" pip 2>&1) \
	   && ! grep -q " + nvidia-" <<< "$$plan"; then \
		$$uv pip install -q --python $(BIN)/python $$links -e ".[test]" pip; \
	else \
		echo "installing with pip"; \
		$(BIN)/python -m pip --version > /dev/null 2>&1 || $(BIN)/python -m ensurepip > /dev/null; \
		set -o pipefail; $(BIN)/python -m pip install -q --upgrade pip $(PIP_QUIET); \
		$(BIN)/python -m pip install -q --no-compile -e ".[test]" $(PIP_EXTRA) $(PIP_QUIET); \
	fi
	@# Then compileall on every core. The dependencies must be compiled here: where PYTHONDONTWRITEBYTECODE is set
	@# (as on this project's machines) Python never writes a .pyc, and every process would compile torch from source
	@# at import. Left out: the packages' own test suites and pip (nothing imports them; 13 s of 47).
	@$(BIN)/python -m compileall -q -j 0 -x '/site-packages/pip/|/tests/' $(VENV)/lib > /dev/null || true  # a few files do not compile, as pip ignores
	@$(BIN)/python -c "import torch, labkit; print('torch', torch.__version__, '- labkit ready')"
	@touch $(STAMP)

$(OVERRIDES): labkit/assets/jupyterlab-overrides.json $(STAMP)
	@mkdir -p $(dir $@) && cp $< $@

setup: $(STAMP) $(OVERRIDES)

# Installs only what is missing, only as root, only with apt-get; otherwise says what to run.
browser:
	@missing=""; \
	[ -x /usr/bin/chromium ] || missing="$$missing chromium"; \
	command -v mpiexec >/dev/null || missing="$$missing openmpi-bin"; \
	[ -x /usr/bin/mpiexec.mpich ] || missing="$$missing mpich"; \
	{ command -v slurmctld || [ -x /usr/sbin/slurmctld ]; } >/dev/null || missing="$$missing slurm-wlm"; \
	if [ -z "$$missing" ]; then echo "Chromium, Open MPI, MPICH and Slurm are installed"; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "missing:$$missing; install as root with: apt-get install -y$$missing (their tests are skipped until then)"; \
	else export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y --no-install-recommends $$missing || \
		{ apt-get update && apt-get install -y --no-install-recommends $$missing; }; fi

lab: setup
	$(BIN)/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root,)

# The lab's own test suite: labkit, the grading tests on the reference solutions, the proof that
# every grading test fails on the untouched stubs, and every notebook executed in its quick setting.
test: setup
	LABKIT_QUICK=1 $(BIN)/python -m pytest --impl=solutions tests --durations=15 $(PYTEST_ARGS)

# The suite's verdicts must not depend on how fast a rank starts: run it with both cores taken by
# two busy loops. Both loops and the run are bounded by STRESS_SECONDS; the loops die on any exit.
STRESS_SECONDS ?= 3000
test-stress: setup
	@busy=""; trap 'kill $$busy 2>/dev/null; wait 2>/dev/null' EXIT INT TERM; \
	for i in 1 2; do timeout $(STRESS_SECONDS) $(BIN)/python -c 'while True: pass' & busy="$$busy $$!"; done; \
	echo "two busy loops (pids$$busy) keep the cores busy during the suite"; \
	timeout $(STRESS_SECONDS) $(MAKE) --no-print-directory test

grade: setup
	$(BIN)/python -m pytest tests/grading --impl=exercises --grade -q --tb=no -rN $(PYTEST_ARGS) || true

bench: setup
	@for script in bench/*.py; do echo "== $$script --quick"; LABKIT_QUICK=1 $(BIN)/python $$script --quick || exit 1; done

# Maintainers: regenerate exercises/ from solutions/ (edited exercises are kept, see labkit/grading/stubgen.py).
stubs: setup
	$(BIN)/python -m labkit.grading.stubgen

notebooks-clean: setup
	$(BIN)/jupyter nbconvert --clear-output --inplace notebooks/*.ipynb
