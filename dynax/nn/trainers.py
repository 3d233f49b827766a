"""Trainers: apply the gradients accumulated in a ParameterCollection with any Optax transform.

Sparse lookup updates. A lookup table's gradient is non-zero only on the rows read since the
last update, so with ``sparse_updates=True`` a table is updated on those rows only: the
optimizer runs on the gathered rows of the parameter, the gradient and every state leaf of the
table's shape, and the results are scattered back. Scalar state (the step count that Adam's
bias correction and Optax's schedules read) advances with every update, whether the table
was used or not, as it does for every other parameter. This is exact for optimizers whose
update of a row with zero gradient is zero and leaves its state unchanged (SGD, Adagrad), so
``SimpleSGDTrainer`` and ``AdagradTrainer`` update sparsely by default. For the others (Adam,
momentum, RMSProp) it is the "lazy" variant, which a user chooses: untouched rows keep their
moments and do not move, as in DyNet's sparse updates and TensorFlow's LazyAdam. Otherwise
(``sparse_updates=False``, the default of ``Trainer`` and the other convenience trainers)
``tx`` applies densely to all parameters jointly, exactly as Optax would. A state leaf that is
neither per element nor scalar (Adafactor's factored moments) has no row-wise form: sparse
mode refuses such an optimizer rather than compute something else.

In sparse mode the ordinary parameters share one Optax state and each lookup table has its
own, so a transform whose update couples parameters (e.g. ``optax.clip_by_global_norm``) sees
them group by group (a table: its used rows only); use the trainer's ``clip_threshold`` for
global-norm clipping instead. For the same reason a mask or labels given as a dict over all
parameter names (``optax.adamw(mask=...)``, ``optax.multi_transform``) must be given as a
function of the parameters in sparse mode, and transforms that accumulate gradients over
steps (``optax.MultiSteps``) are refused there: the rows used before the applying step
would never be applied.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..device import get_device, zeros
from ..errors import ArgumentTypeError
from ..executor.buckets import bucket
from ..graph.computation_graph import compiles_count_for_current_graph
from ..graph.expression import Expression
from ..interrupts import interrupts_held
from .parameters import LookupParameter, ParameterCollection


class Trainer:
    """Applies an ``optax.GradientTransformation`` to the parameters of ``pc``.

    Args:
      pc: the ParameterCollection to train.
      tx: any Optax gradient transformation.
      sparse_updates: update lookup tables on the rows used since the last update only (see
        the module doc: exact for SGD and Adagrad, the "lazy" variant for Adam and the
        like). Default: ``False`` here, as dynax cannot see which rule ``tx`` applies
        (pass ``True`` for ``optax.sgd`` or ``optax.adagrad``, where it is exact);
        ``True`` for ``SimpleSGDTrainer``, ``CyclicalSGDTrainer`` and ``AdagradTrainer``.
      clip_threshold: if set, rescale all gradients so their global L2 norm is at most this.

    ``learning_rate_scale`` (default 1.0) multiplies every update that ``tx`` returns. Set it
    between updates to decay the rate by whatever the loop measures (elapsed time, a dev
    score), which a step-count schedule cannot know in advance; changing it compiles
    nothing. For Optax's optimizers (SGD, momentum, Adagrad, RMSProp, Adam, AdamW) the update
    is proportional to the learning rate, so this is the same as scaling it. The convenience
    trainers below also offer DyNet's ``trainer.learning_rate`` on top of it.
    """

    sparse_is_exact = False  # a subclass whose optimizer a row-wise update leaves exact

    def __init__(self, pc, tx: optax.GradientTransformation,
                 sparse_updates: bool | None = None, clip_threshold: float | None = None):
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            hint = " (call it: optax.adam(1e-3))" if callable(tx) else ""
            raise ArgumentTypeError(f"{type(self).__name__}: tx must be an Optax gradient "
                                    f"transformation, got {tx!r}{hint}")
        if not isinstance(pc, ParameterCollection):
            raise ArgumentTypeError(f"{type(self).__name__}: pc must be a "
                                    f"ParameterCollection, got {type(pc).__name__}")
        self.pc = pc
        self.tx = tx
        # updates take Optax's extra arguments (``update(value=loss)``); a transform that
        # needs none ignores them
        self._tx = optax.with_extra_args_support(tx)
        if sparse_updates is not None and not isinstance(sparse_updates, (bool, np.bool_)):
            raise ArgumentTypeError(f"{type(self).__name__}: sparse_updates must be a bool "
                                    f"(or None: the trainer's default), got {sparse_updates!r}")
        self.sparse_updates = self.sparse_is_exact if sparse_updates is None \
            else bool(sparse_updates)
        self.clip_threshold = None if clip_threshold is None else \
            _clip_threshold(clip_threshold, f"{type(self).__name__}: clip_threshold")
        self.updates = 0
        self.learning_rate_scale = 1.0
        self._base_learning_rate = None  # what a convenience trainer gave optax
        self._names: tuple = ()
        self._state: dict = {}  # group name -> optax state
        # Values and optimizer state are updated in place (donated): writing new arrays cost
        # RNN LM's Adam step over 3.3M values 4.8 ms against 3.1 ms in place. A value the
        # user has read is copied first (``Parameter._own_value``).
        self._dense_step = jax.jit(self._apply, donate_argnums=(0, 2))
        self._sparse_step = jax.jit(self._apply_rows, donate_argnums=(0, 2))
        # zeroing the used gradient rows in place is its own kernel: inside the step, XLA
        # copied the whole gradient table twice to order the read before the write
        self._zero_rows = jax.jit(lambda grad, rows: grad.at[rows].set(0.0), donate_argnums=(0,))
        self._tick = jax.jit(self._advance_count, donate_argnums=(1,))
        self.last_grad_norm: float | None = None

    # ---- pure steps -------------------------------------------------------------------------
    def _apply(self, values, grads, state, scale, lr_scale, extra):
        grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
        updates, state = self._tx.update(grads, state, values, **extra)
        updates = jax.tree_util.tree_map(lambda u: u * lr_scale, updates)
        return optax.apply_updates(values, updates), state

    def _apply_rows(self, value, grad, state, rows, n, scale, lr_scale, extra):
        """Update the first ``n`` of ``rows`` of a table; the rest is padding (bounded
        compiles), given to ``tx`` as rows of zeros (value, gradient and state) so that a
        transform reducing over the rows (``clip_by_global_norm``'s norm, a trust ratio)
        sees the used rows only, and written nowhere."""
        shape = value.shape
        at = jnp.where(jnp.arange(rows.shape[0]) < n, rows, shape[0])  # padding: past the end

        def take(leaf):  # padding reads zeros
            return leaf.at[at].get(mode="fill", fill_value=0)

        sub_state = jax.tree_util.tree_map(
            lambda leaf: take(leaf) if _per_element(leaf, shape) else leaf, state)
        old_rows = take(value)
        updates, new_sub = self._tx.update(take(grad) * scale, sub_state, old_rows, **extra)
        new_rows = optax.apply_updates(old_rows, updates * lr_scale)

        def put(leaf, sub):  # padding writes nothing
            return leaf.at[at].set(sub, mode="drop") if _per_element(leaf, shape) else sub

        state = jax.tree_util.tree_map(put, state, new_sub)
        # outputs in the order of the donated inputs: JAX pairs donated buffers with outputs
        # by position and shape, and a mismatch makes XLA copy every table (measured: 7
        # copies of 20000x300, 130 ms, instead of in-place row scatters)
        return value.at[at].set(new_rows, mode="drop"), state

    def _advance_count(self, value, state, extra):
        """The state of a table no update touched this time: its scalar leaves (the step
        count) advance as an update would advance them; its rows stay as they are."""
        shape = value.shape
        zero_row = jnp.zeros((1,) + shape[1:], value.dtype)
        _, new_sub = self._tx.update(zero_row, _rows_of(state, shape, slice(0, 1)), value[:1],
                                     **extra)
        return jax.tree_util.tree_map(
            lambda leaf, sub: leaf if _per_element(leaf, shape) else sub, state, new_sub)

    # ---- bookkeeping ----------------------------------------------------------------------------
    def _groups(self, params):
        if not self.sparse_updates:
            return {"": params}, []
        dense = [p for p in params if not isinstance(p, LookupParameter)]
        tables = [p for p in params if isinstance(p, LookupParameter)]
        return {"": dense}, tables

    def _sync(self, params):
        names = (tuple(p.name for p in params), self.sparse_updates)  # what the state is for
        if names == self._names:
            return
        # parameters were added (or the mode changed): state for them, the others keep theirs
        groups, tables = self._groups(params)
        # committed to the device like the step's outputs, so the second step hits the cache
        device = get_device()
        old = self._state
        every = {p.name for p in params} | set(self._names[0] if self._names else ())
        known = _known_leaves(old, every)
        state = self._init({p.name: p._value for p in groups[""]}, "its other parameters")
        new = {"": jax.device_put(_carry_over(state, known, every), device)}
        for p in tables:
            if p.name in old:
                new[p.name] = old[p.name]
                continue
            state = self._init(p._value, f"lookup table {p.name!r}")
            _check_row_wise(p, state)
            new[p.name] = jax.device_put(_carry_over(state, known, every, p.name), device)
        self._names, self._state = names, new

    def _init(self, values, what: str):
        """``tx.init(values)``; in sparse mode, where ``values`` is one group of the
        parameters only, an error says so (a mask or labels given as a dict over every
        parameter's name does not fit a group)."""
        try:
            return self.tx.init(values)
        except (ValueError, TypeError) as e:
            if not self.sparse_updates:
                raise
            raise ValueError(
                f"sparse_updates: the optimizer could not be set up for {what} alone "
                f"({type(e).__name__}: {str(e).splitlines()[0]}). In sparse mode each lookup "
                "table has its own optimizer state, and the other parameters share one, so "
                "a mask or labels given as a dict keyed by every parameter's name do not fit; "
                "give them as a function of the parameters, or use sparse_updates=False"
            ) from e

    def _scale(self, params) -> float:
        if self.clip_threshold is None:
            return 1.0
        sq = 0.0
        for p in params:
            if p._grad is not None:
                sq += float(jnp.vdot(p._grad, p._grad))
        norm = float(np.sqrt(sq))
        self.last_grad_norm = norm
        return min(1.0, self.clip_threshold / norm) if norm > 0 else 1.0

    def update(self, **extra_args) -> None:
        """Apply one optimizer step from the accumulated gradients, then zero them.

        Does nothing when no gradient was accumulated since the last update. Keyword
        arguments go to the transform's ``update`` as Optax's extra arguments, e.g.
        ``trainer.update(value=loss)`` for ``optax.contrib.reduce_on_plateau`` (an
        Expression is passed as its value); a transform that takes none ignores them.
        """
        extra = {k: np.asarray(v.value()) if isinstance(v, Expression) else v
                 for k, v in extra_args.items()}
        params = []
        for p in self.pc.parameters():
            if p.updated:
                params.append(p)
            elif p._has_grad:  # frozen (p.set_updated(False)): its gradient is dropped
                p.zero_grad()
        if not any(p._has_grad for p in params):
            return
        # held: a Ctrl-C between a step's call and storing its results (its inputs donated,
        # so deleted) would lose the model
        with compiles_count_for_current_graph(), interrupts_held():
            try:
                self._update(params, extra)
            except TypeError as e:  # raised while tracing the first step: nothing changed
                if extra or "required keyword" not in str(e):
                    raise
                raise ArgumentTypeError(
                    f"{type(self).__name__}.update: the optimizer's update needs extra "
                    f"arguments ({e}); pass them to the trainer's, e.g. "
                    "trainer.update(value=loss) for optax.contrib.reduce_on_plateau") from e

    def _update(self, params, extra) -> None:
        self._sync(params)
        scale = np.float32(self._scale(params))
        lr_scale = np.float32(self._lr_scale)
        groups, tables = self._groups(params)
        dense = groups[""]
        if dense:
            values = {p.name: p._own_value() for p in dense}
            grads = {p.name: (p._grad if p._grad is not None else zeros(p.shape, p.dtype))
                     for p in dense}
            new, self._state[""] = self._dense_step(values, grads, self._state[""], scale,
                                                     lr_scale, extra)
            for p in dense:
                p._value = new[p.name]
                self._clear_grad(p)
        for p in tables:
            self._update_table(p, scale, lr_scale, extra)
        self.updates += 1

    @property
    def learning_rate_scale(self) -> float:
        """The factor on every update (see the class docstring)."""
        return self._lr_scale

    @learning_rate_scale.setter
    def learning_rate_scale(self, value) -> None:
        self._lr_scale = _non_negative(value, f"{type(self).__name__}.learning_rate_scale")

    @property
    def learning_rate(self) -> float:
        """The learning rate of the next update, as in DyNet: the rate this trainer was made
        with (a schedule's value at ``updates``) times ``learning_rate_scale``. Setting it
        sets the scale. Only the convenience trainers know their rate; a ``Trainer`` made
        from an Optax transform has ``learning_rate_scale`` alone."""
        base = self._base_learning_rate
        if base is None:
            raise AttributeError(f"{type(self).__name__} was given an Optax transform, whose "
                                 "learning rate it does not know; use learning_rate_scale")
        if callable(base):
            base = base(self.updates)
        return float(base) * self._lr_scale

    @learning_rate.setter
    def learning_rate(self, value) -> None:
        base = self._base_learning_rate
        name = type(self).__name__
        if base is None or callable(base) or float(base) == 0.0:
            what = "unknown" if base is None else "a schedule" if callable(base) else base
            raise ValueError(f"{name}: cannot set learning_rate when the trainer's rate is "
                             f"{what}; set learning_rate_scale instead")
        self.learning_rate_scale = _non_negative(value, f"{name}.learning_rate") / float(base)

    def _update_table(self, p: LookupParameter, scale, lr_scale, extra):
        if not p._has_grad:  # no row to update; the step count advances all the same
            state = self._state[p.name]
            if not all(_per_element(leaf, p.shape) for leaf in jax.tree_util.tree_leaves(state)):
                self._state[p.name] = self._tick(p._value, state, extra)
            return
        value = p._own_value()
        if p.touched is None:  # used as a whole somewhere: dense step for this table
            p._value, self._state[p.name] = self._dense_step(
                value, p._grad, self._state[p.name], scale, lr_scale, extra)
            p.zero_grad()
            return
        padded = _padded_rows(p.touched)
        p._value, self._state[p.name] = self._sparse_step(
            value, p._grad, self._state[p.name], padded, np.int32(len(p.touched)), scale,
            lr_scale, extra)
        self._clear_grad(p, padded)

    def _clear_grad(self, p, padded=None) -> None:
        """Zero ``p``'s gradient after an update. A lookup table whose gradient is on the
        rows it looked up only keeps its buffer (held between updates) and zeroes those
        rows in place: a fresh zero table each update cost the Tree-LSTM's 20,000 x 300
        embeddings 1.5-12 ms of device time a call (the allocation's page faults, in a
        profile of the training loop), against writing its ~1,400 used rows."""
        if not isinstance(p, LookupParameter) or not p.touched or p._grad is None:
            p.zero_grad()
            return
        p._grad = self._zero_rows(p._grad, _padded_rows(p.touched) if padded is None
                                  else padded)
        p._has_grad = False
        p.touched = set()

    def restart(self, learning_rate=None) -> None:
        """DyNet's ``restart``: forget the optimizer's state (moments, accumulators and the
        step count, so a schedule starts over), as if the trainer were new. Gradients
        accumulated since the last update are kept. ``learning_rate``, if given, is set as
        ``trainer.learning_rate = learning_rate`` would set it."""
        if learning_rate is not None:
            self.learning_rate = learning_rate
        self._names, self._state = (), {}
        self.updates = 0

    def status(self) -> str:
        """Print a one-line summary (updates so far, last gradient norm if clipping), as
        DyNet's ``status()`` does, and return it."""
        s = f"{type(self).__name__}: {self.updates} updates"
        if self.last_grad_norm is not None:
            s += f", last grad norm {self.last_grad_norm:.4g}"
        print(s, flush=True)
        return s

    def set_clip_threshold(self, threshold) -> None:
        """DyNet's: rescale the gradients so their global L2 norm is at most ``threshold``;
        0 turns clipping off (dynax's default; DyNet's trainers clip at 5 by default)."""
        self.clip_threshold = _clip_threshold(threshold, "set_clip_threshold: threshold")

    def get_clip_threshold(self) -> float:
        """The clipping threshold (0.0 when clipping is off)."""
        return 0.0 if self.clip_threshold is None else float(self.clip_threshold)

    def set_sparse_updates(self, sparse: bool) -> None:
        """DyNet's: update lookup tables on their used rows only (see the module doc)."""
        if not isinstance(sparse, (bool, np.bool_)):
            raise ArgumentTypeError(f"set_sparse_updates: expected a bool, got {sparse!r}")
        self.sparse_updates = bool(sparse)


def _padded_rows(touched) -> np.ndarray:
    """A table's used rows, sorted, padded with the first to a bucketed length (bounded
    compiles of the row kernels)."""
    rows = sorted(touched)
    padded = np.full(bucket(max(8, len(rows))), rows[0], np.int32)
    padded[: len(rows)] = rows
    return padded


def _per_element(leaf, shape) -> bool:
    """Whether an optimizer state leaf holds one value per element of a table of ``shape``
    (Adam's moments), rather than shared state (the step count)."""
    return getattr(leaf, "shape", None) == shape


def _rows_of(state, shape, rows):
    """The optimizer state of ``rows`` of a table: its per-element leaves indexed, the
    shared ones as they are."""
    return jax.tree_util.tree_map(lambda leaf: leaf[rows] if _per_element(leaf, shape) else leaf,
                                  state)


def _leaf_key(path, leaf, names, table=None):
    """Where a leaf of an Optax state belongs, whatever the state's layout: ``(parameter
    name, path without the name)`` for a parameter's own leaf (under its name in the dense
    group's per-parameter dicts, or in a sparse table's own state: ``table``), ``(None,
    path)`` for a shared one (the step count). ``names`` are the parameters' names: other
    dict keys on the path (``multi_transform``'s labels, ``named_chain``'s names) are part
    of the place, not the owner."""
    for i in reversed(range(len(path))):
        k = path[i]
        if isinstance(k, jax.tree_util.DictKey) and k.key in names:
            return k.key, tuple(path[:i]) + tuple(path[i + 1:])
    if table is not None and getattr(leaf, "shape", ()) != ():
        return table, tuple(path)
    return None, tuple(path)


def _known_leaves(states: dict, names) -> dict:
    """Every leaf of a trainer's states (``""`` the dense group, else a table's name) by
    ``_leaf_key``. A shared leaf (the step count) is taken from a table first: every update
    advances the tables' counts, while the dense group's stays put while it is empty."""
    known = {}
    for name in sorted(states, key=lambda name: name == ""):
        for path, leaf in jax.tree_util.tree_leaves_with_path(states[name]):
            known.setdefault(_leaf_key(path, leaf, names, name or None), leaf)
    return known


def _carry_over(new, known: dict, names, table=None):
    """``new`` (a freshly initialised Optax state, of the dense group or of ``table``) with
    every leaf that ``known`` has for the same parameter and place (and shape) taken from
    it: parameters added to a collection get fresh moments, the others keep theirs (also
    when a table moves between the dense group and its own sparse state), and the step
    count goes on, as in DyNet."""
    def pick(path, leaf):
        prev = known.get(_leaf_key(path, leaf, names, table))
        ok = prev is not None and getattr(prev, "shape", None) == getattr(leaf, "shape", None)
        # a copy: the steps donate their state, and a leaf may be carried to two places
        return jnp.array(prev, copy=True) if ok else leaf

    return jax.tree_util.tree_map_with_path(pick, new)


# States of transforms that gather gradients over several steps and apply them later: row
# by row, the rows a later step does not use would never be applied (gradients lost, not
# the "lazy" variant), so sparse mode refuses them.
_ACCUMULATING = tuple(t for t in (getattr(optax, "MultiStepsState", None),
                                  getattr(optax, "ApplyEvery", None)) if t is not None)


def _check_row_wise(p: LookupParameter, state) -> None:
    """Raise unless every leaf of a table's optimizer state is per element (the table's
    shape) or scalar, the two kinds a row-wise update can handle, and no transform
    accumulates gradients over steps."""
    nodes = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, _ACCUMULATING))
    for node in nodes:
        if isinstance(node, _ACCUMULATING):
            raise ValueError(
                f"sparse_updates: the optimizer accumulates gradients over steps "
                f"({type(node).__name__}) and applies them later, which a row-wise update "
                f"of lookup table {p.name!r} would lose for rows the applying step does not "
                "use. Use sparse_updates=False for this optimizer.")
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        shape = getattr(leaf, "shape", ())
        if shape not in ((), tuple(p.shape)):
            raise ValueError(
                f"sparse_updates: the optimizer keeps state of shape {tuple(shape)} "
                f"({jax.tree_util.keystr(path)}) for lookup table {p.name!r} of shape "
                f"{tuple(p.shape)}; only state per element or scalar state can be updated "
                "row by row. Use sparse_updates=False for this optimizer.")


def _non_negative(value, what: str) -> float:
    """``value`` as a float, or a ValueError naming ``what`` unless finite and >= 0. A 0-d
    numeric array (``jnp.float32(0.5)``, as Optax takes rates) counts as its number."""
    if getattr(value, "shape", None) == () and getattr(getattr(value, "dtype", None),
                                                          "kind", None) in ("i", "u", "f"):
        value = float(value)
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not (ok and np.isfinite(value) and value >= 0):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


def _clip_threshold(value, what: str) -> float | None:
    """A clipping threshold: a finite number >= 0, where 0 turns clipping off (None)."""
    t = _non_negative(value, what)
    return t if t > 0 else None


def _rate(value, what: str):
    """A learning rate: an Optax schedule (a callable of the step count) as it is, else a
    finite number >= 0 (a negative one would climb the gradient)."""
    return value if callable(value) else _non_negative(value, what)


class SimpleSGDTrainer(Trainer):
    """Plain SGD: ``p -= learning_rate * grad`` (lookup tables sparsely: it is exact)."""

    sparse_is_exact = True

    def __init__(self, pc, learning_rate=0.1, **kwargs):
        learning_rate = _rate(learning_rate, "SimpleSGDTrainer: learning_rate")
        super().__init__(pc, optax.sgd(learning_rate), **kwargs)
        self._base_learning_rate = learning_rate


class MomentumSGDTrainer(Trainer):
    """SGD with (heavy-ball) momentum."""

    def __init__(self, pc, learning_rate=0.01, mom: float = 0.9, **kwargs):
        learning_rate = _rate(learning_rate, "MomentumSGDTrainer: learning_rate")
        super().__init__(pc, optax.sgd(learning_rate, momentum=mom), **kwargs)
        self._base_learning_rate = learning_rate


class AdagradTrainer(Trainer):
    """Adagrad as DyNet computes it: ``h += g**2; p -= learning_rate * g / sqrt(h + eps)``,
    ``h`` starting at zero (Optax's ``adagrad`` starts it at 0.1 by default, which made the
    first steps up to ~30x smaller than DyNet's). Lookup tables sparsely: it is exact."""

    sparse_is_exact = True

    def __init__(self, pc, learning_rate=0.1, eps: float = 1e-20, **kwargs):
        learning_rate = _rate(learning_rate, "AdagradTrainer: learning_rate")
        super().__init__(pc, optax.adagrad(learning_rate, initial_accumulator_value=0.0,
                                           eps=eps), **kwargs)
        self._base_learning_rate = learning_rate


class AdamTrainer(Trainer):
    """Adam (Kingma & Ba, 2015); ``sparse_updates=True`` gives lookup tables the lazy,
    row-wise variant (DyNet's default)."""

    def __init__(self, pc, alpha=1e-3, beta_1: float = 0.9, beta_2: float = 0.999,
                 eps: float = 1e-8, **kwargs):
        alpha = _rate(alpha, "AdamTrainer: alpha")
        super().__init__(pc, optax.adam(alpha, beta_1, beta_2, eps), **kwargs)
        self._base_learning_rate = alpha


class RMSPropTrainer(Trainer):
    """RMSProp as DyNet's: ``v = rho v + (1 - rho) g**2; p -= learning_rate g /
    sqrt(v + eps)``, with DyNet's argument order ``(learning_rate, eps, rho)``."""

    def __init__(self, pc, learning_rate=0.001, eps: float = 1e-8, rho: float = 0.9,
                 **kwargs):
        learning_rate = _rate(learning_rate, "RMSPropTrainer: learning_rate")
        super().__init__(pc, optax.rmsprop(learning_rate, decay=rho, eps=eps,
                                           eps_in_sqrt=True), **kwargs)
        self._base_learning_rate = learning_rate


class AdadeltaTrainer(Trainer):
    """Adadelta (Zeiler, 2012) as DyNet's: no learning rate (1.0), ``rho`` the decay of the
    running averages of squared gradients and squared updates."""

    def __init__(self, pc, eps: float = 1e-6, rho: float = 0.95, **kwargs):
        # Optax's adadelta with learning_rate=None returns the ascent direction: 1.0 it is
        super().__init__(pc, optax.adadelta(1.0, rho=rho, eps=eps), **kwargs)
        self._base_learning_rate = 1.0


def dynet_amsgrad(learning_rate: float, beta_1: float = 0.9, beta_2: float = 0.999,
                  eps: float = 1e-8) -> optax.GradientTransformation:
    """AMSGrad as DyNet updates (Reddi et al., 2018): the moments ``m``, ``v`` as Adam's, the
    running maximum ``vmax`` of the raw ``v``, and at update ``t``
    ``p -= lr sqrt(1 - beta_2^t) / (1 - beta_1^t) m / (sqrt(vmax) + eps)``. Optax's
    ``amsgrad`` takes the maximum of the bias-corrected ``v`` instead, which keeps the
    large early values (``v / (1 - beta_2^t)``) far longer: another optimizer."""
    def init(params):
        def zeros():  # one buffer each: the trainer donates the state
            return jax.tree_util.tree_map(jnp.zeros_like, params)
        return {"m": zeros(), "v": zeros(), "vmax": zeros(), "count": jnp.zeros((), jnp.int32)}

    def update(grads, state, params=None):
        t = state["count"] + 1
        tmap = jax.tree_util.tree_map
        m = tmap(lambda m, g: beta_1 * m + (1 - beta_1) * g, state["m"], grads)
        v = tmap(lambda v, g: beta_2 * v + (1 - beta_2) * g * g, state["v"], grads)
        vmax = tmap(jnp.maximum, state["vmax"], v)
        lr_t = learning_rate * jnp.sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t)
        updates = tmap(lambda m, vm: -lr_t * m / (jnp.sqrt(vm) + eps), m, vmax)
        return updates, {"m": m, "v": v, "vmax": vmax, "count": t}

    return optax.GradientTransformation(init, update)


class AmsgradTrainer(Trainer):
    """AMSGrad (Reddi et al., 2018) as DyNet's (``dynet_amsgrad``): Adam with the running
    maximum of the second moment."""

    def __init__(self, pc, learning_rate=0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 eps: float = 1e-8, **kwargs):
        learning_rate = _rate(learning_rate, "AmsgradTrainer: learning_rate")
        super().__init__(pc, dynet_amsgrad(learning_rate, beta_1, beta_2, eps), **kwargs)
        self._base_learning_rate = learning_rate


def cyclical_learning_rate(learning_rate_min: float, learning_rate_max: float,
                           step_size: int, gamma: float = 1.0):
    """Smith's (2017) triangular cyclical rate as a schedule of the update count ``t``: from
    ``learning_rate_min`` up to ``learning_rate_max`` in ``step_size`` updates and back, the
    amplitude times ``gamma ** t``."""
    def schedule(t):
        cycle = jnp.floor(1 + t / (2 * step_size))
        x = jnp.abs(t / step_size - 2 * cycle + 1)
        amplitude = (learning_rate_max - learning_rate_min) * jnp.maximum(0.0, 1.0 - x)
        return learning_rate_min + amplitude * gamma ** t
    return schedule


class CyclicalSGDTrainer(Trainer):
    """SGD with DyNet's cyclical learning rate (``cyclical_learning_rate``; Smith, 2017);
    ``gamma`` decays the amplitude per update, 1.0 (the default) not at all. DyNet's
    default is ``gamma=0.0``, under which ``gamma ** t`` holds the rate at
    ``learning_rate_min`` from the second update on (its training.h); pass ``gamma=0.0``
    to reproduce that, or nothing for the cycle."""

    sparse_is_exact = True

    def __init__(self, pc, learning_rate_min: float = 0.01, learning_rate_max: float = 0.1,
                 step_size: int = 2000, gamma: float = 1.0, **kwargs):
        if isinstance(step_size, bool) or not isinstance(step_size, int) or step_size < 1:
            raise ValueError(f"CyclicalSGDTrainer: step_size must be an int >= 1, got "
                             f"{step_size!r}")
        lo = _non_negative(learning_rate_min, "CyclicalSGDTrainer: learning_rate_min")
        hi = _non_negative(learning_rate_max, "CyclicalSGDTrainer: learning_rate_max")
        if hi < lo:
            raise ValueError(f"CyclicalSGDTrainer: learning_rate_max ({hi}) is below "
                             f"learning_rate_min ({lo})")
        schedule = cyclical_learning_rate(lo, hi, step_size,
                                          _non_negative(gamma, "CyclicalSGDTrainer: gamma"))
        super().__init__(pc, optax.sgd(schedule), **kwargs)
        self._base_learning_rate = schedule


def exponentiated_gradient(learning_rate: float, momentum: float = 0.9
                           ) -> optax.GradientTransformation:
    """Exponentiated gradient with momentum (Kivinen & Warmuth, 1997), as DyNet's
    ``EGTrainer`` updates: ``h <- momentum * h - learning_rate * g``, then each parameter
    becomes ``w * exp(h)`` normalised to sum to 1 over all its entries. The parameters must
    be positive (a distribution, e.g. initialised to ``1 / size``); ``log(w)`` of a zero or
    negative entry makes the update NaN, as DyNet's."""
    def init(params):
        return jax.tree_util.tree_map(jnp.zeros_like, params)

    def update(grads, h, params=None):  # optax's signature: params may be left out
        if params is None:
            raise ValueError("exponentiated_gradient needs the parameters' values")
        h = jax.tree_util.tree_map(lambda h, g: momentum * h - learning_rate * g, h, grads)

        def step(w, h):  # the softmax of log(w) + h over all entries, minus w
            return jax.nn.softmax((jnp.log(w) + h).ravel()).reshape(w.shape) - w
        return jax.tree_util.tree_map(step, params, h), h

    return optax.GradientTransformation(init, update)


class EGTrainer(Trainer):
    """DyNet's exponentiated-gradient trainer (``exponentiated_gradient``): for parameters
    that are distributions. Dense only: the normalisation runs over each whole parameter,
    lookup tables included, which an update of the used rows alone would not keep.
    ``learning_rate`` enters through the momentum, not linearly in the step, so
    ``learning_rate_scale`` (and setting ``learning_rate``) scales the gradient instead of
    the step, which is the same as scaling the rate."""

    _DENSE_ONLY = "EGTrainer: sparse_updates is not offered (each parameter is normalised " \
                  "as a whole)"

    def __init__(self, pc, learning_rate: float = 0.1, mom: float = 0.9, **kwargs):
        if kwargs.get("sparse_updates"):
            raise ValueError(self._DENSE_ONLY)
        lr = _non_negative(learning_rate, "EGTrainer: learning_rate")
        super().__init__(pc, exponentiated_gradient(lr, _non_negative(mom, "EGTrainer: mom")),
                         **kwargs)
        self._base_learning_rate = lr

    def _apply(self, values, grads, state, scale, lr_scale, extra):
        return super()._apply(values, grads, state, scale * lr_scale, 1.0, extra)

    def set_sparse_updates(self, sparse: bool) -> None:
        super().set_sparse_updates(sparse)
        if self.sparse_updates:
            self.sparse_updates = False
            raise ValueError(self._DENSE_ONLY)
