"""Batched kernels: one jitted, vmapped XLA computation per (signature, input modes, bucket).

A kernel reads its per-instance inputs straight out of the value *arenas* (one device buffer
per (shape, dtype), nodes addressed by row), applies the op's single-instance function under
``vmap``, and writes its outputs as one contiguous block of rows. The arenas it writes are
donated, so the update is in place. Everything a batch needs from the host — its size, row
offsets or row lists, integer data such as labels — travels in ONE int32 *packet*:

    [n, out_start_0, ..., (per value arg: B rows | 1 row), (per int arg: B ints)]

(A backward pass that plans the graph again, ``Engine._backward_plan``, reads output
cotangents of nodes computed in different forward batches: its packets have B rows per
output instead of a start, ``gathered_outs``. A batch whose repeated lanes run once,
``repeats.py``, has its D distinct lanes' arguments, padded to ``distinct``, and ends with
``[D, B expansion entries]``: the distinct lane of each lane.)

Batches are padded to a size B from a short ladder (``buckets.py``), so the kernel cache key
is (modes, B) per signature and compilations stay bounded however the data varies. Padded
lanes compute a copy of lane 0 (finite, real data); their outputs land in rows not yet
allocated, and in the backward pass their cotangents are masked to zero, so they never reach
any gradient.
"""
from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..device import get_device
from ..ops.registry import reads_part
from . import eviction
from .ahead import is_new
from .dots import materialised_transposes

GATHER, UNIFORM = 1, 2  # how a value argument is read: a list of B rows, or one row for all


class Kernel(NamedTuple):
    fn: Callable
    write_akeys: tuple  # arenas donated and returned (forward: outputs; backward: gradients)
    read_akeys: tuple  # arenas only read
    meta: dict  # forward kernels saving residuals: their vjp's pytree structure
    body: Callable  # fn unjitted: a run's loop calls it (a nested jit takes no compiler options)
    step: "Kernel | None" = None  # a forward run kernel's: the single kernel it loops


QUICK_MAX_WORK = 1 << 13  # padded lanes x a lane's work (elements), at most, for a kernel
# that XLA:CPU compiles without LLVM's optimisations (see _jit)
QUICK_OPTIONS = {"xla_backend_optimization_level": 0}


def _jit(fn, name: str, donate: tuple, work: int, accumulates: bool = False,
         one_thread: bool = False):
    """``jax.jit`` of a kernel, named so that JAX's compile log (``jax_log_compiles``) and
    profiler traces say which op, pass and batch size each compilation is for.

    On CPU a kernel of at most ``QUICK_MAX_WORK`` elements of ``work`` (padded lanes times a
    lane's work) compiles without LLVM's optimisations: in half the time or less (40-80 ms
    saved a kernel), and it runs as fast, its time being the launch's and the thunks'
    (measured from 640 to 16k elements: within 10 us; at 64k, 2-5x slower). Such kernels are
    most of those of models whose list lengths follow the data: 95% of a GAT's.
    A kernel that ``accumulates`` matmuls into buffers gets ``accumulating_dots()``; one
    whose products are small steps of a loop (``one_thread``), ``one_thread_dots()``.
    """
    fn.__name__ = fn.__qualname__ = name
    eviction.new_kernel()
    options = {}
    if get_device().platform == "cpu":
        if work <= QUICK_MAX_WORK:
            options.update(QUICK_OPTIONS)
        if accumulates:
            options.update(accumulating_dots())
        if one_thread:
            options.update(one_thread_dots())
    return jax.jit(fn, donate_argnums=donate, compiler_options=options or None)


@functools.cache
def accumulating_dots() -> dict:
    """XLA:CPU options under which a matmul whose product is added to a buffer
    (``g + x^T dy``) runs as one YNNPACK call accumulating into that buffer, where by
    default the product goes to a temporary that a second kernel adds: the weight-gradient
    step of a run's backward loop (``backward_run_kernel``, where its steps are larger than
    ``SMALL_STEP_MAX_WORK``). ``{}`` where this jaxlib does
    not know the option (it is experimental). Measured, one process, alternated in both
    orders: tagger -2 to -6% per update; RNN LM batch 64 -1 to -2%; in every kernel it cost
    the Tree-LSTM 1-4% (it moves other products to YNNPACK), and in a narrow run's
    after-loop product (no buffer to add to) the RNN LM batch 1 3-5%.
    """
    return _if_known({"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"})


def _if_known(options: dict) -> dict:
    """``options`` if this jaxlib's XLA:CPU compiles a product under them, else ``{}`` (an
    older or newer jaxlib without an option or its value)."""
    try:
        x = jax.device_put(jnp.zeros((2, 2)), jax.devices("cpu")[0])  # whatever the default is
        jax.jit(lambda x: x @ x, compiler_options=options).lower(x).compile()
    except Exception:
        return {}
    return options


SMALL_STEP_MAX_WORK = 300_000  # a backward run's step of at most this lane_work: one_thread_dots


@functools.cache
def one_thread_dots() -> dict:
    """XLA:CPU options under which a kernel's matmuls are XLA's own products on one thread
    (not YNNPACK's, and Eigen's not split across threads): for the backward loops of small
    sequence steps (``backward_run_kernel``, steps of at most ``SMALL_STEP_MAX_WORK``),
    whose products are too small to gain from a second thread. ``{}`` where this jaxlib
    does not know the options.

    Measured (session 66; separate processes alternated in both orders, 16 updates x 3
    rounds each, against the code before), ms per update: BiLSTM tagger (steps of 263,168
    parameter elements) -12% and parser (160,800) 0 to -8% with the backward runs so; with the
    forward runs too, the parser was 3-5% slower, the tagger no faster. Every run on one
    thread (forward and backward) cost the RNN LM at 64 sentences (steps of 525,312) 1-2%,
    hence the bound.
    """
    return _if_known({"xla_cpu_multi_thread_eigen": False,
                      "xla_cpu_experimental_ynn_fusion_type": ""})


def _unique(xs):
    out = []
    for x in xs:
        if x not in out:
            out.append(x)
    return tuple(out)


def packet_offsets(sig, modes, B, gathered_outs: bool = False, distinct: int = 0):
    """Packet offsets of each output start (or, ``gathered_outs``, its B rows), value
    argument and int argument. With ``distinct`` lanes (a batch whose repeated lanes run
    once: ``repeats.py``) the arguments have that many lanes, not B."""
    return _offsets(sig, modes, B, gathered_outs, distinct)[:3]


def _offsets(sig, modes, B, gathered_outs: bool = False, distinct: int = 0):
    """``packet_offsets`` and where they end: the offset of a deduplicated batch's
    number of distinct lanes, followed by its expansion (B lane -> distinct lane)."""
    per_out = B if gathered_outs else 1
    lanes = distinct or B
    off = 1
    out_off = list(range(off, off + per_out * len(sig.out_akeys), per_out))
    off += per_out * len(sig.out_akeys)
    val_off = []
    for m in modes:
        val_off.append(off)
        off += lanes if m == GATHER else 1
    int_off = []
    for _ in range(sig.n_ints):
        int_off.append(off)
        off += lanes
    return out_off, val_off, int_off, off


def _expansion(packet, end: int, B: int):
    """A deduplicated batch's distinct lane of each of its B lanes (padding: lane 0)."""
    return packet[end + 1:end + 1 + B]


STACK_LISTS = True  # list ops read their items as one block (see _stacked_list)


def _stacked_list(sig, modes) -> bool:
    """Whether a kernel reads its op's list items (all its value arguments, of one arena,
    each gathered per lane) as ONE block of rows, for the op's ``stacked`` form. Read one
    by one, each item cost XLA:CPU a gather and a piece of the stacking: ~5 ms of
    compilation and ~3 memory maps an item, in the forward kernel and again in the
    backward (a 500-item concatenate: 2.7 + 2.4 s, 3,100 maps; 10,000 items did not
    compile in 3 minutes); a block costs the same whatever the count (session 79)."""
    return (STACK_LISTS and sig.op.stacked is not None and len(modes) > 1
            and sig.kinds.startswith("v" * len(modes)) and "p" not in sig.kinds
            and all(m == GATHER for m in modes) and len(set(sig.in_akeys)) == 1)


READ_PARTS = True  # picks, ranges, row selections read only their part (see _reads_part)


def _reads_part(sig) -> bool:
    """Whether a kernel reads just its op's part of each lane's value, ``x[part]``
    (``OpDef.part``: ``pick``, ``pick_range``, ``select_rows``), straight out of ``x``'s
    arena, ``arena[rows, part]``, and scatter-adds the cotangents back to that part. Read
    whole, ``x`` was gathered into a block of B copies (materialised: the forward's reads
    pass an optimization barrier) and its cotangent was as large: 1,000 picks from two
    1 MB vectors peaked at 2.27 GB (session 79's audit), and now 0.31 GB."""
    return READ_PARTS and reads_part(sig.op, sig.kinds)


def _part_index(sig, rows, ints):
    """The index of the B lanes' parts in the arena, from their ``rows`` and ints."""
    return tuple(sig.op.part(rows, ints, sig.statics))


def _differentiated(sig, modes, gflags) -> list:
    """The value arguments a vjp is taken w.r.t. (those of ``gflags``); for a stacked list
    (``_stacked_list``), its one block if any item needs a gradient."""
    diff = [i for i, f in enumerate(gflags) if f]
    if diff and _stacked_list(sig, modes):
        return [0]
    return diff


def _batched(sig, modes, B):
    """The op's single-instance function, vmapped over lanes; always returns a tuple. A
    stacked list's (``_stacked_list``) takes one value: its block of k x B rows; a part's
    (``_reads_part``), the lanes' parts, which it returns as they are."""
    if _reads_part(sig):
        return lambda vals, params, ints: (vals[0],)
    if _stacked_list(sig, modes):
        k = len(modes)

        def single_stacked(items, params, ints):
            out = sig.op.stacked(items, *sig.assemble((None,) * k, params, ints)[k:])
            return tuple(out) if sig.multi else (out,)

        lanes = jax.vmap(single_stacked, in_axes=(1, None, 0))

        def stacked(vals, params, ints):
            (block,) = vals  # item-major: item j of lane b is row j * B + b
            return lanes(block.reshape((k, B) + block.shape[1:]), params, ints)
        return stacked

    def single(vals, params, ints):
        out = sig.op.fn(*sig.assemble(vals, params, ints))
        return tuple(out) if sig.multi else (out,)

    axes = tuple(None if m == UNIFORM else 0 for m in modes)
    if all(a is None for a in axes) and sig.n_ints == 0:
        def shared_only(vals, params, ints):  # nothing varies per lane: compute once
            return tuple(jnp.broadcast_to(o, (B,) + o.shape) for o in single(vals, params, ints))
        return shared_only
    return jax.vmap(single, in_axes=(axes, None, 0))


def _lane_mask(count, B, ndim):
    """Which of B lanes are real (the first ``count``), shaped to broadcast over ndim."""
    mask = lax.iota(jnp.int32, B) < count
    return mask.reshape((B,) + (1,) * (ndim - 1))


def _read_cotangents(arenas_of, sig, out_off, packet, B, gathered: bool = False):
    """The output cotangents of one batch (its block of B rows per output, or ``gathered``
    its B rows), padded lanes masked to zero."""
    cts = []
    for j, a in enumerate(sig.out_akeys):
        if gathered:
            ct = arenas_of(a)[packet[out_off[j]:out_off[j] + B]]
        else:
            ct = lax.dynamic_slice_in_dim(arenas_of(a), packet[out_off[j]], B, 0)
        # masked even with one lane: a run's padding step has none (_run_param_grads)
        ct = jnp.where(_lane_mask(packet[0], B, ct.ndim), ct, 0)
        cts.append(ct)
    return cts


def _read_inputs(arenas_of, sig, modes, val_off, packet, B, ints, doubled: bool = False):
    """A batch's value arguments: B gathered rows each (padded lanes repeat lane 0's), or
    the one row every lane reads (UNIFORM). With ``doubled`` a 1-lane gather reads its row
    twice, for ``_first_lane`` to drop past an optimization barrier: XLA turns a 1-row
    gather into a slice of the arena, which aliases it, and then copies the whole arena
    (twice per call, seen in the compiled HLO) before the kernel writes it in place.
    A part's (``_reads_part``) is the B lanes' parts of their rows."""
    if _stacked_list(sig, modes):  # one block of at least 2 rows: no 1-row gather
        return [arenas_of(sig.in_akeys[0])[packet[val_off[0]:val_off[0] + len(modes) * B]]]
    if _reads_part(sig):
        if modes[0] == UNIFORM:  # one row for all: the parts of B copies of it
            rows = jnp.broadcast_to(packet[val_off[0]], (B,))
        else:
            rows = packet[val_off[0]:val_off[0] + B]
            if doubled and B == 1:
                rows, ints = _twice(rows), tuple(map(_twice, ints))
        return [arenas_of(sig.in_akeys[0])[_part_index(sig, rows, ints)]]
    xs = []
    for k, (m, off) in enumerate(zip(modes, val_off)):
        arena = arenas_of(sig.in_akeys[k])
        if m == GATHER:
            rows = packet[off:off + B]
            x = arena[_twice(rows) if doubled and B == 1 else rows]
        else:
            x = arena[packet[off]]
        xs.append(x)
    return xs


def _twice(a):
    return jnp.concatenate([a, a])


def _first_lane(xs, sig, modes, B):
    """Undo ``_read_inputs``'s ``doubled``: each gathered argument's first row."""
    if B != 1 or _stacked_list(sig, modes):
        return xs
    return [x[:1] if m == GATHER else x for x, m in zip(xs, modes)]


def _vjp(batched, xs, diff, params, ints):
    """(outputs, vjp function) of the batched op w.r.t. the value args ``diff`` and params."""
    def f(dxs, ps):
        full = list(xs)
        for i, x in zip(diff, dxs):
            full[i] = x
        return batched(tuple(full), ps, ints)

    return jax.vjp(f, [xs[i] for i in diff], params)


def _family(sig):
    """The kernel family of ``sig``, stamped as used by the pass running now (what
    ``eviction.py`` drops last)."""
    family = sig.family
    family.last_used = eviction.clock
    return family


def _cached(family, key, k: Kernel) -> Kernel:
    """Cache ``k`` as ``family``'s kernel of ``key``, unless another thread cached one in
    the meantime: that one, then, so that every thread looks up the same kernel (a run's
    step kernel is looked up on its own and again through the run; two threads making
    the first kernels of a family at once left a run whose recorded step never ran, and
    its backward failed: session 78's audit)."""
    kept = family.kernels.setdefault(key, k)
    if kept is k:
        _note_made(family.kernels, key, k)
    return kept


_made = threading.local()  # .log: what this thread cached inside ``made_kernels``


def _note_made(kernels: dict, key, k) -> None:
    log = getattr(_made, "log", None)
    if log is not None:
        log.append((kernels, key, k))


@contextlib.contextmanager
def made_kernels():
    """Logs the kernels this thread caches inside the block (a forward pass's launches), so
    that a failed launch forgets its own kernels only (``made_mark``, ``forget_made``):
    another thread may cache kernels of the same family meanwhile."""
    outer = getattr(_made, "log", None)
    _made.log = log = []
    try:
        yield
    finally:
        _made.log = outer
        if outer is not None:
            outer.extend(log)


def made_mark() -> int:
    """A mark in this thread's log of kernels made: ``forget_made`` forgets those after."""
    return len(_made.log)


def forget_made(kernels: dict, mark: int) -> None:
    """Uncache the kernels of the cache ``kernels`` that this thread made after ``mark``,
    each only if it is still the one cached under its key."""
    log = _made.log
    for cache, key, k in log[mark:]:
        if cache is kernels and cache.get(key) is k:
            del cache[key]


def _trained_variants(sig, kind: str, modes: tuple, B: int, *rest) -> list:
    """The kernels ``(kind, modes, B, gflags, *rest)`` of ``sig`` with gradient flags (its
    training variants)."""
    # a copy of the items: another thread may cache a kernel of the family meanwhile
    return [k for other, k in tuple(sig.kernels.items())
            if other[0] == kind and other[1:3] == (modes, B) and other[3] is not None
            and other[4:] == rest]


def _evaluation_kernel(sig, key: tuple, kind: str, modes: tuple, B: int, *rest):
    """What an evaluation forward (no gradient) launches for ``key``: a kernel of it that
    holds an executable, its residual-free twin or a training variant (its residuals
    ignored), in that order; else the twin, else a training variant, else None (compile
    the twin).

    Executables matter, not only kernels: ``jax.clear_caches()`` empties them all, and a
    family keeps the kernels of every model that shared it. Taking the twin, or the first
    training variant, whatever their state made evaluation after training compile again,
    depending on what ran earlier in the process (session 72)."""
    k = sig.kernels.get(key)
    if k is not None and not is_new(k.fn):
        return k
    trained = _trained_variants(sig, kind, modes, B, *rest)
    choice = next((t for t in trained if not is_new(t.fn)), None) or k or \
        (trained[0] if trained else None)
    if choice is not None and choice is not k:
        sig.kernels[key] = choice  # found once, searched for again only if emptied
        if k is None:
            _note_made(sig.kernels, key, choice)
    return choice


def forward_kernel(sig, modes: tuple, B: int, gflags: tuple | None = None,
                   distinct: int = 0) -> Kernel:
    """The cached forward kernel
    ``(write_arenas, read_arenas, params, packet) -> (write_arenas, residuals)``.

    With ``distinct`` (a batch whose repeated lanes run once, ``repeats.py``) the op runs
    on that many lanes, and its results are gathered into the B lanes' output rows by the
    packet's expansion; the residuals are the distinct lanes'.

    With ``gflags`` (which value arguments need a gradient) it also returns the residuals of
    ``jax.vjp`` so the backward kernel need not recompute the forward pass (which costs as
    much as the forward itself: a measured ~25% of a Tree-LSTM step). The residuals' pytree
    structure, fixed per kernel, is recorded in ``meta`` at trace time; residuals that are
    parameters are not returned but re-supplied in backward. The residuals are packed into
    few buffers (``_pack``), except with ``pack=False``: a run's step, whose loop stacks
    each residual in a buffer of its own (``forward_run_kernel``).
    """
    sig = _family(sig)  # kernels close over no parameter (registry: a kernel family)
    rest = (distinct,) if distinct else ()
    key = ("fwd", modes, B, gflags) + rest
    k = sig.kernels.get(key) if gflags is not None else \
        _evaluation_kernel(sig, key, "fwd", modes, B, *rest)
    if k is not None:
        return k
    out_off, val_off, int_off, end = _offsets(sig, modes, B, distinct=distinct)
    L = distinct or B  # the lanes the op runs on
    w_akeys = _unique(sig.out_akeys)
    r_akeys = _unique(a for a in sig.in_akeys if a not in w_akeys)
    batched = _batched(sig, modes, L)
    meta: dict = {}

    def kernel(warenas, rarenas, params, packet, pack=True):
        def arena_of(a):
            return warenas[w_akeys.index(a)] if a in w_akeys else rarenas[r_akeys.index(a)]
        # The barrier materialises the inputs before the arena is updated in place: otherwise
        # XLA fuses the reads into the writes' fusions, reads the buffer after it changed,
        # and must copy the whole arena (measured: 2 copies per call of an 8192x150 arena).
        ints = tuple(packet[o:o + L] for o in int_off)
        xs = lax.optimization_barrier(_read_inputs(arena_of, sig, modes, val_off, packet, L,
                                                   ints, doubled=True))
        xs = _first_lane(xs, sig, modes, L)
        saved = ()
        if gflags is None:
            outs = batched(tuple(xs), params, ints)
        else:
            outs, vjp = _vjp(batched, xs, _differentiated(sig, modes, gflags), params, ints)
            leaves, meta["treedef"] = jax.tree_util.tree_flatten(vjp)
            spec, kept = [], []
            for leaf in leaves:  # identity test on tracers: is this residual a parameter?
                j = next((j for j, p in enumerate(params) if leaf is p), None)
                spec.append(("p", j) if j is not None else ("r", len(kept)))
                if j is None:
                    kept.append(leaf)
            meta["spec"] = tuple(spec)
            if pack:
                saved, meta["packing"] = _pack(kept)
            else:
                saved = tuple(kept)
        if distinct:  # every lane's outputs, from the distinct lane it repeats
            expand = _expansion(packet, end, B)
            outs = tuple(o[expand] for o in outs)
        # Outputs sharing an arena occupy consecutive blocks of B rows (see the engine), so
        # each arena gets ONE in-place write: a chain of writes made XLA copy the arena.
        warenas = list(warenas)
        for w, a in enumerate(w_akeys):
            js = [j for j, oa in enumerate(sig.out_akeys) if oa == a]
            block = jnp.concatenate([outs[j] for j in js]) if len(js) > 1 else outs[js[0]]
            warenas[w] = lax.dynamic_update_slice_in_dim(
                warenas[w], block.astype(warenas[w].dtype), packet[out_off[js[0]]], 0)
        return tuple(warenas), saved

    name = f"{sig.op.name}_fwd_B{B}" + (f"_D{distinct}" if distinct else "")
    k = Kernel(_jit(kernel, name, (0,), B * sig.lane_work), w_akeys, r_akeys, meta, kernel)
    return _cached(sig, key, k)


PACK_MAX_ELEMENTS = 1 << 17  # larger residuals stay buffers of their own


def _pack(residuals):
    """The residuals as few buffers, and how to cut them out again.

    A forward kernel's vjp keeps some 20 residual arrays (an LSTM cell's gates, masks, ...).
    Each array a kernel returns costs the host microseconds to create and again to free,
    per batch (the tagger's 46 batches returned 1,044 residual arrays per update), so small
    residuals are concatenated into one flat buffer per dtype. Large ones are returned as
    they are: copying them costs the device more than their buffers cost the host
    (measured: a 2560x300 log-softmax residual, 1.6 -> 6.0 ms packed).
    """
    buffers, items, flat = [], [], {}  # items: (buffer index, start or None, shape)
    for r in residuals:
        if r.size >= PACK_MAX_ELEMENTS:
            items.append((len(buffers), None, r.shape))
            buffers.append(r)
        else:
            group = flat.setdefault(r.dtype, [])
            items.append((r.dtype, sum(x.size for x in group), r.shape))
            group.append(r.ravel())
    index = {}
    for dtype, group in flat.items():
        index[dtype] = len(buffers)
        buffers.append(jnp.concatenate(group) if len(group) > 1 else group[0])
    items = [(index[b] if start is not None else b, start, shape) for b, start, shape in items]
    return tuple(buffers), tuple(items)


def _unpack(buffers, items):
    """The residual arrays of ``_pack``'s buffers, in their original order."""
    return [buffers[b] if start is None else
            buffers[b][start:start + math.prod(shape)].reshape(shape)
            for b, start, shape in items]


def backward_kernel(sig, modes: tuple, gflags: tuple, B: int,
                    forward: Kernel | None = None, fresh: bool = False,
                    param_grads: bool = True, gathered_outs: bool = False,
                    distinct: int = 0) -> Kernel:
    """The cached backward kernel
    ``(grad_arenas, param_grads, value_arenas, params, residuals, packet)
    -> (grad_arenas, param_grads)``.

    It is the ``jax.vjp`` of the forward kernel's batched function: output cotangents are
    read from the gradient arenas, input cotangents scatter-added back (fan-out accumulates
    by itself), parameter cotangents added to the parameters' gradient buffers.
    ``gflags[k]`` says whether value argument k needs a gradient at all. With ``forward``
    (a residual-saving forward kernel) it applies the saved vjp; otherwise it recomputes it
    from the value arenas. With ``fresh`` (no parameter has a gradient yet) ``param_grads``
    is ``()`` and the parameter cotangents are returned as they are: adding them to zero
    buffers cost a memset and a pass over each (RNN LM's 10000x256 softmax: ~2.5 ms).
    On CPU, weight gradients get the matmul layout of ``dots.py`` (tagger: -7% per update).
    Without ``param_grads`` it computes input cotangents only (``param_grads`` is ``()`` and
    returned as is): the step of a run whose weight gradients come after it
    (``backward_run_kernel``). With ``gathered_outs`` the packet lists each output's rows
    (a batch of a backward plan, whose nodes' outputs are not one block). With
    ``packed=False`` ``saved`` holds the residuals unpacked, as a run stacks them.
    With ``distinct`` (``forward_kernel``'s) the cotangents of lanes that repeat one
    distinct lane are summed into it, the vjp runs on the distinct lanes, and each one's
    input cotangent goes to the arguments of the first lane it stands for (the others'
    get none: see ``repeats.py`` for why the sum is what every parameter needs).
    """
    sig = _family(sig)  # kernels close over no parameter (registry: a kernel family)
    key = ("bwd", modes, gflags, B, forward is not None, fresh, param_grads, gathered_outs)
    key += (distinct,) if distinct else ()
    k = sig.kernels.get(key)
    if k is not None:
        return k
    out_off, val_off, int_off, end = _offsets(sig, modes, B, gathered_outs, distinct)
    L = distinct or B  # the lanes the vjp runs on
    diff = [i for i, f in enumerate(gflags) if f]
    g_akeys = _unique(list(sig.out_akeys) + [sig.in_akeys[i] for i in diff])
    v_akeys = _unique(sig.in_akeys) if forward is None else ()
    batched = _batched(sig, modes, L)
    stacked = _stacked_list(sig, modes)
    part = _reads_part(sig)

    def kernel(garenas, pgrads, varenas, params, saved, packet, packed=True):
        ints = tuple(packet[o:o + L] for o in int_off)
        garenas = list(garenas)
        cts = _read_cotangents(lambda a: garenas[g_akeys.index(a)], sig, out_off, packet, B,
                               gathered_outs)
        cts = lax.optimization_barrier(cts)  # read before the in-place updates (see forward)
        if distinct:  # each distinct lane's cotangent: the sum of its lanes' (padding's 0)
            expand = _expansion(packet, end, B)
            cts = [jnp.zeros((L,) + ct.shape[1:], ct.dtype).at[expand].add(ct) for ct in cts]

        if sig.op.row_gather:  # table[i]: scatter-add row cotangents into the table gradient
            return tuple(garenas), (pgrads[0].at[ints[0]].add(cts[0]),)

        if forward is None:
            xs = _read_inputs(lambda a: varenas[v_akeys.index(a)], sig, modes, val_off,
                              packet, L, ints)
            _, vjp = _vjp(batched, xs, _differentiated(sig, modes, gflags), params, ints)
        else:
            meta = forward.meta
            saved = _unpack(saved, meta["packing"]) if packed else list(saved)
            leaves = [params[j] if kind == "p" else saved[j] for kind, j in meta["spec"]]
            vjp = jax.tree_util.tree_unflatten(meta["treedef"], leaves)
        if get_device().platform == "cpu":  # weight gradients in XLA:CPU's fast form
            vjp = materialised_transposes(vjp)
        dxs, dps = vjp(tuple(cts))
        # One scatter-add per gradient arena for all its input cotangents: a chain of
        # in-place updates made XLA copy the arena (it re-read the original buffer after the
        # first update); a single in-place op does not.
        updates: dict = {}
        count = packet[end] if distinct else packet[0]  # real lanes
        if stacked and diff:  # the block's cotangent, as it was read (item-major)
            k = len(modes)
            d = dxs[0].reshape((k, L) + dxs[0].shape[1:])
            if L > 1:  # padded lanes add nothing (see below)
                d = jnp.where(_lane_mask(count, L, d.ndim - 1), d, 0)
            if not all(gflags):  # nor items that take no gradient
                d = jnp.where(np.asarray(gflags).reshape((k,) + (1,) * (d.ndim - 1)), d, 0)
            updates[g_akeys.index(sig.in_akeys[0])] = [
                (packet[val_off[0]:val_off[0] + k * L], d.reshape(dxs[0].shape))]
        for i, d in zip(() if stacked else diff, dxs):
            off = val_off[i]
            if part:  # to the parts only; padded lanes' cotangents are zero already
                rows = packet[off:off + L] if modes[i] == GATHER else \
                    jnp.broadcast_to(packet[off], (L,))
                updates[g_akeys.index(sig.in_akeys[i])] = [(_part_index(sig, rows, ints), d)]
                continue
            if modes[i] == GATHER:
                idx = packet[off:off + L]
                if L > 1:  # a padded lane (lane 0's inputs, a zero cotangent) adds 0 * J,
                    # NaN where lane 0's derivative is infinite: it must add nothing
                    d = jnp.where(_lane_mask(count, L, d.ndim), d, 0)
            else:
                idx, d = packet[off:off + 1], d[None]
            updates.setdefault(g_akeys.index(sig.in_akeys[i]), []).append((idx, d))
        for g, parts in updates.items():
            idx = jnp.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
            upd = jnp.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
            garenas[g] = garenas[g].at[idx].add(upd)
        if not param_grads:  # the unused parameter cotangents are dead code to XLA
            return tuple(garenas), ()
        if fresh:
            return tuple(garenas), tuple(dps)
        return tuple(garenas), tuple(g + d for g, d in zip(pgrads, dps))

    name = (f"{sig.op.name}_bwd_B{B}{'_gathered' if gathered_outs else ''}"
            + (f"_D{distinct}" if distinct else ""))
    k = Kernel(_jit(kernel, name, (0, 1), B * sig.lane_work), g_akeys, v_akeys, {},
               kernel)
    return _cached(sig, key, k)


def run_steps(packets):
    """How many of a run's ``T`` packets are steps: the first ones, with lanes (the engine
    pads a shorter run to ``T`` with packets of none, which nothing runs)."""
    return jnp.sum(packets[:, 0] > 0)


def forward_run_kernel(sig, modes: tuple, B: int, gflags: tuple | None, T: int) -> Kernel:
    """Up to ``T`` consecutive batches of one forward kernel as one loop: arguments as the
    single kernel's but ``packets`` of shape ``(T, packet length)``, the steps first
    (``run_steps``), and then ``stacked``, buffers with room for ``T`` steps' residuals
    (``run_residuals``; donated), which it returns with each step's residuals written in
    place. The engine hands it pooled ones (``scratch.py``): made here, they were
    zero-filled at every launch. Padding steps leave their rows as they were.

    Each residual gets a stacked buffer of its own, not one for the step's packed buffer:
    XLA then writes each where it is computed, in place, where packing first concatenated
    them, a second copy of every residual per step (tagger: 28.0 -> 26.6 ms per update with
    one XLA thread, 34.5 -> 32.2 with two; char tagger -5%; RNN LM and the synthetic
    BiLSTM on par). Their number costs the host little: one launch per run.

    Running the batches one after another inside the loop is what launching them one by
    one does (the read-only arenas are not written by this kernel), so any run is valid; it
    saves a launch per step, which is the whole cost of a small recurrent step (an RNN
    over one sentence runs one 1-lane step per word). The number of steps is data, so one
    kernel serves every run of up to ``T`` steps: a few capacities cover all runs, each
    in one launch (``Engine._launches``). None for an evaluation run (``gflags=None``) of
    a kernel trained but never in a run of ``T``: its steps are launched one by one then,
    compiling nothing.
    """
    sig = _family(sig)  # kernels close over no parameter (registry: a kernel family)
    key = ("fwd_run", modes, B, gflags, T)
    k = sig.kernels.get(key) if gflags is not None else \
        _evaluation_kernel(sig, key, "fwd_run", modes, B, T)
    if k is not None:
        return k
    if gflags is None:  # evaluation: as forward_kernel, reuse what training compiled
        if _trained_variants(sig, "fwd", modes, B):
            return None  # no such run in training: launch its steps with the trained kernel
    step = forward_kernel(sig, modes, B, gflags)

    def kernel(warenas, rarenas, params, packets, stacked):
        def body(t, carry):
            w, stacked = carry
            w, saved = step.body(w, rarenas, params, packets[t], pack=False)
            return w, tuple(lax.dynamic_update_index_in_dim(b, r, t, 0)
                            for b, r in zip(stacked, saved))
        return lax.fori_loop(0, run_steps(packets), body, (warenas, stacked))

    k = Kernel(_jit(kernel, f"{sig.op.name}_fwd_B{B}_T{T}", (0, 4), B * sig.lane_work),
               step.write_akeys, step.read_akeys, step.meta, kernel, step)
    return _cached(sig, key, k)


def run_residuals(run: Kernel, args: tuple, T: int) -> tuple:
    """The shapes of a forward ``run`` kernel's ``stacked`` buffers: room for ``T`` steps of
    what its single kernel saves, given that kernel's arguments ``args`` (a run's first
    step's packet; traced only). Its own single kernel's, not the one a launch found: an
    evaluation reuses trained kernels, and the two need not share gradient flags."""
    shapes = jax.eval_shape(lambda *a: run.step.body(*a, pack=False), *args)[1]
    return tuple(jax.ShapeDtypeStruct((T,) + s.shape, s.dtype) for s in shapes)


DEFER_MAX_LANES = 8  # runs this narrow take their weight gradients after the loop


def backward_run_kernel(sig, modes: tuple, gflags: tuple, B: int, forward: Kernel | None,
                        T: int) -> Kernel:
    """The backward of ``forward_run_kernel``: the single backward kernel over the steps in
    reverse order (a step's input cotangents are complete only once every later step that
    reads its outputs has run), residuals and packets stacked per step.

    A narrow run (at most ``DEFER_MAX_LANES`` lanes) takes its weight gradients after the
    loop, as one product over all ``T x B`` lanes (``_run_param_grads``), and its steps
    compute input cotangents only. Inside the loop each step would read and write every
    weight gradient to add a rank-B update to it: for an LSTM LM over one sentence (1,024 x
    512 weights), 4 MB of traffic per word for a few kFLOP.
    """
    sig = _family(sig)  # kernels close over no parameter (registry: a kernel family)
    key = ("bwd_run", modes, gflags, B, forward is not None, T)
    k = sig.kernels.get(key)
    if k is not None:
        return k
    deferred = defers(sig, modes, B)
    if not deferred:
        step = backward_kernel(sig, modes, gflags, B, forward)
        read_akeys = step.read_akeys

        def kernel(garenas, pgrads, varenas, params, saved, packets):
            def body(carry, t):
                return step.body(*carry, varenas, params, _at(saved, t), packets[t],
                                 packed=False)
            return _reversed_steps(body, (garenas, pgrads), packets)
    else:
        step = backward_kernel(sig, modes, gflags, B, forward, param_grads=False)
        n_step = len(step.read_akeys)  # the step's own value arenas come first
        read_akeys = _unique(step.read_akeys + sig.in_akeys)
        weight_grads = _run_param_grads(sig, modes, B, T)

        def kernel(garenas, pgrads, varenas, params, saved, packets):
            def body(carry, t):
                return step.body(carry, (), varenas[:n_step], params, _at(saved, t),
                                 packets[t], packed=False)[0]
            garenas = _reversed_steps(body, garenas, packets)
            dps = weight_grads(dict(zip(step.write_akeys, garenas)),
                               dict(zip(read_akeys, varenas)), params, packets)
            return garenas, tuple(g + d for g, d in zip(pgrads, dps))

    # small steps: products on one thread, outside YNNPACK, so none accumulates there
    one_thread = sig.lane_work <= SMALL_STEP_MAX_WORK
    k = Kernel(_jit(kernel, f"{sig.op.name}_bwd_B{B}_T{T}", (0, 1), B * sig.lane_work,
                    accumulates=sig.has_params and not deferred and not one_thread,
                    one_thread=one_thread),
               step.write_akeys, read_akeys, {}, kernel)
    return _cached(sig, key, k)


def _at(saved, t):
    """Step ``t``'s residuals of a run's stacked ones."""
    return tuple(lax.dynamic_index_in_dim(r, t, 0, keepdims=False) for r in saved)


def _reversed_steps(body, carry, packets):
    """``carry = body(carry, t)`` for a run's steps ``t`` (``run_steps``), last first."""
    n = run_steps(packets)
    return lax.fori_loop(0, n, lambda i, c: body(c, n - 1 - i), carry)


def defers(sig, modes: tuple, B: int) -> bool:
    """Whether a run of this kernel takes its weight gradients after the loop: narrow steps
    with parameters, every value argument gathered per lane (``_run_param_grads``)."""
    return (B <= DEFER_MAX_LANES and sig.has_params and not sig.op.row_gather
            and all(m == GATHER for m in modes))


def _run_param_grads(sig, modes: tuple, B: int, T: int):
    """The parameter cotangents of a run of ``T`` steps as one batch of ``T x B`` lanes:
    inputs re-read from the value arenas, output cotangents from the gradient arenas (both
    complete once the run's loop is done), the forward recomputed (cheap for narrow steps)
    and ``jax.vjp`` taken w.r.t. the parameters only. A padding step has no lanes:
    ``_read_cotangents`` masks all its cotangents to zero."""
    out_off, val_off, int_off = packet_offsets(sig, modes, B)
    N = T * B
    flat = _batched(sig, modes, N)

    def grads(garenas, varenas, params, packets):
        def step_lanes(packet):  # what one step's kernel reads: inputs, ints, cotangents
            ints = tuple(packet[o:o + B] for o in int_off)
            return (tuple(_read_inputs(varenas.get, sig, modes, val_off, packet, B, ints)),
                    ints, tuple(_read_cotangents(garenas.get, sig, out_off, packet, B)))

        stacked = jax.vmap(step_lanes)(packets)  # (T, B, ...) -> (T x B, ...)
        xs, ints, cts = jax.tree_util.tree_map(lambda x: x.reshape((N,) + x.shape[2:]),
                                               stacked)
        _, vjp = jax.vjp(lambda ps: flat(xs, ps, ints), params)
        if get_device().platform == "cpu":  # weight gradients in XLA:CPU's fast form
            vjp = materialised_transposes(vjp)
        return vjp(cts)[0]

    return grads


def _load(arena, block, start):
    return lax.dynamic_update_slice_in_dim(arena, block, start, 0)


load_block = jax.jit(_load, donate_argnums=(0,))  # host constants -> arena rows, one transfer


def _seed(garena, row):
    return garena.at[row].set(1.0)


seed_gradient = jax.jit(_seed, donate_argnums=(0,))


SIDE_PRODUCT = 16  # the size of the product that makes XLA:CPU run a clear asynchronously (_clear)


def _clear(garena, rows: int):
    """``garena`` with its first ``rows`` rows zero, and a small product it does not need.

    XLA:CPU runs a computation of under 1,000 flops by its cost analysis inline, on the
    calling thread, once its inputs are ready: a clear counts 0 flops, however many rows it
    zeroes. The synthetic BiLSTM's clears (20,000 rows of 512) then held the Python thread
    for ~6 ms at the start of each backward pass, with the device idle, before its first
    kernel launched. A 16 x 16 product (8,192 flops) makes the clear run on XLA's threads
    like any kernel; ``clear_rows`` drops it."""
    side = jnp.ones((SIDE_PRODUCT, SIDE_PRODUCT), garena.dtype)
    return (lax.dynamic_update_slice_in_dim(
        garena, jnp.zeros((rows,) + garena.shape[1:], garena.dtype), 0, 0), side @ side)


# a used gradient arena's first ``rows`` rows set to zero, in place, for the next backward
_clear_rows = jax.jit(_clear, static_argnums=(1,), donate_argnums=(0,))

_CLEARS_COMPILED: set = set()  # (shape, dtype, sharding, rows) compiled ahead of their use


def _forget_if_caches_cleared() -> None:
    """Forget what ``compile_clear`` compiled if the clearing kernel has no executable its
    calls can reach: never called yet, or ``jax.clear_caches()`` ran since (it empties
    every jitted function's cache; the stale memo left the compilation to a later pass,
    which counted it). Nothing where JAX does not say."""
    if is_new(_clear_rows):
        _CLEARS_COMPILED.clear()


def clear_rows(garena, rows: int):
    """``garena`` with its first ``rows`` rows set to zero, in place (donated)."""
    _forget_if_caches_cleared()  # before the call refills the cache
    return _clear_rows(garena, rows)[0]


def compile_clear(garena, rows: int) -> None:
    """Compile ``clear_rows(garena, rows)`` now without running it (JAX's ahead-of-time
    path fills the cache that the call will use). A backward pass leaves its arenas
    uncleared, for ``Expression.gradient()``, and the next pass clears them: compiling here
    keeps the first pass the one that compiles, so a second identical step compiles
    nothing."""
    key = (garena.shape, garena.dtype, garena.sharding, rows)
    _forget_if_caches_cleared()
    if key not in _CLEARS_COMPILED:
        aval = jax.ShapeDtypeStruct(garena.shape, garena.dtype, sharding=garena.sharding)
        _clear_rows.lower(aval, rows).compile()
        _CLEARS_COMPILED.add(key)
