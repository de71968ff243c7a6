"""``dynemb train``: configuration, the training loop, evaluation metrics.

::

    from dynemb.train import TrainConfig, train
    metrics = train(TrainConfig(steps=1250))            # MovieLens 100K, runs/movielens-100k/
"""

from dynemb.train.config import (
    DataConfig, DenseOptimizer, DenseOptimizerConfig, EmbeddingConfig, ModelConfig,
    PipelineConfig, SparseOptimizer, TrainConfig,
)
from dynemb.train.config_io import dump_yaml, from_dict, load, to_dict
from dynemb.train.loop import train
from dynemb.train.metrics import log_loss, roc_auc
from dynemb.train.pipelines import KINDS as PIPELINES, Step, TrainPipeline, pipeline
from dynemb.train.report import format_summary

__all__ = [
    "DataConfig", "DenseOptimizer", "DenseOptimizerConfig", "EmbeddingConfig", "ModelConfig",
    "PIPELINES", "PipelineConfig", "SparseOptimizer", "Step", "TrainConfig", "TrainPipeline", "dump_yaml",
    "format_summary", "from_dict", "load", "log_loss", "pipeline", "roc_auc", "to_dict", "train",
]
