"""The agenda's plan is streamed: the executor launches the first batches while the agenda
picks the rest. That must not change a value or a gradient (``autobatch="none"``,
``jax.grad``), and must not grow an arena beyond what the whole plan would: a streamed pass
reserves rows by a bound, so it runs only where the arenas already hold that bound."""
from __future__ import annotations

import jax
import numpy as np

import dynax as dx
from dynax.batcher import plans as plans_mod
from dynax.batcher import strategies
from dynax.executor import engine as engine_mod
from dynax.graph.computation_graph import _engine

from test_plans import Chains, _run

TOL = dict(rtol=1e-5, atol=1e-5)


def _batch(seed, n=6):
    rng = np.random.default_rng(seed)
    return [(list(rng.integers(0, 10, int(rng.integers(2, 7)))), int(rng.integers(0, 4)))
            for _ in range(n)]


def _events(monkeypatch):
    """Log each batch the agenda yields, the end of its plan, and each kernel launch."""
    log = []
    agenda = strategies._agenda

    def logged_agenda(graph, lo, hi):
        for batch in agenda(graph, lo, hi):
            log.append("batch")
            yield batch
        log.append("end")

    launch = engine_mod.Engine._launch

    def logged_launch(self, g, run, *rest):
        log.append("launch")
        return launch(self, g, run, *rest)

    monkeypatch.setattr(strategies, "_agenda", logged_agenda)
    monkeypatch.setattr(engine_mod.Engine, "_launch", logged_launch)
    return log


def test_a_streamed_forward_launches_before_the_plan_ends_and_matches_the_references(
        monkeypatch):
    model = Chains()
    dx.release_memory()
    _run(model, _batch(0, n=12), "agenda")  # arenas grown for a larger graph
    log = _events(monkeypatch)
    batch = _batch(1)
    value, grads, _ = _run(model, batch, "agenda")
    assert "end" in log and log.index("launch") < log.index("end")
    ref_value, ref_grads, _ = _run(model, batch, "none")
    jax_value, jax_grads = jax.value_and_grad(model.reference, argnums=(0, 1))(
        model.W.value, model.E.value, batch)
    np.testing.assert_allclose(value, ref_value, **TOL)
    np.testing.assert_allclose(value, jax_value, **TOL)
    for name, g in zip("WE", jax_grads):
        np.testing.assert_allclose(grads[name], ref_grads[name], **TOL)
        np.testing.assert_allclose(grads[name], g, **TOL)


def test_where_the_bound_would_grow_an_arena_the_whole_plan_comes_first(monkeypatch):
    model = Chains()
    dx.release_memory()
    log = _events(monkeypatch)
    _run(model, _batch(2), "agenda")  # no arena yet: the bound does not fit
    assert log.index("end") < log.index("launch")
    exact = {a: arena.shape[0] for a, arena in _engine().arenas.items()}
    # the arenas are as with streaming off: sized by the whole plan, not the bound
    dx.release_memory()
    monkeypatch.setattr(plans_mod, "stream", lambda *a: list(strategies.stream(*a)))
    _run(model, _batch(2), "agenda")
    assert {a: arena.shape[0] for a, arena in _engine().arenas.items()} == exact


def test_a_streamed_plan_is_stored_for_reuse(monkeypatch):
    """The plan cache keeps a streamed plan once it has been read to the end: the first
    graph of a shape is scheduled, the second is scheduled and stored (streamed, as the
    arenas hold it by then), the third reuses it."""
    model = Chains()
    batch = _batch(3)
    dx.release_memory()
    log = _events(monkeypatch)
    reused = []
    for _ in range(3):
        log.clear()
        cg = dx.renew_cg(autobatch="agenda")
        model.loss(batch).forward()
        reused.append(cg.stats()["plans_reused"])
        if len(reused) == 2:
            assert log.index("launch") < log.index("end")
    assert reused == [0, 0, 1]


class _SmallCells:
    """Small two-output cells (h and c in one arena): the coarse ladder's case (up to 4x
    the nodes as lanes) where a node's outputs take blocks of B rows."""

    def __init__(self):
        self.pc = pc = dx.ParameterCollection(seed=0)
        self.W = pc.add_parameters((4, 4), name="W")

    def loss(self, sentences):
        losses = []
        for words, _ in sentences:
            h, c = dx.zeros((4,)), dx.zeros((4,))
            for w in words:
                h, c = _cell(self.W @ h + float(w), c)
            losses.append(dx.sum_elems(h + c))
        return dx.esum(losses)


@dx.function
def _cell(x, c):
    return jax.numpy.tanh(x + c), 0.5 * c + x


def test_the_streaming_bound_holds_every_plan_of_the_graph():
    """A streamed pass reserves rows by ``_rows``'s bound instead of the plan: for small and
    large batches, one and two outputs per arena, it must hold what the plan writes."""
    engine = _engine()
    for model in (Chains(), _SmallCells()):
        for seed, n in ((3, 1), (4, 5), (5, 17), (6, 70)):
            dx.renew_cg(autobatch="agenda")
            model.loss(_batch(seed, n))
            g = dx.current_graph()
            hi = len(g.node_sig)
            bound = engine._rows(g, {}, 0, hi)
            for strategy in ("agenda", "depth", "none"):
                exact = engine._rows(g, {}, 0, hi, strategies.schedule(strategy, g, 0, hi))
                assert all(bound[a] >= rows for a, rows in exact.items()), (strategy, n)
