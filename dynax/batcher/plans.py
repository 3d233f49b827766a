"""Plans of recurring graph shapes, reused instead of scheduled again.

A training loop over fixed-shape inputs (equal lengths, a bucketed corpus, one tree shape
for many inputs) builds the same graph every update, up to the integers it reads (token
ids, labels): same signatures, same edges. The plan depends on nothing else, so it is
looked up instead of recomputed: the agenda costs ~30 ms for the 13k nodes of a synthetic
BiLSTM update, the lookup ~3 ms.

The full key (every pending node's signature, argument values, first output and depth)
costs ~0.25 us per node to build, hash and compare, so it is built only for a graph whose
cheap key (strategy, node range, value count) was met before: a workload whose graphs never
recur (variable lengths) pays one small tuple per forward.

Where full keys keep missing, the cache backs off: after ``size`` misses in a row it skips
the full key for the next 1, 2, 4, ... (at most ``MAX_SKIP``) forwards whose cheap key was
met, and a hit halves the next back-off. Graphs of one node count are common without being equal
(64 trees of as many leaves in all), and so is a loop over more distinct graphs than the
cache holds (a benchmark replaying 20 batches): there every full key missed, at ~5 ms of a
Tree-LSTM update's ~30 ms of host time after the build.
"""
from __future__ import annotations

from collections import OrderedDict

from .strategies import stream

MAX_SKIP = 64  # the longest back-off, in forwards: a workload turning recurrent waits so long


class Entry:
    """A cached plan: its full key, its batches, and what the executor keeps with it
    (``replay``: its prepared batches, see ``executor/replay.py``)."""

    __slots__ = ("key", "plan", "replay")

    def __init__(self, key, plan):
        self.key, self.plan, self.replay = key, plan, None


class PlanCache:
    """The last ``size`` plans, keyed by graph shape; plans are shared, so read-only."""

    def __init__(self, size: int = 8):
        self.size = size
        self.plans: OrderedDict = OrderedDict()  # hash of full key -> Entry
        self.hit: Entry | None = None  # the entry the last ``stream`` reused, or None
        self.seen: OrderedDict = OrderedDict()  # cheap keys met recently
        self.hits = 0
        self.lookups = 0  # full keys built and looked up
        self.misses = 0  # full-key misses since the last hit or back-off
        self.skip = 0  # length of the last back-off (halved by a hit)
        self.skip_left = 0  # forwards left in the current back-off

    def clear(self):
        self.plans.clear()
        self.seen.clear()
        self.misses = self.skip = self.skip_left = 0

    def stream(self, strategy: str, graph, lo: int, hi: int):
        """The plan of ``strategies.stream(strategy, graph, lo, hi)``, from the cache if the
        same graph shape was scheduled recently: a list, or an iterator that yields batches
        as they are chosen (the plan is stored once that has been read to the end)."""
        self.hit = None
        if strategy == "none":
            return stream(strategy, graph, lo, hi)
        cheap = (strategy, lo, hi, len(graph.val_node))
        if cheap not in self.seen:
            _remember(self.seen, cheap, True, 4 * self.size)
            return stream(strategy, graph, lo, hi)
        self.seen.move_to_end(cheap)
        if self.skip_left:  # backing off: the last full keys all missed
            self.skip_left -= 1
            return stream(strategy, graph, lo, hi)
        self.lookups += 1
        # node_vals and node_out fix the edges among pending nodes (which values a pending
        # node produces); node_depth covers the depths of earlier, computed producers
        key = (cheap, tuple(graph.node_sig[lo:hi]), tuple(graph.node_vals[lo:hi]),
               tuple(graph.node_out[lo:hi]), tuple(graph.node_depth[lo:hi]))
        # keyed by the hash: a tuple does not keep its hash, and hashing this one costs ~1 ms
        h = hash(key)
        got = self.plans.get(h)
        if got is not None and got.key == key:
            self.plans.move_to_end(h)
            self.hits += 1
            self.misses, self.skip = 0, self.skip // 2
            self.hit = got
            return got.plan
        self.misses += 1
        if self.misses >= self.size:
            self.misses = 0
            self.skip = self.skip_left = min(MAX_SKIP, 2 * self.skip or 1)
        batches = stream(strategy, graph, lo, hi)
        if isinstance(batches, list):
            _remember(self.plans, h, Entry(key, batches), self.size)
            return batches
        return self._recorded(h, key, batches)

    def _recorded(self, h, key, batches):
        """Yield ``batches`` and store them as the plan of ``key`` after the last."""
        plan = []
        for batch in batches:
            plan.append(batch)
            yield batch
        _remember(self.plans, h, Entry(key, plan), self.size)


def _remember(lru: OrderedDict, key, value, size: int):
    lru[key] = value
    if len(lru) > size:
        lru.popitem(last=False)
