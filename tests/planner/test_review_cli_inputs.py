"""`dynemb plan` on hostile input: flags out of range with --from-machine, table entries of the
wrong type, a `tables:` key holding nothing, files that are not text, alias bombs; each is one
line naming what was expected and found, exit status 2, no plan written."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynemb.cli import main
from dynemb.config import TableConfig
from dynemb.errors import ConfigError

TOPOLOGY = "world_size: 2\nranks_per_host: 2\nhbm_bytes_per_rank: 3MiB\nddr_bytes_per_host: 1GiB\n"
BOMB = "".join(f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefg", "bcdefgh"))


def _fails(tmp_path: Path, capsys, tables: str | bytes, *extra: str) -> str:
    path = tmp_path / "tables.yaml"
    if isinstance(tables, bytes):
        path.write_bytes(tables)
    else:
        path.write_text(tables)
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", str(path), "--out", str(out), *extra]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("dynemb plan: error: ") and "\n" not in err, err
    assert captured.out == "" and not out.exists()
    return err


@pytest.mark.parametrize("flag", ["--world-size", "--ranks-per-host", "--profile-steps",
                                  "--batch-size"])
def test_a_flag_below_one_is_refused_even_from_the_machine(tmp_path, capsys, flag):
    """--from-machine used to read 0 as 'not given' and plan for this machine's world size."""
    err = _fails(tmp_path, capsys, "- {name: a, dim: 4, capacity: 100}\n", "--from-machine",
                 flag, "0")
    assert f"{flag}: expected an int >= 1, found 0." in err, err


@pytest.mark.parametrize("features", ["null", "5"])
def test_features_of_the_wrong_type_name_the_field(tmp_path, capsys, features):
    err = _fails(tmp_path, capsys, f"- {{name: a, dim: 4, capacity: 100, features: {features}}}\n",
                 "--from-machine")
    assert "tables[0] (a): TableConfig('a').features: expected a non-empty list of non-empty " \
        f"strings, found {'None' if features == 'null' else features}." in err, err


def test_table_config_features_not_a_list_is_a_config_error():
    with pytest.raises(ConfigError, match=r"features: expected a non-empty list"):
        TableConfig(name="a", dim=4, capacity=10, features=None)


def test_a_tables_key_holding_nothing_says_so(tmp_path, capsys):
    err = _fails(tmp_path, capsys, "tables:\n", "--from-machine")
    assert "expected a list of tables (at the top, or under `tables:`), found nothing under " \
        "`tables:`." in err, err
    err = _fails(tmp_path, capsys, "", "--from-machine")
    assert "found an empty file." in err, err


@pytest.mark.parametrize("text,what", [
    (b"- {name: a, dim: 4}\n- {name: \xe9}\n", "line 2: expected UTF-8 text, found byte 0xe9"),
    (b"a: &a [x, x, x, x, x, x, x, x, x]\n" + BOMB.encode() + b"tables: [*h]\n",
     "expands to more than"),
    (b"[" * 100_000, "nested too deeply"),
])
def test_files_that_are_not_a_list_of_tables_are_one_line(tmp_path, capsys, text, what):
    err = _fails(tmp_path, capsys, text, "--from-machine")
    assert err.startswith(f"dynemb plan: error: tables file {tmp_path / 'tables.yaml'}"), err
    assert what in err, err


def test_a_topology_file_too_large_names_the_topology_file(tmp_path, capsys):
    topo = tmp_path / "topo.yaml"
    topo.write_text(TOPOLOGY + "#" * (2 << 20))
    err = _fails(tmp_path, capsys, "- {name: a, dim: 4, capacity: 100}\n", "--topology",
                 str(topo))
    assert f"topology file {topo}: expected at most 1,048,576 bytes" in err, err
