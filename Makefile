# Two entry points: `make demo` runs the evaluation on the local default, `make test` runs every suite.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# ansible-core 2.21 needs Python >= 3.12 on the control node; the ML environment uses Python 3.11,
# for which a CPU torch wheel is available offline on this kind of machine.
# The first candidate that really runs (a pyenv shim for an inactive version does not).
find_python = $(shell for p in $$HOME/.pyenv/versions/$(1)*/bin/python$(1) $$(command -v python$(1)); do \
                "$$p" -c 'import sys' 2>/dev/null && { echo "$$p"; break; }; done)
PYTHON_CONTROL ?= $(call find_python,3.12)
PYTHON_ML ?= $(call find_python,3.11)
VENV := .venv
ML_VENV := .venv-ml
ANSIBLE_PLAYBOOK := $(VENV)/bin/ansible-playbook
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PYTHONDONTWRITEBYTECODE := 1
# Tests exercise the working tree, not the copy of the package installed in the ML environment.
test test-%: export PYTHONPATH := $(CURDIR)/src

.PHONY: help demo demo-stop test test-in-order test-python test-ansible test-lint test-sanity test-units \
        test-integration test-systemd system-deps ml-env venv clean

help:
	@echo "make demo   - set up, then run playbooks/eval.yml on the local default and print the report path"
	@echo "make test   - run every test suite (lint, sanity, units, package, playbooks, systemd)"

$(VENV)/.stamp: requirements/control.txt
	@test -n "$(PYTHON_CONTROL)" || { echo "Python 3.12 is required for ansible-core 2.21 (set PYTHON_CONTROL)"; exit 1; }
	$(PYTHON_CONTROL) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements/control.txt
	touch $@

venv: $(VENV)/.stamp

# The ML environment is built by the fla_env role, the same code that builds it on GPU hosts.
$(ML_VENV)/.stamp: $(VENV)/.stamp pyproject.toml requirements/ml-dev.txt
	$(ANSIBLE_PLAYBOOK) playbooks/ml_env.yml -e fla_env_python=$(PYTHON_ML)
	$(ML_VENV)/bin/pip install -q -r requirements/ml-dev.txt
	touch $@

ml-env: $(ML_VENV)/.stamp

demo: $(VENV)/.stamp
	$(ANSIBLE_PLAYBOOK) playbooks/eval.yml -e fla_env_python=$(PYTHON_ML)
	@echo "Report: $(CURDIR)/.work/demo/run/score/report.md"

demo-stop: $(VENV)/.stamp
	$(ANSIBLE_PLAYBOOK) playbooks/service.yml -e sglang_service_state=stopped -e sglang_service_guard=false

system-deps:
	@command -v debootstrap >/dev/null && command -v systemd-nspawn >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap systemd-container; }

# Three lanes side by side: the integration suite (plays against development servers of its own, on
# free ports, in its own directories), the systemd suite (mostly waiting: debootstrap, a container
# booting systemd), and the other suites one after another. Each pytest run of a lane keeps its own
# temporary root, so no run's clean-up of old temporary directories removes another's.
test: system-deps $(VENV)/.stamp $(ML_VENV)/.stamp
	$(MAKE) -j3 --output-sync=target test-in-order test-integration test-systemd

test-in-order: $(VENV)/.stamp $(ML_VENV)/.stamp
	$(MAKE) -j1 test-python test-ansible test-lint test-sanity test-units

test-python: $(ML_VENV)/.stamp
	$(ML_VENV)/bin/ruff check src tests benchmarks roles
	$(ML_VENV)/bin/ruff format --check src tests benchmarks roles
	$(ML_VENV)/bin/mypy
	$(ML_VENV)/bin/pytest -q tests/unit

test-ansible: $(VENV)/.stamp $(ML_VENV)/.stamp
	$(VENV)/bin/pytest -q tests/ansible

test-lint: $(VENV)/.stamp
	$(VENV)/bin/ansible-lint --profile production

test-sanity: $(VENV)/.stamp
	./tests/run-ansible-test.sh sanity

test-units: $(VENV)/.stamp
	./tests/run-ansible-test.sh units

# --durations: the slowest tests are named in every run, so a new slow one is seen.
test-integration: $(VENV)/.stamp $(ML_VENV)/.stamp
	mkdir -p /tmp/specops-pytest-integration
	PYTEST_DEBUG_TEMPROOT=/tmp/specops-pytest-integration $(VENV)/bin/pytest -q --durations=10 tests/integration

test-systemd: system-deps $(VENV)/.stamp $(ML_VENV)/.stamp
	mkdir -p /tmp/specops-pytest-systemd
	PYTEST_DEBUG_TEMPROOT=/tmp/specops-pytest-systemd $(VENV)/bin/pytest -q tests/systemd

# The collection as users install it (dist/specops-drafter-<version>.tar.gz): modules, roles,
# playbooks and the specops wheel that the fla_env role installs by default.
.PHONY: collection
collection: $(VENV)/.stamp
	$(VENV)/bin/python tools/build_collection.py --output-path dist

clean:
	rm -rf .work
