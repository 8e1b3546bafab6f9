# Set-up, run and test for ddp-amp. Every target installs what it needs first (once; a stamp keeps it fast).
#
# torch: on a machine without an NVIDIA GPU a CPU build is installed (a local CPU wheel if pip finds one, else
# the PyTorch CPU index), so no CUDA wheels are pulled. A GPU user picks a CUDA build with TORCH_INDEX, e.g.
#     make install TORCH_INDEX=https://download.pytorch.org/whl/cu128
PYTHON      ?= python3
VENV        ?= .venv
TORCH_VERSION ?= 2.13.0
HAS_GPU     := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
TORCH_INDEX ?= $(if $(HAS_GPU),,https://download.pytorch.org/whl/cpu)
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.installed
NPROC       ?= 2
PYTEST_ARGS ?=

.PHONY: install run test test-fast lint docs bench gpu-run gpu-deps clean help

help:
	@echo "make install    create $(VENV) and install ddp-amp with torch ($(if $(HAS_GPU),CUDA,CPU) build) and dev tools"
	@echo "make run        a real $(NPROC)-rank DDP + AMP training run (runs/<timestamp>)"
	@echo "make test       every tier: tests/unit, tests/system (real ranks), tests/cluster (root: namespaces, Slurm)"
	@echo "make test-fast  tests/unit: in-process, no rank process (about a minute)"
	@echo "make lint       ruff"
	@echo "make docs       regenerate docs/options.md from the command line (a unit test fails when it is stale)"
	@echo "make gpu-run    on a CUDA GPU: pytest -m gpu, then the GPU figures (MFU, fp8, ddp-amp against a hand-written loop)"
	@echo "make gpu-deps   here, before a GPU run on a machine that reaches no index: torchao for its torch, in .gpu-deps/"
	@echo "make bench      benchmarks/ (interleaved A/B, medians): CLI start-up, core vs hand-written DDP, launchers, progress cost, fp16 skip detection, checkpoint cost, resume memory, iterable data's end agreement, validation cost, --shard's memory and speed (and what ZeRO-1's broadcast costs on gloo) and how far the batch grows under it, how long a checkpoint blocks training (both formats), AMP and compile speedup, gradient compression, a user's script against torchrun, ddp_amp.loop's step against the core's, the gpt task against a hand-written nanoGPT-style loop, what a fused master-weight step would save bf16-true"

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# A local CPU wheel first (no download); then, without a GPU, the PyTorch CPU index; else the default index.
	@# An extra index: its 2.13.0+cpu (or +cuXXX) outranks the default index's plain 2.13.0, and torch's own
	@# dependencies still come from the default index.
	$(BIN)/python -c "import torch" 2>/dev/null \
	  || $(BIN)/pip install --no-index --no-deps "torch==$(TORCH_VERSION)" 2>/dev/null \
	  || $(BIN)/pip install "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(BIN)/pip install -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/ddp-amp spawn --nproc $(NPROC) --device auto --task mlp --steps 200 --amp auto

# Tests marked serial (the start-up-window and elastic tests, doctor's and a late node's across namespaces) run
# alone first; then the rest on TEST_WORKERS pytest workers, a file per worker at a time (module fixtures are
# shared within a file), the long files first (tests/conftest.py orders them; --no-loadscope-reorder keeps that
# order, which xdist would otherwise replace with one by test count: the Slurm file, 5 tests and 3 minutes, went
# 23rd of 36) and tests/unit's short ones last, to fill the end. More
# workers than cores: a launch's ranks wait (start-up, rendezvous, a stop's grace, Slurm) often enough that two
# workers leave the 2 cores 17% idle; three take 0.79 of two's time (docs/benchmarks.md, "The test suite").
# Both stages always run; exit 5 (PYTEST_ARGS selected none of a stage's tests) counts as a pass, and make
# fails if either stage failed.
TEST_WORKERS ?= 3

test: $(STAMP)
	@serial=0; $(BIN)/python -m pytest -m serial $(PYTEST_ARGS) || serial=$$?; \
	rest=0; $(BIN)/python -m pytest -m "not serial" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) \
	  || rest=$$?; \
	for code in $$serial $$rest; do [ $$code = 0 ] || [ $$code = 5 ] || exit $$code; done; \
	[ $$serial = 0 ] || [ $$rest = 0 ] || { echo "no test selected"; exit 5; }

# Two workers: the unit tests outgrew a minute in one process (760 tests); make test runs them on xdist too.
TEST_FAST_WORKERS ?= 2

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -n $(TEST_FAST_WORKERS) $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples docs

docs: $(STAMP)
	$(BIN)/python docs/generate_options.py

bench: $(STAMP)
	$(BIN)/python benchmarks/cli_startup.py
	$(BIN)/python benchmarks/core_overhead.py --repeats 3 --nproc 2 4
	$(BIN)/python benchmarks/core_overhead.py --task wide --batch-size 128 --repeats 3 --nproc 2 --steps 60
	$(BIN)/python benchmarks/launchers.py --repeats 3 --nproc $(NPROC)
	$(BIN)/python benchmarks/progress_overhead.py --repeats 5
	$(BIN)/python benchmarks/fp16_skip_sync.py --repeats 5 --steps 60
	$(BIN)/python benchmarks/checkpoint_cost.py --repeats 3
	$(BIN)/python benchmarks/checksums.py --repeats 5
	$(BIN)/python benchmarks/resume_memory.py --keep 3 --repeats 3
	$(BIN)/python benchmarks/gemm_limit.py --repeats 3 --profile
	$(BIN)/python benchmarks/bf16_true.py --repeats 3 --profile
	$(BIN)/python benchmarks/master_step.py --repeats 5
	$(BIN)/python benchmarks/master_step.py --repeats 5 --shapes transformer
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/gpt_side_by_side.py --device cpu --size tiny --no-compile --steps 60 \
		--repeats 3 --batch-size 8
	$(BIN)/python benchmarks/tracker_cost.py --repeats 5 --steps 3000
	$(BIN)/python benchmarks/micro_batch_auto.py --repeats 7
	$(BIN)/python benchmarks/allreduce_latency.py --rounds 3
	$(BIN)/python benchmarks/flight_recorder_cost.py --repeats 7
	$(BIN)/python benchmarks/iterable_end_cost.py --repeats 5
	$(BIN)/python benchmarks/evaluation_cost.py --repeats 5
	$(BIN)/python benchmarks/script_launch.py --repeats 5
	$(BIN)/python benchmarks/loop_step.py --repeats 3
	$(BIN)/python benchmarks/shard_cost.py --repeats 3
	$(BIN)/python benchmarks/zero_broadcast.py --repeats 12
	$(BIN)/python benchmarks/checkpoint_blocking.py --repeats 3
	$(BIN)/python benchmarks/max_batch_shard.py
	$(BIN)/python benchmarks/micro_batch_auto.py --repeats 3 --task wide --batch-size 128 --steps 60
	$(BIN)/ddp-amp bench --device cpu --amp off --max-batch --task tests/tasks/helper_tasks.py:activation_heavy \
		--max-memory 1 --batch-size 512
	$(BIN)/ddp-amp bench --device auto --repeats 3
	$(BIN)/ddp-amp bench --device auto --amp off --compile both --repeats 3
	@# Two hosts in network namespaces behind a tc-limited link: root only.
	if [ "$$(id -u)" = 0 ]; then $(BIN)/python benchmarks/grad_compression_netns.py --repeats 3; \
	else echo "skipped benchmarks/grad_compression_netns.py: needs root"; fi

# One GPU, within 570 s: the GPU tests not yet run on a GPU, the figures docs/benchmarks.md quotes, the other GPU
# tests (benchmarks/gpu_run.py; what the deadline leaves out is named, for a second call with --parts). It runs
# the checkout's source with the python that has CUDA torch (a GPU machine's own, or this venv's).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-run:
	PYTHONPATH=src $(GPU_PYTHON) benchmarks/gpu_run.py

# fp8 needs torchao built for the GPU machine's torch (0.17.0 for torch 2.11, from 2.11 on; the default is the
# lent machines' Python 3.12 and torch 2.11). Fetched here, unpacked into .gpu-deps/ (ignored, carried to the
# GPU machine), which gpu_run.py puts on the path: a wheel is a zip, and torchao's fp8 is Python over torch's
# own _scaled_mm, so no install step runs there.
GPU_TORCHAO ?= 0.17.0
GPU_PYTHON_VERSION ?= 3.12
gpu-deps:
	rm -rf .gpu-deps .gpu-deps.wheels
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
	  --dest .gpu-deps.wheels "torchao==$(GPU_TORCHAO)"
	$(PYTHON) -m zipfile -e .gpu-deps.wheels/torchao-*.whl .gpu-deps
	rm -rf .gpu-deps.wheels

clean:
	rm -rf $(VENV) runs build *.egg-info src/*.egg-info
