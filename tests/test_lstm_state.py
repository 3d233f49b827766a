"""``dx.nn.lstm_state``: the LSTM state update with a lean JVP rule.

Its values and derivatives (reverse, forward, second order, under vmap) must equal those of
the same formula written plainly; and its reason to exist, fewer residuals kept by
``jax.vjp``, is checked too. The builders that use it (LSTM, BiRNN, Tree-LSTM) are tested
against the unbatched strategy and ``jax.grad`` in test_builders.py and elsewhere.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx

H = 7


def plain(i, u, o, forgets=(), cells=()):
    c = jax.nn.sigmoid(i) * jnp.tanh(u)
    for f, ck in zip(forgets, cells):
        c = c + jax.nn.sigmoid(f) * ck
    return c, jax.nn.sigmoid(o) * jnp.tanh(c)


def inputs(k, shape=(H,), seed=0):
    """i, u, o and k (forget, cell) pairs; pre-activations up to +-6 (saturated gates too)."""
    xs = 3.0 * jax.random.normal(jax.random.PRNGKey(seed), (3 + 2 * k,) + shape)
    return xs[0], xs[1], xs[2], tuple(xs[3:3 + k]), tuple(xs[3 + k:])


def scalar_loss(fn):
    def loss(i, u, o, fs, cs):
        c, h = fn(i, u, o, fs, cs)
        return jnp.sum(jnp.sin(c) * jnp.arange(1.0, c.shape[-1] + 1)) + jnp.sum(h * h)
    return loss


@pytest.mark.parametrize("k", [0, 1, 2])
def test_values_and_gradients_equal_the_plain_formula(k):
    args = inputs(k, seed=k)
    for a, b in zip(dx.nn.lstm_state(*args), plain(*args)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    got = jax.grad(scalar_loss(dx.nn.lstm_state), argnums=range(5))(*args)
    want = jax.grad(scalar_loss(plain), argnums=range(5))(*args)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_forward_mode_second_order_and_vmap():
    args = inputs(2, shape=(5, H), seed=3)
    tangents = inputs(2, shape=(5, H), seed=4)
    batched = jax.vmap(dx.nn.lstm_state)
    _, got = jax.jvp(batched, args, tangents)
    _, want = jax.jvp(jax.vmap(plain), args, tangents)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    one = inputs(1, seed=5)

    def h_of_i(fn):
        return lambda i: jnp.sum(fn(i, *one[1:])[1] ** 3)
    np.testing.assert_allclose(jax.hessian(h_of_i(dx.nn.lstm_state))(one[0]),
                               jax.hessian(h_of_i(plain))(one[0]), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_vjp_keeps_one_coefficient_per_tangent(k):
    """4 + 2k per-lane arrays (the point of the rule); the plain formula keeps more."""
    args = inputs(k, shape=(3, H))

    def residuals(fn):
        _, vjp = jax.vjp(jax.vmap(fn), *args)
        return [x for x in jax.tree_util.tree_leaves(vjp) if x.shape == (3, H)]

    assert len(residuals(dx.nn.lstm_state)) == 4 + 2 * k
    assert len(residuals(plain)) > 4 + 2 * k


def test_mismatched_forgets_and_cells_are_refused():
    i, u, o, fs, cs = inputs(2)
    with pytest.raises(ValueError):
        dx.nn.lstm_state(i, u, o, fs, cs[:1])
