"""Reference models built on dynemb's tables."""

from dynemb.models.dlrm import DLRM, mlp, pairwise_dots

__all__ = ["DLRM", "mlp", "pairwise_dots"]
