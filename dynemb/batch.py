"""SparseBatch: jagged ids per feature in one feature-major layout.

For F features and batch size B: ``values`` (N,) int64 holds every id, feature after feature and
sample after sample; ``lengths`` (F·B,) the bag length of each (feature, sample); ``weights``
(N,) float, optional, one per id. Validated on construction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dynemb.errors import ConfigError, InputError

EMPTY_KEY = -(1 << 63)
"""The reserved key (int64 minimum) that marks an empty slot; it can never be an id."""


def check_keys(keys: torch.Tensor, where: str) -> None:
    """Raises InputError unless ``keys`` is a 1-D int64 tensor free of the reserved key."""
    if not isinstance(keys, torch.Tensor):
        raise InputError(f"{where}: expected ids as a torch.Tensor, found {type(keys).__name__}.")
    if keys.dtype != torch.int64:
        raise InputError(f"{where}: expected int64 ids, found {keys.dtype}; "
                         "convert integer ids with .long() (float or bool ids are not ids).")
    if keys.dim() != 1:
        raise InputError(f"{where}: expected a 1-D tensor of ids, found shape {tuple(keys.shape)}.")
    if keys.numel() and int(keys.min()) == EMPTY_KEY:  # (the int64 minimum: a min finds it)
        raise InputError(f"{where}: found the reserved empty key {EMPTY_KEY} (int64 minimum) "
                         "among the ids; map it to another id before lookup.")


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of the float tensor ``t`` is finite. One sum first (a NaN or inf
    anywhere makes it non-finite, and on one CPU thread it costs a fortieth of ``isfinite``
    over every element); the element-wise test only when the sum is not finite (also reached
    by finite values whose sum overflows)."""
    return t.numel() == 0 or bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def check_lengths(lengths: torch.Tensor, n: int, where: str,
                  features: Sequence[str] | None = None) -> None:
    """Raises InputError unless every bag length is in ``[0, n]`` and they sum to ``n`` ids.

    Each length's range is checked before summing: int64 lengths such as ``[2**62, 2**62,
    2**62, 2**62 + 5]`` wrap around to a sum of 5, and a kernel trusting them would read far
    outside the ids. ``features`` (F names, lengths feature-major F·B) only names the culprit.
    """
    if lengths.numel() == 0:
        total, approx = 0, 0.0
    else:
        low, high = torch.aminmax(lengths)
        if int(low) < 0 or int(high) > n:
            i = int(torch.nonzero((lengths < 0) | (lengths > n))[0, 0])
            at = f"entry {i}"
            if features:
                batch = lengths.numel() // len(features)
                at = f"feature {features[i // batch]!r}, sample {i % batch}"
            raise InputError(f"{where}: {at}: length {int(lengths[i])}; expected a length in "
                             f"[0, {n}] (the number of ids) for every bag.")
        total = int(lengths.sum())
        # Each term is in [0, n]: an int64 sum that wrapped means a true sum >= 2**63 > 1.5 n +
        # 1, which the float64 sum (relative error far below 1/3 here) cannot hide; a sum of
        # fewer than 2**62 / n terms cannot wrap.
        wraps = lengths.numel() * max(n, 1) >= 1 << 62
        approx = float(lengths.sum(dtype=torch.float64)) if wraps else float(total)
    if total != n or approx > 1.5 * n + 1:
        shown = total if approx <= 1.5 * n + 1 else f"about {approx:.4g}"
        raise InputError(f"{where}: lengths sum to {shown} but there are {n} ids; expected "
                         "them equal.")


CHANGED_BATCH = "was the SparseBatch changed after it was built? build a new one"


def check_table_lengths(lengths: torch.Tensor, n: int, table: str) -> None:
    """:func:`check_lengths` of one table's bags against its ``n`` ids, naming the table and
    the likely cause (a batch whose tensors were changed after it was validated)."""
    check_lengths(lengths, n, f"table {table!r}: the batch's lengths no longer match its ids "
                  f"({CHANGED_BATCH})")


FEATURE_POLICIES = ("strict", "ignore")
"""What a collection does with batch features none of its tables reads: refuse the batch
(``strict``, the default) or skip them (``ignore``, as torchrec does)."""


def check_feature_policy(policy: object, who: str) -> str:
    """``policy`` if it is one of FEATURE_POLICIES, else ConfigError naming ``who``."""
    if policy not in FEATURE_POLICIES:
        raise ConfigError(f"{who}: feature_policy must be one of {list(FEATURE_POLICIES)}, found "
                          f"{policy!r}.")
    return policy


class SparseBatch:
    """Jagged ids of F features for a batch of B samples.

    Args:
        features: feature names, in the order of the layout (distinct).
        values: (N,) int64 ids.
        lengths: (F·B,) int bag lengths, feature-major: lengths[f·B + b].
        weights: optional (N,) float per-id weights (finite).
    """

    def __init__(self, *, features: Sequence[str], values: torch.Tensor, lengths: torch.Tensor,
                 weights: torch.Tensor | None = None) -> None:
        if isinstance(features, str):
            raise InputError(f"SparseBatch: expected a list of feature names, found the string "
                             f"{features!r}; write features=[{features!r}].")
        self.features = tuple(features)
        self.values = values
        self.lengths = lengths
        self.weights = weights
        self._validate()
        self.batch_size = lengths.numel() // len(self.features) if self.features else 0
        per_feature = lengths.view(len(self.features), self.batch_size).sum(dim=1)
        self.feature_offsets: tuple[int, ...] = (0, *torch.cumsum(per_feature, 0).tolist())
        """(F + 1,) where each feature's ids start in ``values``, then N."""

    def _validate(self) -> None:
        names, values, lengths, weights = self.features, self.values, self.lengths, self.weights
        if not names or not all(isinstance(f, str) and f for f in names):
            raise InputError(f"SparseBatch: expected a non-empty list of feature names, found {names!r}.")
        if len(set(names)) != len(names):
            raise InputError(f"SparseBatch: feature names must be distinct, found {names!r}.")
        if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1 or lengths.dtype.is_floating_point \
                or lengths.dtype == torch.bool:
            raise InputError("SparseBatch: expected lengths as a 1-D integer tensor, found "
                             f"{getattr(lengths, 'dtype', type(lengths).__name__)} "
                             f"of shape {tuple(getattr(lengths, 'shape', ()))}.")
        if lengths.numel() % len(names):
            raise InputError(f"SparseBatch: lengths has {lengths.numel()} entries, expected a "
                             f"multiple of the {len(names)} features (F·B, feature-major).")
        check_keys(values, "SparseBatch.values")
        check_lengths(lengths, values.numel(), "SparseBatch", names)
        per_sample = lengths.view(len(names), lengths.numel() // len(names))
        if weights is not None:
            self._validate_weights(weights, per_sample)

    def _validate_weights(self, weights: torch.Tensor, per_sample: torch.Tensor) -> None:
        if not isinstance(weights, torch.Tensor) or not weights.dtype.is_floating_point:
            raise InputError("SparseBatch: expected float weights, found "
                             f"{getattr(weights, 'dtype', type(weights).__name__)}.")
        if weights.shape != self.values.shape:
            raise InputError(f"SparseBatch: weights have shape {tuple(weights.shape)}, expected "
                             f"{tuple(self.values.shape)} (one per id).")
        as_used = weights.to(torch.float32)  # finite as the kernels use them
        if not all_finite(as_used):
            i = int(torch.nonzero(~torch.isfinite(as_used))[0])
            ends = torch.cumsum(per_sample.sum(dim=1), 0)
            f = int(torch.searchsorted(ends, torch.tensor(i, device=ends.device), right=True))
            raise InputError(f"SparseBatch: feature {self.features[f]!r}: weight {i} is "
                             f"{float(weights[i])}; weights must be finite as float32 (at most "
                             "about 3.4e38 in magnitude).")

    @classmethod
    def from_dict(cls, ids: Mapping[str, Sequence[Sequence[int]]],
                  weights: Mapping[str, Sequence[Sequence[float]]] | None = None) -> SparseBatch:
        """Builds a batch from ``{feature: [bag of ids per sample]}`` (same B for every feature).

        ``weights``, if given, has the same features and shapes as ``ids``.
        """
        names = list(ids)
        sizes = {name: len(bags) for name, bags in ids.items()}
        if len(set(sizes.values())) > 1:
            raise InputError(f"SparseBatch.from_dict: features have different batch sizes {sizes}.")
        if weights is not None and set(weights) != set(names):
            raise InputError(f"SparseBatch.from_dict: weights have features {sorted(weights)}, "
                             f"expected {sorted(names)}.")
        for name in names if weights is not None else ():
            if len(weights[name]) != sizes[name]:
                raise InputError(f"SparseBatch.from_dict: feature {name!r} has {sizes[name]} bags "
                                 f"of ids but {len(weights[name])} bags of weights.")
        flat: list[int] = []
        flat_w: list[float] = []
        lengths: list[int] = []
        for name in names:
            for b, bag in enumerate(ids[name]):
                bag = list(bag)
                if not all(isinstance(i, int) and not isinstance(i, bool)
                           and -(1 << 63) <= i < (1 << 63) for i in bag):
                    raise InputError(f"SparseBatch.from_dict: feature {name!r}, sample {b}: "
                                     f"expected int64 ids, found {bag!r}.")
                flat.extend(bag)
                lengths.append(len(bag))
                if weights is not None:
                    w = list(weights[name][b])
                    if len(w) != len(bag):
                        raise InputError(f"SparseBatch.from_dict: feature {name!r}, sample {b}: "
                                         f"{len(w)} weights for {len(bag)} ids.")
                    flat_w.extend(w)
        return cls(features=names, values=torch.tensor(flat, dtype=torch.int64),
                   lengths=torch.tensor(lengths, dtype=torch.int64),
                   weights=None if weights is None else torch.tensor(flat_w, dtype=torch.float32))

    def to(self, device: torch.device | str) -> SparseBatch:
        """A copy on ``device``. It is not validated again (on a GPU that would wait for the
        device several times): this batch was, when it was built."""
        out = object.__new__(SparseBatch)
        out.features, out.batch_size = self.features, self.batch_size
        out.feature_offsets = self.feature_offsets
        out.values, out.lengths = self.values.to(device), self.lengths.to(device)
        out.weights = None if self.weights is None else self.weights.to(device)
        return out

    @classmethod
    def from_kjt(cls, kjt: Any) -> SparseBatch:
        """The batch of a torchrec ``KeyedJaggedTensor`` (lengths or offsets, int32 or int64;
        ids become int64, weights float32). Needs torchrec only to have made ``kjt``."""
        from dynemb.interop import batch_from_kjt  # noqa: PLC0415  (torchrec is optional)

        return batch_from_kjt(kjt)

    def to_kjt(self) -> Any:
        """This batch as a torchrec ``KeyedJaggedTensor`` (needs torchrec)."""
        from dynemb.interop import batch_to_kjt  # noqa: PLC0415  (torchrec is optional)

        return batch_to_kjt(self)

    def select(self, features: Sequence[str]) -> SparseBatch:
        """The batch of ``features`` only, in that order (this batch itself if they are its
        features in its order). Ids, lengths and weights are copied; the weights keep their
        autograd history, so a gradient reaches this batch's weights.

        Raises:
            InputError: a feature the batch does not have (named), or repeated names.
        """
        if isinstance(features, str):
            raise InputError(f"SparseBatch.select: expected a list of feature names, found the "
                             f"string {features!r}; write [{features!r}].")
        names = tuple(features)
        if names == self.features:
            return self
        missing = [f for f in names if f not in self.features]
        if missing:
            raise InputError(f"SparseBatch.select: the batch has no feature(s) {missing}; it "
                             f"has {list(self.features)}.")
        parts = [self.feature(f) for f in names]
        values = torch.cat([p[0] for p in parts]) if parts else self.values[:0]
        lengths = torch.cat([p[1] for p in parts]) if parts else self.lengths[:0]
        weights = None if self.weights is None else (
            torch.cat([p[2] for p in parts]) if parts else self.weights[:0])
        return SparseBatch(features=names, values=values, lengths=lengths, weights=weights)

    def require_features(self, expected: tuple[str, ...], who: str,
                         policy: str = "strict") -> SparseBatch:
        """The batch a module of the ``expected`` features reads: this batch if it has exactly
        those features (in any order); with ``policy="ignore"``, the batch of those features
        (:meth:`select`) if it has more. Raises InputError naming ``who`` otherwise."""
        unknown = sorted(set(self.features) - set(expected))
        missing = sorted(set(expected) - set(self.features))
        if missing or (unknown and policy != "ignore"):
            hint = "" if missing or not unknown else (
                " (build the module with feature_policy=\"ignore\" to skip the features it "
                "does not use, or pass batch.select(features))")
            raise InputError(f"{who}: batch features do not match the tables: unknown {unknown}, "
                             f"missing {missing}; expected {list(expected)}{hint}.")
        return self.select(expected) if unknown else self

    def feature(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(values, lengths (B,), weights or None) of one feature."""
        if name not in self.features:
            raise InputError(f"SparseBatch: no feature {name!r}; the batch has {list(self.features)}.")
        f = self.features.index(name)
        lo, hi = self.feature_offsets[f], self.feature_offsets[f + 1]
        lengths = self.lengths[f * self.batch_size:(f + 1) * self.batch_size]
        weights = None if self.weights is None else self.weights[lo:hi]
        return self.values[lo:hi], lengths, weights

    def __repr__(self) -> str:
        return (f"SparseBatch(features={list(self.features)}, batch_size={self.batch_size}, "
                f"num_ids={self.values.numel()}, weighted={self.weights is not None})")
