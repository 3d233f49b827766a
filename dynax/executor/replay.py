"""Prepared batches of a recurring graph shape, replayed instead of prepared again.

A plan reused from ``PlanCache`` (a training loop over fixed-shape inputs: equal lengths, a
bucketed corpus) is prepared the same way every time it runs on a graph in the same state:
``Engine._prepare`` hands out the same rows in the same order, so it finds the same
argument modes and writes the same packets, up to the per-instance ints (token ids, labels)
at their ends. Preparing costs ~2.5 us per node (a row per output, a row per argument,
lists appended; ~30 ms of the Python thread per synthetic BiLSTM update), so the first
reuse of a plan records what was prepared, and later ones replay it where the graph's state
matches the recorded one: the same rows handed out before, the same rows and gradient flags
of every value the plan reads or writes, ``train`` the same, no signature turned
values-only since. Only the ints are read again.

Not while forward passes run batches on their distinct lanes (``repeats.py``: the engine's
``dry_passes`` is 0): a replayed packet runs every lane, as recorded, and which lanes repeat
depends on the ints. There the plan is reused and prepared afresh: a Tree-LSTM cycling 8
batches (its ~1,440 leaves ~960 distinct words) took 45.2 and 45.8 ms per update against
49.7 and 48.8 replayed (medians, blocks alternated in one process, 10 rounds each).
"""
from __future__ import annotations

from operator import itemgetter
from typing import NamedTuple

import numpy as np


class Replay(NamedTuple):
    """What preparing a plan's batches did, for a graph in the state it describes."""

    train: bool
    first: int  # the first value no earlier forward pass of the graph saw
    rows_before: dict  # akey -> rows handed out before the batches (constants loaded)
    val_row_before: list  # rows of the values from ``first`` on, before (-1: to come)
    val_rg: list  # their gradient flags
    outside: list  # the values below ``first`` the plan reads (an incremental forward)
    outside_rows: list
    outside_rg: list
    val_row_after: list  # rows of the values from ``first`` on, after
    rows_after: dict
    steps: list  # per batch, ``Engine._prepare``'s tuple; without ints, the packet's array

    def matches(self, g, first: int) -> bool:
        """Whether ``g`` is in the recorded state (its constants loaded): then preparing
        the plan would do what was recorded."""
        if (g.train != self.train or first != self.first or g.rows != self.rows_before
                or g.val_row[first:] != self.val_row_before or g.val_rg[first:] != self.val_rg):
            return False
        if self.outside:
            row, rg = g.val_row.__getitem__, g.val_rg.__getitem__
            if (list(map(row, self.outside)) != self.outside_rows
                    or list(map(rg, self.outside)) != self.outside_rg):
                return False
        # a signature that failed to run with residuals prepares without them from then on
        return not any(step[0].values_only for step in self.steps)

    def replay(self, g):
        """Hand out the recorded rows now; an iterator over the recorded steps, in order,
        their ints read from ``g``'s nodes."""
        g.val_row[self.first:] = self.val_row_after
        g.rows = dict(self.rows_after)
        return self._steps(g.node_ints)

    def _steps(self, node_ints):
        for step in self.steps:
            sig, modes, B, gflags, packet, nodes, distinct = step
            if not sig.n_ints:
                yield step
                continue
            packet = list(packet)  # the rows; then the ints, B per int argument
            n = len(nodes)
            ints = list(map(node_ints.__getitem__, nodes))
            for k in range(sig.n_ints):  # a column per int argument (see Engine._modes)
                xs = list(map(itemgetter(k), ints))
                packet += xs
                packet += [xs[0]] * (B - n)
            yield sig, modes, B, gflags, packet, nodes, distinct


class Recording:
    """Collects a forward pass's prepared batches: made before the first (the graph's
    constants loaded), ``add``ed to per batch, ``finish``ed after the last."""

    def __init__(self, g, first: int):
        self.first = first
        self.rows_before = dict(g.rows)
        self.val_row_before = g.val_row[first:]
        self.val_rg = g.val_rg[first:]
        self.steps: list = []

    def add(self, step) -> None:
        self.steps.append(step)

    def finish(self, g) -> Replay:
        """The Replay of the recorded pass. Packets keep their rows only (ints are read at
        each replay); a packet without ints becomes its array, sent as it is."""
        first, steps = self.first, []
        outside = set()
        node_vals = g.node_vals
        for sig, modes, B, gflags, packet, nodes, distinct in self.steps:
            assert not distinct, "a recorded pass runs no batch on its distinct lanes only"
            if first:
                outside.update(v for nd in nodes for v in node_vals[nd] if v < first)
            packet = (packet[:len(packet) - sig.n_ints * B] if sig.n_ints
                      else np.asarray(packet, np.int32))
            steps.append((sig, modes, B, gflags, packet, nodes, distinct))
        outside = sorted(outside)
        return Replay(g.train, first, self.rows_before, self.val_row_before, self.val_rg,
                      outside, [g.val_row[v] for v in outside], [g.val_rg[v] for v in outside],
                      g.val_row[first:], dict(g.rows), steps)
