"""``renew_cg(immediate_compute=True)`` (DyNet's debugging mode): each operation's value is
computed when it is built, so an error is raised by the call that caused it; values and
gradients are those of the lazy graph."""
import numpy as np
import pytest

import dynax as dx


def _model():
    pc = dx.ParameterCollection(seed=2)
    return pc, pc.add_parameters((3, 2)), pc.add_lookup_parameters((5, 2)), dx.LSTMBuilder(
        1, 2, 3, pc)


def _loss(W, E, lstm, seqs):
    losses = []
    for seq in seqs:
        s = lstm.initial_state().add_inputs([E[i] for i in seq])
        h = s[-1].output()
        losses.append(dx.pickneglogsoftmax(h + W @ E[seq[0]], seq[-1] % 3))
    return dx.esum(losses)


def _run(**kw):
    pc, W, E, lstm = _model()
    cg = dx.renew_cg(**kw)
    loss = _loss(W, E, lstm, [[1, 2, 3], [4, 0], [2, 2, 2, 1]])
    pending = len(cg.node_sig) - cg.computed
    value = loss.value()
    loss.backward()
    return value, [np.array(p.grad) for p in (W, E)], pending, cg.stats()


def test_values_and_gradients_equal_the_lazy_graphs():
    value, grads, pending, stats = _run(immediate_compute=True)
    assert pending == 0  # everything was computed while it was built
    for strategy in ("none", "agenda"):
        v, gs, lazy_pending, _ = _run(autobatch=strategy)
        assert lazy_pending > 0
        assert value == pytest.approx(v, rel=1e-6)
        for a, b in zip(grads, gs):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_each_node_is_computed_as_it_is_built():
    cg = dx.renew_cg(immediate_compute=True)
    x = dx.input(np.array([1.0, 2.0], np.float32))
    y = dx.tanh(x)
    assert cg.computed == len(cg.node_sig) == 1
    z = dx.esum([y, x, y])  # a composite (padded list): computed once all its nodes are built
    assert cg.computed == len(cg.node_sig)
    np.testing.assert_allclose(z.npvalue(), 2 * np.tanh([1, 2]) + [1, 2], rtol=1e-6)


def test_a_non_finite_value_is_raised_by_the_call_that_made_it():
    dx.renew_cg(immediate_compute=True, check_validity=True)
    x = dx.input(np.array([1.0, -1.0], np.float32))
    ok = dx.tanh(x)
    with pytest.raises(dx.NonFiniteValueError, match="log") as e:
        dx.log(x)  # log(-1) = nan, raised here, not at a later value()
    assert "test_immediate_compute.py" in str(e.value)
    assert np.isfinite(ok.npvalue()).all()


def test_a_failed_composite_adds_nothing_and_computes_nothing():
    cg = dx.renew_cg(immediate_compute=True)
    x = dx.input(np.ones(2, np.float32))
    before = len(cg.node_sig), cg.computed
    with pytest.raises(dx.ShapeError):
        dx.esum([x, dx.input(np.ones(3, np.float32))])
    assert (len(cg.node_sig), cg.computed) == before
    assert dx.sum_elems(x).value() == 2.0


def test_the_flag_is_checked():
    with pytest.raises(ValueError, match="immediate_compute must be True or False"):
        dx.renew_cg(immediate_compute="yes")
