"""Click-model metrics in torch: ROC AUC (tie-aware) and log loss."""

from __future__ import annotations

import math

import torch


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the probability that a random positive scores above a random
    negative, ties counting one half (the Mann-Whitney U statistic over P·N).

    Computed from average ranks: sort the scores, give each group of tied scores the mean of
    its ranks, and ``AUC = (Σ ranks of positives − P(P+1)/2) / (P·N)``. O(n log n).

    Args:
        scores: (n,) float scores or probabilities (any monotone transform gives the same AUC).
        labels: (n,) labels, 1 (or True) for positives and 0 for negatives.
    Returns:
        The AUC, or NaN when there is no positive or no negative.
    """
    scores = scores.detach().reshape(-1).double().cpu()
    labels = labels.detach().reshape(-1).cpu() > 0.5
    if scores.numel() != labels.numel():
        raise ValueError(f"roc_auc: {scores.numel()} scores but {labels.numel()} labels.")
    positives = int(labels.sum())
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        return math.nan
    sorted_scores, order = torch.sort(scores)
    _, counts = torch.unique_consecutive(sorted_scores, return_counts=True)
    ends = torch.cumsum(counts, 0).double()  # 1-based rank of each group's last member
    mean_rank = ends - (counts.double() - 1.0) / 2.0
    ranks = torch.repeat_interleave(mean_rank, counts)
    rank_sum = float(ranks[labels[order]].sum())
    return (rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives)


def log_loss(probs: torch.Tensor, labels: torch.Tensor, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities (clipped to [eps, 1 − eps]); NaN if empty."""
    probs = probs.detach().reshape(-1).double().cpu().clamp(eps, 1.0 - eps)
    labels = labels.detach().reshape(-1).double().cpu()
    if probs.numel() == 0:
        return math.nan
    loss = -(labels * torch.log(probs) + (1.0 - labels) * torch.log1p(-probs))
    return float(loss.mean())
