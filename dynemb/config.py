"""What the user chooses: frozen, validated configuration dataclasses and enums.

Every dataclass is ``frozen=True, kw_only=True`` and validates itself in ``__post_init__``; a bad
value raises :class:`dynemb.errors.ConfigError` naming the field, the value and the valid range.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, field

from dynemb.errors import ConfigError


class ScorePolicy(str, enum.Enum):
    """How a row's score is kept; the lowest score in a full bucket is evicted first.

    LRU: the table step of the last lookup. LFU: the number of lookups (occurrences).
    STEP: the table step of the last write (insert or optimizer update). CUSTOM: scores given by
    the caller; a new key enters a full bucket only if its score is at least the lowest one.
    NO_EVICTION: scores kept as for LRU, but a full bucket never evicts: the insert fails.
    """

    LRU = "lru"
    LFU = "lfu"
    STEP = "step"
    CUSTOM = "custom"
    NO_EVICTION = "no_eviction"


class PoolingMode(str, enum.Enum):
    """How a bag's rows are reduced. MEAN divides the (weighted) sum by the bag length."""

    SUM = "sum"
    MEAN = "mean"


class Routing(str, enum.Enum):
    """Which rank owns a key when a table is sharded row-wise over W ranks
    (:func:`dynemb.distributed.route` is the one implementation).

    CONTINUOUS: ``key // block`` for keys in ``[0, block·W)`` with ``block = ceil(id_range / W)``
    (needs ``TableConfig.id_range``); other keys fall back to ``key mod W``.
    ROUNDROBIN: ``key mod W``, the floor modulo (``-1`` goes to rank ``W - 1``).
    HASH_ROUNDROBIN: ``fmix64(key) mod W`` on the key's unsigned 64-bit pattern (MurmurHash3's
    64-bit finaliser): balanced for strided ids and ids with a type in their low bits.
    """

    CONTINUOUS = "continuous"
    ROUNDROBIN = "roundrobin"
    HASH_ROUNDROBIN = "hash_roundrobin"


class OnFull(str, enum.Enum):
    """What a lookup does when a key cannot get a row (full bucket, no eviction possible).

    RAISE: raise :class:`CapacityError`; the call is atomic and changes nothing in the table (no
    row inserted, evicted or assigned, no score touched, no admission counted; only
    ``TableStats.failed_inserts`` counts the failure). WARN: log a warning, count it in
    ``TableStats``, and give the key its eval-initializer row without updates; the call completes
    and returns every row it evicted. COUNT: the same without the warning.
    """

    RAISE = "raise"
    WARN = "warn"
    COUNT = "count"


class NonFinite(str, enum.Enum):
    """What a table's fused optimizer does with a row whose summed gradient holds NaN or inf.

    SKIP (the default): leave that row (and its optimizer state) as it was, update the others, and
    count the row in ``TableStats.nonfinite_grads``. RAISE: count them, update nothing in the
    table, and raise :class:`InputError` naming the table, its optimizer step and the count (a
    sharded table checks every shard first: every rank raises and no rank updates the table).
    APPLY: apply the update as computed (the row and its state become NaN/inf; counted too).
    Gradients are judged as float32, the dtype rows are updated in. Whatever the choice, the
    ``max_grad_norm`` clipping norm counts finite rows only, so one bad row cannot switch
    clipping off for the others.
    """

    RAISE = "raise"
    SKIP = "skip"
    APPLY = "apply"


class StorageMode(str, enum.Enum):
    """Where a table's rows live (see :class:`Storage`).

    HBM_ONLY: every row in the fast tier. HYBRID: rows hash-partitioned between the tiers, a
    fraction ``cache_load_factor`` of the slots in hbm. CACHING: a full backing store in ddr under
    an hbm cache of ``cache_load_factor`` of the rows (write-back). AUTO: the planner
    (``dynemb.planner.plan``) chooses the mode; a table cannot be built before it did.
    """

    HBM_ONLY = "hbm_only"
    HYBRID = "hybrid"
    CACHING = "caching"
    AUTO = "auto"


class InitKind(str, enum.Enum):
    """Initial-value distributions for new rows."""

    NORMAL = "normal"
    TRUNCATED_NORMAL = "truncated_normal"
    UNIFORM = "uniform"
    CONSTANT = "constant"


def _fail(owner: str, name: str, value: object, expected: str) -> None:
    raise ConfigError(f"{owner}.{name}: expected {expected}, found {value!r}.")


def _is_int(value: object) -> bool:
    """An int, not a bool (``True`` is an int to Python, never a size here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive(owner: str, name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        _fail(owner, name, value, "a finite number " + (">= 0" if allow_zero else "> 0"))


@dataclass(frozen=True, kw_only=True)
class Initializer:
    """Initial values of a row's embedding, deterministic per (seed, table, key).

    The same key gets the same initial row on any rank, world size and backend run.
    """

    kind: InitKind = InitKind.NORMAL
    """Distribution of each element."""
    mean: float = 0.0
    """NORMAL / TRUNCATED_NORMAL: the mean."""
    std: float = 0.01
    """NORMAL / TRUNCATED_NORMAL: the standard deviation (before truncation). Normal draws
    interpolate 2**16 quantiles; NORMAL is cut at ±6 std (2e-9 of the mass)."""
    bound: float = 2.0
    """TRUNCATED_NORMAL: values lie within mean ± bound·std."""
    low: float = -0.01
    """UNIFORM: the lower end."""
    high: float = 0.01
    """UNIFORM: the upper end."""
    value: float = 0.0
    """CONSTANT: the value of every element."""
    seed: int = 0
    """Mixed with the table name and the key; change it to draw other initial rows."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, InitKind):
            _fail("Initializer", "kind", self.kind, f"one of {[k.name for k in InitKind]}")
        for name in ("mean", "low", "high", "value"):
            if not math.isfinite(getattr(self, name)):
                _fail("Initializer", name, getattr(self, name), "a finite number")
        _check_positive("Initializer", "std", self.std, allow_zero=True)
        _check_positive("Initializer", "bound", self.bound)
        if self.high < self.low:
            _fail("Initializer", "high", self.high, f"high >= low ({self.low})")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            _fail("Initializer", "seed", self.seed, "an int in [0, 2**63)")


ZEROS = Initializer(kind=InitKind.CONSTANT, value=0.0)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Base of the fused sparse optimizers; rows are updated in backward, in place."""

    lr: float = 0.01
    """Learning rate (the default is torch.optim's for each optimizer)."""
    weight_decay: float = 0.0
    """L2 penalty added to the gradient of each updated row (``g + weight_decay * w``)."""
    max_grad_norm: float | None = None
    """If set, the table's per-key summed gradient is scaled so its total L2 norm is at most this
    (``torch.nn.utils.clip_grad_norm_`` applied to the table's gradient)."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_positive(owner, "lr", self.lr, allow_zero=True)
        _check_positive(owner, "weight_decay", self.weight_decay, allow_zero=True)
        if self.max_grad_norm is not None:
            _check_positive(owner, "max_grad_norm", self.max_grad_norm)


@dataclass(frozen=True, kw_only=True)
class SGD(OptimizerConfig):
    """Plain SGD: ``w -= lr * g`` (``torch.optim.SGD`` without momentum). No state."""

    lr: float = 0.001


@dataclass(frozen=True, kw_only=True)
class Adagrad(OptimizerConfig):
    """``torch.optim.Adagrad``: per-element sum of squared gradients; state width = dim."""

    lr_decay: float = 0.0
    """``lr / (1 + (t - 1) * lr_decay)`` with t the table's optimizer step."""
    eps: float = 1e-10
    """Added to the square root of the accumulator."""
    initial_accumulator_value: float = 0.0
    """Accumulator value of a new row."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive("Adagrad", "lr_decay", self.lr_decay, allow_zero=True)
        _check_positive("Adagrad", "eps", self.eps)
        _check_positive("Adagrad", "initial_accumulator_value", self.initial_accumulator_value,
                        allow_zero=True)


@dataclass(frozen=True, kw_only=True)
class RowWiseAdagrad(Adagrad):
    """Row-wise Adagrad: one accumulator per row, ``m += mean(g**2)``, ``w -= lr * g / (sqrt(m) + eps)``.

    State width 1. Defaults follow ``torch.optim.Adagrad`` (as torchrec's RowWiseAdagrad does).
    """


@dataclass(frozen=True, kw_only=True)
class Adam(OptimizerConfig):
    """The ``torch.optim.SparseAdam`` rule: lazy per-row moments, bias correction by the table's
    global optimizer step; state width = 2 * dim. ``weight_decay`` adds ``wd * w`` to the gradient
    (``torch.optim.Adam``'s L2 form)."""

    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates of the first and second moments."""
    eps: float = 1e-8
    """Added to the square root of the second moment."""

    def __post_init__(self) -> None:
        super().__post_init__()
        betas = self.betas
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
            _fail("Adam", "betas", betas, "two numbers in [0, 1)")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        _check_positive("Adam", "eps", self.eps)


@dataclass(frozen=True, kw_only=True)
class Admission:
    """Frequency admission: a key gets a row only once it was seen ``threshold`` times.

    Until then its lookups return the eval initializer and it gets no update. Counts live in a
    bounded counter table that evicts its least-counted keys when full.
    """

    threshold: int = 2
    """Occurrences (in training lookups) needed before a key gets a row."""
    counter_capacity: int = 1 << 16
    """Slots of the counter table."""

    def __post_init__(self) -> None:
        if not _is_int(self.threshold) or self.threshold < 1:
            _fail("Admission", "threshold", self.threshold, "an int >= 1")
        if not _is_int(self.counter_capacity) or self.counter_capacity < 1:
            _fail("Admission", "counter_capacity", self.counter_capacity, "an int >= 1")


@dataclass(frozen=True, kw_only=True)
class Storage:
    """A table's two storage tiers and how its rows use them.

    ``hbm`` is the fast tier (GPU memory for a CUDA table, else RAM); ``ddr`` the large one
    (pinned host memory for a CUDA table; RAM, or with ``ddr_path`` a memory-mapped file, for a
    CPU table). The mode changes where rows live, never what training computes.
    """

    mode: StorageMode = StorageMode.HBM_ONLY
    """HBM_ONLY, HYBRID, CACHING, or AUTO (the planner chooses)."""
    cache_load_factor: float | None = None
    """x in [0.1, 1.0]: the fraction of the rows held in hbm (HYBRID) or cached there (CACHING);
    1.0 (the only value HBM_ONLY accepts) drops the ddr tier. None with HYBRID, CACHING or AUTO:
    the planner chooses x (the table can be built only once it did; see :attr:`planned`)."""
    ddr_path: str | None = None
    """A directory for the ddr tier's memory-mapped files (``<table>.ddr.*``), so a table can
    outgrow RAM; None keeps the ddr tier in memory. Sharded tables use ``rank<r>/`` under it."""
    reopen: bool | str = False
    """CACHING with ``ddr_path``: ``True`` opens the backing store a previous table closed cleanly
    there (``close()``, or interpreter exit) and refuses a torn one (a crash after it was opened);
    ``"auto"`` reopens a cleanly closed store, else creates a new one (never reusing a torn one);
    ``False`` creates a new store and refuses to overwrite existing files."""

    def __post_init__(self) -> None:
        if not isinstance(self.mode, StorageMode):
            _fail("Storage", "mode", self.mode, f"one of {[m.name for m in StorageMode]}")
        x = self.cache_load_factor
        if x is None:
            if self.mode == StorageMode.HBM_ONLY:
                object.__setattr__(self, "cache_load_factor", 1.0)
        elif (not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x)
              or not 0.1 <= x <= 1.0):
            _fail("Storage", "cache_load_factor", x, "a number in [0.1, 1.0]")
        else:
            object.__setattr__(self, "cache_load_factor", float(x))
        if self.mode == StorageMode.HBM_ONLY and self.cache_load_factor != 1.0:
            _fail("Storage", "cache_load_factor", x, "1.0 with HBM_ONLY (choose HYBRID or CACHING "
                  "to keep part of the rows in ddr)")
        if self.ddr_path is not None:
            if not isinstance(self.ddr_path, (str, os.PathLike)) or not str(self.ddr_path):
                _fail("Storage", "ddr_path", self.ddr_path, "a directory path or None")
            object.__setattr__(self, "ddr_path", os.fspath(self.ddr_path))
            if self.effective_mode == StorageMode.HBM_ONLY:
                _fail("Storage", "ddr_path", self.ddr_path, "None when there is no ddr tier "
                      f"(mode {self.mode.name}, cache_load_factor {self.cache_load_factor})")
        if not (isinstance(self.reopen, bool) or self.reopen == "auto"):
            _fail("Storage", "reopen", self.reopen, "True, False or 'auto'")
        if self.reopen and (self.effective_mode != StorageMode.CACHING or self.ddr_path is None):
            _fail("Storage", "reopen", self.reopen, "False unless mode=CACHING with a ddr_path "
                  "and cache_load_factor < 1 (only a CACHING backing store holds every row)")

    @property
    def effective_mode(self) -> StorageMode:
        """The mode in force: cache_load_factor 1.0 means HBM_ONLY in any mode."""
        return StorageMode.HBM_ONLY if self.cache_load_factor == 1.0 else self.mode

    @property
    def planned(self) -> bool:
        """Whether mode and cache_load_factor are both decided (a table can be built)."""
        return self.effective_mode != StorageMode.AUTO and self.cache_load_factor is not None

    def require_planned(self, table: str) -> None:
        """Raises ConfigError naming ``table`` if the planner has yet to choose its storage."""
        if not self.planned:
            raise ConfigError(
                f"table {table!r}: its storage (mode {self.mode.name}, cache_load_factor "
                f"{self.cache_load_factor}) is left to the planner, so the table cannot be built "
                "yet; plan the tables first (configs = dynemb.planner.plan(tables, topology)"
                ".apply(tables)) or give both mode and cache_load_factor.")


@dataclass(frozen=True, kw_only=True)
class TableConfig:
    """One dynamic embedding table: rows keyed by raw int64 ids, created on first sight."""

    name: str
    """Unique table name."""
    dim: int
    """Embedding dimension."""
    features: tuple[str, ...]
    """Feature names looked up in this table (several features may share a table)."""
    capacity: int
    """Rows the table can hold (rounded up to whole buckets; see ``DynamicTable.capacity()``).
    Sharded over W ranks this is the global capacity: each rank's shard holds
    ``ceil(capacity / W)`` rows (see ``dynemb.distributed.shard_capacity``)."""
    optimizer: OptimizerConfig = field(default_factory=SGD)
    """Fused sparse optimizer applied in backward."""
    score: ScorePolicy = ScorePolicy.LRU
    """Eviction score policy."""
    pooling: PoolingMode = PoolingMode.SUM
    """Bag reduction for EmbeddingBagCollection."""
    initializer: Initializer = field(default_factory=Initializer)
    """Initial embedding of a new row."""
    eval_initializer: Initializer = ZEROS
    """Embedding returned for a key without a row (eval mode, not yet admitted, failed insert)."""
    admission: Admission | None = None
    """Optional frequency admission."""
    on_full: OnFull = OnFull.RAISE
    """What happens when a key cannot get a row."""
    routing: Routing = Routing.HASH_ROUNDROBIN
    """Which rank owns each key when the table is sharded (unused in a single process)."""
    id_range: int | None = None
    """Ids expected in ``[0, id_range)``: the block size of ``Routing.CONTINUOUS``
    (``ceil(id_range / W)``), which requires it; an int in ``[1, 2**63]`` or None."""
    bucket_capacity: int = 128
    """Slots per hash bucket (a power of two in [8, 1024]; a table smaller than one bucket gets
    one bucket of the next power of two, at least 8)."""
    storage: Storage = field(default_factory=Storage)
    """Storage tiers: HBM_ONLY (the default), HYBRID or CACHING (see :class:`Storage`)."""
    nonfinite: NonFinite = NonFinite.SKIP
    """Rows whose gradient holds NaN or inf: SKIP their update (counted), RAISE, or APPLY it
    (see :class:`NonFinite`; the strings "skip", "raise", "apply" are accepted)."""
    threads: int | None = None
    """Threads one call of the table's CPU kernels (lookup, row initialisation, pooling, the
    optimizer update) splits its work over; None (the default) takes torch's count
    (``torch.get_num_threads()``) at each call. Results are bit-identical for any count."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            _fail("TableConfig", "name", self.name, "a non-empty string")
        owner = f"TableConfig({self.name!r})"
        if isinstance(self.features, str):
            _fail(owner, "features", self.features, "a list of feature names, not one string")
        try:
            object.__setattr__(self, "features", tuple(self.features))
        except TypeError:  # not iterable: None, a number
            _fail(owner, "features", self.features, "a non-empty list of non-empty strings")
        if not self.features or not all(isinstance(f, str) and f for f in self.features):
            _fail(owner, "features", self.features, "a non-empty list of non-empty strings")
        if len(set(self.features)) != len(self.features):
            _fail(owner, "features", self.features, "distinct feature names")
        if not _is_int(self.dim) or self.dim < 1:
            _fail(owner, "dim", self.dim, "an int >= 1")
        if not _is_int(self.capacity) or self.capacity < 1:
            _fail(owner, "capacity", self.capacity, "an int >= 1")
        b = self.bucket_capacity
        if not _is_int(b) or b < 8 or b & (b - 1) or b > 1024:
            _fail(owner, "bucket_capacity", b, "a power of two in [8, 1024]")
        if isinstance(self.nonfinite, str) and not isinstance(self.nonfinite, NonFinite):
            if self.nonfinite not in {m.value for m in NonFinite}:
                _fail(owner, "nonfinite", self.nonfinite, "one of 'skip', 'raise', 'apply'")
            object.__setattr__(self, "nonfinite", NonFinite(self.nonfinite))
        checks = (("optimizer", OptimizerConfig), ("score", ScorePolicy),
                  ("pooling", PoolingMode), ("initializer", Initializer),
                  ("eval_initializer", Initializer), ("on_full", OnFull), ("routing", Routing),
                  ("nonfinite", NonFinite),
                  ("storage", Storage))
        for name, kind in checks:
            if not isinstance(getattr(self, name), kind):
                _fail(owner, name, getattr(self, name), f"a {kind.__name__}")
        t = self.threads
        if t is not None and (not _is_int(t) or not 1 <= t <= 1024):
            _fail(owner, "threads", self.threads, "an int in [1, 1024] or None")
        if self.admission is not None and not isinstance(self.admission, Admission):
            _fail(owner, "admission", self.admission, "an Admission or None")
        r = self.id_range
        if r is not None and (not _is_int(r) or not 1 <= r <= 2**63):
            _fail(owner, "id_range", r, "an int in [1, 2**63] or None")
        if self.routing == Routing.CONTINUOUS and r is None:
            raise ConfigError(f"{owner}.id_range: routing=CONTINUOUS needs the id range "
                              "(owner = key // ceil(id_range / W)), found None; set "
                              "id_range=<1 + the largest id>, or choose Routing.HASH_ROUNDROBIN.")
