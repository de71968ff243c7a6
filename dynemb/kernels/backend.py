"""One tensor-level interface over the two kernel implementations.

``NUMBA`` runs the compiled CPU kernels on zero-copy numpy views of CPU tensors; ``TORCH`` runs
the vectorised torch twins (any device). Tables pick one by device (``backend_for``); tests run
both against the same models.

Index operations: ``find(ix, keys, custom, policy, step, touch, pin, prev=None)`` (``prev``: an
(N,) int64 journal of the scores it touched), ``restore_scores(ix, slots, prev)`` (undoes those
touches), ``insert(ix, keys, custom, policy, step, atomic=False)`` (``atomic``: every key is
placed or nothing changes), ``finish``, ``unpin`` (both free the pins of a lookup's slots;
the pins of slots held by lookups in flight, their hold counts, are put back afterwards, which
costs nothing when the index holds none: ``HashIndex.held_pins``), ``erase``.
"""

from __future__ import annotations

import torch

from dynemb.config import Initializer, InitKind
from dynemb.errors import ConfigError
from dynemb.kernels import index_numba as inb
from dynemb.kernels import index_torch as ito
from dynemb.kernels import pooling_numba as pnb
from dynemb.kernels import pooling_torch as pto
from dynemb.kernels import rows_numba as rnb
from dynemb.kernels import rows_torch as rto

_NO_QUANTILES = torch.zeros(2, dtype=torch.float32)
_NO_PREV = torch.empty(0, dtype=torch.int64)
INIT_CODES = {
    InitKind.NORMAL: rnb.INIT_NORMAL,
    InitKind.TRUNCATED_NORMAL: rnb.INIT_TRUNCATED_NORMAL,
    InitKind.UNIFORM: rnb.INIT_UNIFORM,
    InitKind.CONSTANT: rnb.INIT_CONSTANT,
}


def init_params(init: Initializer, device: torch.device) -> tuple[int, float, float, torch.Tensor]:
    """(kind code, a, b, quantile table on ``device``) as the init kernels take them."""
    code = INIT_CODES[init.kind]
    if init.kind == InitKind.UNIFORM:
        return code, init.low, init.high, _NO_QUANTILES
    if init.kind == InitKind.CONSTANT:
        return code, init.value, 0.0, _NO_QUANTILES
    bound = init.bound if init.kind == InitKind.TRUNCATED_NORMAL else rnb.NORMAL_BOUND
    return code, init.mean, init.std, rto.quantile_table(bound, device)


def _np(t: torch.Tensor):
    return t.detach().numpy()


def _put_back(ix, held: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Restores the hold counts (pins) of held slots that a ``finish``/``unpin`` freed."""
    if held is not None:
        ix.pins[held[0]] = held[1]


class NumbaBackend:
    """Compiled single-threaded CPU kernels."""

    name = "numba"

    def find(self, ix, keys, custom, policy, step, touch, pin, prev=None):
        slots = torch.empty_like(keys)
        inb.find_pass(_np(keys), _np(custom), _np(ix.keys), _np(ix.scores), _np(ix.digests),
                      _np(ix.pins), ix.num_buckets, ix.split, ix.width - 1, policy, step, touch, pin,
                      _np(slots), _np(_NO_PREV if prev is None else prev))
        return slots

    def restore_scores(self, ix, slots, prev):
        inb.restore_scores(_np(slots), _np(prev), _np(ix.scores))

    def insert(self, ix, keys, custom, policy, step, atomic=False):
        n = keys.numel()
        slots = torch.empty_like(keys)
        inserted = torch.zeros(n, dtype=torch.bool)
        ev_keys, ev_slots, ev_scores = (torch.empty_like(keys) for _ in range(3))
        n_ev = inb.insert_pass(
            _np(keys), _np(custom), _np(ix.keys), _np(ix.scores), _np(ix.digests),
            _np(ix.pins), ix.num_buckets, ix.split, ix.width - 1, policy, step, atomic,
            _np(slots), _np(inserted), _np(ev_keys), _np(ev_slots), _np(ev_scores),
            _np(ix.counts))
        return slots, inserted, (ev_keys[:n_ev], ev_slots[:n_ev], ev_scores[:n_ev])

    def finish(self, ix, slots):
        inverse, unique_slots, unique_pos = (torch.empty_like(slots) for _ in range(3))
        held = ix.held_pins(slots) if ix.held else None
        u = inb.finish(_np(slots), _np(ix.pins), _np(inverse), _np(unique_slots), _np(unique_pos))
        _put_back(ix, held)
        return inverse, unique_slots[:u], unique_pos[:u]

    def unpin(self, ix, slots):
        held = ix.held_pins(slots) if ix.held else None
        inb.unpin(_np(slots), _np(ix.pins))
        _put_back(ix, held)

    def erase(self, ix, keys):
        slots = torch.empty_like(keys)
        inb.erase(_np(keys), _np(ix.keys), _np(ix.scores), _np(ix.digests), ix.num_buckets,
                  ix.split, ix.width - 1, _np(slots), _np(ix.counts))
        return slots

    def init_rows(self, dst, dst_rows, keys, dim, state_value, init, table_mix):
        kind, a, b, quantiles = init_params(init, dst.device)
        rnb.init_rows(_np(dst), _np(dst_rows), _np(keys), dim, state_value, kind, a, b,
                      _np(quantiles), table_mix)

    def gather(self, rows, slots, dim, out):
        rnb.gather(_np(rows), _np(slots), dim, _np(out))

    def copy_rows(self, src, src_rows, dst, dst_rows):
        rnb.copy_rows(_np(src), _np(src_rows), _np(dst), _np(dst_rows))

    def pool(self, rows, extra, src, inverse, lengths, weights, batch, dim, mean, out):
        pnb.pool(_np(rows), _np(extra), _np(src), _np(inverse), _np(lengths), _np(weights),
                 batch, dim, mean, _np(out))

    def pool_backward(self, gout, rows, extra, src, inverse, lengths, weights, batch, dim, mean,
                      grads, wgrad):
        pnb.pool_backward(_np(gout.contiguous()), _np(rows), _np(extra), _np(src), _np(inverse),
                          _np(lengths), _np(weights), batch, dim, mean, _np(grads), _np(wgrad))

    def optimizer(self, name):
        kernel = getattr(rnb, name)

        def run(rows, slots, grads, *args):
            kernel(_np(rows), _np(slots), _np(grads.contiguous()), *args)

        return run


class TorchBackend:
    """Vectorised torch reference kernels (CPU or CUDA)."""

    name = "torch"

    def find(self, ix, keys, custom, policy, step, touch, pin, prev=None):
        return ito.find_pass(ix, keys, custom, policy, step, touch, pin, prev)

    def restore_scores(self, ix, slots, prev):
        ito.restore_scores(ix, slots, prev)

    def insert(self, ix, keys, custom, policy, step, atomic=False):
        return ito.insert_pass(ix, keys, custom, policy, step, atomic)

    def finish(self, ix, slots):
        held = ix.held_pins(slots) if ix.held else None
        out = ito.finish(ix, slots)
        _put_back(ix, held)
        return out

    def unpin(self, ix, slots):
        held = ix.held_pins(slots) if ix.held else None
        ito.unpin(ix, slots)
        _put_back(ix, held)

    def erase(self, ix, keys):
        return ito.erase(ix, keys)

    def init_rows(self, dst, dst_rows, keys, dim, state_value, init, table_mix):
        rto.init_rows(dst, dst_rows, keys, dim, state_value, *init_params(init, dst.device),
                      table_mix)

    def gather(self, rows, slots, dim, out):
        rto.gather(rows, slots, dim, out)

    def copy_rows(self, src, src_rows, dst, dst_rows):
        rto.copy_rows(src, src_rows, dst, dst_rows)

    def pool(self, *args):
        pto.pool(*args)

    def pool_backward(self, *args):
        pto.pool_backward(*args)

    def optimizer(self, name):
        return getattr(rto, name)


NUMBA = NumbaBackend()
TORCH = TorchBackend()
BACKENDS = {"numba": NUMBA, "torch": TORCH}


def backend_for(device: torch.device, name: str | None = None):
    """The backend named ``name`` ("numba" or "torch"), or the default for ``device``."""
    if name is None:
        return NUMBA if device.type == "cpu" else TORCH
    if name not in BACKENDS:
        raise ConfigError(f"backend: expected one of {sorted(BACKENDS)}, found {name!r}.")
    if name == "numba" and device.type != "cpu":
        raise ConfigError(f"backend 'numba' runs on CPU tensors only, found device {device}; "
                          "use backend='torch' (the default for non-CPU devices).")
    return BACKENDS[name]
