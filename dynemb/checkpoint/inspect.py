"""What a checkpoint holds, read from its manifest (no tensor is loaded): the text of
``dynemb inspect PATH`` (the command itself is in ``dynemb.cli``).

:func:`describe` gives the header (kind, step, world size, versions), the dense state, and per
table its configuration summary and a row per rank: rows, table and optimizer steps, files and
bytes. :func:`verify_all` checks every file as ``load`` does: size, sha256, and each shard
file's metadata and shapes against the manifest (itself checked by its checksum and schema).
"""

from __future__ import annotations

import datetime
from pathlib import Path

from dynemb.checkpoint.integrity import check_files
from dynemb.checkpoint.manifest import DELTA, read_manifest
from dynemb.checkpoint.paths import load_lock
from dynemb.checkpoint.schema import file_specs


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _printable(text: str) -> str:
    """``text`` with every character that cannot be shown as it is (control characters,
    escape sequences, lone surrogates: a hand-edited manifest or an odd path) escaped as in
    Python source; line breaks kept."""
    return "\n".join(line if line.isprintable() else
                     "".join(c if c.isprintable() else ascii(c)[1:-1] for c in line)
                     for line in text.split("\n"))


def _optimizer(opt: dict) -> str:
    args = ", ".join(f"{k}={v}" for k, v in opt.items() if k != "type" and v is not None)
    return f"{opt['type']}({args})"


def _rank_files(r: dict) -> list[str]:
    files = [p["file"] for p in r["parts"]]
    files += [r[k]["file"] for k in ("admission", "evicted") if r.get(k)]
    return files


def _table_lines(key: str, t: dict, files: dict, delta: bool) -> list[str]:
    adm = "yes" if t["admission"] else "no"
    lines = [f"table {key!r}: dim {t['dim']}, optimizer {_optimizer(t['optimizer'])}, "
             f"routing {t['routing']}, storage {t['storage_mode']}, score {t['score']}, "
             f"admission {adm}, capacity {t['config'].get('capacity')}"]
    head = (f"  {'rank':>4}  {'rows':>12}  {'table_step':>10}  {'opt_step':>8}  {'files':>5}  "
            f"{'bytes':>10}")
    lines.append(head + ("  evicted" if delta else ""))
    total_rows = total_bytes = 0
    for i, r in enumerate(t["ranks"]):
        fs = _rank_files(r)
        nbytes = sum(files[f]["bytes"] for f in fs if f in files)
        total_rows += r["rows"]
        total_bytes += nbytes
        line = (f"  {i:>4}  {r['rows']:>12,}  {r['table_step']:>10}  {r['optimizer_step']:>8}  "
                f"{len(fs):>5}  {_size(nbytes):>10}")
        if delta:
            line += f"  {(r.get('evicted') or {}).get('keys', 0):,}"
        lines.append(line)
    lines.append(f"  total {total_rows:,} rows, {_size(total_bytes)}")
    return lines


def describe(path: str | Path) -> str:
    """A human-readable summary of the checkpoint at ``path`` (from its manifest), printable
    whatever its strings hold.

    Raises:
        CheckpointError: no readable checkpoint manifest there.
    """
    root = Path(path)
    m = read_manifest(root)
    files = m["files"]
    delta = m["kind"] == DELTA
    created = datetime.datetime.fromtimestamp(m["created_unix"], datetime.timezone.utc)
    since = f", rows since step {m['since_step']}" if delta else ""
    lines = [
        f"dynemb checkpoint {root}",
        f"  kind {m['kind']}{since}, step {m['step']}, world size {m['world_size']}, "
        f"format {m['format_version']}, dynemb {m['library_version']}, torch {m['torch_version']}",
        f"  created {created:%Y-%m-%d %H:%M:%S} UTC, {len(files)} files, "
        f"{_size(sum(f['bytes'] for f in files.values()))}",
    ]
    d = m["dense"]
    dense_bytes = sum(files[f]["bytes"] for f in d["files"] if f in files)
    lines.append(f"dense: optimizer {d['optimizer'] or 'none'}, "
                 f"{'replicated on every rank' if d['replicated'] else 'differs between ranks'}, "
                 f"{len(d['files'])} file(s), {_size(dense_bytes)}")
    for key, t in m["tables"].items():
        lines += _table_lines(key, t, files, delta)
    return _printable("\n".join(lines))


def verify_all(path: str | Path) -> int:
    """Checks every file the manifest lists (size, sha256, and each shard file's metadata and
    tensor shapes against the manifest); returns how many.

    Raises:
        CheckpointError: the manifest or a file fails a check (the first failure).
    """
    root = Path(path).absolute()
    lock = load_lock(root)  # as a load: no save replaces the files while they are checked
    try:
        m = read_manifest(root)
        specs = file_specs(m, f"checkpoint {root}")
        check_files(root, m, specs)
    finally:
        if lock is not None:
            lock.__exit__()
    return len(specs)
