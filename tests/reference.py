"""Shared helpers for tests: run the same model under every strategy and compare."""
import jax
import jax.numpy as jnp
import numpy as np

STRATEGIES = ("none", "depth", "agenda")


def grads_of(pc):
    """{name: numpy gradient} of every parameter of ``pc``."""
    return {p.name: np.asarray(p.grad) for p in pc.parameters()}


def zero_grads(pc):
    for p in pc.parameters():
        p.zero_grad()


def assert_close(a, b, rtol=1e-5, atol=1e-5, what=""):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=what)


def ref_lstm(x, state, Wx, Wh, b):
    """One step of ``dx.nn.LSTMBuilder`` in plain JAX: state ``(c, h)`` -> ``(c', h')``."""
    c, h = state
    i, f, o, g = jnp.split(Wx @ x + Wh @ h + b, 4)
    c2 = jax.nn.sigmoid(i) * jnp.tanh(g) + jax.nn.sigmoid(f) * c
    return c2, jax.nn.sigmoid(o) * jnp.tanh(c2)


def ref_gru(x, state, Wx, Wh, b):
    """One step of ``dx.nn.GRUBuilder`` in plain JAX: state ``(h,)`` -> ``(h',)``."""
    h = state[0]
    H = h.shape[0]
    gx, gh = Wx @ x + b, Wh[:2 * H] @ h
    z, r = jax.nn.sigmoid(gx[:H] + gh[:H]), jax.nn.sigmoid(gx[H:2 * H] + gh[H:])
    n = jnp.tanh(gx[2 * H:] + Wh[2 * H:] @ (r * h))
    return ((1 - z) * n + z * h,)
