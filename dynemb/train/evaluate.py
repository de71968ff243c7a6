"""Scoring a model on a stream of batches: AUC and log loss over the samples of every rank.

Sharded lookups are collective, so the ranks step through evaluation together: a rank whose
part is used up feeds empty batches until every rank is done.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from dynemb.batch import SparseBatch
from dynemb.data.base import Batch, DataSource
from dynemb.models.dlrm import DLRM
from dynemb.train.metrics import log_loss, roc_auc
from dynemb.train.parallel import Env, all_gather_cat, any_rank


def _next(batches: Iterator[Batch], taken: int, limit: float) -> Batch | None:
    if taken >= limit:
        return None
    batch = next(batches, None)
    if batch is not None and taken + batch.size > limit:  # keep exactly ``limit`` samples
        keep = int(limit - taken)
        return None if keep <= 0 else _head(batch, keep)
    return batch


def _head(batch: Batch, n: int) -> Batch:
    """The first ``n`` samples of ``batch``."""
    sp = batch.sparse
    lengths = sp.lengths.view(len(sp.features), sp.batch_size)
    values = [sp.feature(f)[0][:int(lengths[i, :n].sum())] for i, f in enumerate(sp.features)]
    sparse = SparseBatch(features=sp.features, values=torch.cat(values),
                         lengths=lengths[:, :n].reshape(-1).contiguous())
    prob = None if batch.true_prob is None else batch.true_prob[:n]
    return Batch(dense=batch.dense[:n], sparse=sparse, labels=batch.labels[:n], true_prob=prob)


@torch.no_grad()
def predict(model: DLRM, batches: Iterator[Batch], source: DataSource, env: Env,
            limit: float = math.inf) -> dict[str, torch.Tensor]:
    """Click probabilities of this rank's samples, gathered from every rank.

    Args:
        model: the model (put in eval mode meanwhile: tables neither insert nor update).
        batches: this rank's batches.
        source: gives the empty batch a finished rank feeds.
        env: the job.
        limit: samples of this rank to score at most.
    Returns:
        ``{"prob": (n,), "label": (n,), "true_prob": (n,) (if the source knows it)}``, float32
        on the CPU, every rank's samples in rank order.
    """
    was_training = model.training
    model.eval()
    probs, labels, true = [], [], []
    taken = 0
    try:
        while True:
            batch = _next(batches, taken, limit)
            if env.distributed:
                if not any_rank(env, batch is not None):
                    break
                batch = batch if batch is not None else source.empty()
            elif batch is None:
                break
            taken += batch.size
            batch = batch.to(env.device)
            probs.append(torch.sigmoid(model(batch.dense, batch.sparse)).float())
            labels.append(batch.labels)
            if batch.true_prob is not None:
                true.append(batch.true_prob)
    finally:
        model.train(was_training)
    out = {"prob": torch.cat(probs) if probs else torch.zeros(0),
           "label": torch.cat(labels) if labels else torch.zeros(0)}
    if source.has_true_prob:
        out["true_prob"] = torch.cat(true) if true else torch.zeros(0)
    return {k: all_gather_cat(env, v.to(env.device)).cpu() for k, v in out.items()}


def score(predictions: dict[str, torch.Tensor]) -> dict[str, float]:
    """AUC, log loss, sample count and positive rate of gathered predictions (and the best
    achievable AUC and log loss when the true probabilities are known)."""
    prob, label = predictions["prob"], predictions["label"]
    out = {"auc": roc_auc(prob, label), "log_loss": log_loss(prob, label),
           "samples": int(label.numel()),
           "positive_rate": float(label.mean()) if label.numel() else math.nan}
    if "true_prob" in predictions:
        out["best_auc"] = roc_auc(predictions["true_prob"], label)
        out["best_log_loss"] = log_loss(predictions["true_prob"], label)
    return out


def evaluate(model: DLRM, source: DataSource, env: Env, *, batch_size: int,
             max_samples: int = 0) -> dict[str, float]:
    """Scores the held-out samples (at most ``max_samples`` over all ranks; 0: all)."""
    per_rank = max(1, batch_size // env.world_size)
    limit = math.inf if max_samples == 0 else math.ceil(max_samples / env.world_size)
    batches = source.eval_batches(per_rank, rank=env.rank, world_size=env.world_size)
    return score(predict(model, batches, source, env, limit))


def evaluate_train(model: DLRM, source: DataSource, env: Env, *, batch_size: int,
                   samples: int) -> dict[str, float]:
    """Scores the first ``samples`` training samples (the train AUC and log loss)."""
    per_rank = max(1, batch_size // env.world_size)
    batches = source.train_sample_batches(per_rank, samples, rank=env.rank,
                                          world_size=env.world_size)
    return score(predict(model, batches, source, env))
