"""Compiling a pass's new kernels side by side, before the first of them is launched.

A kernel compiles on its first launch, on the launching thread, so a fresh graph's pass
compiled its tens of new kernels one after another while the other cores idled. XLA
releases the GIL while it compiles: the engine lowers each new kernel on the graph's thread
(tracing is Python) and hands the compilation to a pool of threads, one per core; each
launch then waits for its own kernel only, and finds the executable in JAX's cache (the
jitted function's ``lower(...).compile()`` fills the cache its calls read).

On 2 cores the gain is a few percent of a warm-up (XLA:CPU already keeps ~1.5 cores busy
compiling one kernel); it grows with the cores XLA leaves idle (see dynax/README.md).

Nothing here decides what runs: a lowering or compilation that fails is dropped, and the
launch, compiling again on its own thread, raises the error where it is reported.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

from ..graph.computation_graph import counted_here

_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max(1, os.cpu_count() or 1),
                                   thread_name_prefix="dynax-compile")
    return _POOL


def is_new(fn) -> bool:
    """Whether the jitted ``fn`` has never run since JAX's caches were last cleared (its
    fast-path cache is empty). False where JAX does not say: that kernel then compiles on
    its launch, as without this module."""
    size = getattr(fn, "_cache_size", None)
    return size is not None and size() == 0


class Ahead:
    """The compilations in flight of one pass, by jitted function."""

    def __init__(self):
        self.pending: dict = {}

    def submit(self, fn, args: tuple) -> None:
        """Lower ``fn`` for ``args`` (arrays, or shapes with their sharding) here and
        compile it in the pool, unless it is in flight already."""
        if fn in self.pending:
            return
        try:
            lowered = fn.lower(*args)
        except Exception:  # the launch traces again and reports it
            return
        self.pending[fn] = _pool().submit(counted_here(lowered.compile))

    def wait(self, fn) -> None:
        """Block until ``fn``'s compilation, if one is in flight, has finished."""
        future: Future | None = self.pending.pop(fn, None)
        if future is not None:
            future.exception()  # a failure is the launch's to raise, compiling again
