"""The working set the planner charges to hbm against what a training step allocates: the peak
resident memory of one step of a warm table (every row exists), measured in a fresh process
whose allocator returns every large block to the system when it is freed, plus what the table
keeps between steps for its steps (its gradient buffer, or its group's: resident before the
step measured)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import dynemb
from dynemb.config import Storage, StorageMode
from dynemb.table.memory import working_set_bytes

STEP = r"""
import json, sys, torch, dynemb
from dynemb.batch import SparseBatch
from dynemb.config import Storage, StorageMode
from dynemb.nn import EmbeddingBagCollection

torch.set_num_threads(1)


def resident(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def peak(ids_n, dim, mode, x):
    storage = Storage(mode=StorageMode[mode], cache_load_factor=x)
    cfg = dynemb.TableConfig(name="t", dim=dim, features=["f"], capacity=4 * ids_n,
                             optimizer=dynemb.Adam(), storage=storage)
    ebc = EmbeddingBagCollection([cfg])
    ids = torch.randperm(4 * ids_n, generator=torch.Generator().manual_seed(0))[:ids_n]
    batch = SparseBatch(features=["f"], values=ids, lengths=torch.ones(ids_n, dtype=torch.int64))

    def step():
        out = ebc(batch).values()  # kept through backward, as a model keeps its activations
        out.sum().backward()

    step()
    step()  # every row exists and every page of the tables has been touched
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident size
    base = resident("VmRSS:")
    step()
    kept = sum(t.grad_scratch.nbytes for t in ebc.tables.values())
    if ebc._group:  # grouped tables share one gradient buffer (dynemb.nn.grouped)
        kept += ebc._group.grad_bytes
    out = resident("VmHWM:") - base + kept
    ebc.close()
    return out


print(json.dumps([peak(*case) for case in json.loads(sys.argv[1])]))
"""
IDS, DIM = 32768, 128
CASES = [(StorageMode.HBM_ONLY, 1.0), (StorageMode.HYBRID, 0.5), (StorageMode.CACHING, 0.1)]


@pytest.fixture(scope="module")
def peaks() -> dict:
    """Each case's peak, measured in one fresh process."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cases = json.dumps([(IDS, DIM, mode.name, x) for mode, x in CASES])
    out = subprocess.run([sys.executable, "-c", STEP, cases], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    return dict(zip(CASES, json.loads(out.stdout.strip().splitlines()[-1])))


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
@pytest.mark.parametrize("mode,x", CASES)
def test_a_step_allocates_no_more_than_the_working_set_charged(peaks, mode, x):
    """One id per bag (a sequence feature: as many pooled rows as ids), all distinct: HYBRID
    moves half the rows across the tiers, CACHING at 0.1 misses most of them (copy in, write
    back). The estimate must cover the step (2 % for what else the process allocates)."""
    config = dynemb.TableConfig(name="t", dim=DIM, features=["f"], capacity=4 * IDS,
                                optimizer=dynemb.Adam(),
                                storage=Storage(mode=mode, cache_load_factor=x))
    charged = dynemb.table_memory(config, ids_per_step=IDS).hbm.working_bytes
    assert charged == working_set_bytes(config, IDS)
    peak = peaks[(mode, x)]
    assert peak <= 1.02 * charged, (peak, charged)
    assert charged <= 1.6 * peak, (peak, charged)  # and not wildly above it
