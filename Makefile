# The two commands of the README, each doing all set-up on a fresh machine:
#   make example   the main job: trains a byte-level GPT of sequence-parallel blocks
#   make test      the test suite (the GPU tests skip without two GPUs)
# PYTHON and VENV choose the interpreter and its virtualenv (CI's second leg:
# make test PYTHON=python3.13 VENV=.venv-newest).
# and, run by make test as well:
#   make cpp-test  the C++ unit tests (CTest; no GPU needed)
# Set-up: a virtualenv in .venv with jax, flax and the NVIDIA wheels (CUDA 13 by
# default, CUDA=12 for the twin), then the package itself, built in place with
# its cuBLASMp extension. ARGS is passed on: make example ARGS="--steps 200".
PYTHON ?= python3
VENV ?= .venv
CUDA ?= 13
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

.PHONY: setup example test cpp-test clean

setup: $(VENV)/.installed

# The package's folders too: the editable install maps each module file, so a
# file added or removed needs a reinstall.
$(VENV)/.installed: pyproject.toml CMakeLists.txt $(wildcard xla_ffi/*) \
    $(shell find jax_comm_gemm -type d -not -name __pycache__)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet scikit-build-core nanobind cmake ninja "jax>=0.10.2"
	@# The NVIDIA wheels must be installed before the extension can build
	@# against them: the first pass installs the dependencies (its build finds
	@# no headers yet and skips the extension), the second builds it.
	$(PIP) install --quiet --no-build-isolation -e ".[cuda$(CUDA),test]"
	$(PIP) install --quiet --no-build-isolation --no-deps --force-reinstall -e .
	touch $@

example: setup
	$(PY) examples/train_byte_gpt.py $(ARGS)

# Two pytest workers (pytest-xdist): most tests compile on one core, so a
# 2-core machine runs the suite in about half the time. The GPU tests stay on
# one worker (the root conftest.py groups them).
test: setup cpp-test
	@$(PY) -c "import sys; from importlib.metadata import version as v; print('Python', sys.version.split()[0], '| jax', v('jax'), '| jaxlib', v('jaxlib'), '| flax', v('flax'))"
	JCG_REQUIRE_EXTENSION=1 $(PY) -m pytest -q -n 2 --dist loadgroup $(ARGS)

CPP_TEST_DIR := build/cpp-tests-$(notdir $(VENV))
cpp-test: setup
	$(VENV)/bin/cmake -S tests/cpp -B $(CPP_TEST_DIR) -G Ninja \
	  -DPython_EXECUTABLE=$(abspath $(PY)) -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV))/bin/ninja
	$(VENV)/bin/cmake --build $(CPP_TEST_DIR)
	$(VENV)/bin/ctest --test-dir $(CPP_TEST_DIR) --output-on-failure

clean:
	rm -rf $(VENV) build
