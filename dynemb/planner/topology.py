"""The machines a plan must fit: ranks, hosts, and the bytes of each storage tier."""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass

from dynemb.errors import PlanningError

DEVICES = ("cpu", "cuda")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _fail(name: str, value: object, expected: str) -> None:
    raise PlanningError(f"Topology.{name}: expected {expected}, found {value!r}.")


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Ranks and memory budgets.

    With row-wise sharding every rank holds one shard of every table, so a plan charges each
    rank's hbm with every table's per-rank hbm bytes, and each host's ddr with
    ``ranks_per_host`` times every table's per-rank ddr bytes.
    """

    world_size: int
    """Ranks in all."""
    ranks_per_host: int
    """Ranks sharing one host's ddr (torchrun's LOCAL_WORLD_SIZE); at most ``world_size``."""
    hbm_bytes_per_rank: int
    """The fast tier of one rank: its GPU's memory, or on a CPU host the RAM given to its hbm."""
    ddr_bytes_per_host: int
    """The large tier of one host: host memory, or on a CPU host the disk under ``ddr_path``."""
    device: str = "cpu"
    """``cpu`` or ``cuda``: picks the default cost constants."""
    hbm_reserve_fraction: float = 0.0
    """Share of hbm kept free for everything else (dense model, activations, allocator slack)."""
    ddr_reserve_fraction: float = 0.0
    """Share of ddr kept free."""

    def __post_init__(self) -> None:
        for name in ("world_size", "ranks_per_host"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                _fail(name, getattr(self, name), "an int >= 1")
        if self.ranks_per_host > self.world_size:
            _fail("ranks_per_host", self.ranks_per_host, f"at most world_size ({self.world_size})")
        for name in ("hbm_bytes_per_rank", "ddr_bytes_per_host"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                _fail(name, getattr(self, name), "an int >= 0 (bytes)")
        if self.device not in DEVICES:
            _fail("device", self.device, f"one of {DEVICES}")
        for name in ("hbm_reserve_fraction", "ddr_reserve_fraction"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 <= v < 1.0:
                _fail(name, v, "a number in [0, 1)")

    @property
    def hosts(self) -> int:
        return math.ceil(self.world_size / self.ranks_per_host)

    @property
    def hbm_budget(self) -> int:
        """Bytes of hbm per rank a plan may use (after the reserve)."""
        return int(self.hbm_bytes_per_rank * (1.0 - self.hbm_reserve_fraction))

    @property
    def ddr_budget_per_host(self) -> int:
        """Bytes of ddr per host a plan may use (after the reserve)."""
        return int(self.ddr_bytes_per_host * (1.0 - self.ddr_reserve_fraction))

    @property
    def ddr_budget_per_rank(self) -> int:
        """The per-rank ddr bytes every rank may use so that a host's ranks fit together:
        ``ranks_per_host * x <= per-host budget`` holds exactly when ``x`` is at most this."""
        return self.ddr_budget_per_host // self.ranks_per_host

    def as_dict(self) -> dict:
        return {"world_size": self.world_size, "ranks_per_host": self.ranks_per_host,
                "hbm_bytes_per_rank": self.hbm_bytes_per_rank,
                "ddr_bytes_per_host": self.ddr_bytes_per_host, "device": self.device,
                "hbm_reserve_fraction": self.hbm_reserve_fraction,
                "ddr_reserve_fraction": self.ddr_reserve_fraction}

    @classmethod
    def from_dict(cls, data: object) -> Topology:
        if not isinstance(data, dict):
            raise PlanningError(f"Topology: expected a mapping, found {type(data).__name__}.")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanningError(f"Topology: unknown field(s) {unknown}; valid: {sorted(known)}.")
        try:
            return cls(**data)
        except TypeError as e:
            raise PlanningError(f"Topology: {e}") from None

    @classmethod
    def from_machine(cls, *, world_size: int | None = None, ranks_per_host: int | None = None,
                     device: str | None = None, ddr_path: str | os.PathLike | None = None,
                     hbm_reserve_fraction: float = 0.15,
                     ddr_reserve_fraction: float = 0.1) -> Topology:
        """This machine's topology (torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE when not given).

        CUDA: hbm is the GPU's memory, ddr the host's RAM. CPU: hbm is each rank's share of the
        RAM available now, ddr the free disk under ``ddr_path`` (whose rows are memory-mapped
        files), or without ``ddr_path`` the same RAM again (the tiers then share it: plan with
        a ``ddr_path`` to use the disk).
        """
        world = world_size or _env_int("WORLD_SIZE", 1)
        local = ranks_per_host or _env_int("LOCAL_WORLD_SIZE", world)
        local = min(local, world)
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        ram = _available_ram()
        if device == "cuda":
            import torch

            hbm = int(torch.cuda.mem_get_info()[1])
            ddr = _total_ram()
        else:
            hbm = ram // local
            ddr = shutil.disk_usage(ddr_path).free if ddr_path is not None else ram
        return cls(world_size=world, ranks_per_host=local, hbm_bytes_per_rank=hbm,
                   ddr_bytes_per_host=ddr, device=device,
                   hbm_reserve_fraction=hbm_reserve_fraction,
                   ddr_reserve_fraction=ddr_reserve_fraction)


def _total_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _available_ram() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the total."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return _total_ram()


def _env_int(name: str, default: int) -> int:
    """The int >= 1 in environment variable ``name`` (torchrun's), or ``default`` if unset."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise PlanningError(f"Topology.from_machine: environment variable {name} must be an int "
                            f">= 1 (torchrun sets it), found {raw!r}.")
    return value
