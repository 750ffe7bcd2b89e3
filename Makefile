# Newcomer entry points (see README):  make demo   |   make test   |   make demo-ep
# Every target installs what it needs: Debian packages, a virtual environment in .venv, and
# moegrad itself (rebuilt only when a source file changed).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
JOBS ?= $(shell nproc)
# pytest-xdist workers for the Python suites (0: one process).
PYTEST_JOBS ?= $(JOBS)
SOURCES := $(shell find src include python cmake -type f -not -name '*.pyc') CMakeLists.txt pyproject.toml
CPP_TEST_SOURCES := $(shell find tests/cpp tests/consumer examples -type f 2>/dev/null)
# The CI build (CI=true, set by .ci/run) turns compiler warnings into errors; local builds only
# show them (docs/decisions.md L63).
WERROR := $(if $(filter true 1 yes,$(CI)),ON,OFF)
# CUDA architectures of the package and C++ test builds (empty: CMakeLists.txt's list; .ci/run
# leaves out the PTX, L212).
CUDA_ARCHS ?=

.PHONY: demo demo-ep test test-python test-cpp cpp-build bench setup clean fuzz fuzz-build test-asan

demo: $(VENV)/.installed
	$(PY) -m moegrad.demo $(ARGS)

# The demo model trained expert-parallel by EP processes (gloo on the CPU): torchrun, run through
# the environment's python so that no activated .venv is needed (docs/demo.md).
EP ?= 2
demo-ep: $(VENV)/.installed
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $(EP) -m moegrad.demo --ep $(EP) $(ARGS)

test: test-python test-cpp

test-python: $(VENV)/.installed
	$(PY) -m pytest tests/python -q -n $(PYTEST_JOBS) $(PYTEST_ARGS)

test-cpp: build/cpp/.built
	ctest --test-dir build/cpp --output-on-failure -j $(JOBS)

cpp-build: build/cpp/.built

bench: $(VENV)/.installed
	$(PY) -m moegrad.bench $(ARGS)

setup: $(VENV)/.installed

build/.system-deps: scripts/install-system-deps.sh
	bash scripts/install-system-deps.sh
	@mkdir -p build && touch $@

$(VENV)/.deps: requirements-dev.txt build/.system-deps
	@echo "==> Creating .venv and installing PyTorch (CPU build) and the test tools:" \
	  "about 1-2 minutes, most of it downloading."
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install --progress-bar on -r requirements-dev.txt
	touch $@

# pip -v shows CMake's output, so the compile prints its [done/total] progress lines.
$(VENV)/.installed: $(VENV)/.deps $(SOURCES)
	@echo "==> Compiling moegrad (C++17 kernels for every SIMD target, the Python module; CUDA" \
	  "kernels when nvcc is found) and installing it into .venv: about 3-4 minutes on 2 cores" \
	  "for a first build (longer with CUDA), seconds when little changed. Progress: [n/N] below."
	$(PY) -m pip install -v --no-build-isolation --no-deps -C cmake.define.MOEGRAD_WERROR=$(WERROR) \
	  $(if $(CUDA_ARCHS),-C cmake.define.MOEGRAD_CUDA_ARCHS="$(CUDA_ARCHS)") .
	touch $@

build/cpp/.built: $(VENV)/.deps $(SOURCES) $(CPP_TEST_SOURCES)
	@echo "==> Building the C++ library, its tests and the C example in build/cpp: about 4-6" \
	  "minutes on 2 cores the first time. Progress: [n/N] below."
	cmake -S . -B build/cpp -G Ninja -DMOEGRAD_BUILD_TESTS=ON -DMOEGRAD_WERROR=$(WERROR) \
	  $(if $(CUDA_ARCHS),-DMOEGRAD_CUDA_ARCHS="$(CUDA_ARCHS)") >/dev/null
	cmake --build build/cpp -j $(JOBS)
	touch $@

# ---- fuzzing and sanitizers (docs/testing.md) ----
FUZZ_SECONDS ?= 10
FUZZ_RUNS ?= -1
FUZZ_SOURCES := $(shell find tests/fuzz -type f -not -path '*/corpus/*' 2>/dev/null)
FUZZERS := fuzz_gating_top_k fuzz_gating_top_k_backward fuzz_finalize_routing \
	fuzz_finalize_routing_grad fuzz_swiglu_group_quant_grad fuzz_swiglu_group fuzz_swiglu_group_quant \
	fuzz_finalize_routing_bias_grad fuzz_init_routing_v2 fuzz_init_routing_v3 fuzz_init_routing_grad \
	fuzz_clipped_swiglu fuzz_handles

# libFuzzer harnesses under ASan + UBSan (clang); FUZZ_SECONDS per harness, non-zero exit on
# any finding. FUZZ_RUNS=N stops each harness after N inputs instead.
fuzz: build/fuzz/.built
	FUZZ_JOBS=$(JOBS) bash tests/fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_RUNS)

fuzz-build: build/fuzz/.built

# Without CUDA and with one Highway target (docs/testing.md, L211): the harnesses call the CPU
# backend, and every SIMD target is tested by the plain C++ suite.
build/fuzz/.built: $(VENV)/.deps $(SOURCES) $(FUZZ_SOURCES)
	CC=clang-16 CXX=clang++-16 cmake -S . -B build/fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DMOEGRAD_BUILD_FUZZERS=ON -DMOEGRAD_SANITIZE=address,undefined -DMOEGRAD_WITH_CUDA=OFF \
	  -DMOEGRAD_HWY_ONE_TARGET=ON >/dev/null
	cmake --build build/fuzz -j $(JOBS) --target $(FUZZERS)
	touch $@

# The whole C++ suite and the Python suite against an ASan + UBSan build (scripts/test-asan.sh).
# ASAN_STEPS picks steps of it: build, cpp, python (default: all three).
test-asan: $(VENV)/.deps
	JOBS=$(JOBS) PYTEST_JOBS=$(PYTEST_JOBS) bash scripts/test-asan.sh $(PYTEST_ARGS)

clean:
	rm -rf build
