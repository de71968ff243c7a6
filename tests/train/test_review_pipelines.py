"""Adversarial review of the training pipelines (one process): cases the pipeline tests do not
cover (weight gradients, empty batches, admission and LFU, on_full COUNT, full CACHING tables,
non-finite gradients), misuse (an output the loss ignores, a collection called twice, failures
in the iterator or the loss, alternating iterators, use after close), mode switches, and leaks.
The multi-process cases are in test_review_pipelines_sharded.py."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import dynemb
from dynemb.errors import DynembError, InputError
from dynemb.train import PIPELINES, pipeline

import _pipes as P
from _review_jobs import Batch, Net, build, configs, data, eager, held, loss_fn, run

EXACT = ("base", "sparse_dist", "fused_sparse_dist", "prefetch")


def assert_like_eager(kind: str, cfgs, make, net=Net, **kw) -> None:
    """``kind`` over ``make()`` equals the eager loop over ``make()``: losses, outputs, rows,
    optimizer state, scores, dense parameters, weight gradients and table counters."""
    want_data, got_data = make(), make()
    ref, ref_opt = build(cfgs, net)
    want = eager(ref, ref_opt, want_data)
    model, opt = build(cfgs, net)
    got = run(kind, model, opt, got_data, **kw)
    assert len(got) == len(want)
    for (gl, go), (wl, wo) in zip(got, want):
        assert torch.equal(gl, wl) and torch.equal(go, wo)
    P.M.assert_same_tables(P.M.snapshot(model), P.M.snapshot(ref))
    for p, q in zip(model.mlp.parameters(), ref.mlp.parameters()):
        assert torch.equal(p, q)
    for g, w in zip(got_data, want_data):
        if isinstance(w.sparse, dynemb.SparseBatch) and w.sparse.weights is not None \
                and w.sparse.weights.requires_grad:
            assert torch.equal(g.sparse.weights.grad, w.sparse.weights.grad)
    for name, t in model.ebc.tables.items():
        s, r = t.stats(), ref.ebc.tables[name].stats()
        for f in ("evicted", "failed_inserts", "admission_rejected", "nonfinite_grads",
                  "stale_updates", "inserted"):
            assert getattr(s, f) == getattr(r, f), (name, f)
    assert held(model) == 0


# ---------------------------------------------------------------------- exactness, held up

ADMIT = dict(admission=dynemb.Admission(threshold=2, counter_capacity=64))
LFU = dict(score=dynemb.ScorePolicy.LFU)
COUNT = dict(on_full=dynemb.OnFull.COUNT, capacity=16, bucket_capacity=16)
CACHED = dict(storage=dynemb.Storage(mode=dynemb.StorageMode.CACHING, cache_load_factor=0.25),
              capacity=64, bucket_capacity=16, on_full=dynemb.OnFull.COUNT)
CASES = {
    # weights needing a gradient (the pooled weight-gradient path keeps the entries)
    "weight_grads": (configs(b=CACHED), lambda: data(8, weighted=True, wgrad=True)),
    # empty batches among others; MEAN bags are often empty
    "empty_batches": (configs(b=CACHED), lambda: data(8, empty_at=(0, 3, 7))),
    # admission and LFU count occurrences; full tables evict
    "admission_lfu": (configs(a={**ADMIT, **LFU}, b={**CACHED, **LFU, **ADMIT}),
                      lambda: data(10, hi=200)),
    # tables too small for a batch: on_full COUNT gives keys no row, counted
    "on_full_count": (configs(a=COUNT, b={**CACHED, **COUNT, "capacity": 32}),
                      lambda: data(8, hi=400, maxlen=8)),
    # full CACHING tables whose cache (16 rows) is smaller than one batch's keys
    "cache_smaller_than_batch": (configs(a=CACHED, b={**CACHED, **LFU}),
                                 lambda: data(10, hi=300, maxlen=8, weighted=True, wgrad=True)),
}


@pytest.mark.parametrize("kind", EXACT)
@pytest.mark.parametrize("case", list(CASES))
def test_exact_kinds_equal_the_eager_loop_in_hard_cases(kind, case):
    cfgs, make = CASES[case]
    assert_like_eager(kind, cfgs, make)


def test_the_hard_cases_really_exercise_their_paths():
    """(So the exactness above is not vacuous.)"""
    model, opt = build(CASES["on_full_count"][0])
    eager(model, opt, CASES["on_full_count"][1]())
    assert all(t.stats().failed_inserts > 0 for t in model.ebc.tables.values())
    model, opt = build(CASES["cache_smaller_than_batch"][0])
    batches = CASES["cache_smaller_than_batch"][1]()
    eager(model, opt, batches)
    assert all(t.stats().evicted > 0 and t.stats().cache_evictions > 0
               for t in model.ebc.tables.values())
    assert max(int(torch.unique(b.sparse.values).numel()) for b in batches) > 16


class NanNet(Net):
    """Gradient rows of the pooled output turn NaN on every batch with more than 2 positives."""

    def forward(self, b: Batch) -> torch.Tensor:
        v = self.ebc(b.sparse).values()
        if v.requires_grad and v.shape[0] and b.labels.sum() > 2:
            v.register_hook(lambda g: torch.where(
                torch.arange(g.shape[0])[:, None] == 0, float("nan"), g))
        return self.mlp(v).squeeze(-1)


@pytest.mark.parametrize("kind", EXACT)
def test_nonfinite_gradients_skipped_exactly_as_in_the_eager_loop(kind):
    assert_like_eager(kind, configs(b=CACHED), lambda: data(8), net=NanNet)
    model, opt = build(configs(b=CACHED), NanNet)
    eager(model, opt, data(8))
    assert all(t.stats().nonfinite_grads > 0 for t in model.ebc.tables.values())


@pytest.mark.parametrize("kind", PIPELINES)
def test_nonfinite_raise_fails_the_pipeline_releasing_every_hold(kind):
    raising = dict(nonfinite=dynemb.NonFinite.RAISE, capacity=256)
    cfgs = configs(a=raising, b={**CACHED, **raising, "capacity": 256})
    model, opt = build(cfgs, NanNet)
    pipe = pipeline(kind, model=model, optimizer=opt, loss_fn=loss_fn)
    it = iter(data(8))
    with pytest.raises(InputError, match="NaN or inf"):
        while True:
            pipe.progress(it)
    assert held(model) == 0
    with pytest.raises(DynembError, match="an earlier step failed"):
        pipe.progress(it)
    pipe.close()
    assert held(model) == 0
    model.ebc(data(1, seed=5)[0].sparse)  # the collection works on its own again


def test_semi_sync_with_start_batch_beyond_the_run_is_the_eager_loop():
    assert_like_eager("semi_sync", configs(b=CACHED), lambda: data(5), start_batch=7)


# ---------------------------------------------------------------------- misuse, failures, leaks


class IgnoresSequence(torch.nn.Module):
    """Calls both collections; its loss uses the pooled output only (the sequence rows are
    read for a metric, say): their backward never runs."""

    def __init__(self, table_s: dynemb.TableConfig) -> None:
        super().__init__()
        self.ebc = dynemb.EmbeddingBagCollection(configs(b=CACHED), feature_policy="ignore")
        self.ec = dynemb.EmbeddingCollection([table_s], feature_policy="ignore")
        torch.manual_seed(0)
        self.mlp = torch.nn.Linear(10, 1)

    def forward(self, b: Batch) -> torch.Tensor:
        seq = self.ec(b.sparse)["fb1"].values
        return self.mlp(self.ebc(b.sparse).values()).squeeze(-1) + 0 * seq.detach().sum()


@pytest.mark.parametrize("kind", PIPELINES)
def test_an_output_the_loss_does_not_use_leaves_no_row_held(kind):
    """The sequence table (16 rows, LRU, on_full RAISE) evicts its way through 200 distinct
    ids in the eager loop; rows a pipeline held for a batch whose backward never reached the
    table must be released when the batch is done, or they pile up until no key gets a row."""
    table_s = dynemb.TableConfig(name="s", dim=2, features=["fb1"], capacity=16,
                                 bucket_capacity=16)
    make = lambda: data(10, hi=200, maxlen=3)  # noqa: E731
    ref = IgnoresSequence(table_s)
    ref_opt = torch.optim.Adam(ref.mlp.parameters(), lr=0.01)
    want = eager(ref, ref_opt, make())
    model = IgnoresSequence(table_s)
    opt = torch.optim.Adam(model.mlp.parameters(), lr=0.01)
    got = run(kind, model, opt, make())  # (today: CapacityError, every row of "s" held)
    assert len(got) == 10 and held(model) == 0
    if kind != "semi_sync":
        assert [loss for loss, _ in got] == [loss for loss, _ in want]
        P.M.assert_same_tables(P.M.snapshot(model), P.M.snapshot(ref))


def _counting(batches, log: list):
    for b in batches:
        log.append(b)
        yield b


@pytest.mark.parametrize("kind", PIPELINES)
def test_a_collection_called_twice_per_batch_raises_naming_it_and_holds_nothing(kind):
    class Twice(Net):
        def forward(self, b):
            self.ebc(b.sparse)
            return super().forward(b)

    model, opt = build(configs(b=CACHED), Twice)
    pipe = pipeline(kind, model=model, optimizer=opt, loss_fn=loss_fn)
    with pytest.raises(InputError, match="EmbeddingBagCollection: called with a batch the "
                                         "pipeline .* did not stage"):
        pipe.progress(iter(data(4)))
    assert held(model) == 0
    pipe.close()
    assert held(model) == 0 and model.ebc.in_flight == 0
    eager(model, opt, data(2))  # usable on its own again


class Boom(Exception):
    pass


def _raising_iterator(batches, at: int):
    for i, b in enumerate(batches):
        if i == at:
            raise Boom(f"loader failed at {i}")
        yield b


@pytest.mark.parametrize("kind", PIPELINES)
@pytest.mark.parametrize("where", ["iterator", "loss_fn"])
def test_a_failure_in_the_iterator_or_the_loss_releases_everything(kind, where):
    model, opt = build(configs(b=CACHED))
    calls = []

    def bad_loss(out, b):
        calls.append(1)
        if len(calls) == 3:
            raise Boom("loss failed")
        return loss_fn(out, b)

    pipe = pipeline(kind, model=model, optimizer=opt,
                    loss_fn=bad_loss if where == "loss_fn" else loss_fn)
    it = _raising_iterator(data(6), 3) if where == "iterator" else iter(data(6))
    with pytest.raises(Boom):
        for _ in range(6):
            pipe.progress(it)
    assert held(model) == 0
    with pytest.raises(DynembError, match="an earlier step failed .*Boom"):
        pipe.progress(iter(data(2)))
    if pipe.lead and where == "loss_fn":  # batches still staged: no checkpoint until close()
        with pytest.raises(dynemb.checkpoint.CheckpointError, match="drain"):
            dynemb.checkpoint.save("/nonexistent/never", model=model, step=1)
    pipe.close()
    pipe.close()  # idempotent
    with pytest.raises(DynembError, match="closed; build a new pipeline"):
        pipe.progress(iter(data(2)))
    assert held(model) == 0 and model.ebc.in_flight == 0
    # the collections work on their own, and a new pipeline drives them
    eager(model, opt, data(2))
    assert len(run(kind, model, opt, data(3))) == 3 and held(model) == 0


@pytest.mark.parametrize("kind", PIPELINES)
def test_alternating_iterators_train_every_batch_once_in_pull_order(kind):
    model, opt = build(configs(b=CACHED))
    one, two = data(4, seed=1), data(4, seed=2)
    pulled: list = []
    it1, it2 = _counting(one, pulled), _counting(two, pulled)
    trained = []
    with pipeline(kind, model=model, optimizer=opt, loss_fn=loss_fn) as pipe:
        for it in (it1, it2, it1, it2, it1, it2):
            trained.append(pipe.progress(it))
        trained += pipe.drain()
    assert [s.batch for s in trained] == pulled
    assert [s.index for s in trained] == list(range(len(pulled)))
    assert held(model) == 0


@pytest.mark.parametrize("kind", PIPELINES)
@pytest.mark.parametrize("how", ["pipeline", "model"])
def test_a_mode_switch_takes_effect_lead_batches_later(kind, how):
    model, opt = build(configs(b=CACHED))
    pipe = pipeline(kind, model=model, optimizer=opt, loss_fn=loss_fn)
    it = iter(data(12))
    modes = []
    with pipe:
        modes.append(pipe.progress(it).training)  # batch 0
        pipe.eval() if how == "pipeline" else model.eval()
        for _ in range(4):
            modes.append(pipe.progress(it).training)
        pipe.train() if how == "pipeline" else model.train()
        modes += [pipe.progress(it).training for _ in range(5)]
    lead = pipe.lead
    want = [True] * (1 + lead) + [False] * 4 + [True] * (5 - lead)
    assert modes == want
    assert held(model) == 0
    # the eval batches applied no update, the train batches one each
    assert all(t.stats().optimizer_step == sum(modes) for t in model.ebc.tables.values())


def test_semi_sync_stash_with_optimizer_params_that_get_no_gradient():
    model, _ = build(configs(b=CACHED))
    unused = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([*model.mlp.parameters(), unused], lr=0.1)
    got = run("semi_sync", model, opt, data(6), start_batch=1, stash_gradients=True)
    assert len(got) == 6 and torch.equal(unused.detach(), torch.ones(3)) and held(model) == 0


@pytest.mark.parametrize("kind", PIPELINES)
def test_nothing_keeps_trained_batches_or_their_graphs_alive(kind):
    model, opt = build(configs(b=CACHED))
    batches = data(30, weighted=True, wgrad=True)
    refs = [weakref.ref(b) for b in batches]
    it = (batches.pop(0) for _ in range(len(batches)))  # keeps no pulled batch
    outputs = []
    with pipeline(kind, model=model, optimizer=opt, loss_fn=loss_fn) as pipe:
        for _ in range(20):
            step = pipe.progress(it)
            outputs.append(weakref.ref(step.output))
            del step
        gc.collect()
        alive = [i for i, r in enumerate(refs) if r() is not None]
        # the batches in flight, and the iterator's list holds the rest
        assert alive == list(range(20, 30))
        assert all(o() is None for o in outputs)
    del it, batches
    gc.collect()
    assert all(r() is None for r in refs)  # a closed pipeline keeps no batch either


@pytest.mark.parametrize("kind", ["base", "semi_sync"])
@pytest.mark.parametrize("where", ["loss_fn", "optimizer"])
def test_stop_iteration_inside_a_step_is_an_error_not_the_end_of_the_data(kind, where):
    """A StopIteration escaping the model, the loss or the optimizer (a helper's ``next()`` on
    an exhausted iterator, say) must not end the user's ``except StopIteration: break`` loop
    as if the data had run out, with the batch half trained and its rows held."""
    model, opt = build(configs(b=CACHED))
    calls = []

    def step_hook(*_):
        calls.append(1)
        if len(calls) == 3:
            next(iter([]))

    if where == "optimizer":
        opt.register_step_pre_hook(step_hook)
    pipe = pipeline(kind, model=model, optimizer=opt,
                    loss_fn=(lambda o, b: (step_hook(), loss_fn(o, b))[1])
                    if where == "loss_fn" else loss_fn)
    it, steps = iter(data(6)), 0
    with pytest.raises(DynembError, match="StopIteration was raised inside a step") as err:
        while True:
            pipe.progress(it)
            steps += 1
    assert steps == 2 and isinstance(err.value.__cause__, StopIteration)
    assert held(model) == 0
    pipe.close()


def test_a_model_that_converts_the_batch_to_a_kjt_raises_naming_the_collection():
    pytest.importorskip("torchrec")

    class Converting(Net):
        def forward(self, b):
            return self.mlp(self.ebc(b.sparse.to_kjt()).values()).squeeze(-1)

    model, opt = build(configs(b=CACHED), Converting)
    eager(model, opt, data(2))  # fine without a pipeline
    with pipeline("sparse_dist", model=model, optimizer=opt, loss_fn=loss_fn) as pipe, \
            pytest.raises(InputError, match="EmbeddingBagCollection: called with a batch the "
                                            "pipeline 'sparse_dist' .* did not stage"):
        pipe.progress(iter(data(3)))
    assert held(model) == 0


def test_batches_whose_sparse_part_is_a_kjt_train_exactly():
    pytest.importorskip("torchrec")

    def make():
        return [Batch(b.sparse.to_kjt(), b.labels) for b in data(6)]

    assert_like_eager("fused_sparse_dist", configs(b=CACHED), make)


@pytest.mark.parametrize("what", ["load", "export_incremental"])
def test_checkpoint_load_and_export_refused_with_batches_in_flight(tmp_path, what):
    model, opt = build(configs())
    eager(model, opt, data(2))
    dynemb.checkpoint.save(tmp_path / "ck", model=model, step=2)
    with pipeline("semi_sync", model=model, optimizer=opt, loss_fn=loss_fn) as pipe:
        pipe.progress(iter(data(4, seed=3)))
        assert pipe.in_flight == 2
        mid = P.M.snapshot(model)
        with pytest.raises(dynemb.checkpoint.CheckpointError,
                           match=f"{what}: the pipeline 'semi_sync' .* holds 2 batch"):
            if what == "load":
                dynemb.checkpoint.load(tmp_path / "ck", model=model)
            else:
                dynemb.checkpoint.export_incremental(tmp_path / "inc", model=model,
                                                     since_step=2, step=3)
        P.M.assert_same_tables(P.M.snapshot(model), mid)  # nothing changed
        pipe.drain()
    assert not (tmp_path / "inc").exists()


def test_a_pipeline_over_a_collection_another_pipeline_drives_changes_nothing():
    model, opt = build(configs())

    class Two(torch.nn.Module):  # a free collection first, then the driven one
        def __init__(self):
            super().__init__()
            self.free = dynemb.EmbeddingBagCollection(configs(a={"name": "c"}, b={"name": "d"}))
            self.shared = model.ebc

    other = Two()
    with pipeline("sparse_dist", model=model, optimizer=opt, loss_fn=loss_fn) as pipe:
        pipe.progress(iter(data(3)))
        with pytest.raises(InputError, match="already driven by the pipeline 'sparse_dist'"):
            pipeline("base", model=other, loss_fn=loss_fn)
        assert pipe.in_flight == 1 and model.ebc.in_flight == 1
    other.free(data(1)[0].sparse)  # the free one was not left attached
    assert held(model) == 0
