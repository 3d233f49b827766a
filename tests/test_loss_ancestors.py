"""Backward runs only what the loss depends on. Nodes built for a decision (a greedy step's
scores read with ``.value()``) get no cotangent, but zero times an infinite local derivative
is NaN: if backward ran them, that NaN would reach the parameters, where ``jax.grad`` of
the loss never looks at them. Each test builds such nodes, alone in their batches, batched
with nodes the loss needs (a masked batch), and in fused recurrent runs, and compares the
gradients with ``jax.grad`` of the loss alone."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dynax as dx
from dynax.graph.computation_graph import _engine

TOL = dict(rtol=1e-5, atol=1e-6)
STRATEGIES = ("agenda", "depth", "none")
E_IN = np.array([1.0, -2.0, 0.5], np.float32)


def _params(seed=0):
    pc = dx.ParameterCollection(seed=seed)
    return pc, pc.add_parameters((4, 3), name="W"), pc.add_parameters((4, 4), name="U")


def _grads_finite_and_equal(params, ref):
    for p, r in zip(params, ref):
        got = np.asarray(p.grad)
        assert np.isfinite(got).all(), f"{p.name}: non-finite gradient {got}"
        np.testing.assert_allclose(got, np.asarray(r), **TOL)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("probe_first", [True, False])
def test_decision_node_with_infinite_derivative_is_not_run(strategy, probe_first):
    pc, W, _ = _params()
    ref = jax.grad(lambda w: jnp.sum(jnp.tanh(w @ E_IN)))(jnp.asarray(W.value))
    dx.renew_cg(autobatch=strategy)
    x = W @ dx.input(E_IN)
    if probe_first:  # sqrt at 0: infinite derivative
        probe = dx.sqrt(x * 0.0)
        loss = dx.sum_elems(dx.tanh(x))
    else:
        loss = dx.sum_elems(dx.tanh(x))
        probe = dx.sqrt(x * 0.0)
    assert np.all(probe.npvalue() == 0.0)
    loss.backward()
    _grads_finite_and_equal([W], [ref])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_decoding_log_of_underflowed_softmax(strategy):
    """The DyNet idiom ``log(softmax(...))`` for a greedy step: the softmax underflows to 0
    and ``log`` has an infinite derivative there; the loss is built afterwards from the
    same scores."""
    pc, W, _ = _params()
    e = (300.0 * E_IN).astype(np.float32)
    dx.renew_cg(autobatch=strategy)
    scores = W @ dx.input(e)
    logp = dx.log(dx.softmax(scores))
    best = int(np.argmax(logp.npvalue()))
    assert np.isinf(logp.npvalue()).any()
    loss = dx.pickneglogsoftmax(scores, best)
    loss.backward()
    ref = jax.grad(lambda w: -jax.nn.log_softmax(w @ e)[best])(jnp.asarray(W.value))
    _grads_finite_and_equal([W], [ref])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batch_mixing_needed_and_decision_nodes(strategy):
    """Four instances' ``sqrt`` nodes run as one batch; the loss reads three of them. The
    fourth (at 0: infinite derivative) must not count, under any strategy; its inputs are
    built both before and after the loss, so lanes of either kind are masked."""
    pc, W, _ = _params()
    inputs = [E_IN * s for s in (1.0, 0.5, 2.0)]
    for late in (False, True):
        W.zero_grad()
        dx.renew_cg(autobatch=strategy)
        xs = [dx.square(W @ dx.input(e)) + 1.0 for e in inputs]
        dead_in = dx.square(W @ dx.input(E_IN)) * 0.0
        if not late:
            dead = dx.sqrt(dead_in)
        roots = [dx.sqrt(x) for x in xs]
        loss = dx.sum_elems(dx.esum(roots))
        if late:
            dead = dx.sqrt(dead_in)
        dx.forward([dead, loss])
        if strategy != "none":  # one batch of the four sqrt nodes
            assert dx.current_graph().stats()["batches"] < dx.current_graph().stats()["nodes"]
        loss.backward()
        ref = jax.grad(lambda w: sum(jnp.sum(jnp.sqrt(jnp.square(w @ e) + 1.0))
                                     for e in inputs))(jnp.asarray(W.value))
        _grads_finite_and_equal([W], [ref])


@dx.function
def _root_cell(h, s, U):
    return jnp.sqrt(jnp.square(U @ h) + s)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_recurrent_run_with_a_decision_chain(strategy):
    """Two chains of one cell step in lockstep (a fused run of 2-lane steps); only the first
    is in the loss. The second stays at 0, where the cell's derivative is infinite."""
    pc, _, U = _params()
    h0 = np.array([0.3, -0.2, 0.5, 0.1], np.float32)
    one, zero = np.ones(4, np.float32), np.zeros(4, np.float32)
    dx.renew_cg(autobatch=strategy)
    h, d = dx.input(h0), dx.input(zero)
    for _ in range(6):
        h, d = _root_cell(h, dx.input(one), U), _root_cell(d, dx.input(zero), U)
    assert np.all(d.npvalue() == 0.0)
    loss = dx.sum_elems(h)
    loss.backward()

    def ref(u):
        x = jnp.asarray(h0)
        for _ in range(6):
            x = jnp.sqrt(jnp.square(u @ x) + 1.0)
        return jnp.sum(x)
    _grads_finite_and_equal([U], [jax.grad(ref)(jnp.asarray(U.value))])


def test_rows_read_only_by_decision_nodes_are_not_updated():
    """Lazy (sparse) updates touch the rows the loss used: a row looked up only for a
    decision keeps its value, as in DyNet."""
    pc = dx.ParameterCollection(seed=0)
    E = pc.add_lookup_parameters((5, 3), init="normal", name="E")
    trainer = dx.Trainer(pc, optax.adam(0.1), sparse_updates=True)
    for step in range(2):
        dx.renew_cg()
        decision = dx.sum_elems(E[2])  # read, never part of the loss
        decision.value()
        loss = dx.sum_elems(dx.tanh(E[0] + E[2 if step == 0 else 1]))
        before = np.asarray(E.value).copy()
        loss.backward()
        trainer.update()
    after = np.asarray(E.value)
    assert not np.allclose(after[[0, 1]], before[[0, 1]])  # used by the loss: moved
    np.testing.assert_array_equal(after[[2, 3, 4]], before[[2, 3, 4]])  # row 2: decision only


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_second_loss_of_one_graph_sees_its_own_ancestors(strategy):
    """Two losses in one graph, each backward over its own ancestors: the sum of their
    gradients is ``jax.grad`` of their sum, though each is a dead node to the other."""
    pc, W, _ = _params()
    e2 = E_IN[::-1].copy()
    dx.renew_cg(autobatch=strategy)
    l1 = dx.sum_elems(dx.sqrt(dx.square(W @ dx.input(E_IN)) + 1.0))
    l2 = dx.sum_elems(dx.sqrt(dx.square(W @ dx.input(e2)) + 1.0))
    l1.backward()
    l2.backward()
    ref = jax.grad(lambda w: jnp.sum(jnp.sqrt(jnp.square(w @ E_IN) + 1.0))
                   + jnp.sum(jnp.sqrt(jnp.square(w @ e2) + 1.0)))(jnp.asarray(W.value))
    _grads_finite_and_equal([W], [ref])


@dx.function
def _split_cell(x):
    return jnp.tanh(x), x * 2.0


def _reverse_pass(g, loss_node):
    """Every node's ancestry by a plain reverse pass over the graph's lists."""
    needed = set(range(g.node_out[loss_node], g.node_out[loss_node]
                       + len(g.node_sig[loss_node].out_akeys)))
    live = [False] * (loss_node + 1)
    for nd in range(loss_node, -1, -1):
        outs = range(g.node_out[nd], g.node_out[nd] + len(g.node_sig[nd].out_akeys))
        if any(v in needed for v in outs):
            live[nd] = True
            needed.update(g.node_vals[nd])
    return live


@pytest.mark.parametrize("seed", range(8))
def test_ancestors_of_random_graphs_match_a_reverse_pass(seed):
    """``_loss_ancestors`` (reference counting, with its all-live shortcut) against a plain
    reverse pass, on random graphs with constants between nodes, two-output nodes, values
    read twice, and nodes after the loss."""
    from dynax.executor.engine import _loss_ancestors
    rng = np.random.default_rng(seed)
    g = dx.renew_cg()
    vals = [dx.input(rng.standard_normal(3).astype(np.float32)) for _ in range(2)]
    for _ in range(40):
        kind = rng.integers(4)
        a, b = (vals[i] for i in rng.integers(len(vals), size=2))
        if kind == 0:
            vals.append(a + b)
        elif kind == 1:
            vals.append(dx.tanh(a) * a)
        elif kind == 2:
            vals.extend(_split_cell(a))
        else:
            vals.append(dx.input(rng.standard_normal(3).astype(np.float32)))
    for _ in range(3):  # losses at three points of the graph
        loss = dx.sum_elems(vals[rng.integers(len(vals))])
        L = g.val_node[loss.v]
        got = _loss_ancestors(g, L)
        want = _reverse_pass(g, L)
        assert (got if got is not None else [True] * (L + 1)) == want
        vals.append(dx.tanh(vals[rng.integers(len(vals))]))


@pytest.fixture
def reads_wait(monkeypatch):
    """Every read waits for the device (as a training loop's loss read does), so reading a
    scalar looks for its loss ancestors ahead of ``backward()``; calls are counted."""
    from dynax.executor import engine
    calls = []
    real = engine._loss_ancestors

    def counted(g, node):
        calls.append(node)
        return real(g, node)

    monkeypatch.setattr(engine, "_waiting", lambda pending: True)
    monkeypatch.setattr(engine, "_loss_ancestors", counted)
    monkeypatch.setattr(_engine(), "search_ahead", True)  # as after a training step
    return calls


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ancestors_found_while_the_loss_is_read_are_used_by_its_backward(strategy, reads_wait):
    """The loss read first: its ancestors (a decision node at sqrt(0) not among them) are
    found during the read and backward uses them, running no second search."""
    pc, W, _ = _params()
    ref = jax.grad(lambda w: jnp.sum(jnp.tanh(w @ E_IN)))(jnp.asarray(W.value))
    cg = dx.renew_cg(autobatch=strategy)
    x = W @ dx.input(E_IN)
    probe = dx.sqrt(x * 0.0)
    loss = dx.sum_elems(dx.tanh(x))
    loss.value()
    assert len(reads_wait) == 1 and cg.loss_live[1] is not None  # the probe is dead
    loss.backward()
    assert len(reads_wait) == 1
    _grads_finite_and_equal([W], [ref])
    assert np.all(probe.npvalue() == 0.0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_backward_of_another_loss_than_the_one_read_finds_its_own_ancestors(strategy,
                                                                           reads_wait):
    """A scalar read first, then the gradient of a loss built afterwards from a node the
    first one does not read: the search made for the read does not fit, and is not used."""
    pc, W, U = _params()
    e4 = np.array([0.3, -0.1, 0.2, 0.5], np.float32)

    def ref_b(w, u):
        h = jnp.tanh(w @ E_IN) * 2.0
        return jnp.sum(jnp.square(h + u @ e4))

    ref = jax.grad(ref_b, argnums=(0, 1))(jnp.asarray(W.value), jnp.asarray(U.value))
    dx.renew_cg(autobatch=strategy)
    x = W @ dx.input(E_IN)
    h = dx.tanh(x) * 2.0  # dead for a
    a = dx.sum_elems(dx.square(x))
    a.value()
    b = dx.sum_elems(dx.square(h + U @ dx.input(e4)))
    b.backward()
    assert len(reads_wait) == 2
    _grads_finite_and_equal([W, U], ref)


def test_a_decoder_reading_a_score_per_step_searches_at_most_once_ahead(reads_wait):
    """Thirty scalar reads of a growing graph (a decoder's stop decisions), then backward:
    the ancestors are looked for once during the reads and once for the loss, not per read
    (which would grow with the graph at every step)."""
    pc, W, U = _params()
    dx.renew_cg()
    h = dx.tanh(W @ dx.input(E_IN))
    scores = []
    for _ in range(30):
        h = dx.tanh(U @ h)
        s = dx.sum_elems(h)
        s.value()
        scores.append(s)
    dx.esum(scores).backward()
    assert len(reads_wait) == 2

    def ref(w, u):
        h, total = jnp.tanh(w @ E_IN), 0.0
        for _ in range(30):
            h = jnp.tanh(u @ h)
            total = total + jnp.sum(h)
        return total

    _grads_finite_and_equal([W, U], jax.grad(ref, argnums=(0, 1))(jnp.asarray(W.value),
                                                                  jnp.asarray(U.value)))


def test_only_a_loop_that_reads_its_loss_before_backward_searches_ahead(reads_wait):
    """An inference loop (reads, never a backward) does not search ahead: its wait for the
    value can be shorter than the search. A training step (the loss read, then its
    backward) turns the search on for the next graph; a backward of a value not read
    turns it off."""
    pc, W, _ = _params()

    def loss():
        return dx.sum_elems(dx.tanh(W @ dx.input(E_IN)))

    _engine().search_ahead = False
    dx.renew_cg()
    loss().value()
    assert reads_wait == []  # inference: no search
    dx.renew_cg()
    first = loss()
    first.value()
    first.backward()
    assert len(reads_wait) == 1 and _engine().search_ahead  # backward's own search
    dx.renew_cg()
    loss().value()
    assert len(reads_wait) == 2  # searched ahead, as the loop now reads then differentiates
    dx.renew_cg()
    loss().backward()  # not read first
    assert len(reads_wait) == 3 and not _engine().search_ahead
