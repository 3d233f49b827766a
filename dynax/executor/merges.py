"""Backward batches merged across forward passes.

A graph computed in many forward passes (a parser or decoder deciding from the values of
each step: ``dx.forward`` or ``.value()`` per step) holds one narrow batch of its step's
signature per pass. Backward ran them one by one: the benchmark parser's ~77 score batches
of ~33 lanes each were ~77 launches and a kernel per batch size. Their nodes are independent
of each other and only read at the end (by the loss), so their backward can run as one batch.

Which merge, decided from the last batch back: a batch joins the latest group of its
signature formed so far (the group running earliest in forward order), unless a batch
reading its nodes runs before that group does, counting a reading batch as running where
its own group does; a group runs where its last member ran. So every batch reading a
group's nodes runs after the group in forward order (before it in backward, passing back
its cotangents first), and every batch producing its inputs runs before it. Loss terms
built step by step (a decision's log-probability picked after each step) merge first,
into a group near the end, which lets the steps' scores they read merge too.

A merged batch recomputes its vjp from the value arenas (``Engine._lane_by_lane``): its
members' saved residuals are of other batch sizes. That recomputation is a forward pass of
the op, so only groups of narrow batches merge (``MERGE_MAX_LANES``), where a launch costs
more than its lanes' work. Its size is the count of the steps' decisions, which drifts as
a model trains: padded on the batch ladder, the parser's 2,600-2,800 lanes met a new size
(a compilation) in steady state, and padded to a power of two (4,096) they cost the device
what the launches saved (+4.2% and +5.2% per update in two A/Bs). So a group larger than
``engine.MERGE_CHUNK`` lanes runs as chunks of that size, the last one padded: one kernel.

Measured on the benchmark parser (session 57, alternated in one process): backward
launches per update 96-97 -> 25-28 (``stats()['backward_batches']``, which counts a fused
run's steps, 125 -> 54), the backward phase -26%, steady updates on par (+1.3%,
faster in 7 of 12 rounds; CPU -1.5%); its first 8 updates 5.6-8.7% faster, with 145
compilations instead of 157.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from ..batcher.strategies import edges

MERGE_MAX_LANES = 64  # members of a merged group average at most this many nodes


def _mergeable(batch) -> bool:
    """A plain batch that saved its vjp: not a fused run (stacked packets), not one that ran
    its distinct lanes only (``repeats.py``), not one without a gradient (or a lookup,
    whose backward scatters rows), and not already a backward plan's."""
    return (batch.forward is not None and batch.packet.ndim == 1 and not batch.distinct
            and not batch.gathered_outs)


def merged_groups(g, batches) -> list[list[int]]:
    """Groups of two or more of ``batches`` (indices, in forward order) whose backward can
    run as one batch, by the rule above; none where no signature has two mergeable
    batches of ``MERGE_MAX_LANES`` nodes or fewer on average."""
    ok = [_mergeable(b) for b in batches]
    count, lanes = Counter(), Counter()
    for b, fits in zip(batches, ok):
        if fits:
            count[b.sig] += 1
            lanes[b.sig] += len(b.nodes)
    narrow = {s for s, c in count.items() if c > 1 and lanes[s] <= MERGE_MAX_LANES * c}
    if not narrow:
        return []
    readers = _readers(g, batches)
    m = len(batches)
    # where each batch runs, in forward order: its group's last member's place (and m:
    # after them all, for a reader in no batch)
    slot = list(range(m + 1))
    latest: dict = {}  # signature -> its group formed last here (earliest in order)
    groups = []
    for j in range(m - 1, -1, -1):
        b = batches[j]
        if not ok[j] or b.sig not in narrow:
            continue
        group = latest.get(b.sig)
        first_read = min((slot[r] for r in readers[j]), default=m)
        if (group is not None and first_read > slot[group[0]]
                and all(x is y for x, y in zip(batches[group[0]].param_values,
                                               b.param_values))):
            group.append(j)
            slot[j] = slot[group[0]]
        else:
            latest[b.sig] = group = [j]
            groups.append(group)
    return [sorted(group) for group in groups if len(group) > 1]


def _readers(g, batches) -> list[list[int]]:
    """For each batch, the batches reading its nodes' outputs (indices; ``len(batches)``
    for readers in none)."""
    n = g.computed
    m = len(batches)
    where = np.full(n, m, np.int64)  # node -> its batch
    for i, b in enumerate(batches):
        where[b.nodes] = i
    producer, reader = edges(g, 0, n, np.fromiter(map(len, g.node_vals[:n]), np.int64, n))
    computed = producer >= 0  # constants have none
    pairs = np.unique(where[producer[computed]] * (m + 1) + where[reader[computed]])
    out: list = [[] for _ in range(m + 1)]
    for p, r in zip((pairs // (m + 1)).tolist(), (pairs % (m + 1)).tolist()):
        if p != r:
            out[p].append(r)
    return out[:m]
