"""Edges of the API contract (found by two audits in session 16): what a DyNet or JAX user
expects where API.md is brief. Of the first audit's tests, all but a few neighbouring cases
(one-item ``average``, the BiRNN builder, a chunked ``emax``) failed before their fixes; the
second audit's reproduce what it reported."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dynax as dx

from reference import STRATEGIES, rounded


def counts(cg):
    st = cg.stats()
    return st["nodes"], st["values"]


# ---- list operations always return an Expression of the current graph ---------------------------

@pytest.mark.parametrize("op", [dx.esum, dx.emax, dx.average, dx.concatenate])
def test_one_item_lists_give_an_expression(op):
    pc = dx.ParameterCollection(seed=0)
    A = pc.add_parameters((3,), name="A")
    dx.renew_cg()
    for item, want in ((A, np.asarray(A.value)), (np.arange(3.0), np.arange(3.0))):
        e = op([item])
        assert isinstance(e, dx.Expression)
        np.testing.assert_allclose(e.npvalue(), want, rtol=1e-6)
    dx.sum_elems(op([A])).backward()  # a Parameter's gradient flows through it
    np.testing.assert_allclose(A.grad, np.ones(3))


def test_one_item_shortcuts_check_the_item():
    dx.renew_cg()
    x = dx.input(np.ones(4))
    with pytest.raises(dx.ShapeError, match="axis d=3"):
        dx.concatenate([x], d=3)
    dx.renew_cg()
    for op in (lambda: dx.esum([x]), lambda: dx.emax([x]), lambda: dx.concatenate([x]),
               lambda: dx.dropout(x, 0.0)):
        with pytest.raises(dx.StaleExpressionError):
            op()


@pytest.mark.parametrize("op", [dx.esum, dx.emax, dx.average])
def test_an_expression_is_not_a_list(op):
    cg = dx.renew_cg()
    x = dx.input(np.ones(4))
    before = counts(cg)
    with pytest.raises(ValueError, match="expected a list"):
        op(x)
    assert counts(cg) == before


def test_expressions_are_not_sequences_or_arrays():
    cg = dx.renew_cg()
    x = dx.input(np.ones(4))
    before = counts(cg)
    with pytest.raises(TypeError, match="not iterable"):
        list(x)
    with pytest.raises(TypeError, match="not an array"):
        np.asarray(x)
    for e in (x, dx.sum_elems(x)):  # ``if e:`` would test the handle, never the value
        with pytest.raises(TypeError, match="no truth value"):
            bool(e)
    before = counts(cg)
    with pytest.raises(dx.DTypeError, match="input"):
        dx.input([x, x])
    assert counts(cg) == before
    # numpy scalars on either side still build nodes
    np.testing.assert_allclose((np.float32(2) * x + np.float64(1)).npvalue(), 3 * np.ones(4))


# ---- bad arguments are refused and change nothing ----------------------------------------------

def test_lookup_needs_a_table():
    cg = dx.renew_cg()
    x = dx.input(np.arange(4.0))
    before = counts(cg)
    for table in (x, np.ones((3, 3))):
        with pytest.raises(ValueError, match="lookup: the table must be"):
            dx.lookup(table, 2)
    assert counts(cg) == before
    assert x.value()[2] == 2.0  # the graph still computes


def test_booleans_and_floats_are_not_indices():
    """A TypeError (``ArgumentTypeError``), as Python's own ``[1, 2][1.0]``."""
    pc = dx.ParameterCollection(seed=0)
    E = pc.add_lookup_parameters((5, 2), name="E")
    dx.renew_cg()
    x = dx.input(np.arange(4.0))
    for op in (lambda: dx.pick(x, True), lambda: E[True], lambda: dx.pickneglogsoftmax(x, False),
               lambda: E[1.0], lambda: dx.pickneglogsoftmax(x, 1.0)):
        with pytest.raises(dx.ArgumentTypeError, match="index must be an integer"):
            op()


@pytest.mark.parametrize("call", [
    lambda: dx.pick(np.ones(3), 5),
    lambda: dx.pickneglogsoftmax(np.ones(4), 9),
    lambda: dx.hinge(np.ones(4), 9),
    lambda: dx.reshape(np.ones(4), (3,)),
])
def test_failed_ops_on_arrays_leave_no_constant(call):
    cg = dx.renew_cg()
    before = counts(cg)
    with pytest.raises(ValueError):
        call()
    assert counts(cg) == before


@pytest.mark.parametrize("make", [
    lambda pc: dx.nn.LSTMBuilder(2, 4, 6, pc).initial_state(),
    lambda pc: dx.nn.BiRNNBuilder(2, 4, 6, pc),
])
def test_builders_add_all_inputs_or_none(make):
    pc = dx.ParameterCollection(seed=0)
    cg = dx.renew_cg()
    rnn = make(pc)
    ok, bad = dx.input(np.ones(4)), dx.input(np.ones(5))
    before = counts(cg)
    with pytest.raises(dx.ShapeError):
        rnn.transduce([ok, ok, bad])
    assert counts(cg) == before


def test_dropout_rate_must_be_a_number():
    dx.renew_cg()
    for p in ("0.5", None, True, 1.0, -0.1):
        with pytest.raises(dx.InvalidArgumentError, match="dropout"):
            dx.dropout(dx.input(np.ones(3)), p)


# ---- parameters ----------------------------------------------------------------------------------

def test_bad_initialisers_are_refused_without_drawing_a_key():
    a, b = dx.ParameterCollection(seed=3), dx.ParameterCollection(seed=3)
    bad = [((3,), np.ones(4)), ((2, 3), lambda k, s: jnp.ones((5,))),
           ((2,), np.array(["a", "b"])), ((2,), np.array([1 + 1j, 2])), ((2.5, 3), "glorot"),
           ((0, 3), "glorot")]
    for shape, init in bad:
        with pytest.raises(dx.InvalidArgumentError, match="add_parameters"):
            a.add_parameters(shape, init=init)
    assert a.parameters() == []
    # the failed calls drew no key: the next parameter is the one a clean collection makes
    np.testing.assert_array_equal(a.add_parameters((3, 2)).value, b.add_parameters((3, 2)).value)
    W = b.parameters()[0]
    with pytest.raises(dx.InvalidArgumentError, match="set_value"):
        W.set_value(np.array([["a", "b"]] * 3))


@pytest.mark.parametrize("name", ["", "a b", 3])
def test_bad_subcollection_names_are_refused(name):
    with pytest.raises(dx.InvalidArgumentError, match="add_subcollection"):
        dx.ParameterCollection().add_subcollection(name)


@pytest.mark.parametrize("name", ["a b", "W!", "x:y"])
def test_bad_parameter_names_are_refused_without_drawing_a_key(name):
    a, b = dx.ParameterCollection(seed=3), dx.ParameterCollection(seed=3)
    with pytest.raises(dx.InvalidArgumentError,
                       match=f"parameter name 'enc/{name}' may contain only letters"):
        a.add_subcollection("enc").add_parameters((3, 2), name=name)
    with pytest.raises(dx.InvalidArgumentError, match=f"parameter name '{name}' may contain"):
        a.add_lookup_parameters((3, 2), name=name)
    assert a.parameters() == []
    np.testing.assert_array_equal(a.add_parameters((3, 2)).value, b.add_parameters((3, 2)).value)


def test_parameters_repr_names_kind_name_and_shape():
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_subcollection("enc").add_parameters((2, 3), name="W")
    E = pc.add_lookup_parameters((5, 4), name="E")
    assert repr(W) == "Parameter('enc/W', shape=(2, 3))"
    assert repr(E) == "LookupParameter('E', shape=(5, 4))"


@pytest.mark.parametrize("bad,match", [
    ([[1.0, 2.0, 3.0], [4.0]], "set_value of W: cannot make an array of list"),
    (np.zeros((3, 2)), r"set_value: W has shape \(2, 3\), got \(3, 2\)"),
    (np.zeros(6), r"set_value: W has shape \(2, 3\), got \(6,\)"),
])
def test_set_value_refuses_what_is_not_an_array_of_the_shape_and_changes_nothing(bad, match):
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((2, 3), name="W")
    before = np.array(W.value)
    with pytest.raises(dx.InvalidArgumentError, match=match):
        W.set_value(bad)
    np.testing.assert_array_equal(W.value, before)


def test_arrays_the_user_holds_survive_an_update():
    """Tables are updated in place (donated); an array the user took from the table, or gave
    it through a callable init, stays valid and unchanged."""
    G = jnp.ones((6, 4))
    pc = dx.ParameterCollection(seed=0)
    E = pc.add_lookup_parameters((6, 4), init=lambda key, shape: G, name="E")
    trainer = dx.SimpleSGDTrainer(pc, learning_rate=0.5)

    def step():
        dx.renew_cg()
        dx.sum_elems(E[1]).backward()
        trainer.update()

    step()
    held = E.value
    held_copy = np.array(held)
    step()
    np.testing.assert_array_equal(np.asarray(held), held_copy)  # still readable, unchanged
    np.testing.assert_array_equal(np.asarray(G), np.ones((6, 4)))
    np.testing.assert_allclose(np.asarray(E.value)[1], held_copy[1] - 0.5)
    # a loop that does not read the table keeps updating it in place (no copy per update)
    step()  # (the line above read E.value: this update works on a copy)
    pointer = E._value.unsafe_buffer_pointer()
    step()
    assert E._value.unsafe_buffer_pointer() == pointer


@pytest.mark.parametrize("make_trainer", [
    lambda pc: dx.SimpleSGDTrainer(pc, learning_rate=0.5),
    lambda pc: dx.AdamTrainer(pc, alpha=0.1),
    lambda pc: dx.Trainer(pc, optax.sgd(0.5), sparse_updates=False),
])
def test_dense_parameters_the_user_holds_survive_an_update(make_trainer):
    """Dense parameters are updated in place too (their arrays donated to the step): an
    array read through ``value`` stays valid and unchanged, while a loop that reads nothing
    updates in place (the step's arithmetic: the next test)."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 4), name="W")
    E = pc.add_lookup_parameters((5, 4), name="E")
    trainer = make_trainer(pc)
    x = np.arange(4.0, dtype=np.float32)

    def step():
        dx.renew_cg()
        dx.sum_elems(W @ (dx.input(x) + E[2])).backward()
        trainer.update()

    step()
    held, held_E = W.value, E.value
    copies = np.array(held), np.array(held_E)
    step()
    np.testing.assert_array_equal(np.asarray(held), copies[0])  # still readable, unchanged
    np.testing.assert_array_equal(np.asarray(held_E), copies[1])
    assert not np.array_equal(np.asarray(W.value), copies[0])  # the parameter did move
    step()  # (the lines above read the values: this update works on copies)
    pointers = W._value.unsafe_buffer_pointer(), E._value.unsafe_buffer_pointer()
    step()
    assert (W._value.unsafe_buffer_pointer(), E._value.unsafe_buffer_pointer()) == pointers


def test_dense_update_in_place_gives_the_plain_sgd_step():
    """The donated dense step is still exactly ``W - lr * grad``, with and without a read."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((2, 3), name="W")
    trainer = dx.SimpleSGDTrainer(pc, learning_rate=0.25)
    x = np.array([1.0, -2.0, 0.5], np.float32)
    for read in (False, True, False):
        before = W.npvalue()  # npvalue copies to the host without marking the value held
        if read:
            W.value
        dx.renew_cg()
        dx.sum_elems(W @ dx.input(x)).backward()
        trainer.update()
        np.testing.assert_allclose(W.npvalue(), before - 0.25 * np.outer([1.0, 1.0], x),
                                   rtol=1e-6)


def test_values_read_are_the_callers_own_copies():
    dx.renew_cg()
    x = dx.input(np.arange(4.0)) * 2.0
    dx.forward([x])
    v = x.npvalue()
    v[0] = 99.0  # writable, as in DyNet, and it does not change what x reads
    assert x.npvalue()[0] == 0.0
    w = x.value()
    w[1] = 99.0
    assert x.value()[1] == 2.0


# ---- emax splits tied gradients as jnp.max does ------------------------------------------------

@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n,tied", [(3, (0, 1)), (20, (0, 1)), (40, (0, 1, 17, 35))])
def test_emax_ties_match_jax_grad(strategy, n, tied):
    """Ties split as jnp.max splits them, equally among all tied items, also where lists
    longer than esum's chunks put them far apart (the audit's case: 17 and more items)."""
    pc = dx.ParameterCollection(seed=0)
    vals = [np.ones(3) if i in tied else np.zeros(3) for i in range(n)]
    ps = [pc.add_parameters((3,), init=v, name=f"p{i}") for i, v in enumerate(vals)]
    dx.renew_cg(autobatch=strategy)
    y = dx.sum_elems(dx.emax(ps))
    y.backward()
    want = jax.grad(lambda xs: jnp.sum(jnp.max(jnp.stack(xs), axis=0)))(
        [jnp.asarray(v, jnp.float32) for v in vals])
    assert y.value() == pytest.approx(3.0)
    for p, g in zip(ps, want):
        np.testing.assert_allclose(p.grad, g, rtol=1e-6, atol=1e-7, err_msg=p.name)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", [3, 5])
def test_emax_of_all_minus_infinity_splits_among_the_real_items(strategy, n):
    """A fully masked max (every item -inf): the list's padding is -inf too, and must not
    take a share of the gradient (it took 1/4 of it with 3 items)."""
    pc = dx.ParameterCollection(seed=0)
    x0 = np.full(n, -np.inf, np.float32)
    P = pc.add_parameters((n,), init=x0, name="P")
    dx.renew_cg(autobatch=strategy)
    m = dx.emax([dx.pick(P, i) for i in range(n)])
    m.backward()
    assert m.value() == -np.inf
    np.testing.assert_allclose(np.asarray(P.grad),
                               np.asarray(jax.grad(jnp.max)(jnp.asarray(x0))), rtol=1e-6)


# ---- NumPy spellings -------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reshape_infers_one_dimension_and_concatenate_counts_axes_from_the_end(strategy):
    pc = dx.ParameterCollection(seed=0)
    M = pc.add_parameters((2, 3), name="M")
    dx.renew_cg(autobatch=strategy)
    flat = dx.reshape(M, (-1,))
    assert flat.shape == (6,)
    assert dx.reshape(M, (3, -1)).shape == (3, 2)
    both = dx.concatenate([M, M * 2.0], d=-1)
    assert both.shape == (2, 6)
    m = np.asarray(M.value)
    np.testing.assert_allclose(both.npvalue(), np.concatenate([m, 2 * m], axis=-1), rtol=1e-6)
    y = dx.sum_elems(dx.cmult(flat, dx.input(np.arange(6.0)))) + dx.sum_elems(both)
    y.backward()
    want = jax.grad(lambda w: jnp.sum(w.reshape(-1) * jnp.arange(6.0))
                    + jnp.sum(jnp.concatenate([w, 2 * w], -1)))(jnp.asarray(m))
    np.testing.assert_allclose(M.grad, want, rtol=1e-6)
    for bad in ((-1, -1), (4, -1), (-2, 3), (0, -1)):
        with pytest.raises(dx.ShapeError, match="reshape"):
            dx.reshape(M, bad)
    with pytest.raises(dx.ShapeError, match="concatenate"):
        dx.concatenate([M, M], d=-3)


# ---- second audit (session 16): functions, builders, threads, arguments -------------------------

def test_signatures_and_shapes_interned_from_two_threads_stay_distinct():
    """Two threads making new signatures (and shapes) at once: every one keeps its own id,
    so no two signatures can batch together. Without the lock, duplicate ids appeared
    (12-18 in 4,000 with this switch interval)."""
    import sys
    import threading
    from dynax.ops.registry import AKEY_AVAL, live_signatures

    @dx.function
    def scaled(x, c):  # a static float: a signature per value
        return x * c

    start = max(s.sid for s in live_signatures()) + 1

    def work(offset):
        dx.renew_cg()
        for n in range(offset, 2000, 2):
            x = dx.input(np.ones((n % 7 + 700, 1 + n % 3), np.float32))
            scaled(x, float(n) + 0.5)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    new = [s for s in live_signatures() if s.sid >= start]
    assert len(new) >= 2000
    assert len({s.sid for s in new}) == len(new)
    for s in new:  # each signature's input shape is the one its value was interned with
        (akey,) = s.in_akeys
        assert AKEY_AVAL[akey].shape[0] in range(700, 707)


def test_integer_outputs_of_a_function_are_refused():
    @dx.function
    def with_argmax(x, W):
        y = jnp.tanh(W @ x)
        return y, jnp.argmax(y)

    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 4), name="W")
    cg = dx.renew_cg()
    x = dx.input(np.ones(4))
    before = counts(cg)
    with pytest.raises(dx.ArgumentTypeError, match="floating-point.*int32"):
        with_argmax(x, W)
    assert counts(cg) == before


def test_errors_inside_a_function_reach_the_user_as_they_are():
    @dx.function
    def typo(x):
        return jnpp.tanh(x)  # noqa: F821  (the bug under test)

    @dx.function
    def bad_shapes(x, W):
        return W @ x

    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 5), name="W")
    cg = dx.renew_cg()
    x = dx.input(np.ones(4))
    with pytest.raises(NameError, match="jnpp"):
        typo(x)

    class NotPositive(ValueError):  # the function's own check: its type stays
        pass

    @dx.function
    def checks(x):
        raise NotPositive("x must be positive")

    with pytest.raises(NotPositive, match="x must be positive") as err:
        checks(x)
    assert not isinstance(err.value, dx.ShapeError)
    with pytest.raises(dx.ShapeError, match="bad_shapes") as err:
        bad_shapes(x, W)
    assert err.value.__cause__ is not None  # JAX's full explanation stays in the chain
    assert counts(cg) == (0, 1)
    assert float(dx.sum_elems(x).value()) == 4.0


def test_functions_take_keywords_in_plain_calls():
    @dx.function
    def scaled(x, scale=1.0):
        return jnp.tanh(x) * scale

    np.testing.assert_allclose(scaled(jnp.ones(3), scale=3.0), 3 * np.tanh(np.ones(3)), rtol=1e-6)
    dx.renew_cg()
    with pytest.raises(dx.ArgumentTypeError, match="positional"):
        scaled(dx.input(np.ones(3)), scale=3.0)


def test_failed_builder_calls_leave_no_constant():
    pc = dx.ParameterCollection(seed=0)
    lstm = dx.nn.LSTMBuilder(1, 4, 3, pc)
    tree = dx.nn.TreeLSTMBuilder(4, 2, pc)
    child_sum = dx.nn.ChildSumTreeLSTMBuilder(4, 2, pc)
    cg = dx.renew_cg()
    state = lstm.initial_state()
    ok_pair = (np.zeros(2), np.zeros(2))
    calls = [lambda: lstm.initial_state([np.zeros(3), np.zeros(2)]),
             lambda: state.add_input(np.zeros(5)),
             lambda: tree.leaf(np.zeros(5)),
             lambda: tree.compose(ok_pair, (np.zeros(3), np.zeros(2))),
             lambda: child_sum.node(np.zeros(4), [ok_pair, (np.zeros(3), np.zeros(2))])]
    for call in calls:
        before = counts(cg)
        with pytest.raises(ValueError):
            call()
        assert counts(cg) == before


def test_argument_checks_of_graphs_builders_and_saving(tmp_path):
    for kw in (dict(seed=1.5), dict(seed=2 ** 31), dict(seed=-1), dict(train="no"),
               dict(check_validity=1)):
        with pytest.raises(ValueError, match="renew_cg"):
            dx.renew_cg(**kw)
    pc = dx.ParameterCollection(seed=0)
    lstm = dx.nn.LSTMBuilder(1, 4, 3, pc)
    with pytest.raises(dx.InvalidArgumentError, match="set_dropout"):
        lstm.set_dropout("x")
    W = pc.add_parameters((3, 3), name="W")
    dx.renew_cg()
    with pytest.raises(dx.ArgumentTypeError, match="affine_transform: expected a list"):
        dx.affine_transform(W)
    missing = tmp_path / "nope" / "model.npz"
    with pytest.raises(FileNotFoundError, match="nope"):
        pc.save(missing)


def test_loading_two_saved_objects_onto_one_name_is_refused(tmp_path):
    def lstm(seed):
        return dx.nn.LSTMBuilder(1, 3, 2, dx.ParameterCollection(seed=seed))

    path = tmp_path / "two.npz"
    dx.save(path, [lstm(1), lstm(2)])  # both builders' parameters are named lstm/...
    pc = dx.ParameterCollection(seed=3)
    a, b = dx.nn.LSTMBuilder(1, 3, 2, pc), dx.nn.LSTMBuilder(1, 3, 2, pc)
    before = [np.array(p.value) for p in pc.parameters()]
    for restore in (lambda: dx.load(path, pc), lambda: pc.populate(path)):
        with pytest.raises(ValueError, match="both map to parameter"):
            restore()
    for p, v in zip(pc.parameters(), before):
        np.testing.assert_array_equal(p.value, v)
    dx.load(path, [a, b])  # as a list of objects it is unambiguous
    np.testing.assert_array_equal(a.param_collection().parameters()[0].value,
                                  lstm(1).param_collection().parameters()[0].value)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_failed_validity_check_leaves_the_gradients_as_they_were(strategy):
    from dynax.executor.validity import NonFiniteValueError

    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((1, 1), init="zeros", name="W")  # sqrt'(0): an infinite gradient
    V = pc.add_parameters((1, 1), init="ones", name="V")
    E = pc.add_lookup_parameters((3, 1), init="ones", name="E")
    dx.renew_cg(autobatch=strategy, check_validity=True)
    dx.sum_elems(V @ E[2]).backward()  # an earlier, valid backward pass
    v_grad, e_grad = np.array(V.grad), np.array(E.grad)
    x = dx.input(np.ones(1))
    loss = dx.sum_elems(dx.sqrt(W @ x)) + dx.sum_elems(dx.tanh(V @ E[0]) * 3.0)
    with pytest.raises(NonFiniteValueError, match="non-finite gradient"):
        loss.backward()
    np.testing.assert_array_equal(V.grad, v_grad)
    np.testing.assert_array_equal(E.grad, e_grad)
    np.testing.assert_array_equal(W.grad, np.zeros((1, 1)))
    assert E.touched == {2}


def test_a_batch_that_fails_to_run_is_named_and_earlier_values_still_read():
    def host_fn(x):
        return np.tanh(x)

    @dx.function
    def unbatchable(x):  # a callback without a vmap rule: JAX refuses to batch it
        return jax.pure_callback(host_fn, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    dx.renew_cg()
    t = dx.tanh(dx.input(np.ones(3)))
    np.testing.assert_allclose(t.npvalue(), np.tanh(np.ones(3)), rtol=1e-6)
    y = unbatchable(dx.input(np.ones(3)))
    with pytest.raises(Exception) as err:
        y.npvalue()
    assert any("unbatchable" in n for n in getattr(err.value, "__notes__", []))
    np.testing.assert_allclose(t.npvalue(), np.tanh(np.ones(3)), rtol=1e-6)  # still readable
    with pytest.raises(RuntimeError, match="can compute nothing more.*unbatchable.*renew_cg"):
        dx.sum_elems(t).value()
    dx.renew_cg()  # a new graph works again
    assert dx.sum_elems(dx.input(np.ones(3))).value() == 3.0


@pytest.mark.parametrize("strategy", ["none", "depth", "agenda"])
def test_a_function_jax_cannot_differentiate_runs_for_decisions(strategy):
    """A callback without a JVP rule cannot save vjp residuals in a training forward: it
    runs values-only instead (a model may decide with it), a loss that does not depend on
    it gets jax.grad's gradient, and a backward that would need it is refused, naming the
    op and why its training forward failed, before anything is accumulated. An evaluation
    graph computes it as well."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 3), name="W")
    xs = [np.array([0.4, 1.6, -2.2], np.float32) * k for k in (1, 2, 3)]
    dx.renew_cg(train=True, autobatch=strategy)
    hs = [W @ dx.input(x) for x in xs]
    decisions = [rounded(h) for h in hs]
    for d, x in zip(decisions, xs):
        np.testing.assert_array_equal(d.npvalue(), np.round(np.asarray(W.value) @ x))
    dx.esum([dx.sum_elems(dx.tanh(h)) for h in hs]).backward()
    want = jax.grad(lambda w: sum(jnp.sum(jnp.tanh(w @ x)) for x in xs))(jnp.asarray(W.value))
    # atol: entries up to ~3 summed over 3 instances, one of them cancelling to ~0.09
    np.testing.assert_allclose(W.grad, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="backward: the loss depends on '.*rounded'.*cannot "
                                         "differentiate .its training forward failed: "
                                         "ValueError: Pure callbacks do not support JVP"):
        dx.sum_elems(decisions[1] * hs[1]).backward()
    np.testing.assert_allclose(W.grad, want, rtol=1e-5, atol=1e-5)  # nothing accumulated
    dx.renew_cg(train=False, autobatch=strategy)
    np.testing.assert_array_equal(rounded(W @ dx.input(xs[0])).npvalue(),
                                  np.round(np.asarray(W.value) @ xs[0]))


def test_a_failed_launch_forgets_only_its_own_kernels(monkeypatch):
    """A training forward that fails and falls back to values-only forgets the kernels it
    made, and only those: a kernel of the same family that another thread cached during
    the failing launch stays cached (it was forgotten by count before: that thread's next
    lookup of it compiled a second kernel, the caching race of session 78's audit)."""
    import threading

    from dynax.executor import engine, kernels

    def host_round(x):
        return np.round(x)

    @dx.function
    def round_on_host(h):  # a callback without a JVP rule: its training forward fails
        return jax.pure_callback(host_round, jax.ShapeDtypeStruct(h.shape, h.dtype), h,
                                 vmap_method="sequential")

    other = kernels.Kernel(fn=lambda *a: a, write_akeys=(), read_akeys=(), meta={},
                           body=lambda *a: a)
    launch = engine.Engine._launch
    cached_meanwhile = []

    def launch_while_another_thread_caches(self, g, run, ahead=None):
        sig = run[0][0]
        if sig.op.name.endswith("round_on_host") and not cached_meanwhile:
            t = threading.Thread(target=lambda: cached_meanwhile.append(
                (sig, kernels._cached(sig, ("another thread's",), other))))
            t.start()
            t.join()
        return launch(self, g, run, ahead)

    monkeypatch.setattr(engine.Engine, "_launch", launch_while_another_thread_caches)
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 3), name="W")
    x = np.array([0.4, 1.6, -2.2], np.float32)
    dx.renew_cg(train=True)
    decision = round_on_host(W @ dx.input(x))
    np.testing.assert_array_equal(decision.npvalue(), np.round(np.asarray(W.value) @ x))
    sig, cached = cached_meanwhile[0]
    assert sig.values_only is not None  # the training launch failed, and was undone
    assert cached is other and sig.kernels.get(("another thread's",)) is other
    own = [key for key in sig.kernels if key != ("another thread's",)]
    assert own and all(key[3] is None for key in own)  # its training kernel is forgotten


def test_a_failed_backward_says_the_gradients_are_partial():
    """A backward pass that fails part-way (here: a while_loop, which JAX cannot reverse)
    cannot undo what it accumulated without a copy of every gradient; the error says so,
    how to recover (validity mode restores them: tested above), and which op failed."""
    @dx.function
    def halvings(x):  # values only: a dynamic loop
        return jax.lax.while_loop(lambda v: jnp.sum(v) > 1.0, lambda v: v * 0.5, x)

    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((2, 2), name="W")
    dx.renew_cg()
    loss = dx.sum_elems(halvings(W @ dx.input(np.ones(2, np.float32)) + 4.0))
    assert np.isfinite(loss.value())
    with pytest.raises(ValueError) as err:
        loss.backward()
    notes = getattr(err.value, "__notes__", [])
    assert any("partly accumulated" in n and "check_validity" in n for n in notes)
    # and it names the op whose backward failed, as the forward pass does
    assert any("backward pass" in n and "halvings' node" in n for n in notes)


def test_a_backward_kernel_failing_while_running_leaves_no_deleted_gradient():
    """A kernel that fails while it runs (a host callback in a custom vjp raising) had been
    given the gradient buffers of its parameters (donated, so deleted): those parameters'
    gradients are dropped, not left as deleted arrays that fail every later read, update
    and backward. The other parameters keep what they accumulated, as the note says."""
    fail = [False]

    def host(g):
        if fail[0]:
            raise RuntimeError("boom in backward")
        return np.asarray(g)

    @jax.custom_vjp
    def ident(x):
        return x

    ident.defvjp(lambda x: (x, None), lambda _, g: (jax.pure_callback(
        host, jax.ShapeDtypeStruct(g.shape, g.dtype), g, vmap_method="sequential"),))

    @dx.function
    def cell(x, W):
        return ident(jnp.tanh(W @ x))

    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((4, 4), name="W")
    V = pc.add_parameters((4, 4), name="V")
    trainer = dx.SimpleSGDTrainer(pc, learning_rate=0.1)
    x = np.ones(4, np.float32)

    def loss():
        dx.renew_cg()
        return dx.sum_elems(cell(V @ dx.input(x), W))

    loss().backward()  # W and V now hold gradient buffers, which the next pass is given
    loss_ = loss()
    loss_.value()
    fail[0] = True
    with pytest.raises(Exception, match="boom in backward|pure_callback") as err:
        loss_.backward()
    fail[0] = False
    assert any("partly accumulated" in n for n in getattr(err.value, "__notes__", []))
    assert W._grad is None or not W._grad.is_deleted()
    assert W.grad is None or np.isfinite(W.grad).all()  # readable
    trainer.update()  # and training goes on
    pc.zero_grad()
    dx.renew_cg()
    l = loss()
    l.backward()
    w, v = jnp.asarray(W.value), jnp.asarray(V.value)
    gw, gv = jax.grad(lambda w, v: jnp.sum(jnp.tanh(w @ (v @ x))), argnums=(0, 1))(w, v)
    np.testing.assert_allclose(W.grad, gw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(V.grad, gv, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["none", "depth", "agenda"])
@pytest.mark.parametrize("train", [True, False])
def test_a_kernel_failing_at_run_time_spoils_only_its_graph(strategy, train):
    """A kernel that fails while running (here a callback that raises) has already been
    given the pooled arena it writes (donated): the next graph must get a fresh one, not
    the deleted buffer (every later graph on the thread failed until release_memory)."""
    def host_check(y):
        if (np.asarray(y) > 100).any():
            raise RuntimeError("out of range")
        return np.asarray(y)

    @dx.function
    def checked(y):
        return jax.pure_callback(host_check, jax.ShapeDtypeStruct(y.shape, y.dtype), y,
                                 vmap_method="sequential")

    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 4), name="W")
    x = np.ones(4, np.float32)
    dx.renew_cg(autobatch=strategy, train=train)
    first = dx.sum_elems(dx.tanh(W @ dx.input(x)))
    first.value()
    with pytest.raises(Exception, match="out of range"):
        checked(dx.input(np.full(3, 1000.0, np.float32))).value()
    assert np.isfinite(first.value())  # read before: still reads
    dx.renew_cg(autobatch=strategy, train=train)
    loss = dx.sum_elems(dx.tanh(W @ dx.input(x)))
    np.testing.assert_allclose(loss.value(), np.sum(np.tanh(np.asarray(W.value) @ x)),
                               rtol=1e-6)
    if train:
        loss.backward()
        want = jax.grad(lambda w: jnp.sum(jnp.tanh(w @ x)))(jnp.asarray(W.value))
        np.testing.assert_allclose(W.grad, want, rtol=1e-5, atol=1e-6)


def test_an_interrupted_forward_stops_its_graph_and_the_next_one_runs(monkeypatch):
    """Ctrl-C part-way through a forward pass (simulated: KeyboardInterrupt from the second
    launch): the graph's rows are handed out part-way and some batches recorded, so it
    refuses to compute more (a retry would record them twice, and backward count them
    twice); a new graph computes the right values and gradients."""
    from dynax.executor.engine import Engine

    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((4, 4), name="W")
    xs = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)

    def build():
        h = dx.input(np.zeros(4, np.float32))
        for x in xs:  # a chain: one launch per step
            h = dx.tanh(W @ h + dx.input(x))
        return dx.sum_elems(h)

    def ref(w):
        h = jnp.zeros(4)
        for x in xs:
            h = jnp.tanh(w @ h + x)
        return jnp.sum(h)

    launch, calls = Engine._launch, []

    def interrupted(self, g, run, *rest):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return launch(self, g, run, *rest)

    dx.renew_cg(autobatch="none")
    loss = build()
    monkeypatch.setattr(Engine, "_launch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        loss.value()
    monkeypatch.setattr(Engine, "_launch", launch)
    with pytest.raises(RuntimeError, match="stopped part-way.*KeyboardInterrupt"):
        loss.backward()
    assert W._grad is None  # nothing accumulated
    dx.renew_cg(autobatch="none")
    loss = build()
    loss.backward()
    np.testing.assert_allclose(loss.value(), ref(jnp.asarray(W.value)), rtol=1e-6)
    np.testing.assert_allclose(W.grad, jax.grad(ref)(jnp.asarray(W.value)), rtol=1e-5,
                               atol=1e-6)


def test_an_expressions_shape_dtype_and_length_are_known_before_it_is_computed():
    """``shape``, its DyNet spelling ``dim()``, ``dtype`` and ``len()`` (the first axis, as
    NumPy's) need no value: nothing runs; ``len()`` of a scalar is a TypeError, as NumPy's."""
    cg = dx.renew_cg()
    m = dx.input(np.ones((4, 3), np.float64))  # stored as float32, as every value
    s = dx.sum_elems(m)
    assert m.shape == m.dim() == (4, 3) and s.shape == s.dim() == ()
    assert m.dtype == s.dtype == np.float32
    assert len(m) == 4 and len(dx.transpose(m)) == 3
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d expression"):
        len(s)
    assert cg.stats()["batches"] == 0


def test_a_name_the_collection_lacks_is_a_key_error_listing_what_it_has():
    pc = dx.ParameterCollection(seed=0)
    enc = pc.add_subcollection("enc")
    W = enc.add_parameters((2,), name="W")
    assert enc["W"] is W and pc["enc/W"] is W
    with pytest.raises(KeyError, match=r"no parameter 'nope' in 'enc'; it has 'W'"):
        enc["nope"]
    with pytest.raises(KeyError, match=r"no parameter 'x'; it has none"):
        dx.ParameterCollection()["x"]
    with pytest.raises(dx.ArgumentTypeError, match=r"a parameter name is a str, got 3"):
        pc[3]


# ---- found by session 76's audit --------------------------------------------------------------

@pytest.mark.parametrize("strategy", STRATEGIES)
def test_affine_transform_of_a_bias_alone_is_the_bias(strategy):
    """``affine_transform([b])`` is ``b`` (an empty sum of products, as DyNet's); it raised
    a TypeError from the shape check before."""
    pc = dx.ParameterCollection(seed=0)
    b = pc.add_parameters((3,), init=np.array([1.0, -2.0, 0.5], np.float32), name="b")
    dx.renew_cg(autobatch=strategy)
    x = dx.input(np.array([3.0, 4.0, 5.0], np.float32))
    outs = [dx.affine_transform([b]), dx.affine_transform([x]),
            dx.affine_transform([np.ones(3)])]
    for e, want in zip(outs, ([1.0, -2.0, 0.5], [3.0, 4.0, 5.0], [1.0, 1.0, 1.0])):
        np.testing.assert_allclose(e.npvalue(), want, rtol=1e-6)
    dx.sum_elems(dx.cmult(outs[0], x)).backward()
    want = jax.grad(lambda w: jnp.sum(w * jnp.array([3.0, 4.0, 5.0])))(jnp.asarray(b.value))
    np.testing.assert_allclose(b.grad, want, rtol=1e-6)


@pytest.mark.parametrize("call,match", [
    (lambda x, M: dx.reshape(M, "ab"), r"reshape: the shape must be .*'ab'"),
    (lambda x, M: dx.reshape(M, None), r"reshape: the shape must be .*None"),
    (lambda x, M: dx.reshape(M, (6.9, 2)), r"reshape: the shape must be .*6\.9"),
    (lambda x, M: dx.reshape(M, (True, 6)), r"reshape: the shape must be"),
    (lambda x, M: dx.hinge(x, 0, margin="a"), r"hinge: margin must be a finite number"),
    (lambda x, M: dx.hinge(x, 0, margin=None), r"hinge: margin must be a finite number"),
    (lambda x, M: dx.hinge(x, 0, margin=np.ones(2)), r"hinge: margin must be a finite"),
])
def test_bad_static_arguments_name_the_operation(call, match):
    """A reshape's shape and a hinge's margin are checked as other ops' statics are: a
    ValueError naming the op (a bare ``int()``/``float()`` error before, and a float
    dimension was truncated), and nothing is added."""
    cg = dx.renew_cg()
    x, M = dx.input(np.ones(3)), dx.input(np.ones((2, 3)))
    n = counts(cg)
    with pytest.raises(dx.InvalidArgumentError, match=match):
        call(x, M)
    assert counts(cg) == n


def test_reshape_takes_a_numpy_shape():
    dx.renew_cg()
    M = dx.input(np.arange(6.0).reshape(2, 3))
    assert dx.reshape(M, np.array([3, 2])).shape == (3, 2)
    np.testing.assert_allclose(dx.reshape(M, np.array([-1])).npvalue(), np.arange(6.0))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_abs_of_an_expression_and_a_parameter(strategy):
    """Python's ``abs()`` is ``dx.abs``, as ``-e`` is ``dx.negate``."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3,), init=np.array([-1.5, 2.0, -0.25], np.float32), name="W")
    dx.renew_cg(autobatch=strategy)
    x = dx.input(np.array([-3.0, 0.5, 2.0], np.float32))
    np.testing.assert_allclose(abs(x).npvalue(), [3.0, 0.5, 2.0])
    dx.sum_elems(abs(W) + abs(x)).backward()
    want = jax.grad(lambda w: jnp.sum(jnp.abs(w)))(jnp.asarray(W.value))
    np.testing.assert_allclose(W.grad, want)


def test_input_of_a_graph_value_or_a_time_is_refused_clearly():
    pc = dx.ParameterCollection(seed=0)
    W, E = pc.add_parameters((2, 3)), pc.add_lookup_parameters((4, 3))
    cg = dx.renew_cg()
    n = counts(cg)
    for p, name in ((W, "a Parameter"), (E, "a LookupParameter")):
        with pytest.raises(dx.ArgumentTypeError, match=rf"input: got {name} of shape .*"
                                                       r"dx\.parameter\(p\)"):
            dx.input(p)
    for arr in (np.array([1], "timedelta64[s]"), np.array(["2020-01-01"], "datetime64[D]")):
        with pytest.raises(dx.DTypeError, match=re.escape(f"input: unsupported dtype {arr.dtype}")):
            dx.input(arr)
    assert counts(cg) == n


# ---- a DyNet program ported (session 76's check) ------------------------------------------------

@pytest.mark.parametrize("name,hint", [
    ("lookup_batch", "no batch dimension"), ("pickneglogsoftmax_batch", "no batch dimension"),
    ("vecInput", "a new graph"), ("cg_revert", "loss's ancestors"),
    ("FastLSTMBuilder", "LSTMBuilder")])
def test_dynet_names_with_no_counterpart_say_what_to_write(name, hint):
    assert not hasattr(dx, name)
    with pytest.raises(AttributeError, match=rf"'{name}' \(DyNet's\): .*{hint}"):
        getattr(dx, name)
    with pytest.raises(AttributeError, match=r"^module 'dynax' has no attribute 'nonesuch'$"):
        dx.nonesuch  # noqa: B018


def test_a_batch_of_indices_and_dynet_s_column_concatenation_are_refused_with_the_way():
    pc = dx.ParameterCollection(seed=0)
    E = pc.add_lookup_parameters((5, 3))
    cg = dx.renew_cg()
    n = counts(cg)
    for bad in ([1, 2], slice(1, 3), np.array([1, 2])):
        with pytest.raises(dx.ArgumentTypeError, match=r"lookup: index must be an integer.*"
                                                       r"no batch of indices"):
            dx.lookup(E, bad)
    with pytest.raises(dx.ArgumentTypeError, match="no batch of indices"):
        E[1:3]  # noqa: B018
    v = dx.input(np.ones(3))
    with pytest.raises(dx.ShapeError, match=r"axis d=1 .*dx\.concatenate_cols"):
        dx.concatenate([v, v], d=1)
    assert counts(cg) == (n[0], n[1] + 1)  # only v


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lstm_builder_takes_dynet_s_forget_bias(strategy):
    """``VanillaLSTMBuilder(..., forget_bias=b)`` starts the forget gate's bias at b (DyNet
    adds b at run time to a bias starting at 0: the same first step); its output equals
    the LSTM equations with that bias, under every strategy. ``ln_lstm=True`` is refused
    with the way, and nothing is added to the collection."""
    pc = dx.ParameterCollection(seed=0)
    lstm = dx.VanillaLSTMBuilder(1, 3, 2, pc, forget_bias=0.25)
    Wx, Wh, b = (np.asarray(p.value) for p in lstm.params[0])
    np.testing.assert_array_equal(b, [0, 0, 0.25, 0.25, 0, 0, 0, 0])
    dx.renew_cg(autobatch=strategy)
    x = np.array([0.5, -1.0, 2.0], np.float32)
    h = lstm.initial_state().add_input(dx.input(x)).output().npvalue()
    i, f, o, g = np.split(Wx @ x + b, 4)  # the first step: h and c start at 0
    sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    np.testing.assert_allclose(h, sig(o) * np.tanh(sig(i) * np.tanh(g)), rtol=1e-5)
    n = pc.parameter_count()
    with pytest.raises(dx.InvalidArgumentError, match=r"ln_lstm=True .* @dx\.function"):
        dx.VanillaLSTMBuilder(1, 3, 2, pc, ln_lstm=True)
    assert pc.parameter_count() == n
