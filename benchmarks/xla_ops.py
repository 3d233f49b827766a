"""Where the device time of a dynax update goes, per XLA kernel and per operation inside it.

Trains a task's dynax model (``agenda``) to steady state, then records ``--updates`` updates
with JAX's profiler at host tracer level 3, at which XLA:CPU reports every thunk it runs
(the fused loops, YNNPACK's products, gathers, scatters, while loops) with its kernel
(``hlo_module``) and operation (``hlo_op``). Prints per update, summed over XLA's threads:

* each kernel family's time (a kernel's batch and run sizes dropped from its name:
  ``jit_bidirectional_lstm_cell_bwd`` covers every ``_bwd_B<lanes>_T<steps>`` variant);
* the self time of each (kernel family, operation kind), an operation's number dropped
  (``ynn_fusion.6`` -> ``ynn_fusion``), with its calls per update;
* how long 0, 1, 2, ... of XLA's threads ran a kernel's thunk at once (``busy_threads``):
  XLA:CPU runs one device's programs one after another, so a pass whose kernels depend on
  each other keeps one thread busy at a time (session 66).

Tracing costs each thunk some microseconds, so small operations that run often read high
(the tagger's 273 weight-gradient adds per update: 3.4 ms traced, while removing them left
the wall time unchanged, session 45): read it for where to look, and decide by an A/B of
the wall time (``benchmarks.run``, or alternated blocks of updates in one process)::

    .venv/bin/python -m benchmarks.xla_ops --task tagger [--cpu-threads 1]
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax

from . import harness


def _events(trace_dir: str) -> list:
    """The complete events of XLA:CPU's thunks in the Perfetto trace under ``trace_dir``."""
    path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and "hlo_module" in (e.get("args") or {})]


def traced_events(run) -> list:
    """``run()`` under JAX's profiler at host tracer level 3 (no Python tracing): the
    events of the XLA:CPU thunks it ran."""
    options = jax.profiler.ProfileOptions()
    options.host_tracer_level, options.python_tracer_level = 3, 0
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True, profiler_options=options):
            run()
        return _events(d)


def _family(module: str) -> str:
    return re.sub(r"_B\d+|_T\d+", "", module)


def self_times(events: list) -> tuple[collections.Counter, collections.Counter,
                                      collections.Counter]:
    """(time per kernel family, self time and calls per (family, operation kind)), in us.

    Thunks nest (a while loop's body runs inside its thunk) on one thread: an event's self
    time is its duration less its direct children's."""
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e["tid"])].append(e)
    family, own, calls = collections.Counter(), collections.Counter(), collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ = []  # the enclosing events of the current one
        for e in evs:
            e["self"] = e["dur"]
            while open_ and open_[-1]["ts"] + open_[-1]["dur"] <= e["ts"]:
                open_.pop()
            if open_:
                open_[-1]["self"] -= e["dur"]
            else:
                family[_family(e["args"]["hlo_module"])] += e["dur"]
            open_.append(e)
        for e in evs:
            key = (_family(e["args"]["hlo_module"]), re.sub(r"\.\d+$", "", e["args"]["hlo_op"]))
            own[key] += e["self"]
            calls[key] += 1
    return family, own, calls


def busy_threads(events: list) -> tuple[collections.Counter, float]:
    """``({k: us during which exactly k threads ran a thunk}, traced span in us)``.

    A thread counts as busy while one of its outermost thunks runs (nested ones, a while
    loop's body, run inside it). The helpers' shares of a product XLA splits across
    threads are not traced (session 48), so this reads how far the kernels themselves run
    side by side: session 66 found one thread busy for 85% of a tagger update."""
    edges = []
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e["tid"])].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        end = None
        for e in evs:
            if end is None or e["ts"] >= end:  # outermost: not inside the last one
                end = e["ts"] + e["dur"]
                edges += [(e["ts"], 1), (end, -1)]
    edges.sort()
    busy, running = collections.Counter(), 0
    for (t0, step), (t1, _) in zip(edges, edges[1:]):
        running += step
        busy[running] += t1 - t0
    return busy, (edges[-1][0] - edges[0][0]) if edges else 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updates", type=int, default=8, help="updates recorded")
    ap.add_argument("--top", type=int, default=30, help="operation rows printed")
    args, task, system, batches = harness.steady_agenda(ap, argv)
    n = args.updates

    def run(updates):
        for b in updates:
            system.update(b)
        harness.wait_for_device(system)

    events = traced_events(lambda: run(batches[:n]))
    family, own, calls = self_times(events)
    print(f"{task.NAME}, {n} updates traced: ms per update, summed over XLA's threads")
    print("kernel families:")
    for name, us in family.most_common():
        print(f"  {us / 1000 / n:8.2f}  {name}")
    print("self time per (kernel family, operation):")
    for (name, op), us in own.most_common(args.top):
        print(f"  {us / 1000 / n:8.2f}  {calls[name, op] / n:7.1f}/update  {name}  {op}")
    busy, span = busy_threads(events)
    print("XLA threads running a thunk at once (ms per update, share of the traced span):")
    for k in sorted(busy):
        print(f"  {k}: {busy[k] / 1000 / n:8.2f}  {100 * busy[k] / max(span, 1e-9):5.1f}%")


if __name__ == "__main__":
    main()
