"""Streamed backward launches: each backward kernel launches as soon as it is decided, until
one that has never run turns up; from there on the launches are collected and their new
kernels compiled side by side (``Engine._backward_batches``).

The order of launches is the same either way, so gradients must not change: each pass is
compared with ``autobatch="none"`` and with ``jax.grad`` of the same math."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import dynax as dx
from dynax.executor import engine
from reference import (Chains, check_against_none_and_jax, grads_of, train_pass,
                       zero_grads)


def _batch(lengths, seed):
    rng = np.random.default_rng(seed)
    return [(list(rng.integers(0, 10, k)), int(rng.integers(0, 4))) for k in lengths]


@pytest.fixture
def events(monkeypatch):
    """('decide' | 'launch', batch) in the order the backward pass does them."""
    log = []
    decide, launch = engine.Engine._backward_launch, engine.Engine._backward_batch

    def logged_decide(self, g, loss_node, live, once, full, batch):
        log.append(("decide", id(batch)))
        return decide(self, g, loss_node, live, once, full, batch)

    def logged_launch(self, g, grads, batch, launch_, ahead=None):
        log.append(("launch", id(batch)))
        return launch(self, g, grads, batch, launch_, ahead)

    monkeypatch.setattr(engine.Engine, "_backward_launch", logged_decide)
    monkeypatch.setattr(engine.Engine, "_backward_batch", logged_launch)
    return log


def _pass(model, batch, strategy="agenda"):
    return train_pass(model, batch, strategy)[:2]


def _first_launch(log) -> int:
    return next(i for i, (what, _) in enumerate(log) if what == "launch")


def test_known_kernels_launch_as_decided_new_ones_after_all_are_decided(events, monkeypatch):
    jax.clear_caches()  # every kernel of the first pass new, whatever ran before
    model = Chains()
    lengths = (3, 6, 2, 6)
    # first pass: every kernel is new, so every launch waits until all are decided
    batch = _batch(lengths, 0)
    value, grads = _pass(model, batch)
    n_decided = sum(what == "decide" for what, _ in events)
    assert n_decided > 3
    assert _first_launch(events) == n_decided  # all decisions first
    check_against_none_and_jax(model, batch, value, grads)
    # the same shapes again: each launch follows its own decision
    events.clear()
    batch = _batch(lengths, 1)
    value, grads = _pass(model, batch)
    assert [what for what, _ in events] == ["decide", "launch"] * n_decided
    assert [b for _, b in events[0::2]] == [b for _, b in events[1::2]]
    check_against_none_and_jax(model, batch, value, grads)
    # the third backward kernel taken for new: the two before it launch as decided, it and
    # the rest once all are decided
    events.clear()
    batch = _batch(lengths, 2)
    zero_grads(model.pc)
    dx.renew_cg()
    loss = model.loss(batch)
    value = loss.scalar_value()
    asked = []
    really_new = engine.is_new

    def third_is_new(fn):
        asked.append(fn)
        return len(asked) == 3 or really_new(fn)

    monkeypatch.setattr(engine, "is_new", third_is_new)
    loss.backward()
    grads = grads_of(model.pc)
    monkeypatch.setattr(engine, "is_new", really_new)
    assert [what for what, _ in events] == (["decide", "launch"] * 2
                                            + ["decide"] * (n_decided - 2)
                                            + ["launch"] * (n_decided - 2))
    check_against_none_and_jax(model, batch, value, grads)


def test_switched_off_every_launch_waits_for_all_decisions(events, monkeypatch):
    monkeypatch.setattr(engine, "STREAM_BACKWARD", False)
    model = Chains()
    lengths = (2, 4)
    for seed in range(2):  # the second pass's kernels are known: streamed if on
        batch = _batch(lengths, seed)
        events.clear()
        value, grads = _pass(model, batch)
        n_decided = sum(what == "decide" for what, _ in events)
        assert _first_launch(events) == n_decided
        check_against_none_and_jax(model, batch, value, grads)


def test_validity_mode_does_not_stream(events):
    model = Chains()
    batch = _batch((2, 3), 0)
    for _ in range(2):
        events.clear()
        zero_grads(model.pc)
        dx.renew_cg(check_validity=True)
        loss = model.loss(batch)
        value = loss.scalar_value()
        loss.backward()
        n_decided = sum(what == "decide" for what, _ in events)
        assert _first_launch(events) == n_decided
    check_against_none_and_jax(model, batch, value, grads_of(model.pc))
