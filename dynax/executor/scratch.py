"""Pooled residual buffers of run kernels: reused from graph to graph, never zero-filled.

A run kernel (``kernels.forward_run_kernel``) writes each step's vjp residuals into buffers
with room for its capacity of steps. Made inside the kernel, they were zero-filled at every
launch (XLA leaves no buffer uninitialised): the tagger's runs filled ~28 MB an update
that nothing read. Now each launch is handed a set from this pool, donated, and the kernel
writes its steps into it in place; the batch keeps it for its backward pass, and it comes
back when its graph is retired (``renew_cg``), for the next graph's launches of that kernel.
Rows past a run's own steps hold whatever an earlier run left there; nothing reads them
(backward runs a run's own steps only). Buffers donated to a launch that failed are lost,
and made anew.

The pool holds, per run kernel, as many sets as one graph's launches of it have needed at
once; ``dx.release_memory()`` lets them go, and a kernel dropped (``eviction.py``) takes
its sets with it.
"""
from __future__ import annotations

import weakref

import jax
import numpy as np

from ..device import get_device
from .kernels import run_residuals


class ResidualPool:
    """Free residual buffer sets, per run kernel."""

    def __init__(self):
        # keyed weakly: a kernel dropped with its family (eviction.py) is freed, sets and all
        self.free = weakref.WeakKeyDictionary()  # a run kernel's jitted function -> [sets]
        self.shapes = weakref.WeakKeyDictionary()  # ... -> its buffers' shapes

    def take(self, kern, args: tuple, T: int) -> tuple[tuple, list]:
        """A set of buffers for a launch of the run kernel ``kern`` with room for ``T``
        steps, given its other arguments ``args`` (``Engine._forward_args``), and the list
        it goes back to (``give_back``)."""
        free = self.free.setdefault(kern.fn, [])
        while free:
            got = free.pop()
            if not any(b.is_deleted() for b in got):  # not lost to a failed launch
                return got, free
        return self._made(kern, args, T), free

    def spare(self, kern, args: tuple, T: int) -> tuple:
        """A set for lowering ``kern`` (``ahead.py``), left in the pool."""
        free = self.free.setdefault(kern.fn, [])
        if not free:
            free.append(self._made(kern, args, T))
        return free[-1]

    def clear(self) -> None:
        self.free.clear()
        self.shapes.clear()

    def _made(self, kern, args: tuple, T: int) -> tuple:
        """A new set for ``kern``. Its shapes are traced once per kernel (from the run's
        first step: its packets' first row): tracing took 20-300 ms a set on a slow
        machine, and sets are made in steady state too, where a graph needs one more than
        any before it (the tagger made 6 over its updates 6 to 25)."""
        shapes = self.shapes.get(kern.fn)
        if shapes is None:
            shapes = self.shapes[kern.fn] = run_residuals(kern, args[:3] + (args[3][0],), T)
        return _new(shapes)


def give_back(batches) -> None:
    """Return the residual buffers of a retired graph's run batches to their pool lists
    (``Batch.pool``): nothing reads them from now on."""
    for b in batches:
        if b.pool is not None and b.saved:
            b.pool.append(b.saved)


def _new(shapes) -> tuple:
    # a host zero array put on the device: an eager jnp.zeros would compile a fill per shape
    device = get_device()
    return tuple(jax.device_put(np.zeros(s.shape, s.dtype), device) for s in shapes)
