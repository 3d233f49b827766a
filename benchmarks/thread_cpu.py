"""Which threads of the process spend the CPU time of a dynax update, and at what nice value.

Trains a task's dynax model (``agenda``) to steady state, then runs ``--updates`` updates and
prints each thread's CPU time per update (Linux's ``/proc/self/task``, 10 ms ticks, so read
it over 50 updates or more). On XLA:CPU three kinds show up: the Python thread (building,
scheduling, dispatching), XLA's intra-op pool (``tf_XLAEigen``, the threads
``dx.set_xla_thread_nice`` lowers) and unnamed threads of XLA's client that run each
kernel's thunks and take their share of its parallel work (session 48: the tagger's 2.9 +
2.8 ms per update, the Tree-LSTM's 5.9 + 5.6, at the Python thread's priority)::

    .venv/bin/python -m benchmarks.thread_cpu --task tagger [--updates 100] [--cpu-threads 1]
"""
from __future__ import annotations

import argparse
import os
import time

import dynax as dx

from . import harness


def thread_times() -> dict:
    """``{thread id: (name, nice, CPU seconds so far)}`` of this process's threads; empty
    where ``/proc`` is not there. A thread that ends while it is read is left out."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                # fields after the name (which may hold spaces): state is field 3, utime 14,
                # stime 15, nice 19 of proc(5)
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (name, int(fields[16]), (int(fields[11]) + int(fields[12])) / tick)
    return out


def per_update(before: dict, after: dict, updates: int) -> list:
    """``(name, nice, thread id, CPU ms per update)`` of each thread that ran between the
    two ``thread_times`` snapshots, busiest first; a thread started in between counts
    from zero."""
    rows = []
    for tid, (name, nice, cpu) in after.items():
        spent = cpu - before.get(tid, (name, nice, 0.0))[2]
        if spent > 0:
            rows.append((name, nice, tid, 1e3 * spent / updates))
    return sorted(rows, key=lambda r: -r[3])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updates", type=int, default=100, help="updates measured")
    args, task, system, batches = harness.steady_agenda(ap, argv)
    with dx.settled_heap():
        before, t0 = thread_times(), time.perf_counter()
        for i in range(args.updates):
            system.update(batches[i % len(batches)])
        harness.wait_for_device(system)
        wall, after = time.perf_counter() - t0, thread_times()
    rows = per_update(before, after, args.updates)
    main_tid = os.getpid()  # on Linux the main thread's id is the process id
    print(f"{args.task}, {args.updates} updates: {1e3 * wall / args.updates:.2f} ms per "
          f"update (wall), {sum(r[3] for r in rows):.2f} ms of CPU, per thread:")
    for name, nice, tid, ms in rows:
        who = "Python (main)" if tid == main_tid else name
        print(f"  {who:16s} nice {nice:3d}  tid {tid:7d}  {ms:7.2f} ms")


if __name__ == "__main__":
    main()
