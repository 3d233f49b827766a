"""A backward pass run while its loss is read, its parameter gradients held until claimed.

A training loop reads its loss, then calls ``backward()``::

    loss.value(); loss.backward(); trainer.update()

Reading the loss waits for the forward pass, and the host sat idle there; the backward
kernels were launched only after it, so the device, done with the forward pass, waited for
the host in turn. When a read waits and the graph is a training loop's (``may_run_early``),
the engine runs the backward pass of that loss right away (``Engine._backward_while_waiting``),
its kernels queued behind the forward pass, and holds the parameters' gradients aside here:
nothing a user can see changes until ``backward()`` of that same loss claims them
(``fits``, then ``commit``), which then launches nothing. Anything else (another loss, a
full backward, new nodes computed, parameters changed or given gradients since) drops them,
and that ``backward()`` runs as usual.

Measured on the benchmark's training loops (2-core CPU, blocks of 24 updates alternated in
one process, 16 rounds): the tagger 28.86 -> 27.23 ms per update, the Tree-LSTM 33.28 ->
32.23 (dynax/README.md).
"""
from __future__ import annotations

from ..device import zeros


def may_run_early(g, v: int) -> bool:
    """Whether ``backward()`` of value ``v`` may run while it is read: a training graph's
    scalar loss whose ancestors are known (``Engine.read`` found them while waiting), the
    graph's first backward pass (so no earlier pass's gradients are read meanwhile), and
    no parameter the graph uses with a gradient yet (held gradients start from zero)."""
    return (g.train and not g.check_validity and not g.immediate_compute
            and g.values_at_backward == 0 and g.early is None
            and g.loss_live is not None and g.loss_live[0] == g.val_node[v]
            and not any(p._has_grad for b in g.batches for p in b.sig.params))


class EarlyBackward:
    """A backward pass of value ``v`` of graph ``g`` run early: its parameters' gradients, held."""

    def __init__(self, g, v: int):
        self.v = v
        self.computed = g.computed  # nodes computed when it ran
        self.n_backward_batches = g.n_backward_batches  # the graph's count before it ran
        self.grads: dict = {}  # parameter -> its gradient so far
        self.calls: list = []  # (parameter, gradient, sig, nodes): Parameter._accumulate's
        self.arenas = None  # the pass's gradient arenas (Expression.gradient reads them)
        self.params = {p: p._value for b in g.batches for p in b.sig.params}  # values it used

    def buffer(self, p):
        """The gradient of ``p`` a backward kernel adds to (and consumes): zero at first, in
        the zeroed buffer ``p`` may keep (a lookup table's, between updates), which it
        gives up: an unclaimed pass leaves ``p`` with no buffer, its gradient still zero."""
        got = self.grads.get(p)
        if got is None:
            got, p._grad = p._grad, None
            if got is None:
                got = zeros(p.shape, p.dtype)
        return got

    def add(self, p, grad, sig, nodes) -> None:
        self.grads[p] = grad
        self.calls.append((p, grad, sig, nodes))

    def fits(self, g, v: int, full: bool) -> bool:
        """Whether ``backward()`` of ``v`` (``full`` or not) would compute these gradients:
        the same loss, no node computed since, and every parameter as it was (same value,
        still without a gradient)."""
        return (v == self.v and not full and g.computed == self.computed
                and all(p._value is value and not p._has_grad
                        for p, value in self.params.items()))

    def commit(self, g):
        """Give the parameters their gradients, as the pass run live would have (the same
        ``_accumulate`` calls, in order); the pass's gradient arenas."""
        for p, grad, sig, nodes in self.calls:
            p._accumulate(grad, sig, g, nodes)
        return self.arenas


class DroppedGradients:
    """In place of an ``EarlyBackward``: a pass whose parameter gradients are not wanted
    (``Engine._exact_gradients``): kernels add to zeros, and what they return is dropped."""

    grads: dict = {}  # no parameter has a buffer here

    def buffer(self, p):
        return zeros(p.shape, p.dtype)

    def add(self, p, grad, sig, nodes) -> None:
        pass
