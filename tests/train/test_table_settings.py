"""Per-table settings in the training config (``embeddings.tables``): a group's pattern, then
single tables, over the section's defaults; every setting reaches its table; entries that match
nothing or hold a bad value are refused naming the entry; the config round-trips through YAML
and --print-config; and a run with tables of mixed dims trains (projected to the interaction
dim)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import dynemb
from dynemb.cli import main
from dynemb.data.movielens import MovieLens100K
from dynemb.errors import ConfigError
from dynemb.models.dlrm import DLRM
from dynemb.train import TrainConfig, from_dict, to_dict
from dynemb.train.config_io import describe_yaml, parse_yaml
from dynemb.train.setup import table_configs

SETTINGS = """
model: {embedding_dim: 8}
embeddings:
  optimizer: adam
  lr: 0.003
  storage: hbm_only
  tables:
    - {match: "*e*", optimizer: sgd, lr: 0.5, capacity: 1000}
    - match: user
      dim: 16
      optimizer: rowwise_adagrad
      score: lfu
      admission_threshold: 3
      routing: roundrobin
      storage: caching
      cache_load_factor: 0.5
    - {match: zip, pooling: mean, on_full: count, init_std: 0.5, weight_decay: 0.01}
"""


def config(text: str = SETTINGS) -> TrainConfig:
    return from_dict(TrainConfig, yaml.safe_load(text))


def test_every_setting_reaches_its_table_in_order():
    tables = {t.name: t for t in table_configs(config(), MovieLens100K())}
    user, item, zip_, hour = tables["user"], tables["item"], tables["zip"], tables["hour"]
    # "user" matches "*e*" first, then its own entry, which wins where both set a value
    assert user.dim == 16 and type(user.optimizer) is dynemb.RowWiseAdagrad
    assert user.optimizer.lr == 0.5 and user.capacity == 1000  # from the group entry
    assert user.score == dynemb.ScorePolicy.LFU and user.admission.threshold == 3
    assert user.routing == dynemb.Routing.ROUNDROBIN
    assert user.storage.mode == dynemb.StorageMode.CACHING and user.storage.cache_load_factor == 0.5
    assert type(item.optimizer) is dynemb.SGD and item.optimizer.lr == 0.5 and item.dim == 8
    assert item.capacity == 1000 and item.storage.mode == dynemb.StorageMode.HBM_ONLY
    assert zip_.pooling == dynemb.PoolingMode.MEAN and zip_.on_full == dynemb.OnFull.COUNT
    assert zip_.initializer.std == 0.5 and zip_.optimizer.weight_decay == 0.01
    assert type(zip_.optimizer) is dynemb.Adam  # "zip" has no "e": the section's defaults
    assert type(hour.optimizer) is dynemb.Adam and hour.optimizer.lr == 0.003
    assert hour.capacity == 1024 and hour.admission is None  # 24 ids: 2x, at least 1024


def test_a_group_is_a_list_of_names_or_patterns():
    cfg = config("embeddings: {tables: [{match: [gender, 'h*'], optimizer: sgd}]}")
    tables = {t.name: t for t in table_configs(cfg, MovieLens100K())}
    assert {n for n, t in tables.items() if type(t.optimizer) is dynemb.SGD} == \
        {"gender", "hour"}


def test_the_docs_example_resolves_on_movielens():
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    section = text[text.index("### Per-table settings"):]
    block = section[section.index("```yaml") + len("```yaml"):section.index("```\n", 20)]
    tables = {t.name: t for t in table_configs(config(block), MovieLens100K())}
    assert type(tables["zip"].optimizer) is dynemb.SGD and tables["user"].dim == 16


def test_the_kernel_thread_count_reaches_every_table():
    assert {t.threads for t in table_configs(config(), MovieLens100K())} == {None}
    cfg = config("embeddings: {threads: 2}")
    assert {t.threads for t in table_configs(cfg, MovieLens100K())} == {2}
    with pytest.raises(ConfigError, match=r"EmbeddingConfig\.threads: expected an int in "
                                          r"\[1, 1024\], found 0"):
        config("embeddings: {threads: 0}")


def test_an_entry_that_matches_no_table_is_refused_naming_the_tables():
    cfg = config("embeddings: {tables: [{match: usr, dim: 4}]}")
    with pytest.raises(ConfigError, match=r"tables\[0\]: match 'usr' names no table; the "
                                          r"tables \(one per feature\) are \['user', 'item'"):
        table_configs(cfg, MovieLens100K())


@pytest.mark.parametrize("entry, named", [
    ("{match: user, optimizer: lamb}", r"optimizer: expected one of \['sgd'"),
    ("{match: user, lr: -1}", r"tables\[0\] \(match 'user'\): .*lr"),
    ("{match: user, dim: 0}", r"dim: expected an int in \[1, 4096\]"),
    ("{match: user, storage: hbm_only, cache_load_factor: 0.5}", r"do not go together"),
    ("{match: '', dim: 4}", r"match"),
    ("{match: [], dim: 4}", r"match: expected a feature name or glob pattern, or a non-empty"),
    ("{match: user, size: 4}", r"embeddings\.tables\[0\]: unknown key\(s\) \['size'\]"),
])
def test_a_bad_entry_is_refused_naming_it(entry, named):
    with pytest.raises(ConfigError, match=named):
        config(f"embeddings: {{tables: [{entry}]}}")


def test_the_settings_round_trip_through_yaml_and_print_config():
    cfg = config()
    assert from_dict(TrainConfig, to_dict(cfg)) == cfg
    assert to_dict(cfg)["embeddings"]["tables"][1] == {
        "match": "user", "dim": 16, "optimizer": "rowwise_adagrad", "score": "lfu",
        "admission_threshold": 3, "routing": "roundrobin", "storage": "caching",
        "cache_load_factor": 0.5}  # what is not set stays out
    text = describe_yaml(cfg)
    assert "# Per-table settings" in text
    assert from_dict(TrainConfig, parse_yaml(text, "printed")) == cfg


def test_dlrm_projects_tables_of_other_dims_to_the_interaction_dim():
    tables = [dynemb.TableConfig(name=n, dim=d, features=[n], capacity=64)
              for n, d in (("a.x", 4), ("b", 8), ("keys", 16))]  # names a ModuleDict refuses
    with pytest.raises(ConfigError, match="give interaction_dim="):
        DLRM(dense_dim=2, tables=tables)
    model = DLRM(dense_dim=2, tables=tables, interaction_dim=8)
    assert sorted(model.projections) == ["0", "2"]  # by position
    assert model.projections["2"].weight.shape == (8, 16)
    batch = dynemb.SparseBatch.from_dict({"a.x": [[1], [2]], "b": [[3], [4]],
                                          "keys": [[5], []]})
    logits = model(torch.randn(2, 2), batch)
    logits.sum().backward()
    assert logits.shape == (2,) and model.projections["0"].weight.grad is not None


def test_a_run_with_per_table_settings_trains(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(SETTINGS)
    out = tmp_path / "run"
    assert main(["train", "--config", str(path), "--steps", "20", "--batch-size", "64",
                 "--set", "data.train_eval_samples=500", "--set", "data.max_eval_samples=500",
                 "--set", "checkpoint_at_end=false", "--out", str(out)]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert 0 < m["eval"]["auc"] < 1
    user, item = m["tables"]["user"], m["tables"]["item"]
    assert user["ddr_bytes"] > 0 and item["ddr_bytes"] == 0  # caching, hbm_only
    assert 1000 <= user["capacity"] < 1200 and user["lookups"] == 20 * 64  # whole buckets


def test_storage_settings_layer_per_table_and_an_entry_setting_storage_restarts_them():
    cfg = config("""
embeddings:
  storage: hybrid
  cache_load_factor: 0.5
  tables:
    - {match: "u*", storage: caching}
    - {match: user, cache_load_factor: 0.25}
    - {match: item, storage: hbm_only}
""")
    tables = {t.name: t for t in table_configs(cfg, MovieLens100K())}
    assert tables["user"].storage.mode == dynemb.StorageMode.CACHING
    assert tables["user"].storage.cache_load_factor == 0.25
    assert tables["item"].storage.mode == dynemb.StorageMode.HBM_ONLY  # not hybrid's 0.5
    assert tables["zip"].storage.mode == dynemb.StorageMode.HYBRID


def test_settings_that_only_clash_together_name_the_table_and_its_entries():
    cfg = config("""
embeddings:
  tables:
    - {match: user, storage: hbm_only}
    - {match: [user, item], cache_load_factor: 0.5}
""")
    with pytest.raises(ConfigError, match=r"table 'user' \(the section's settings, then "
                                          r"embeddings\.tables\[0, 1\]\): .*do not go together"):
        table_configs(cfg, MovieLens100K())


def test_an_empty_list_a_literal_name_and_a_ddr_path_left_to_the_planner():
    assert config("embeddings: {tables: null}").embeddings.tables == ()
    from dynemb.train.config import TableSettings

    assert TableSettings(match="f[0]").matches("f[0]")  # a name is itself, glob characters or not
    cfg = config("embeddings: {storage: auto, tables: [{match: user, ddr_path: /tmp/x}]}")
    with pytest.raises(ConfigError, match="table 'user': a ddr_path of its own"):
        table_configs(cfg, MovieLens100K())
