"""Evaluation: a sample limit is exact, and scores carry the best achievable AUC when the
source knows the true probabilities."""

from __future__ import annotations

import torch

from dynemb.data import SyntheticConfig, SyntheticData
from dynemb.train import TrainConfig
from dynemb.train.evaluate import _head, evaluate, evaluate_train
from dynemb.train.parallel import Env
from dynemb.train.setup import build_model

ENV = Env(rank=0, world_size=1, device=torch.device("cpu"))


def _setup():
    cfg = TrainConfig()
    data = SyntheticData(SyntheticConfig(num_dense=2, num_sparse=3, vocab_sizes=50,
                                         eval_samples=3000))
    return build_model(cfg, data, ENV), data


def test_limits_are_exact_and_best_auc_is_reported():
    model, data = _setup()
    full = evaluate(model, data, ENV, batch_size=1000)
    assert full["samples"] == 3000 and 0.5 < full["best_auc"] <= 1.0
    part = evaluate(model, data, ENV, batch_size=1000, max_samples=1234)
    assert part["samples"] == 1234
    train = evaluate_train(model, data, ENV, batch_size=512, samples=700)
    assert train["samples"] == 700 and set(train) >= {"auc", "log_loss", "positive_rate"}
    assert model.training  # restored after evaluation


def test_head_keeps_the_first_samples():
    data = SyntheticData(SyntheticConfig(num_dense=2, num_sparse=3, vocab_sizes=50))
    batch = next(data.train_batches(10))
    head = _head(batch, 4)
    assert head.size == 4 and torch.equal(head.dense, batch.dense[:4])
    for f in batch.sparse.features:
        assert torch.equal(head.sparse.feature(f)[0], batch.sparse.feature(f)[0][:4])
    assert torch.equal(head.true_prob, batch.true_prob[:4])
