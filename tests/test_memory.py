"""Bounded memory: what persists between updates is parameters, optimiser state and the pooled
arenas, nothing else; a graph's memory goes with it; arenas grow on demand and
``dx.release_memory()`` gives them back. Device memory is measured as the bytes of
``jax.live_arrays()``, which is exact and deterministic (no allocator noise)."""
from __future__ import annotations

import gc
import types

import jax
import numpy as np
import optax
import pytest

import dynax as dx
from dynax.device import zeros
from dynax.executor import engine as engine_module
from dynax.graph.computation_graph import _engine


def device_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


def arena_bytes() -> int:
    return sum(a.nbytes for a in _engine().arenas.values())


class Tagger:
    def __init__(self):
        self.pc = pc = dx.ParameterCollection(seed=0)
        self.E = pc.add_lookup_parameters((50, 8), name="E")
        self.lstm = dx.nn.LSTMBuilder(1, 8, 12, pc)
        self.W = pc.add_parameters((4, 12), name="W")

    def loss(self, sentences):
        losses = []
        for words in sentences:
            hs = self.lstm.initial_state().transduce([self.E[w] for w in words])
            losses += [dx.pickneglogsoftmax(self.W @ h, w % 4) for h, w in zip(hs, words)]
        return dx.esum(losses)


def _batches(seed, n):
    rng = np.random.default_rng(seed)
    return [[list(rng.integers(0, 50, rng.integers(2, 12))) for _ in range(rng.integers(2, 9))]
            for _ in range(n)]


def _train_step(model, trainer, batch, strategy):
    dx.renew_cg(autobatch=strategy)
    loss = model.loss(batch)
    value = loss.scalar_value()
    loss.backward()
    trainer.update()
    return value


def test_device_memory_flat_over_repeated_varying_batches():
    dx.release_memory()
    model = Tagger()
    trainer = dx.Trainer(model.pc, optax.adam(1e-2))
    batches = _batches(0, 4)
    after = []
    for epoch in range(3):
        for b in batches:
            _train_step(model, trainer, b, "agenda")
        dx.renew_cg()
        gc.collect()
        after.append((device_bytes(), len(jax.live_arrays())))
    # the first epoch grows the arenas to the largest batch; later epochs hold exactly as much
    assert after[1] == after[2], after


def test_graph_memory_released_by_renew_cg():
    dx.release_memory()
    model = Tagger()
    batch = _batches(1, 1)[0] * 4

    def backward():
        dx.renew_cg(autobatch="agenda")
        loss = model.loss(batch)
        loss.backward()  # the forward saved vjp residuals; they live as long as the graph
        return loss

    backward()  # a first graph creates the gradient buffers, which persist
    dx.renew_cg()
    gc.collect()
    base = device_bytes()
    loss = backward()
    assert device_bytes() > base
    del loss
    dx.renew_cg()
    gc.collect()
    assert device_bytes() == base


def test_arenas_grow_on_demand_and_shrink_when_asked(monkeypatch):
    monkeypatch.setattr(engine_module, "ARENA_START_BYTES", 256)  # small first arenas
    dx.release_memory()
    assert arena_bytes() == 0
    model = Tagger()
    small = [[1, 2, 3]]
    large = [list(range(1, 40)) for _ in range(30)]  # many more rows than the small graph
    _loss_value(model, small, "agenda")
    small_bytes = arena_bytes()
    got = _loss_value(model, large, "agenda")
    assert arena_bytes() > small_bytes  # grew without any preallocation setting
    np.testing.assert_allclose(got, _loss_value(model, large, "none"), rtol=1e-5)
    dx.renew_cg()
    dx.release_memory()
    assert arena_bytes() == 0
    np.testing.assert_allclose(_loss_value(model, large, "agenda"), got, rtol=1e-6)


def _loss_value(model, batch, strategy):
    dx.renew_cg(autobatch=strategy)
    return model.loss(batch).scalar_value()


def test_arenas_grow_before_a_forward_runs_any_kernel(monkeypatch):
    """Kernels are compiled per arena capacity: an arena growing in the middle of a forward
    pass would make the kernels that ran before it compile again. All growth happens first."""
    dx.release_memory()
    events = []
    grow, run = engine_module.Engine._grow, engine_module.Engine._call_forward
    monkeypatch.setattr(engine_module.Engine, "_grow",
                        lambda self, akey, need: (events.append("grow"), grow(self, akey, need)))
    monkeypatch.setattr(engine_module.Engine, "_call_forward",
                        lambda self, *a: (events.append("run"), run(self, *a)))
    model = Tagger()
    rng = np.random.default_rng(0)
    sentences = [list(rng.integers(0, 50, size=n)) for n in rng.integers(3, 30, size=64)]
    dx.renew_cg()
    loss = model.loss(sentences)
    loss.value()
    assert "grow" in events and "run" in events  # the arenas started small and grew
    assert "grow" not in events[events.index("run"):], events


def test_a_grown_arena_has_headroom_for_a_slightly_larger_graph():
    """Kernels compile per arena capacity, so an arena sized exactly for the first graph
    would grow (and every kernel compile again) on the next, slightly larger one."""
    from dynax.ops.registry import akey_of
    eng = engine_module.Engine()
    akey = akey_of((128,), np.float32)  # 512-byte rows: a new arena starts at 2,048 rows
    eng._grow(akey, 2000)
    cap = eng.arenas[akey].shape[0]
    assert cap >= 2000 * engine_module.GROW_HEADROOM > 2048, cap
    grown = eng.arenas[akey]
    graph = types.SimpleNamespace(rows={})  # _alloc reads and updates only its rows
    eng._alloc(graph, akey, 2400, 2400)  # 20% more rows: no growth
    assert eng.arenas[akey] is grown


def test_gradient_buffers_are_zero_on_the_selected_device_and_compile_once():
    from dynax.device import get_device, zeros
    from dynax.graph.computation_graph import _compile_count
    a = zeros((3, 5), np.float32)
    assert a.shape == (3, 5) and a.dtype == np.float32 and not np.asarray(a).any()
    assert a.devices() == {get_device()}
    assert zeros((2,), np.int32).dtype == np.int32
    before = _compile_count()
    b = zeros((3, 5), np.float32)
    assert _compile_count() == before  # the fill is cached per (device, shape, dtype)
    assert b is not a  # a new buffer each call: gradient buffers are donated and updated


def test_gradient_arenas_are_reused_with_the_written_rows_cleared(monkeypatch):
    """A backward pass reuses the last one's gradient arenas, the rows it wrote set to zero
    again: gradients equal those computed with new arenas, and no new arena is made."""
    model = Tagger()
    first, second = _batches(3, 2)
    first = first * 3  # more rows than the second graph: all must be cleared

    def grads(batch):
        for p in model.pc.parameters():
            p.zero_grad()
        dx.renew_cg(autobatch="agenda")
        model.loss(batch).backward()
        return {p.name: np.asarray(p.grad) for p in model.pc.parameters()}

    dx.release_memory()
    expected = grads(second)  # new gradient arenas
    grads(first)  # leaves its written arenas behind
    made = []
    monkeypatch.setattr(engine_module, "zeros", lambda *a: made.append(a) or zeros(*a))
    got = grads(second)
    assert made == []  # every gradient arena was reused
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    dx.release_memory()
    assert _engine().spare_grads == {}


def test_clearing_a_gradient_arena_zeroes_its_rows_and_is_not_run_inline():
    """XLA:CPU runs computations of under 1,000 flops (its cost analysis) on the calling
    thread; a clear of many rows must not be one (``kernels._clear``), or it holds the
    Python thread while the device idles. The side product must survive XLA's passes."""
    from dynax.executor import kernels
    arena = jax.numpy.ones((64, 8), np.float32)
    kernels.compile_clear(arena, 40)
    cleared = np.asarray(kernels.clear_rows(arena, 40))
    assert not cleared[:40].any() and (cleared[40:] == 1).all()
    aval = jax.ShapeDtypeStruct((64, 8), np.float32)
    cost = jax.jit(kernels._clear, static_argnums=(1,)).lower(aval, 40).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] >= 1000


def test_a_large_arena_grows_in_smaller_steps(monkeypatch):
    """Past GROW_FAST_BYTES an arena grows 2x, not 4x, at a time (with its headroom): a
    chain of 103 values of 1 MiB took a 1 GiB arena, and a gradient arena as large, where
    512 MiB holds it (here at a 1 MiB threshold, to stay small)."""
    from dynax.ops.registry import akey_of
    monkeypatch.setattr(engine_module, "GROW_FAST_BYTES", 1 << 20)
    eng = engine_module.Engine()
    akey = akey_of((128,), np.float32)  # 512-byte rows: a new arena starts at 2,048 rows
    eng._grow(akey, 3000)
    assert eng.arenas[akey].shape[0] == 4096  # 2,048 x 2 >= 3,000 x 1.25 (4x: 8,192)
    monkeypatch.setattr(engine_module, "GROW_FAST_BYTES", 64 << 20)
    eng = engine_module.Engine()
    eng._grow(akey, 3000)
    assert eng.arenas[akey].shape[0] == 8192  # small arenas: 4x steps, fewer recompiles


def test_an_arena_of_large_values_starts_at_the_rows_asked_for(monkeypatch):
    """Values of which MIN_ROWS rows pass GROW_FAST_BYTES get an arena of the rows a graph
    asks for (with headroom), not MIN_ROWS: 16 rows of a 160 MB value took 2.5 GB, and
    a gradient arena as large, for 4 values (session 79's audit). Here at a 1 MiB
    threshold, with 256 KiB rows; values and gradients as jax.grad's."""
    monkeypatch.setattr(engine_module, "GROW_FAST_BYTES", 1 << 20)
    n = 1 << 16
    pc = dx.ParameterCollection(seed=0)
    P = pc.add_parameters((n,), name="P")
    x0 = np.linspace(-2, 2, n, dtype=np.float32)
    dx.release_memory()
    dx.renew_cg()
    y = dx.tanh(dx.input(x0) + P)
    loss = dx.sum_elems(dx.cmult(y, y))
    value = loss.value()
    loss.backward()
    f = jax.value_and_grad(lambda p: jax.numpy.sum(jax.numpy.tanh(x0 + p) ** 2))
    want, grad = f(jax.numpy.asarray(P.value))
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(P.grad, grad, rtol=1e-5, atol=1e-7)
    rows = [a.shape[0] for a in _engine().arenas.values() if a.shape[1:] == (n,)]
    assert rows and max(rows) < engine_module.MIN_ROWS, rows  # 4 values: 5 rows
    dx.release_memory()


def test_a_replaced_graph_lets_go_of_its_residuals_and_values():
    """Losses kept in a list (instead of their values) kept their graphs' saved residuals
    alive (~0.3 MB per update in an LSTM loop); a replaced graph drops them, and still
    reports its stats, while its expressions raise as before."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((8, 8), name="W")
    old = dx.renew_cg()
    h = dx.input(np.ones(8, np.float32))
    for _ in range(5):
        h = dx.tanh(W @ h)
    loss = dx.sum_elems(h)
    loss.value()
    loss.backward()
    assert old.batches and old.host_values
    n_batches = old.stats()["batches"]
    dx.renew_cg()
    assert old.batches == [] and old.host_values == {} and old.pending_reads == {}
    assert old.stats()["batches"] == n_batches
    with pytest.raises(dx.StaleExpressionError):
        loss.value()


def test_release_memory_ends_the_current_graph_instead_of_zeroing_its_values():
    """Its arenas held the graph's computed values: reading them, or building on them,
    afterwards is refused (it read zeros before), and the next graph works."""
    pc = dx.ParameterCollection(seed=0)
    W, E = pc.add_parameters((3, 4)), pc.add_lookup_parameters((10, 4))
    lstm = dx.LSTMBuilder(1, 4, 3, pc)
    dx.renew_cg()
    h = W @ E[2]
    h.forward()
    state = lstm.initial_state()
    dx.release_memory()
    for use in (lambda: h.npvalue(), lambda: h * 1.0, lambda: dx.sum_elems(h).backward(),
                lambda: state.add_input(E[1]), lambda: state.set_h([h])):
        with pytest.raises(dx.StaleExpressionError, match="dx.release_memory\\(\\) dropped"):
            use()
    h = W @ E[2]  # a new graph, started by the next operation
    np.testing.assert_allclose(h.npvalue(), np.asarray(W.value) @ np.asarray(E.value)[2],
                               rtol=1e-6)
    empty = dx.renew_cg()
    dx.release_memory()  # a graph without values stays current
    assert dx.current_graph() is empty


@pytest.mark.parametrize("first", ["lookup", "function", "tanh"])
def test_the_first_operation_after_release_memory_starts_a_new_graph(first):
    """Whichever op comes first after ``dx.release_memory()`` (before the fix, one that
    appended its node straight to the thread's ended graph raised AttributeError)."""
    pc = dx.ParameterCollection(seed=0)
    W, E = pc.add_parameters((3, 4)), pc.add_lookup_parameters((10, 4))
    first_column = dx.function(lambda W: 2.0 * W[:, 0])
    dx.renew_cg()
    (W @ E[1]).forward()
    ended = dx.current_graph()
    dx.release_memory()
    w, e = np.asarray(W.value), np.asarray(E.value)
    if first == "lookup":
        y, want = E[2], e[2]
    elif first == "function":
        y, want = first_column(W), 2 * w[:, 0]
    else:
        y, want = dx.tanh(W), np.tanh(w)
    assert dx.current_graph() is not ended
    np.testing.assert_allclose(y.npvalue(), want, rtol=1e-6)
