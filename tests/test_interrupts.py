"""Ctrl-C during a trainer's step or a backward pass leaves the model whole: the steps that
consume donated buffers hold SIGINT and deliver it once they have stored their results."""
import inspect
import signal
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dynax as dx
from dynax.executor.engine import Engine
from dynax.nn.trainers import Trainer

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="signals reach the main thread only")


class Interrupted(BaseException):
    """What this test's SIGINT handler raises (a KeyboardInterrupt would stop pytest)."""


def _raise_interrupted(signum, frame):
    raise Interrupted


class interrupt_at:
    """SIGINT delivered as the line of ``fn`` holding ``text`` is about to run (once): where
    a Ctrl-C would hurt most, after a donating call returned and before its results are
    stored."""

    def __init__(self, fn, text):
        lines, start = inspect.getsourcelines(fn)
        self.code = fn.__code__
        self.line = start + next(i for i, line in enumerate(lines) if text in line)
        self.fired = False

    def _local(self, frame, event, arg):
        if event == "line" and frame.f_lineno == self.line and not self.fired:
            self.fired = True
            signal.raise_signal(signal.SIGINT)
        return self._local

    def _global(self, frame, event, arg):
        return self._local if frame.f_code is self.code else None

    def __enter__(self):
        self.handler = signal.signal(signal.SIGINT, _raise_interrupted)
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        signal.signal(signal.SIGINT, self.handler)


def _model():
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 4), name="W")
    E = pc.add_lookup_parameters((6, 4), name="E")
    return pc, W, E


def _loss(W, E):
    dx.renew_cg()
    return dx.sum_elems(dx.tanh(W @ E[2] + W @ E[5]))


def _ref_grads(W, E):
    def f(w, e):
        return jnp.sum(jnp.tanh(w @ e[2] + w @ e[5]))
    return jax.grad(f, argnums=(0, 1))(W.value, E.value)


def test_ctrl_c_after_the_optimizer_step_returns_keeps_the_update():
    """Two identical models take two Adam steps; the second step of one is interrupted
    as it returns. Its values are live and equal the other's: the step was kept whole."""
    models = [_model() for _ in range(2)]
    trainers = [dx.Trainer(pc, optax.adam(0.1)) for pc, _, _ in models]
    for (pc, W, E), trainer in zip(models, trainers):
        _loss(W, E).backward()
        trainer.update()  # compiles the step: the interrupt below lands in a warm call
        _loss(W, E).backward()
    trainers[0].update()
    (pc, W, E), trainer = models[1], trainers[1]
    with interrupt_at(Trainer._update, "for p in dense:") as at:
        with pytest.raises(Interrupted):
            trainer.update()
    assert at.fired
    assert not W._value.is_deleted() and not E._value.is_deleted()
    assert trainer.updates == 2 and not W._has_grad
    np.testing.assert_array_equal(W.value, models[0][1].value)
    np.testing.assert_array_equal(E.value, models[0][2].value)
    _loss(W, E).backward()  # and training goes on
    trainer.update()


def test_ctrl_c_between_backward_kernels_keeps_the_gradients():
    pc, W, E = _model()
    _loss(W, E).backward()  # compiles; then a fresh pass is interrupted
    pc.zero_grad()
    gw, ge = _ref_grads(W, E)
    loss = _loss(W, E)
    with interrupt_at(Engine._backward_batch, "for a, arr in zip(kern.write_akeys") as at:
        with pytest.raises(Interrupted):
            loss.backward()
    assert at.fired
    # the pass finished before the interrupt was delivered: gradients whole and readable
    np.testing.assert_allclose(W.grad, gw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(E.grad, ge, rtol=1e-5, atol=1e-6)


def test_held_interrupt_restores_the_handler_and_delivers_once():
    from dynax.interrupts import interrupts_held
    before = signal.signal(signal.SIGINT, _raise_interrupted)
    try:
        with pytest.raises(Interrupted):
            with interrupts_held():
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGINT)
                done = True  # the block ran to its end
        assert done
        assert signal.getsignal(signal.SIGINT) is _raise_interrupted
        with interrupts_held():  # nothing pending: nothing raised
            pass
    finally:
        signal.signal(signal.SIGINT, before)
