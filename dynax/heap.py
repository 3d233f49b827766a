"""``settled_heap``: CPython's cyclic garbage collector set up for a training loop.

Every update builds a graph of tens of thousands of small Python objects (nodes' records,
Expressions, RNN states) that live until the next ``renew_cg`` and are then freed by
reference counting: they hold no cycles for the collector to find. Yet their allocation
triggers it: a generation-0 collection every 700 objects (2,000 from Python 3.13), a full
one every few updates. A full collection walks every tracked object, ~200k with JAX
loaded (~100 ms each on a 2-core VM). ``gc.freeze`` takes the objects alive at the start
out of its sight, and a higher first threshold makes the collections rare. Measured with
the heap frozen, on the benchmark tasks' updates (2-core VM), threshold 700 against
50,000: 7-45 collections per update against one every five, and the Python thread's time
per update 83.6 -> 75.4 ms (tagger), 59.3 -> 51.9 (Tree-LSTM), 255.0 -> 229.4 (synthetic
BiLSTM).
"""
from __future__ import annotations

import contextlib
import gc
import threading

TRAINING_THRESHOLD = 50_000  # objects allocated (net) between generation-0 collections

_open = 0  # blocks open now: the first to open sets the collector up, the last to close
_saved: tuple = ()  # restores it (any order, as threads may close them: the GC is global)
_lock = threading.Lock()  # the count and the collector's settings change together


@contextlib.contextmanager
def settled_heap(threshold: int = TRAINING_THRESHOLD):
    """Within the block, the cyclic garbage collector skips the objects alive at its start
    and runs a generation-0 collection every ``threshold`` allocations (CPython's default:
    700, and 2,000 from Python 3.13). It collects first; on leaving (also on an error) the
    objects are unfrozen and the thresholds restored. Meant for a training loop, once the
    model is built::

        with dx.settled_heap():
            for batch in batches:
                ...

    Cycles made inside are still collected, only less often. The collector is the
    process's: blocks open at once (nested, or in other threads) share the first one's
    settings, and the last one to close restores them.
    """
    global _open, _saved
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ValueError(f"settled_heap: threshold must be a positive int, got {threshold!r}")
    with _lock:
        if not _open:
            _saved = gc.get_threshold()
            gc.collect()
            gc.freeze()
            gc.set_threshold(threshold, *_saved[1:])
        _open += 1
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if not _open:
                gc.set_threshold(*_saved)
                gc.unfreeze()
