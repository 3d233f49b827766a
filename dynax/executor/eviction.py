"""Forgetting value shapes the process stopped meeting: their compiled kernels and arenas.

Kernels are compiled per value shape, and each new shape gets pooled arenas (a value arena
and a gradient arena of at least ``ARENA_START_BYTES``). A model whose value shapes follow
the data (attention over each sentence's own length, one score per word) meets a new shape
with every new length, and nothing was ever dropped: the process grew ~15 MB a length, and
XLA:CPU maps each fused loop of an executable into memory on its own (three maps a loop; a
``concatenate`` of 40 scores is ~56 loops), so an attention model run over lengths 1..150
reached Linux's limit of 65,530 memory maps near length 130 and died in LLVM (session 77).

So each kernel family (registry: the kernels of one op on one set of argument shapes) is
stamped with the pass that last looked one of its kernels up (``clock``, counting the
forward and backward passes of every thread), and after every ``CHECK_EVERY`` new kernels
the process checks what it holds, at the start of a pass while no other pass runs. Past
``MAX_KERNELS`` kernels, or past ``MAP_SHARE`` of the kernel's limit on memory maps (Linux:
``vm.max_map_count``), the least recently used families not used within ``KEEP_PASSES``
passes lose their kernels (to ``MAX_KERNELS / 2``, or half of what can go for the maps).
A dropped kernel is an ordinary Python object: with it go JAX's executable and its maps
(checked: 60 such kernels held 5,800 maps, 230 after). A family used again compiles again,
as it did the first time. Arenas of shapes none of their thread's last
``ARENA_IDLE_PASSES`` forward passes wrote are dropped when its next graph starts.

Workloads of fixed or bucketed shapes never come near: the examples hold 100-160 kernels
and ~530 maps at their end.
"""
from __future__ import annotations

import contextlib
import functools
import threading

from ..ops.registry import live_kernel_families

CHECK_EVERY = 32  # new kernels between two checks (a check: ~8 ms at 20,000 maps)
MAX_KERNELS = 2048  # compiled kernels the process keeps at most (the examples: 100-160)
MAP_SHARE = 0.5  # of the limit on memory maps, past which kernels are dropped
KEEP_PASSES = 16  # families used within this many passes keep their kernels
ARENA_IDLE_PASSES = 64  # a thread's arenas unused in its last this many forward passes go

clock = 0  # forward and backward passes started, in every thread
_new_kernels = 0  # kernels made since the last check
dropped = 0  # kernels dropped so far (tests, debugging)
_LOCK = threading.Lock()  # over the count of threads in a pass, and over each check
_threads_in_pass = 0
_local = threading.local()  # .depth: this thread's passes in flight (a read runs backward)


def new_kernel() -> None:
    """Count a kernel just made: every ``CHECK_EVERY``, the next pass checks."""
    global _new_kernels
    _new_kernels += 1


@contextlib.contextmanager
def pass_running():
    """Around a forward or backward pass: advances the clock. Kernels are dropped only
    here, at the start of a pass while no other thread is in one: a pass looks some
    kernels up twice (a run's step kernel on its own, then through the run kernel), and a
    family cleared between the two would give the batch a step kernel the run never ran,
    whose backward then fails (session 78's audit)."""
    global clock, _new_kernels, _threads_in_pass
    depth = getattr(_local, "depth", 0)
    with _LOCK:
        clock += 1
        if not depth:
            _threads_in_pass += 1
            if _new_kernels >= CHECK_EVERY and _threads_in_pass == 1:
                _new_kernels = 0
                drop_old_kernels()
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth
        if not depth:
            with _LOCK:
                _threads_in_pass -= 1


def held_kernels(families=None) -> int:
    """The compiled kernels the process holds, by key (an evaluation's alias of a training
    kernel counts again)."""
    if families is None:
        families = live_kernel_families()
    return sum(len(f.kernels) for f in families)


def drop_old_kernels() -> int:
    """Drop the kernels of the least recently used families if the process holds more than
    ``MAX_KERNELS`` kernels or more than ``MAP_SHARE`` of its limit on memory maps; the
    number dropped."""
    global dropped
    families = live_kernel_families()
    total = held_kernels(families)
    limit = map_limit()
    crowded = limit is not None and memory_maps() > MAP_SHARE * limit
    if total <= MAX_KERNELS and not crowded:
        return 0
    old = sorted((f for f in families if f.kernels and f.last_used < clock - KEEP_PASSES),
                 key=lambda f: f.last_used)
    target = MAX_KERNELS // 2 if total > MAX_KERNELS else total
    if crowded:  # how many maps a kernel holds varies widely: half of what can go
        target = min(target, total - held_kernels(old) // 2)
    n = 0
    for family in old:
        if total - n <= target:
            break
        n += len(family.kernels)
        family.kernels.clear()  # shared by the family's signatures: in place
    dropped += n
    return n


@functools.cache
def map_limit() -> int | None:
    """The kernel's limit on a process's memory maps (Linux), or None where it is not
    known: then the maps are not counted."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def memory_maps() -> int:
    """The process's memory maps now (Linux; 0 where they cannot be read)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0
