"""Row optimizers fused into backward: state width, initial state and update rule."""

from dynemb.optim.rules import RowOptimizer, state_width

__all__ = ["RowOptimizer", "state_width"]
