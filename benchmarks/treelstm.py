"""Tree-LSTM training throughput: dynax (none / depth / agenda) vs a hand-batched JAX baseline.

The model and the baseline live in ``benchmarks.tasks.treelstm`` (re-exported here for
existing imports); timing is ``benchmarks.harness``. This entry point runs that one task::

    .venv/bin/python -m benchmarks.treelstm [--quick] [--strategies agenda,depth,none,hand]

which is ``python -m benchmarks.run --task treelstm`` (results in
``benchmarks/results/treelstm.csv`` and ``.png``).
"""
from __future__ import annotations

import sys

# re-exported: benchmarks.overhead and older scripts import the model from here
from .tasks.treelstm import (BATCH, EMB, HID, LR, DynaxTreeLSTM, HandBatched,  # noqa: F401
                             _compose, _leaf, compose_cell, leaf_cell)


def main(argv=None) -> None:
    from . import run
    argv = list(sys.argv[1:] if argv is None else argv)
    run.main(["--task", "treelstm"] + argv)


if __name__ == "__main__":
    main()
