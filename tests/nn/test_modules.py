"""EmbeddingBagCollection / EmbeddingCollection behaviour beyond the numeric twins: output API,
eval mode, admission and capacity through the module, bad input, rows evicted before backward."""

from __future__ import annotations

import logging

import pytest
import torch

import dynemb
from dynemb.errors import CapacityError, ConfigError, InputError


def _ebc(backend, **kw):
    kw.setdefault("optimizer", dynemb.SGD(lr=0.5))
    tables = [dynemb.TableConfig(name="item", dim=4, features=["item_id", "clicked"],
                                 capacity=64, **kw),
              dynemb.TableConfig(name="user", dim=3, features=["user_id"], capacity=64)]
    return dynemb.EmbeddingBagCollection(tables, backend=backend)


def _batch():
    return dynemb.SparseBatch.from_dict({"item_id": [[3], [7, 3]], "clicked": [[], [9, 9, 4]],
                                         "user_id": [[1], [2]]})


def test_keyed_embeddings_layout(backend):
    ebc = _ebc(backend)
    out = ebc(_batch())
    assert out.keys() == ("item_id", "clicked", "user_id")
    assert out.values().shape == (2, 4 + 4 + 3)
    assert out.dims() == (4, 4, 3)
    assert torch.equal(out["clicked"], out.values()[:, 4:8])
    assert list(out.to_dict()) == ["item_id", "clicked", "user_id"]
    assert torch.equal(out["clicked"][0], torch.zeros(4))  # empty bag
    rows = ebc.tables["item"].find(torch.tensor([9, 4])).values
    torch.testing.assert_close(out["clicked"][1], 2 * rows[0] + rows[1])
    with pytest.raises(KeyError):
        out["nope"]


@pytest.mark.parametrize("cls", ["bags", "rows"])
def test_a_step_leaves_no_reference_cycle(backend, cls, cyclic_garbage):
    """A training step's tensors (outputs, lookups, autograd nodes) are freed when the step's
    last reference goes, not when the garbage collector next runs: an output whose grad_fn held
    it through the node's state kept every step's outputs alive until a collection."""
    if cls == "bags":
        module = _ebc(backend)
    else:
        tables = [dynemb.TableConfig(name="item", dim=4, features=["item_id", "clicked"],
                                     capacity=64, optimizer=dynemb.SGD(lr=0.5)),
                  dynemb.TableConfig(name="user", dim=3, features=["user_id"], capacity=64)]
        module = dynemb.EmbeddingCollection(tables, backend=backend)

    def step():
        out = module(_batch())
        parts = [out.values()] if cls == "bags" else [j.values for j in out.values()]
        sum(p.sum() for p in parts).backward()

    step()
    assert cyclic_garbage(step) == []


def test_batch_feature_order_does_not_matter(backend):
    ebc = _ebc(backend)
    a = _batch()
    ebc(a)
    ebc.eval()
    b = dynemb.SparseBatch.from_dict({"user_id": [[1], [2]], "clicked": [[], [9, 9, 4]],
                                      "item_id": [[3], [7, 3]]})
    torch.testing.assert_close(ebc(a).values(), ebc(b).values())


def test_eval_mode_never_inserts_or_updates(backend):
    ebc = _ebc(backend)
    ebc(_batch())  # train: creates rows (no backward)
    table = ebc.tables["item"]
    before = table.export_batch(0, table.capacity())
    stats = table.stats()
    ebc.eval()
    out = ebc(dynemb.SparseBatch.from_dict({"item_id": [[3], [1000]], "clicked": [[4], [1001]],
                                            "user_id": [[1], [5]]}))
    assert not out.values().requires_grad
    assert torch.equal(out["item_id"][1], torch.zeros(4))  # unknown id: eval initializer
    after = table.export_batch(0, table.capacity())
    assert torch.equal(before.keys, after.keys) and torch.equal(before.scores, after.scores)
    assert torch.equal(before.embeddings, after.embeddings)
    assert table.stats().size == stats.size and table.stats().step == stats.step


def test_eval_initializer_is_used_for_unknown_ids(backend):
    init = dynemb.Initializer(kind=dynemb.InitKind.CONSTANT, value=0.25)
    ebc = _ebc(backend, eval_initializer=init)
    ebc.eval()
    out = ebc(_batch())
    torch.testing.assert_close(out["item_id"][1], torch.full((4,), 0.5))  # two unknown ids


def test_training_lookup_without_grad_inserts_but_does_not_update(backend):
    ebc = _ebc(backend)
    with torch.no_grad():
        out = ebc(_batch())
    assert not out.values().requires_grad
    assert ebc.tables["item"].size() == 4
    assert ebc.tables["item"].stats().optimizer_step == 0


def test_admission_through_the_module(backend):
    ebc = _ebc(backend, admission=dynemb.Admission(threshold=2, counter_capacity=64))
    table = ebc.tables["item"]
    batch = dynemb.SparseBatch.from_dict({"item_id": [[5], [6]], "clicked": [[6], []],
                                          "user_id": [[1], [2]]})
    out = ebc(batch)  # 5 seen once: rejected; 6 seen twice in the batch: admitted
    out.values().sum().backward()
    assert table.find(torch.tensor([5, 6])).found.tolist() == [False, True]
    assert torch.equal(out["item_id"][0], torch.zeros(4))
    assert table.stats().admission_rejected == 1
    ebc(batch).values().sum().backward()  # 5 seen the second time
    assert bool(table.find(torch.tensor([5])).found[0])


def test_capacity_error_names_the_table(backend):
    ebc = dynemb.EmbeddingBagCollection(
        [dynemb.TableConfig(name="tiny", dim=2, features=["f"], capacity=8)], backend=backend)
    batch = dynemb.SparseBatch(features=["f"], values=torch.arange(20), lengths=torch.tensor([20]))
    with pytest.raises(CapacityError, match="tiny"):
        ebc(batch)


def test_on_full_warn_gives_eval_rows_and_counts(backend, caplog):
    ebc = dynemb.EmbeddingBagCollection(
        [dynemb.TableConfig(name="tiny", dim=2, features=["f"], capacity=8,
                            on_full=dynemb.OnFull.WARN)], backend=backend)
    batch = dynemb.SparseBatch(features=["f"], values=torch.arange(20),
                               lengths=torch.ones(20, dtype=torch.int64))
    with caplog.at_level(logging.WARNING, logger="dynemb"):
        out = ebc(batch)
    out.values().sum().backward()
    assert "could not get a row" in caplog.text
    stats = ebc.tables["tiny"].stats()
    assert stats.failed_inserts == 12 and stats.size == 8
    assert int((out.values().abs().sum(1) == 0).sum()) == 12


def test_rows_evicted_before_backward_are_counted_not_misapplied(backend):
    """Another lookup between forward and backward evicts rows of the first: the backward updates
    only rows still owned by its keys, and counts the others."""
    cfg = dynemb.TableConfig(name="t", dim=2, features=["f"], capacity=8,
                             optimizer=dynemb.SGD(lr=1.0))
    ebc = dynemb.EmbeddingBagCollection([cfg], backend=backend)
    table = ebc.tables["t"]
    first = dynemb.SparseBatch(features=["f"], values=torch.arange(8), lengths=torch.ones(8, dtype=torch.int64))
    out = ebc(first)
    table.find_or_insert(torch.arange(100, 104))  # evicts 4 of the first batch's rows
    newcomers = table.find(torch.arange(100, 104)).values.clone()
    out.values().sum().backward()
    stats = table.stats()
    assert stats.stale_updates == 4
    torch.testing.assert_close(table.find(torch.arange(100, 104)).values, newcomers)
    survivors = table.find(torch.arange(8))
    assert int(survivors.found.sum()) == 4


def test_bad_batches_are_refused(backend):
    ebc = _ebc(backend)
    with pytest.raises(InputError, match="unknown \\['other'\\]"):
        ebc(dynemb.SparseBatch.from_dict({"item_id": [[1]], "clicked": [[1]], "user_id": [[1]],
                                          "other": [[1]]}))
    with pytest.raises(InputError, match="missing \\['user_id'\\]"):
        ebc(dynemb.SparseBatch.from_dict({"item_id": [[1]], "clicked": [[1]]}))
    with pytest.raises(InputError, match="SparseBatch"):
        ebc({"item_id": [[1]]})


def test_collection_config_errors():
    t = dynemb.TableConfig(name="a", dim=2, features=["f"], capacity=8)
    with pytest.raises(ConfigError, match="distinct"):
        dynemb.EmbeddingBagCollection([t, t])
    u = dynemb.TableConfig(name="b", dim=2, features=["f"], capacity=8)
    with pytest.raises(ConfigError, match="feature 'f'"):
        dynemb.EmbeddingBagCollection([t, u])
    with pytest.raises(ConfigError):
        dynemb.EmbeddingBagCollection([])


def test_embedding_collection_output_and_weights_refused(backend):
    ec = dynemb.EmbeddingCollection(
        [dynemb.TableConfig(name="t", dim=3, features=["a", "b"], capacity=64)], backend=backend)
    batch = dynemb.SparseBatch.from_dict({"a": [[1, 2], []], "b": [[2], [3, 1, 1]]})
    out = ec(batch)
    assert out["a"].values.shape == (2, 3) and out["b"].values.shape == (4, 3)
    assert out["b"].lengths.tolist() == [1, 3]
    assert out["b"].offsets().tolist() == [0, 1, 4]
    torch.testing.assert_close(out["a"].values[1], out["b"].values[0])  # id 2 twice
    assert [s.shape[0] for s in out["b"].split()] == [1, 3]
    weighted = dynemb.SparseBatch.from_dict({"a": [[1]], "b": [[2]]}, weights={"a": [[1.0]], "b": [[1.0]]})
    with pytest.raises(InputError, match="weights"):
        ec(weighted)


def test_a_batch_without_ids(backend):
    ebc = _ebc(backend)
    empty = dynemb.SparseBatch(features=["item_id", "clicked", "user_id"],
                               values=torch.zeros(0, dtype=torch.int64),
                               lengths=torch.zeros(6, dtype=torch.int64))
    out = ebc(empty)
    assert torch.equal(out.values(), torch.zeros(2, 11))
    out.values().sum().backward()


def test_a_batch_of_zero_samples(backend):
    ebc = _ebc(backend)
    empty = dynemb.SparseBatch(features=["item_id", "clicked", "user_id"],
                               values=torch.zeros(0, dtype=torch.int64),
                               lengths=torch.zeros(0, dtype=torch.int64))
    out = ebc(empty)
    assert out.values().shape == (0, 11)
    out.values().sum().backward()
    ebc.eval()
    assert ebc(empty).values().shape == (0, 11)
    ec = dynemb.EmbeddingCollection(
        [dynemb.TableConfig(name="t", dim=3, features=["a"], capacity=64)], backend=backend)
    got = ec(dynemb.SparseBatch(features=["a"], values=torch.zeros(0, dtype=torch.int64),
                                lengths=torch.zeros(0, dtype=torch.int64)))
    assert got["a"].values.shape == (0, 3) and got["a"].lengths.numel() == 0


def test_weight_gradient_uses_the_rows_forward_saw(backend):
    """Two forwards, then one backward: the second forward's update must not leak into the
    first's weight gradient (rows change only in backward, but backward order is autograd's)."""
    cfg = dynemb.TableConfig(name="t", dim=2, features=["f"], capacity=64,
                             optimizer=dynemb.SGD(lr=1.0))
    ebc = dynemb.EmbeddingBagCollection([cfg], backend=backend)
    ebc.tables["t"].insert_or_assign(torch.tensor([1]), torch.ones(1, 2))
    w1 = torch.ones(1, requires_grad=True)
    w2 = torch.ones(1, requires_grad=True)
    b1 = dynemb.SparseBatch(features=["f"], values=torch.tensor([1]), lengths=torch.tensor([1]),
                            weights=w1)
    b2 = dynemb.SparseBatch(features=["f"], values=torch.tensor([1]), lengths=torch.tensor([1]),
                            weights=w2)
    (ebc(b1).values().sum() + ebc(b2).values().sum()).backward()
    assert w1.grad.tolist() == [2.0] and w2.grad.tolist() == [2.0]


def test_a_batch_changed_after_construction_is_refused(backend):
    ebc = _ebc(backend)
    batch = _batch()
    batch.lengths[0] = 5
    with pytest.raises(InputError, match="changed after"):
        ebc(batch)


def _rows(table: dynemb.DynamicTable) -> dict[int, torch.Tensor]:
    b = table.export_batch(0, table.capacity())
    full = torch.cat([b.embeddings, b.optimizer_state], dim=1)
    return {k: full[i].clone() for i, k in enumerate(b.keys.tolist())}


@pytest.mark.parametrize("kind", ["ebc", "ec"])
@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_a_nan_loss_in_one_sample_reaches_no_row(backend, kind, nonfinite):
    """A gradient that is NaN for one sample's bag: SKIP updates every other row and leaves the
    NaN bag's rows (and Adam state) as they were; RAISE fails backward with an error naming the
    table, and updates no row."""
    cfg = dynemb.TableConfig(name="item", dim=4, features=["item_id"], capacity=64,
                             optimizer=dynemb.Adam(lr=0.1), nonfinite=nonfinite)
    cls = dynemb.EmbeddingBagCollection if kind == "ebc" else dynemb.EmbeddingCollection
    module = cls([cfg], backend=backend)
    batch = dynemb.SparseBatch.from_dict({"item_id": [[1, 2], [3], [2]]})
    module(batch)                                  # creates the rows
    table = module.tables["item"]
    before = _rows(table)
    out = module(batch)
    if kind == "ebc":
        w = torch.ones_like(out.values())
        w[1, 0] = float("nan")                     # sample 1's bag: key 3 only
        loss = (out.values() * w).sum()
    else:
        w = torch.ones_like(out["item_id"].values)
        w[2, 0] = float("nan")                     # the third id: key 3
        loss = (out["item_id"].values * w).sum()
    if nonfinite == "raise":
        with pytest.raises(InputError, match="'item'.*1 gradient row"):
            loss.backward()
        after = _rows(table)
        assert all(torch.equal(before[k], after[k]) for k in before)
    else:
        loss.backward()
        after = _rows(table)
        assert torch.equal(after[3], before[3])
        assert not torch.equal(after[1], before[1]) and not torch.equal(after[2], before[2])
        assert all(bool(torch.isfinite(r).all()) for r in after.values())
    assert table.stats().nonfinite_grads == 1


@pytest.mark.parametrize("backend, grad, sharded", [("torch", False, False), ("numba", True, False),
                                                   ("numba", False, True)])
def test_a_batch_refilled_between_forward_and_backward_does_not_reach_backward(
        backend, grad, sharded, request):
    """A loader may refill its buffers once forward has run: backward reads the ids, lengths
    and weights forward took (copies), never the batch's tensors as they are then (single
    process, and sharded over a gloo group of one)."""
    if sharded:
        request.getfixturevalue("group_of_one")

    def run(refill: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg = dynemb.TableConfig(name="t", dim=2, features=["f"], capacity=64,
                                 optimizer=dynemb.SGD(lr=1.0), pooling=dynemb.PoolingMode.MEAN)
        ebc = dynemb.EmbeddingBagCollection([cfg], backend=backend)
        if sharded:
            ebc = dynemb.distributed.shard(ebc)
        lengths = torch.tensor([2, 0, 1])
        weights = torch.tensor([1.0, 2.0, 3.0], requires_grad=grad)
        batch = dynemb.SparseBatch(features=["f"], values=torch.tensor([5, 6, 7]),
                                   lengths=lengths, weights=weights)
        out = ebc(batch).values()
        if refill:
            with torch.no_grad():
                lengths.copy_(torch.tensor([1, 1, 1]))
                weights.fill_(100.0)
        out.sum().backward()
        return ebc.tables["t"].find(torch.tensor([5, 6, 7])).values, weights.grad

    (rows, wgrad), (rows_refilled, wgrad_refilled) = run(False), run(True)
    assert torch.equal(rows, rows_refilled)
    assert (wgrad is None and wgrad_refilled is None) or torch.equal(wgrad, wgrad_refilled)
