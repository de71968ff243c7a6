"""Reference twins: dynemb modules against plain torch (nn.EmbeddingBag / nn.Embedding + the torch
optimizer with the same rule), starting from the same rows, for 5 steps.

Compared each step: the pooled outputs and the gradient reaching per-id weights; after the steps:
every row (embedding) and, where torch keeps it, the optimizer state. The embedding gradient
itself is checked through the rows: after an SGD step, row = before - lr * grad exactly.
"""

from __future__ import annotations

import pytest
import torch

import dynemb

DIM = 6
NUM_KEYS = 40
STEPS = 5
CLOSE = dict(atol=1e-6, rtol=1e-6)  # float32 sums of many rows round relatively


def _keys(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.unique(torch.randint(-(2**62), 2**62, (NUM_KEYS,), generator=g))


def _batches(keys: torch.Tensor, features: list[str], *, weighted: bool, cover_all: bool,
             seed: int = 1) -> list[tuple[dynemb.SparseBatch, torch.Tensor]]:
    """STEPS batches of 5 samples: (batch, index of each id in ``keys``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 5, (len(features) * 5,), generator=g)
        lengths[0] = 0  # an empty bag
        idx = torch.randint(0, keys.numel(), (int(lengths.sum()),), generator=g)
        if cover_all:  # every key appears in every step (dense-optimizer references)
            idx = torch.cat([idx, torch.arange(keys.numel())])
            lengths[-1] += keys.numel()
        idx[: min(3, idx.numel())] = idx[0] if idx.numel() else idx[:0]  # repeated ids
        weights = torch.rand(idx.numel(), generator=g) + 0.5 if weighted else None
        out.append((dynemb.SparseBatch(features=features, values=keys[idx], lengths=lengths,
                                       weights=weights), idx))
    return out


def _start_rows(keys: torch.Tensor) -> torch.Tensor:
    return torch.randn(keys.numel(), DIM, generator=torch.Generator().manual_seed(7)) * 0.5


def _dyn_collection(cls, optimizer, pooling, features, keys, backend):
    cfg = dynemb.TableConfig(name="t", dim=DIM, features=features, capacity=256,
                             optimizer=optimizer, pooling=pooling)
    module = cls([cfg], backend=backend)
    module.tables["t"].insert_or_assign(keys, _start_rows(keys))
    return module


def _row_wise_adagrad_step(weight: torch.Tensor, state: torch.Tensor, grad: torch.Tensor,
                           config: dynemb.RowWiseAdagrad, step: int) -> None:
    """The row-wise Adagrad formula on the rows with a nonzero gradient (the touched rows):
    g += wd·w; m += mean(g²); w -= lr / (1 + (t - 1)·lr_decay) · g / (sqrt(m) + eps)."""
    rows = torch.nonzero(grad.abs().sum(1) > 0).flatten()
    g = grad[rows] + config.weight_decay * weight.data[rows]
    state[rows] += (g * g).mean(1)
    clr = config.lr / (1 + (step - 1) * config.lr_decay)
    weight.data[rows] -= clr * g / (state[rows].sqrt() + config.eps)[:, None]


def _torch_optimizer(config, params):
    if isinstance(config, dynemb.RowWiseAdagrad):
        return None
    if isinstance(config, dynemb.SGD):
        return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
    if isinstance(config, dynemb.Adagrad):
        return torch.optim.Adagrad(params, lr=config.lr, lr_decay=config.lr_decay,
                                   weight_decay=config.weight_decay, eps=config.eps,
                                   initial_accumulator_value=config.initial_accumulator_value)
    # torch.optim.Adam places eps differently; the SparseAdam rule is the reference (weight
    # decay is added to its gradient by the caller, as torch.optim.Adam's L2 form does)
    return torch.optim.SparseAdam(params, lr=config.lr, betas=config.betas, eps=config.eps)


def _rows_of(module, keys):
    found = module.tables["t"].find(keys)
    assert bool(found.found.all())
    return found.values


OPTIMIZERS = {
    "sgd": dynemb.SGD(lr=0.1),
    "adagrad": dynemb.Adagrad(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    "rowwise_adagrad": dynemb.RowWiseAdagrad(lr=0.1, lr_decay=0.02),
    "adam": dynemb.Adam(lr=0.05),
}


def _run_twins(optimizer, pooling, weighted, backend, *, features=("a",), dense_ref=False):
    features = list(features)
    keys = _keys()
    ours = _dyn_collection(dynemb.EmbeddingBagCollection, optimizer, pooling, features, keys,
                           backend)
    ref = torch.nn.EmbeddingBag(keys.numel(), DIM, mode="sum", sparse=not dense_ref)
    ref.weight.data.copy_(_start_rows(keys))
    opt = _torch_optimizer(optimizer, ref.parameters())
    rw_state = torch.zeros(keys.numel())
    proj = torch.randn(5, DIM * len(features), generator=torch.Generator().manual_seed(3))
    for step, (batch, idx) in enumerate(_batches(keys, features, weighted=weighted,
                                                 cover_all=dense_ref), start=1):
        w_ours = None if batch.weights is None else batch.weights.clone().requires_grad_(True)
        if w_ours is not None:
            batch = dynemb.SparseBatch(features=batch.features, values=batch.values,
                                       lengths=batch.lengths, weights=w_ours)
        out = ours(batch).values()
        w_ref = None if w_ours is None else w_ours.detach().clone().requires_grad_(True)
        pooled = []
        offsets = torch.cumsum(batch.lengths, 0) - batch.lengths
        ref_out = ref(idx, offsets, per_sample_weights=w_ref)
        if pooling == dynemb.PoolingMode.MEAN:
            ref_out = ref_out / batch.lengths.clamp(min=1)[:, None]
        pooled = torch.cat(ref_out.split(5), dim=1)  # (5, F·dim): features side by side
        torch.testing.assert_close(out, pooled, **CLOSE)
        (out * proj).sum().backward()
        if opt is not None:
            opt.zero_grad()
        (pooled * proj).sum().backward()
        if optimizer.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), optimizer.max_grad_norm)
        if isinstance(optimizer, dynemb.Adam) and dense_ref:  # SparseAdam wants a sparse grad
            g = ref.weight.grad + optimizer.weight_decay * ref.weight.data
            ref.weight.grad = g.to_sparse()
        if opt is None:
            _row_wise_adagrad_step(ref.weight, rw_state, ref.weight.grad.to_dense(), optimizer,
                                   step)
            ref.weight.grad = None
        else:
            opt.step()
        if w_ours is not None:
            torch.testing.assert_close(w_ours.grad, w_ref.grad, **CLOSE)
    torch.testing.assert_close(_rows_of(ours, keys), ref.weight.data, **CLOSE)
    return ours, ref, opt, keys, rw_state


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("pooling", [dynemb.PoolingMode.SUM, dynemb.PoolingMode.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
def test_ebc_matches_embedding_bag_and_torch_optimizer(name, pooling, weighted, backend):
    ours, ref, opt, keys, rw_state = _run_twins(OPTIMIZERS[name], pooling, weighted, backend)
    table = ours.tables["t"]
    state = table.export_batch(0, table.capacity())
    order = torch.argsort(state.keys)
    assert torch.equal(state.keys[order], keys)  # keys come out sorted by torch.unique
    st = state.optimizer_state[order]
    if name == "adagrad":
        torch.testing.assert_close(st, opt.state[ref.weight]["sum"], **CLOSE)
    elif name == "adam":
        s = opt.state[ref.weight]
        torch.testing.assert_close(st[:, :DIM], s["exp_avg"], **CLOSE)
        torch.testing.assert_close(st[:, DIM:], s["exp_avg_sq"], **CLOSE)
    elif name == "rowwise_adagrad":
        torch.testing.assert_close(st[:, 0], rw_state, **CLOSE)


def test_features_sharing_a_table_match_one_embedding_bag(backend):
    _run_twins(dynemb.Adam(lr=0.05), dynemb.PoolingMode.SUM, True, backend,
               features=("clicked", "item"))


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_weight_decay_matches_torch(name, backend):
    base = OPTIMIZERS[name]
    cfg = type(base)(**{**base.__dict__, "weight_decay": 0.05})
    _run_twins(cfg, dynemb.PoolingMode.SUM, False, backend, dense_ref=True)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_gradient_clipping_matches_clip_grad_norm(name, backend):
    base = OPTIMIZERS[name]
    cfg = type(base)(**{**base.__dict__, "max_grad_norm": 0.5})
    _run_twins(cfg, dynemb.PoolingMode.SUM, False, backend, dense_ref=True)


def test_sgd_step_is_minus_lr_times_summed_gradient(backend):
    """The embedding gradient itself: with SGD lr=1 a row moves by exactly -grad, and repeated
    ids (across bags and features) have their gradients summed."""
    keys = torch.tensor([11, 22, 33])
    ours = _dyn_collection(dynemb.EmbeddingBagCollection, dynemb.SGD(lr=1.0),
                           dynemb.PoolingMode.SUM, ["a", "b"], keys, backend)
    before = _rows_of(ours, keys).clone()
    batch = dynemb.SparseBatch.from_dict({"a": [[11, 11], [22]], "b": [[11], []]},
                                         weights={"a": [[1.0, 2.0], [0.5]], "b": [[3.0], []]})
    up = torch.arange(2 * 2 * DIM, dtype=torch.float32).view(2, 2 * DIM) / 10
    (ours(batch).values() * up).sum().backward()
    after = _rows_of(ours, keys)
    g11 = (1.0 + 2.0) * up[0, :DIM] + 3.0 * up[0, DIM:]
    g22 = 0.5 * up[1, :DIM]
    torch.testing.assert_close(before[0] - after[0], g11, **CLOSE)
    torch.testing.assert_close(before[1] - after[1], g22, **CLOSE)
    torch.testing.assert_close(before[2], after[2])  # untouched


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_embedding_collection_matches_nn_embedding(name, backend):
    keys = _keys()
    optimizer = OPTIMIZERS[name]
    ours = _dyn_collection(dynemb.EmbeddingCollection, optimizer, dynemb.PoolingMode.SUM,
                           ["a"], keys, backend)
    ref = torch.nn.Embedding(keys.numel(), DIM, sparse=True)
    ref.weight.data.copy_(_start_rows(keys))
    opt = _torch_optimizer(optimizer, ref.parameters())
    for batch, idx in _batches(keys, ["a"], weighted=False, cover_all=False):
        jagged = ours(batch)["a"]
        assert torch.equal(jagged.lengths, batch.lengths)
        expect = ref(idx)
        torch.testing.assert_close(jagged.values, expect, **CLOSE)
        proj = torch.linspace(-1, 1, DIM)
        (jagged.values * proj).sum().backward()
        opt.zero_grad()
        (expect * proj).sum().backward()
        opt.step()
    torch.testing.assert_close(_rows_of(ours, keys), ref.weight.data, **CLOSE)
