"""Recursive Tree-LSTM over random trees written with @dx.function: values and gradients
equal a pure-JAX recursion over the same trees, for every strategy; the cells batch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dynax as dx
from reference import STRATEGIES, assert_close, grads_of, zero_grads

V, D, H, C = 30, 6, 5, 3


def random_tree(rng, n):
    if n == 1:
        return int(rng.integers(V))
    k = int(rng.integers(1, n))
    return (random_tree(rng, k), random_tree(rng, n - k))


def leaf_math(x, W, b):
    i, o, u = jnp.split(W @ x + b, 3)
    c = jax.nn.sigmoid(i) * jnp.tanh(u)
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


def compose_math(hl, cl, hr, cr, U, b):
    i, fl, fr, o, u = jnp.split(U @ jnp.concatenate([hl, hr]) + b, 5)
    c = jax.nn.sigmoid(i) * jnp.tanh(u) + jax.nn.sigmoid(fl) * cl + jax.nn.sigmoid(fr) * cr
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


leaf = dx.function(leaf_math)
compose = dx.function(compose_math)


@dx.function
def root_loss_cell(h, Wo, bo, label):  # a static int label: part of the signature
    return -jax.nn.log_softmax(Wo @ h + bo)[label]


@pytest.fixture(scope="module")
def model():
    pc = dx.ParameterCollection(seed=1)
    ps = dict(E=pc.add_lookup_parameters((V, D), name="E"),
              W=pc.add_parameters((3 * H, D), name="W"), b=pc.add_parameters((3 * H,), name="b"),
              U=pc.add_parameters((5 * H, 2 * H), name="U"),
              bu=pc.add_parameters((5 * H,), name="bu"),
              Wo=pc.add_parameters((C, H), name="Wo"), bo=pc.add_parameters((C,), name="bo"))
    rng = np.random.default_rng(0)
    trees = [(random_tree(rng, int(rng.integers(1, 9))), int(rng.integers(C))) for _ in range(6)]
    return pc, ps, trees


def count_leaves(t):
    return 1 if isinstance(t, int) else count_leaves(t[0]) + count_leaves(t[1])


def encode(t, ps):
    if isinstance(t, int):
        return leaf(ps["E"][t], ps["W"], ps["b"])
    hl, cl = encode(t[0], ps)
    hr, cr = encode(t[1], ps)
    return compose(hl, cl, hr, cr, ps["U"], ps["bu"])


def encode_ref(t, v):
    if isinstance(t, int):
        return leaf_math(v["E"][t], v["W"], v["b"])
    hl, cl = encode_ref(t[0], v)
    hr, cr = encode_ref(t[1], v)
    return compose_math(hl, cl, hr, cr, v["U"], v["bu"])


def ref_loss(v, trees):
    return sum(-jax.nn.log_softmax(v["Wo"] @ encode_ref(t, v)[0] + v["bo"])[y] for t, y in trees)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_treelstm_matches_pure_jax(model, strategy):
    pc, ps, trees = model
    values = {k: p.value for k, p in ps.items()}
    ref_val = float(ref_loss(values, trees))
    ref_grads = jax.grad(ref_loss)(values, trees)
    zero_grads(pc)
    cg = dx.renew_cg(autobatch=strategy)
    loss = dx.esum([dx.pickneglogsoftmax(ps["Wo"] @ encode(t, ps)[0] + ps["bo"], y)
                    for t, y in trees])
    assert_close(loss.value(), ref_val, what=strategy)
    loss.backward()
    grads = grads_of(pc)
    for k, p in ps.items():
        assert_close(grads[p.name], ref_grads[k], what=f"{strategy} d/d{k}")
    n_leaf_calls = sum(count_leaves(t) for t, _ in trees)
    if strategy == "agenda":  # all leaves of all trees run as one batch
        leaf_batches = [b.nodes for b in cg.batches if b.sig.op.fn is leaf_math]
        assert len(leaf_batches) == 1 and len(leaf_batches[0]) == n_leaf_calls


def test_static_argument_is_part_of_signature(model):
    pc, ps, trees = model
    values = {k: p.value for k, p in ps.items()}

    def ref(v):
        return sum(-jax.nn.log_softmax(v["Wo"] @ encode_ref(t, v)[0] + v["bo"])[y]
                   for t, y in trees)

    ref_grads = jax.grad(ref)(values)
    zero_grads(pc)
    cg = dx.renew_cg(autobatch="agenda")
    loss = dx.esum([root_loss_cell(encode(t, ps)[0], ps["Wo"], ps["bo"], y) for t, y in trees])
    assert_close(loss.value(), float(ref(values)))
    loss.backward()
    assert_close(grads_of(pc)[ps["Wo"].name], ref_grads["Wo"])
    labels = {y for _, y in trees}
    root_batches = [b.nodes for b in cg.batches if b.sig.op is root_loss_cell.op]
    assert len(root_batches) == len(labels)  # one batch per distinct static label


@pytest.mark.parametrize("int_type", [np.int32, np.int64])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_numpy_integer_is_per_instance(model, strategy, int_type):
    """A NumPy integer label is per-instance data: one signature for all labels (one batch
    under agenda); values and gradients as plain jax.grad."""
    pc, ps, trees = model
    values = {k: p.value for k, p in ps.items()}
    ref_grads = jax.grad(ref_loss)(values, trees)
    zero_grads(pc)
    cg = dx.renew_cg(autobatch=strategy)
    loss = dx.esum([root_loss_cell(encode(t, ps)[0], ps["Wo"], ps["bo"], int_type(y))
                    for t, y in trees])
    assert_close(loss.value(), float(ref_loss(values, trees)), what=strategy)
    loss.backward()
    grads = grads_of(pc)
    for k, p in ps.items():
        assert_close(grads[p.name], ref_grads[k], what=f"{strategy} d/d{k}")
    root_batches = [b for b in cg.batches if b.sig.op is root_loss_cell.op]
    assert len({y for _, y in trees}) > 1
    assert len({b.sig for b in root_batches}) == 1  # labels 0..2, one signature
    if strategy == "agenda":  # all roots wait for the loss: one batch
        assert len(root_batches) == 1 and len(root_batches[0].nodes) == len(trees)


def test_numpy_integer_checked():
    """A per-instance integer that the function uses as an index (``[label]``) is checked
    against what it indexes, at construction, naming the function (JAX would clamp it: a
    label past the output layer would silently read the last class); nothing is added."""
    pc = dx.ParameterCollection(seed=0)
    Wo, bo = pc.add_parameters((C, H)), pc.add_parameters((C,))
    cg = dx.renew_cg()
    h = dx.input(np.ones(H, np.float32))
    root_loss_cell(h, Wo, bo, np.int64(C - 1))  # compiles the appender for this pattern
    n = cg.stats()["nodes"]
    for bad in (C, -1, 2**31):
        with pytest.raises(dx.IndexOutOfRangeError,
                           match=rf"root_loss_cell: index {bad} \(int argument 1 of 1\) out of "
                                 rf"range \[0, {C}\), what the function indexes with it"):
            root_loss_cell(h, Wo, bo, np.int64(bad))
    assert cg.stats()["nodes"] == n


@dx.function
def _split_in(x, k):  # k is a count (a shape), not an index: it cannot be traced
    return jnp.stack([p.sum() for p in jnp.split(x, k)])


def test_static_int_index_checked():
    """A static Python int label is refused past the end as a NumPy one is (JAX clamps a
    static index too: ``f(h, C)`` read class C - 1's loss before session 76); Python's
    negative indices within the axis stay valid, and an int used as a count is not an
    index. Nothing is added by a refused call."""
    pc = dx.ParameterCollection(seed=0)
    Wo, bo = pc.add_parameters((C, H)), pc.add_parameters((C,))
    cg = dx.renew_cg()
    h = dx.input(np.ones(H, np.float32))
    last = root_loss_cell(h, Wo, bo, C - 1)
    np.testing.assert_allclose(root_loss_cell(h, Wo, bo, -1).value(), last.value(), rtol=1e-6)
    n = cg.stats()["nodes"]
    for bad in (C, C + 5, -C - 1):
        with pytest.raises(dx.IndexOutOfRangeError,
                           match=rf"root_loss_cell: index {bad} \(argument 4, a static int\) "
                                 rf"out of range \[-{C}, {C}\), what the function indexes"):
            root_loss_cell(h, Wo, bo, bad)
    assert cg.stats()["nodes"] == n
    parts = _split_in(dx.input(np.arange(6.0, dtype=np.float32)), 3)
    np.testing.assert_allclose(parts.npvalue(), [1.0, 5.0, 9.0])


@dx.function
def _shifted_read(x, i):  # i + 1 indexes: i has no bound of its own
    return x[i + 1]


@dx.function
def _two_indices(x, E, i, j):  # i indexes two axes (4 and 3 rows): the smaller bounds it
    return x[i] * E[i, j] + E[2, j]


def test_numpy_integer_bounds_follow_its_uses_as_an_index():
    """An integer used as an index as it is gets that axis as its bound (the smallest of
    several uses; each integer its own); one used after arithmetic only the int32 range,
    and JAX's clamping is the user's to check; values as in JAX."""
    x = np.arange(1.0, 5.0, dtype=np.float32)[:3]  # 3 entries
    E = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    cg = dx.renew_cg()
    xe, Ee = dx.input(x), dx.input(E)
    n = cg.stats()["nodes"]
    assert _two_indices(xe, Ee, np.int32(2), np.int32(1)).value() == x[2] * E[2, 1] + E[2, 1]
    with pytest.raises(dx.IndexOutOfRangeError, match=r"index 3 \(int argument 1 of 2\) out "
                                                       r"of range \[0, 3\)"):
        _two_indices(xe, Ee, np.int32(3), np.int32(0))
    with pytest.raises(dx.IndexOutOfRangeError, match=r"index 3 \(int argument 2 of 2\) out "
                                                       r"of range \[0, 3\)"):
        _two_indices(xe, Ee, np.int32(0), np.int32(3))
    assert _shifted_read(xe, np.int32(1)).value() == x[2]
    assert _shifted_read(xe, np.int32(5)).value() == x[2]  # JAX clamps: documented
    with pytest.raises(dx.IndexOutOfRangeError,
                       match=r"_shifted_read: int argument -1 is outside \[0, 2\*\*31 - 1\)"
                             r".*not after arithmetic"):
        _shifted_read(xe, np.int32(-1))
    assert cg.stats()["nodes"] == n + 3  # the calls that were not refused


def test_nested_function_calls_inline():
    @dx.function
    def inner(x, W):
        return jnp.tanh(W @ x)

    @dx.function
    def outer(x, W):
        return inner(inner(x, W), W) * 2.0

    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((4, 4))
    xs = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    for strategy in STRATEGIES:
        zero_grads(pc)
        cg = dx.renew_cg(autobatch=strategy)
        out = dx.esum([dx.sum_elems(outer(dx.input(x), W)) for x in xs])
        ref = lambda w: sum(jnp.sum(jnp.tanh(w @ jnp.tanh(w @ x)) * 2.0) for x in xs)
        assert_close(out.value(), float(ref(W.value)))
        out.backward()
        assert_close(W.grad, jax.grad(ref)(W.value))
        assert cg.stats()["nodes"] == 3 + 3 + 1  # 3 outer, 3 sum_elems, 1 esum


def test_numpy_bool_is_a_static_argument_like_a_python_bool():
    """``np.True_`` is static like ``True`` (NumPy floats already were): the same
    signature, one batch, and the value of plain JAX."""
    @dx.function
    def maybe_negated(x, negate):
        return -x if negate else x

    cg = dx.renew_cg(autobatch="agenda")
    x = np.arange(3, dtype=np.float32)
    ys = [maybe_negated(dx.input(x), flag) for flag in (True, np.True_, False, np.False_)]
    total = dx.esum(ys)
    np.testing.assert_allclose(total.npvalue(), np.zeros(3), atol=0)
    np.testing.assert_allclose(ys[1].npvalue(), -x)
    batches = [b.nodes for b in cg.batches if b.sig.op is maybe_negated.op]
    assert sorted(map(len, batches)) == [2, 2]  # one per flag value, NumPy or Python


def test_a_function_recursing_on_arrays_costs_few_frames():
    """Inside a traced dx.function, a call with JAX arrays only is a plain call: straight
    to the function (it went through three more frames per level, so a self-recursion 200
    deep hit Python's default recursion limit, where plain JAX goes past 900)."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((4, 4), name="W")

    @dx.function
    def power(x, W, n):
        return x if n == 0 else jnp.tanh(W @ power(x, W, n - 1))

    def plain(x, w, n):
        for _ in range(n):
            x = jnp.tanh(w @ x)
        return x

    dx.renew_cg()
    loss = dx.sum_elems(power(dx.input(np.ones(4, np.float32)), W, 200))
    loss.backward()
    want, grad = jax.value_and_grad(lambda w: jnp.sum(plain(jnp.ones(4), w, 200)))(
        jnp.asarray(W.value))
    np.testing.assert_allclose(loss.value(), want, rtol=1e-5)
    np.testing.assert_allclose(W.grad, grad, rtol=1e-4, atol=1e-6)


@dx.function
def _window(x, i):  # 2 entries from i of a 3-vector: i < 2
    return lax.dynamic_slice(x, (i,), (2,))


@dx.function
def _overwritten(x, i):  # 2 entries written from i: i < 2
    return lax.dynamic_update_slice(x, jnp.zeros(2, x.dtype), (i,))


@dx.function
def _clipped_take(x, i):  # a clamping gather (jnp.take's default fills instead): i < 3
    return jnp.take(x, i, mode="clip")


@jax.jit
def _read_in_jit(x, i):
    return x[i]


@dx.function
def _read_via_jit(x, i):  # the use inside a nested jit: i < 3
    return _read_in_jit(x, i) * 2.0


@jax.jit
def _same(i):
    return i


@dx.function
def _read_after_jit(x, i):  # the integer comes out of a nested jit as it went in: i < 3
    return x[_same(i)]


@pytest.mark.parametrize("fn, bound, ref", [
    (_window, 2, lambda x, i: x[i:i + 2]),
    (_overwritten, 2, lambda x, i: np.concatenate([x[:i], [0.0, 0.0], x[i + 2:]])),
    (_clipped_take, 3, lambda x, i: x[i]),
    (_read_via_jit, 3, lambda x, i: 2.0 * x[i]),
    (_read_after_jit, 3, lambda x, i: x[i]),
], ids=["dynamic_slice", "dynamic_update_slice", "clamping-gather", "nested-jit",
        "out-of-a-jit"])
def test_index_uses_of_slices_gathers_and_nested_jits_are_bounded(fn, bound, ref):
    """Each use of an integer as an index JAX would clamp bounds it: the last valid value
    gives JAX's value, the next is refused (and adds no node)."""
    x = np.array([1.0, 2.0, 3.0], np.float32)
    cg = dx.renew_cg()
    xe = dx.input(x)
    np.testing.assert_allclose(fn(xe, np.int32(bound - 1)).npvalue(), ref(x, bound - 1))
    n = cg.stats()["nodes"]
    with pytest.raises(dx.IndexOutOfRangeError,
                       match=rf"{fn.__name__}: index {bound} \(int argument 1 of 1\) out of "
                             rf"range \[0, {bound}\)"):
        fn(xe, np.int32(bound))
    assert cg.stats()["nodes"] == n
