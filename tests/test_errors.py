"""Bad input fails at construction with a ValueError (subclass) whose message names the
operation and the shapes or index involved; a failed call changes nothing."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx

STRATEGIES = ("none", "depth", "agenda")

_PC = dx.ParameterCollection(seed=0)
A = _PC.add_parameters((3,), name="A")
W = _PC.add_parameters((4, 3), name="W")
EMB = _PC.add_lookup_parameters((10, 4), name="emb")


def inp(shape):
    return dx.input(np.ones(shape, np.float32))


def check_message(err, names, *parts, site=True):
    """``err`` is a ValueError whose message contains one of ``names`` and every part."""
    assert isinstance(err, ValueError), type(err)
    msg = str(err)
    names = (names,) if isinstance(names, str) else names
    assert any(n in msg for n in names), f"no op name {names} in {msg!r}"
    for p in parts:
        assert p in msg, f"{p!r} not in {msg!r}"
    if site:  # the user's file:line where the bad call was made
        assert re.search(rf"{re.escape(__file__)}:\d+", msg), f"no {__file__}:line in {msg!r}"
    return msg


def check_index_message(err, name, index, shape):
    """The message names the op and the index (outside of the shape's own digits)."""
    msg = check_message(err, name)
    rest = msg.replace(str(shape), " ")
    assert re.search(rf"(?<![\d-]){re.escape(str(index))}(?!\d)", rest), \
        f"index {index} not in {msg!r}"
    return msg


# ---- shapes -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("op, names", [
    (lambda a, b: a + b, ("add", "+")),
    (lambda a, b: a - b, ("sub", "-")),
    (lambda a, b: a * b, ("cmult", "mul", "*")),
    (lambda a, b: a / b, ("cdiv", "div", "/")),
    (dx.cmult, "cmult"),
    (dx.cdiv, "cdiv"),
], ids=["add", "sub", "mul", "div", "cmult", "cdiv"])
def test_elementwise_shape_mismatch(op, names):
    dx.renew_cg()
    a, b = inp(3), inp(4)
    with pytest.raises(ValueError) as ei:
        op(a, b)
    check_message(ei.value, names, "(3,)", "(4,)")
    with pytest.raises(ValueError) as ei:  # a Parameter on one side
        op(b, A)
    check_message(ei.value, names, "(3,)", "(4,)")


def test_add_shape_mismatch_is_shape_error():
    dx.renew_cg()
    with pytest.raises(dx.ShapeError) as ei:
        inp(3) + inp(4)
    check_message(ei.value, "add", "(3,)", "(4,)")


def test_matmul_shape_mismatch():
    dx.renew_cg()
    x = inp(5)
    with pytest.raises(ValueError) as ei:
        W @ x
    check_message(ei.value, "matmul", "(4, 3)", "(5,)")
    m = inp((4, 3))
    with pytest.raises(ValueError) as ei:
        m @ x
    check_message(ei.value, "matmul", "(4, 3)", "(5,)")
    with pytest.raises(ValueError) as ei:
        m @ inp((2, 2))
    check_message(ei.value, "matmul", "(4, 3)", "(2, 2)")


def test_concatenate_mismatch():
    dx.renew_cg()
    a, b, c = inp((2, 3)), inp((2, 4)), inp((3, 3))
    with pytest.raises(ValueError) as ei:
        dx.concatenate([a, b])  # d=0: the other axis differs
    check_message(ei.value, "concatenate", "(2, 3)", "(2, 4)")
    with pytest.raises(ValueError) as ei:
        dx.concatenate([a, c], d=1)
    check_message(ei.value, "concatenate", "(2, 3)", "(3, 3)")
    with pytest.raises(ValueError) as ei:
        dx.concatenate([inp(3), a])  # vector with matrix
    check_message(ei.value, "concatenate", "(3,)", "(2, 3)")


def test_reshape_wrong_size():
    dx.renew_cg()
    with pytest.raises(ValueError) as ei:
        dx.reshape(inp(6), (4,))
    check_message(ei.value, "reshape", "(6,)", "(4,)")
    with pytest.raises(ValueError) as ei:
        dx.reshape(inp((2, 3)), (4, 2))
    check_message(ei.value, "reshape", "(2, 3)", "(4, 2)")


@pytest.mark.parametrize("name, build", [
    ("dot_product", lambda: dx.dot_product(inp(3), inp(4))),
    ("squared_distance", lambda: dx.squared_distance(inp(3), inp(4))),
    ("binary_log_loss", lambda: dx.binary_log_loss(inp(3), inp(4))),
    ("esum", lambda: dx.esum([inp(3), inp(4)])),
    ("average", lambda: dx.average([inp(3), inp(4)])),
    ("emax", lambda: dx.emax([inp(3), inp(4)])),
    ("affine_transform", lambda: dx.affine_transform([inp(3), W, inp(3)])),
], ids=lambda v: v if isinstance(v, str) else None)
def test_other_shape_mismatches(name, build):
    dx.renew_cg()
    with pytest.raises(ValueError) as ei:
        build()
    check_message(ei.value, name, "(3,)")


# ---- indices and labels -----------------------------------------------------------------------------

@pytest.mark.parametrize("i", [3, 4, 100, -1, -3])
def test_pick_out_of_range(i):
    dx.renew_cg()
    x = inp(3)
    with pytest.raises(ValueError) as ei:  # pick takes [0, n), as DyNet's
        dx.pick(x, i)
    check_index_message(ei.value, "pick", i, (3,))
    if i < 0:  # e[i] counts a negative index from the end, as NumPy's
        np.testing.assert_array_equal(x[i].value(), x.npvalue()[i])
        return
    with pytest.raises(ValueError) as ei:  # E[i] on an expression
        x[i]
    check_index_message(ei.value, "pick", i, (3,))


@pytest.mark.parametrize("i", [-4, -100])
def test_negative_item_out_of_range(i):
    dx.renew_cg()
    x = inp(3)
    with pytest.raises(ValueError) as ei:
        x[i]
    check_index_message(ei.value, "pick", i, (3,))


@pytest.mark.parametrize("label", [3, 7, -1])
def test_pickneglogsoftmax_label_out_of_range(label):
    dx.renew_cg()
    with pytest.raises(ValueError) as ei:
        dx.pickneglogsoftmax(inp(3), label)
    check_index_message(ei.value, "pickneglogsoftmax", label, (3,))


@pytest.mark.parametrize("i", [10, 11, 1000, -1])
def test_lookup_index_out_of_range(i):
    dx.renew_cg()
    with pytest.raises(ValueError) as ei:
        dx.lookup(EMB, i)
    check_index_message(ei.value, "lookup", i, (10, 4))
    with pytest.raises(ValueError) as ei:
        EMB[i]
    check_index_message(ei.value, "lookup", i, (10, 4))


@pytest.mark.parametrize("label", [3, 5, -1])
def test_hinge_label_out_of_range(label):
    dx.renew_cg()
    with pytest.raises(ValueError) as ei:
        dx.hinge(inp(3), label)
    check_index_message(ei.value, "hinge", label, (3,))
    with pytest.raises(ValueError) as ei:
        dx.hinge(inp(3), label, margin=0.5)
    check_index_message(ei.value, "hinge", label, (3,))


def test_non_integer_index_rejected():
    dx.renew_cg()
    with pytest.raises((ValueError, TypeError)):
        dx.pick(inp(3), 1.5)
    with pytest.raises((ValueError, TypeError)):
        dx.lookup(EMB, "2")


# ---- dx.input dtypes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value, dtype", [
    (np.array(["a", "b"]), "<U1"),
    (np.array([1.0, None], dtype=object), "object"),
    ("abc", "<U3"),
    ([["x", "y"]], "<U1"),
], ids=["str_array", "object_array", "python_str", "nested_str_list"])
def test_input_wrong_dtype(value, dtype):
    dx.renew_cg()
    with pytest.raises(ValueError) as ei:
        dx.input(value)
    check_message(ei.value, "input", dtype)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 0)])
def test_input_without_elements_refused(shape):
    """An empty array was taken (softmax of it computed []) while an empty slice was refused:
    no expression has zero elements, and nothing is added."""
    cg = dx.renew_cg()
    with pytest.raises(dx.ShapeError, match=r"input: shape \(.*\) has no element"):
        dx.input(np.zeros(shape, np.float32))
    assert cg.stats()["nodes"] == 0 and not cg.val_node


def test_input_nonfinite_accepted():
    dx.renew_cg()
    vals = np.array([np.nan, np.inf, -np.inf, 1.0])
    e = dx.input(vals)
    assert e.shape == (4,)
    np.testing.assert_array_equal(e.npvalue(), vals.astype(np.float32))
    assert np.isnan(dx.input(float("nan")).value())
    assert dx.input(float("inf")).value() == float("inf")


# ---- backward ---------------------------------------------------------------------------------------

def test_backward_non_scalar():
    dx.renew_cg()
    e = inp(3) + A
    with pytest.raises(dx.NonScalarBackwardError) as ei:
        e.backward()
    check_message(ei.value, "backward", "(3,)")
    m = inp((2, 3)) * 2.0
    with pytest.raises(dx.NonScalarBackwardError) as ei:
        m.backward()
    check_message(ei.value, "backward", "(2, 3)")
    np.testing.assert_array_equal(np.asarray(A.grad), np.zeros(3))


def test_backward_one_element_non_0d_allowed():
    """backward() needs one element, not a 0-d shape."""
    A.zero_grad()
    dx.renew_cg()
    e = dx.reshape(dx.sum_elems(inp(3) * A), (1,))
    assert e.shape == (1,)
    e.backward()
    np.testing.assert_allclose(np.asarray(A.grad), np.ones(3), rtol=1e-6)
    A.zero_grad()


# ---- stale expressions ----------------------------------------------------------------------------------

def test_stale_expression_in_op():
    dx.renew_cg()
    e = inp(3)
    dx.renew_cg()
    fresh = inp(3)
    for use in (lambda: dx.tanh(e), lambda: e + 1.0, lambda: e + fresh, lambda: fresh * e,
                lambda: W @ dx.concatenate([e, fresh]), lambda: dx.esum([fresh, e]),
                lambda: dx.pick(e, 0), lambda: A + e):
        with pytest.raises(dx.StaleExpressionError):
            use()
    assert issubclass(dx.StaleExpressionError, dx.DynaxError)


def test_stale_expression_value():
    dx.renew_cg()
    e = inp(3)
    s = dx.sum_elems(e * A)
    computed = dx.tanh(inp(2))
    computed.value()  # computed before the graph was replaced: still stale afterwards
    dx.renew_cg()
    for read in (e.value, e.npvalue, s.scalar_value, e.forward, s.backward, computed.value,
                 computed.npvalue):
        with pytest.raises(dx.StaleExpressionError):
            read()
    with pytest.raises(dx.StaleExpressionError):
        dx.forward([e])


# ---- a failed call changes nothing ------------------------------------------------------------------------

@dx.function
def ffn(x, M):
    return jnp.tanh(M @ x)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_failed_call_changes_nothing(strategy):
    A.zero_grad()
    cg = dx.renew_cg(autobatch=strategy)
    x = dx.input(np.array([0.5, -1.0, 2.0], np.float32))
    good = dx.tanh(x + A)
    before = good.npvalue()
    a_value = np.asarray(A.value).copy()
    # operands of the failing calls, built beforehand
    v4, v5, v6, m23, m24 = inp(4), inp(5), inp(6), inp((2, 3)), inp((2, 4))
    failing = [
        lambda: good + v4, lambda: A - v4, lambda: v4 * good, lambda: good / v4,
        lambda: W @ v5, lambda: dx.concatenate([m23, m24]), lambda: dx.reshape(v6, (4,)),
        lambda: dx.pick(good, 3), lambda: dx.pick(good, -1), lambda: good[7],
        lambda: dx.pickneglogsoftmax(good, 3), lambda: dx.lookup(EMB, 10), lambda: EMB[-1],
        lambda: dx.hinge(good, 3), lambda: dx.input(np.array(["a"])),
        lambda: dx.input(np.array([None], dtype=object)), lambda: good.backward(),
        lambda: dx.dot_product(good, v4), lambda: dx.squared_distance(good, v4),
        lambda: dx.esum([good, v4]), lambda: dx.average([good, v4]), lambda: dx.emax([good, v4]),
        lambda: dx.affine_transform([good, W, good]), lambda: dx.dropout(good, 1.5),
        lambda: ffn(v4, W),
    ]
    changed = []
    for k, call in enumerate(failing):
        st0 = cg.stats()
        with pytest.raises(ValueError):
            call()
        st1 = cg.stats()
        if (st1["nodes"], st1["values"]) != (st0["nodes"], st0["values"]):
            changed.append(f"failing call #{k}: nodes/values {st0['nodes']}/{st0['values']} "
                           f"-> {st1['nodes']}/{st1['values']}")
    # the graph still works: old values unchanged, new expressions build and compute
    np.testing.assert_array_equal(good.npvalue(), before)
    np.testing.assert_array_equal(np.asarray(A.value), a_value)
    np.testing.assert_array_equal(np.asarray(A.grad), np.zeros(3))
    twice = good * 2.0
    np.testing.assert_allclose(twice.npvalue(), 2 * before, rtol=1e-6)
    dx.sum_elems(good).backward()
    np.testing.assert_allclose(np.asarray(A.grad), 1 - before ** 2, rtol=1e-5, atol=1e-6)
    A.zero_grad()
    assert not changed, changed


def test_failed_call_with_array_operand_adds_nothing():
    """An array operand is turned into a constant; a call that then fails must not leave
    that constant behind in the graph."""
    cg = dx.renew_cg()
    x = inp(3)
    st0 = cg.stats()
    with pytest.raises(ValueError):
        x + np.ones(4, np.float32)
    st1 = cg.stats()
    assert (st1["nodes"], st1["values"]) == (st0["nodes"], st0["values"])


@pytest.mark.parametrize("op", [dx.esum, dx.average, dx.emax], ids=["esum", "average", "emax"])
def test_failed_list_op_on_fresh_graph_adds_nothing(op):
    """esum/average pad lists with a shared zero constant: a failing call must not add it."""
    cg = dx.renew_cg()
    a, b = inp(3), inp(4)
    st0 = cg.stats()
    with pytest.raises(ValueError) as ei:
        op([a, b, a])
    check_message(ei.value, op.__name__, "(3,)", "(4,)", "item 1")
    st1 = cg.stats()
    assert (st1["nodes"], st1["values"]) == (st0["nodes"], st0["values"])


@pytest.mark.parametrize("op", [dx.esum, dx.average, dx.emax], ids=["esum", "average", "emax"])
def test_failed_long_list_op_names_itself_and_the_item(op):
    """A list longer than one node's worth is reduced in chunks; the error still names the
    op the user called and the offending item's index in the user's list, not a chunk."""
    cg = dx.renew_cg()
    a, b = inp(3), inp(4)
    st0 = cg.stats()
    with pytest.raises(ValueError) as ei:
        op([a] * 20 + [b])
    check_message(ei.value, op.__name__, "item 0 has shape (3,)", "item 20 has (4,)")
    assert "esum" not in str(ei.value) or op is dx.esum
    st1 = cg.stats()
    assert (st1["nodes"], st1["values"]) == (st0["nodes"], st0["values"])


def _softmax_calls():
    pc = dx.ParameterCollection(seed=0)
    std = dx.nn.StandardSoftmaxBuilder(5, 7, pc)
    cls = dx.nn.ClassFactoredSoftmaxBuilder(5, [0, 0, 1, 1, 2], pc)
    bad = np.ones(3, np.float32)  # an array: a constant the failed call must not leave
    return {
        "standard full_logits": lambda: std.full_logits(bad),
        "standard full_log_distribution": lambda: std.full_log_distribution(bad),
        "standard neg_log_softmax": lambda: std.neg_log_softmax(bad, 1),
        "factored neg_log_softmax": lambda: cls.neg_log_softmax(bad, 1),
        "factored bad label": lambda: cls.neg_log_softmax(np.ones(5, np.float32), 9),
        "factored full_log_distribution": lambda: cls.full_log_distribution(bad),
        "factored class_log_distribution": lambda: cls.class_log_distribution(bad),
        # update=False: the weights' no-gradient copies are made before h is checked
        "standard full_logits frozen": lambda: std.full_logits(bad, update=False),
        "standard full_log_distribution frozen":
            lambda: std.full_log_distribution(bad, update=False),
        "factored class_logits frozen": lambda: cls.class_logits(bad, update=False),
        "factored subclass_logits frozen": lambda: cls.subclass_logits(bad, 0, update=False),
    }


@pytest.mark.parametrize("call", list(_softmax_calls()))
def test_failed_softmax_builder_call_adds_nothing(call):
    cg = dx.renew_cg()
    run = _softmax_calls()[call]
    st0 = cg.stats()
    with pytest.raises(ValueError):
        run()
    st1 = cg.stats()
    assert (st1["nodes"], st1["values"]) == (st0["nodes"], st0["values"])


# ---- builders: the same rules, and the user's line (not the builder's) in the message ---------

def _builder_cases():
    pc = dx.ParameterCollection(seed=0)
    lstm = dx.nn.LSTMBuilder(1, 3, 5, pc)
    tree = dx.nn.TreeLSTMBuilder(3, 4, pc)
    sm = dx.nn.StandardSoftmaxBuilder(5, 7, pc)
    return {
        "lstm input dim": (lambda: lstm.initial_state().add_input(inp(4)),
                           ("LSTMBuilder", "add_input"), "(4,)"),
        "lstm layers": (lambda: dx.nn.LSTMBuilder(0, 3, 5, pc), ("LSTMBuilder",), "0"),
        "birnn odd hidden": (lambda: dx.nn.BiRNNBuilder(1, 3, 5, pc, dx.nn.LSTMBuilder),
                             ("BiRNNBuilder",), "5"),
        "tree pair": (lambda: tree.compose(inp(4), inp(4)), ("TreeLSTMBuilder", "compose"), ""),
        "softmax label": (lambda: sm.neg_log_softmax(inp(5), 9), ("neg_log_softmax", "pick"),
                          "9"),
        "bad init": (lambda: pc.add_parameters((2, 2), init="nope"), ("add_parameters",),
                     "nope"),
    }


@pytest.mark.parametrize("case", list(_builder_cases()))
def test_builder_errors_name_the_user_line(case):
    dx.renew_cg()
    build, names, part = _builder_cases()[case]
    with pytest.raises(ValueError) as ei:
        build()
    check_message(ei.value, names, part)


def test_expressions_of_another_threads_graph_are_named_as_such():
    """Graphs are per thread: an expression built on another thread's (still current)
    graph is refused with a message that says so, in an op and in ``dx.forward`` (which
    used to fail with an IndexError from inside the engine)."""
    import threading
    built = {}

    def build():
        dx.renew_cg()
        built["e"] = dx.tanh(dx.input(np.ones(2, np.float32)))

    t = threading.Thread(target=build)
    t.start()
    t.join()
    dx.renew_cg()
    mine = dx.tanh(dx.input(np.full(2, 0.5, np.float32)))
    with pytest.raises(ValueError, match="another thread's computation graph"):
        mine + built["e"]
    with pytest.raises(ValueError, match="different graphs"):
        dx.forward([mine, built["e"]])
    np.testing.assert_allclose(mine.npvalue(), np.tanh(0.5), rtol=1e-6)  # nothing broken


@pytest.mark.parametrize("bad", [dict(autobatch="greedy"), dict(seed=-1), dict(train="yes"),
                                 dict(check_validity=1)])
def test_failed_renew_cg_keeps_the_current_graph(bad):
    """A ``renew_cg`` refused for its arguments changes nothing: the current graph stays
    current and alive, its expressions still read, and new nodes join it."""
    cg = dx.renew_cg()
    x = dx.input(np.array([1.0, 2.0], np.float32))
    with pytest.raises(ValueError, match="renew_cg"):
        dx.renew_cg(**bad)
    assert dx.current_graph() is cg
    np.testing.assert_allclose((dx.tanh(x) * 2.0).npvalue(), 2.0 * np.tanh([1.0, 2.0]),
                               rtol=1e-6)
    np.testing.assert_allclose(x.npvalue(), [1.0, 2.0])


@dx.function
def _branch_on_value(a):
    if a.sum() > 0:  # Python control flow on a traced value: JAX refuses it
        return a
    return -a


@dx.function
def _to_numpy(a):
    return jnp.asarray(np.asarray(a) * 2.0)


@pytest.mark.parametrize("fn, error", [(_branch_on_value, "TracerBoolConversionError"),
                                       (_to_numpy, "TracerArrayConversionError")])
def test_tracing_errors_in_a_function_reach_the_user_as_they_are(fn, error):
    """A function's own misuse of traced values raises JAX's error with its advice, not a
    ShapeError about the arguments, with a note naming the function and its arguments (the
    message names neither); and the graph is unchanged."""
    g = dx.renew_cg()
    x = dx.input(np.ones(4, np.float32))
    with pytest.raises(getattr(jax.errors, error)) as info:
        fn(x)
    assert not isinstance(info.value, dx.ShapeError)
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert f"while tracing {fn.__name__}((4,))" in note, note
    assert g.stats()["nodes"] == 0


@dx.function
def _scaled(x, M, how):
    return jnp.tanh(M @ x) * (1.0 if how is None else how[0])


@pytest.mark.parametrize("call, what", [
    (lambda x: _scaled(x, W, (1.0, [2.0])), "static argument (1.0, [2.0]) is not hashable"),
    (lambda x: _scaled(x, W, {"scale": 2.0}), "unsupported argument of type dict"),
    (lambda x: _scaled(x, jnp.ones((4, 3)), None), "argument 1 is a JAX array mixed with"),
    (lambda x: _scaled(x, W, how=None), "positional arguments only"),
], ids=["unhashable-static", "dict", "jax-array", "keyword"])
def test_function_arguments_it_cannot_take_are_named(call, what):
    """A dx.function node's arguments: Expressions, Parameters, NumPy arrays and integers,
    and hashable statics. Anything else is an ArgumentTypeError naming the function and
    the argument, at the user's line, and the graph is unchanged."""
    g = dx.renew_cg()
    x = inp(3)
    st0 = g.stats()
    with pytest.raises(dx.ArgumentTypeError) as ei:
        call(x)
    check_message(ei.value, "_scaled", what)
    assert (g.stats()["nodes"], g.stats()["values"]) == (st0["nodes"], st0["values"])
    # the same function still builds nodes, with a static tuple and with None
    np.testing.assert_allclose(_scaled(x, W, (2.0,)).npvalue(),
                               2 * _scaled(x, W, None).npvalue(), rtol=1e-6)


def test_function_with_plain_arrays_is_a_plain_call():
    """Without an Expression or Parameter argument (JAX or NumPy arrays only, as inside
    another traced function) a dx.function runs its JAX function and adds no node."""
    g = dx.renew_cg()
    m, x = np.ones((4, 3), np.float32), np.array([0.5, -1.0, 2.0], np.float32)
    for args in ((jnp.asarray(x), jnp.asarray(m), None), (x, m, (3.0,))):
        out = _scaled(*args)
        want = np.tanh(m @ x) * (1.0 if args[2] is None else 3.0)
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
    assert g.stats()["nodes"] == 0


def test_stale_expressions_given_to_builders_name_the_builder_and_the_user_line():
    pc = dx.ParameterCollection(seed=0)
    lstm = dx.nn.LSTMBuilder(1, 3, 5, pc)
    bi = dx.nn.BiRNNBuilder(1, 3, 4, pc, dx.nn.LSTMBuilder)
    tree = dx.nn.TreeLSTMBuilder(3, 4, pc)
    dx.renew_cg()
    old = inp(3)
    g = dx.renew_cg()
    for call, name in ((lambda: lstm.initial_state().add_input(old), "LSTMBuilder.add_input"),
                       (lambda: bi.transduce([old]), "BiRNNBuilder"),
                       (lambda: tree.leaf(old), "TreeLSTMBuilder.leaf")):
        with pytest.raises(dx.StaleExpressionError) as ei:
            call()
        msg = str(ei.value)
        assert name in msg and "renew_cg" in msg, msg
        assert re.search(rf"{re.escape(__file__)}:\d+", msg), msg
    assert g.stats()["nodes"] == 0


@pytest.mark.parametrize("change", ["set_value", "update", "populate"])
def test_backward_through_values_of_changed_parameters_is_refused(change, tmp_path):
    """After a parameter changes, a backward pass through nodes computed with its old value
    would mix old and new values (updates donate the old array): refused before anything is
    accumulated. Nodes computed after the change, and losses not reading the old nodes,
    backpropagate as usual (DyNet computes later nodes with the new values too)."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 3), name="W")
    V = pc.add_parameters((3, 3), name="V")
    trainer = dx.SimpleSGDTrainer(pc, learning_rate=0.1)
    pc.save(tmp_path / "p.npz")
    x = np.array([1.0, -1.0, 0.5], np.float32)
    dx.renew_cg()
    old_loss = dx.sum_elems(dx.tanh(W @ dx.input(x)))
    other = dx.sum_elems(dx.tanh(V @ dx.input(x)))
    other.value()
    old_loss.value()
    if change == "set_value":
        W.set_value(2 * np.asarray(W.value))
    elif change == "populate":
        pc.populate(tmp_path / "p.npz")
    else:
        old_loss.backward()
        trainer.update()
    with pytest.raises(dx.StaleExpressionError, match="W changed"):
        old_loss.backward()
    assert np.all(np.asarray(W.grad) == 0)  # nothing accumulated
    if change == "set_value":  # (populate and a dense update replace V's array too)
        other.backward()  # does not read W: unaffected
        assert np.abs(np.asarray(V.grad)).sum() > 0
    w = np.asarray(W.value)
    new_loss = dx.sum_elems(dx.tanh(W @ dx.input(x)))  # computed with the new value
    new_loss.backward()
    want = jax.grad(lambda w: jnp.sum(jnp.tanh(w @ x)))(jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(W.grad), np.asarray(want), rtol=1e-5, atol=1e-6)


@dx.function
def _dict_out(x):
    return {"x": x}


IMAGE = np.ones((5, 5, 1), np.float32)
FILTER = np.ones((2, 2, 1, 1), np.float32)


@pytest.mark.parametrize("call, error, what", [
    (lambda x, s: dx.cmult(2.0, 3.0), dx.ArgumentTypeError,
     "cmult: at least one argument must be an Expression or Parameter"),
    (lambda x, s: dx.affine_transform([x, W]), dx.InvalidArgumentError,
     "affine_transform: expected [b, W1, x1, ...] (odd length), got 2 items"),
    (lambda x, s: dx.concatenate([x, x], 1.0), dx.ArgumentTypeError,
     "concatenate: axis d must be an int, got 1.0"),
    (lambda x, s: s[0:1], dx.ShapeError, "slice: a scalar has no dimension"),
    (lambda x, s: jax.jit(lambda a: dx.tanh(a))(jnp.ones(3)), dx.ArgumentTypeError,
     "tanh: dynax ops build graph nodes, so they cannot run on traced JAX values"),
    (lambda x, s: jax.jit(dx.input)(jnp.ones(3)), dx.ArgumentTypeError,
     "input: dynax ops build graph nodes, so they cannot run on traced JAX values"),
    (lambda x, s: _dict_out(x), dx.ArgumentTypeError,
     "_dict_out: outputs must be arrays or a tuple of arrays"),
    (lambda x, s: dx.select_rows(x, [0]), dx.ShapeError,
     "select_rows: expected a matrix, got shape (3,)"),
    (lambda x, s: dx.conv2d(IMAGE, FILTER, [1, 1], is_valid=1), dx.InvalidArgumentError,
     "conv2d: is_valid must be True or False, got 1"),
    (lambda x, s: dx.conv2d_bias(IMAGE, FILTER, None, [1, 1]), dx.InvalidArgumentError,
     "conv2d_bias: the bias b is required"),
], ids=["two-numbers", "affine-even", "concatenate-axis", "slice-scalar", "traced-operand",
        "traced-input", "function-dict-output", "select-rows-vector", "conv-flag",
        "conv-bias-none"])
def test_arguments_an_op_cannot_take_are_named(call, error, what):
    """Numbers only, a list of the wrong length, an axis that is not an int, a slice of a
    scalar, and JAX's traced values (a dynax op under jax.jit): each refused with the op's
    name and what is wrong, at the user's line; the graph is unchanged."""
    g = dx.renew_cg()
    x = inp(3)
    s = dx.sum_elems(x)
    st0 = g.stats()
    with pytest.raises(error) as ei:
        call(x, s)
    check_message(ei.value, what.split(":")[0], what)
    assert (g.stats()["nodes"], g.stats()["values"]) == (st0["nodes"], st0["values"])


def test_scalar_value_of_a_vector_names_the_line():
    """scalar_value() of a vector is refused before anything is computed, with the user's
    line as every other construction error (it was a plain ValueError without one)."""
    cg = dx.renew_cg()
    e = dx.tanh(dx.input(np.ones(3, np.float32)))
    with pytest.raises(dx.ShapeError, match=r"scalar_value: expression has shape \(3,\), not "
                                            r"one element; use value\(\) .*test_errors.py"):
        e.scalar_value()
    assert cg.stats()["batches"] == 0


@pytest.mark.parametrize("shape, hint", [((), True), ([], True), ((0,), False),
                                         ((3, -1), False), ((2.0,), False), ("a", False),
                                         ((True,), False)])
def test_parameter_shapes_must_be_positive_ints(shape, hint):
    """Parameters are refused with zero, negative or non-int sizes; a scalar one (shape ())
    is pointed to (1,), as in DyNet, where a parameter has at least one dimension."""
    pc = dx.ParameterCollection(seed=0)
    with pytest.raises(dx.InvalidArgumentError, match="add_parameters: invalid shape") as ei:
        pc.add_parameters(shape)
    assert ("shape (1,)" in str(ei.value)) == hint
    assert not list(pc.parameters())
