"""The configuration of ``dynemb train``: frozen dataclasses, every field defaulted and
validated, loaded from YAML or JSON (unknown keys are errors listing the valid ones).

A config file mirrors the dataclasses; anything left out keeps its default::

    steps: 1250
    batch_size: 256
    data: {source: movielens-100k, split: time}
    model: {embedding_dim: 8, top_mlp: [64, 32]}
    embeddings:
      optimizer: adam                   # every table's defaults ...
      lr: 0.003
      tables:                           # ... then per table (a feature name or a glob pattern)
        - {match: [age, gender, zip], capacity: 4096, optimizer: sgd}
        - {match: user, dim: 16, storage: caching, cache_load_factor: 0.5}
    dense_optimizer: {name: adam, lr: 0.0005}
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
from dataclasses import dataclass, field

from dynemb.config import OnFull, PoolingMode, Routing, ScorePolicy, Storage, StorageMode
from dynemb.data.base import is_int, is_number, require
from dynemb.data.movielens import Split
from dynemb.data.synthetic import SyntheticConfig
from dynemb.errors import ConfigError

SOURCES = ("movielens-100k", "synthetic", "criteo:PATH")


class SparseOptimizer(str, enum.Enum):
    """The row optimizer fused into the embedding tables."""

    SGD = "sgd"
    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAM = "adam"


class DenseOptimizer(str, enum.Enum):
    """The torch.optim optimizer of the MLPs."""

    SGD = "sgd"
    ADAGRAD = "adagrad"
    ADAM = "adam"


def _check_int(owner: str, name: str, value: object, low: int, high: int | None = None) -> None:
    ok = is_int(value) and value >= low and (high is None or value <= high)
    bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
    require(ok, owner, name, value, f"an int {bound}")


def _check_sizes(owner: str, name: str, value: object) -> tuple[int, ...]:
    ok = isinstance(value, (list, tuple)) and all(is_int(v) and 1 <= v <= 1 << 16 for v in value)
    require(ok, owner, name, value, "a list of layer sizes, ints in [1, 65536]")
    return tuple(value)


def _check_enum(owner: str, name: str, value: object, kind: type[enum.Enum]) -> enum.Enum:
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{owner}.{name}: expected one of {[k.value for k in kind]}, "
                          f"found {value!r}.") from None


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the samples come from and how they are served."""

    source: str = "movielens-100k"
    """``movielens-100k``, ``synthetic`` or ``criteo:PATH`` (a Criteo TSV file, .gz allowed)."""
    split: Split = Split.RANDOM
    """MovieLens: ``random`` (seeded 80/20) or ``time`` (the latest ratings held out)."""
    eval_fraction: float = 0.2
    """MovieLens: share of the ratings held out. Criteo: share of the lines held out (every
    round(1 / eval_fraction)-th line)."""
    count_features: bool = True
    """MovieLens: add the log number of ratings the user, and the item, had before each rating
    (by timestamp) as dense features (history lengths; no labels)."""
    seed: int = 0
    """Seeds the MovieLens random split and the order of samples in each epoch."""
    prefetch: int = 0
    """Batches a background thread prepares ahead of the step (0: none; measured on 2 cores:
    batch building holds the GIL, so a thread moves its cost into the step rather than hiding
    it)."""
    workers: int = 0
    """1: build training batches in a background process (a spawned DataLoader worker), which
    can overlap GIL-bound work such as Criteo parsing with the step when a core is free."""
    eval_batch_size: int = 4096
    """Samples per evaluation batch (all ranks together)."""
    max_eval_samples: int = 0
    """Held-out samples evaluated (0: all of them)."""
    train_eval_samples: int = 20_000
    """Training samples scored at the end for the train AUC and log loss (0: none)."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    """The synthetic generator's settings (``source: synthetic``)."""

    def __post_init__(self) -> None:
        own = "DataConfig"
        ok = isinstance(self.source, str) and (self.source in ("movielens-100k", "synthetic")
                                               or (self.source.startswith("criteo:")
                                                   and len(self.source) > len("criteo:")))
        require(ok, own, "source", self.source, f"one of {list(SOURCES)}")
        object.__setattr__(self, "split", _check_enum(own, "split", self.split, Split))
        require(is_number(self.eval_fraction) and 0 < self.eval_fraction < 1, own,
                "eval_fraction", self.eval_fraction, "a number in (0, 1)")
        require(isinstance(self.count_features, bool), own, "count_features",
                self.count_features, "true or false")
        _check_int(own, "seed", self.seed, 0, 2**62)
        _check_int(own, "prefetch", self.prefetch, 0, 64)
        _check_int(own, "workers", self.workers, 0, 1)
        _check_int(own, "eval_batch_size", self.eval_batch_size, 1)
        _check_int(own, "max_eval_samples", self.max_eval_samples, 0)
        _check_int(own, "train_eval_samples", self.train_eval_samples, 0)
        require(isinstance(self.synthetic, SyntheticConfig), own, "synthetic", self.synthetic,
                "a SyntheticConfig")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The DLRM's shape."""

    embedding_dim: int = 8
    """Dimension of the tables (unless ``embeddings.tables`` sets another: such a table is
    projected to this one by a linear layer) and of the bottom MLP's output."""
    bottom_mlp: tuple[int, ...] = (64,)
    """Hidden layer sizes of the bottom MLP (dense features)."""
    top_mlp: tuple[int, ...] = (64, 32)
    """Hidden layer sizes of the top MLP (before the one-logit output)."""

    def __post_init__(self) -> None:
        _check_int("ModelConfig", "embedding_dim", self.embedding_dim, 1, 4096)
        for name in ("bottom_mlp", "top_mlp"):
            object.__setattr__(self, name, _check_sizes("ModelConfig", name, getattr(self, name)))


STORAGE_FIELDS = ("storage", "cache_load_factor", "ddr_path")
"""The settings that make one ``Storage`` together."""


@dataclass(frozen=True, kw_only=True)
class TableSettings:
    """Settings of the tables whose feature ``match`` names; null keeps the default."""

    match: str | tuple[str, ...] = ""
    """The tables' features: a name, a glob pattern (``user_*``), or a list of them (a group)."""
    dim: int | None = None
    """Embedding dimension (default: ``model.embedding_dim``)."""
    capacity: int | None = None
    """Rows at most (see ``embeddings.capacity``)."""
    optimizer: SparseOptimizer | None = None
    """Row optimizer."""
    lr: float | None = None
    """Its learning rate."""
    weight_decay: float | None = None
    """Its L2 penalty."""
    init_std: float | None = None
    """Standard deviation of the normal initial rows."""
    score: ScorePolicy | None = None
    """Eviction policy."""
    pooling: PoolingMode | None = None
    """Pooling of a multi-id bag."""
    admission_threshold: int | None = None
    """Sightings before a new id gets a row."""
    on_full: OnFull | None = None
    """When an id cannot get a row."""
    routing: Routing | None = None
    """Which rank owns an id under torchrun."""
    storage: StorageMode | None = None
    """Storage mode (``auto``: planned)."""
    cache_load_factor: float | None = None
    """Share of the rows in hbm (HYBRID) or cached there (CACHING)."""
    ddr_path: str | None = None
    """Directory of the ddr tier's memory-mapped files."""

    def __post_init__(self) -> None:
        own = "TableSettings"
        names = self._names()
        require(isinstance(names, tuple) and len(names) > 0
                and all(isinstance(n, str) and n != "" for n in names), own, "match",
                self.match, "a feature name or glob pattern, or a non-empty list of them")
        for name, kind in (("optimizer", SparseOptimizer), ("score", ScorePolicy),
                           ("pooling", PoolingMode), ("on_full", OnFull),
                           ("storage", StorageMode), ("routing", Routing)):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _check_enum(own, name, getattr(self, name), kind))
        if self.dim is not None:
            _check_int(own, "dim", self.dim, 1, 4096)

    def _names(self) -> object:
        return (self.match,) if isinstance(self.match, str) else self.match

    def matches(self, feature: str) -> bool:
        """Whether ``feature``'s table takes these settings (its name, or a glob pattern)."""
        return any(feature == n or fnmatch.fnmatchcase(feature, n) for n in self._names())

    def overrides(self) -> dict[str, object]:
        """The settings given (not null) that ``EmbeddingConfig`` also has."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("match", "dim") and getattr(self, f.name) is not None}


@dataclass(frozen=True, kw_only=True)
class EmbeddingConfig:
    """The dynamic tables: one per sparse feature; the settings here are every table's, unless
    ``tables`` sets others."""

    optimizer: SparseOptimizer = SparseOptimizer.ADAM
    """Row optimizer fused into backward."""
    lr: float = 0.003
    """Its learning rate."""
    weight_decay: float = 0.0
    """Its L2 penalty."""
    init_std: float = 0.01
    """Standard deviation of the normal initial rows."""
    capacity: int = 1 << 16
    """Rows per table at most; a table whose number of ids is known gets 2x that (at least
    1024) if smaller. Sharded: the global capacity."""
    score: ScorePolicy = ScorePolicy.LRU
    """Eviction policy when a table is full."""
    pooling: PoolingMode = PoolingMode.SUM
    """How a multi-id bag (e.g. genres) is pooled."""
    admission_threshold: int = 0
    """A new id gets a row only after this many sightings (0 or 1: at once)."""
    on_full: OnFull = OnFull.RAISE
    """When an id cannot get a row (a full table without eviction)."""
    routing: Routing = Routing.HASH_ROUNDROBIN
    """Which rank owns an id under torchrun: ``hash_roundrobin``, ``roundrobin`` or
    ``continuous`` (needs the number of ids; see docs/sharding.md)."""
    backend: str | None = None
    """Kernel backend: ``numba``, ``torch``, ``triton`` or null (numba on CPU, triton on
    CUDA)."""
    threads: int | None = None
    """Threads each table's CPU kernels split a call over (``TableConfig.threads``; results are
    the same for any count); null: the run's ``threads``. On a small machine one torch thread
    with the kernels on every core is the fast setting (see docs/architecture.md)."""
    storage: StorageMode = StorageMode.AUTO
    """Every table's storage mode: ``auto`` (the planner chooses HBM_ONLY, HYBRID or CACHING
    and the cache_load_factor at start-up), ``hbm_only``, ``hybrid`` or ``caching`` (the mode
    pinned; its cache_load_factor is ``cache_load_factor``, or planned when that is null)."""
    cache_load_factor: float | None = None
    """x in [0.1, 1.0], the share of each table's rows in hbm (HYBRID) or cached there
    (CACHING); null: planned (``hbm_only``: 1.0)."""
    ddr_path: str | None = None
    """A directory for the ddr tier's memory-mapped files (one ``rank<r>/`` per rank under
    torchrun); null: the ddr tier in RAM. Its files are deleted when the run ends (the rows
    are in the checkpoints)."""
    plan: str | None = None
    """A saved plan (``plan.json`` of ``dynemb plan`` or of an earlier run) to build the tables
    from instead of planning; its tables must be this run's. ``dynemb train --plan FILE``."""
    calibration: str | None = None
    """A cost calibration (``dynemb calibrate --out FILE``) for the planner; null: the
    documented defaults of ``device``."""
    hbm_bytes_per_rank: int | None = None
    """The planner's hbm per rank, in bytes; null: this machine's (the GPU's memory, or on a
    CPU host each rank's share of the RAM available at start-up)."""
    ddr_bytes_per_host: int | None = None
    """The planner's ddr per host, in bytes; null: this machine's (host RAM on a GPU host; on a
    CPU host the free disk under ``ddr_path``, or without it the available RAM)."""
    hbm_reserve_fraction: float = 0.15
    """Share of hbm the planner leaves free (dense model, activations, allocator slack)."""
    ddr_reserve_fraction: float = 0.1
    """Share of ddr the planner leaves free."""
    profile_steps: int = 32
    """Training batches whose ids are each table's access profile for the planner: the first
    batches of the run (at most the steps it trains), which it then trains on as usual."""
    tables: tuple[TableSettings, ...] = ()
    """Per-table settings: a list of ``{match: FEATURE, PATTERN or [GROUP], <setting>: value}``
    (settings: dim, capacity, optimizer, lr, weight_decay, init_std, score, pooling,
    admission_threshold, on_full, routing, storage, cache_load_factor, ddr_path). Each table
    takes the settings above, then those of every entry that matches its feature, in order
    (so a group's pattern first, then single tables); an entry that sets storage sets its
    cache_load_factor and ddr_path with it. An entry matching no table is an error."""

    def __post_init__(self) -> None:
        own = "EmbeddingConfig"
        for name, kind in (("optimizer", SparseOptimizer), ("score", ScorePolicy),
                           ("pooling", PoolingMode), ("on_full", OnFull),
                           ("storage", StorageMode), ("routing", Routing)):
            object.__setattr__(self, name, _check_enum(own, name, getattr(self, name), kind))
        for name in ("lr", "weight_decay", "init_std"):
            value = getattr(self, name)
            require(is_number(value) and value >= 0, own, name, value, "a finite number >= 0")
        _check_int(own, "capacity", self.capacity, 1, 1 << 40)
        _check_int(own, "admission_threshold", self.admission_threshold, 0)
        require(self.backend in (None, "numba", "torch", "triton"), own, "backend",
                self.backend, "numba, torch, triton or null")
        if self.threads is not None:
            _check_int(own, "threads", self.threads, 1, 1024)
        self._check_planning()
        if self.tables is None or isinstance(self.tables, list):  # `tables:` left empty
            object.__setattr__(self, "tables", tuple(self.tables or ()))
        require(all(isinstance(t, TableSettings) for t in self.tables), own, "tables",
                self.tables, "a list of per-table settings ({match: ..., ...})")
        for i, entry in enumerate(self.tables):
            # each entry's own values, checked as the section's are (the storage settings
            # alone: the combination a table ends with is checked when its table is made)
            given = entry.overrides()
            rest = {k: v for k, v in given.items() if k not in STORAGE_FIELDS}
            storage = {k: getattr(entry, k) for k in STORAGE_FIELDS}
            if entry.storage is None:
                storage["storage"] = StorageMode.AUTO
            try:
                dataclasses.replace(self, tables=(), **rest, **storage)
            except ConfigError as error:
                raise ConfigError(f"EmbeddingConfig.tables[{i}] (match {entry.match!r}): "
                                  f"{error}") from None

    def for_table(self, feature: str) -> tuple[EmbeddingConfig, int | None]:
        """The settings of ``feature``'s table and its dim (None: ``model.embedding_dim``):
        the section's, then every matching entry's in order. An entry that sets ``storage``
        sets its cache_load_factor and ddr_path with it (null: planned, in RAM).

        Raises:
            ConfigError: the settings a table ends with do not go together, naming the table
                and its entries.
        """
        values, dim, used = {}, None, []
        for i, entry in enumerate(self.tables):
            if entry.matches(feature):
                used.append(i)
                if entry.storage is not None:
                    values.update({k: getattr(entry, k) for k in STORAGE_FIELDS})
                values.update(entry.overrides())
                dim = entry.dim if entry.dim is not None else dim
        try:
            return dataclasses.replace(self, tables=(), **values), dim
        except ConfigError as error:
            raise ConfigError(f"table {feature!r} (the section's settings, then "
                              f"embeddings.tables{used}): {error}") from None

    def check_matches(self, features: list[str]) -> None:
        """ConfigError if an entry of ``tables`` matches none of ``features``."""
        for i, entry in enumerate(self.tables):
            if not any(entry.matches(f) for f in features):
                raise ConfigError(f"EmbeddingConfig.tables[{i}]: match {entry.match!r} names "
                                  f"no table; the tables (one per feature) are {features}.")

    def _check_planning(self) -> None:
        own = "EmbeddingConfig"
        x = self.cache_load_factor
        require(x is None or (is_number(x) and 0.1 <= x <= 1.0), own, "cache_load_factor", x,
                "a number in [0.1, 1.0] or null (planned)")
        for name in ("ddr_path", "plan", "calibration"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, str) and value != ""), own, name,
                    value, "a path or null")
        for name in ("hbm_bytes_per_rank", "ddr_bytes_per_host"):
            value = getattr(self, name)
            require(value is None or (is_int(value) and 0 <= value < 1 << 62), own, name,
                    value, "a number of bytes (an int >= 0) or null (this machine's)")
        for name in ("hbm_reserve_fraction", "ddr_reserve_fraction"):
            value = getattr(self, name)
            require(is_number(value) and 0 <= value < 1, own, name, value,
                    "a number in [0, 1)")
        _check_int(own, "profile_steps", self.profile_steps, 1, 4096)
        self.table_storage()  # storage, cache_load_factor and ddr_path must go together

    def table_storage(self) -> Storage:
        """The ``Storage`` of every table as configured (planned later where it is left open).

        Raises:
            ConfigError: the three settings do not go together (e.g. ``hbm_only`` with a
                cache_load_factor below 1, or with a ``ddr_path``).
        """
        try:
            return Storage(mode=self.storage, cache_load_factor=self.cache_load_factor,
                           ddr_path=self.ddr_path)
        except ConfigError as error:
            raise ConfigError(f"EmbeddingConfig.storage {self.storage.value!r}, "
                              f"cache_load_factor {self.cache_load_factor!r}, ddr_path "
                              f"{self.ddr_path!r}: they do not go together ({error})") from None


@dataclass(frozen=True, kw_only=True)
class DenseOptimizerConfig:
    """The optimizer of the MLPs."""

    name: DenseOptimizer = DenseOptimizer.ADAM
    """Which torch.optim optimizer."""
    lr: float = 0.0005
    """Learning rate."""
    weight_decay: float = 0.0
    """L2 penalty."""

    def __post_init__(self) -> None:
        own = "DenseOptimizerConfig"
        object.__setattr__(self, "name", _check_enum(own, "name", self.name, DenseOptimizer))
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            require(is_number(value) and value >= 0, own, name, value, "a finite number >= 0")


PIPELINE_KINDS = ("base", "sparse_dist", "fused_sparse_dist", "semi_sync", "prefetch")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How training steps overlap (see docs/pipelines.md). The run restarts its pipeline after
    each evaluation and checkpoint (every batch pulled is trained before them)."""

    kind: str = "base"
    """base, sparse_dist, fused_sparse_dist, semi_sync or prefetch (prefetch needs a CACHING
    table)."""
    start_batch: int = 0
    """semi_sync: steps (from each pipeline start) that run synchronously first."""
    stash_gradients: bool = False
    """semi_sync: the dense optimizer applies the previous step's gradients."""

    def __post_init__(self) -> None:
        own = "PipelineConfig"
        require(self.kind in PIPELINE_KINDS, own, "kind", self.kind,
                f"one of {', '.join(PIPELINE_KINDS)}")
        _check_int(own, "start_batch", self.start_batch, 0)
        require(isinstance(self.stash_gradients, bool), own, "stash_gradients",
                self.stash_gradients, "true or false")
        if self.kind != "semi_sync":
            require(self.start_batch == 0 and not self.stash_gradients, own, "kind", self.kind,
                    "semi_sync when start_batch or stash_gradients is set")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One ``dynemb train`` run."""

    out: str = ""
    """Run directory (metrics.json, config.yaml, checkpoints/); empty: runs/<data source>."""
    steps: int = 1250
    """Training steps (the total: a resumed run continues up to it)."""
    batch_size: int = 256
    """Samples per step, all ranks together (each rank takes batch_size / world size)."""
    eval_every: int = 500
    """Steps between evaluations recorded in the history (0: only at the end)."""
    log_every: int = 100
    """Steps between progress log lines when stderr is not a terminal."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: none during training)."""
    checkpoint_at_end: bool = True
    """Save a checkpoint after the last step."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept in <out>/checkpoints (older ones are deleted; 0: keep all)."""
    seed: int = 0
    """Seeds the dense layers' initial weights."""
    threads: int = 1
    """torch intra-op threads per process (one is fastest for small ops on small machines)."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` (under torchrun each rank takes cuda:<local rank>)."""
    timeout_s: float = 600.0
    """Under torchrun: the collective timeout of the process group the run makes, in seconds.
    A rank waiting this long in a collective (the sharded embeddings' all-to-alls, the dense
    gradients' all-reduce) for a rank that is hung or gone raises instead of waiting forever."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    embeddings: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    dense_optimizer: DenseOptimizerConfig = field(default_factory=DenseOptimizerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    def __post_init__(self) -> None:
        own = "TrainConfig"
        require(isinstance(self.out, str), own, "out", self.out, "a path string")
        _check_int(own, "steps", self.steps, 1)
        _check_int(own, "batch_size", self.batch_size, 1)
        for name in ("eval_every", "checkpoint_every", "keep_checkpoints"):
            _check_int(own, name, getattr(self, name), 0)
        _check_int(own, "log_every", self.log_every, 1)
        require(isinstance(self.checkpoint_at_end, bool), own, "checkpoint_at_end",
                self.checkpoint_at_end, "true or false")
        _check_int(own, "seed", self.seed, 0, 2**62)
        _check_int(own, "threads", self.threads, 1, 1024)
        require(self.device in ("cpu", "cuda"), own, "device", self.device, "cpu or cuda")
        require(is_number(self.timeout_s) and 0 < self.timeout_s <= 86_400 * 7, own,
                "timeout_s", self.timeout_s, "a number of seconds in (0, 604800]")
        for name, kind in (("data", DataConfig), ("model", ModelConfig),
                           ("embeddings", EmbeddingConfig),
                           ("dense_optimizer", DenseOptimizerConfig),
                           ("pipeline", PipelineConfig)):
            require(isinstance(getattr(self, name), kind), own, name, getattr(self, name),
                    f"a {kind.__name__}")

    @property
    def run_dir(self) -> str:
        """``out``, or runs/<data source> when it is empty."""
        if self.out:
            return self.out
        return "runs/" + self.data.source.split(":", 1)[0]
