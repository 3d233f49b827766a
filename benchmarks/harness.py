"""Timing harness shared by the benchmarks: any task module, dynax strategies vs a hand baseline.

A task module (``benchmarks/tasks/<name>.py``) provides::

    NAME, UNIT, BATCH, LR            # name, what an item is, items per update, Adam's rate
    BATCH_SIZES                      # optional: run the task once per batch size
    make_batches(n_batches, seed, batch_size=BATCH) -> list   # deterministic data
    DynaxModel(seed)                 # .pc, .loss(batch) -> summed loss in the current graph
    HandModel(init) or None          # hand-batched JAX: .signatures, .update(batch) -> (loss, pack s)
                                     # .signature(batch) or None: lets the warm-up precompile

``run_dynax`` times one autobatching strategy, ``run_hand`` the baseline; both return a dict
of figures (``summarise``). The time split per update is the one of Figure 2 of DyNet's
autobatching paper (Neubig et al., 2017): graph ``build``, ``schedule`` (batching),
``forward``, ``backward`` (host time of dispatching the kernels), ``wait`` (blocked on the
device) and ``update`` (dispatching the optimizer step); they add up to the wall time.

Both systems run the loop a user writes, with JAX's asynchronous dispatch: each update reads
its loss, and nothing else waits for the device. The baseline's loss comes out of its fused
jitted step, so reading it waits for the whole step; dynax's is read after the forward pass,
so its backward pass and optimizer step run on the device while the next graph is built. The
timed pass starts with the device idle and ends when it has finished; ``wait`` is where the
host blocked.
"""
from __future__ import annotations

import contextlib
import csv
import gc
import importlib
import os
import statistics
import time

import jax
import numpy as np
import optax

import dynax as dx

PHASES = ("build", "schedule", "forward", "backward", "wait", "update")
SYSTEMS = ("none", "depth", "agenda", "hand")
RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")

# (warm-up, timed) updates per system; "none" is slow and steady, so it needs fewer
COUNTS = {"none": (2, 3), "depth": (5, 20), "agenda": (5, 20), "hand": (5, 20)}
QUICK_COUNTS = {"none": (1, 1), "depth": (3, 4), "agenda": (3, 4), "hand": (2, 4)}


MAX_PRECOMPILE_PASSES = 3

# ---- compile counting (for the hand-batched baseline; dynax reports its own) ---------------

_compiles = [0]


def _on_event(name, *args, **kwargs):
    if name == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


# ---- tasks ------------------------------------------------------------------------------------

def load_task(name: str):
    """The task module ``benchmarks.tasks.<name>``, or None (with a message) if it is missing."""
    modname = f"{__package__ or 'benchmarks'}.tasks.{name}"
    try:
        return importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name != modname:  # the task exists but something it imports does not
            raise
        print(f"[skip] task {name!r}: no module {modname}", flush=True)
        return None


def batch_sizes(task) -> tuple:
    """The batch sizes to run a task at: its ``BATCH_SIZES``, else ``(BATCH,)``."""
    return tuple(getattr(task, "BATCH_SIZES", None) or (task.BATCH,))


def initial_values(task) -> dict:
    """``{name: array}`` of ``DynaxModel(seed=0)``: the baseline's starting point."""
    return {p.name: np.asarray(p.value) for p in task.DynaxModel(seed=0).pc.parameters()}


# ---- running and timing ---------------------------------------------------------------------

def _block_values(pc):
    jax.block_until_ready([p.value for p in pc.parameters()])


@contextlib.contextmanager
def settled_heap():
    """Collect, then exempt every surviving object from the cyclic garbage collector
    (``gc.freeze``) until the block ends, as long-running Python services do after start-up.

    Why: a full collection walks every tracked object, and a process with JAX loaded holds
    ~200k of them (compiled kernels, tracing caches), so each costs ~100 ms here; the
    graph a dynax update builds allocates enough objects to trigger one every 1-5 updates
    (measured on the tagger: 0.2 full collections of ~115 ms per update; BiLSTM synthetic:
    0.7). Frozen, those collections walk only the objects made since (1.5-15 ms). Applied to
    every system's timed updates alike; the heap is unfrozen afterwards.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_dynax(task, strategy: str, warm: list, timed: list, batch_size: int, *,
              sparse_updates: bool = True, tx=None, name: str | None = None) -> dict:
    """Warm-up then timed updates of ``task.DynaxModel`` under one autobatching strategy.

    ``tx`` is the Optax transform (default ``optax.adam(task.LR)``); ``sparse_updates`` is
    passed to ``dx.Trainer`` (lookup tables updated on the used rows only).
    """
    jax.clear_caches()  # fresh compilation, so the warm-up rate is a true "fresh" rate
    dx.release_memory()
    model = task.DynaxModel(seed=0)
    trainer = dx.Trainer(model.pc, tx if tx is not None else optax.adam(task.LR),
                         sparse_updates=sparse_updates)
    # Steady state means "shapes compiled": after the warm-up, untimed passes over the timed
    # batches compile their shapes (the hand-batched baseline's warm-up precompiles its jit
    # signatures of the timed batches in the same way), repeated until one compiles nothing
    # (at most MAX_PRECOMPILE_PASSES): when an arena grows during a pass, kernels compiled
    # earlier in that pass for its old capacity compile again on their next use. Then the
    # timed pass.
    # A natural training loop: each update reads its loss, nothing else waits, so the
    # backward pass and the optimizer step run on the device while the next graph is built.
    # The device is idle when the timed pass starts, and its end waits for the device.
    def update(batch, last=False):
        c0 = time.process_time()
        t0 = time.perf_counter()
        cg = dx.renew_cg(autobatch=strategy)
        loss = model.loss(batch)
        lv = loss.value()
        loss.backward()
        t1 = time.perf_counter()
        trainer.update()
        t2 = time.perf_counter()
        if last:
            _block_values(model.pc)
        t3 = time.perf_counter()
        cpu = time.process_time() - c0
        st = cg.stats()
        sec = st["seconds"]
        return {"total": t3 - t0, "cpu": cpu, **{k: sec[k] for k in PHASES[:4]},
                "wait": max(0.0, (t1 - t0) - sum(sec[k] for k in PHASES[:4])) + (t3 - t2),
                "update": t2 - t1, "loss": lv, "nodes": st["nodes"],
                "batches": st["batches"], "launches": st["launches"],
                "compiles": st["compiles"]}

    rows = [update(batch) for batch in warm]
    precompile = []  # compilations per untimed pass
    while len(precompile) < MAX_PRECOMPILE_PASSES and (not precompile or precompile[-1]):
        precompile.append(sum(update(batch)["compiles"] for batch in timed))
    _block_values(model.pc)
    with settled_heap():
        rows += [update(batch, last=i == len(timed) - 1) for i, batch in enumerate(timed)]
    out = summarise(name or f"dynax/{strategy}", rows, len(warm), batch_size)
    out["precompile_pass_compiles"] = sum(precompile)
    out["precompile_passes"] = len(precompile)
    return out


def run_hand(task, warm: list, timed: list, batch_size: int) -> dict:
    """The hand-batched baseline, from the same initial parameters as ``DynaxModel(seed=0)``.

    Its warm-up also compiles the timed batches' jit signatures not met in the warm-up
    batches: what a user precompiling the buckets of a fixed dataset would do (dynax gets the
    same: untimed passes over the timed batches, see ``run_dynax``). With
    ``HandModel.signature`` that is one extra update per new signature; without it, one extra
    pass over the timed batches. ``build`` is the host-side packing, ``forward`` dispatching
    the jitted step (forward, backward and Adam fused) and ``wait`` the step itself (reading
    its loss).
    """
    init = initial_values(task)
    jax.clear_caches()
    model = task.HandModel(init)
    if getattr(model, "signature", None) is not None:
        seen = {model.signature(b) for b in warm}
        extra = []
        for b in timed:
            s = model.signature(b)
            if s not in seen:
                seen.add(s)
                extra.append(b)
    else:
        extra = list(timed)
    rows = []
    with contextlib.ExitStack() as heap:  # settled for the timed updates
        for i, batch in enumerate(warm + extra + timed):
            if i == len(warm) + len(extra):
                heap.enter_context(settled_heap())
            n0, c0 = _compiles[0], time.process_time()
            t0 = time.perf_counter()
            loss, pack_s = model.update(batch)
            t1 = time.perf_counter()
            lv = float(loss)  # waits for the step
            t2 = time.perf_counter()
            rows.append({"total": t2 - t0, "cpu": time.process_time() - c0, "build": pack_s,
                         "schedule": 0.0, "forward": t1 - t0 - pack_s, "backward": 0.0,
                         "wait": t2 - t1, "update": 0.0, "loss": lv, "nodes": 0, "batches": 0,
                         "launches": 0,
                         "compiles": _compiles[0] - n0})
    out = summarise("hand-batched JAX", rows, len(warm) + len(extra), batch_size)
    out["signatures"] = len(model.signatures)
    return out


def summarise(name: str, rows: list, n_warm: int, batch_size: int) -> dict:
    """Figures of one run: items/s (mean over the timed updates, rate of the median update,
    and "fresh" = the warm-up updates, compilation included), ms per update, the time split,
    batches and compilations per update, and the mean loss per item of the first update and
    the last."""
    warm, timed = rows[:n_warm], rows[n_warm:]

    def mean(key, rs=timed):
        return statistics.fmean(r[key] for r in rs)

    return {
        "system": name, "batch": batch_size, "warmup_updates": n_warm,
        "timed_updates": len(timed),
        "items_per_s": batch_size / mean("total"),
        "median_items_per_s": batch_size / statistics.median(r["total"] for r in timed),
        "fresh_items_per_s": batch_size / mean("total", warm) if warm else float("nan"),
        "ms_per_update": 1e3 * mean("total"), "cpu_ms_per_update": 1e3 * mean("cpu"),
        **{f"{k}_ms": 1e3 * mean(k) for k in PHASES},
        "batches_per_update": mean("batches"), "launches_per_update": mean("launches"),
        "nodes_per_update": mean("nodes"),
        "compiles_per_step": mean("compiles"),
        "timed_compiles": sum(r["compiles"] for r in timed),
        "warmup_compiles": sum(r["compiles"] for r in warm),
        "loss_first": rows[0]["loss"] / batch_size, "loss_last": timed[-1]["loss"] / batch_size,
    }


def add_ratios(results: dict) -> None:
    """Add ``x_none`` and ``x_hand`` (throughput ratio to those systems) to every result."""
    for ref in ("none", "hand"):
        base = results.get(ref)
        for r in results.values():
            r[f"x_{ref}"] = (r["items_per_s"] / base["items_per_s"]) if base else float("nan")


# ---- printing -------------------------------------------------------------------------------

def print_result(r: dict, unit: str) -> None:
    """A few lines about one run, printed as soon as it finishes."""
    print(f"== {r['system']} (batch {r['batch']}): {r['timed_updates']} timed updates after "
          f"{r['warmup_updates']} warm-up")
    print(f"   {r['items_per_s']:8.1f} {unit}/s steady (mean; median update "
          f"{r['median_items_per_s']:.1f})   {r['fresh_items_per_s']:8.1f} {unit}/s fresh "
          f"(warm-up updates, {r['warmup_compiles']} compilations)")
    hand = not r["nodes_per_update"]
    split = (f"pack {r['build_ms']:.1f} + jitted step {r['forward_ms']:.1f}" if hand else
             " + ".join(f"{k} {r[k + '_ms']:.1f}" for k in PHASES))
    print(f"   {r['ms_per_update']:.1f} ms/update (process CPU {r['cpu_ms_per_update']:.1f} ms);"
          f" split: {split}")
    if hand:
        print(f"   {r.get('signatures', 0)} jit signatures; compiles per step after warm-up: "
              f"{r['compiles_per_step']:.2f}")
    else:
        print(f"   {r['nodes_per_update']:.0f} nodes, {r['batches_per_update']:.1f} batches "
              f"in {r['launches_per_update']:.1f} launches per update; compiles per step after "
              f"warm-up: {r['compiles_per_step']:.2f} "
              f"({r['timed_compiles']} in {r['timed_updates']} updates)")
    print(f"   mean loss per item: first update {r['loss_first']:.4f}, last {r['loss_last']:.4f}",
          flush=True)


def fmt(x, spec=".1f") -> str:
    """``x`` formatted, or '-' for None / NaN."""
    return "-" if x is None or (isinstance(x, float) and np.isnan(x)) else format(x, spec)


def print_table(results: dict, unit: str, title: str = "") -> None:
    """The per-task table: throughput, ratios to none and to the hand baseline, compilations
    and the time split per update (ms)."""
    if title:
        print(f"\n{title}")
    print(f"{'system':<18}{unit + '/s':>12}{'median':>9}{'fresh':>8}{'ms/upd':>9}"
          f"{'x none':>8}{'x hand':>8}{'batches':>8}{'comp/st':>8}  "
          + " ".join(f"{k:>8}" for k in PHASES))
    for r in results.values():
        b = fmt(r["batches_per_update"], ".0f") if r["nodes_per_update"] else "-"
        print(f"{r['system']:<18}{r['items_per_s']:>12.1f}{r['median_items_per_s']:>9.1f}"
              f"{r['fresh_items_per_s']:>8.1f}{r['ms_per_update']:>9.1f}"
              f"{fmt(r.get('x_none'), '.2f'):>8}{fmt(r.get('x_hand'), '.2f'):>8}{b:>8}"
              f"{r['compiles_per_step']:>8.2f}  "
              + " ".join(f"{r[k + '_ms']:>8.1f}" for k in PHASES), flush=True)


def write_csv(rows: list, path: str) -> None:
    """One row per result dict; floats to 4 significant digits."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    keys = list(rows[0].keys()) + sorted({k for r in rows for k in r} - set(rows[0]))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})
    print(f"wrote {path}")


def plot(by_batch: dict, unit: str, title: str, path: str) -> None:
    """A PNG: throughput per system (grouped by batch size) and, for the default batch size,
    the time split per update (as Figure 2 of the autobatching paper). Skipped with a message
    when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"[skip] plot {path}: matplotlib is not installed")
        return
    sizes = list(by_batch)
    systems = [s for s in SYSTEMS if any(s in by_batch[b] for b in sizes)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(1, len(sizes))
    for j, bs in enumerate(sizes):
        xs = [i + (j - (len(sizes) - 1) / 2) * width for i in range(len(systems))]
        ys = [by_batch[bs][s]["items_per_s"] if s in by_batch[bs] else 0.0 for s in systems]
        bars = ax1.bar(xs, ys, width, label=f"batch {bs}")
        for bar, s in zip(bars, systems):
            r = by_batch[bs].get(s)
            if r is not None:
                note = f"{r['items_per_s']:.0f}"
                if s != "none" and not np.isnan(r.get("x_none", float("nan"))):
                    note += f"\n{r['x_none']:.1f}x"
                ax1.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                             ha="center", va="bottom", fontsize=7)
    ax1.set_xticks(range(len(systems)))
    ax1.set_xticklabels(systems)
    ax1.set_ylabel(f"{unit}/s (steady state)")
    ax1.set_yscale("log")
    ax1.set_title(f"{title}: throughput")
    if len(sizes) > 1:
        ax1.legend(fontsize=8)
    # the split as shares of the update, like Figure 2 of the paper (totals vary 100x, so
    # absolute stacked bars would hide the fast systems)
    main = by_batch[sizes[-1]]
    names = [s for s in systems if s in main]
    left = np.zeros(len(names))
    for k in PHASES:
        vals = np.array([100.0 * main[s][k + "_ms"] / main[s]["ms_per_update"] for s in names])
        ax2.barh(names, vals, left=left, label=k)
        left += vals
    for i, s in enumerate(names):
        ax2.annotate(f"{main[s]['ms_per_update']:.0f} ms", (101, i), va="center", fontsize=7)
    ax2.set_xlim(0, 118)
    ax2.set_xlabel("% of the time per update")
    ax2.set_title(f"time split per update (batch {sizes[-1]})")
    ax2.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


# ---- one task, every system -----------------------------------------------------------------

def run_task(task, strategies=SYSTEMS, quick: bool = False, batch_size: int | None = None,
             seed: int = 1) -> dict:
    """Run ``strategies`` (of none, depth, agenda, hand) on one task at one batch size;
    returns ``{strategy: result}`` with ratios added.

    All systems start from the same parameters (seed 0) on the same warm-up batches, so
    their first losses agree, and time the same batches.
    """
    bs = batch_size or task.BATCH
    counts = QUICK_COUNTS if quick else COUNTS
    n_timed = max(t for w, t in counts.values())
    batches = task.make_batches(n_timed + max(w for w, t in counts.values()), seed, bs)
    results = {}
    for s in strategies:
        w, t = counts[s]
        warm, timed = batches[n_timed:n_timed + w], batches[:t]
        if s == "hand":
            if getattr(task, "HandModel", None) is None:
                print(f"[skip] {task.NAME}: no hand-batched baseline", flush=True)
                continue
            results[s] = run_hand(task, warm, timed, bs)
        else:
            results[s] = run_dynax(task, s, warm, timed, bs)
        results[s]["task"], results[s]["unit"] = task.NAME, task.UNIT
        print_result(results[s], task.UNIT)
    add_ratios(results)
    return results
