# `make train` and `make test` do everything on a fresh machine: create .venv, install the pinned
# dependencies (torch==2.13.0 first and on its own, so no resolver ever pulls another torch build),
# install dynemb editable, then run. `make install` is idempotent: a stamp file records that .venv
# matches requirements.txt and pyproject.toml.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dynemb-installed
TORCH := torch==2.13.0

.PHONY: install train test bench bench-deps clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps recbole==1.2.1
	$(BIN)/python -m pip install -q --no-deps $(TORCHREC_PKGS)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -c "import torch, dynemb, torchrec, fbgemm_gpu; \
		from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen; \
		import torchrec.distributed.batched_embedding_kernel; \
		assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

# --overwrite: running `make train` again replaces the earlier run in runs/movielens-100k.
train: install
	$(BIN)/python -m dynemb train --overwrite

test: install
	$(BIN)/python -m pytest -q

# Full runs (a few minutes each on 2 cores, one torch thread); JSON on stdout and in
# benchmarks/results/. The fbgemm baseline of train_step.py comes with `make install`.
bench: install
	$(BIN)/python benchmarks/table_ops.py --out benchmarks/results/table_ops.json
	$(BIN)/python benchmarks/train_step.py --out benchmarks/results/train_step.json
	$(BIN)/python benchmarks/many_tables.py --out benchmarks/results/many_tables.json
	$(BIN)/python benchmarks/threads.py --dims 64 --out benchmarks/results/threads.json

# torchrec (dynemb's interop is tested against it) and fbgemm's CPU TBE (the baseline of
# benchmarks/train_step.py). Only these versions load with torch 2.13; a plain `pip install
# torchrec` would pull a CUDA torch, so everything goes in with --no-deps, pinned, dependencies
# listed by hand (tensordict needs pyvers). `make bench-deps` is kept as a name for `install`.
TORCHREC_PKGS := fbgemm-gpu-cpu==1.8.0 torchrec==1.9.2 tensordict==0.15.3 pyvers==0.2.3 \
	torchmetrics==1.0.3 lightning-utilities==0.15.3 pyre-extensions==0.0.32 typing-inspect==0.9.0 \
	mypy-extensions==1.2.0 cloudpickle==3.1.2 orjson==3.13.0 iopath==0.1.10 portalocker==4.4.2
bench-deps: install

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
