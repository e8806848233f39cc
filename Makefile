# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Everything is installed into a project-local virtual environment (.venv/), never into the
# Python that runs make: your global site-packages and editable installs stay as they are.
# PYTHON=/path/to/python uses an environment you made yourself instead (nothing is created).
SYSTEM_PYTHON ?= python3
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
# torch is installed first and pinned only if missing (an unpinned install may pull a CUDA build).
TORCH_VERSION ?= 2.13.0
NPROC ?= 1

export HF_HUB_OFFLINE ?= 1
export OMP_NUM_THREADS ?= 1
# A persistent compile cache keeps torch.compile tests fast after the first run. It lives outside the
# clone (inductor keys what it stores on the torch version and the graph), so a fresh clone on this
# machine reuses it; each test session compiles into a copy of it (tests/compile_cache.py).
export TORCHINDUCTOR_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/sft/inductor

.PHONY: install demo demo-lora demo-vlm test test-fast lint demo-data models-doc

$(VENV)/bin/python:
	$(SYSTEM_PYTHON) -m venv $(VENV)

.cache/installed: pyproject.toml $(PYTHON)
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==$(TORCH_VERSION)
	$(PYTHON) -m pip install -e '.[test]'
	mkdir -p .cache && touch $@

install: .cache/installed

demo-data:
	$(PYTHON) scripts/demo_data.py --out data/demo

# The demo's processes share the cores. nproc counts the cores this process may use, but obeys
# OMP_NUM_THREADS (exported above, and passed to $(shell) by make >= 4.4): ask it without.
DEMO_THREADS ?= $(shell n=$$(( $$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) / $(NPROC) )); echo $$(( n > 0 ? n : 1 )))

demo: install demo-data
	OMP_NUM_THREADS=$(DEMO_THREADS) $(PYTHON) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) --signals-to-handle SIGTERM,SIGINT,SIGUSR1 train.py --config configs/demo.yaml
	-$(PYTHON) -m sft.plot runs/demo
	$(PYTHON) -m sft.chat runs/demo/export --prompt "Spell the word 'rocket'."

# LoRA on the same data: adapters on a frozen base (random weights, written once), ~1.5 minutes.
runs/demo_lora_base/config.json: | install
	$(PYTHON) scripts/save_random_checkpoint.py configs/demo/model runs/demo_lora_base --dtype float32 --device cpu

demo-lora: install demo-data runs/demo_lora_base/config.json
	OMP_NUM_THREADS=$(DEMO_THREADS) $(PYTHON) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) --signals-to-handle SIGTERM,SIGINT,SIGUSR1 train.py --config configs/demo_lora.yaml
	$(PYTHON) -m sft.chat runs/demo_lora/export --prompt "Spell the word 'rocket'."

# Images: a tiny Qwen3.5 as published (random weights, written once) learns questions about pictures,
# ~1 minute; then answers one about a picture of the eval split, which it never saw.
runs/demo_vlm_base/config.json: | install
	$(PYTHON) scripts/save_random_checkpoint.py configs/demo_vlm/model runs/demo_vlm_base --dtype float32 --device cpu

demo-vlm: install runs/demo_vlm_base/config.json
	$(PYTHON) scripts/demo_data.py --images --out data/demo_vlm
	OMP_NUM_THREADS=$(DEMO_THREADS) $(PYTHON) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) --signals-to-handle SIGTERM,SIGINT,SIGUSR1 train.py --config configs/demo_vlm.yaml
	$(PYTHON) -m sft.chat runs/demo_vlm/export --image data/demo_vlm/images/eval0.png --prompt "What colour is the shape?"

# ruff, its rules in pyproject.toml (CI runs it before the tests).
lint: install
	$(PYTHON) -m ruff check .

# Test files run on TEST_WORKERS processes (pytest-xdist), each file's tests on one of them, in order.
TEST_WORKERS ?= 3
test: install
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# The unit tier (tests/unit: nothing launches torchrun or a Python), under half a minute: for the edit-test loop.
test-fast: install
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/unit

# docs/models.md: every causal-LM family of the installed transformers through the trainer's path (tests/zoo.py)
models-doc: install
	$(PYTHON) tests/zoo.py
