"""check_validity=True: the first non-finite value or gradient raises, naming op and line."""
import numpy as np
import pytest

import dynax as dx
NonFiniteValueError = dx.NonFiniteValueError  # exported by name


@pytest.mark.parametrize("strategy", ["none", "agenda"])
def test_nonfinite_forward_names_op_and_line(strategy):
    dx.renew_cg(autobatch=strategy, check_validity=True)
    x = dx.input(np.array([1.0, -1.0], np.float32))
    ok = dx.tanh(x)
    bad = dx.log(x)  # log(-1) = nan
    with pytest.raises(NonFiniteValueError) as e:
        (dx.sum_elems(ok) + dx.sum_elems(bad)).value()
    assert "log" in str(e.value) and "test_validity.py" in str(e.value)


def test_nonfinite_gradient_is_reported():
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((2,), init=np.array([0.0, 1.0], np.float32))
    dx.renew_cg(check_validity=True)
    loss = dx.sum_elems(dx.sqrt(dx.cmult(W, W)))  # d/dW sqrt(W^2) at 0: 0 * inf = nan
    assert np.isfinite(loss.value())
    with pytest.raises(NonFiniteValueError, match="gradient"):
        loss.backward()


def test_finite_graph_passes_in_validity_mode():
    dx.renew_cg(check_validity=True)
    x = dx.input(np.array([1.0, 2.0], np.float32))
    assert dx.sum_elems(dx.tanh(x)).value() == pytest.approx(float(np.tanh([1, 2]).sum()))
