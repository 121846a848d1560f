# forkguard's entry points. `make demo` and `make test` work on a fresh Debian 12 machine: both
# install what they need (scripts/install-deps) before building.
PRESET ?= release
JOBS ?= $(shell nproc)
BUILD := build/$(PRESET)
FAKE := $(BUILD)/lib/fake_cuda

.PHONY: all deps build test demo asan tsan fuzz format format-check clean

all: build

deps:
	scripts/install-deps

build: deps
	cmake --preset $(PRESET)
	cmake --build --preset $(PRESET) -j $(JOBS)

test: build
	ctest --preset $(PRESET) -j $(JOBS)

# The main job on an embedded default: the test driver stands in for a GPU. The probe on a
# process going from clean to poisoned, then ranks launched after the parent touched CUDA: the
# fork server and spawn succeed, plain fork is refused with the evidence. Then two training
# ranks under `forkguard run`, each with a process-worker image loader feeding its GPU (the host
# where there is none), on DATA (an ImageFolder) or on images cut from Debian's photographs.
# Then the same in Python, in real Jupyter kernels on the torch 2.14 venv (deps installs it):
# after a first cell `torch.cuda.is_available()` and a parallel CPU op, accelerate's
# notebook_launcher and torch's DataLoader against forkguard's, each cell bounded, one table.
demo: build
	@dev=$$(mktemp -d) && trap 'rm -rf "$$dev"' EXIT && \
	  FORKGUARD_CUDA_DRIVER=$(CURDIR)/$(FAKE)/libcuda.so.1 \
	  FORKGUARD_NVML_LIBRARY=$(CURDIR)/$(FAKE)/libnvidia-ml.so.1 \
	  FAKE_CUDA_DEV_DIR=$$dev $(BUILD)/bin/doctor_stages && \
	  for m in forkserver spawn fork; do \
	    echo; echo "=== notebook_style --parent-touches-cuda --nproc 4 --start-method $$m ==="; \
	    FORKGUARD_CUDA_DRIVER=$(CURDIR)/$(FAKE)/libcuda.so.1 FAKE_CUDA_DEV_DIR=$$dev \
	      $(BUILD)/bin/notebook_style --parent-touches-cuda --nproc 4 --start-method $$m; \
	    rc=$$?; echo "--- exit code $$rc"; \
	    if [ $$m = fork ]; then [ $$rc -eq 3 ] || exit 1; else [ $$rc -eq 0 ] || exit 1; fi; \
	  done
	@data="$(DATA)"; if [ -z "$$data" ]; then data=build/demo/images; scripts/demo-data $$data; fi; \
	  echo; echo "=== forkguard run --nproc-per-node 2 -- loader_ranks --data $$data ==="; \
	  $(BUILD)/bin/forkguard run --nproc-per-node 2 -- $(BUILD)/bin/loader_ranks --data "$$data" --epochs 2
	@echo; echo "=== examples/notebook_peers.py: accelerate's and torch's against forkguard's, in Jupyter kernels ==="
	PYTHONPATH=$(CURDIR)/$(BUILD)/python build/torch-2.14/bin/python examples/notebook_peers.py

asan tsan: deps
	cmake --preset $@
	cmake --build --preset $@ -j $(JOBS)
	ctest --preset $@ -j $(JOBS)

# Every parser under libFuzzer (clang, ASan + UBSan) for FUZZ_SECONDS each, on its seed corpus
# (tests/fuzz/corpus); a finding fails it and is left in build/fuzz/findings (docs/reliability.md).
FUZZ_SECONDS ?= 60
fuzz: deps
	cmake --preset fuzz
	cmake --build --preset fuzz -j $(JOBS)
	scripts/fuzz $(FUZZ_SECONDS)

SOURCES = $(shell git ls-files '*.cpp' '*.hpp' '*.h' '*.cc')
format:
	clang-format -i $(SOURCES)
format-check:
	clang-format --dry-run -Werror $(SOURCES)

clean:
	rm -rf build
