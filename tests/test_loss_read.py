"""``backward()`` queues the loss's read ahead of the backward kernels, so that a loop
reading the loss after ``trainer.update()`` waits for the forward pass only, not for the
backward pass and the optimizer step queued before its read."""
from __future__ import annotations

import numpy as np
import optax

import dynax as dx

from reference import Chains

TOL = dict(rtol=1e-5, atol=1e-5)


def test_a_loss_read_after_the_update_is_the_forward_value():
    """``backward()`` queues the loss's read ahead of its kernels (a loop that reads the
    loss after ``trainer.update()`` then waits for the forward pass only): the value read
    is the forward's, not one computed with the updated parameters."""
    model = Chains()
    batch = [([1, 2, 3], 0), ([4, 5], 2), ([6, 7, 8, 9], 1)]
    before = float(model.reference(model.W.value, model.E.value, batch))  # plain JAX
    trainer = dx.Trainer(model.pc, optax.sgd(0.5))
    cg = dx.renew_cg(autobatch="agenda")
    loss = model.loss(batch)
    loss.backward()
    assert loss.v in cg.pending_reads  # queued before the backward kernels
    trainer.update()
    after_update = loss.scalar_value()
    assert cg.stats()["batches"] > 0
    np.testing.assert_allclose(after_update, before, **TOL)
    dx.renew_cg(autobatch="agenda")
    assert abs(model.loss(batch).scalar_value() - before) > 1e-3  # the update did change it
