# memsched -- `make demo` and `make test` work on a fresh machine: they install
# what is missing, build, then run.
PYTHON      ?= python3
TORCH_PIN   ?= 2.14.1
BUILD_DIR   ?= build
APT_PKGS    := libgtest-dev libbenchmark-dev nlohmann-json3-dev
PY_PKGS     := pytest pytest-benchmark matplotlib
# Test-only: the frameworks memsched.integrations plugs into (their tests skip without them). About 25 s
# for the 42 packages on a machine that has torch (measured without a pip cache); installed by `make test`.
# pymetis: the METIS baseline of memsched.partition (its rows say "not installed" without it).
TEST_PKGS   := transformers accelerate lightning pymetis
export MEMSCHED_BUILD_DIR := $(abspath $(BUILD_DIR))
# torch's cpp_extension guesses CUDA_HOME from nvcc's location; point it at the toolkit.
ifneq ($(wildcard /usr/local/cuda),)
export CUDA_HOME ?= /usr/local/cuda
endif

.PHONY: all deps test-deps build test test-cpp test-python demo bench clean gpu-check gpu-check-deps

all: build

# Install only what is missing. An installed torch >= 2.11 is kept (the GPU
# machine ships 2.11); otherwise the pinned CUDA build, which lets a CPU-only
# machine compile and link every CUDA path.
deps:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian packages:$$missing"; \
	    SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	  else echo "note: cannot install$$missing (no apt-get); C++ tests need them"; fi; \
	fi
	@$(PYTHON) -c "import torch, sys; v=tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if v >= (2, 11) else 1)" 2>/dev/null \
	  || $(PYTHON) -m pip install -q "torch==$(TORCH_PIN)"
	@for p in $(PY_PKGS); do m=$$(echo $$p | tr - _); [ $$p = pytest-benchmark ] && m=pytest_benchmark; \
	  $(PYTHON) -c "import $$m" 2>/dev/null || $(PYTHON) -m pip install -q $$p; done

# Only what is missing; the installed torch is kept (each of them accepts it).
test-deps:
	@for p in $(TEST_PKGS); do $(PYTHON) -c "import $$p" 2>/dev/null || $(PYTHON) -m pip install -q $$p; done

build: deps
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .

test-cpp: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j2

test-python: build test-deps
	$(PYTHON) -m pytest -q tests/python

test: build test-deps
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j2
	$(PYTHON) -m pytest -q tests/python

demo: build
	$(PYTHON) -m memsched demo --out-dir demo_out

bench: build
	@mkdir -p bench_out
	$(PYTHON) -m pytest -q benchmarks/python --benchmark-json=bench_out/python.json
	cmake -S . -B $(BUILD_DIR) -DMEMSCHED_BUILD_BENCHMARKS=ON >/dev/null && cmake --build $(BUILD_DIR) --parallel
	@for b in $(BUILD_DIR)/benchmarks/cpp/bench_*; do [ -x $$b ] && $$b --benchmark_out=bench_out/$$(basename $$b).json --benchmark_out_format=json; done; true

# --- GPU machine ---------------------------------------------------------------
# `make gpu-check` on a bare GPU machine (torch there, no registry): builds memsched, runs the CUDA
# tests and every GPU benchmark under per-part timeouts (under 9 minutes in all), and writes
# $(GPU_CHECK_OUT)/gpu_check.md and gpu_check.json. It needs no other target: on that machine
# `deps` would reach for apt and pip. GPU_CHECK_ARGS=--cpu-smoke runs the same parts here, reduced.
# `make gpu-check-deps` (here, with a network) fills the two git-ignored folders to carry there.
GPU_CHECK_OUT  ?= gpu_check_out
GPU_CHECK_ARGS ?=
TRL_VERSION    ?= 1.16.0

gpu-check:
	PYTHONUNBUFFERED=1 $(PYTHON) -u benchmarks/gpu/gpu_check.py --out "$(GPU_CHECK_OUT)" $(GPU_CHECK_ARGS)

# third_party/include/nlohmann: Debian's nlohmann_json headers (json.hpp includes its detail/ tree), found
# by CMakeLists.txt's find_path fallback. .whl/trl-*.whl: TRL, read as a file by bench_offload.py (its
# trl/models/activation_offloading.py needs only psutil, accelerate and transformers, all on the GPU image).
gpu-check-deps:
	@[ -f /usr/include/nlohmann/json.hpp ] || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq nlohmann-json3-dev; }
	rm -rf third_party/include/nlohmann
	mkdir -p third_party/include
	cp -r /usr/include/nlohmann third_party/include/nlohmann
	mkdir -p .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl "trl==$(TRL_VERSION)"
	@du -sh third_party .whl
	@echo "carry: [\"third_party\", \".whl\"]"

clean:
	rm -rf $(BUILD_DIR) python/memsched/_C*.so python/memsched/libmemsched_alloc*.so *.egg-info python/*.egg-info
