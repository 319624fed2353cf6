# Two entry points: `make demo` runs the evaluation on the local default, `make test` runs every suite.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# ansible-core 2.21 needs Python >= 3.12 on the control node; the ML environment uses Python 3.11,
# for which a CPU torch wheel is available offline on this kind of machine.
# The first candidate that really runs (a pyenv shim for an inactive version does not) and can make
# environments (a distribution may ship venv's ensurepip apart, as Debian's python3.X-venv). The
# distribution's build comes first: built with PGO and LTO, it runs pure Python in half the CPU of a
# from-source (pyenv) build, and a whole evaluation on the local default in a sixth less
# (benchmarks/interpreters.sh, benchmarks/eval_interpreters.sh; 2026-12-03, 2 cores).
find_python = $(shell for p in /usr/bin/python$(1) $$HOME/.pyenv/versions/$(1)*/bin/python$(1) $$(command -v python$(1)); do \
                "$$p" -c 'import ensurepip, venv' 2>/dev/null && { echo "$$p"; break; }; done)
PYTHON_CONTROL ?= $(call find_python,3.12)
PYTHON_ML ?= $(call find_python,3.11)
VENV := .venv
# Labels a long step's output and says it is still working when it is quiet (see .ci/heartbeat.py).
HEARTBEAT = $(PYTHON_CONTROL) $(CURDIR)/.ci/heartbeat.py
ML_VENV := .venv-ml
ANSIBLE_PLAYBOOK := $(VENV)/bin/ansible-playbook
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
# Bytecode goes to one cache outside the tree, written by whichever process first imports a module and read
# by every later one: nothing is written beside the sources (the checkout, the collection), and only what
# some process imports is compiled (torch alone has thousands of modules no run imports). With a prefix set
# Python reads no __pycache__ beside the sources either, so the installers compile nothing (PIP_COMPILE=0,
# and uv without --compile-bytecode): 2026-12-05, about 37 core-s of make test went to compiling the two
# environments, and every process that imported specops compiled it again.
export PYTHONPYCACHEPREFIX := $(CURDIR)/.work/pycache
export PIP_COMPILE := 0
# A machine that sets PYTHONDONTWRITEBYTECODE for every process would keep that cache empty, and with the
# prefix set no process would read the environments' own bytecode: every import compiled, every time
# (2026-12-05: twice the CPU of the whole suite).
unexport PYTHONDONTWRITEBYTECODE
# Tests exercise the working tree, not the copy of the package installed in the ML environment.
test test-%: export PYTHONPATH := $(CURDIR)/src
# The suites keep both cores busy: a torch process's second thread would mostly spin at OpenMP's
# barriers waiting for a core (one eval.yml beside two busy processes: 174 core-s with torch's two
# threads, 92 with one). Tests that compare thread counts set them explicitly.
test test-%: export OMP_NUM_THREADS := 1

.PHONY: help demo demo-stop test test-in-order test-python test-python-checks test-unit test-ansible test-lint \
        test-sanity test-units \
        test-integration test-fleet test-systemd test-fixtures test-models \
        system-deps ml-env venv lock lock-check clean

help:
	@echo "make demo   - set up, then run playbooks/eval.yml on the local default and print the report path"
	@echo "make test   - run every test suite (lint, sanity, units, package, playbooks, systemd)"

# uv fills the environments from the locks (seconds where pip takes minutes) and compiles them; it
# lives in a small environment of its own, installed by pip from a hash-pinned lock.
UV_ENV := .work/uv
UV := $(UV_ENV)/bin/uv
# Exactly what a lock says: every dependency is in it, each file is checked against its hashes.
UV_INSTALL_LOCK = $(UV) pip install --require-hashes --no-deps --python
# torch is not in ml.lock: the host's pip configuration (index, wheelhouse) provides it, here a local
# CPU wheel. The version is the one the local inventory asks the fla_env role for.
ML_TORCH = $(shell sed -n 's/^fla_env_torch: *//p' inventory/local/group_vars/gpu_hosts.yml)
PURELIB = $$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

$(UV_ENV)/.stamp: requirements/bootstrap.lock
	@test -n "$(PYTHON_CONTROL)" || { echo "Python 3.12 is required for ansible-core 2.21 (set PYTHON_CONTROL)"; exit 1; }
	@echo "== $(UV_ENV): uv, from requirements/bootstrap.lock"
	$(PYTHON_CONTROL) -m venv --clear $(UV_ENV)
	$(UV_ENV)/bin/pip install --progress-bar on --require-hashes --no-deps -r requirements/bootstrap.lock
	touch $@

# --clear: a rebuilt environment holds what the lock says and nothing left over from an older one.
$(VENV)/.stamp: $(UV_ENV)/.stamp requirements/test.lock requirements/collections.yml \
                requirements/collection-sources.lock requirements/install_collections.py
	@echo "== $(VENV): Python $(PYTHON_CONTROL), the control node's runtime and the test tools (requirements/test.lock)"
	$(PYTHON_CONTROL) -m venv --clear $(VENV)
	$(HEARTBEAT) venv $(UV_INSTALL_LOCK) $(VENV)/bin/python -r requirements/test.lock
	@echo "== $(VENV): collections of requirements/collections.yml"
	$(HEARTBEAT) venv $(VENV)/bin/python requirements/install_collections.py requirements/collections.yml \
	  --source-lock requirements/collection-sources.lock --dest "$(call PURELIB,$(VENV))"
	touch $@

venv: $(VENV)/.stamp

# The ML environment is built by the fla_env role, the same code that builds it on GPU hosts, from the
# same lock (the role's default). The first steps fill it with what the role would install, with
# progress shown (inside a module pip runs silently for minutes), and run again only when a lock
# changes; the role then installs specops, finds the rest satisfied and verifies the backend.
$(ML_VENV)/.locked: $(UV_ENV)/.stamp requirements/ml.lock requirements/ml-dev.lock
	@test -n "$(PYTHON_ML)" || { echo "Python 3.11 is required for the ML environment (set PYTHON_ML)"; exit 1; }
	@echo "== $(ML_VENV): Python $(PYTHON_ML), requirements/ml.lock and ml-dev.lock"
	$(PYTHON_ML) -m venv --clear $(ML_VENV)
	$(HEARTBEAT) ml-env $(UV_INSTALL_LOCK) $(ML_VENV)/bin/python -r requirements/ml.lock -r requirements/ml-dev.lock
	@echo "== $(ML_VENV): $(ML_TORCH) from pip's configured index or wheelhouse"
	$(HEARTBEAT) ml-env $(ML_VENV)/bin/pip install --progress-bar on --no-deps "$(ML_TORCH)"
	touch $@

$(ML_VENV)/.stamp: $(VENV)/.stamp $(ML_VENV)/.locked pyproject.toml
	@echo "== $(ML_VENV): specops and the backend check (fla_env role)"
	$(HEARTBEAT) ml-env $(ANSIBLE_PLAYBOOK) playbooks/ml_env.yml -e fla_env_python=$(PYTHON_ML) -e fla_env_venv=$(CURDIR)/$(ML_VENV)
	touch $@

ml-env: $(ML_VENV)/.stamp

# The locks, from the .in files next to them (and pyproject.toml for ml.lock). Hashes of every file
# of each pinned version, so a host of another platform can check what it installs.
# control and test: any platform, Python 3.12 (ansible-core 2.21). ml: the Python and platform the
# ML environment is tested on (its torch wheel decides the rest); GPU hosts take the same pins.
# torch's CPU wheel is found where pip's configuration looks (find-links); uv does not read pip's files.
PIP_WHEELHOUSES = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON_CONTROL) -m pip config get global.find-links 2>/dev/null))
# A lock whose content did not change keeps its date, so the environments built from it stay current.
# uv keeps the versions an existing output file pins (upgrade with: make lock LOCK_FLAGS=--upgrade).
LOCK = compile_lock() { out="$$1"; shift; cp "$$out" "$$out.new" 2>/dev/null; \
         $(UV) pip compile $(LOCK_FLAGS) --quiet --generate-hashes --custom-compile-command "make lock" "$$@" -o "$$out.new" && \
         { cmp -s "$$out.new" "$$out" && rm "$$out.new" || { mv "$$out.new" "$$out"; echo "updated $$out"; }; }; }; compile_lock
lock: $(UV_ENV)/.stamp
	$(LOCK) requirements/bootstrap.lock --universal --python-version 3.12 requirements/bootstrap.in
	$(LOCK) requirements/control.lock --universal --python-version 3.12 requirements/control.in
	$(LOCK) requirements/test.lock --universal --python-version 3.12 requirements/test.in
	$(LOCK) requirements/build.lock --universal --python-version 3.12 requirements/build.in
	$(LOCK) requirements/collection-sources.lock --python-version 3.12 --no-deps requirements/collection-sources.in
	$(LOCK) requirements/ml.lock --python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-emit-package torch \
	  $(foreach dir,$(PIP_WHEELHOUSES),--find-links $(dir)) pyproject.toml --extra ml requirements/ml.in
	$(LOCK) requirements/ml-dev.lock --python-version 3.11 --python-platform x86_64-manylinux_2_28 requirements/ml-dev.in

# Environments rebuilt from the locks hold exactly the locked versions: builds both again under other
# names and compares their `pip freeze` with the locks.
LOCK_CHECK_VENV := .venv-lock-check
lock-check:
	$(MAKE) VENV=$(LOCK_CHECK_VENV) ML_VENV=$(LOCK_CHECK_VENV)-ml $(LOCK_CHECK_VENV)-ml/.stamp
	$(LOCK_CHECK_VENV)/bin/python requirements/check_lock.py requirements/test.lock
	$(LOCK_CHECK_VENV)-ml/bin/python requirements/check_lock.py requirements/ml.lock \
	  requirements/ml-dev.lock --also "$(ML_TORCH)" --also specops==$$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

demo: $(VENV)/.stamp $(ML_VENV)/.stamp
	$(HEARTBEAT) demo $(ANSIBLE_PLAYBOOK) playbooks/eval.yml -e fla_env_python=$(PYTHON_ML)
	@echo "Report: $(CURDIR)/.work/demo/run/score/report.md"

demo-stop: $(VENV)/.stamp
	$(ANSIBLE_PLAYBOOK) playbooks/service.yml -e sglang_service_state=stopped -e sglang_service_guard=false

system-deps:
	@command -v debootstrap >/dev/null && command -v systemd-nspawn >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap systemd-container; }

# Fixture models, each built once per run and shared, each build saying its steps: TEST_MODELS has
# the trained reference drafter (the playbooks of the integration and fleet tests read it, and so do
# the unit tests that need a drafter trained on the target); TEST_FIXTURES holds the same target and
# drafter with an untrained reference (the unit and module tests read it). A suite run on its own
# builds what it needs itself.
TEST_MODELS := $(CURDIR)/.work/test-models
TEST_FIXTURES := $(CURDIR)/.work/test-fixtures
test test-%: export SPECOPS_TEST_MODELS := $(TEST_MODELS)
test test-%: export SPECOPS_FIXTURES := $(TEST_FIXTURES)

# Per-test durations of every suite land here (JUnit XML, and the slowest in each log), so the suites
# can be ordered on measured numbers.
TEST_REPORTS := $(CURDIR)/.work/test-reports
# -v: one line per test, so a suite shows where it is; --durations: slow tests are named in every run.
PYTEST_FLAGS = -v -p no:cacheprovider --durations=25 --durations-min=1 --junitxml=$(TEST_REPORTS)/$@.xml
# Spread over both cores, a file per worker: module-scoped fixtures (servers, engines) stay built once.
XDIST = -n 2 --dist loadfile

test-models: $(ML_VENV)/.stamp
	$(HEARTBEAT) models $(ML_VENV)/bin/python -m specops.fixtures --out $(TEST_MODELS) --prompts prompts/coding.jsonl

test-fixtures: $(ML_VENV)/.stamp
	$(HEARTBEAT) fixtures $(ML_VENV)/bin/python -m specops.fixtures --out $(TEST_FIXTURES) --no-reference-training

# The suites, four at a time (make -j4), in this order: the four long ones first, then the checks,
# each started as soon as a suite ends, so whichever suites end first share the run's
# tail. With fixed lanes (2026-12-03: the systemd suite then ansible-lint, sanity, units and the unit
# tests in one lane) the lane that held the most checks ended the run alone: 2026-12-04, 1150 s, of
# which the last ~175 s with one lane left.
#  - integration: plays against development servers of their own, on free ports, in their own
#    directories, a test file per worker (each worker runs the shared evaluation once);
#  - module tests (tests/ansible), spread over both cores;
#  - fleet: two servers behind the router (a third joins for the options roll), the suite's longest fixture;
#  - systemd: mostly waiting (debootstrap, a container booting systemd);
#  - then the checks: ansible-test sanity, the unit tests (on both cores), ruff and mypy, ansible-lint and
#    ansible-test units. The unit tests come second so that they end with the long suites: last
#    (2026-12-05, 0158a00 and eb67879) they started ~90 s before the integration suite ended and ran ~80 s
#    alone after it (281 s for 245 core-s), while ansible-lint, which needs little CPU but long (150-210 s
#    for 47 core-s), ran beside them; third (e790d76) they still ended the run, 84 s after the
#    integration suite (346 s). Beside three suites they cost more CPU (2026-12-04: 207 core-s against
#    157 at the end of the run), less than the lone tail costs.
# More at once does not help on 2 cores: with the unit tests as a fifth lane from the start
# (2026-12-03) the run took 2550 s and 4,929 core-s instead of 2287 s and 4,087 (busier cores stretch
# every wait, and each stretched wait costs CPU), and six timing-sensitive tests failed.
# A suite that fails does not stop the others (--keep-going): the run says everything that failed.
# The environments and the fixture models are built in the same make, once, the two environments side
# by side; the checks wait for the fixture models (CHECKS_AFTER) so that the long suites get the slots
# first. Every line a suite prints carries its name and shows as soon as it is written; a suite quiet
# for 25 s says so. Each pytest run keeps its own temporary root, so no run's clean-up of old temporary
# directories removes another's.
LONG_SUITES := test-integration test-ansible test-fleet test-systemd
CHECKS := test-sanity test-unit test-python-checks test-lint test-units
CHECKS_AFTER ?=
test: system-deps
	mkdir -p $(TEST_REPORTS)
	$(MAKE) -j4 --keep-going --output-sync=none CHECKS_AFTER="test-models test-fixtures" $(LONG_SUITES) $(CHECKS)
	$(PYTHON_CONTROL) .ci/durations.py --top 5 $(TEST_REPORTS)/*.xml

# What needs neither playbooks nor systemd, one suite after another.
test-in-order: $(VENV)/.stamp $(ML_VENV)/.stamp
	$(MAKE) -j1 test-python test-ansible test-lint test-sanity test-units

# The package's checks: ruff and mypy, then its unit tests.
test-python:
	$(MAKE) -j1 test-python-checks test-unit

test-python-checks: $(ML_VENV)/.stamp | $(CHECKS_AFTER)
	$(ML_VENV)/bin/ruff check src tests benchmarks roles
	$(ML_VENV)/bin/ruff format --check src tests benchmarks roles
	$(HEARTBEAT) mypy $(ML_VENV)/bin/mypy

test-unit: $(ML_VENV)/.stamp test-models test-fixtures
	$(HEARTBEAT) unit $(ML_VENV)/bin/pytest $(PYTEST_FLAGS) $(XDIST) tests/unit

test-ansible: $(VENV)/.stamp $(ML_VENV)/.stamp test-fixtures
	$(HEARTBEAT) ansible $(VENV)/bin/pytest $(PYTEST_FLAGS) $(XDIST) tests/ansible

test-lint: $(VENV)/.stamp | $(CHECKS_AFTER)
	$(HEARTBEAT) lint $(VENV)/bin/ansible-lint --profile production

test-sanity: $(VENV)/.stamp | $(CHECKS_AFTER)
	$(HEARTBEAT) sanity ./tests/run-ansible-test.sh sanity

test-units: $(VENV)/.stamp | $(CHECKS_AFTER)
	$(HEARTBEAT) units ./tests/run-ansible-test.sh units

test-integration: $(VENV)/.stamp $(ML_VENV)/.stamp test-models
	mkdir -p /tmp/specops-pytest-integration
	PYTEST_DEBUG_TEMPROOT=/tmp/specops-pytest-integration \
	  $(HEARTBEAT) integration $(VENV)/bin/pytest $(PYTEST_FLAGS) $(XDIST) tests/integration --ignore=tests/integration/test_fleet.py

test-fleet: $(VENV)/.stamp $(ML_VENV)/.stamp test-models
	mkdir -p /tmp/specops-pytest-fleet
	PYTEST_DEBUG_TEMPROOT=/tmp/specops-pytest-fleet \
	  $(HEARTBEAT) fleet $(VENV)/bin/pytest $(PYTEST_FLAGS) tests/integration/test_fleet.py

test-systemd: system-deps $(VENV)/.stamp $(ML_VENV)/.stamp
	mkdir -p /tmp/specops-pytest-systemd
	PYTEST_DEBUG_TEMPROOT=/tmp/specops-pytest-systemd $(HEARTBEAT) systemd $(VENV)/bin/pytest $(PYTEST_FLAGS) tests/systemd

# The collection as users install it (dist/specops-drafter-<version>.tar.gz): modules, roles,
# playbooks and the specops wheel that the fla_env role installs by default. Built in an environment of
# its own that holds only what the build needs (requirements/build.lock: ansible-galaxy and the wheel's
# build backend, about 10 packages), installed by pip, hash-checked: not the test environment.
BUILD_VENV := .work/build-env
$(BUILD_VENV)/.stamp: requirements/build.lock
	@test -n "$(PYTHON_CONTROL)" || { echo "Python 3.12 is required for ansible-core 2.21 (set PYTHON_CONTROL)"; exit 1; }
	$(PYTHON_CONTROL) -m venv --clear $(BUILD_VENV)
	$(BUILD_VENV)/bin/pip install --quiet --require-hashes --no-deps -r requirements/build.lock
	touch $@

.PHONY: collection
collection: $(BUILD_VENV)/.stamp
	$(BUILD_VENV)/bin/python tools/build_collection.py --output-path dist

clean:
	rm -rf .work
