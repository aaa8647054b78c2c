# The two commands of the README, each doing all set-up on a fresh machine:
#   make example   the main job: trains a byte-level GPT of sequence-parallel blocks
#   make test      the test suite (the GPU tests skip without two GPUs)
# and, run by make test as well:
#   make cpp-test  the C++ unit tests (CTest; no GPU needed)
# PYTHON and VENV choose the interpreter and its virtualenv (CI's second leg:
# make test PYTHON=python3.13 VENV=.venv-newest). ARGS is passed on:
# make example ARGS="--steps 200".
#
# Set-up is the README's install command, editable: pip install -e
# ".[cuda13,test]" -C jcg.cuda=13, whose isolated build brings the NVIDIA wheels
# and compiles the cuBLASMp extension (build_backend/jcg_build.py). CUDA picks
# the CUDA major (13, 12) or none (a pure-Python package, nothing CUDA
# downloaded). make test builds the extension (CUDA 13 unless told), so compile
# errors are caught on any machine; make example builds it only where
# nvidia-smi sees a GPU, so on a CPU machine it downloads no CUDA wheels, and it
# reuses a test set-up already there.
PYTHON ?= python3
VENV ?= .venv
CUDA ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q GPU && echo yes)
TEST_CUDA := $(or $(CUDA),13)
EXAMPLE_CUDA := $(or $(CUDA),$(if $(GPU),13,none))
TEST_SETUP := $(VENV)/.installed-$(TEST_CUDA)-test
EXAMPLE_SETUP := $(if $(CUDA),$(VENV)/.installed-$(CUDA)-examples,\
  $(or $(wildcard $(VENV)/.installed-*-test),$(VENV)/.installed-$(EXAMPLE_CUDA)-examples))

# The package's folders too: the editable install maps each module file, so a
# file added or removed needs a reinstall.
SOURCES := pyproject.toml CMakeLists.txt build_backend/jcg_build.py $(wildcard xla_ffi/*) \
  $(shell find jax_comm_gemm -type d -not -name __pycache__)

.PHONY: setup example test cpp-test clean

setup: $(TEST_SETUP)

# $* is <cuda>-<extra>: 13-test, none-examples, ...
$(VENV)/.installed-%: $(SOURCES)
	@cuda=$(word 1,$(subst -, ,$*)); extra=$(word 2,$(subst -, ,$*)); \
	if [ $$cuda = none ]; then extras=$$extra; what="a pure-Python package (the XLA path; no CUDA wheels)"; \
	else extras=cuda$$cuda,$$extra; what="the cuBLASMp extension, compiled against the CUDA $$cuda wheels' headers"; fi; \
	set -e; \
	if [ ! -x $(PY) ]; then echo "==> set-up: a virtualenv in $(VENV) ($(PYTHON))"; $(PYTHON) -m venv $(VENV); fi; \
	$(PIP) install --quiet --upgrade pip; \
	echo "==> set-up: pip install -e \".[$$extras]\" -C jcg.cuda=$$cuda: jax, flax and the $$extra extra, then $$what"; \
	if [ $$cuda != none ]; then echo "    (the first time about 5 minutes on 2 CPU cores: about 1 GB of NVIDIA wheels to fetch, then the C++ build)"; \
	else echo "    (the first time about 2 minutes: jax, flax, optax, orbax-checkpoint and matplotlib to fetch)"; fi; \
	$(PIP) install --quiet -e ".[$$extras]" -C jcg.cuda=$$cuda; \
	rm -f $(VENV)/.installed-*; touch $@; echo "==> set-up done ($(VENV))"

example: $(EXAMPLE_SETUP)
	$(PY) examples/train_byte_gpt.py $(ARGS)

# Two pytest workers (pytest-xdist): most tests compile on one core, so a
# 2-core machine runs the suite in about half the time. The GPU tests stay on
# one worker (the root conftest.py groups them). Where the extension was built,
# its tests must not skip (JCG_REQUIRE_EXTENSION=1).
test: $(TEST_SETUP) $(if $(filter none,$(TEST_CUDA)),,cpp-test)
	@$(PY) -c "import sys; from importlib.metadata import version as v; print('Python', sys.version.split()[0], '| jax', v('jax'), '| jaxlib', v('jaxlib'), '| flax', v('flax'))"
	JCG_REQUIRE_EXTENSION=$(if $(filter none,$(TEST_CUDA)),0,1) $(PY) -m pytest -q -n 2 --dist loadgroup $(ARGS)

# The C++ tests compile against the headers of the NVIDIA wheels the set-up
# installed (the cuda extra), with CMake and ninja from PyPI.
CPP_TEST_DIR := build/cpp-tests-$(notdir $(VENV))
cpp-test: $(TEST_SETUP)
	@test -x $(VENV)/bin/cmake -a -x $(VENV)/bin/ninja || \
	  { echo "==> cpp-test: CMake and ninja into $(VENV)"; $(PIP) install --quiet cmake ninja; }
	$(VENV)/bin/cmake -S tests/cpp -B $(CPP_TEST_DIR) -G Ninja \
	  -DPython_EXECUTABLE=$(abspath $(PY)) -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV))/bin/ninja
	$(VENV)/bin/cmake --build $(CPP_TEST_DIR)
	$(VENV)/bin/ctest --test-dir $(CPP_TEST_DIR) --output-on-failure

clean:
	rm -rf $(VENV) build dist
