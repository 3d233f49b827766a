"""The executor: runs a graph's plan forward and backward over device arenas.

Values live in *arenas*, one device buffer per (shape, dtype) key, rows addressed by integer
ids; the arenas, and the gradient arenas of the backward pass, are pooled per thread and
reused by every graph (N3LDG's memory pool), so a training loop allocates no arena once
warm. Rows are handed out when a batch runs, in plan order, so a batch's outputs are one
contiguous block written in place (inputs are gathered; see ``_modes`` for why there is no
slice fast path).
"""
from __future__ import annotations

import math
import time
from collections import Counter
from contextlib import contextmanager
from itertools import chain
from operator import itemgetter
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
import numpy as np

from ..batcher.plans import PlanCache
from ..batcher.strategies import schedule
from ..device import get_device, yield_xla_threads, zeros
from ..errors import StaleExpressionError
from ..interrupts import interrupts_held
from ..ops.registry import AKEY_AVAL, AKEY_SIZE, CHEAP
from . import eviction
from .ahead import Ahead, is_new
from .buckets import bucket, coarse_bucket
from .early import DroppedGradients, EarlyBackward, may_run_early
from .validity import check_argument_grads, check_block, check_forward, check_param_grads
from .kernels import (GATHER, UNIFORM, backward_kernel, backward_run_kernel, clear_rows,
                      compile_clear, defers, forget_made, forward_kernel,
                      forward_run_kernel, load_block, made_kernels, made_mark,
                      packet_offsets, seed_gradient)
from .merges import merged_groups
from .repeats import RepeatGate, repeated_lanes
from .replay import Recording
from .scratch import ResidualPool

MIN_ROWS = 16  # rows of a new arena at the least (values of 64 KiB and more)
ARENA_START_BYTES = 1 << 20  # a new arena holds at least this much (then grows 4x)
GROW_HEADROOM = 1.25  # a grown arena holds this many times what was asked (see _grow)
GROW_FAST_BYTES = 64 << 20  # arenas smaller than this grow 4x at a time, larger ones 2x
UNIFORM_MIN_SIZE = 4096  # elements; smaller shared values are gathered like any other
LONE_CHAIN_RUNS = True  # a lone step of a sequence runs as its size's run (_chain_step)
FUSE_RUNS = True  # consecutive batches of one kernel run as one loop (see _launches)
JOIN_SEQUENCE_FLAGS = True  # a sequence's first step joins its run (_joined_flags)
AHEAD_COMPILE = True  # a pass's new kernels compile side by side (see ahead.py)
REPLAY_PREPARED = True  # a reused plan's batches are prepared as last time (see replay.py)
STREAM_BACKWARD = True  # backward kernels launch as they are decided (see _backward_batches)
BACKWARD_WHILE_WAITING = True  # a training loop's backward runs as its loss is read (early.py)
RUN_MIN_STEPS = 4  # the smallest run kernel: up to this many steps (see _run_capacity)
RUN_LANE_STEPS = 512  # a run kernel's room: about this many lanes x steps (_run_capacity),
RUN_VALUE_ELEMENTS = 1 << 20  # ... at most this many elements of its lanes' values,
RUN_MAX_STEPS = 64  # ... and at most this many steps
FUSE_MAX_MACS = 1 << 25  # fuse steps of at most this many lanes x parameter elements
RUN_REPEATS_ONCE = True  # lanes repeating another lane's computation run once (repeats.py)
REPEATS_MIN_WORK = 1 << 22  # lanes saved x a lane's work (elements), at least, to do so
REPLAN_MAX_LANES = 4  # forward batches this narrow on average: backward may plan again
MERGE_CHUNK = 512  # merged backward batches (merges.py) larger than this run in such chunks
COARSE_MAX_WORK = 1 << 16  # padded lanes x a lane's work (elements), at most, for the
# coarse ladder (_lanes): its padding then costs ~10 us at worst


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _padded_count(n: int, work: int) -> int:
    """``n`` rows (a batch's lanes, a fetch's values) of ``work`` elements each, padded:
    each padded count is a kernel to compile. Small work takes the coarse ladder
    (``coarse_bucket``) where the padded whole is at most ``COARSE_MAX_WORK`` elements, and
    its padding costs microseconds; the rest the fine one (``bucket``). A fetch uses it as
    batches do: a model stepped pass by pass fetches a different count at almost every
    step (a parser's scores as its parsers finish: 13 row counts from 1 to 64, now 3)."""
    c = coarse_bucket(n)
    return c if c * work <= COARSE_MAX_WORK else bucket(n)


def _lanes(n: int, sig) -> int:
    """The lanes a batch of n nodes of ``sig`` runs as: its bucket (1 for a lone node).

    Small batches of small work take the coarse ladder (``_padded_count``): where a padded
    kernel's whole work is at most ``COARSE_MAX_WORK`` elements, its padding costs
    microseconds, while every bucket is a kernel to compile (50-300 ms). A GAT's per-degree
    attention ops over 10 updates: 345 -> 195 compilations.

    A lone node runs as 1 lane. It used to run as 2 (the second repeating the first), since
    a 1-lane kernel copied its arena twice per call (``kernels._read_inputs`` now reads a
    lone row twice, which avoids that); but XLA:CPU runs a 2-row product on YNNPACK, where
    a 1-row one is a matrix-vector product at half the time (a 256 x 1024 weight: 37 against
    66 us), and one sentence's LSTM is such a chain of lone steps.
    """
    if n == 1:
        return 1
    return _padded_count(n, sig.lane_work)


def _max_padding(n: int, sig) -> tuple:
    """The most padding lanes of batches of ``sig`` over n nodes in all (``_lanes``): of
    one batch, and of all of them together. On the fine ladder a batch of k nodes pads at
    most k lanes; on the coarse one under 3k, and under its work bound."""
    w = sig.lane_work
    if 4 * w > COARSE_MAX_WORK:  # never coarse
        return n, n
    return max(n, min(3 * n, COARSE_MAX_WORK // w)), 3 * n


@jax.jit
def _gather_rows(arena, rows):
    # jitted with a traced index: one compile per (arena shape, row count bucket); eager
    # ``arena[i]`` would compile a new slice for every distinct Python int ``i``
    return arena[rows]


class Batch(NamedTuple):
    """One executed batch: what backward needs to run its vjp."""

    sig: object  # Signature
    modes: tuple  # how each value argument was read (GATHER / UNIFORM)
    B: int  # padded size
    packet: np.ndarray  # the int32 packet sent to the kernel; (T, length) for a run of T
    nodes: list  # node ids, one per lane (per lane of each step, for a run)
    gflags: tuple | None  # which value arguments need a gradient (None: not computed)
    forward: object  # the residual-saving forward Kernel, or None
    saved: tuple  # its residuals
    param_values: tuple  # the parameters' arrays it ran with (a later change is refused)
    gathered_outs: bool = False  # a backward plan's batch: the packet lists output rows
    distinct: int = 0  # its lanes' distinct computations ran on this many lanes (repeats.py)
    pool: list | None = None  # a run's: where its residual buffers go back to (scratch.py)


def _grad_flags(g, sig, nodes):
    """Which value arguments of a batch need a gradient; None if none of its outputs can."""
    rg, outs, node_vals = g.val_rg, g.node_out, g.node_vals
    if not any(rg[outs[nd]] for nd in nodes):
        return None
    if sig.op.cost == CHEAP:
        # Cheap ops differentiate every argument: a cotangent nobody reads costs little,
        # while each flag pattern (e.g. the zero pads of an esum) would be a kernel to compile
        return (True,) * len(sig.in_akeys)
    return tuple(any(rg[node_vals[nd][k]] for nd in nodes) for k in range(len(sig.in_akeys)))


def _batch_grad_flags(g, sig, nodes):
    """The gradient flags a batch records (``_grad_flags``): None in an evaluation graph,
    for a lookup (its backward scatters row cotangents, no vjp) and for a signature that
    runs values-only."""
    if not g.train or sig.op.row_gather or sig.values_only:
        return None
    return _grad_flags(g, sig, nodes)


def _params_of_one_batch(batches) -> set:
    """The parameters that exactly one of the executed batches uses."""
    seen, twice = set(), set()
    for b in batches:
        for p in b.sig.params:
            if p in seen:
                twice.add(p)
            seen.add(p)
    return seen - twice


class Engine:
    """Per-thread executor state: the arena pool."""

    def __init__(self):
        self.arenas: dict = {}  # akey -> jax.Array of shape (capacity, *shape)
        self.spare_grads: dict = {}  # akey -> (the last backward pass's gradient arena,
        # the rows to clear before the next pass uses it)
        self.last_grads = None  # (graph, {akey: arena}) of the last backward pass, read by
        # Expression.gradient() until the next pass takes the arenas back
        self.plans = PlanCache()  # plans of recurring graph shapes
        self.device = None  # the device its arenas are on
        # whether the last backward() was of a value read first (a training loop's pattern):
        # only then does a read look for the loss ancestors ahead (_ancestors_while_waiting)
        self.search_ahead = False
        self.early = None  # the EarlyBackward running now, if one is
        # whether a backward pass merges the cotangents of repeated lanes (repeats.py): not
        # while one runs again for Expression.gradient() (_exact_gradients)
        self.merge_repeats = True
        self.dry_passes = 0  # forward passes since one ran a batch on its distinct lanes
        self.residuals = ResidualPool()  # run kernels' residual buffers (scratch.py)
        self.passes = 0  # forward passes of this thread: the clock of its arenas' use
        self.arena_used: dict = {}  # akey -> the last pass that wrote its arena (eviction.py)

    def _follow_device(self, g) -> None:
        """Keep the arenas on the device ``dx.set_device`` selects: after a change they are
        dropped (and made again there on demand), unless ``g`` has values in them."""
        device = get_device()
        if device == self.device:
            return
        if self.device is not None:
            if g.computed:
                reason = (f"this graph computed values on {self.device}, and dx.set_device "
                          f"has selected {device} since")
                raise StaleExpressionError(
                    f"{reason}; start a new graph with dx.renew_cg()", reason)
            self.release_memory()
        self.device = device
        if device.platform == "cpu":  # the Python thread gets a core when it has work
            yield_xla_threads()

    # ---- arenas -------------------------------------------------------------------------------
    def _alloc(self, g, akey: int, n: int, B: int) -> int:
        """Rows [start, start+n) for ``g``; capacity for a B-row write from start."""
        start = g.rows.get(akey, 0)
        g.rows[akey] = start + n
        arena = self.arenas.get(akey)
        if arena is None or arena.shape[0] < start + B:
            self._grow(akey, start + B)
        return start

    def _grow(self, akey: int, need: int):
        # Every kernel that touches an arena is compiled for its capacity, so each growth
        # recompiles them: start at ARENA_START_BYTES worth of rows (at least MIN_ROWS) and
        # grow 4x at a time, trading some memory for far fewer growth steps and compiles.
        # Growth leaves GROW_HEADROOM over the need, so that the next graphs, a little larger
        # than this one, fit: the tagger's first graph used 7,530 of 8,192 rows, its second
        # needed more, and the kernels compiled in the first update compiled again (measured
        # over 8 warm-up updates: 156 -> 112 compilations, 68 -> 45 s, with the headroom).
        # Past GROW_FAST_BYTES, 2x steps: memory over compilations (a chain of 103 values
        # of 1 MiB jumped from a 256 MiB arena to 1 GiB, and its gradient arena with it).
        old = self.arenas.get(akey)
        row_bytes = max(1, AKEY_SIZE[akey] * AKEY_AVAL[akey].dtype.itemsize)

        def grown(rows):
            return rows * (4 if rows * row_bytes < GROW_FAST_BYTES else 2)

        if old is not None:
            cap = grown(old.shape[0])
        elif MIN_ROWS * row_bytes > GROW_FAST_BYTES:  # values of over 4 MiB: the rows asked
            cap = math.ceil(need * GROW_HEADROOM)  # for (16 rows of a 160 MB value: 2.5 GB,
            # and a gradient arena as large; session 79's audit)
        else:
            cap = max(MIN_ROWS, _pow2(ARENA_START_BYTES // row_bytes))
        while cap < need * GROW_HEADROOM:
            cap = grown(cap)
        aval = AKEY_AVAL[akey]
        new = jnp.zeros((cap,) + tuple(aval.shape), aval.dtype, device=get_device())
        if old is not None:
            new = new.at[: old.shape[0]].set(old)
        self.arenas[akey] = new

    def _drop_idle_arenas(self) -> None:
        """At a graph's start, drop the arenas (and spare gradient arenas) none of this
        thread's last ``eviction.ARENA_IDLE_PASSES`` forward passes wrote: of value shapes
        it stopped meeting. The last backward pass's arenas go with them: that graph is
        retired, so no ``gradient()`` reads them (the spare ones stay for the next pass)."""
        self.last_grads = None
        oldest = self.passes - eviction.ARENA_IDLE_PASSES
        for a in [a for a, t in self.arena_used.items() if t < oldest]:
            del self.arena_used[a]
            self.arenas.pop(a, None)
            self.spare_grads.pop(a, None)

    def release_memory(self):
        """Drop every pooled arena (they are re-created on demand), and forget that the
        last graph was a training loop's: a graph read after this (an evaluation, after
        training) runs no backward pass ahead, whose gradient arenas would be allocated
        again; the next backward() of a read loss turns that on again."""
        self.arenas.clear()
        self.arena_used.clear()
        self.spare_grads.clear()
        self.last_grads = None
        self.plans.clear()
        self.residuals.clear()
        self.search_ahead = False

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, g):
        """Compute the nodes of ``g`` not computed yet. If that fails or is interrupted
        part-way (an error, Ctrl-C), ``g`` computes nothing more (its rows are handed out
        part-way), and pooled arenas donated to a kernel that did not return are replaced
        by fresh ones of the same capacity, so later graphs run."""
        self._follow_device(g)
        self.passes += 1
        with eviction.pass_running(), made_kernels():
            if not g.rows:  # nothing of g in the arenas yet: those long unused can go
                self._drop_idle_arenas()
            try:
                self._forward(g)
            except BaseException as e:
                # jax_debug_nans / debug_infs: the non-finite value a kernel wrote stays in
                # its arena, and JAX checks every arena a kernel returns whole: every later
                # graph would raise, so all arenas are replaced
                self._replace_lost_arenas(every=isinstance(e, FloatingPointError))
                if g.failed is None and g.computed < len(g.node_sig):
                    g.failed = f"its forward pass stopped part-way ({type(e).__name__})"
                raise

    def _replace_lost_arenas(self, every: bool = False) -> None:
        """Fresh zero arenas for the ones a failed or interrupted kernel took (donated
        buffers are deleted when the call is dispatched), or for ``every`` one, of the same
        capacity: kernels are compiled per capacity."""
        for a, arr in list(self.arenas.items()):
            if every or arr.is_deleted():
                self.arenas[a] = zeros(arr.shape, arr.dtype)

    def _forward(self, g):
        t0 = time.perf_counter()
        first = len(g.val_row)  # the first value no earlier forward pass of g saw
        g.val_row.extend([-1] * (len(g.val_node) - first))
        lo, hi = g.computed, len(g.node_sig)
        hits = self.plans.hits
        # a list, or an iterator choosing batches as they are read: the first batches are
        # launched while the agenda picks the rest, so the device starts sooner
        batches = self.plans.stream(g.autobatch, g, lo, hi)
        g.n_plans_reused += self.plans.hits - hits
        reused = self.plans.hit  # the plan's cache entry, where it was reused
        consts: dict = {}  # akey -> [(value id, host array)] of the pending constants
        for v, arr in g.pending_consts:
            consts.setdefault(g.val_akey[v], []).append((v, arr))
        if not isinstance(batches, list):
            rows = self._rows(g, consts, lo, hi)
            if not self._fits(rows):
                # streamed, its rows have a bound only; where that bound would grow an
                # arena, the whole plan is made first so the arena grows to what it needs
                batches = list(batches)
        if isinstance(batches, list):
            rows = self._rows(g, consts, lo, hi, batches)
            self._grow_to(rows)
        self.arena_used.update(dict.fromkeys(rows, self.passes))
        self._load_constants(g, consts)
        g.pending_consts = []
        # a reused plan's batches are prepared as they were last time (replay.py)
        replay = recording = None
        # ... unless the last pass ran batches on their distinct lanes (repeats.py): a
        # replay runs every lane, which cost more than preparing afresh (replay.py)
        if REPLAY_PREPARED and reused is not None and not g.check_validity \
                and not (RUN_REPEATS_ONCE and self.dry_passes == 0):
            if reused.replay is not None and reused.replay.matches(g, first):
                replay = reused.replay.replay(g)
                g.n_replayed += 1
            else:
                recording = Recording(g, first)
        t1 = time.perf_counter()
        scheduling = t1 - t0
        plan: list = []
        run: list = []  # prepared batches of one kernel, launched together
        held: list = []  # runs from the first with a new kernel on (see _launch_held)
        # 'none' is the node-by-node reference; validity checks look at every batch
        fuse = FUSE_RUNS and g.autobatch != "none" and not g.check_validity
        # a replayed plan's packets are the recorded ones: no lane is known to repeat there;
        # 'none' runs one node a batch (nothing repeats), so its passes count for nothing
        repeats = (RUN_REPEATS_ONCE and not g.check_validity and replay is None
                   and recording is None and g.autobatch != "none")
        repeated_before = g.n_repeated_lanes
        batches = iter(batches)
        while True:
            t = time.perf_counter()
            nodes = next(batches, None)
            scheduling += time.perf_counter() - t
            if nodes is None:
                break
            plan.append(nodes)
            if replay is not None:
                step = next(replay)
            else:
                step = self._prepare(g, nodes, repeats)
                if recording is not None:
                    recording.add(step)
            if JOIN_SEQUENCE_FLAGS and run and fuse and step[:4] != run[0][:4] and \
                    not (step[6] or run[0][6]):
                step = _joined_flags(run, step)  # a sequence's first step joins its run
            # a batch running its distinct lanes only is launched on its own
            if run and (not fuse or step[:4] != run[0][:4] or step[6] or run[0][6]):
                mark = made_mark()  # before the check makes any of its kernels
                if held or self._meets_new_kernel(g, run):
                    held.append((run, mark))
                else:
                    self._launch_checked(g, run, mark)
                run = []
            run.append(step)
        if run:
            held.append((run, made_mark()))
        self._launch_held(g, held)
        if recording is not None:
            reused.replay = recording.finish(g)
        if repeats:
            self.dry_passes = 0 if g.n_repeated_lanes > repeated_before else self.dry_passes + 1
        g.computed = hi
        g.n_batches += len(plan)
        g.forward_passes += 1
        if g.check_validity:
            check_forward(self, g, plan)
        g.seconds["schedule"] += scheduling
        g.seconds["forward"] += time.perf_counter() - t0 - scheduling

    def _meets_new_kernel(self, g, run) -> bool:
        """Whether ``run`` launches a kernel that has not run yet, so that the runs from it
        on are held back and their new kernels compiled side by side (``ahead.py``)."""
        return (AHEAD_COMPILE and not g.check_validity
                and any(is_new(launch[0].fn) for launch in self._launches(g, run)))

    def _launch_held(self, g, held: list) -> None:
        """Launch the ``held`` runs (``(run, made_mark() before its kernels)``) in order,
        their new kernels first lowered here and compiled in ``ahead.py``'s pool, side by
        side, so that each launch waits for its own only."""
        ahead = None
        if len(held) > 1 or held and self._meets_new_kernel(g, held[0][0]):
            ahead = Ahead()
            for run, _ in held:
                params = tuple(p._value for p in run[0][0].params)
                for kern, _, chunk, T in self._launches(g, run):
                    if is_new(kern.fn):
                        args = self._forward_args(kern, params, _packet(chunk, T))
                        if T:
                            args += (self.residuals.spare(kern, args, T),)
                        ahead.submit(kern.fn, args)
        for run, mark in held:
            self._launch_checked(g, run, mark, ahead)

    def _launch_checked(self, g, run, mark: int, ahead=None):
        """``_launch``; an error there (compiling or running the kernel, e.g. a function JAX
        cannot batch) names the op, and leaves the graph failed: its rows are handed out
        part-way, so nothing more can run on it. A training forward that fails where a
        values-only one runs (a callback without a JVP rule) runs values-only instead.
        ``mark``: ``made_mark()`` before this run's kernels were made."""
        sig = run[0][0]
        before = mark, len(g.batches), g.n_launches
        try:
            self._launch(g, run, ahead)
        except Exception as e:
            nodes = run[0][5]
            _undo_launch(g, sig, *before)
            if run[0][3] is not None and not isinstance(e, FloatingPointError) \
                    and self._launch_values_only(g, run, e):
                return  # it failed saving residuals, and runs without (not a non-finite
                # value under jax_debug_nans: that is no reason to give up the backward)
            what = (f"a batch of {sum(len(s[5]) for s in run)} '{sig.op.name}' node(s) (the "
                    f"first built as node {nodes[0]})")
            g.failed = f"{what} failed: {type(e).__name__}: {_first_line(e)}"
            e.add_note(f"dynax: while running {what}")
            raise

    def _launch_values_only(self, g, run, error: Exception) -> bool:
        """Launch ``run`` without vjp residuals; whether it ran. If it did, the signature
        runs so from now on, and a backward that needs it is refused before any kernel
        runs (``_check_backward_possible``)."""
        sig = run[0][0]
        before = made_mark(), len(g.batches), g.n_launches
        try:
            self._launch(g, [(*step[:3], None, *step[4:]) for step in run])
        except Exception:
            _undo_launch(g, sig, *before)
            return False
        sig.values_only = f"{type(error).__name__}: {_first_line(error)}"
        return True

    def _rows(self, g, consts, lo: int, hi: int, plan=None) -> dict:
        """Per arena, the rows this forward pass can write at most (``_alloc``'s rule: rows
        used, plus the largest padding a write needs beyond them). Without the ``plan``, a
        bound that holds for any (``_max_padding``): of the m outputs of a node in one
        arena, all but the last take B rows."""
        used, slack = dict(g.rows), {}

        def add(a, rows, pad):
            used[a] = used.get(a, 0) + rows
            slack[a] = max(slack.get(a, 0), pad)

        for a, items in consts.items():
            add(a, len(items), bucket(len(items)) - len(items))
        sigs = g.node_sig
        if plan is not None:
            for nodes in plan:
                n = len(nodes)
                B = _lanes(n, sigs[nodes[0]])
                outs = sigs[nodes[0]].out_akeys
                for j, a in enumerate(outs):  # outputs of one arena: blocks of B, the last n
                    add(a, B if a in outs[j + 1:] else n, B - n)
        else:
            for sig, n in Counter(sigs[lo:hi]).items():
                outs = sig.out_akeys
                one, total = _max_padding(n, sig)
                for a in set(outs):  # outputs of one arena: blocks of B, the last n
                    add(a, (outs.count(a) - 1) * (n + total) + n, one)
        return {a: rows + slack.get(a, 0) for a, rows in used.items()}

    def _fits(self, rows: dict) -> bool:
        arenas = self.arenas
        return all(a in arenas and arenas[a].shape[0] >= n for a, n in rows.items())

    def _grow_to(self, rows: dict):
        """Grow each arena, once and before anything runs, to hold all this forward writes:
        kernels are compiled per arena capacity, so an arena growing in the middle of a
        forward pass made every kernel that ran before the growth compile again (the first
        tagger update: 2 growths of the 128-d arena)."""
        for a, n in rows.items():
            arena = self.arenas.get(a)
            if arena is None or arena.shape[0] < n:
                self._grow(a, n)

    def _load_constants(self, g, consts):
        """Copy the pending constants into their arenas: one transfer per arena."""
        for akey, items in consts.items():
            n = len(items)
            B = bucket(n)
            start = self._alloc(g, akey, n, B)
            aval = AKEY_AVAL[akey]
            block = np.zeros((B,) + tuple(aval.shape), aval.dtype)
            for i, (v, arr) in enumerate(items):
                block[i] = arr
                g.val_row[v] = start + i
            self.arenas[akey] = load_block(self.arenas[akey], block, np.int32(start))

    def _modes(self, g, sig, nodes):
        """How each value argument is read (GATHER, or UNIFORM when every lane reads the
        same row), and its rows.

        There is no slice mode for contiguous rows: measured on XLA:CPU, a kernel that
        slices an arena it also updates in place makes XLA copy the whole arena (2 copies of
        8192x150 per call), while a gather of the same rows does not; a gather of B rows is
        cheap next to the op itself. Outputs are still written as one contiguous block.
        """
        n = len(nodes)
        row_of = g.val_row.__getitem__
        modes, all_rows = [], []
        # the value arguments of the batch's nodes, a column per argument position
        # (itemgetter: zip(*rows) costs ~0.1 us a node, making an iterator of each)
        vals = list(map(g.node_vals.__getitem__, nodes))
        for k, akey in enumerate(sig.in_akeys):
            rows = list(map(row_of, map(itemgetter(k), vals)))
            all_rows.append(rows)
            # UNIFORM only pays for large values (a shared computed matrix): for small ones a
            # gather of B copies is cheap, and each mode pattern is a kernel to compile
            modes.append(UNIFORM if n > 1 and AKEY_SIZE[akey] >= UNIFORM_MIN_SIZE
                         and rows.count(rows[0]) == n else GATHER)
        return tuple(modes), all_rows

    def _prepare(self, g, nodes, repeats: bool = False):
        """Rows for a batch's outputs and its int packet: ``(sig, modes, B, gflags, packet,
        nodes, distinct)``; its kernel is launched later (``_launch``), maybe with the next
        batches. With ``repeats``, lanes repeating another's computation are looked for
        (``_repeats``): where the batch runs its ``distinct`` lanes only, the packet's
        arguments are theirs, followed by their number and each lane's distinct lane."""
        sig = g.node_sig[nodes[0]]
        n = len(nodes)
        B = _lanes(n, sig)
        # where a gradient may flow, the forward kernel also saves the vjp residuals
        gflags = _batch_grad_flags(g, sig, nodes)
        modes, all_rows = self._modes(g, sig, nodes)
        found = self._repeats(g, sig, nodes, B) if repeats and n > 1 else None
        # the packet: [n, output starts, per value arg (B rows | 1 row), per int arg (B ints)]
        packet = [n]
        val_row = g.val_row
        firsts = list(map(g.node_out.__getitem__, nodes))  # each node's first output value
        starts: dict = {}
        for j, a in enumerate(sig.out_akeys):
            if a in starts:  # outputs of one arena take consecutive blocks of B rows
                start = starts[a] = starts[a] + B
            else:
                m = sig.out_akeys.count(a)
                start = starts[a] = self._alloc(g, a, (m - 1) * B + n, m * B)
            packet.append(start)
            for v, row in zip(firsts, range(start, start + n)):
                val_row[v + j] = row
        if found is None:
            _add_arguments(packet, g, sig, modes, all_rows, B, nodes)
            return sig, modes, B, gflags, packet, nodes, 0
        lanes, expand = found
        U = _lanes(len(lanes), sig)
        g.n_repeated_lanes += n - len(lanes)
        _add_arguments(packet, g, sig, modes, [[rows[i] for i in lanes] for rows in all_rows],
                       U, [nodes[i] for i in lanes])
        packet.append(len(lanes))
        packet += expand
        packet += [0] * (B - n)
        return sig, modes, B, gflags, packet, nodes, U

    def _repeats(self, g, sig, nodes, B: int):
        """The repeated lanes of a batch (``repeated_lanes``) where running its distinct
        lanes only saves enough work (``REPEATS_MIN_WORK``), else None.

        A lookup never runs so (gathering a table's row costs what gathering a result
        would), but its repeats are recorded: they are what makes the cells reading the
        lookups repeat. So it counts as found only while forward passes keep running
        batches on their distinct lanes: a tagger's lookups repeat in every graph and its
        cells hardly ever, and keying its ~1,400 lookups cost 0.4 ms an update."""
        gate = sig.repeats
        if gate is None:
            gate = sig.repeats = RepeatGate()
        if not gate.looks():
            return None
        found = repeated_lanes(g, sig, nodes)
        if sig.op.row_gather:
            gate.saw(found is not None and self.dry_passes == 0)
            return None
        if found is not None and \
                (B - _lanes(len(found[0]), sig)) * sig.lane_work < REPEATS_MIN_WORK:
            found = None  # too little to save: such batches are looked at less and less often
        gate.saw(found is not None)
        return found

    def _launches(self, g, run):
        """The launches of consecutive prepared batches of one kernel: ``(kernel, step
        kernel, batches, T)``, ``T`` the capacity of a run kernel, 0 for a single batch's.

        Runs of small steps (launch-bound) run in a loop (``kernels.forward_run_kernel``)
        with room for ``_run_capacity`` steps, one launch per that many: per signature and
        size one kernel serves every run, where loops of exact power-of-two lengths took two
        or three (7 steps: 4, 2, 1; the tagger's first 5 updates: 122 -> 104 compilations).
        A lone step launches its single kernel, unless it continues a sequence in this pass
        (``_chain_step``): in the loop lone steps saved kernels where runs are common
        (tagger: 90 compilations) but none where they are rare (a Tree-LSTM's levels),
        where a loop compiles slower (and then zero-filled room for 4 steps' residuals:
        Tree-LSTM, ``--quick``, 3 alternated rounds: 1,164 -> 1,099 trees/s); and taking
        the loop only once runs had compiled it made the bits depend on the kernel cache's
        history (the loop rounds differently). Large steps run one launch
        each (measured on the synthetic BiLSTM's 64-lane steps: a loop costs the device
        more than the launches it saves).
        """
        sig, modes, B, gflags = run[0][:4]
        step = forward_kernel(sig, modes, B, gflags, run[0][6])
        kern = None
        # runs longer than one form only where _forward fuses (not 'none', no validity
        # checks); _chain_step asks the same of a lone step
        if (len(run) > 1 or _chain_step(g, run[0])) and \
                B * sig.param_elements <= FUSE_MAX_MACS:
            T = _run_capacity(sig, modes, B, len(run))
            kern = forward_run_kernel(sig, modes, B, gflags, T)
        if kern is None:  # one launch per batch
            for r in run:
                yield step, step, [r], 0
        else:
            for i in range(0, len(run), T):
                yield kern, step, run[i:i + T], T

    def _launch(self, g, run, ahead=None):
        """Run consecutive prepared batches of one kernel (``_launches``), each launch
        waiting for its kernel's compilation if ``ahead`` has it in flight."""
        sig, modes, B, gflags = run[0][:4]
        for kern, step, chunk, T in self._launches(g, run):
            if ahead is not None:
                ahead.wait(kern.fn)
            nodes = chunk[0][5] if len(chunk) == 1 else [nd for r in chunk for nd in r[5]]
            self._call_forward(g, sig, modes, B, gflags, _packet(chunk, T), nodes, kern,
                               step, chunk[0][6], T)

    def _forward_args(self, kern, param_values: tuple, packet) -> tuple:
        """A forward kernel's arguments: its arenas written and read, the parameters' values
        and the packet (what a launch passes, and what ``ahead.py`` compiles for); a run
        kernel's take its residual buffers after these."""
        arenas = self.arenas
        return (tuple(arenas[a] for a in kern.write_akeys),
                tuple(arenas[a] for a in kern.read_akeys), param_values, packet)

    def _call_forward(self, g, sig, modes, B, gflags, packet, nodes, kern, step,
                      distinct: int = 0, T: int = 0):
        """Launch ``kern`` (``step``, or a run of it with room for ``T`` steps) and record
        the batch for backward."""
        arenas = self.arenas
        param_values = tuple(p._value for p in sig.params)
        args = self._forward_args(kern, param_values, packet)
        pool = None
        if T:  # a run: residual buffers from the pool, back there when the graph retires
            stacked, pool = self.residuals.take(kern, args, T)
            args += (stacked,)
        new, saved = kern.fn(*args)
        for a, arr in zip(kern.write_akeys, new):
            arenas[a] = arr
        if gflags is None:  # from a reused training kernel: not needed
            if pool is not None:
                pool.append(saved)
            saved, pool = (), None
        g.n_launches += 1
        g.batches.append(Batch(sig, modes, B, packet, nodes, gflags,
                               step if gflags is not None else None, saved, param_values,
                               distinct=distinct, pool=pool))

    # ---- reading ---------------------------------------------------------------------------------
    def read(self, g, v: int) -> np.ndarray:
        got = g.host_values.get(v)
        if got is None:
            pending = g.pending_reads.pop(v, None)
            if pending is None:
                pending = self._start_read(g, v)
            search = self.search_ahead and g.loss_live is None and g.train
            if (search or g.litter) and _waiting(pending):  # host work the wait hides
                g.litter = ()  # the replaced graph's node lists (renew_cg)
                if search:
                    _ancestors_while_waiting(g, v)
                    if BACKWARD_WHILE_WAITING and may_run_early(g, v):
                        self._backward_while_waiting(g, v)
            got = g.host_values[v] = np.asarray(pending)[0, ...]
        return got

    def _start_read(self, g, v: int):
        """Queue the one-row gather of value ``v`` (its device array; reading it waits)."""
        return _gather_rows(self.arenas[g.val_akey[v]], np.asarray([g.val_row[v]], np.int32))

    def fetch(self, g, values) -> None:
        """Copy computed values to the host: one gather and one transfer per arena."""
        by_akey: dict = {}
        for v in values:
            if v not in g.host_values:
                by_akey.setdefault(g.val_akey[v], []).append(v)
        for akey, vs in by_akey.items():
            rows = [g.val_row[v] for v in vs]
            rows += rows[:1] * (_padded_count(len(rows), AKEY_SIZE[akey]) - len(rows))
            host = np.asarray(_gather_rows(self.arenas[akey], np.asarray(rows, np.int32)))
            for j, v in enumerate(vs):
                g.host_values[v] = host[j, ...]  # an ndarray even when 0-d

    # ---- backward --------------------------------------------------------------------------------
    def backward(self, g, v: int, full: bool = False):
        """Accumulate the gradient of value ``v`` into the parameters it depends on; with
        ``full``, compute the cotangent of every value the loss depends on as well (inputs
        included), for ``Expression.gradient()``."""
        self._follow_device(g)
        with eviction.pass_running():
            return self._backward(g, v, full)

    def _backward(self, g, v: int, full: bool):
        early, g.early = g.early, None
        if early is not None:
            if early.fits(g, v, full):
                self.search_ahead = True
                self.last_grads = (g, early.commit(g))
                return
            g.n_backward_batches = early.n_backward_batches  # not run, as far as stats go
        loss_node = g.val_node[v]
        self.search_ahead = v in g.host_values
        if loss_node < 0:  # a constant: no parameter contributed, nothing to differentiate
            self.last_grads = None  # the gradients of a pass before are not this one's
            return
        if v not in g.host_values and self.early is None:
            # queue the loss's read ahead of the backward kernels, so that a loop reading
            # it after ``trainer.update()`` waits for the forward pass only
            g.pending_reads[v] = self._start_read(g, v)
        known = g.loss_live
        live = known[1] if known and known[0] == loss_node else _loss_ancestors(g, loss_node)
        _check_backward_possible(g, loss_node, live, full)
        grads = self._gradient_arenas(g)
        grads[g.val_akey[v]] = seed_gradient(grads[g.val_akey[v]], np.int32(g.val_row[v]))
        if not g.check_validity:
            plan = self._backward_plan(g)
            try:
                with interrupts_held():  # its kernels consume the gradient buffers
                    return self._backward_batches(g, grads, v, loss_node, live, full, plan)
            except Exception as e:  # restoring needs a copy of every gradient: validity mode
                _forget_lost_gradients(plan)
                e.add_note("dynax: the backward pass stopped part-way, so the parameters' "
                           "gradients are partly accumulated; zero them (p.zero_grad()) "
                           "before an update, or build with dx.renew_cg(check_validity=True) "
                           "to have a failed backward leave them as they were")
                raise
        snapshot = _gradient_snapshot(g.batches)
        try:
            self._backward_batches(g, grads, v, loss_node, live, full, g.batches)
        except BaseException:  # a check failed part-way: no parameter keeps a partial gradient
            _restore_gradients(snapshot)
            raise

    def _backward_while_waiting(self, g, v: int) -> None:
        """Run ``backward()`` of loss ``v`` while the host waits for its value, the
        parameters' gradients held aside until ``backward()`` of ``v`` claims them
        (``early.py``). An error is left for that ``backward()`` to raise."""
        t = time.perf_counter()
        early = self.early = EarlyBackward(g, v)
        try:
            self.backward(g, v)
        except Exception:  # noqa: BLE001  (backward() runs again, and raises it there)
            g.n_backward_batches = early.n_backward_batches
        else:
            if self.last_grads is not None and self.last_grads[0] is g:  # the pass ran
                early.arenas, self.last_grads = self.last_grads[1], None  # until claimed
                g.early = early
        finally:
            self.early = None
        g.seconds["backward"] += time.perf_counter() - t

    def _grad_buffer(self, p):
        """The gradient buffer of ``p`` a backward kernel adds to (and consumes)."""
        return p._grad_buffer() if self.early is None else self.early.buffer(p)

    def _has_buffer(self, p) -> bool:
        """Whether a gradient buffer of ``p`` exists (a kernel then adds to it)."""
        return p._grad is not None or (self.early is not None and p in self.early.grads)

    def _accumulate(self, p, arr, sig, g, nodes) -> None:
        """``p``'s gradient is now ``arr`` (its buffer and the batch's share added)."""
        if self.early is None:
            p._accumulate(arr, sig, g, nodes)
        else:
            self.early.add(p, arr, sig, nodes)

    def _backward_plan(self, g) -> list:
        """The batches backward runs, in forward order: the forward passes' own, a plan of
        the whole graph where incremental forward passes ran it in many narrow batches, or
        the forward's with narrow batches of one signature merged (``merges.py``).

        A value read after every step of a decoder or parser (DyNet's ``.value()`` idiom)
        makes each forward pass compute a step or two: 16 sentences read word by word ran
        2,885 batches of one or two nodes, where a plan of the finished graph has 38. The
        new plan's batches recompute their vjp from the value arenas (their forward saved
        none) and read their output cotangents by row. They are looked for only where two
        or more forward passes ran batches of fewer than ``REPLAN_MAX_LANES`` nodes on
        average, and used only if they are at most half as many. Wider passes (a parser's
        steps across its sentences) keep their batches, merged where ``merges.py`` can."""
        batches = g.batches
        n_computed = g.computed
        if g.autobatch == "none" or g.forward_passes < 2 or not g.n_batches:
            return batches
        if n_computed <= REPLAN_MAX_LANES * g.n_batches:
            plan = schedule(g.autobatch, g, 0, n_computed)
            if 2 * len(plan) <= g.n_batches:
                return [self._lane_by_lane(g, nodes) for nodes in plan]
        groups = merged_groups(g, batches)
        if not groups:
            return batches
        last = {m[-1]: m for m in groups}  # a group runs where its last batch would
        merged = set(chain.from_iterable(groups))
        out = []
        for j, b in enumerate(batches):
            if j in last:
                nodes = [nd for i in last[j] for nd in batches[i].nodes]
                if len(nodes) <= MERGE_CHUNK:
                    out.append(self._lane_by_lane(g, nodes, b.param_values))
                    continue
                # chunks of one size, the last padded: one kernel whatever the group's
                # size, which follows the decisions (and drifts as the model trains)
                out += [self._lane_by_lane(g, nodes[k:k + MERGE_CHUNK], b.param_values,
                                           MERGE_CHUNK)
                        for k in range(0, len(nodes), MERGE_CHUNK)]
            elif j not in merged:
                out.append(b)
        return out

    def _lane_by_lane(self, g, nodes, param_values: tuple | None = None,
                      B: int | None = None) -> Batch:
        """A batch over computed ``nodes`` for backward only: its kernel recomputes the
        vjp from the value arenas, every lane its own (none merged, see ``repeats.py``),
        and reads each output's cotangent by row (``gathered_outs``). ``param_values``:
        those its forward ran with, if it ran as one batch or as batches with the same
        (the parameters' now, else); ``B``, its lanes if not the default."""
        sig = g.node_sig[nodes[0]]
        outs, val_row = g.node_out, g.val_row
        if B is None:
            # powers of two: these sizes follow the data more than the forward's do, and
            # each is a kernel variant to compile (a helper's chains read per step, 80
            # updates: 67 -> 61 compilations; 45 without planning again)
            B = max(2, _pow2(len(nodes)))
        modes, all_rows = self._modes(g, sig, nodes)
        packet = [len(nodes)]
        for j in range(len(sig.out_akeys)):
            rows = [val_row[outs[nd] + j] for nd in nodes]
            packet += rows
            packet += [rows[0]] * (B - len(nodes))
        _add_arguments(packet, g, sig, modes, all_rows, B, nodes)
        gflags = _batch_grad_flags(g, sig, nodes)
        if param_values is None:
            param_values = tuple(p._value for p in sig.params)
        return Batch(sig, modes, B, np.asarray(packet, np.int32), nodes, gflags, None, (),
                     param_values, True)

    def _backward_batches(self, g, grads, v, loss_node, live, full, batches):
        """Run the backward kernels of the batches (``_backward_plan``'s) the loss ``v``
        depends on (``live``: see ``_loss_ancestors``), last first: each launched as soon as
        it is decided, up to the first whose kernel never ran; from that one on, their new
        kernels compiled side by side first (``ahead.py``).

        A batch that ran its distinct lanes only (``repeats.py``) merges its repeated
        lanes' cotangents, except in a full pass, a pass for ``Expression.gradient()``
        (``merge_repeats`` off) or where some of its lanes do not reach the loss: it then
        runs lane by lane (``_lane_by_lane``)."""
        once = _params_of_one_batch(batches)
        g.merged = None
        merged = []
        # Until a kernel that has not run yet turns up, each launch goes as soon as it is
        # decided, so the device (idle since the forward pass) starts at once; from that
        # kernel on they are collected, and their new kernels compiled side by side.
        stream = STREAM_BACKWARD and not g.check_validity
        launches = []
        for batch in reversed(batches):
            with _noting_backward(batch):
                if batch.distinct and min(batch.nodes) <= loss_node:
                    if (self.merge_repeats and not full
                            and all(_needed(batch.nodes, loss_node, live))):
                        merged.append(batch)
                    else:
                        batch = self._lane_by_lane(g, batch.nodes, batch.param_values)
                launch = self._backward_launch(g, loss_node, live, once, full, batch)
                if stream and not _compiles_first(launch):
                    self._backward_batch(g, grads, batch, launch)
                    continue
            stream = False
            launches.append((batch, launch))
        ahead = self._compile_backward_ahead(g, grads, launches)
        for batch, launch in launches:
            with _noting_backward(batch):  # e.g. a dx.function JAX cannot differentiate
                self._backward_batch(g, grads, batch, launch, ahead)
        if merged:
            g.merged = (v, merged, None)  # the values upstream: found when first needed
        # kept as they are for Expression.gradient(), and cleared when the next pass takes
        # them (a bucketed row count, so that the same step next compiles nothing)
        for a, arr in grads.items():
            used = min(arr.shape[0], _pow2(g.rows[a]))
            compile_clear(arr, used)
            self.spare_grads[a] = (arr, used)
        self.last_grads = (g, grads)

    def _backward_launch(self, g, loss_node, live, once, full, batch):
        """What the backward of ``batch`` launches: None (nothing: no lane reaches the
        loss, or no gradient flows), ``(None, gflags, lanes)`` (some lanes only, maybe none:
        see ``_backward_some_lanes``), or ``(kernel, gflags, saved, fresh)``."""
        sig, modes, B, packet, nodes, gflags, fwd, saved = batch[:8]
        if min(nodes) > loss_node:
            return None
        if full and gflags != (every := (True,) * len(sig.in_akeys)):
            # its forward saved the vjp of fewer arguments (those a parameter reaches) or
            # none: recompute it for all of them
            if not every and not sig.params:  # a random draw: nothing to differentiate
                return None
            gflags, fwd, saved = every, None, ()
        elif gflags is None:  # forward saved nothing (train=False, or no gradient flowed)
            gflags = _grad_flags(g, sig, nodes)
            if gflags is None:
                return None
        if live is not None or max(nodes) > loss_node:
            lanes = _needed(nodes, loss_node, live)
            if not all(lanes):
                return None, gflags, lanes
        params = sig.params
        if packet.ndim == 1:
            # the first gradient of parameters that only this batch uses is returned as
            # is (no zero buffer to add it to); limited to them, so that a recurrent
            # cell, whose first batch in reverse order varies, compiles no variant per
            # batch size
            fresh = (bool(params) and not sig.op.row_gather
                     and all(not self._has_buffer(p) and p in once for p in params))
            kern = backward_kernel(sig, modes, gflags, B, fwd, fresh,
                                   gathered_outs=batch.gathered_outs,
                                   distinct=batch.distinct)
        else:  # a fused run (see _launch)
            fresh = False
            kern = backward_run_kernel(sig, modes, gflags, B, fwd, packet.shape[0])
        return kern, gflags, saved, fresh

    def _compile_backward_ahead(self, g, grads, launches):
        """An ``Ahead`` compiling the new kernels of ``launches`` side by side, or None."""
        new = [(batch, launch) for batch, launch in launches if _compiles_first(launch)]
        if not AHEAD_COMPILE or g.check_validity or not new:
            return None
        ahead = Ahead()
        device = SingleDeviceSharding(get_device())
        for batch, (kern, _, saved, fresh) in new:
            params = batch.sig.params
            # a parameter's gradient buffer, made on its first launch, as that makes it
            pgrads = () if fresh else tuple(
                p._grad if p._grad is not None
                else jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=device) for p in params)
            ahead.submit(kern.fn, self._backward_args(kern, grads, pgrads, params, saved,
                                                      batch.packet))
        return ahead

    def _backward_args(self, kern, grads: dict, pgrads: tuple, params, saved, packet) -> tuple:
        """A backward kernel's arguments: its gradient arenas, the parameters' gradient
        buffers (``pgrads``), its value arenas, the parameters' values, the forward's
        residuals and the packet (what a launch passes, and what ``ahead.py`` compiles
        for)."""
        return (tuple(grads[a] for a in kern.write_akeys), pgrads,
                tuple(self.arenas[a] for a in kern.read_akeys),
                tuple(p._value for p in params), saved, packet)

    def _backward_batch(self, g, grads, batch, launch, ahead=None):
        """One batch's (or fused run's) share of ``_backward_batches``: its ``launch``
        (``_backward_launch``'s)."""
        if launch is None:
            return
        sig, modes, B, packet, nodes = batch[:5]
        if g.check_validity:
            for j, a in enumerate(sig.out_akeys):
                check_block(g, grads[a], packet[1 + j], nodes, sig, "gradient")
        if launch[0] is None:
            _, gflags, lanes = launch
            if any(lanes):
                self._backward_some_lanes(g, grads, sig, modes, B, packet, nodes, gflags,
                                          lanes, batch.gathered_outs)
            return
        kern, gflags, saved, fresh = launch
        params = sig.params
        # a run's steps: its packets with lanes
        g.n_backward_batches += np.count_nonzero(packet[:, 0]) if packet.ndim == 2 else 1
        if ahead is not None:
            ahead.wait(kern.fn)
        pgrads = () if fresh else tuple(map(self._grad_buffer, params))
        new_g, new_pg = kern.fn(*self._backward_args(kern, grads, pgrads, params, saved,
                                                     packet))
        for a, arr in zip(kern.write_akeys, new_g):
            grads[a] = arr
        for p, arr in zip(params, new_pg):
            self._accumulate(p, arr, sig, g, nodes)
        if g.check_validity:
            check_argument_grads(g, grads, sig, nodes, gflags)
            check_param_grads(g, sig, nodes)

    def _backward_some_lanes(self, g, grads, sig, modes, B, packet, nodes, gflags, lanes,
                             gathered=False):
        """The backward of a batch (or run) only some of whose nodes the loss depends on
        (``lanes``), step by step. The other lanes are pointed at the inputs of one that
        counts, and the vjp is recomputed from them: their cotangents are zero (only nodes
        that do not count read them), and zero times a finite derivative adds nothing (see
        ``_loss_ancestors`` for why their own inputs must not be used)."""
        # no saved residuals: recomputed
        kern = backward_kernel(sig, modes, gflags, B, gathered_outs=gathered)
        _, val_off, int_off = packet_offsets(sig, modes, B, gathered)
        per_lane = [o for o, m in zip(val_off, modes) if m == GATHER] + int_off
        steps = packet if packet.ndim == 2 else packet[None]
        starts = np.cumsum([0] + [int(p[0]) for p in steps])
        for t in reversed(range(len(steps))):
            on = np.zeros(B, bool)
            on[:starts[t + 1] - starts[t]] = lanes[starts[t]:starts[t + 1]]
            if not on.any():
                continue
            first = int(np.argmax(on))
            g.n_backward_batches += 1
            packet_t = steps[t].copy()
            for off in per_lane:  # rows of gathered arguments, ints
                packet_t[off:off + B][~on] = packet_t[off + first]
            new_g, new_pg = kern.fn(*self._backward_args(
                kern, grads, tuple(map(self._grad_buffer, sig.params)), sig.params, (),
                packet_t))
            for a, arr in zip(kern.write_akeys, new_g):
                grads[a] = arr
            step_nodes = nodes[starts[t]:starts[t + 1]]
            live_nodes = [nd for nd, o in zip(step_nodes, on) if o]
            for p, arr in zip(sig.params, new_pg):
                self._accumulate(p, arr, sig, g, live_nodes)
            if g.check_validity:
                check_argument_grads(g, grads, sig, live_nodes, gflags)
                check_param_grads(g, sig, step_nodes)

    def _gradient_arenas(self, g):
        """Zero gradient arenas, one per value arena ``g`` uses.

        Each backward pass leaves its arenas for the next, which sets the rows written to
        zero (a prefix: a graph's rows are handed out from 0). A new arena would cost a
        fresh allocation and a fill of its full capacity, which XLA:CPU runs on the calling
        thread (the synthetic BiLSTM's 64 MB arena: 22-30 ms, against 1.3-3.7 ms to clear a
        used one in place; its updates, alternated in one process: 781 -> 740 ms median).
        """
        self.last_grads = None  # their arenas are this pass's now
        grads = {}
        for a in g.rows:
            arena = self.arenas[a]
            spare, used = self.spare_grads.pop(a, (None, 0))
            if spare is None or spare.shape != arena.shape:
                spare = zeros(arena.shape, arena.dtype)
            elif used:
                spare = clear_rows(spare, used)
            grads[a] = spare
        return grads

    def gradient(self, g, v: int) -> np.ndarray:
        """The cotangent of value ``v`` (built before it) in the last backward pass, or
        None if that pass was not ``g``'s."""
        if self.last_grads is None or self.last_grads[0] is not g:
            return None
        if g.merged is not None and v in _upstream_of_merges(g):
            self._exact_gradients(g)
        arena = self.last_grads[1][g.val_akey[v]]  # every arena of g's values has one
        # the caller's own copy, writable, as npvalue()
        return np.array(_gather_rows(arena, np.array([g.val_row[v]], np.int32))[0])

    def _exact_gradients(self, g) -> None:
        """Run the last backward pass of ``g``, which merged repeated lanes' cotangents,
        again lane by lane: its arenas then hold every value's own cotangent. The
        parameters' gradients of this second pass are dropped (they are the first's)."""
        loss = g.merged[0]
        search_ahead, n_batches = self.search_ahead, g.n_backward_batches
        self.early, self.merge_repeats = DroppedGradients(), False
        try:
            self.backward(g, loss)
        except StaleExpressionError as e:
            what = e.reason or str(e)
            raise StaleExpressionError(
                "gradient: the last backward pass ran lanes repeating one computation once "
                "and summed their gradients, so this expression's own gradient needs that "
                f"pass again with the parameters it ran with, but {what}. Read gradient() "
                "before changing parameters, or call backward(full=True), which keeps "
                "every expression's own gradient") from None
        finally:
            self.early, self.merge_repeats = None, True
            self.search_ahead, g.n_backward_batches = search_ahead, n_batches


def _upstream_of_merges(g) -> set:
    """The values whose cotangent in ``g``'s last backward pass is not their own
    (``repeats.py``): the value arguments of the batches whose repeated lanes it merged,
    and every value upstream of them. Found once per pass (``g.merged`` keeps them)."""
    loss, batches, upstream = g.merged
    if upstream is None:
        todo = [w for b in batches for nd in b.nodes for w in g.node_vals[nd]]
        upstream = set()
        while todo:
            w = todo.pop()
            if w not in upstream:
                upstream.add(w)
                if (nd := g.val_node[w]) >= 0:
                    todo.extend(g.node_vals[nd])
        g.merged = (loss, batches, upstream)
    return upstream


def _compiles_first(launch) -> bool:
    """Whether a backward ``launch`` (``Engine._backward_launch``'s) runs a whole-batch
    kernel that has never run: one to compile side by side before launching."""
    return launch is not None and launch[0] is not None and is_new(launch[0].fn)


def _add_arguments(packet: list, g, sig, modes, all_rows, B: int, nodes) -> None:
    """Append a batch's value-argument rows (B per gathered argument, padded with the first
    lane's; one if uniform) and its int arguments (B each) to its packet."""
    n = len(nodes)
    for m, rows in zip(modes, all_rows):
        if m == GATHER:
            packet += rows
            packet += [rows[0]] * (B - n)
        else:
            packet.append(rows[0])
    if sig.n_ints:  # a column per int argument position
        ints = list(map(g.node_ints.__getitem__, nodes))
        for k in range(sig.n_ints):
            xs = list(map(itemgetter(k), ints))
            packet += xs
            packet += [xs[0]] * (B - n)


@contextmanager
def _noting_backward(batch):
    """An error in the backward pass of ``batch`` notes the batch."""
    try:
        yield
    except Exception as e:
        sig, nodes = batch[0], batch[4]
        e.add_note(f"dynax: while running the backward pass of a batch of {len(nodes)} "
                   f"'{sig.op.name}' node(s) (the first built as node {nodes[0]})")
        raise


def _joined_flags(run: list, step: tuple) -> tuple:
    """``step``, and the prepared batches of ``run`` in place, with the union of their
    gradient flags where they are steps of one sequence (``OpDef.sequence_step``) that
    differ in those flags only; else ``step`` as it was.

    A sequence's first step reads its initial state, a constant that needs no gradient, so
    its flags differ from the later steps': it ran a kernel of its own (forward and
    backward, compiled per size) and a launch of its own every pass (the tagger: its
    64-lane first step, 2 of the first update's 59 compilations). In the run, the initial
    state's cotangent is computed and not read, as a cheap op's are (``_grad_flags``)."""
    first = run[0]
    if not (step[0].op.sequence_step and step[:3] == first[:3]) or \
            step[3] is None or first[3] is None:
        return step
    flags = tuple(a or b for a, b in zip(step[3], first[3]))
    if flags != first[3]:
        run[:] = [(*r[:3], flags, *r[4:]) for r in run]
    return (*step[:3], flags, *step[4:])


def _chain_step(g, step) -> bool:
    """Whether a lone prepared batch continues a sequence within this forward pass: its op
    is an RNN's step (``OpDef.sequence_step``) and its first node reads a state made by a
    node of its own signature that this pass computes (``g.computed`` moves on at its end).

    Such a batch launches the run kernel of its size (``_launches``), which the longer
    runs of its sequences use, instead of a single kernel of its own. Not where the state
    came from an earlier pass (a decoder stepped one ``dx.forward`` at a time): each
    launch holds a residual buffer set with room for a whole run (``scratch.py``), and one
    step per pass would hold a set per step."""
    sig = step[0]
    if not (LONE_CHAIN_RUNS and FUSE_RUNS and sig.op.sequence_step) or step[6] or \
            g.autobatch == "none" or g.check_validity:  # step[6]: its distinct lanes only
        return False
    sigs, val_node, first = g.node_sig, g.val_node, g.computed
    for v in g.node_vals[step[5][0]]:
        n = val_node[v]
        if n >= first and sigs[n] is sig:
            return True
    return False


def _run_capacity(sig, modes: tuple, B: int, n: int) -> int:
    """The room, in steps, of the run kernel that launches a run of ``n`` steps of ``B``
    lanes: one per signature and size, ``RUN_LANE_STEPS / B`` steps, fewer where the
    steps' values would pass ``RUN_VALUE_ELEMENTS`` (a power of two from ``RUN_MIN_STEPS``
    to ``RUN_MAX_STEPS``); a longer run launches it more than once. Its residual buffers
    are pooled (``scratch.py``), so room costs memory (residuals are a few times a lane's
    values: the tagger's BiLSTM step saves 1.6x), not time. Training and evaluation find
    the same room, so an evaluation reuses the trained kernel.

    A narrow run that takes its weight gradients after the loop (``kernels.defers``) gets
    room for the next power of two of its steps instead: that product spans every step
    the kernel has room for, its padding ones included.

    Room for the next power of two of every run's steps, as before, made each size a
    kernel per power of two its runs reached: the tagger's 64-lane steps ran in runs of 7
    to 10 (kernels of 8 and 16 steps), its 48-lane ones of 4 to 6 (4 and 8)."""
    if defers(sig, modes, B):
        return max(RUN_MIN_STEPS, _pow2(n))
    room = min(RUN_LANE_STEPS // B, RUN_VALUE_ELEMENTS // (B * sig.value_elements))
    room = 1 << max(0, room.bit_length() - 1)  # a power of two, floored
    return min(RUN_MAX_STEPS, max(RUN_MIN_STEPS, room))


def _packet(chunk: list, T: int = 0) -> np.ndarray:
    """The int packet of a launch of prepared batches: one batch's, or for a run kernel of
    capacity ``T`` theirs stacked, padded to ``T`` with copies of the last one that have no
    lanes (its rows are real ones: a padding step's inputs are finite values, which the
    deferred weight gradients read, with zero cotangents)."""
    if not T:
        return np.asarray(chunk[0][4], np.int32)
    rows = [r[4] for r in chunk]
    packets = np.asarray(rows + rows[-1:] * (T - len(rows)), np.int32)
    packets[len(rows):, 0] = 0
    return packets


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def _undo_launch(g, sig, mark: int, n_batches: int, n_launches: int) -> None:
    """Forget a failed launch: the kernels of ``sig`` this thread made for it (one may be
    what failed to trace or compile, and later graphs would reuse it: an evaluation reuses
    a training kernel; not those another thread made meanwhile) and the batches it
    recorded."""
    forget_made(sig.kernels, mark)
    del g.batches[n_batches:]
    g.n_launches = n_launches


def _check_backward_possible(g, loss_node: int, live, full: bool) -> None:
    """Refuse, before any kernel runs (so nothing is accumulated), a backward pass through
    batches whose parameters changed after they ran (``set_value``, ``populate``, a trainer
    update: the vjp would mix the old values the forward used with the new ones, and the
    old arrays may be gone, as updates donate them), or through a function JAX cannot
    differentiate (``Signature.values_only``)."""
    for b in g.batches:
        if b.sig.values_only and b.gflags is None and any(_needed(b.nodes, loss_node, live)) \
                and (full or _grad_flags(g, b.sig, b.nodes) is not None):
            raise ValueError(
                f"backward: the loss depends on '{b.sig.op.name}' (a batch of {len(b.nodes)} "
                f"node(s), the first built as node {b.nodes[0]}), which JAX cannot "
                f"differentiate (its training forward failed: {b.sig.values_only}); use its "
                "values for decisions only or, for a callback without a JVP rule, give the "
                "function a jax.custom_jvp")
        changed = [p for p, v in zip(b.sig.params, b.param_values) if p._value is not v]
        if changed and any(_needed(b.nodes, loss_node, live)):
            reason = (f"parameter {changed[0].name} changed (set_value, populate or a trainer "
                      f"update) after this graph computed '{b.sig.op.name}' with it, and the "
                      "loss depends on that")
            raise StaleExpressionError(
                f"backward: {reason}; its gradient would mix the old and the new values. "
                "Call backward() before changing parameters, or build the graph again "
                "(dx.renew_cg())", reason)


def _needed(nodes, loss_node: int, live) -> list:
    """Per node, whether the loss depends on it (``live``: ``_loss_ancestors``'s flags)."""
    return [nd <= loss_node and (live is None or live[nd]) for nd in nodes]


def _waiting(pending) -> bool:
    """Whether reading ``pending`` would wait for the device."""
    return not pending.is_ready()


def _ancestors_while_waiting(g, v: int) -> None:
    """Find the loss ancestors of a scalar while the host waits for its value anyway.

    A training loop reads its loss, then calls ``backward()``: ``_loss_ancestors`` (~2.4
    ms for a 64-tree Tree-LSTM graph on a 2-core CPU) then ran while the device sat idle
    between the forward and the backward kernels. Done at most once per graph (a decoder
    reading a score per step would otherwise pay it per read, growing with the graph), and
    only where the last ``backward()`` was of a value read first (an inference loop, which
    never calls it, paid 2.6 ms per Tree-LSTM graph: its wait was shorter than the search);
    nodes up to a computed one never change, so the answer stays right."""
    node = g.val_node[v]
    if node >= 0 and not AKEY_AVAL[g.val_akey[v]].shape:
        g.loss_live = (node, _loss_ancestors(g, node))


def _loss_ancestors(g, loss_node: int):
    """Which nodes the loss depends on: None when every node up to ``loss_node`` does (the
    common case, told apart with a few array operations), else a list of flags over the
    nodes ``0 .. loss_node``.

    Backward must not run the others: their cotangent is zero, but zero times an infinite
    local derivative is NaN (``log`` of a probability that underflowed, in a decoding step
    built before the loss), and it would reach the parameters, where ``jax.grad`` of the
    loss never looks at such a node. Reference counting finds them: a node none of whose
    outputs a node up to the loss reads is dead, and so is one read only by dead nodes.
    A read by a node that stops gradients (``nobackprop``, ``const_lookup``) does not
    count: what only such nodes read gets no gradient, as under ``jax.lax.stop_gradient``
    (and a table row read that way is not one an update uses).
    """
    node_vals, val_node, node_out = g.node_vals[:loss_node + 1], g.val_node, g.node_out
    sigs = g.node_sig
    reads = np.bincount(np.fromiter(chain.from_iterable(node_vals), np.intp),
                        minlength=node_out[loss_node])  # per value, by nodes up to the loss
    stops = {nd for nd in g.stop_nodes if nd <= loss_node}
    for nd in stops:
        for v in node_vals[nd]:
            reads[v] -= 1

    def unread(nd):  # none of its outputs (consecutive values), one of which is known unread
        n_out = len(sigs[nd].out_akeys)
        return n_out == 1 or not any(reads[node_out[nd]:node_out[nd] + n_out])

    dead = [nd for nd in (val_node[v] for v in
                          np.flatnonzero(reads[:node_out[loss_node]] == 0).tolist())
            if nd >= 0 and unread(nd)]
    if not dead:
        return None
    dead = list(dict.fromkeys(dead))  # a node with several unread outputs: once
    reads = reads.tolist()
    live = [True] * (loss_node + 1)
    for nd in dead:
        live[nd] = False
    while dead:
        nd = dead.pop()
        if nd in stops:  # its reads are not counted (above)
            continue
        for v in node_vals[nd]:
            reads[v] -= 1
            p = val_node[v]
            if reads[v] == 0 and p >= 0 and live[p] and unread(p):
                live[p] = False
                dead.append(p)
    return live


def _params_of(batches):
    """Every parameter the batches use, once each."""
    return {id(p): p for b in batches for p in b[0].params}.values()


def _gradient_snapshot(batches) -> list:
    """Copies of the gradient state of every parameter the batches use (validity mode: a
    failed check must leave the gradients as they were)."""
    params = _params_of(batches)
    snapshot = []
    for p in params:
        grad = None if p._grad is None else jnp.array(p._grad, copy=True)  # buffers are donated
        rows = getattr(p, "touched", None)  # a table's used rows (None: all of them)
        snapshot.append((p, grad, p._has_grad, None if rows is None else set(rows)))
    return snapshot


def _forget_lost_gradients(batches) -> None:
    """After a backward kernel failed while running: a gradient buffer it was given
    (donated) is deleted, and would fail every later read and update; that parameter's
    gradient is dropped instead (the others keep what they accumulated)."""
    for p in _params_of(batches):
        if p._grad is not None and p._grad.is_deleted():
            p.zero_grad()


def _restore_gradients(snapshot) -> None:
    for p, grad, has_grad, rows in snapshot:
        p._grad, p._has_grad = grad, has_grad
        if hasattr(p, "touched"):
            p.touched = rows
