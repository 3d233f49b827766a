"""Redraw the PNGs of result CSVs without running anything (after changing the plot).

Run from the repository root::

    .venv/bin/python -m benchmarks.replot benchmarks/results/*.csv

Each ``T.csv`` written by ``benchmarks.run`` becomes ``T.png`` beside it; CSVs of other
layouts (``benchmarks.tagger``'s ``tagger_sparse.csv``) are skipped with a message.
"""
from __future__ import annotations

import argparse
import csv
import os

from . import harness

# the system names in the CSVs (as the harness names its systems), by the strategy keys
# the plot groups them under
_KEYS = {**{f"dynax/{s}": s for s in harness.SYSTEMS if s != "hand"},
         harness.HandSystem.name: "hand"}


def read_results(path: str) -> tuple[dict, str, str] | None:
    """``({batch size: {strategy: result}}, unit, task)`` of a CSV, or None where its rows
    are not ``benchmarks.run``'s."""
    by_batch: dict = {}
    unit = task = ""
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            key = _KEYS.get(row.get("system", ""))
            if key is None or not row.get("batch"):
                return None
            r = {}
            for k, v in row.items():
                try:
                    r[k] = float(v)
                except (TypeError, ValueError):
                    r[k] = v
            unit, task = row.get("unit", ""), row.get("task", "")
            by_batch.setdefault(int(r["batch"]), {})[key] = r
    return (by_batch, unit, task) if by_batch else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csvs", nargs="+", help="result CSVs of benchmarks.run")
    args = ap.parse_args(argv)
    for path in args.csvs:
        got = read_results(path)
        if got is None:
            print(f"[skip] {path}: not a benchmarks.run result table")
            continue
        by_batch, unit, task = got
        harness.plot(by_batch, unit, task or os.path.splitext(os.path.basename(path))[0],
                     os.path.splitext(path)[0] + ".png")


if __name__ == "__main__":
    main()
