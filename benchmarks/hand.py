"""What every hand-batched JAX baseline shares: one jitted training step per shape signature.

A baseline subclasses ``HandBaseline`` and gives ``pack(batch) -> (signature, arrays)`` (the
host-side padding and indexing) and ``_loss(params, signature, *arrays)`` (the summed loss of
the batch, ``signature`` being static). The step — ``jax.value_and_grad`` of the loss and an
Adam update — is one ``jax.jit`` per signature, with the parameters and the optimizer state
donated.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax


class HandBaseline:
    """Parameters and Adam state on the device, ``update(batch)`` and ``signatures``."""

    def __init__(self, init: dict, lr: float):
        # committed to the device, like the step's outputs, so the second call of a
        # signature hits the jit cache instead of compiling again
        device = jax.devices()[0]
        self.params = jax.device_put({k: jnp.array(v) for k, v in init.items()}, device)
        self.tx = optax.adam(lr)
        self.opt_state = jax.device_put(self.tx.init(self.params), device)
        self.step = jax.jit(self._step, static_argnums=(0,), donate_argnums=(1, 2))
        self.signatures: set = set()  # the jit signatures met so far

    def pack(self, batch) -> tuple:
        """(static signature, host arrays) of a batch."""
        raise NotImplementedError

    def _loss(self, params, sig, *arrays):
        raise NotImplementedError

    def signature(self, batch):
        """The jit signature ``update`` would use for this batch (lets the harness precompile)."""
        return self.pack(batch)[0]

    def _step(self, sig, params, opt_state, *arrays):
        loss, grads = jax.value_and_grad(self._loss)(params, sig, *arrays)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def update(self, batch) -> tuple[jax.Array, float]:
        """One training update; returns (summed loss on the device, host packing seconds).
        Reading the loss waits for the step."""
        t0 = time.perf_counter()
        sig, arrays = self.pack(batch)
        t1 = time.perf_counter()
        self.signatures.add(sig)
        self.params, self.opt_state, loss = self.step(sig, self.params, self.opt_state, *arrays)
        return loss, t1 - t0
