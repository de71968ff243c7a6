"""What a run reports: per-table counters (summed over the ranks), peak memory, the summary
text printed at the end, and ``metrics.json``."""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path

import torch

from dynemb.errors import ConfigError
from dynemb.models.dlrm import DLRM
from dynemb.train.parallel import Env, all_max, all_sum

_COUNTERS = ("size", "capacity", "lookups", "hits", "inserted", "evicted", "failed_inserts",
             "admission_rejected", "forgotten_sightings", "nonfinite_grads")


def table_report(model: DLRM, env: Env) -> dict[str, dict[str, float]]:
    """Per table, over all ranks: rows held (``rows``), capacity, lookups, hit rate, inserts,
    evictions, failed inserts, rejected admissions, admission sightings a full counter table
    forgot, and gradient rows that were not finite (collective under torchrun)."""
    tables = model.embeddings.tables
    counts = torch.tensor([[getattr(t.stats(), c) for c in _COUNTERS] for t in tables.values()],
                          dtype=torch.float64, device=env.device)
    counts = all_sum(env, counts).cpu()
    out = {}
    for name, row in zip(tables, counts.tolist()):
        entry = {("rows" if c == "size" else c): int(v) for c, v in zip(_COUNTERS, row)}
        entry["hit_rate"] = entry["hits"] / entry["lookups"] if entry["lookups"] else math.nan
        out[name] = entry
    return out


def memory_report(env: Env) -> dict[str, float]:
    """Peak resident memory of the largest rank's process (MiB; ``ru_maxrss``), and peak CUDA
    memory when on a GPU (collective under torchrun)."""
    peak = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0]  # KiB on Linux
    if env.device.type == "cuda":
        peak.append(torch.cuda.max_memory_allocated(env.device) / 2**20)
    values = all_max(env, torch.tensor(peak, dtype=torch.float64, device=env.device)).cpu()
    out = {"peak_rss_mib": round(float(values[0]), 1)}
    if env.device.type == "cuda":
        out["peak_cuda_mib"] = round(float(values[1]), 1)
    return out


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def format_summary(metrics: dict) -> str:
    """The end-of-run summary as text (what ``dynemb train`` prints)."""
    ev, tr, thr = metrics["eval"], metrics.get("train") or {}, metrics["throughput"]
    lines = [f"dynemb train: {metrics['data']['source']}, {metrics['steps']} steps x "
             f"{metrics['batch_size']} samples, {metrics['world_size']} rank(s)  ->  "
             f"{metrics['out']}",
             f"  eval   AUC {_fmt(ev['auc'])}  log loss {_fmt(ev['log_loss'])}  "
             f"({ev['samples']:,} samples)"]
    if "best_auc" in ev:
        lines.append(f"  best achievable (true probabilities)  AUC {_fmt(ev['best_auc'])}  "
                     f"log loss {_fmt(ev['best_log_loss'])}")
    if "auc" in tr:
        lines.append(f"  train  AUC {_fmt(tr.get('auc'))}  log loss {_fmt(tr.get('log_loss'))}  "
                     f"({tr.get('samples', 0):,} samples)")
    lines.append(f"  {thr['samples_per_s']:,.0f} samples/s, training {thr['train_s']:.1f} s, "
                 f"waiting for data {100 * thr['data_wait_share']:.1f} % of it; "
                 f"wall {thr['wall_s']:.1f} s; peak memory "
                 f"{metrics['memory']['peak_rss_mib']:,.0f} MiB")
    for name, t in metrics["tables"].items():
        line = (f"  table {name:<12} {t['rows']:>9,} rows of {t['capacity']:>9,}  "
                f"hit rate {_fmt(t['hit_rate'], 3)}  {t['evicted']:,} evicted")
        lost = [(t.get(k, 0), what) for k, what in (
            ("failed_inserts", "failed inserts"), ("nonfinite_grads", "non-finite gradient rows"),
            ("forgotten_sightings", "forgotten admission sightings")) if t.get(k, 0)]
        lines.append(line + "".join(f"  {n:,} {what}" for n, what in lost))
    return "\n".join(lines)


def write_json(path: Path, data: dict) -> None:
    """Writes ``data`` as indented JSON (NaN as null), atomically.

    Raises:
        ConfigError: the file cannot be written (naming it).
    """

    def clean(value: object) -> object:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(clean(data), indent=2) + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError as error:
        raise ConfigError(f"{path}: cannot write it ({error.strerror}); expected a writable "
                          "run directory with free space.") from None
