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

.PHONY: install train test bench bench-deps clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps recbole==1.2.1
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -c "import torch, dynemb; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

# --overwrite: running `make train` again replaces the earlier run in runs/movielens-100k.
train: install
	$(BIN)/python -m dynemb train --overwrite

test: install
	$(BIN)/python -m pytest -q

# Full runs (a few minutes each on 2 cores, one torch thread); JSON on stdout and in
# benchmarks/results/. The fbgemm baseline of train_step.py needs `make bench-deps` (else skipped).
bench: install
	$(BIN)/python benchmarks/table_ops.py --out benchmarks/results/table_ops.json
	$(BIN)/python benchmarks/train_step.py --out benchmarks/results/train_step.json

# Optional baselines for benchmarks/train_step.py: fbgemm's CPU TBE (and torchrec). Only these
# versions load with torch 2.13; a plain `pip install torchrec` would pull a CUDA torch, so
# everything goes in with --no-deps, pinned, dependencies listed by hand (tensordict needs pyvers).
BENCH_PKGS := fbgemm-gpu-cpu==1.8.0 torchrec==1.9.2 tensordict==0.15.3 pyvers==0.2.3 \
	torchmetrics==1.0.3 lightning-utilities==0.15.3 pyre-extensions==0.0.32 typing-inspect==0.9.0 \
	mypy-extensions==1.2.0 cloudpickle==3.1.2 orjson==3.13.0 iopath==0.1.10 portalocker==4.4.2
bench-deps: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP) Makefile
	$(BIN)/python -m pip install -q --no-deps $(BENCH_PKGS)
	$(BIN)/python -c "import torch, fbgemm_gpu, torchrec; \
		from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen; \
		import torchrec.distributed.batched_embedding_kernel; \
		assert torch.__version__.startswith('2.13.0'), torch.__version__; \
		print('bench-deps ok: torch', torch.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__)"
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
