# Two commands set everything up: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; a GPU machine can install its own CUDA build first, pyproject only asks for a range.
TORCH ?= torch==2.13.0

.PHONY: install install-dev demo test chaos lint docs clean bench-peer bench-peer-lora gpu-check gpu-wheels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

demo: install
	$(BIN)/sdtrain demo --out runs/demo --minutes 10

# lint-imports: the layers of pyproject.toml's [tool.importlinter] hold (no import cycle, local imports included).
test: install-dev
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q

# Fault injection through the CLI (kill -9, damaged checkpoints, a full disk, NaN steps, a second run):
# a table of faults, trials and data lost. `make chaos TRIALS=20` for a long run.
TRIALS ?= 3
chaos: install-dev
	$(BIN)/python -m tests.chaos --trials $(TRIALS)

# sdtrain beside diffusers' examples/text_to_image/train_text_to_image.py from a diffusers checkout:
#   make bench-peer DIFFUSERS=path/to/diffusers [BENCH_PEER_ARGS="--size sd2 --steps 10 --ema both"]
BENCH_PEER_ARGS ?= --size tiny --steps 40 --ema both --precision fp32,bf16
bench-peer: install
	@test -n "$(DIFFUSERS)" || { echo "usage: make bench-peer DIFFUSERS=path/to/diffusers-checkout" >&2; exit 2; }
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/peer.py --diffusers $(DIFFUSERS) $(BENCH_PEER_ARGS) --work runs/bench-peer \
		--out runs/bench-peer/results.json

# sdtrain beside diffusers' DreamBooth LoRA scripts (examples/dreambooth/train_dreambooth_lora_{flux,sdxl}.py):
#   make bench-peer-lora DIFFUSERS=path/to/diffusers [BENCH_PEER_LORA_ARGS="--family flux --size partial --steps 8"]
BENCH_PEER_LORA_ARGS ?= --family flux,sdxl --size tiny --steps 20
bench-peer-lora: install
	@test -n "$(DIFFUSERS)" || { echo "usage: make bench-peer-lora DIFFUSERS=path/to/diffusers-checkout" >&2; exit 2; }
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/peer_lora.py --diffusers $(DIFFUSERS) $(BENCH_PEER_LORA_ARGS) --work runs/bench-peer-lora \
		--out runs/bench-peer-lora/results.json

# The CUDA paths checked and the seed's figures measured in one run (benchmarks/gpu_check.py): on a GPU machine,
# whose python3 holds a CUDA PyTorch, with the packages it lacks installed offline from .gpu-wheels/; elsewhere a
# dry run at tiny sizes on the CPU, in the project's venv. Writes runs/gpu-check/results.json.
gpu-check:
	@if python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		python3 benchmarks/gpu_check.py; \
	else \
		$(MAKE) --no-print-directory install-dev && $(BIN)/python benchmarks/gpu_check.py; \
	fi

# The wheels of what a bare CUDA image lacks (diffusers, webdataset, omegaconf...), at this venv's versions, into
# .gpu-wheels/ (ignored by git; carry it to the GPU machine with the tree).
gpu-wheels: install
	$(BIN)/python benchmarks/gpu_check.py wheels

lint: install-dev
	$(BIN)/ruff check src tests
	$(BIN)/lint-imports

# docs/configuration.md from the config's field docstrings (src/sdtrain/config.py); tests/test_docs.py fails
# when the committed page is stale.
docs: install
	$(BIN)/sdtrain docs config --out docs/configuration.md

clean:
	rm -rf runs .pytest_cache
