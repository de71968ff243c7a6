"""Building a run from its config: the data source, the tables (placed by a plan, see
:mod:`dynemb.train.planning`), the DLRM (sharded under torchrun) and the dense optimizer."""

from __future__ import annotations

import logging

import torch

from dynemb.config import (
    SGD, Adagrad, Adam, Admission, Initializer, OptimizerConfig, Routing, RowWiseAdagrad,
    TableConfig,
)
from dynemb.data.base import DataSource
from dynemb.data.criteo import CriteoTSV
from dynemb.data.movielens import MovieLens100K
from dynemb.data.synthetic import SyntheticData
from dynemb.distributed import shard
from dynemb.errors import ConfigError
from dynemb.models.dlrm import DLRM
from dynemb.planner import Plan
from dynemb.train.config import (
    DataConfig, DenseOptimizer, EmbeddingConfig, SparseOptimizer, TrainConfig,
)
from dynemb.train.parallel import Env, broadcast_parameters
from dynemb.train.planning import apply_plan, needs_planning, plan_tables

logger = logging.getLogger(__name__)

MIN_TABLE_ROWS = 1024


def make_source(config: DataConfig) -> DataSource:
    """The data source ``config.source`` names."""
    if config.source == "movielens-100k":
        return MovieLens100K(split=config.split, eval_fraction=config.eval_fraction,
                             seed=config.seed, count_features=config.count_features)
    if config.source == "synthetic":
        return SyntheticData(config.synthetic)
    return CriteoTSV(config.source.split(":", 1)[1], eval_fraction=config.eval_fraction)


def sparse_optimizer(config: EmbeddingConfig) -> OptimizerConfig:
    """The fused row optimizer of every table."""
    kinds = {SparseOptimizer.SGD: SGD, SparseOptimizer.ADAGRAD: Adagrad,
             SparseOptimizer.ROWWISE_ADAGRAD: RowWiseAdagrad, SparseOptimizer.ADAM: Adam}
    return kinds[config.optimizer](lr=config.lr, weight_decay=config.weight_decay)


def table_rows(config: EmbeddingConfig, num_ids: int | None) -> int:
    """A table's capacity: ``config.capacity``, or twice the known number of ids (at least
    MIN_TABLE_ROWS) when that is smaller."""
    if num_ids is None:
        return config.capacity
    return min(config.capacity, max(MIN_TABLE_ROWS, 2 * num_ids))


def table_configs(config: TrainConfig, source: DataSource) -> list[TableConfig]:
    """One table per sparse feature, named after it, with the settings of ``embeddings`` and
    of its entries in ``embeddings.tables``, and the configured storage (left to the planner
    where it is ``auto`` or its cache_load_factor is null).

    Raises:
        ConfigError: an entry of ``embeddings.tables`` matches no feature, or a table's
            settings do not make a valid table (naming it).
    """
    config.embeddings.check_matches([f.name for f in source.features])
    out = []
    for f in source.features:
        emb, dim = config.embeddings.for_table(f.name)
        if emb.ddr_path != config.embeddings.ddr_path and not emb.table_storage().planned:
            raise ConfigError(f"table {f.name!r}: a ddr_path of its own ({emb.ddr_path!r}) "
                              "with its storage left to the planner, which budgets the ddr "
                              "tier of embeddings.ddr_path only; pin its storage and "
                              "cache_load_factor, or set embeddings.ddr_path.")
        admission = (Admission(threshold=emb.admission_threshold)
                     if emb.admission_threshold > 1 else None)
        out.append(TableConfig(
            name=f.name, dim=dim or config.model.embedding_dim, features=[f.name],
            capacity=table_rows(emb, f.num_ids), optimizer=sparse_optimizer(emb),
            score=emb.score, pooling=emb.pooling, admission=admission,
            initializer=Initializer(std=emb.init_std), on_full=emb.on_full,
            routing=emb.routing, id_range=_id_range(emb, f.num_ids),
            storage=emb.table_storage(), threads=emb.threads))
    return out


def _id_range(emb: EmbeddingConfig, num_ids: int | None) -> int | None:
    """CONTINUOUS routing's id range: the feature's number of ids (ids are 0..n-1 there)."""
    return num_ids if emb.routing == Routing.CONTINUOUS else None


def build_model(config: TrainConfig, source: DataSource, env: Env,
                plan: Plan | None = None) -> DLRM:
    """The DLRM on ``env.device``; under torchrun its tables are sharded row-wise over the
    ranks and its dense layers start equal on every rank (collective).

    Args:
        plan: places the tables left to the planner (checked against them). None: in one
            process they are planned here (:func:`dynemb.train.planning.plan_tables`, profiled
            on the first training batches); under torchrun a plan is required, made once for
            every rank (``dynemb train`` makes it on rank 0 and shares it).
    Raises:
        ConfigError: a table is left to the planner and there is no plan (under torchrun), or
            the plan does not fit the tables.
    """
    tables = table_configs(config, source)
    if plan is None and needs_planning(tables):
        if env.distributed:
            raise ConfigError("build_model: tables are left to the planner "
                              f"({[t.name for t in tables if not t.storage.planned]}); expected "
                              "a plan made once for every rank (dynemb.train.planning.settle "
                              "on rank 0, shared), or a planned storage.")
        plan, _ = plan_tables(config, tables, source, world_size=1)
    if plan is not None:
        tables = apply_plan(plan, tables, "the plan")
    torch.manual_seed(config.seed)
    model = DLRM(dense_dim=len(source.dense_names), tables=tables,
                 interaction_dim=config.model.embedding_dim,
                 bottom_mlp=config.model.bottom_mlp, top_mlp=config.model.top_mlp,
                 device=env.device, backend=config.embeddings.backend)
    if env.distributed:
        model.embeddings = shard(model.embeddings)
        broadcast_parameters(env, model)
    return model


def dense_optimizer(config: TrainConfig, model: DLRM) -> torch.optim.Optimizer:
    """The torch optimizer of the model's dense parameters."""
    cfg = config.dense_optimizer
    kinds = {DenseOptimizer.SGD: torch.optim.SGD, DenseOptimizer.ADAGRAD: torch.optim.Adagrad,
             DenseOptimizer.ADAM: torch.optim.Adam}
    return kinds[cfg.name](model.dense_parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
