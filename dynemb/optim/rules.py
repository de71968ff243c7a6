"""The fused sparse optimizers: what state a row carries and how a gradient updates it.

A row is ``[embedding (dim) | state (state_width)]``. ``RowOptimizer.apply`` takes the summed
gradient of each unique key (U, dim) and updates those rows in place through the table's kernel
backend; hyper-parameters and bias corrections are computed here, once per step.
"""

from __future__ import annotations

import math

import torch

from dynemb.config import SGD, Adagrad, Adam, OptimizerConfig, RowWiseAdagrad
from dynemb.errors import ConfigError


def state_width(config: OptimizerConfig, dim: int) -> int:
    """Float32 elements of optimizer state per row."""
    kind = type(config)
    if kind is SGD:
        return 0
    if kind is Adagrad:
        return dim
    if kind is RowWiseAdagrad:
        return 1
    if kind is Adam:
        return 2 * dim
    raise ConfigError(f"optimizer: expected SGD, Adagrad, RowWiseAdagrad or Adam, found {kind.__name__}.")


def grad_norm_sq(grads: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm (float64 scalar tensor) of the rows of ``grads`` (U, dim) that are
    ``valid`` (U,) bool and finite: a row holding NaN or inf never enters a clipping norm (it is
    skipped, refused or applied as it is, by ``TableConfig.nonfinite``), so it cannot turn the
    norm into NaN and switch clipping off for the finite rows."""
    rows = grads[valid].double()
    total = rows.pow(2).sum()  # finite float32 values cannot overflow this float64 sum
    if bool(torch.isfinite(total)):
        return total
    return rows[torch.isfinite(rows).all(dim=1)].pow(2).sum()


def clip_scale(max_norm: float, norm_sq: float) -> float:
    """The factor (at most 1) that brings a gradient of squared norm ``norm_sq`` to
    ``max_norm``; 1.0 when it is already within."""
    return min(1.0, max_norm / (math.sqrt(norm_sq) + 1e-6))


class RowOptimizer:
    """Applies one optimizer config to rows; counts its own global step (Adam, Adagrad decay)."""

    def __init__(self, config: OptimizerConfig, dim: int) -> None:
        self.config = config
        self.dim = dim
        self.state_width = state_width(config, dim)
        self.initial_state = (config.initial_accumulator_value
                              if isinstance(config, Adagrad) else 0.0)
        self.step = 0

    def clip(self, grads: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``grads`` scaled so the L2 norm of its valid, finite rows is at most max_grad_norm
        (a new tensor when scaled: the caller's stays as it was)."""
        max_norm = self.config.max_grad_norm
        if max_norm is None:
            return grads
        scale = clip_scale(max_norm, float(grad_norm_sq(grads, valid)))
        return grads * scale if scale < 1.0 else grads

    def kernel_args(self, t: int) -> tuple[str, tuple[float, ...]]:
        """(kernel name, hyper-parameters) of optimizer step ``t`` (1 for the first): the
        learning rate decayed and Adam's bias corrections folded in."""
        c = self.config
        kind = type(c)
        if kind is SGD:
            return "sgd", (c.lr, c.weight_decay)
        if kind in (Adagrad, RowWiseAdagrad):
            clr = c.lr / (1.0 + (t - 1) * c.lr_decay)
            return ("adagrad" if kind is Adagrad else "rowwise_adagrad"), (clr, c.eps,
                                                                            c.weight_decay)
        b1, b2 = c.betas
        step_size = c.lr * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        return "adam", (step_size, b1, b2, c.eps, c.weight_decay)

    def apply(self, parts, grads: torch.Tensor, *, clip: bool = True) -> None:
        """One update (one optimizer step) of the rows of unique keys.

        Args:
            parts: ``(backend, rows, slots)`` per row store (a table's tiers): ``slots`` (U,)
                int64 rows of ``rows`` to update, -1 where the entry is not in that store.
            grads: (U, dim) float32 summed gradient per entry, shared by the parts.
            clip: clip to ``max_grad_norm`` first, by the norm of the rows it updates (a
                sharded table is clipped over all shards before this call and passes False).
        """
        self.step += 1
        if clip:
            valid = parts[0][2] >= 0
            for _, _, slots in parts[1:]:
                valid = valid | (slots.to(valid.device) >= 0)
            grads = self.clip(grads, valid)
        name, args = self.kernel_args(self.step)
        for backend, rows, slots in parts:
            g = grads
            if rows.device != grads.device:  # a host tier of a GPU table: move its rows only
                ok = slots >= 0
                slots, g = slots[ok], grads[ok.to(grads.device)]
            backend.optimizer(name)(rows, slots, g.to(rows.device), *args)
