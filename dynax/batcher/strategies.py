"""Scheduling strategies: which pending nodes run together, in which order.

Each strategy maps the pending node range ``[lo, hi)`` of a graph to a *plan*: a list of
batches, each a list of node ids sharing one signature and independent of each other.

* ``none``   one node per batch, in construction (topological) order — the reference.
* ``depth``  nodes of equal depth and signature together (TensorFlow Fold's rule).
* ``agenda`` the on-the-fly agenda of Neubig et al. (2017): among the ready nodes, run all
  of the signature whose nodes have the lowest average depth; cheap ops before heavy ones
  on ties. It lets e.g. the losses of sequences of different lengths run as one batch.

All are O(nodes + edges). Large graphs with large batches are scheduled on NumPy arrays (a
few array operations per batch instead of Python steps per node and edge: the agenda of a
6k-node tagger update costs ~7-9 ms in Python loops, ~5 ms on arrays); the others in plain
Python loops, as NumPy's ~30 us per batch would dominate. Both give the same plan, batches
in node order (tests/test_schedule_arrays.py). The agenda's plan is also available as a
stream (``stream``): batches yielded as they are chosen, for the executor to launch them
while it picks the rest.
"""
from __future__ import annotations

import heapq
from itertools import chain
from operator import attrgetter

import numpy as np

# Measured on the benchmark tasks: by depth, arrays win from ~4k nodes; the agenda's
# arrays win from ~1k nodes wherever its batches average ~50 nodes or more (the setup's
# estimate, which turns graphs of small batches away at 3-14% of a Python plan's cost)
ARRAYS_MIN_NODES = 4096  # pending nodes, at the least, to schedule by depth on arrays
AGENDA_ARRAYS_MIN_NODES = 1024  # the same for the agenda
ARRAYS_MIN_BATCH = 48  # agenda: nodes per batch, at the least (estimated, then checked)

_sid = attrgetter("sid")


def schedule(strategy: str, graph, lo: int, hi: int) -> list[list[int]]:
    """The plan for nodes ``lo..hi-1`` of ``graph`` under ``strategy``."""
    return list(stream(strategy, graph, lo, hi))


def stream(strategy: str, graph, lo: int, hi: int):
    """``schedule``'s plan, as a list where it is made all at once (depth, none, one batch),
    else as an iterator: the agenda yields each batch as soon as it is chosen, so the
    executor can launch the first batches while the agenda picks the rest."""
    if strategy != "none" and hi - lo > 1 and _one_batch(strategy, graph, lo, hi):
        return [list(range(lo, hi))]
    if strategy == "agenda":
        return _agenda(graph, lo, hi)
    if strategy == "depth":
        return by_depth(graph, lo, hi)
    if strategy == "none":
        return [[n] for n in range(lo, hi)]
    raise ValueError(f"unknown autobatch strategy {strategy!r}")


def _one_batch(strategy: str, graph, lo: int, hi: int) -> bool:
    """Whether the strategy's plan is one batch of all pending nodes, told by C-level scans
    instead of a schedule (~5 vs ~80 us): the common step of a model that computes step by
    step (a parser's scores across its parsers). For the agenda: one signature and no
    pending node reading another's output (all its inputs are older than the first pending
    output); for depth, also one depth."""
    sigs = graph.node_sig[lo:hi]
    if sigs.count(sigs[0]) != hi - lo:
        return False
    if strategy == "depth":  # one depth also means no pending node reads another's output
        depths = graph.node_depth[lo:hi]
        return depths.count(depths[0]) == hi - lo
    return max(chain.from_iterable(graph.node_vals[lo:hi]), default=-1) < graph.node_out[lo]


def by_depth(graph, lo: int, hi: int) -> list[list[int]]:
    if hi - lo >= max(1, ARRAYS_MIN_NODES):
        return _by_depth_arrays(graph, lo, hi)
    sigs, depths = graph.node_sig, graph.node_depth
    groups: dict = {}
    for n in range(lo, hi):
        key = (depths[n], sigs[n].op.cost, sigs[n].sid)
        g = groups.get(key)
        if g is None:
            groups[key] = [n]
        else:
            g.append(n)
    return [groups[k] for k in sorted(groups)]


def by_agenda(graph, lo: int, hi: int) -> list[list[int]]:
    return list(_agenda(graph, lo, hi))


def _agenda(graph, lo: int, hi: int):
    """The agenda's batches, one at a time: on arrays for large graphs with large batches,
    else (or from the point where batches turn out small) in Python loops."""
    if hi - lo >= max(1, AGENDA_ARRAYS_MIN_NODES):
        state = _agenda_arrays_setup(graph, lo, hi)
        if state is not None:
            return _agenda_arrays(graph, lo, state)
    return _agenda_python(graph, lo, hi)


def _agenda_python(graph, lo: int, hi: int):
    sigs, vals, depths, val_node = graph.node_sig, graph.node_vals, graph.node_depth, graph.val_node
    m = hi - lo
    indeg = [0] * m
    succ: list = [None] * m
    depth_sum: dict = {}
    count: dict = {}
    for n in range(lo, hi):
        s = sigs[n]
        depth_sum[s] = depth_sum.get(s, 0) + depths[n]
        count[s] = count.get(s, 0) + 1
        k = 0
        for v in vals[n]:
            p = val_node[v]
            if p >= lo:  # a pending producer (constants have -1, computed nodes < lo)
                k += 1
                j = p - lo
                if succ[j] is None:
                    succ[j] = [n]
                else:
                    succ[j].append(n)
        indeg[n - lo] = k

    # lowest average depth first; cheap before heavy on ties; then signature id
    priority = {s: (depth_sum[s] / c, s.op.cost, s.sid) for s, c in count.items()}

    ready: dict = {}
    heap: list = []
    for n in range(lo, hi):
        if indeg[n - lo] == 0:
            s = sigs[n]
            r = ready.get(s)
            if r is None:
                ready[s] = [n]
                heapq.heappush(heap, priority[s])
            else:
                r.append(n)
    return _agenda_loop(sigs, lo, indeg, succ, priority, ready, heap)


def _agenda_loop(sigs, lo, indeg, succ, priority, ready, heap):
    """The agenda's main loop in Python: ``ready`` maps a signature to its ready nodes,
    ``heap`` holds the priorities of signatures with ready nodes, ``indeg`` and ``succ``
    are indexed by node - ``lo``."""
    by_sid = {p[2]: s for s, p in priority.items()}
    while heap:
        s = by_sid[heapq.heappop(heap)[2]]
        batch = ready.pop(s, None)
        if not batch:
            continue
        batch.sort()  # node order, as on arrays (nodes joining later may have lower ids)
        yield batch
        for n in batch:
            nexts = succ[n - lo]
            if nexts is None:
                continue
            for c in nexts:
                j = c - lo
                indeg[j] -= 1
                if indeg[j] == 0:
                    cs = sigs[c]
                    r = ready.get(cs)
                    if r is None:
                        ready[cs] = [c]
                        heapq.heappush(heap, priority[cs])
                    else:
                        r.append(c)


# ---- the same plans on arrays (large graphs) ---------------------------------------------------

def _signatures(graph, lo: int, hi: int):
    """Per pending node, the index of its signature and its depth; the signatures, in sid
    order."""
    sigs = graph.node_sig[lo:hi]
    sids = np.fromiter(map(_sid, sigs), np.int64, hi - lo)
    _, first, k = np.unique(sids, return_index=True, return_inverse=True)
    depth = np.array(graph.node_depth[lo:hi], np.int64)
    return k.reshape(-1), depth, [sigs[i] for i in first.tolist()]


def _run_bounds(keys) -> list[int]:
    """Where the runs of equal values of a sorted array start, and its length."""
    return [0] + (np.flatnonzero(keys[1:] != keys[:-1]) + 1).tolist() + [len(keys)]


def _by_depth_arrays(graph, lo: int, hi: int) -> list[list[int]]:
    k, depth, sigs = _signatures(graph, lo, hi)
    # rank of each signature by (cost, sid): the tie order of by_depth's (depth, cost, sid)
    rank = np.empty(len(sigs), np.int64)
    rank[sorted(range(len(sigs)), key=lambda i: (sigs[i].op.cost, sigs[i].sid))] = \
        np.arange(len(sigs))
    key = depth * len(sigs) + rank[k]
    order = np.argsort(key, kind="stable")
    cuts = _run_bounds(key[order])
    nodes = (order + lo).tolist()
    return [nodes[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def edges(graph, lo: int, hi: int, n_in):
    """The value edges into nodes ``lo..hi-1``, one per value argument (``n_in`` of each
    node): the producing node of each (-1 for a constant) and the index of its reader
    from ``lo``."""
    prod = np.fromiter(map(graph.val_node.__getitem__,
                           chain.from_iterable(graph.node_vals[lo:hi])),
                       np.int64, int(n_in.sum()))
    return prod, np.repeat(np.arange(hi - lo), n_in)


def _agenda_arrays_setup(graph, lo: int, hi: int):
    """Signatures, priorities and edges (successors in CSR form) of the pending nodes, or
    None where the batches would be small: estimated as a batch per signature, and one per
    depth along the longest chain."""
    m = hi - lo
    k, depth, sigs = _signatures(graph, lo, hi)
    if m < ARRAYS_MIN_BATCH * max(len(sigs), int(depth.max() - depth.min()) + 1):
        return None
    # edges among pending nodes: producer -> consumer, successors of each node in CSR form
    prod, cons = edges(graph, lo, hi, np.array([len(s.in_akeys) for s in sigs], np.int64)[k])
    prod -= lo
    pending = prod >= 0  # constants have producer -1, computed nodes are below lo
    prod, cons = prod[pending], cons[pending]
    indeg = np.bincount(cons, minlength=m)
    succ = cons[np.argsort(prod, kind="stable")]
    first_succ = np.zeros(m + 1, np.int64)
    np.cumsum(np.bincount(prod, minlength=m), out=first_succ[1:])
    avg = (np.bincount(k, weights=depth.astype(np.float64)) / np.bincount(k)).tolist()
    return k, sigs, avg, indeg, succ, first_succ


def _agenda_arrays(graph, lo: int, state):
    """The agenda's batches from ``_agenda_arrays_setup``'s state, each yielded as soon as
    it is chosen; once batches turn out small (more than one per ARRAYS_MIN_BATCH nodes on
    average), the rest comes from the Python loop, which is faster there."""
    k, sigs, avg, indeg, succ, first_succ = state
    m = len(k)
    priority = [(a, s.op.cost, s.sid, i) for i, (a, s) in enumerate(zip(avg, sigs))]
    ready: dict = {}  # signature index -> arrays of ready nodes (each sorted)
    heap: list = []

    def add(nodes):
        ks = k[nodes]
        if (ks == ks[0]).all():
            groups = ((int(ks[0]), nodes),)
        else:
            order = np.argsort(ks, kind="stable")
            ks, nodes = ks[order], nodes[order]
            cuts = _run_bounds(ks)
            groups = [(int(ks[a]), nodes[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
        for i, part in groups:
            r = ready.get(i)
            if r is None:
                ready[i] = [part]
                heapq.heappush(heap, priority[i])
            else:
                r.append(part)

    add(np.flatnonzero(indeg == 0))
    done = 0
    most = m // max(1, ARRAYS_MIN_BATCH)  # batches beyond this: the Python loops do better
    while heap:
        top = heapq.heappop(heap)
        parts = ready.pop(top[3], None)
        if not parts:
            continue
        if done == most:
            ready[top[3]] = parts
            heapq.heappush(heap, top)
            yield from _agenda_loop(graph.node_sig, lo, *_python_state(
                lo, sigs, avg, indeg, succ, first_succ, ready, heap))
            return
        batch = parts[0] if len(parts) == 1 else np.sort(np.concatenate(parts))
        done += 1
        yield (batch + lo).tolist()
        # the successors of the batch: the CSR segments of its nodes, concatenated
        start = first_succ[batch]
        size = first_succ[batch + 1] - start
        end = size.cumsum()
        if end[-1] == 0:
            continue
        c = succ[np.arange(end[-1]) + np.repeat(start - end + size, size)]
        np.subtract.at(indeg, c, 1)
        now = c[indeg[c] == 0]  # newly ready, once per edge from the batch
        if now.size:
            now.sort()
            if now.size > 1:
                now = now[np.concatenate(([True], now[1:] != now[:-1]))]
            add(now)


def _python_state(lo, sigs, avg, indeg, succ, first_succ, ready, heap):
    """The array agenda's state in the Python loop's form (node ids absolute, signatures
    as keys): ``(indeg, succ, priority, ready, heap)``."""
    flat, bounds = (succ + lo).tolist(), first_succ.tolist()
    succ_lists = [flat[a:b] or None for a, b in zip(bounds[:-1], bounds[1:])]
    priority = {s: (a, s.op.cost, s.sid) for a, s in zip(avg, sigs)}
    ready_lists = {sigs[i]: (np.concatenate(parts) + lo).tolist() for i, parts in ready.items()}
    heap = [p[:3] for p in heap]
    heapq.heapify(heap)
    return indeg.tolist(), succ_lists, priority, ready_lists, heap
