# Newcomer entry points (see README):  make demo   |   make test
# Every target installs what it needs: Debian packages, a virtual environment in .venv, and
# moegrad itself (rebuilt only when a source file changed).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
JOBS ?= $(shell nproc)
SOURCES := $(shell find src include python cmake -type f -not -name '*.pyc') CMakeLists.txt pyproject.toml
CPP_TEST_SOURCES := $(shell find tests/cpp tests/consumer examples -type f 2>/dev/null)
# The CI build (CI=true, set by .ci/run) turns compiler warnings into errors; local builds only
# show them (docs/decisions.md L63).
WERROR := $(if $(filter true 1 yes,$(CI)),ON,OFF)

.PHONY: demo test test-python test-cpp bench setup clean

demo: $(VENV)/.installed
	$(PY) -m moegrad.demo $(ARGS)

test: test-python test-cpp

test-python: $(VENV)/.installed
	$(PY) -m pytest tests/python -q $(PYTEST_ARGS)

test-cpp: build/cpp/.built
	ctest --test-dir build/cpp --output-on-failure -j $(JOBS)

bench: $(VENV)/.installed
	$(PY) -m moegrad.bench $(ARGS)

setup: $(VENV)/.installed

build/.system-deps: scripts/install-system-deps.sh
	bash scripts/install-system-deps.sh
	@mkdir -p build && touch $@

$(VENV)/.deps: requirements-dev.txt build/.system-deps
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

$(VENV)/.installed: $(VENV)/.deps $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps -C cmake.define.MOEGRAD_WERROR=$(WERROR) .
	touch $@

build/cpp/.built: $(VENV)/.deps $(SOURCES) $(CPP_TEST_SOURCES)
	cmake -S . -B build/cpp -G Ninja -DMOEGRAD_BUILD_TESTS=ON -DMOEGRAD_WERROR=$(WERROR) >/dev/null
	cmake --build build/cpp -j $(JOBS)
	touch $@

clean:
	rm -rf build
