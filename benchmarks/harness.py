"""Timing harness shared by the benchmarks: any task module, dynax strategies vs a hand baseline.

A task module (``benchmarks/tasks/<name>.py``) provides::

    NAME, UNIT, BATCH, LR            # name, what an item is, items per update, Adam's rate
    BATCH_SIZES                      # optional: run the task once per batch size
    make_batches(n_batches, seed, batch_size=BATCH) -> list   # deterministic data
    DynaxModel(seed)                 # .pc, .loss(batch) -> summed loss in the current graph
    HandModel(init) or None          # hand-batched JAX: .signatures, .update(batch) -> (loss, pack s)
                                     # .signature(batch): precompile one batch per signature

``DynaxSystem`` runs one autobatching strategy, ``HandSystem`` the baseline; ``run_systems``
times several side by side, their timed updates interleaved, and returns a dict of figures
per system (``summarise``). The time split per update is the one of Figure 2 of DyNet's
autobatching paper (Neubig et al., 2017): graph ``build``, ``schedule`` (batching),
``forward``, ``backward`` (host time of dispatching the kernels), ``wait`` (blocked on the
device) and ``update`` (dispatching the optimizer step, and the harness's own bookkeeping
after it, where the host can be held up while the device runs the backward pass); they add
up to the wall time of each whole update call.

Both systems run the loop a user writes, with JAX's asynchronous dispatch: each update reads
its loss, and nothing else waits for the device. The baseline's loss comes out of its fused
jitted step, so reading it waits for the whole step; dynax's is read after the forward pass,
so its backward pass and optimizer step run on the device while the next graph is built. Steady
state is timed as in a long loop: each block of timed updates follows an untimed lead-in update,
so the first timed update, like every other, starts while the device runs the backward pass of
the update before it; the clock stops when the last one returns, and the device finishes its
backward pass untimed (the lead-in's was timed: one backward pass per timed update). ``wait``
is where the host blocked.
"""
from __future__ import annotations

import csv
import importlib
import os
import statistics
import time

import jax
import numpy as np
import optax

import dynax as dx
from dynax.device import yield_xla_threads

PHASES = ("build", "schedule", "forward", "backward", "wait", "update")
SYSTEMS = ("none", "depth", "agenda", "hand")
RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")

# (warm-up, timed) updates per system; "none" is slow (an update costs ~10 of the others'),
# so it times 6; with 3 the tagger's agenda/none ratio, over 3 updates of each, spread
# 8.5-10.2x between runs (sessions 79-80)
COUNTS = {"none": (2, 6), "depth": (5, 20), "agenda": (5, 20), "hand": (5, 20)}
QUICK_COUNTS = {"none": (1, 1), "depth": (3, 4), "agenda": (3, 4), "hand": (2, 4)}


MAX_PRECOMPILE_PASSES = 3
ROUNDS = 4  # blocks each system's timed updates are cut into, the systems taking turns

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


def steady_agenda(ap, argv=None):
    """The setup of the profiling tools (``xla_ops``, ``thread_cpu``): ``ap`` gets
    ``--task`` and ``--cpu-threads`` and parses ``argv``; the task's dynax agenda system is
    started and run twice over 24 batches (every shape compiled, arenas grown) and left
    settled. Returns ``(args, task, system, batches)``."""
    ap.add_argument("--task", default="tagger")
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="XLA:CPU intra-op threads (dx.set_cpu_threads)")
    args = ap.parse_args(argv)
    if args.cpu_threads is not None:
        dx.set_cpu_threads(args.cpu_threads)
    task = load_task(args.task)
    if task is None:
        ap.error(f"unknown task {args.task!r}")
    batches = task.make_batches(24, seed=1)
    system = DynaxSystem(task, "agenda")
    system.start()
    for b in batches + batches:
        system.update(b)
    wait_for_device(system)
    return args, task, system, batches


def wait_for_device(system) -> None:
    """Block until the device has finished ``system``'s updates, leaving its parameters
    unread: ``value`` would mark them held, and the next update would copy every one."""
    jax.block_until_ready([p._value for p in system.model.pc.parameters()])


class DynaxSystem:
    """dynax training ``task.DynaxModel(seed=0)`` under one autobatching strategy.

    ``tx`` is the Optax transform (default ``optax.adam(task.LR)``); ``sparse_updates`` is
    passed to ``dx.Trainer`` (lookup tables updated on the used rows only: lazy Adam, as
    DyNet's, for ``vs_dynet``). The default is the hand baseline's dense update, so that the
    two train alike (lazy and dense Adam drift apart from the third update on).
    """

    def __init__(self, task, strategy: str, *, sparse_updates: bool = False, tx=None,
                 name: str | None = None):
        self.task, self.strategy, self.sparse_updates = task, strategy, sparse_updates
        self.tx = tx if tx is not None else optax.adam(task.LR)
        self.name = name or f"dynax/{strategy}"
        self.model = self.trainer = None

    def start(self):
        """A fresh start: compiled kernels and pooled arenas dropped, a new model."""
        jax.clear_caches()
        dx.release_memory()
        self.model = self.task.DynaxModel(seed=0)
        self.trainer = dx.Trainer(self.model.pc, self.tx, sparse_updates=self.sparse_updates)

    def untimed_batches(self, timed: list) -> list:
        """What an untimed pass runs to compile the timed batches' shapes: all of them (a
        graph's kernels depend on all its shapes and on the arenas' capacities)."""
        return list(timed)

    def update(self, batch) -> dict:
        """One update of the loop a user writes: each update reads its loss and nothing
        else waits, so the backward pass and the optimizer step run on the device while the
        next graph is built."""
        # The clock covers the whole call, its own bookkeeping included: after the update
        # is dispatched the host can be held up (XLA runs the backward pass on both cores),
        # and stopping the clock there left up to 8% of a user's loop uncounted.
        t0 = time.perf_counter()
        c0, h0 = time.process_time(), time.thread_time()
        cg = dx.renew_cg(autobatch=self.strategy)
        loss = self.model.loss(batch)
        lv = loss.value()
        loss.backward()
        t1 = time.perf_counter()
        self.trainer.update()
        cpu, host = time.process_time() - c0, time.thread_time() - h0
        st = cg.stats()
        sec = st["seconds"]
        t2 = time.perf_counter()
        return {"total": t2 - t0, "cpu": cpu, "host_cpu": host,
                **{k: sec[k] for k in PHASES[:4]},
                "wait": max(0.0, (t1 - t0) - sum(sec[k] for k in PHASES[:4])),
                "update": t2 - t1, "loss": lv, "nodes": st["nodes"],
                "batches": st["batches"], "launches": st["launches"],
                "compiles": st["compiles"]}

    def settle(self):
        """Wait until the device has finished this system's work."""
        _block_values(self.model.pc)

    def extra(self) -> dict:
        """Figures of this system beyond ``summarise``'s."""
        return {}


class HandSystem:
    """The hand-batched baseline ``task.HandModel``, from the parameters of
    ``DynaxModel(seed=0)``. ``build`` is its host-side packing, ``forward`` dispatching the
    jitted step (forward, backward and Adam fused) and ``wait`` the step itself (reading its
    loss waits for it)."""

    name = "hand-batched JAX"

    def __init__(self, task):
        self.task, self.model = task, None

    def start(self):
        init = initial_values(self.task)
        jax.clear_caches()
        self.model = self.task.HandModel(init)

    def untimed_batches(self, timed: list) -> list:
        """All the timed batches, as dynax's: one per jit signature would compile as much,
        but then the systems' models would have trained different numbers of updates when
        the timed ones start (their last losses, and the parser's work, would differ)."""
        return list(timed)

    def update(self, batch) -> dict:
        t0 = time.perf_counter()  # the whole call, as DynaxSystem.update
        n0, c0, h0 = _compiles[0], time.process_time(), time.thread_time()
        loss, pack_s = self.model.update(batch)
        t1 = time.perf_counter()
        lv = float(loss)  # waits for the step
        cpu, host = time.process_time() - c0, time.thread_time() - h0
        t2 = time.perf_counter()
        return {"total": t2 - t0, "cpu": cpu, "host_cpu": host, "build": pack_s,
                "schedule": 0.0, "forward": t1 - t0 - pack_s, "backward": 0.0,
                "wait": t2 - t1, "update": 0.0, "loss": lv, "nodes": 0, "batches": 0,
                "launches": 0, "compiles": _compiles[0] - n0}

    def settle(self):
        pass  # each update's loss read waited for its step

    def extra(self) -> dict:
        """Figures of this system beyond ``summarise``'s: its jit signatures."""
        return {"signatures": len(self.model.signatures)}


def run_systems(systems: dict, batches: dict, batch_size: int, rounds: int = ROUNDS,
                log=print) -> dict:
    """Time ``systems`` (``{key: system}``) side by side on ``batches`` (``{key: (warm,
    timed)}``); returns ``{key: summary}``.

    1. Each system in turn starts fresh and runs its warm-up updates: its "fresh" rate,
       compilation included.
    2. Steady state means "shapes compiled": untimed passes over every system's timed batches
       (``untimed_batches``), repeated until one compiles nothing (at most
       MAX_PRECOMPILE_PASSES). They are needed after step 1, as each fresh start cleared the
       compilations of the systems before it, and when an arena grows during a pass, dynax
       kernels compiled earlier for its old capacity compile again on their next use.
    3. The timed updates, interleaved: each system's are cut into ``rounds`` blocks and the
       systems take turns, block by block, in an order reversed every round (A B, B A, ...),
       so the machine's drift over the run (15-40% per hour on a shared VM) falls on every
       system alike. A block starts with an untimed lead-in update (the batch before its
       first) and ends with an untimed wait for the device, so it holds as much device work
       as it has updates (timing from an idle device to an idle one added one unoverlapped
       backward pass per block: the tagger's mean 1,048 sentences/s against a median of
       1,066 then, 1,070 against 1,062 now).
    """
    warm_rows, untimed = {}, {k: 0 for k in systems}
    if jax.devices()[0].platform == "cpu":
        # what dynax's first computation does (dx.set_xla_thread_nice), done first so that
        # every system runs under it, the hand baseline too, whichever runs first
        yield_xla_threads()
    for k, s in systems.items():
        s.start()
        warm_rows[k] = [s.update(b) for b in batches[k][0]]
        s.settle()
        fresh = batch_size * len(warm_rows[k]) / max(1e-9, sum(r["total"] for r in warm_rows[k]))
        log(f"   [{s.name}] warm-up: {len(warm_rows[k])} updates, {fresh:.1f}/s fresh",
            flush=True)
    passes = []
    while len(passes) < MAX_PRECOMPILE_PASSES and (not passes or passes[-1]):
        n = 0
        for k, s in systems.items():
            c = sum(s.update(b)["compiles"] for b in s.untimed_batches(batches[k][1]))
            s.settle()
            untimed[k] += c
            n += c
        passes.append(n)
        log(f"   untimed pass {len(passes)}: {n} compilations", flush=True)
    timed_rows = {k: [] for k in systems}
    order = list(systems)
    # the collector as a training loop sets it (dx.settled_heap), for every system alike
    with dx.settled_heap():
        for r in range(rounds):
            for k in (order if r % 2 == 0 else order[::-1]):
                timed = batches[k][1]
                lo, hi = len(timed) * r // rounds, len(timed) * (r + 1) // rounds
                s = systems[k]
                s.update(timed[lo - 1])  # untimed lead-in: its backward pass overlaps the first
                timed_rows[k] += [s.update(timed[i]) for i in range(lo, hi)]
                s.settle()
    out = {}
    for k, s in systems.items():
        out[k] = summarise(s.name, warm_rows[k] + timed_rows[k], len(warm_rows[k]), batch_size)
        out[k].update(precompile_pass_compiles=untimed[k], precompile_passes=len(passes),
                      **s.extra())
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
        "host_cpu_ms_per_update": 1e3 * mean("host_cpu"),
        **{f"{k}_ms": 1e3 * mean(k) for k in PHASES},
        "batches_per_update": mean("batches"), "launches_per_update": mean("launches"),
        "nodes_per_update": mean("nodes"),
        "compiles_per_step": mean("compiles"),
        "timed_compiles": sum(r["compiles"] for r in timed),
        "warmup_compiles": sum(r["compiles"] for r in warm),
        "loss_first": rows[0]["loss"] / batch_size, "loss_last": timed[-1]["loss"] / batch_size,
        "timed_seconds": [r["total"] for r in timed],  # for ratios (add_ratios); not in CSVs
    }


def add_ratios(results: dict) -> None:
    """Add ``x_none`` and ``x_hand`` (throughput ratio to those systems) to every result,
    each over the timed batches both systems ran (``none`` times the first 6 of the 20
    that the others time; over all 20 against its 3 the ratio was off by up to 4%)."""
    for ref in ("none", "hand"):
        base = results.get(ref)
        for r in results.values():
            if base is None:
                r[f"x_{ref}"] = float("nan")
                continue
            n = min(len(r["timed_seconds"]), len(base["timed_seconds"]))
            r[f"x_{ref}"] = sum(base["timed_seconds"][:n]) / sum(r["timed_seconds"][:n])


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
    print(f"   {r['ms_per_update']:.1f} ms/update (process CPU {r['cpu_ms_per_update']:.1f} ms, "
          f"{r['host_cpu_ms_per_update']:.1f} of it on the Python thread); split: {split}")
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
    rows = [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows]
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
    heights = [r["items_per_s"] for res in by_batch.values() for r in res.values()
               if r["items_per_s"] > 0]
    if heights:  # room above the tallest bar for its two-line label (the axis is log)
        lo, hi = min(heights), max(heights)
        ax1.set_ylim(top=hi * max(1.6, (hi / lo) ** 0.2))
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

def split_batches(task, counts: dict, batch_size: int, seed: int = 1) -> dict:
    """``{key: (warm-up batches, timed batches)}`` for ``counts`` ``{key: (warm, timed)}``:
    every system times the same first batches, and warms up on the ones after the longest
    timed run (so no system warms up on a batch that another times)."""
    n_timed = max(t for w, t in counts.values())
    batches = task.make_batches(n_timed + max(w for w, t in counts.values()), seed, batch_size)
    return {k: (batches[n_timed:n_timed + w], batches[:t]) for k, (w, t) in counts.items()}


def run_task(task, strategies=SYSTEMS, quick: bool = False, batch_size: int | None = None,
             seed: int = 1) -> dict:
    """Run ``strategies`` (of none, depth, agenda, hand) on one task at one batch size;
    returns ``{strategy: result}`` with ratios added.

    All systems start from the same parameters (seed 0) on the same warm-up batches, so
    their first losses agree, and time the same batches, interleaved (``run_systems``).
    """
    bs = batch_size or task.BATCH
    counts = QUICK_COUNTS if quick else COUNTS
    systems = {}
    for s in strategies:
        if s == "hand" and getattr(task, "HandModel", None) is None:
            print(f"[skip] {task.NAME}: no hand-batched baseline", flush=True)
            continue
        systems[s] = HandSystem(task) if s == "hand" else DynaxSystem(task, s)
    runs = split_batches(task, counts, bs, seed)  # over every system's counts, run or not
    results = run_systems(systems, {s: runs[s] for s in systems}, bs)
    for s, r in results.items():
        r["task"], r["unit"] = task.NAME, task.UNIT
        print_result(r, task.UNIT)
    add_ratios(results)
    return results
