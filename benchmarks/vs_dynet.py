"""dynax's agenda against DyNet itself, side by side in one run: ``python -m benchmarks.vs_dynet
--dynet-python PYTHON [--task tagger,treelstm] [--quick] [--cpu-threads N]``.

The issue's DyNet figures (1,210 sentences/s, 1,100-1,240 trees/s) were measured elsewhere,
on a machine whose speed swings by a third within minutes here. This puts DyNet 2.x in the
same run instead: its models (``dynet_worker.py``) run in a child process under PYTHON, a
Python with DyNet installed (its own venv: DyNet needs neither JAX nor dynax), and the harness
interleaves its timed updates with dynax's block by block (``harness.run_systems``), on the
same minibatches, from the same initial parameters. DyNet runs on one thread, with its
agenda autobatching (``autobatch=1``). The first update's losses of the two must agree: a
check that both compute the same function. Tables and a CSV per task go to ``--out``.

DyNet 2.1.2 has no wheel for Python 3.11; ``benchmarks/build_dynet.sh`` builds it from its
source distribution against Debian's Eigen 3.4 headers. Figures: ``benchmarks/RESULTS.md``,
"DyNet itself, side by side".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile

import numpy as np

import dynax as dx

from . import harness

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dynet_worker.py")
LOSS_RTOL = 1e-4  # first-update losses of dynax and DyNet (float32 sums of ~1,400 terms)


def tagger_init(values: dict) -> dict:
    """The tagger's initial parameters under the names ``dynet_worker.Tagger`` reads."""
    out = {"E": values["E"]}
    for d in ("fwd", "bwd"):
        for w in ("Wx", "Wh", "b"):
            out[f"{d}_{w}"] = values[f"birnn/{d}0/lstm/{w}0"]
    out.update({k: values[k] for k in ("W1", "b1", "W2", "b2")})
    return out


def treelstm_init(values: dict) -> dict:
    """The Tree-LSTM's initial parameters, as ``dynet_worker.TreeLSTM`` reads them."""
    return {k: values[k] for k in ("E", "W_leaf", "b_leaf", "U", "b_comp", "W_out", "b_out")}


def encode_batch(task_name: str, batch) -> list:
    """A minibatch as JSON-able lists: ``[words, tags]`` per sentence, ``[words, children,
    label]`` per tree."""
    if task_name == "tagger":
        return [[list(s.words), list(s.tags)] for s in batch]
    return [[list(t.words), [list(c) for c in t.children], int(t.label)] for t in batch]


INITS = {"tagger": tagger_init, "treelstm": treelstm_init}
TASKS = tuple(INITS)  # the tasks with a DyNet model


class DyNetSystem:
    """A harness system (``start`` / ``update`` / ``settle`` / ``untimed_batches``) whose
    updates run in a DyNet child process; each update's row holds DyNet's own timing."""

    def __init__(self, task, python: str, autobatch: int = 1, lstm: str = "compact"):
        if task.NAME not in INITS:
            raise ValueError(f"vs_dynet: no DyNet model of task {task.NAME!r} "
                             f"(have: {', '.join(INITS)})")
        self.task, self.python, self.autobatch, self.lstm = task, python, autobatch, lstm
        self.name = f"DyNet (autobatch {autobatch})"
        self.proc = self.tmp = self.log = None
        self.sent: dict = {}  # id(batch) -> the id the worker knows it by

    def start(self):
        self.close()
        self.tmp = tempfile.TemporaryDirectory(prefix="vs_dynet_")
        init_path = os.path.join(self.tmp.name, "init.npz")
        np.savez(init_path, **INITS[self.task.NAME](harness.initial_values(self.task)))
        self.log = open(os.path.join(self.tmp.name, "stderr.txt"), "w+")
        try:
            self.proc = subprocess.Popen([self.python, WORKER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.log, text=True)
        except OSError as e:
            raise RuntimeError(f"vs_dynet: cannot run {self.python!r}: {e}") from None
        self.sent = {}
        got = self._ask({"task": self.task.NAME, "lr": self.task.LR, "init": init_path,
                         "autobatch": self.autobatch, "lstm": self.lstm})
        if "error" in got:
            raise RuntimeError(f"vs_dynet: {got['error']}")

    def _send(self, msg: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self._stopped()

    def _ask(self, msg: dict) -> dict:
        """Send one message and read the worker's reply."""
        self._send(msg)
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        self._stopped()

    def _stopped(self):
        self.log.seek(0)
        raise RuntimeError(f"vs_dynet: the DyNet worker ({self.python}) stopped; its "
                           f"stderr:\n{self.log.read()[-2000:]}")

    def untimed_batches(self, timed: list) -> list:
        return list(timed)  # nothing to compile; this warms DyNet's memory pools

    def update(self, batch) -> dict:
        key = id(batch)
        if key not in self.sent:
            self.sent[key] = len(self.sent)
            self._send({"op": "batch", "id": self.sent[key],
                        "data": encode_batch(self.task.NAME, batch)})
        row = self._ask({"op": "update", "id": self.sent[key]})
        return {"total": row["total"], "cpu": row["cpu"], "host_cpu": row["host_cpu"],
                "build": row["build"], "schedule": 0.0, "forward": row["forward"],
                "backward": row["backward"], "wait": 0.0, "update": row["update"],
                "loss": row["loss"], "nodes": 0, "batches": 0, "launches": 0, "compiles": 0}

    def settle(self):
        pass  # DyNet computes synchronously: each update has finished when it returns

    def extra(self) -> dict:
        return {}

    def close(self):
        if self.proc is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            self.proc.wait(timeout=30)
            self.proc = None
        if self.tmp is not None:
            self.log.close()
            self.tmp.cleanup()
            self.tmp = None


def compare(task, python: str, quick: bool = False, lstm: str = "compact") -> dict:
    """Run dynax (agenda) and DyNet side by side on one task; print and return the results."""
    agenda = (harness.QUICK_COUNTS if quick else harness.COUNTS)["agenda"]
    runs = harness.split_batches(task, {"agenda": agenda, "dynet": agenda}, task.BATCH)
    dynet = DyNetSystem(task, python, lstm=lstm)
    try:
        # lazy Adam on the lookup tables, as DyNet's
        agenda = harness.DynaxSystem(task, "agenda", sparse_updates=True)
        results = harness.run_systems({"agenda": agenda, "dynet": dynet}, runs, task.BATCH)
    finally:
        dynet.close()
    for r in results.values():
        r["task"], r["unit"] = task.NAME, task.UNIT
    harness.print_table(results, task.UNIT, f"{task.NAME}, batch {task.BATCH}: {task.UNIT}/s "
                        "in steady state (mean, median update); fresh = warm-up; ms per phase")
    a, d = results["agenda"], results["dynet"]
    ratio = a["items_per_s"] / d["items_per_s"]
    a["x_dynet"] = ratio
    gap = abs(a["loss_first"] - d["loss_first"]) / abs(d["loss_first"])
    a["first_loss_rel_diff"] = gap
    print(f"agenda / DyNet: {ratio:.2f}x ({a['items_per_s']:.0f} vs {d['items_per_s']:.0f} "
          f"{task.UNIT}/s; process CPU {a['cpu_ms_per_update']:.0f} vs "
          f"{d['cpu_ms_per_update']:.0f} ms per update, on the Python thread "
          f"{a['host_cpu_ms_per_update']:.0f} vs {d['host_cpu_ms_per_update']:.0f})")
    print(f"first update's mean loss: dynax {a['loss_first']:.6f}, DyNet {d['loss_first']:.6f} "
          f"(relative difference {gap:.1e}, {'agree' if gap <= LOSS_RTOL else 'DIFFER'}); "
          f"last: {a['loss_last']:.6f} vs {d['loss_last']:.6f}", flush=True)
    if gap > LOSS_RTOL:
        print("WARNING: the two models compute different losses, so their rates do not "
              "compare like with like", flush=True)
    return results


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dynet-python", required=True,
                    help="a Python interpreter that can 'import dynet'")
    ap.add_argument("--task", default=",".join(TASKS),
                    help=f"comma-separated, of {', '.join(TASKS)} (default: both)")
    ap.add_argument("--quick", action="store_true", help="a few updates only (a smoke run)")
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="XLA:CPU intra-op threads for dynax (default: one per core)")
    ap.add_argument("--dynet-lstm", choices=("compact", "vanilla"), default="compact",
                    help="DyNet's LSTM builder for the tagger: CompactVanillaLSTMBuilder "
                         "(fused nodes, the faster) or VanillaLSTMBuilder")
    ap.add_argument("--out", default=os.path.join(harness.RESULTS_DIR, "vs_dynet"),
                    help="directory for the CSVs")
    args = ap.parse_args(argv)
    tasks = [t.strip() for t in args.task.split(",") if t.strip()]
    for t in tasks:
        if t not in TASKS:
            ap.error(f"no DyNet model of task {t!r} (have: {', '.join(TASKS)})")
    if args.cpu_threads is not None:
        try:
            dx.set_cpu_threads(args.cpu_threads)
        except (ValueError, RuntimeError) as e:
            ap.error(str(e))
    print(f"dynax (agenda, {os.environ.get('PJRT_NPROC', 'default')} XLA threads) against "
          f"DyNet under {args.dynet_python}; {'quick' if args.quick else 'full'} run",
          flush=True)
    out = {}
    for name in tasks:
        task = harness.load_task(name)
        out[name] = compare(task, args.dynet_python, args.quick, args.dynet_lstm)
        harness.write_csv(list(out[name].values()), os.path.join(args.out, f"{name}.csv"))
    return out


if __name__ == "__main__":
    main()
