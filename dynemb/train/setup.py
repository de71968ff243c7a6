"""Building a run from its config: the data source, the tables, the DLRM (sharded under
torchrun) and the dense optimizer."""

from __future__ import annotations

import logging

import torch

from dynemb.config import (
    SGD, Adagrad, Adam, Admission, Initializer, OptimizerConfig, RowWiseAdagrad, TableConfig,
)
from dynemb.data.base import DataSource
from dynemb.data.criteo import CriteoTSV
from dynemb.data.movielens import MovieLens100K
from dynemb.data.synthetic import SyntheticData
from dynemb.distributed import shard
from dynemb.models.dlrm import DLRM
from dynemb.train.config import (
    DataConfig, DenseOptimizer, EmbeddingConfig, SparseOptimizer, TrainConfig,
)
from dynemb.train.parallel import Env, broadcast_parameters

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
    """One table per sparse feature, named after it."""
    emb = config.embeddings
    admission = (Admission(threshold=emb.admission_threshold)
                 if emb.admission_threshold > 1 else None)
    return [TableConfig(name=f.name, dim=config.model.embedding_dim, features=[f.name],
                        capacity=table_rows(emb, f.num_ids), optimizer=sparse_optimizer(emb),
                        score=emb.score, pooling=emb.pooling, admission=admission,
                        initializer=Initializer(std=emb.init_std), on_full=emb.on_full)
            for f in source.features]


def build_model(config: TrainConfig, source: DataSource, env: Env) -> DLRM:
    """The DLRM on ``env.device``; under torchrun its tables are sharded row-wise over the
    ranks and its dense layers start equal on every rank (collective)."""
    torch.manual_seed(config.seed)
    model = DLRM(dense_dim=len(source.dense_names), tables=table_configs(config, source),
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
