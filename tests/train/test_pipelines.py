"""Training pipelines in one process: exactly the eager loop (base, sparse_dist,
fused_sparse_dist, prefetch), semi_sync against a hand-written oracle of its schedule, draining,
mode switches, misuse."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb.errors import ConfigError, DynembError, InputError
from dynemb.train import PIPELINES, pipeline

import _pipes as P

EXACT = ("base", "sparse_dist", "fused_sparse_dist", "prefetch")


@pytest.mark.parametrize("kind", EXACT)
@pytest.mark.parametrize("opt", list(P.OPTIMIZERS))
def test_exact_pipelines_equal_the_eager_loop(kind, opt):
    data = P.batches(12, seed=3)
    caching = kind == "prefetch" or opt == "adam"
    ref_model, ref_opt = P.build(opt, caching=caching)
    want = P.eager(ref_model, ref_opt, data)
    model, dense = P.build(opt, caching=caching)
    got = P.piped(kind, model, dense, data)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    P.assert_same(P.state(model), P.state(ref_model))
    for t in model.ebc.tables.values():
        assert t.stats().stale_updates == 0
        assert t.held_rows() == 0


@pytest.mark.parametrize("kind, holds", [("base", False), ("sparse_dist", True),
                                         ("semi_sync", True)])
def test_rows_are_held_only_where_another_batch_can_run_in_between(kind, holds):
    """base (lead 0) runs nothing between a batch's lookup and its backward, so it holds no
    rows (holding cost make train about 12 %); the pipelines that pull ahead hold them."""
    model, dense = P.build("sgd")
    seen = []

    def forward(m, batch):
        out = m(batch)
        seen.append(sum(t.held_rows() for t in m.ebc.tables.values()))
        return out

    P.piped(kind, model, dense, P.batches(6, seed=3), forward=forward)
    assert (max(seen) > 0) == holds


def test_the_evicting_table_really_evicts():
    """The exactness above is over a full table that evicts every step."""
    model, dense = P.build("sgd")
    P.piped("sparse_dist", model, dense, P.batches(12, seed=3))
    assert model.ebc.tables["a"].stats().evicted > 0


def _semi_sync_oracle(data, start_batch: int, stash: bool):
    """Hand-written schedule of semi_sync over the raw table API: batch j >= max(start_batch, 1)
    is looked up (rows held) before batch j-1's forward; the others in their own step. One id
    per bag, distinct keys: pooling is the row itself, exact."""
    bag, seqt = P.tables(P.OPTIMIZERS["adagrad"], seq=False)
    tabs = {c.name: dynemb.DynamicTable(c) for c in bag}
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(mlp.parameters(), lr=0.01)
    looked: dict[int, dict] = {}

    def lookup(j):
        b = data[j].sparse
        out = {}
        for name, feats in (("a", ["fa"]), ("b", ["fb1", "fb2"])):
            keys = torch.cat([b.feature(f)[0] for f in feats])
            lk = tabs[name].lookup(keys, train=True, hold=True)
            rows = tabs[name].embeddings(lk).requires_grad_(True)
            out[name] = (lk, rows)
        looked[j] = out

    losses, stashed = [], None
    for i in range(len(data)):
        if i + 1 < len(data) and i + 1 >= max(start_batch, 1):
            lookup(i + 1)
        if i not in looked:
            lookup(i)
        parts = looked.pop(i)
        n = data[i].labels.numel()
        (lka, ra), (lkb, rb) = parts["a"], parts["b"]
        xa = torch.nn.functional.embedding(lka.inverse, ra)
        xb = torch.nn.functional.embedding(lkb.inverse, rb)
        x = torch.cat([xa, xb[:n], xb[n:]], dim=1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(mlp(x).squeeze(-1),
                                                                    data[i].labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        tabs["a"].apply_gradients(lka, ra.grad)
        tabs["b"].apply_gradients(lkb, rb.grad)
        if stash and i >= start_batch:
            stashed = P.swap_stash(list(mlp.parameters()), stashed)
        opt.step()
        losses.append(loss.detach())
    return losses, tabs, mlp


@pytest.mark.parametrize("start_batch", [0, 3])
@pytest.mark.parametrize("stash", [False, True])
def test_semi_sync_follows_its_schedule_exactly(start_batch, stash):
    data = P.batches(9, seed=5, distinct=True)
    want, tabs, mlp = _semi_sync_oracle(data, start_batch, stash)
    model, dense = P.build("adagrad", seq=False)
    got = P.piped("semi_sync", model, dense, data, start_batch=start_batch,
                  stash_gradients=stash)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    for name, t in model.ebc.tables.items():
        assert torch.equal(P.M.export(t)["embeddings"], P.M.export(tabs[name])["embeddings"])
        assert t.held_rows() == 0
    for p, q in zip(model.mlp.parameters(), mlp.parameters()):
        assert torch.equal(p, q)
    # and it is not the eager loop (the staleness is real)
    ref, ref_opt = P.build("adagrad", seq=False)
    eager = P.eager(ref, ref_opt, data)
    assert not all(torch.equal(a, b) for a, b in zip(got, eager))


@pytest.mark.parametrize("kind", PIPELINES)
@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_n_batches_give_n_steps_and_stop_iteration_repeats(kind, n):
    model, dense = P.build("sgd", caching=True)
    pipe = pipeline(kind, model=model, optimizer=dense, loss_fn=P.loss_fn)
    it = iter(P.batches(n))
    steps = []
    with pipe:
        while True:
            try:
                steps.append(pipe.progress(it))
            except StopIteration:
                break
            assert pipe.in_flight <= pipe.lead
        assert [s.index for s in steps] == list(range(n))
        for _ in range(2):
            with pytest.raises(StopIteration):
                pipe.progress(it)
        more = iter(P.batches(2, seed=9))  # a new iterator continues
        assert pipe.progress(more).index == n
        # base pulled nothing ahead; the others pulled the second batch
        assert [s.index for s in pipe.drain()] == ([n + 1] if pipe.lead else [])
        assert pipe.in_flight == 0


@pytest.mark.parametrize("kind,lead", [("base", 0), ("sparse_dist", 1), ("fused_sparse_dist", 1),
                                       ("semi_sync", 2), ("prefetch", 1)])
def test_each_kind_pulls_its_documented_lead(kind, lead):
    model, dense = P.build("sgd", caching=True)
    pulled = []

    def source():
        for b in P.batches(6):
            pulled.append(b)
            yield b

    it = source()
    with pipeline(kind, model=model, optimizer=dense, loss_fn=P.loss_fn) as pipe:
        pipe.progress(it)
        assert len(pulled) == 1 + lead and pipe.in_flight == lead
        pipe.progress(it)
        assert len(pulled) == 2 + lead


def test_drain_then_checkpoint_resume_equals_the_uninterrupted_run(tmp_path):
    """(Tables that do not evict after the resume: a loaded table places its rows in other
    slots, so among equal scores a full table may choose other victims than the table it was
    saved from, with or without a pipeline; see docs/pipelines.md.)"""
    data = P.batches(10, seed=7)
    ref, ref_opt = P.build("adam", caching=True, capacity=1024)
    want = P.eager(ref, ref_opt, data)
    model, dense = P.build("adam", caching=True, capacity=1024)
    pipe = pipeline("fused_sparse_dist", model=model, optimizer=dense, loss_fn=P.loss_fn)
    it = iter(data)
    got = [pipe.progress(it).loss for _ in range(4)]
    with pytest.raises(dynemb.checkpoint.CheckpointError, match="fused_sparse_dist"):
        dynemb.checkpoint.save(tmp_path / "ck", model=model, step=4)
    got += [s.loss for s in pipe.drain()]
    dynemb.checkpoint.save(tmp_path / "ck", model=model, dense_optimizer=dense, step=4)
    pipe.close()
    model2, dense2 = P.build("adam", caching=True, capacity=1024)
    dynemb.checkpoint.load(tmp_path / "ck", model=model2, dense_optimizer=dense2)
    got += P.piped("fused_sparse_dist", model2, dense2, data[len(got):])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    P.assert_same(P.state(model2), P.state(ref))


def test_eval_batches_update_nothing_and_mode_switches_affect_later_pulls():
    data = P.batches(6, seed=2)
    model, dense = P.build("sgd")
    before = P.state(model)
    with pipeline("sparse_dist", model=model, optimizer=dense, loss_fn=P.loss_fn) as pipe:
        pipe.eval()
        it = iter(data)
        s0 = pipe.progress(it)  # pulled batches 0 and 1 in eval mode
        pipe.train()  # batch 2 onwards train; batch 1 is already in flight in eval mode
        s1 = pipe.progress(it)
        assert not s0.training and not s1.training
        P.assert_same(P.state(model), before)
        s2 = pipe.progress(it)
        assert s2.training and s2.index == 2
    ref, ref_opt = P.build("sgd")
    with torch.no_grad():
        ref.eval()
        want = [P.loss_fn(ref(b), b) for b in data[:2]]
    assert torch.equal(s0.loss, want[0]) and torch.equal(s1.loss, want[1])


@pytest.mark.parametrize("kind", ["sparse_dist", "fused_sparse_dist", "semi_sync", "prefetch"])
def test_model_eval_then_model_train_between_calls_switches_back(kind):
    """A short ``model.eval()`` then ``model.train()`` between ``progress`` calls evaluates the
    batches pulled meanwhile and trains again after: the model is left in the mode batches are
    pulled in, so the switch back is seen (it was lost once, and training stopped silently)."""
    model, dense = P.build("sgd", caching=kind == "prefetch")
    modes = []
    with pipeline(kind, model=model, optimizer=dense, loss_fn=P.loss_fn) as pipe:
        it = iter(P.batches(10, seed=1))
        for k in range(10):
            if k == 3:
                model.eval()
                assert not model.training
            if k == 4:
                model.train()
            modes.append(pipe.progress(it).training)
            assert model.training == (k != 3)  # as the user left it
    evaluated = [i for i, m in enumerate(modes) if not m]
    assert evaluated == [3 + pipe.lead]


def test_a_forward_that_skips_or_copies_the_sparse_batch_raises_naming_the_collection():
    model, dense = P.build("sgd")

    class Copying(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, b):
            copy = dynemb.SparseBatch(features=b.sparse.features, values=b.sparse.values.clone(),
                                      lengths=b.sparse.lengths.clone())
            return self.inner(P.Batch(sparse=copy, labels=b.labels))

    with pipeline("sparse_dist", model=Copying(model), optimizer=dense,
                  loss_fn=P.loss_fn) as pipe, pytest.raises(InputError, match="did not stage"):
        pipe.progress(iter(P.batches(3)))
    model, dense = P.build("sgd")
    skip = lambda m, b: (m.mlp(torch.zeros(b.labels.numel(), 10)).squeeze(-1), None)  # noqa: E731
    pipe = pipeline("base", model=model, optimizer=dense, loss_fn=P.loss_fn, forward=skip)
    with pytest.raises(InputError, match="did not call EmbeddingBagCollection 'ebc'"):
        pipe.progress(iter(P.batches(3)))
    with pytest.raises(DynembError, match="an earlier step failed"):
        pipe.progress(iter(P.batches(3)))
    pipe.close()
    P.eager(model, dense, P.batches(2))  # usable on its own again


def test_construction_checks():
    model, dense = P.build("sgd")
    with pytest.raises(ConfigError, match="expected a kind"):
        pipeline("fast", model=model, loss_fn=P.loss_fn)
    with pytest.raises(ConfigError, match="no table is CACHING"):
        pipeline("prefetch", model=model, loss_fn=P.loss_fn)
    with pytest.raises(ConfigError, match="semi_sync"):
        pipeline("sparse_dist", model=model, loss_fn=P.loss_fn, start_batch=2)
    with pytest.raises(ConfigError, match="no dynemb collection"):
        pipeline("base", model=torch.nn.Linear(2, 2), loss_fn=P.loss_fn)
    model.ebc.scale = torch.nn.Parameter(torch.ones(1))  # read by the lookup stage, say
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="'scale' of EmbeddingBagCollection"):
        pipeline("fused_sparse_dist", model=model, optimizer=opt, loss_fn=P.loss_fn)
    with pipeline("base", model=model, loss_fn=P.loss_fn):
        with pytest.raises(InputError, match="already driven"):
            pipeline("base", model=model, loss_fn=P.loss_fn)


def test_step_time_split_is_reported():
    model, dense = P.build("sgd", caching=True)
    with pipeline("prefetch", model=model, optimizer=dense, loss_fn=P.loss_fn) as pipe:
        it = iter(P.batches(4))
        s = pipe.progress(it)
        s = pipe.progress(it)
    assert set(s.seconds) >= {"data", "input_dist", "lookup", "prefetch", "output_dist",
                              "dense", "backward", "optimizer", "total"}
    assert all(v >= 0 for v in s.seconds.values())
    assert s.seconds["lookup"] > 0 and s.seconds["backward"] > 0 and s.seconds["dense"] > 0


@pytest.mark.parametrize("kind", PIPELINES)
def test_grouped_tables_train_as_table_by_table_under_every_pipeline(kind):
    """The collection's tables run grouped (``dynemb.nn.grouped``), their lookups held where
    the pipeline pulls ahead: exactly what the same tables do one by one."""
    data = P.batches(10, seed=4)
    caching = kind == "prefetch"
    runs = []
    for grouped in (True, False):
        model, dense = P.build("adagrad", caching=caching)
        if not grouped:
            model.ebc._group = False
        seen = []  # rows held at each forward and right after each backward

        def held(m=model, seen=seen):
            seen.append(sum(t.held_rows() for t in m.ebc.tables.values()))

        def forward(m, batch, held=held):
            out = m(batch)
            held()
            return out

        runs.append((P.piped(kind, model, dense, data, forward=forward, after_backward=held),
                     P.state(model), seen, model))
    (got, got_state, got_held, model), (want, want_state, want_held, _) = runs
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    P.assert_same(got_state, want_state)
    assert got_held == want_held
    assert model.ebc._group and model.ebc._group.tables  # the group ran
    assert all(t.held_rows() == 0 for t in model.ebc.tables.values())
