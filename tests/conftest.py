"""Shared fixtures: both kernel backends, one intra-op thread, small tables."""

from __future__ import annotations

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run in its interpreter (before dynemb,
    os.environ.setdefault("TRITON_INTERPRET", "1")  # whose imports import triton)

import dynemb  # noqa: E402

torch.set_num_threads(1)

BACKENDS = ("numba", "torch")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """The kernel backend a table is built with: "numba" (compiled) and "torch" (reference)."""
    return request.param


def _table_config(**kw) -> dynemb.TableConfig:
    kw.setdefault("name", "t")
    kw.setdefault("dim", 4)
    kw.setdefault("features", ("f",))
    kw.setdefault("capacity", 8)
    return dynemb.TableConfig(**kw)


@pytest.fixture
def table_config():
    """Factory: ``table_config(**TableConfig fields)`` with small defaults: name "t", dim 4,
    feature "f", capacity 8 (one bucket of 8 slots)."""
    return _table_config


@pytest.fixture
def make_table(backend):
    """Factory: ``make_table(**TableConfig fields)`` builds a DynamicTable on the fixture's backend
    (defaults as in ``table_config``)."""

    def make(**kw) -> dynemb.DynamicTable:
        return dynemb.DynamicTable(_table_config(**kw), backend=backend)

    return make


@pytest.fixture
def group_of_one():
    """A gloo group of one rank in this process (skipped if one exists), destroyed afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def cyclic_garbage():
    """``cyclic_garbage(fn)``: runs ``fn`` after a collection, then collects again; returns the
    type names of what fn left in reference cycles among dynemb objects, plain tensors and
    dynemb's autograd nodes (other garbage, e.g. torch.compile's from earlier tests, may turn
    up and is not counted)."""

    def ours(obj) -> bool:
        kind = type(obj)
        return (kind.__module__.startswith("dynemb") or kind is torch.Tensor
                or kind.__name__.endswith("FnBackward"))

    def run(fn) -> list[str]:
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            fn()
            gc.collect()
            return sorted({type(o).__name__ for o in gc.garbage if ours(o)})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()

    return run
