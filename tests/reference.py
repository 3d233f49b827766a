"""Shared helpers for tests: run the same model under every strategy and compare."""
import jax
import jax.numpy as jnp
import numpy as np

import dynax as dx

STRATEGIES = ("none", "depth", "agenda")


def _host_round(a):
    return np.round(a).astype(np.float32)


@dx.function
def rounded(h):
    """``round(h)`` by a host callback without a JVP rule: a function JAX cannot
    differentiate (its training forward runs values-only)."""
    return jax.pure_callback(_host_round, jax.ShapeDtypeStruct(h.shape, h.dtype), h,
                             vmap_method="broadcast_all")


def clear_kernels():
    """Forget every compiled kernel, so that the next pass compiles (or loads) its own.

    Kernels belong to kernel families, shared by signatures of equal shapes and kept by
    their op after the model that compiled them is dropped: clearing only the live
    signatures' kernels left a dropped model's (another test's LSTM of the same sizes)
    in the family a test's model joins later (session 72)."""
    from dynax.ops.registry import live_kernel_families
    for family in live_kernel_families():
        family.kernels.clear()


def grads_of(pc):
    """{name: numpy gradient} of every parameter of ``pc``."""
    return {p.name: np.asarray(p.grad) for p in pc.parameters()}


def zero_grads(pc):
    for p in pc.parameters():
        p.zero_grad()


def assert_close(a, b, rtol=1e-5, atol=1e-5, what=""):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=what)


class Chains:
    """Per instance: a chain of ``tanh(W @ h + E[w])`` over its words, then a loss; and
    ``reference``, the same math in plain JAX."""

    def __init__(self):
        self.pc = pc = dx.ParameterCollection(seed=0)
        self.W = pc.add_parameters((4, 4), name="W")
        self.E = pc.add_lookup_parameters((10, 4), name="E")

    def loss(self, sentences):
        losses = []
        for words, label in sentences:
            h = dx.zeros((4,))
            for w in words:
                h = dx.tanh(self.W @ h + self.E[w])
            losses.append(dx.pickneglogsoftmax(h, label))
        return dx.esum(losses)

    def reference(self, W, E, sentences):
        total = 0.0
        for words, label in sentences:
            h = jnp.zeros(4)
            for w in words:
                h = jnp.tanh(W @ h + E[w])
            total = total - jax.nn.log_softmax(h)[label]
        return total


def assert_matches_none_and_jax(model, batch, value, grads, none_value, none_grads,
                                rtol=1e-5, atol=1e-5):
    """A loss ``value`` and gradients ``grads`` (of parameters ``W`` and ``E``) equal to the
    ``autobatch="none"`` run's and to ``jax.value_and_grad`` of ``model.reference``."""
    jv, (gW, gE) = jax.value_and_grad(model.reference, argnums=(0, 1))(
        model.W.value, model.E.value, batch)
    tol = dict(rtol=rtol, atol=atol)
    np.testing.assert_allclose(value, none_value, **tol)
    np.testing.assert_allclose(value, jv, **tol)
    for name, ref in (("W", gW), ("E", gE)):
        np.testing.assert_allclose(grads[name], none_grads[name], **tol)
        np.testing.assert_allclose(grads[name], ref, **tol)


def train_pass(model, batch, strategy, seed=None, before=None):
    """One graph of ``model.loss(batch)``: gradients zeroed, the loss read, then
    differentiated. Returns its value, the gradients (``grads_of``), the graph's stats and
    what ``before`` returned (called first: nodes built ahead of the loss, unread)."""
    zero_grads(model.pc)
    cg = dx.renew_cg(autobatch=strategy, seed=seed)
    extra = before() if before else None
    loss = model.loss(batch)
    value = loss.scalar_value()
    loss.backward()
    return value, grads_of(model.pc), cg.stats(), extra


def check_against_none_and_jax(model, batch, value, grads):
    """``assert_matches_none_and_jax`` against a fresh ``autobatch="none"`` pass."""
    ref_value, ref_grads, _, _ = train_pass(model, batch, "none")
    assert_matches_none_and_jax(model, batch, value, grads, ref_value, ref_grads)


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


def ref_leaf(x, W, b_leaf):
    """A leaf of ``dx.nn.TreeLSTMBuilder`` in plain JAX: ``(h, c)``."""
    i, o, u = jnp.split(W @ x + b_leaf, 3)
    c = jax.nn.sigmoid(i) * jnp.tanh(u)
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


def ref_compose(left, right, Ul, Ur, b):
    """An inner node of ``dx.nn.TreeLSTMBuilder`` from its children's ``(h, c)``."""
    (hl, cl), (hr, cr) = left, right
    i, fl, fr, o, u = jnp.split(Ul @ hl + Ur @ hr + b, 5)
    c = jax.nn.sigmoid(i) * jnp.tanh(u) + jax.nn.sigmoid(fl) * cl + jax.nn.sigmoid(fr) * cr
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


def ref_binary_tree(vals, t, xs):
    """``(h, c)`` of the binary tree ``t`` (nested pairs over indices into ``xs``); ``vals``
    are the builder's parameters in order: W, b_leaf, U_l, U_r, b."""
    W, b_leaf, Ul, Ur, b = vals
    if isinstance(t, int):
        return ref_leaf(xs[t], W, b_leaf)
    return ref_compose(ref_binary_tree(vals, t[0], xs), ref_binary_tree(vals, t[1], xs),
                       Ul, Ur, b)


def ref_child_sum_node(x, kids, W, U, b, Wf, Uf, bf):
    """A node of ``dx.nn.ChildSumTreeLSTMBuilder`` from its input and children's ``(h, c)``."""
    h_sum = sum((h for h, _ in kids), jnp.zeros(U.shape[1]))
    i, o, u = jnp.split(W @ x + U @ h_sum + b, 3)
    fc = sum((jax.nn.sigmoid(Wf @ x + Uf @ hk + bf) * ck for hk, ck in kids),
             jnp.zeros(U.shape[1]))
    c = jax.nn.sigmoid(i) * jnp.tanh(u) + fc
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


def ref_child_sum_tree(vals, t, xs):
    """``(h, c)`` of the tree ``t = (input index, [children])``; ``vals`` are the builder's
    parameters in order: W, U, b, W_f, U_f, b_f."""
    kids = [ref_child_sum_tree(vals, c, xs) for c in t[1]]
    return ref_child_sum_node(xs[t[0]], kids, *vals)


def every_repeat_runs_once(monkeypatch):
    """Run every batch with repeated lanes on its distinct lanes (``repeats.py``), however
    little that saves (the default asks for 4M elements of work saved), and look at every
    batch (an earlier test's batches without repeats made the gates skip some)."""
    from dynax.executor import engine
    from dynax.ops.registry import live_signatures
    monkeypatch.setattr(engine, "REPEATS_MIN_WORK", 1)
    for sig in live_signatures():  # gates are per (interned) signature: start open
        sig.repeats = None
    dx.renew_cg().engine.dry_passes = 0  # as if the last pass had run repeats once


def record_kernel_texts(monkeypatch):
    """From here on (kernels made before are forgotten), note each kernel's first call;
    returns ``texts()``: ({name: compiled HLO text on that call's argument shapes},
    {name: (jitted, args)})."""
    from dynax.executor import kernels
    clear_kernels()  # kernels made by earlier tests would not be recorded
    first_calls = {}
    real = kernels._jit

    def recording(fn, name, donate, work, accumulates=False, one_thread=False):
        jitted = real(fn, name, donate, work, accumulates, one_thread)

        class Recorded:  # the jitted function, its first call's arguments noted
            def __call__(self, *args):
                first_calls.setdefault(name, (jitted, args))
                return jitted(*args)

            def __getattr__(self, attr):
                return getattr(jitted, attr)
        return Recorded()

    monkeypatch.setattr(kernels, "_jit", recording)

    def texts():
        # lowered before the call's donated arenas are reused: their shapes only
        return {name: jitted.lower(*jax.tree.map(
                    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape")
                    else a, args)).compile().as_text()
                for name, (jitted, args) in first_calls.items()}, first_calls
    return texts
