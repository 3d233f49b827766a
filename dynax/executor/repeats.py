"""Lanes of a batch that repeat another lane's computation, found so they run once.

A batch's lanes often compute the same thing twice: the Tree-LSTM benchmark's leaf cell for
a word that occurs in several of an update's 64 trees (about a third of its ~1,440 leaves
repeat a word), a lookup of a frequent word, the first step of sentences that start alike.
Two nodes of one signature compute equal outputs when their value arguments hold equal
values and their ints are equal: an op is a function of its arguments, its parameters (the
signature's) and its ints (a random draw's key is one of its ints). Values are known equal
when they are the same value, or when ``g.same`` says so: each repeated lane's outputs are
recorded there as equal to its first lane's, so the leaf cells of two lookups of one word
repeat, and so on downwards.

The engine (``Engine._prepare``) runs such a batch on its distinct lanes where that saves
enough work; every lane still gets its own output rows (a gather of its distinct lane's),
so each node keeps its value, its row and its place in ``stats()``. The backward kernel sums
the cotangents of a distinct lane's lanes and runs the vjp once: every parameter then gets
the same gradient as lane by lane, since lanes known equal are computed by equal
computations from equal leaves (their derivatives w.r.t. every parameter are equal). A
value's own cotangent is not the same: the arguments of the first lane get the sum, those
of the lanes repeating it none. So the engine merges only in a plain backward pass over
lanes that all reach the loss; ``backward(full=True)`` runs such batches lane by lane, and
``Expression.gradient()`` of a value upstream of a merge recomputes the pass lane by lane
(``Engine._exact_gradients``).
"""
from __future__ import annotations

from operator import itemgetter

import numpy as np

MAX_SKIP = 64  # batches of a signature not looked at, at most, after one without repeats


class RepeatGate:
    """Per signature: whether to look for repeats in its next batch. Looking costs about
    0.1 us a lane, so after a batch without repeats worth running once
    (``Engine._repeats``) the signature's next 1, 3, 7, ... batches (at most
    ``MAX_SKIP``) are not looked at; a batch with such repeats resets that (an RNN LM's
    steps repeat at the first word, where every sentence reads ``<s>``, hardly after)."""

    __slots__ = ("misses", "skip")

    def __init__(self):
        self.misses = 0  # batches looked at in a row without repeats
        self.skip = 0  # batches still to skip

    def looks(self) -> bool:
        if self.skip > 0:  # signatures are shared by threads: a race may take it below 0
            self.skip -= 1
            return False
        return True

    def saw(self, repeats: bool) -> None:
        if repeats:
            self.misses = 0
        else:
            self.misses += 1
            self.skip = min(MAX_SKIP, (1 << self.misses) - 1)


def repeated_lanes(g, sig, nodes):
    """``(distinct, expand)`` for a batch of ``sig`` over ``nodes``: the first lane of each
    distinct computation, and for each lane the index of its distinct one in ``distinct``;
    None if no lane repeats another. The repeated lanes' outputs are recorded in
    ``g.same`` as equal to their first lane's."""
    n = len(nodes)
    same = g.same
    # a row of keys per argument: value ids (a known-equal one as the earlier value), then
    # each int argument's ints (columns of the per-node tuples: itemgetter, as zip(*rows)
    # costs ~0.1 us a row)
    vals = list(map(g.node_vals.__getitem__, nodes))
    keys = [list(map(itemgetter(k), vals)) for k in range(len(sig.in_akeys))]
    if same:
        keys = [list(map(same.get, c, c)) for c in keys]
    if sig.n_ints:
        ints = list(map(g.node_ints.__getitem__, nodes))
        keys += [list(map(itemgetter(k), ints)) for k in range(sig.n_ints)]
    if not keys:  # nothing varies: every lane computes the same
        distinct, expand = np.zeros(1, np.int64), np.zeros(n, np.int64)
    elif len(keys) == 1:
        _, distinct, expand = np.unique(np.asarray(keys[0], np.int64), return_index=True,
                                        return_inverse=True)
    else:
        _, distinct, expand = np.unique(np.asarray(keys, np.int64), axis=1,
                                        return_index=True, return_inverse=True)
    if len(distinct) == n:
        return None
    expand = expand.reshape(-1)
    firsts = distinct[expand]  # each lane's first lane
    repeats = np.flatnonzero(firsts != np.arange(n))
    outs = np.fromiter(map(g.node_out.__getitem__, nodes), np.int64, n)
    o, of = outs[repeats], outs[firsts[repeats]]
    for j in range(len(sig.out_akeys)):  # outputs are consecutive values
        same.update(zip((o + j).tolist(), (of + j).tolist()))
    return distinct.tolist(), expand.tolist()
