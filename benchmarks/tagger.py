"""BiLSTM tagger: sparse vs dense lookup-table updates, Adam and SGD, ``none`` vs ``agenda``.

The tagger task of ``benchmarks.tasks.tagger`` (vocabulary 20000, embedding 128: the table
is most of the parameters, and one update touches about 1,000 of its rows). Per optimizer
(``optax.adam(1e-3)``, ``optax.sgd(1e-3)``) and update mode (``dx.Trainer(...,
sparse_updates=True | False)``: the used rows only, or the whole table), each strategy is
timed as in ``benchmarks.run``, all of them interleaved in one run; one table shows
sentences/s, the agenda/none ratio and the sparse/dense ratio side by side. Sparse SGD is
exact; sparse Adam is the "lazy" variant.

Run from the repository root::

    .venv/bin/python -m benchmarks.tagger [--quick] [--strategies none,agenda]
"""
from __future__ import annotations

import argparse
import os

import jax
import optax

from . import harness
from .tasks import tagger as task

OPTIMIZERS = {"adam": lambda: optax.adam(task.LR), "sgd": lambda: optax.sgd(1e-3)}
MODES = {"sparse": True, "dense": False}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few updates only (a smoke run)")
    ap.add_argument("--strategies", default="none,agenda",
                    help="comma-separated subset of none,depth,agenda")
    ap.add_argument("--csv", default=os.path.join(harness.RESULTS_DIR, "tagger_sparse.csv"))
    args = ap.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for s in strategies:
        if s not in ("none", "depth", "agenda"):
            ap.error(f"unknown strategy {s!r}")
    counts = harness.QUICK_COUNTS if args.quick else harness.COUNTS
    split = harness.split_batches(task, {s: counts[s] for s in strategies}, task.BATCH)
    print(f"BiLSTM tagger, {task.BATCH} sentences/update, vocab {task.VOCAB} x emb {task.EMB}: "
          f"sparse vs dense lookup updates; jax {jax.__version__} on "
          f"{jax.devices()[0].platform}", flush=True)

    systems, runs = {}, {}  # keyed by (optimizer, mode, strategy)
    for opt, make_tx in OPTIMIZERS.items():
        for mode, sparse in MODES.items():
            for s in strategies:
                systems[opt, mode, s] = harness.DynaxSystem(
                    task, s, sparse_updates=sparse, tx=make_tx(), name=f"{opt}/{mode}/{s}")
                runs[opt, mode, s] = split[s]
    results = harness.run_systems(systems, runs, task.BATCH)  # timed side by side
    for (opt, mode, s), r in results.items():
        r.update(task=task.NAME, unit=task.UNIT, optimizer=opt, lookup_updates=mode,
                 strategy=s)
        harness.print_result(r, task.UNIT)

    print("\nsentences/s in steady state (mean over the timed updates); update = ms of "
          "trainer.update() per step")
    head = "".join(f"{s + ' s/s':>13}{s + ' upd':>11}" for s in strategies)
    extra = f"{'agenda/none':>13}" if {"none", "agenda"} <= set(strategies) else ""
    print(f"{'optimizer':<10}{'lookups':<9}{head}{extra}{'sparse/dense':>14}")
    for opt in OPTIMIZERS:
        for mode in MODES:
            res = {s: results[opt, mode, s] for s in strategies}
            cells = "".join(f"{r['items_per_s']:>13.1f}{r['update_ms']:>11.1f}"
                            for r in res.values())
            if extra:
                cells += f"{res['agenda']['items_per_s'] / res['none']['items_per_s']:>12.2f}x"
            ratio = ""
            if mode == "sparse":  # sparse over dense, per strategy
                ratio = " ".join(f"{s}:{r['items_per_s'] / results[opt, 'dense', s]['items_per_s']:.2f}x"
                                 for s, r in res.items())
            print(f"{opt:<10}{mode:<9}{cells}  {ratio}")
    harness.write_csv(list(results.values()), args.csv)
    return results


if __name__ == "__main__":
    main()
