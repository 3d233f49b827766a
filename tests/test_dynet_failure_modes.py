"""Regression tests for the failures DyNet's autobatcher had in the field, each shown absent:

1. wrong gradients when an argument shared by a batch was itself a computed (batched) value;
2. operations with per-node state (random masks) run once per batch instead of once per node;
3. constants of different values batched together as if they were one;
4. memory that could not grow while autobatching (a fixed pool sized before the graph).

Every case is checked under all strategies against plain ``jax.grad`` on the same math.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx
from dynax.executor import engine as engine_module
from dynax.executor.engine import UNIFORM_MIN_SIZE
from dynax.graph.computation_graph import _engine
from dynax.executor.kernels import UNIFORM
from reference import STRATEGIES, assert_close, grads_of, zero_grads

RNG = np.random.default_rng(0)
W0 = RNG.normal(size=(4, 3)).astype(np.float32)
V0 = RNG.normal(size=(4,)).astype(np.float32)
XS = RNG.normal(size=(6, 3)).astype(np.float32)


def _collection():
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((4, 3), init=W0, name="W")
    v = pc.add_parameters((4,), init=V0, name="v")
    return pc, W, v


@pytest.mark.parametrize("rows, cols", [(4, 3), (80, 64)], ids=["small", "large"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shared_argument_that_is_itself_computed(strategy, rows, cols):
    """A computed matrix (tanh(2W)) and a computed vector (the output of a batch of matmuls)
    are each shared by a batch of nodes; gradients must flow back through them once per use.
    The large matrix is read once for the whole batch (UNIFORM mode), the small one gathered."""
    rng = np.random.default_rng(rows)
    W0 = rng.normal(size=(rows, cols)).astype(np.float32) / np.sqrt(cols)
    V0 = rng.normal(size=(rows,)).astype(np.float32)
    XS = rng.normal(size=(6, cols)).astype(np.float32)
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((rows, cols), init=W0, name="W")
    v = pc.add_parameters((rows,), init=V0, name="v")
    cg = dx.renew_cg(autobatch=strategy)
    Wc = dx.tanh(W * 2.0)                     # a computed value used as a shared argument
    hs = [dx.tanh(Wc @ dx.input(x)) for x in XS]   # one batch of matmuls sharing Wc
    shared_h = hs[0]                              # an output of that batch, shared in turn
    terms = [dx.dot_product(shared_h, h * v) for h in hs[1:]]
    loss = dx.esum(terms)
    got = loss.scalar_value()
    loss.backward()
    uniform = any(UNIFORM in b.modes for b in cg.batches)
    assert uniform == (strategy != "none" and rows * cols >= UNIFORM_MIN_SIZE)

    def ref(W, v):
        Wc = jnp.tanh(2.0 * W)
        hs = [jnp.tanh(Wc @ x) for x in XS]
        return sum(jnp.dot(hs[0], h * v) for h in hs[1:])

    want, (gW, gv) = jax.value_and_grad(ref, argnums=(0, 1))(jnp.asarray(W0), jnp.asarray(V0))
    assert_close(got, want, rtol=1e-4)
    g = grads_of(pc)
    assert_close(g["W"], gW, rtol=1e-4, what="W")
    assert_close(g["v"], gv, rtol=1e-4, what="v")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_node_random_state_is_per_node(strategy):
    """Dropout in a batch of identical-signature nodes draws one mask per node, and the same
    masks as the node-by-node reference."""
    x = np.ones(64, np.float32)

    def masks(strategy):
        dx.renew_cg(autobatch=strategy, train=True, seed=7)
        outs = [dx.dropout(dx.input(x), 0.5) for _ in range(8)]
        dx.forward(outs)
        return np.stack([o.npvalue() for o in outs])

    got = masks(strategy)
    assert len({m.tobytes() for m in got}) == 8, "two nodes of one batch shared a mask"
    np.testing.assert_array_equal(got, masks("none"))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_constants_of_different_values_stay_distinct(strategy):
    """Same-shape constants (dx.input arrays and Python scalars) in one batch keep their own
    values, in the forward pass and in the gradients they scale."""
    pc, W, v = _collection()
    scales = [0.5, 1.0, 2.0, -3.0, 7.25]
    dx.renew_cg(autobatch=strategy)
    terms = []
    for i, s in enumerate(scales):
        c = dx.input(np.full(4, s, np.float32))          # constants of one shape, many values
        terms.append(dx.sum_elems(dx.cmult(v * s, c) + float(i)))   # Python scalars too
    loss = dx.esum(terms)
    got = loss.scalar_value()
    loss.backward()

    def ref(v):
        return sum(jnp.sum(v * s * jnp.full(4, s) + i) for i, s in enumerate(scales))

    want, gv = jax.value_and_grad(ref)(jnp.asarray(V0))
    assert_close(got, want)
    assert_close(grads_of(pc)["v"], gv)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_memory_grows_during_autobatching(strategy, monkeypatch):
    """No pool is sized in advance: a graph grown far beyond the last one, including between
    two incremental forwards of one graph, just works."""
    monkeypatch.setattr(engine_module, "ARENA_START_BYTES", 256)  # so the arenas must grow
    pc, W, v = _collection()
    zero_grads(pc)
    dx.release_memory()
    dx.renew_cg(autobatch=strategy)
    first = dx.tanh(W @ dx.input(XS[0]))
    first.forward()                                   # arenas sized for a tiny graph
    many = [dx.tanh(W @ dx.input(XS[i % 6] * (1 + i / 100))) for i in range(600)]
    loss = dx.esum([dx.dot_product(h, v) for h in [first] + many])
    small = {a: x.shape[0] for a, x in _engine().arenas.items()}
    got = loss.scalar_value()                         # incremental forward: far more rows
    assert any(_engine().arenas[a].shape[0] > n for a, n in small.items())  # it grew
    loss.backward()

    def ref(W, v):
        xs = [XS[0]] + [XS[i % 6] * (1 + i / 100) for i in range(600)]
        H = jnp.tanh(jnp.stack(xs) @ W.T)
        return jnp.sum(H @ v)

    want, (gW, gv) = jax.value_and_grad(ref, argnums=(0, 1))(jnp.asarray(W0), jnp.asarray(V0))
    assert_close(got, want, rtol=1e-4)
    g = grads_of(pc)
    assert_close(g["W"], gW, rtol=1e-4, atol=1e-3, what="W")
    assert_close(g["v"], gv, rtol=1e-4, atol=1e-3, what="v")
