"""What a run reports: per-table counters (summed over the ranks), peak memory, the plan's
predictions next to what was measured, the summary text printed at the end, and
``metrics.json``."""

from __future__ import annotations

import json
import math
import os
import resource
from pathlib import Path

import torch

from dynemb.errors import ConfigError
from dynemb.models.dlrm import DLRM
from dynemb.table.memory import table_memory
from dynemb.train.parallel import Env, all_gather_cat, all_sum
from dynemb.train.planning import RunPlan

_COUNTERS = ("size", "capacity", "lookups", "hits", "hbm_hits", "inserted", "evicted",
             "failed_inserts", "admission_rejected", "forgotten_sightings", "nonfinite_grads")


def table_report(model: DLRM, env: Env) -> dict[str, dict]:
    """Per table, in total over the ranks and per rank (``per_rank``: one value per rank for
    each count): rows held (``rows``), capacity, lookups, ids that had a row (``hits``; the hit
    rate is their share), lookups served from hbm (``hbm_hits``; the hbm hit rate), inserts,
    evictions, failed inserts, rejected admissions, admission sightings a full counter table
    forgot, gradient rows that were not finite, and the bytes the table holds in each tier
    (``hbm_bytes``, ``ddr_bytes``). Collective under torchrun."""
    tables = model.embeddings.tables
    own = torch.tensor([[*(getattr(t.stats(), c) for c in _COUNTERS),
                         t.memory_usage().hbm_bytes, t.memory_usage().ddr_bytes]
                        for t in tables.values()], dtype=torch.float64)
    every = all_gather_cat(env, own.reshape(1, -1).to(env.device)).cpu()
    every = every.reshape(env.world_size, len(tables), len(_COUNTERS) + 2)
    names = [("rows" if c == "size" else c) for c in _COUNTERS] + ["hbm_bytes", "ddr_bytes"]
    out = {}
    for i, name in enumerate(tables):
        per_rank = {n: [int(v) for v in every[:, i, j].tolist()] for j, n in enumerate(names)}
        entry: dict = {n: sum(v) for n, v in per_rank.items()}
        lookups = entry["lookups"]
        entry["hit_rate"] = entry["hits"] / lookups if lookups else math.nan
        entry["hbm_hit_rate"] = entry["hbm_hits"] / lookups if lookups else math.nan
        entry["per_rank"] = per_rank
        out[name] = entry
    return out


def tier_counts(model: DLRM) -> torch.Tensor:
    """(T, 2) float64 (lookups, hbm hits) of this rank's tables so far (TableStats)."""
    stats = [t.stats() for t in model.embeddings.tables.values()]
    return torch.tensor([[s.lookups, s.hbm_hits] for s in stats], dtype=torch.float64)


def _memory(model: DLRM, env: Env) -> torch.Tensor:
    """(W, T, 2) float64: every rank's (hbm, ddr) bytes of each table's shard, from
    ``DynamicTable.memory_usage()`` (collective)."""
    tables = model.embeddings.tables
    own = torch.tensor([[u.hbm_bytes, u.ddr_bytes] for u in
                        (t.memory_usage() for t in tables.values())], dtype=torch.float64)
    every = all_gather_cat(env, own.reshape(1, -1).to(env.device)).cpu()
    return every.reshape(env.world_size, len(tables), 2)


def _per_host(bytes_per_rank: torch.Tensor, ranks_per_host: int) -> float:
    """The largest sum over a host's ranks (torchrun numbers a host's ranks consecutively)."""
    return max(float(bytes_per_rank[i:i + ranks_per_host].sum())
               for i in range(0, bytes_per_rank.numel(), ranks_per_host))


def plan_report(settled: RunPlan, model: DLRM, env: Env, counts: torch.Tensor,
                step_ms: float) -> dict:
    """The plan's predictions next to what the run measured (collective under torchrun).

    Per table: the mode and cache_load_factor planned and built; the hbm hit rate predicted and
    measured over the training steps (``counts``: this rank's (lookups, hbm hits) per table
    during them, summed here over the ranks); the bytes per tier of one rank's shard planned
    (hbm including the estimated per-step working set, given apart) and measured
    (``memory_usage()``: the largest rank's, and whether every rank's shard has the same); the
    predicted ms per step. In all: the tables'
    predicted ms per step next to the measured median step time (``step_ms``, the whole step),
    and the bytes per rank and per host against the budgets.
    """
    result = settled.plan
    info = {"origin": settled.origin, "file": settled.path, "seconds": settled.seconds,
            "batch_seconds": settled.batch_seconds, "profile_steps": settled.profile_steps}
    if result is None:
        return info
    counts = all_sum(env, counts.to(env.device)).cpu()
    memory = _memory(model, env)
    topo = result.topology
    tables = {}
    for i, (config, (name, table)) in enumerate(zip(model.embeddings.configs,
                                                    model.embeddings.tables.items())):
        choice = result.tables[name]
        static = table_memory(config, world_size=topo.world_size)
        lookups, hits = counts[i].tolist()
        tables[name] = {
            "mode": choice.mode.value, "cache_load_factor": choice.cache_load_factor,
            "pinned": choice.pinned, "built_mode": table.mode.value,
            "built_cache_load_factor": table.config.storage.cache_load_factor,
            "predicted_hbm_hit_rate": choice.predicted_hit_rate,
            "measured_hbm_hit_rate": hits / lookups if lookups else math.nan,
            "predicted_hbm_bytes": choice.hbm_bytes,
            "predicted_working_bytes": choice.hbm_bytes - static.hbm_bytes,
            "measured_hbm_bytes": int(memory[:, i, 0].max()),
            "predicted_ddr_bytes": choice.ddr_bytes,
            "measured_ddr_bytes": int(memory[:, i, 1].max()),
            "measured_same_on_every_rank": bool((memory[:, i] == memory[0, i]).all()),
            "predicted_ms": choice.predicted_ms}
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(env.world_size)))
    totals = memory.sum(dim=1)  # (W, 2) per rank
    return {**info, "cost_source": result.cost_source, "optimal": result.optimal,
            "topology": topo.as_dict(),
            "predicted_ms_per_step": result.predicted_ms, "measured_step_ms_median": step_ms,
            "hbm_budget_per_rank": topo.hbm_budget,
            "predicted_hbm_bytes_per_rank": result.hbm_bytes_per_rank,
            "measured_hbm_bytes_per_rank": int(totals[:, 0].max()),
            "ddr_budget_per_host": topo.ddr_budget_per_host,
            "predicted_ddr_bytes_per_host": result.ddr_bytes_per_host,
            "measured_ddr_bytes_per_host": int(_per_host(totals[:, 1],
                                                         max(1, min(local, env.world_size)))),
            "tables": tables}


def memory_report(env: Env) -> dict:
    """Peak resident memory (MiB; ``getrusage`` ``ru_maxrss``) of each rank's process and of
    the largest one, and peak CUDA memory when on a GPU (collective under torchrun)."""
    peak = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0]  # KiB on Linux
    if env.device.type == "cuda":
        peak.append(torch.cuda.max_memory_allocated(env.device) / 2**20)
    every = all_gather_cat(env, torch.tensor([peak], dtype=torch.float64,
                                             device=env.device)).cpu()
    out = {"peak_rss_mib": round(float(every[:, 0].max()), 1),
           "peak_rss_mib_per_rank": [round(float(v), 1) for v in every[:, 0].tolist()],
           "peak_rss_is": "the largest peak resident set (ru_maxrss) of any rank's process; "
                          "each rank's in peak_rss_mib_per_rank"}
    if env.device.type == "cuda":
        out["peak_cuda_mib"] = round(float(every[:, 1].max()), 1)
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
    pipe = metrics.get("pipeline")
    if pipe:
        parts = ", ".join(f"{k.replace('_', ' ')} {100 * v:.0f} %"
                          for k, v in pipe["split_share"].items() if v >= 0.005)
        lines.append(f"  pipeline {pipe['kind']}: {parts}")
    for name, t in metrics["tables"].items():
        line = (f"  table {name:<12} {t['rows']:>9,} rows of {t['capacity']:>9,}  "
                f"hit rate {_fmt(t['hit_rate'], 3)} (ids that had a row), "
                f"{_fmt(t.get('hbm_hit_rate'), 3)} from hbm  {t['evicted']:,} evicted")
        lost = [(t.get(k, 0), what) for k, what in (
            ("failed_inserts", "failed inserts"), ("nonfinite_grads", "non-finite gradient rows"),
            ("forgotten_sightings", "forgotten admission sightings")) if t.get(k, 0)]
        lines.append(line + "".join(f"  {n:,} {what}" for n, what in lost))
    lines += _plan_lines(metrics.get("plan"))
    return "\n".join(lines)


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.2f}"


def _plan_lines(plan: dict | None) -> list[str]:
    """The summary's plan: per table what was predicted next to what was measured."""
    if not plan or "tables" not in plan:
        return ["  plan   none: every table's storage is given in the config"] if plan else []
    how = {"planned": f"planned at start-up in {plan['seconds']:.2f} s (profiled on "
                      f"{plan['profile_steps']} batch(es) built in {plan['batch_seconds']:.2f} "
                      "s)", "file": f"from --plan {plan['file']}",
           "resumed": f"the resumed run's {plan['file']}"}.get(plan["origin"], plan["origin"])
    lines = [f"  plan   {how} ({plan['cost_source']}); predicted (steady state) | measured (this run):",
             f"  plan   step: tables {plan['predicted_ms_per_step']:.3f} ms predicted | whole "
             f"step {_fmt(plan['measured_step_ms_median'], 3)} ms measured (median)",
             f"  plan   hbm per rank {_mib(plan['predicted_hbm_bytes_per_rank'])} | "
             f"{_mib(plan['measured_hbm_bytes_per_rank'])} MiB (budget "
             f"{_mib(plan['hbm_budget_per_rank'])}); ddr per host "
             f"{_mib(plan['predicted_ddr_bytes_per_host'])} | "
             f"{_mib(plan['measured_ddr_bytes_per_host'])} MiB (budget "
             f"{_mib(plan['ddr_budget_per_host'])})"]
    for name, t in plan["tables"].items():
        lines.append(
            f"  plan   {name:<12} {t['mode']:<8} x={t['cache_load_factor']:.2f}  hbm hit rate "
            f"{_fmt(t['predicted_hbm_hit_rate'], 3)} | {_fmt(t['measured_hbm_hit_rate'], 3)}  "
            f"hbm {_mib(t['predicted_hbm_bytes'])} (working set "
            f"{_mib(t['predicted_working_bytes'])}) | {_mib(t['measured_hbm_bytes'])} MiB  "
            f"ddr {_mib(t['predicted_ddr_bytes'])} | {_mib(t['measured_ddr_bytes'])} MiB  "
            f"{t['predicted_ms']:.4f} ms")
    return lines


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
