"""AUC against a brute-force pairwise count (ties count one half) and log loss against torch."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.train.metrics import log_loss, roc_auc


def brute_force_auc(scores: list[float], labels: list[int]) -> float:
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=2, max_size=60))
def test_auc_equals_the_pairwise_count_with_ties(pairs):
    scores = [s / 3.0 for s, _ in pairs]  # few distinct values: many ties
    labels = [int(y) for _, y in pairs]
    got = roc_auc(torch.tensor(scores), torch.tensor(labels))
    if 0 < sum(labels) < len(labels):
        assert got == pytest.approx(brute_force_auc(scores, labels), abs=1e-12)
    else:
        assert math.isnan(got)


def test_auc_on_continuous_scores_and_extremes():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(500, generator=g)
    labels = (torch.rand(500, generator=g) < scores).float()
    assert roc_auc(scores, labels) == pytest.approx(
        brute_force_auc(scores.tolist(), labels.long().tolist()), abs=1e-12)
    assert roc_auc(labels, labels) == 1.0
    assert roc_auc(-labels, labels) == 0.0
    assert roc_auc(torch.ones(10), labels[:10]) == 0.5
    with pytest.raises(ValueError, match="3 scores but 2 labels"):
        roc_auc(torch.zeros(3), torch.zeros(2))


def test_log_loss_matches_torch():
    g = torch.Generator().manual_seed(1)
    p = torch.rand(100, generator=g)
    y = (torch.rand(100, generator=g) < 0.5).float()
    want = torch.nn.functional.binary_cross_entropy(p.double(), y.double())
    assert log_loss(p, y) == pytest.approx(float(want), rel=1e-9)
    assert log_loss(torch.tensor([1.0]), torch.tensor([0.0])) == pytest.approx(-math.log(1e-7))
    assert math.isnan(log_loss(torch.zeros(0), torch.zeros(0)))
