"""Soak test: does memory stay flat over a long training run on data of varying size?

Trains a Tree-LSTM classifier (dx.nn.TreeLSTMBuilder, Adam, sparse embedding updates) for
``--steps`` updates; every update draws a batch of 8–64 trees of 5–40 leaves, so graph sizes,
batch widths and arena demands vary all the time. After each update it records

* resident memory of the process (``VmRSS`` from ``/proc/self/status``), and
* device-buffer bytes: the sum of ``nbytes`` over ``jax.live_arrays()`` (parameters,
  optimiser state, pooled arenas, anything leaked),

and fits a least-squares line to each over the steps after ``--warmup``. A leak shows up as
a positive slope; bounded memory as a slope near zero (RSS wobbles by allocator noise).
At the end it calls ``dx.release_memory()`` and reports what that gave back.

    .venv/bin/python -m benchmarks.soak [--steps 600] [--warmup 100] [--quick]
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np
import optax

import dynax as dx
from dynax.graph.computation_graph import _compile_count

from .data import N_CLASSES, random_trees

VOCAB, EMB, HID = 5000, 64, 64


def rss_bytes() -> int | None:
    """Current resident set size, or None where /proc is not available."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


class Model:
    def __init__(self, seed: int = 0):
        self.pc = pc = dx.ParameterCollection(seed=seed)
        self.E = pc.add_lookup_parameters((VOCAB, EMB), init="normal", name="E")
        self.tree = dx.nn.TreeLSTMBuilder(EMB, HID, pc)
        self.W = pc.add_parameters((N_CLASSES, HID), name="W")
        self.b = pc.add_parameters((N_CLASSES,), init="zeros", name="b")

    def loss(self, trees):
        losses = []
        for t in trees:
            def rec(i):
                if i < t.n_leaves:
                    return self.tree.leaf(self.E[t.words[i]])
                left, right = t.children[i - t.n_leaves]
                return self.tree.compose(rec(left), rec(right))

            h, _ = rec(t.root)
            losses.append(dx.pickneglogsoftmax(self.W @ h + self.b, t.label))
        return dx.esum(losses)


def slope(ys) -> float:
    """Least-squares slope per step."""
    ys = np.asarray(ys, np.float64)
    return float(np.polyfit(np.arange(len(ys)), ys, 1)[0]) if len(ys) > 1 else 0.0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--autobatch", default="agenda", choices=("none", "depth", "agenda"))
    ap.add_argument("--quick", action="store_true", help="120 steps, 40 warm-up")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 120, 40
    if args.warmup >= args.steps:
        ap.error("--warmup must be smaller than --steps")

    rng = np.random.default_rng(0)
    pool = random_trees(2000, seed=3, vocab=VOCAB)
    model = Model()
    trainer = dx.Trainer(model.pc, optax.adam(1e-3), sparse_updates=True)
    rss, dev, losses, compiles = [], [], [], []
    t0 = time.perf_counter()
    print(f"soak: {args.steps} updates of 8-64 trees ({args.autobatch}), "
          f"warm-up {args.warmup}", flush=True)
    for step in range(args.steps):
        size = int(rng.integers(8, 65))
        batch = [pool[i] for i in rng.integers(0, len(pool), size)]
        dx.renew_cg(autobatch=args.autobatch)
        loss = model.loss(batch)
        losses.append(loss.scalar_value() / size)
        loss.backward()
        trainer.update()
        del loss
        dx.renew_cg()  # drop this update's graph: what is still held now is what persists
        compiles.append(_compile_count())
        rss.append(rss_bytes() or 0)
        dev.append(device_bytes())
        if (step + 1) % max(1, args.steps // 10) == 0:
            print(f"  step {step + 1:5d}  loss/tree {np.mean(losses[-20:]):.3f}  "
                  f"rss {rss[-1] / 2**20:8.1f} MiB  device buffers {dev[-1] / 2**20:7.2f} MiB  "
                  f"compiles {compiles[-1]:4d}  {time.perf_counter() - t0:6.1f} s", flush=True)

    w = args.warmup
    result = {
        "steps": args.steps, "warmup": w,
        "rss_slope_kib_per_step": slope(rss[w:]) / 1024,
        "rss_growth_mib": (rss[-1] - rss[w]) / 2**20,
        "rss_slope_last_half_kib_per_step": slope(rss[(w + len(rss)) // 2:]) / 1024,
        "device_slope_kib_per_step": slope(dev[w:]) / 1024,
        "device_min_max_mib": (min(dev[w:]) / 2**20, max(dev[w:]) / 2**20),
        "compiles_after_warmup": compiles[-1] - compiles[w],
        # RSS change summed over the updates that compiled nothing: growth not due to code
        "rss_growth_without_compiles_mib": sum(
            rss[i] - rss[i - 1] for i in range(w + 1, len(rss))
            if compiles[i] == compiles[i - 1]) / 2**20,
    }
    dx.renew_cg()
    before = device_bytes()
    dx.release_memory()
    result["released_mib"] = (before - device_bytes()) / 2**20
    print(f"after warm-up ({args.steps - w} updates): RSS slope "
          f"{result['rss_slope_kib_per_step']:+.2f} KiB/update "
          f"(net {result['rss_growth_mib']:+.1f} MiB; last half "
          f"{result['rss_slope_last_half_kib_per_step']:+.2f} KiB/update); device-buffer slope "
          f"{result['device_slope_kib_per_step']:+.3f} KiB/update "
          f"(range {result['device_min_max_mib'][0]:.2f}-{result['device_min_max_mib'][1]:.2f} MiB)")
    print(f"XLA compilations after warm-up: {result['compiles_after_warmup']} (each new "
          "(signature, batch-size bucket) compiles once); RSS change summed over the updates "
          f"that compiled nothing: {result['rss_growth_without_compiles_mib']:+.1f} MiB")
    print(f"dx.release_memory() gave back {result['released_mib']:.2f} MiB of pooled arenas")
    return result


if __name__ == "__main__":
    main()
