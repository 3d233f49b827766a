"""A parameter's first gradient: when only one batch of a backward pass uses a parameter and
it has no gradient yet, the backward kernel returns the cotangent as the gradient instead of
adding it to a zero buffer. Gradients must equal ``jax.grad`` of the same math for every
strategy, on the first backward and when later ones accumulate."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx

TOL = dict(rtol=1e-5, atol=1e-5)
STRATEGIES = ("agenda", "depth", "none")
IN, HID, OUT = 3, 4, 5


@dx.function
def _step(x, h, W, U):
    return jnp.tanh(W @ x + U @ h)


@dx.function
def _out_loss(h, V, c, label):
    return -jax.nn.log_softmax(V @ h + c)[label]


def _model(out=OUT, hid=HID):
    pc = dx.ParameterCollection(seed=3)
    return (pc.add_parameters((hid, IN), name="W"), pc.add_parameters((hid, hid), name="U"),
            pc.add_parameters((out, hid), name="V"), pc.add_parameters((out,), name="c"))


def _data(seed=0):
    rng = np.random.default_rng(seed)
    seqs = [[rng.standard_normal(IN).astype(np.float32) for _ in range(n)] for n in (2, 5, 3)]
    return seqs, [1, 4, 0]


def _loss(params, seqs, labels):
    W, U, V, c = params
    losses = []
    for xs, y in zip(seqs, labels):
        h = dx.input(np.zeros(U.shape[0], np.float32))
        for x in xs:
            h = _step(dx.input(x), h, W, U)
        losses.append(_out_loss(h, V, c, np.int32(y)))  # one batch of three: V, c "fresh"
    return dx.esum(losses)


def _reference(vals, seqs, labels):
    W, U, V, c = vals
    total = 0.0
    for xs, y in zip(seqs, labels):
        h = jnp.zeros(U.shape[0])
        for x in xs:
            h = jnp.tanh(W @ x + U @ h)
        total = total + -jax.nn.log_softmax(V @ h + c)[y]
    return total


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_first_and_accumulated_gradients_equal_jax_grad(strategy):
    params = _model()
    seqs, labels = _data()
    want = jax.grad(_reference)(tuple(p.value for p in params), seqs, labels)
    for k in (1, 2):  # the second backward accumulates onto the first
        dx.renew_cg(autobatch=strategy)
        _loss(params, seqs, labels).backward()
        for p, g in zip(params, want):
            np.testing.assert_allclose(np.asarray(p.grad), k * np.asarray(g), **TOL,
                                       err_msg=f"{p.name} after {k} backward passes")


def test_fresh_variant_only_for_parameters_of_one_batch():
    # shapes of its own: signatures of equal shapes share compiled kernels (and variants)
    params = _model(out=7, hid=6)
    seqs, labels = _data(1)
    dx.renew_cg(autobatch="agenda")
    _loss(params, seqs, labels).backward()
    step_sig, out_sig = _signature(_step, params[0]), _signature(_out_loss, params[2])
    assert _backward_variants(out_sig) == {True}  # V and c: one batch, no gradient yet
    assert _backward_variants(step_sig) == {False}  # W and U: one batch per step
    dx.renew_cg(autobatch="agenda")
    _loss(params, seqs, labels).backward()  # V and c have gradients now: accumulated
    assert _backward_variants(out_sig) == {True, False}


def _signature(fn, param):
    """The signature of ``fn``'s nodes over ``param`` (this test's model only)."""
    from dynax.ops.registry import live_signatures
    return next(s for s in live_signatures() if s.op is fn.op and param in s.params)


def _backward_variants(sig) -> set:
    """The ``fresh`` flags of the signature's compiled single-batch backward kernels (key:
    ``("bwd", modes, gflags, B, saved residuals, fresh, param_grads)``)."""
    return {key[5] for key in sig.kernels if key[0] == "bwd"}
