"""The lazy computation graph: flat lists of nodes and values, nothing computed on construction.

A *node* is one op application (one signature, one kernel lane when batched). A *value* is
one output array of a node, or a constant given by ``dx.input``; an ``Expression`` is a thin
handle ``(graph, value id)``. Nodes and values live in parallel Python lists indexed by id,
because building the graph is on the hot path of every training step.
"""
from __future__ import annotations

import contextlib
import functools
import math
import operator
import threading
import time

import numpy as np

from ..errors import (ArgumentTypeError, IndexOutOfRangeError, InvalidArgumentError,
                      StaleExpressionError)
from ..ops.registry import (AKEY_AVAL, INDEX_LIMIT, akey_of, describe,
                            signature_for, static_type)
from ..sites import user_site

_FLOAT = np.dtype(np.float32)
_SCALAR = akey_of((), _FLOAT)  # the arena of 0-d float32 values

STRATEGIES = ("agenda", "depth", "none")


class _ThreadState(threading.local):
    """Per-thread state, each None until set: the current graph (``renew_cg``; None again
    after ``retire_current_graph``), the engine, and the graph counting compilations."""

    cg = None
    engine = None
    counting = None


_local = _ThreadState()
_seed_counter = [0]


def _counting_compiles(method):
    """While ``method`` of a graph runs, the compilations on this thread count as the
    graph's (``stats()["compiles"]``)."""
    @functools.wraps(method)
    def wrapper(self, *args):
        prev = _local.counting
        _local.counting = self
        try:
            return method(self, *args)
        finally:
            _local.counting = prev
    return wrapper


def counted_here(fn):
    """``fn`` made to count the compilations it runs, on whatever thread, as the graph
    counting on this thread now does (a compilation handed to another thread)."""
    g = _local.counting

    def counted():
        prev = _local.counting
        _local.counting = g
        try:
            return fn()
        finally:
            _local.counting = prev
    return counted


# what retire() empties: all of a graph's per-node and per-value lists but val_akey
_PER_NODE_LISTS = ("node_sig", "node_vals", "node_ints", "node_depth", "node_out", "stop_nodes",
                   "val_node", "val_rg", "val_depth", "val_row")


class ComputationGraph:
    """One per-instance graph, current for the thread that made it with ``dx.renew_cg``."""

    def __init__(self, autobatch: str = "agenda", train: bool = True, seed: int | None = None,
                 check_validity: bool = False, immediate_compute: bool = False):
        if autobatch not in STRATEGIES:
            raise ValueError(f"renew_cg: autobatch must be one of {STRATEGIES}, got {autobatch!r}")
        for name, flag in (("train", train), ("check_validity", check_validity),
                           ("immediate_compute", immediate_compute)):
            if not isinstance(flag, (bool, np.bool_)):
                raise ValueError(f"renew_cg: {name} must be True or False, got {flag!r}")
        if seed is not None and (isinstance(seed, (bool, np.bool_))
                                 or not isinstance(seed, (int, np.integer))
                                 or not 0 <= seed < 2 ** 31):
            raise ValueError(f"renew_cg: seed must be an int in [0, 2**31), got {seed!r}")
        self.autobatch = autobatch
        self.train = bool(train)
        self.check_validity = bool(check_validity)
        self.immediate_compute = bool(immediate_compute)
        # nodes take the checked path of add_node (appenders.append_node) in either mode
        self.checked_path = self.check_validity or self.immediate_compute
        self.constructing = 0  # depth of composite constructions under way (ops.atomic)
        if seed is None:
            _seed_counter[0] += 1
            seed = _seed_counter[0]
        self.seed = int(seed) & 0x7FFFFFFF
        self.alive = True
        self.retired_because = ""  # set by retire()
        self.failed: str | None = None  # why the graph stopped, if a batch failed to run
        # nodes
        self.node_sig: list = []  # Signature of each node
        self.node_vals: list = []  # value ids of its 'v' arguments
        self.node_ints: list = []  # its 'i' arguments (tuple, or None)
        self.node_depth: list = []  # 1 + max depth of producers; nodes on constants have 1
        self.node_out: list = []  # id of its first output value (outputs are consecutive)
        self.stop_nodes: list = []  # nodes of ops that stop gradients (OpDef.stops_gradient)
        # values
        self.val_node: list = []  # producing node, or -1 for a constant
        self.val_akey: list = []  # interned (shape, dtype)
        self.val_rg: list = []  # whether a gradient can flow into it (a parameter is upstream)
        self.val_depth: list = []  # depth of its producer, 0 for a constant
        self.val_row: list = []  # arena row once computed (extended lazily by the executor)
        self.pending_consts: list = []  # (value id, host array) not yet in an arena
        self.same: dict = {}  # value id -> an earlier value known equal (executor/repeats.py)
        # (loss value, batches, values upstream of them or None) of the last backward pass,
        # where it merged the cotangents of repeated lanes: those values' own cotangents
        # were not kept (Engine.gradient)
        self.merged = None
        self.node_site: dict = {}  # node -> user file:line (check_validity mode only)
        self.values_at_backward = 0  # values built before the last backward pass
        self.full_backward = False  # whether that pass kept every value's gradient
        self.zero_consts: dict = {}  # akey -> value id of a zero constant (list padding)
        self.scalar_consts: dict = {}  # number -> value id of its 0-d constant (operands)
        self.frozen_params: dict = {}  # parameter -> value id of its no-gradient copy
        # execution state
        self.rows: dict = {}  # akey -> arena rows handed out so far
        self.host_values: dict = {}  # value id -> host copy, fetched in batches (dx.forward)
        self.pending_reads: dict = {}  # value id -> its queued one-row gather (device array)
        self.loss_live = None  # (node, _loss_ancestors) found while a read waited, at most once
        self.litter: tuple = ()  # the replaced graph's node lists, dropped while a read waits
        self.early = None  # a backward pass run while its loss was read (executor/early.py)
        self.computed = 0  # nodes [0, computed) have values
        self.batches: list = []  # executed batch records, forward order (for backward)
        self.n_batches = 0
        self.forward_passes = 0  # forward passes that computed nodes
        self.n_backward_batches = 0  # batches whose backward kernel ran (Engine._backward_plan)
        self.n_launches = 0  # forward kernel launches (a fused run of batches is one)
        self.n_plans_reused = 0  # forwards whose plan came from the executor's plan cache
        self.n_replayed = 0  # ... whose batches were prepared as last time (executor/replay.py)
        self.n_repeated_lanes = 0  # lanes run once for the lanes repeating them (repeats.py)
        self.executables = 0  # backend compilations this graph's work caused, loads included
        self.cache_loads = 0  # ... of which loaded from the persistent compilation cache
        self.seconds = {"build": 0.0, "schedule": 0.0, "forward": 0.0, "backward": 0.0}
        self._mark = time.perf_counter()
        self.engine = _engine()

    # ---- construction ------------------------------------------------------------------

    def add_constant(self, array: np.ndarray, akey: int) -> int:
        """A constant value (no node; loaded into its arena with the next forward pass)."""
        v = len(self.val_node)
        self.val_node.append(-1)
        self.val_akey.append(akey)
        self.val_rg.append(False)
        self.val_depth.append(0)
        self.pending_consts.append((v, array))
        return v

    def zero_constant(self, akey: int) -> int:
        """A shared zero value of the given shape (pads lists to a bucketed length)."""
        v = self.zero_consts.get(akey)
        if v is None:
            a = AKEY_AVAL[akey]
            v = self.zero_consts[akey] = self.add_constant(np.zeros(a.shape, a.dtype), akey)
        return v

    def scalar_constant(self, x: float, dtype=_FLOAT) -> int:
        """A 0-d constant of ``dtype`` for a number operand of ``+ - * /``, shared within
        the graph.

        Data, not part of the signature: ``e * w`` for many values of ``w`` is one batch and
        one kernel (as a static operand it was a batch and a compilation per value)."""
        key = (x, math.copysign(1.0, x), dtype)  # 0.0 and -0.0 differ in what they add
        v = self.scalar_consts.get(key)
        if v is None:
            akey = _SCALAR if dtype == _FLOAT else akey_of((), dtype)
            v = self.scalar_consts[key] = self.add_constant(np.asarray(x, dtype), akey)
        return v

    def add_node(self, op, kinds: str, args):
        """Append one node applying ``op`` to ``args`` (one per char of ``kinds``).

        Returns (id of its first output value, its Signature). Raises, and changes nothing,
        on bad input. The general path: ``appenders.append_node`` runs the common case
        faster and defers to this one for anything it does not handle.
        """
        val_akey = self.val_akey
        key = [op, kinds]
        vals = []
        ints = None
        stypes = None
        for k, a in zip(kinds, args):
            if k == "v":
                if a.g is not self:
                    _stale(a, op.name)
                v = a.v
                key.append(val_akey[v])
                vals.append(v)
            elif k == "i":
                if ints is None:
                    ints = []
                ints.append(a)
                key.append(None)
            else:  # 'p' (the Parameter itself) or 's' (the static value)
                key.append(a)
                if k == "s":
                    stypes = (stypes or ()) + (static_type(a),)
        if stypes is not None:
            key.append(stypes)
        key = tuple(key)
        sig = signature_for(key)
        if ints is not None:
            ints = self._check_ints(sig, ints, kinds, key[2:])
        val_node, val_depth, val_rg = self.val_node, self.val_depth, self.val_rg
        depth = 0
        rg = sig.has_params
        for v in vals:
            if val_depth[v] > depth:
                depth = val_depth[v]
            if val_rg[v]:
                rg = True
        depth += 1
        n = len(self.node_sig)
        if self.check_validity:
            self.node_site[n] = user_site()
        if sig.op.stops_gradient:
            self.stop_nodes.append(n)
        self.node_sig.append(sig)
        self.node_vals.append(tuple(vals))
        self.node_ints.append(ints)
        self.node_depth.append(depth)
        out = len(val_node)
        self.node_out.append(out)
        outs = sig.out_akeys
        if len(outs) == 1:
            val_node.append(n)
            val_akey.append(outs[0])
            val_rg.append(rg)
            val_depth.append(depth)
        else:
            val_node.extend([n] * len(outs))
            val_akey.extend(outs)
            val_rg.extend([rg] * len(outs))
            val_depth.extend([depth] * len(outs))
        return out, sig

    # ---- all-or-nothing construction -----------------------------------------------------

    def mark(self) -> tuple:
        """A point to roll back to if a composite construction fails."""
        return len(self.node_sig), len(self.val_node), len(self.pending_consts)

    def rollback(self, mark: tuple) -> None:
        """Forget every node, value and constant added since ``mark`` (a failed call).

        If a forward pass ran since (a value read inside the call: a generator given to
        ``esum`` that reads scores to decide), what it computed stays: those nodes have rows
        and batches, and the pass took the pending constants. Only what came after goes."""
        n, v, c = mark
        if len(self.val_row) > v:  # the executor extends val_row to every value it computes
            n, v, c = self.computed, len(self.val_row), 0
        for lst in (self.node_sig, self.node_vals, self.node_ints, self.node_depth,
                    self.node_out):
            del lst[n:]
        for lst in (self.val_node, self.val_akey, self.val_rg, self.val_depth):
            del lst[v:]
        del self.val_row[v:]
        del self.pending_consts[c:]
        self.zero_consts = {a: z for a, z in self.zero_consts.items() if z < v}
        self.scalar_consts = {x: z for x, z in self.scalar_consts.items() if z < v}
        self.frozen_params = {p: z for p, z in self.frozen_params.items() if z < v}
        for k in [k for k in self.node_site if k >= n]:
            del self.node_site[k]
        if self.stop_nodes:
            self.stop_nodes = [s for s in self.stop_nodes if s < n]

    def _check_ints(self, sig, ints, kinds, key):
        if len(ints) == 1:  # fast path: one plain in-range int (a lookup, a pick, a label)
            x = ints[0]
            if type(x) is int and 0 <= x < sig.bounds[0]:
                return (x,)
        checked = []
        for i, (x, hi) in enumerate(zip(ints, sig.bounds)):
            try:
                x = as_index(x)
            except TypeError:  # a TypeError, as Python's own indexing with a float
                many = isinstance(ints[i], (list, tuple, slice, np.ndarray))
                raise ArgumentTypeError(
                    f"{sig.op.name}: index must be an integer, got {ints[i]!r} "
                    f"(arguments: {describe(kinds, tuple(key))})"
                    + ("; there is no batch of indices (DyNet's lookup_batch): build one "
                       "node per instance and the autobatcher batches them" if many else ""))
            if not 0 <= x < hi:
                if sig.op.index_bounds is None and hi < INDEX_LIMIT:  # what it indexes
                    raise IndexOutOfRangeError(
                        f"{sig.op.name}: index {x} (int argument {i + 1} of "
                        f"{len(sig.bounds)}) out of range [0, {hi}), what the function "
                        f"indexes with it (arguments: {describe(kinds, tuple(key))}); "
                        "JAX would clamp it there")
                if sig.op.index_bounds is None:  # a dx.function's integer data
                    raise IndexOutOfRangeError(
                        f"{sig.op.name}: int argument {x} is outside [0, 2**31 - 1), the "
                        f"range of a dx.function's per-instance ints (arguments: "
                        f"{describe(kinds, tuple(key))}). What they index inside the "
                        "function is checked where they are an index as they are (x[i]), "
                        "not after arithmetic (JAX clamps an index past the end)")
                raise IndexOutOfRangeError(
                    f"{sig.op.name}: index {x} out of range [0, {hi}) "
                    f"(arguments: {describe(kinds, tuple(key))})")
            checked.append(x)
        return tuple(checked)

    # ---- computation -------------------------------------------------------------------

    def retire(self, reason: str = "replaced by dx.renew_cg()") -> tuple:
        """Replaced by a new graph (or its values dropped by ``dx.release_memory()``): its
        expressions raise from now on, so what only they could use (the batches' saved
        residuals, host copies of values) is let go, also while the user still holds them
        (a list of losses instead of their values).

        Returns the per-node lists it empties, for the caller to drop when it likes:
        freeing their ~10 objects per node costs a 4k-node tagger graph ~0.7 ms, which
        ``renew_cg`` moves to where the next graph's host waits for the device anyway."""
        self.alive = False
        self.retired_because = reason
        if self.early is not None:  # never claimed: as far as stats go, it did not run
            self.n_backward_batches = self.early.n_backward_batches
            self.early = None
        from ..executor.scratch import give_back  # (the executor imports this module)
        give_back(self.batches)  # the runs' residual buffers, for the next graph's launches
        self.batches = []
        self.host_values = {}
        self.pending_reads = {}
        self.pending_consts = []
        self.loss_live = None  # its flags go too (a retired graph is read no more)
        # A stale expression still answers its shape and dtype (val_akey), and stats() its
        # counts; the rest of the graph's per-node lists (~170 bytes a value) go.
        self.retired_sizes = (len(self.node_sig), len(self.val_node))
        dropped = tuple(getattr(self, name) for name in _PER_NODE_LISTS)
        for name in _PER_NODE_LISTS:
            setattr(self, name, [])
        self.node_site, self.frozen_params, self.rows, self.same = {}, {}, {}, {}
        self.merged = None
        self.zero_consts, self.scalar_consts = {}, {}
        self.litter = ()  # its predecessor's, if no read waited to drop them
        return dropped

    def check_alive(self, what: str = "expression"):
        """Raise ``StaleExpressionError`` if ``dx.renew_cg`` has replaced this graph."""
        if not self.alive:
            raise StaleExpressionError(
                f"{what} belongs to a computation graph {self.retired_because}; "
                "build expressions again on the current graph")

    @_counting_compiles
    def forward_to(self, value_id: int | None = None):
        """Compute every pending node (incremental forward)."""
        self.check_alive()
        if self.failed is not None:
            raise RuntimeError(f"this graph can compute nothing more: {self.failed}; values "
                               "read before that still read; build a new graph with "
                               "dx.renew_cg()")
        if self.computed == len(self.node_sig) and not self.pending_consts:
            return
        now = time.perf_counter()
        self.seconds["build"] += now - self._mark
        self.engine.forward(self)
        self._mark = time.perf_counter()

    @_counting_compiles
    def backward(self, value_id: int, full: bool = False):
        """Accumulate d(value)/d(parameter) into every parameter it depends on; with
        ``full``, keep the gradient of every value as well (``Expression.backward`` checks
        first that the value has one element)."""
        self.check_alive()
        self.forward_to(value_id)
        t = time.perf_counter()
        self.full_backward = False  # until this pass has run
        self.engine.backward(self, value_id, full)
        self.full_backward = full
        self.values_at_backward = len(self.val_node)  # later values have no gradient
        end = time.perf_counter()
        self.seconds["backward"] += end - t
        self._mark = end

    def gradient(self, value_id: int) -> np.ndarray:
        """The gradient of the last ``backward()`` of this graph with respect to a value."""
        self.check_alive()
        if not (self.val_rg[value_id] or self.full_backward):
            raise InvalidArgumentError(
                "gradient: this expression depends on no parameter, so backward() computes "
                "no gradient for it; call backward(full=True) to have the gradient of every "
                "expression, inputs included")
        if value_id >= self.values_at_backward > 0:
            raise InvalidArgumentError("gradient: this expression was built after the last "
                                       "backward(), which computed no gradient for it")
        grad = self.engine.gradient(self, value_id)
        if grad is None:
            raise InvalidArgumentError(
                "gradient: no gradient of this graph is kept: call backward() first (a "
                "backward pass that failed, or of a constant, keeps none). The gradients of "
                "a backward pass are kept until the next one, of any graph")
        return grad

    def read(self, value_id: int) -> np.ndarray:
        """A value on the host (computed first if pending)."""
        self.check_alive()
        if value_id in self.host_values:  # already on the host (even if the graph failed since)
            return self.host_values[value_id]
        return self._read_device(value_id)

    @_counting_compiles
    def _read_device(self, value_id: int) -> np.ndarray:
        self.forward_to(value_id)
        return self.engine.read(self, value_id)

    @_counting_compiles
    def fetch(self, value_ids) -> None:
        """Compute, then copy the given values to the host together (one gather per shape),
        so that reading each of them afterwards costs no device round trip."""
        if value_ids:
            self.forward_to(max(value_ids))
            self.engine.fetch(self, value_ids)

    def stats(self) -> dict:
        """Counters of this graph: nodes, batches (groups of nodes run as one), launches
        (forward kernel launches: consecutive batches of one kernel run as one loop),
        compiles (new XLA compilations caused by this graph: its forward and backward passes
        and reads, and the trainer updates made while it is the thread's current graph; not
        the user's own ``jax.jit`` calls, nor other threads' work), cache_loads (compiled
        kernels loaded from ``dx.set_compilation_cache``'s directory instead), plans reused
        (forward passes that reused a cached plan) and plans_replayed (of those, the passes
        that replayed the rows and packets prepared the last time the plan ran),
        backward_batches (the batches whose backward kernel ran: of the forward's, or of a
        new plan where the forward ran in many narrow passes, ``Engine._backward_plan``;
        batches no loss depends on are skipped), repeated_lanes (nodes whose computation
        repeated another's in their batch, computed once for them all:
        ``executor/repeats.py``) and seconds per phase."""
        nodes, values = ((len(self.node_sig), len(self.val_node)) if self.alive
                         else self.retired_sizes)
        return {"nodes": nodes, "values": values,
                "batches": self.n_batches, "compiles": self.executables - self.cache_loads,
                "cache_loads": self.cache_loads,
                "launches": self.n_launches, "plans_reused": self.n_plans_reused,
                "plans_replayed": self.n_replayed,
                "backward_batches": self.n_backward_batches,
                "repeated_lanes": self.n_repeated_lanes,
                "seconds": dict(self.seconds)}


@contextlib.contextmanager
def compiles_count_for_current_graph():
    """Compilations in the block count as the thread's current graph's (a trainer's
    update: its step compiles once per parameter layout)."""
    prev = _local.counting
    _local.counting = _local.cg
    try:
        yield
    finally:
        _local.counting = prev


def _stale(expr, opname):
    from .expression import Expression
    if not isinstance(expr, Expression):
        raise ArgumentTypeError(f"{opname}: expected an Expression, got {type(expr).__name__}")
    if expr.g.alive:  # graphs are per thread: another thread's current graph
        raise ArgumentTypeError(
            f"{opname}: an argument belongs to another thread's computation graph; "
            "expressions are used on the thread that built them")
    raise StaleExpressionError(
        f"{opname}: an argument belongs to a computation graph {expr.g.retired_because}; "
        "build expressions again on the current graph")


# ---- the current graph (one per thread) ----------------------------------------------------

def as_index(x) -> int:
    """``x`` as an int index (a Python or NumPy integer, a 0-d integer array); TypeError
    for anything else, bools included (an int to Python, never an index here)."""
    if isinstance(x, (bool, np.bool_)):
        raise TypeError
    return operator.index(x)


def renew_cg(autobatch: str = "agenda", train: bool = True, seed: int | None = None,
             check_validity: bool = False, immediate_compute: bool = False) -> ComputationGraph:
    """Start a fresh computation graph and make it current for this thread.

    Args:
      autobatch: ``"agenda"`` (default), ``"depth"`` or ``"none"`` (node by node, the reference).
      train: when False, ``dx.dropout`` is the identity.
      seed: seed of the graph's random numbers (``dropout`` and its variants, ``noise``,
        ``random_*``); a new one per graph if None. Every strategy draws the same numbers.
      check_validity: raise at the first non-finite value computed, forward or backward
        (values and gradients), naming the op and the user's line that built it.
      immediate_compute: compute each operation's value when it is built (DyNet's; for
        debugging: an error is raised by the call that caused it, with check_validity a
        non-finite value too), node by node instead of batched.
    """
    cg = ComputationGraph(autobatch, train, seed, check_validity,
                          immediate_compute)  # checks: raises first
    old = _local.cg
    if old is not None:
        cg.litter = old.retire()  # freed by the new graph's first read that waits
    _local.cg = cg
    return cg


def retire_current_graph(reason: str) -> None:
    """End this thread's current graph, if it has values (``dx.release_memory()`` drops
    the arenas that hold them); the next operation starts a new one. The lists of the
    graph it replaced, if still held, go too."""
    cg = _local.cg
    if cg is not None:
        cg.litter = ()  # its predecessor's lists
        if cg.val_node:
            cg.retire(reason)
            _local.cg = None


def current_graph() -> ComputationGraph:
    """The thread's current graph (one is created on first use)."""
    cg = _local.cg
    if cg is None:
        cg = renew_cg()
    return cg


def _engine():
    eng = _local.engine
    if eng is None:
        from ..executor.engine import Engine
        eng = _local.engine = Engine()
    return eng


# ---- compile counting: every XLA backend compilation, process-wide and per graph -------------
# JAX reports a backend compile event for each executable it needs, loaded from its
# persistent cache (``dx.set_compilation_cache``) or compiled; loads are counted apart.

_counts = {"executables": 0, "cache_loads": 0}  # executables = compiled + loaded
_lock = threading.Lock()


def _on_duration(name, *args, **kwargs):
    if name == "/jax/core/compile/backend_compile_duration":
        with _lock:
            _counts["executables"] += 1
        g = _local.counting  # JAX compiles on the thread that asks
        if g is not None:
            g.executables += 1


def _on_event(name, *args, **kwargs):
    if name == "/jax/compilation_cache/cache_hits":
        with _lock:
            _counts["cache_loads"] += 1
        g = _local.counting
        if g is not None:
            g.cache_loads += 1


def _compile_count() -> int:
    """New XLA compilations so far in this process."""
    with _lock:
        return _counts["executables"] - _counts["cache_loads"]


def _install_listener():
    import jax.monitoring
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


_install_listener()
