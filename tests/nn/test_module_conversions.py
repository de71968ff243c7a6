"""A collection prints its tables, and refuses .to()/.half()/.cuda() that would leave its
tables (not parameters) behind, while calls that change nothing pass."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb.errors import ConfigError


def model() -> torch.nn.Module:
    tables = [dynemb.TableConfig(name="t", dim=4, features=["a", "b"], capacity=256,
                                 optimizer=dynemb.Adam()),
              dynemb.TableConfig(name="u", dim=8, features=["c"], capacity=1000,
                                 storage=dynemb.Storage(mode=dynemb.StorageMode.CACHING,
                                                        cache_load_factor=0.5))]
    m = torch.nn.Module()
    m.ebc = dynemb.EmbeddingBagCollection(tables)
    m.mlp = torch.nn.Linear(3, 1)
    return m


def test_repr_shows_every_table():
    text = repr(model())
    assert "t: features ['a', 'b'], dim 4, capacity 256, hbm_only, Adam" in text
    assert "u: features ['c'], dim 8, capacity 1,000, caching x=0.5, SGD" in text
    assert "device=cpu, backend=numba, feature_policy='strict', built=False" in text


@pytest.mark.parametrize("convert", [lambda m: m.half(), lambda m: m.double(),
                                     lambda m: m.to(torch.bfloat16), lambda m: m.to("meta")],
                         ids=["half", "double", "to_dtype", "to_device"])
def test_moving_or_converting_the_tables_is_refused(convert):
    m = model()
    with pytest.raises(ConfigError, match="cannot be moved or converted.*dense submodules"):
        convert(m)


def test_calls_that_change_nothing_pass_and_dense_parts_convert():
    m = model()
    m.to("cpu").float().share_memory()
    m.mlp.half()
    assert m.mlp.weight.dtype == torch.float16


def test_sharded_collections_refuse_too(group_of_one):
    sharded = dynemb.distributed.shard(model().ebc)
    assert "world_size=1, rank=0" in repr(sharded) and "t: features" in repr(sharded)
    with pytest.raises(ConfigError, match="ShardedEmbeddingBagCollection"):
        sharded.half()
