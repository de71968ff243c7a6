"""The run configuration: defaults, validation, unknown keys, YAML/JSON files, overrides and
the CLI flags."""

from __future__ import annotations

import json

import pytest
import yaml

from dynemb.cli import build_parser, train_config
from dynemb.data import Split
from dynemb.errors import ConfigError
from dynemb.train import (
    DataConfig, EmbeddingConfig, ModelConfig, SparseOptimizer, TrainConfig, dump_yaml,
    from_dict, load, to_dict,
)


def test_defaults_are_valid_and_round_trip():
    cfg = TrainConfig()
    assert cfg.data.source == "movielens-100k" and cfg.data.split is Split.RANDOM
    assert cfg.run_dir == "runs/movielens-100k"
    assert from_dict(TrainConfig, to_dict(cfg)) == cfg
    assert from_dict(TrainConfig, yaml.safe_load(dump_yaml(cfg))) == cfg


def test_unknown_keys_list_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        from_dict(TrainConfig, {"stepz": 3})
    assert "unknown key(s) ['stepz']" in str(info.value)
    assert "'batch_size'" in str(info.value) and "'steps'" in str(info.value)
    with pytest.raises(ConfigError, match=r"data\.synthetic: unknown key\(s\) \['vocab'\]; "
                                          r"valid keys are \[.*'vocab_sizes'"):
        from_dict(TrainConfig, {"data": {"synthetic": {"vocab": 5}}})


@pytest.mark.parametrize("data,match", [
    ({"steps": 0}, r"TrainConfig\.steps: expected an int >= 1, found 0"),
    ({"steps": True}, r"TrainConfig\.steps"),
    ({"batch_size": 2.5}, r"TrainConfig\.batch_size"),
    ({"device": "tpu"}, r"TrainConfig\.device"),
    ({"data": {"source": "imagenet"}}, r"data: DataConfig\.source: expected one of "
                                       r"\['movielens-100k', 'synthetic', 'criteo:PATH'\]"),
    ({"data": {"split": "sideways"}}, r"expected one of \['random', 'time'\]"),
    ({"data": {"eval_fraction": 1}}, r"DataConfig\.eval_fraction"),
    ({"data": {"synthetic": {"alpha": -1}}}, r"data\.synthetic: SyntheticConfig\.alpha"),
    ({"model": {"top_mlp": [0]}}, r"ModelConfig\.top_mlp"),
    ({"model": 3}, r"model: expected a mapping"),
    ({"embeddings": {"optimizer": "lion"}}, r"'rowwise_adagrad', 'adam'\], found 'lion'"),
    ({"embeddings": {"lr": -1}}, r"EmbeddingConfig\.lr"),
    ({"embeddings": {"score": "fifo"}}, r"EmbeddingConfig\.score"),
    ({"dense_optimizer": {"name": "lamb"}}, r"DenseOptimizerConfig\.name"),
])
def test_bad_values_name_the_field(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(TrainConfig, data)


def test_dataclasses_are_frozen_and_validate_directly():
    cfg = DataConfig(split="time")
    assert cfg.split is Split.TIME
    with pytest.raises(AttributeError):
        cfg.split = Split.RANDOM  # type: ignore[misc]
    with pytest.raises(ConfigError, match="capacity"):
        EmbeddingConfig(capacity=0)
    assert ModelConfig(top_mlp=[8, 4]).top_mlp == (8, 4)
    assert EmbeddingConfig(optimizer="rowwise_adagrad").optimizer is SparseOptimizer.ROWWISE_ADAGRAD


def test_yaml_and_json_files_and_overrides(tmp_path):
    (tmp_path / "run.yaml").write_text("steps: 40\ndata:\n  source: synthetic\n"
                                       "  synthetic: {num_sparse: 2, vocab_sizes: [5, 6]}\n")
    cfg = load(TrainConfig, tmp_path / "run.yaml", ["model.top_mlp=[16]", "data.split=time"])
    assert cfg.steps == 40 and cfg.data.synthetic.vocab_sizes == (5, 6)
    assert cfg.model.top_mlp == (16,) and cfg.data.split is Split.TIME
    (tmp_path / "run.json").write_text(json.dumps({"batch_size": 64}))
    assert load(TrainConfig, tmp_path / "run.json").batch_size == 64
    (tmp_path / "bad.yaml").write_text("steps: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(TrainConfig, tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="cannot read"):
        load(TrainConfig, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load(TrainConfig, overrides=["steps"])


def test_cli_flags_override_the_file(tmp_path):
    (tmp_path / "run.yaml").write_text("steps: 40\nbatch_size: 64\nout: runs/a\n")
    args = build_parser().parse_args([
        "train", "--config", str(tmp_path / "run.yaml"), "--data", "criteo:/data/day_0.tsv",
        "--steps", "7", "--out", "runs/b", "--set", "batch_size=32", "--resume"])
    cfg = train_config(args)
    assert (cfg.steps, cfg.batch_size, cfg.out) == (7, 32, "runs/b")
    assert cfg.data.source == "criteo:/data/day_0.tsv" and args.resume
    assert TrainConfig(data=DataConfig(source="criteo:/x/day_1.gz")).run_dir == "runs/criteo"


BILLION_LAUGHS = "\n".join(
    ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]) + "\n"


@pytest.mark.parametrize("name,content,match", [
    ("cycle.yaml", "steps: 3\ndata: &d\n  seed: *d\n",
     r"cycle\.yaml, line 2: the value anchored there contains itself"),
    ("cycle2.yaml", "model:\n  top_mlp: &l [1, *l]\n", r"cycle2\.yaml, line 2: .*anchor cycle"),
    ("laughs.yaml", BILLION_LAUGHS, r"laughs\.yaml, line \d+: expands to more than 100,000"),
    ("latin1.yaml", "steps: 3\nout: caf\xe9\n".encode("latin-1"),
     r"latin1\.yaml, line 2: expected UTF-8 text, found byte 0xe9"),
    ("syntax.yaml", "steps: 3\nmodel: {top_mlp: [1\n",
     r"syntax\.yaml, line 3, column 1: not valid YAML"),
    ("date.yaml", "out: 2020-13-45\n", r"date\.yaml: a value cannot be read"),
    ("deep.yaml", "a: " + "[" * 5000 + "]" * 5000 + "\n", r"deep\.yaml: nested too deeply"),
    ("deep.json", "[" * 100_000 + "]" * 100_000, r"deep\.json: nested too deeply"),
    ("bad.json", '{"steps": 3,\n "x": }', r"bad\.json, line 2, column 7: not valid JSON"),
    ("big.yaml", "# " + "x" * (1 << 20) + "\n", r"big\.yaml: expected at most 1,048,576 bytes"),
    # these three used to be a ValueError traceback, and silently the last of two values
    ("digits.json", '{"steps": ' + "1" * 5000 + "}", r"digits\.json: a value cannot be read"),
    ("twice.yaml", "steps: 3\ndata:\n  seed: 1\n  seed: 2\n",
     r"twice\.yaml, line 4: key 'seed' appears twice"),
    ("twice.json", '{"steps": 3, "steps": 4}', r"twice\.json: key 'steps' appears twice"),
])
def test_hostile_config_files_raise_config_error_naming_the_file_and_line(tmp_path, name,
                                                                          content, match):
    """Anchor cycles, alias bombs, non-UTF-8 bytes, bad dates, deep nesting: a ConfigError
    naming the file (and the parser's line), never a traceback or a hang."""
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=match):
        load(TrainConfig, path)


def test_yaml_values_that_are_not_json_survive_overrides(tmp_path):
    """A date in the file used to crash the deep copy made for --set (json.dumps)."""
    (tmp_path / "run.yaml").write_text("out: 2020-01-01\nsteps: 3\n")
    with pytest.raises(ConfigError, match=r"TrainConfig\.out: expected a path string, found "
                                          r"datetime\.date"):
        load(TrainConfig, tmp_path / "run.yaml", ["batch_size=8"])
    with pytest.raises(ConfigError, match=r"override 'out=&a \[\*a\]', line 1: .*anchor cycle"):
        load(TrainConfig, overrides=["out=&a [*a]"])
    assert load(TrainConfig, overrides=["out=[1"]).out == "[1"  # not YAML: the text itself
    assert load(TrainConfig, overrides=["steps=&n 7"]).steps == 7  # anchors are fine
