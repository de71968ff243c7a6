# `make train` and `make test` do everything on a fresh machine: create .venv, install the pinned
# dependencies (torch==2.13.0 first and on its own, so no resolver ever pulls another torch build),
# install dynemb editable, then run. `make install` is idempotent: a stamp file records that .venv
# matches requirements.txt and pyproject.toml.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dynemb-installed
TORCH := torch==2.13.0
BENCH_STAMP := $(VENV)/.dynemb-bench-deps

.PHONY: install train test bench bench-smoke bench-deps clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -c "import torch, dynemb; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

train: install
	$(BIN)/python examples/quickstart.py

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python benchmarks/table_ops.py
	$(BIN)/python benchmarks/train_step.py

# Optional baselines for benchmarks/train_step.py: fbgemm's CPU TBE through torchrec. Only these
# versions load with torch 2.13; a plain `pip install torchrec` would pull a CUDA torch.
bench-deps: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --no-deps fbgemm-gpu-cpu==1.8.0 torchrec==1.9.2
	$(BIN)/python -m pip install -q --no-deps tensordict torchmetrics==1.0.3 pyre-extensions typing-inspect mypy-extensions lightning-utilities cloudpickle orjson iopath portalocker
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
