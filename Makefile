# The README's two commands: `make test` and `make demo`. Both set up first: a virtual environment in .venv
# (unless one is active), a CPU torch when none is installed (a user's own CUDA torch is kept), and the package
# in editable mode with its extension built.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,triton,dali,deepspeed
PYTEST_ARGS ?= -n 2

ifdef VIRTUAL_ENV
PY := python
STAMP := .installed
else
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
endif

SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*.cu csrc/cuda/*.h)

.PHONY: setup test demo bench lint format clean cpp-test cuda-compile mutation

setup: $(STAMP)

$(STAMP): $(SOURCES)
	@if [ -z "$$VIRTUAL_ENV" ] && [ ! -x $(VENV)/bin/python ]; then $(PYTHON) -m venv $(VENV); fi
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install setuptools wheel ninja
	$(PY) -m pip install --no-build-isolation -e ".[$(EXTRAS)]"
	@touch $@

test: setup
	$(PY) -m pytest $(PYTEST_ARGS) tests

# The embedded default run (small DiT, MinSNR-5, built-in digits, CPU) in a new run directory.
demo: setup
	$(PY) -m diffcurr_fast.cli train --run-dir runs/demo-$$(date +%Y%m%d-%H%M%S)

bench: setup
	$(PY) benchmarks/bench_ops.py

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# The C++ library against libtorch and its ctest (also run by the test suite: tests/csrc/test_cmake.py).
cpp-test: setup
	cmake -S . -B csrc/build -DCMAKE_PREFIX_PATH=$$($(PY) -c 'import torch; print(torch.utils.cmake_prefix_path)')
	cmake --build csrc/build -j 2
	ctest --test-dir csrc/build --output-on-failure

# Compile-only check of the CUDA sources with nvcc (also run by the test suite: tests/csrc/test_cuda_compile.py).
cuda-compile: setup
	$(PY) -m pytest -q tests/csrc/test_cuda_compile.py

# Mutation testing of the integration modules with mutmut (docs/mutation.md); not part of `make test`. Config in
# pyproject.toml [tool.mutmut]; MUTANTS narrows the run to fnmatch patterns of mutant names, e.g.
# MUTANTS='diffcurr_fast.train.ema.*'. Results stay in mutants/ (a rerun checks only what changed).
MUTANTS ?=
MUTATION_JOBS ?= 2

mutation: setup
	@$(PY) -c "import mutmut" 2>/dev/null || $(PY) -m pip install "mutmut>=3.3"  # the `mutation` extra
	# PYTHONPATH: a test's subprocesses (the CLI, torchrun) import this checkout's unmutated code, not whatever
	# checkout the package was installed from (the mutated copy would need mutmut's state, which they do not have)
	PYTHONPATH=$(CURDIR) nice -n 10 $(PY) -m mutmut run --max-children $(MUTATION_JOBS) $(MUTANTS)
	$(PY) tools/mutation_report.py

clean:
	rm -rf build *.egg-info diffcurr_fast/_C*.so csrc/build .installed $(VENV)/.installed mutants
