"""Host CPU per update of a user's plain dynax training loop: the A/B measure for a busy machine.

On a shared 2-core VM wall-clock rates swing by up to 2x within minutes (session 36), so a
change to host-side code (graph building, scheduling, the executor's bookkeeping) is best
compared by the CPU time of the Python thread, which another process's load barely moves.
This script runs the loop of ``benchmarks.harness`` (``renew_cg``, the task's loss, its
value, ``backward``, a dense Adam ``update``) over ``--batches`` batches replayed, and prints
per update, as medians over the timed passes:

* ``build``: the Python thread's CPU building the graph;
* ``run``: the Python thread's CPU in the value, backward and update calls (scheduling and
  dispatching the kernels), each update started on an idle device;
* ``wall`` and ``python``: the mean wall time and the Python thread's CPU of the loop as a
  user runs it (the device overlapping the next build).

Compare two checkouts by running it in each, alternated, a few rounds (e.g. a ``git worktree``
of the older commit with this file copied in, run from its root with ``PYTHONPATH=.``)::

    .venv/bin/python -m benchmarks.host_cpu --task treelstm
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import optax

import dynax as dx

from .harness import load_task


def _settle(model):
    jax.block_until_ready([p.value for p in model.pc.parameters()])


def measure(task, n_batches: int, passes: int, model_kw=None, batch_kw=None) -> dict:
    """The figures above, in ms, for ``task`` over ``n_batches`` batches (``model_kw`` and
    ``batch_kw``: sizes other than the task's, for ``DynaxModel`` and ``make_batches``)."""
    model = task.DynaxModel(seed=0, **(model_kw or {}))
    trainer = dx.Trainer(model.pc, optax.adam(task.LR))
    batches = task.make_batches(n_batches, seed=1, **(batch_kw or {}))

    def update(batch):
        dx.renew_cg()
        loss = model.loss(batch)
        loss.value()
        loss.backward()
        trainer.update()

    for b in batches * 2:  # compiles every shape, and fills the caches
        update(b)
    _settle(model)
    with dx.settled_heap():  # as the harness's timed updates
        build, run = [], []
        for b in batches * passes:  # each phase on its own: the device idle at its start
            _settle(model)
            c0 = time.thread_time()
            dx.renew_cg()
            loss = model.loss(b)
            c1 = time.thread_time()
            _settle(model)
            c2 = time.thread_time()
            loss.value()
            loss.backward()
            trainer.update()
            build.append(c1 - c0)
            run.append(time.thread_time() - c2)
        _settle(model)
        t0, c0 = time.perf_counter(), time.thread_time()
        for b in batches * passes:  # the loop a user writes
            update(b)
        _settle(model)
        n = len(batches) * passes
        wall, python = (time.perf_counter() - t0) / n, (time.thread_time() - c0) / n
    return {"build": 1e3 * statistics.median(build), "run": 1e3 * statistics.median(run),
            "wall": 1e3 * wall, "python": 1e3 * python}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="treelstm", help="a task of benchmarks/tasks")
    ap.add_argument("--batches", type=int, default=20, help="distinct batches, replayed")
    ap.add_argument("--passes", type=int, default=3, help="timed passes over them")
    args = ap.parse_args(argv)
    task = load_task(args.task)
    if task is None:
        raise SystemExit(2)
    r = measure(task, args.batches, args.passes)
    print(f"{args.task}: per update, ms: build {r['build']:.1f} (thread CPU), run "
          f"{r['run']:.1f} (thread CPU); the plain loop: wall {r['wall']:.1f}, "
          f"Python thread {r['python']:.1f}", flush=True)


if __name__ == "__main__":
    main()
