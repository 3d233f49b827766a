"""Recurrent builders: ``SimpleRNNBuilder``, ``LSTMBuilder``, ``GRUBuilder``, ``BiRNNBuilder``.

DyNet's interface: a builder owns the parameters (in its own subcollection), a *state* is an
immutable position in a sequence::

    s = builder.initial_state()          # zeros, or initial_state(vecs)
    s2 = s.add_input(x)                  # a new state; s is unchanged
    s2.output()                          # top-layer h
    hs = builder.initial_state().transduce(xs)

Each layer step is ONE graph node (a ``@dx.function`` cell; ``BiRNNBuilder`` puts a step of
each direction in one node), so the autobatcher runs the same step of many sequences (and of
different time steps that are ready together) as one kernel.
Equations, with ``σ`` the logistic sigmoid and ``[W_x | W_h]`` one layer's weights:

* SimpleRNN: ``h' = tanh(W_x x + W_h h + b)``
* LSTM (gates stacked ``i, f, o, g``; forget bias initialised to 1):
  ``c' = σ(i) ⊙ tanh(g) + σ(f) ⊙ c``, ``h' = σ(o) ⊙ tanh(c')``
* GRU (stacked ``z, r, n``; Cho et al. 2014):
  ``z = σ(..), r = σ(..)``, ``n = tanh(W_xn x + W_hn (r ⊙ h) + b_n)``, ``h' = (1 - z) ⊙ n + z ⊙ h``

Dropout (``set_dropout(d)``, ``set_dropouts(d, d_h)``) is variational, as in DyNet's LSTM
builders: a sequence's masks ``m_x, m_h`` are drawn once, by ``initial_state()``, and each
step reads ``m_x ⊙ x`` and, in its products ``W_h ·``, ``m_h ⊙ h``. The masks are arguments
of the step's node, so dropout adds no node per step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ArgumentTypeError, InvalidArgumentError, ShapeError, StaleExpressionError
from ..graph.appenders import append_node
from ..graph.computation_graph import current_graph
from ..graph.expression import Expression
from ..ops import core as ops
from ..ops.extra import const_parameter
from ..ops.function import function
from .lstm_state import lstm_state
from .parameters import Parameter, ParameterCollection


# ---- cells: one single-instance step each (one graph node per call) ----------------------------
# Each step function takes ``hr``, the previous h as the recurrent products read it: h itself,
# or h times its dropout mask (the carried state of a GRU is never masked, only its products).

def _rnn_step(x, h, hr, Wx, Wh, b):
    return jnp.tanh(Wx @ x + Wh @ hr + b)


def _lstm_step(x, c, h, hr, Wx, Wh, b):
    i, f, o, g = jnp.split(Wx @ x + Wh @ hr + b, 4)
    return lstm_state(i, g, o, (f,), (c,))


def _coupled_lstm_step(x, c, h, hr, Wx, Wh, b, Wic, Woc):
    i, o, g = jnp.split(Wx @ x + Wh @ hr + b, 3)
    i = jax.nn.sigmoid(i + Wic @ c)  # peephole on the old cell; the forget gate is 1 - i
    c2 = c + (jnp.tanh(g) - c) * i
    return c2, jax.nn.sigmoid(o + Woc @ c2) * jnp.tanh(c2)


def _gru_step(x, h, hr, Wx, Wh, b):
    n_h = h.shape[0]
    gx = Wx @ x + b
    zr = jax.nn.sigmoid(gx[:2 * n_h] + Wh[:2 * n_h] @ hr)
    z, r = zr[:n_h], zr[n_h:]
    n = jnp.tanh(gx[2 * n_h:] + Wh[2 * n_h:] @ (r * hr))
    return (1.0 - z) * n + z * h


@function
def _rnn_cell(x, h, Wx, Wh, b):
    return _rnn_step(x, h, h, Wx, Wh, b)


@function
def _rnn_cell_dropout(x, h, mx, mh, Wx, Wh, b):
    return _rnn_step(x * mx, h, h * mh, Wx, Wh, b)


@function
def _lstm_cell(x, c, h, Wx, Wh, b):
    return _lstm_step(x, c, h, h, Wx, Wh, b)


@function
def _lstm_cell_dropout(x, c, h, mx, mh, Wx, Wh, b):
    return _lstm_step(x * mx, c, h, h * mh, Wx, Wh, b)


@function
def _coupled_lstm_cell(x, c, h, Wx, Wh, b, Wic, Woc):
    return _coupled_lstm_step(x, c, h, h, Wx, Wh, b, Wic, Woc)


@function
def _coupled_lstm_cell_dropout(x, c, h, mx, mh, Wx, Wh, b, Wic, Woc):
    return _coupled_lstm_step(x * mx, c, h, h * mh, Wx, Wh, b, Wic, Woc)


@function
def _gru_cell(x, h, Wx, Wh, b):
    return _gru_step(x, h, h, Wx, Wh, b)


@function
def _gru_cell_dropout(x, h, mx, mh, Wx, Wh, b):
    return _gru_step(x * mx, h, h * mh, Wx, Wh, b)


# ---- helpers ------------------------------------------------------------------------------------

def _fresh_subcollection(pc, base: str):
    """A subcollection named ``base`` (or ``base_1``, ``base_2``, ...) that holds nothing yet."""
    if not isinstance(pc, ParameterCollection):
        raise ArgumentTypeError(f"{base}: a builder's parameters need a dx.ParameterCollection, "
                                f"got {type(pc).__name__}")
    name, i = base, 0
    while True:
        sub = pc.add_subcollection(name)
        if not sub.parameters():
            return sub
        i += 1
        name = f"{base}_{i}"


def _check_dims(who, **dims):
    for k, v in dims.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise InvalidArgumentError(f"{who}: {k} must be a positive integer, got {v!r}")


def _frozen(params) -> tuple:
    """No-gradient copies of ``params`` in the current graph (DyNet's ``update=False``),
    made once per graph, as DyNet's builders make their parameter expressions: a batch of
    steps then reads one shared copy of each weight (and a failed construction that removes
    them removes them from the graph's record too: ``ComputationGraph.rollback``). None (a
    bias not built) stays None."""
    g = current_graph()
    out = []
    for p in params:
        if p is None:
            out.append(None)
            continue
        v = g.frozen_params.get(p)
        if v is None:
            v = g.frozen_params[p] = const_parameter(p).v
        out.append(Expression(g, v))
    return tuple(out)


def _as_expr(x, who: str, what: str):
    """A builder's vector argument ``what`` of ``who`` as an Expression: a Parameter joins
    the graph as itself (a learned start vector or initial state), an array as a constant;
    anything else (None: a state's missing input) is refused, naming the builder call."""
    if type(x) is Expression:
        return x
    if isinstance(x, Parameter):
        return ops.parameter(x)
    if not isinstance(x, (np.ndarray, jax.Array, list, tuple)):
        raise ArgumentTypeError(f"{who}: {what} must be an Expression, a Parameter or an "
                                f"array, got {type(x).__name__} {x!r}")
    return ops.input(x)


def _check_vector(who, what, x, dim):
    if not x.g.alive:  # named here: the cell op below would name itself, not the builder
        raise StaleExpressionError(f"{who}: {what} belongs to a computation graph "
                                   f"{x.g.retired_because}; build it again on the current graph")
    if tuple(x.shape) != (dim,):
        raise ShapeError(f"{who}: {what} must have shape ({dim},), got {tuple(x.shape)}"
                         f"{ops.dynet_dims_hint([tuple(x.shape)])}")


def _vector_arg(who, what, x, dim):
    """``x`` as an Expression of shape ``(dim,)``; if it does not fit, the error leaves the
    graph as it was (an array's constant is removed again)."""
    if type(x) is Expression:
        _check_vector(who, what, x, dim)
        return x
    return ops.atomic(_converted_vector)(who, what, x, dim)


def _converted_vector(who, what, x, dim):
    x = _as_expr(x, who, what)
    _check_vector(who, what, x, dim)
    return x


# ---- state --------------------------------------------------------------------------------------

class RNNState:
    """An immutable position in a sequence: per layer, a tuple of state vectors (h last).

    ``add_input`` returns a new state; the old one stays valid, so several continuations of
    one prefix can be built (beam search).
    """

    __slots__ = ("builder", "layers", "masks", "_prev", "params")

    def __init__(self, builder, layers, prev=None, masks=None, params=None):
        self.builder = builder
        self.layers = layers  # tuple over layers of tuples of Expressions (h is the last)
        self.masks = masks  # per layer (x mask, h mask), drawn once per sequence; or None
        self._prev = prev
        self.params = params  # per layer, the weights' no-gradient copies; None: the builder's

    def add_input(self, x) -> "RNNState":
        """The state after reading ``x`` (a vector of ``input_dim``)."""
        if type(x) is not Expression:  # an array becomes a constant: undone on failure
            return ops.atomic(self._add_input)(x)
        return self._add_input(x)

    def _add_input(self, x) -> "RNNState":
        b = self.builder
        who = type(b).__name__ + ".add_input"
        g = self.layers[0][-1].g
        if not g.alive:  # before any node is added (dropout's)
            raise StaleExpressionError(f"{who}: this state belongs to a computation graph "
                                       f"{g.retired_because}; start again from "
                                       "initial_state() on the current graph")
        x = _as_expr(x, who, "input")
        _check_vector(who, "input", x, b.input_dim)
        new, inp, masks = [], x, self.masks
        for layer, (params, state) in enumerate(zip(self.params or b.params, self.layers)):
            out = b._step(params, inp, state, None if masks is None else masks[layer])
            new.append(out)
            inp = out[-1]
        return RNNState(b, tuple(new), self, masks, self.params)

    @ops.atomic
    def add_inputs(self, xs) -> list["RNNState"]:
        """The states after each input of ``xs`` in turn (all or nothing: if one input is
        bad, the steps already added are removed again)."""
        states, s = [], self
        for x in xs:
            s = s.add_input(x)
            states.append(s)
        return states

    def transduce(self, xs) -> list[Expression]:
        """The top-layer outputs after each input of ``xs``."""
        return [s.output() for s in self.add_inputs(xs)]

    def output(self) -> Expression:
        """The top layer's h."""
        return self.layers[-1][-1]

    def h(self) -> list:
        """h of every layer, bottom to top (a new list, as DyNet's)."""
        return [layer[-1] for layer in self.layers]

    def s(self) -> list:
        """All state vectors in DyNet's order (LSTM: ``c_1..c_L, h_1..h_L``; others: h)."""
        return [layer[k] for k in range(len(self.layers[0])) for layer in self.layers]

    def prev(self) -> "RNNState | None":
        """The state this one was made from (None for an initial state)."""
        return self._prev

    def set_h(self, es) -> "RNNState":
        """A new state with every layer's h replaced by ``es`` (one vector per layer, bottom
        to top); an LSTM's cells are kept. As DyNet's, its ``prev()`` is this state."""
        return self._replaced("set_h", es, len(self.layers[0]) - 1)

    def set_s(self, es) -> "RNNState":
        """A new state made of the vectors ``es``, in the order of ``s()`` (LSTM:
        ``[c_1..c_L, h_1..h_L]``); its ``prev()`` is this state."""
        return self._replaced("set_s", es, 0)

    @ops.atomic
    def _replaced(self, name, es, first):
        """The state with vectors ``first..`` of every layer (in ``s()`` order) replaced."""
        b = self.builder
        who = f"{type(b).__name__} state.{name}"
        g = self.layers[0][-1].g
        if not g.alive:
            raise StaleExpressionError(f"{who}: this state belongs to a computation graph "
                                       f"{g.retired_because}")
        L, n = len(self.layers), len(self.layers[0])
        if not isinstance(es, (list, tuple)):
            raise ArgumentTypeError(f"{who}: expected a list of {(n - first) * L} vectors, "
                                    f"got {type(es).__name__}")
        if len(es) != (n - first) * L:
            raise InvalidArgumentError(f"{who}: expected {(n - first) * L} vectors "
                                       f"({n - first} per layer for {L} layers), got {len(es)}")
        es = [_vector_arg(who, "each vector", e, b.hidden_dim) for e in es]
        layers = tuple(layer[:first] + tuple(es[(k - first) * L + i] for k in range(first, n))
                       for i, layer in enumerate(self.layers))
        return RNNState(b, layers, self, self.masks, self.params)


# ---- builders -----------------------------------------------------------------------------------

def _check_rate(who, p):
    if isinstance(p, bool) or not isinstance(p, (int, float, np.integer, np.floating)) \
            or not 0.0 <= p < 1.0:
        raise InvalidArgumentError(f"{who}: a dropout rate must be a number in [0, 1), got {p!r}")
    return float(p)


def _mask(dim, p):
    """An inverted-dropout mask: entries 0 with probability ``p``, else 1/(1-p) (ones if 0)."""
    return ops.dropout(ops.ones((dim,)), p)


class _RNNBuilder:
    """Shared machinery: parameters per layer, initial states, dropout."""

    _name = "rnn"
    _n_states = 1  # state vectors per layer
    _gates = 1  # stacked gate blocks in the weights

    def __init__(self, layers: int, input_dim: int, hidden_dim: int, pc):
        who = type(self).__name__
        _check_dims(who, layers=layers, input_dim=input_dim, hidden_dim=hidden_dim)
        self.layers, self.input_dim, self.hidden_dim = int(layers), int(input_dim), int(hidden_dim)
        self.pc = _fresh_subcollection(pc, self._name)
        self.params = []
        for layer in range(self.layers):
            in_dim = self.input_dim if layer == 0 else self.hidden_dim
            n = self._gates * self.hidden_dim
            self.params.append((
                self.pc.add_parameters((n, in_dim), name=f"Wx{layer}"),
                self.pc.add_parameters((n, self.hidden_dim), name=f"Wh{layer}"),
                self.pc.add_parameters((n,), init=self._bias_init(), name=f"b{layer}")))
        self.dropout_rate = self.dropout_rate_h = 0.0

    def _bias_init(self):
        return "zeros"

    _cell = None  # the Function of one layer step: cell(x, *state, *params) -> new state
    _dropout_cell = None  # the same with masks: cell(x, *state, x_mask, h_mask, *params)

    def _step(self, params, x, state, masks=None):
        if masks is None:
            out = self._cell(x, *state, *params)
        else:
            out = self._dropout_cell(x, *state, *masks, *params)
        return out if isinstance(out, tuple) else (out,)

    def param_collection(self):
        """The subcollection holding this builder's parameters."""
        return self.pc

    def get_parameters(self) -> list[list[Parameter]]:
        """Per layer, its parameters (``[W_x, W_h, b]``, and a coupled LSTM's peepholes
        ``W_ic, W_oc``), as DyNet's."""
        return [list(layer) for layer in self.params]

    def get_parameter_expressions(self) -> list[list[Expression]]:
        """``get_parameters()`` as Expressions of the current graph."""
        return [[ops.parameter(p) for p in layer] for layer in self.params]

    def set_dropout(self, p: float, d_h: float | None = None) -> None:
        """Drop the input and the recurrent h of every layer with rate ``p`` (0 disables):
        ``set_dropouts(p, p)``, as DyNet's ``set_dropout``; with ``d_h`` (DyNet's
        ``CompactVanillaLSTMBuilder.set_dropout(d, d_r)``), ``set_dropouts(p, d_h)``."""
        self.set_dropouts(p, p if d_h is None else d_h)

    def set_dropouts(self, d: float, d_h: float) -> None:
        """Variational dropout (Gal & Ghahramani 2016), as DyNet's LSTM builders: each
        ``initial_state()`` draws one mask per layer for its input (rate ``d``) and one for
        the h its recurrent products read (rate ``d_h``); every step of that sequence reuses
        them. The h a state outputs is not masked, and neither is the state a GRU carries.
        Masks are ``dx.dropout`` masks, so a graph built with ``train=False`` has none."""
        who = type(self).__name__ + ".set_dropouts"
        d, d_h = _check_rate(who, d), _check_rate(who, d_h)
        self.dropout_rate, self.dropout_rate_h = d, d_h

    def disable_dropout(self) -> None:
        """Stop applying dropout (to sequences started from now on)."""
        self.dropout_rate = self.dropout_rate_h = 0.0

    def _sequence_masks(self, always: bool = False):
        """Per layer ``(x mask, h mask)`` for a new sequence; None without dropout, unless
        ``always`` (then masks of ones stand in)."""
        if not always and (not (self.dropout_rate or self.dropout_rate_h)
                           or not current_graph().train):
            return None
        return tuple((_mask(self.input_dim if layer == 0 else self.hidden_dim,
                            self.dropout_rate),
                      _mask(self.hidden_dim, self.dropout_rate_h))
                     for layer in range(self.layers))

    @ops.atomic
    def initial_state(self, vecs=None, update: bool = True) -> RNNState:
        """The state before any input: zeros, or the vectors ``vecs`` in the order of ``s()``
        (LSTM: ``[c_1..c_L, h_1..h_L]``; others: ``[h_1..h_L]``). With dropout set, this
        draws the sequence's masks. With ``update=False`` (DyNet's) the sequence's steps
        read the weights as constants: no gradient flows back into them."""
        who = type(self).__name__ + ".initial_state"
        update = ops._flag_arg(who, "update", update)
        n, L = self._n_states, self.layers
        if vecs is None:
            # shared by every sequence's initial state: a constant each made the char tagger
            # load ~600 per update
            z = ops.shared_zeros((self.hidden_dim,))
            layers = tuple((z,) * n for _ in range(L))
        else:
            if isinstance(vecs, (Expression, Parameter)):  # one vector, not the list
                raise ArgumentTypeError(
                    f"{who}: vecs is a list of {n * L} vectors ({n} per layer for {L} "
                    f"layers), got one {type(vecs).__name__}")
            vecs = [_as_expr(v, who, f"vector {k}") for k, v in enumerate(vecs)]
            if len(vecs) != n * L:
                raise InvalidArgumentError(
                    f"{who}: expected {n * L} vectors ({n} per layer for {L} layers), "
                    f"got {len(vecs)}")
            for v in vecs:
                _check_vector(who, "each initial vector", v, self.hidden_dim)
            layers = tuple(tuple(vecs[k * L + layer] for k in range(n)) for layer in range(L))
        params = None if update else tuple(_frozen(layer) for layer in self.params)
        return RNNState(self, layers, None, self._sequence_masks(), params)


class SimpleRNNBuilder(_RNNBuilder):
    """Elman RNN: ``h' = tanh(W_x x + W_h h + b)`` per layer; one node per layer step."""

    _name = "simple_rnn"
    _cell, _dropout_cell = _rnn_cell, _rnn_cell_dropout


class LSTMBuilder(_RNNBuilder):
    """LSTM with gates ``i, f, o, g`` stacked in ``W_x, W_h, b``; the forget gate's bias
    starts at ``forget_bias`` (1, as DyNet's; DyNet adds it at run time to a bias that
    starts at 0: the same cell at the start).

    State per layer is ``(c, h)``; ``s()`` gives ``[c_1..c_L, h_1..h_L]`` as in DyNet.
    DyNet's layer-normalised variant (``ln_lstm=True``) is not there.
    """

    _name = "lstm"
    _n_states = 2
    _gates = 4

    def __init__(self, layers: int, input_dim: int, hidden_dim: int, pc,
                 forget_bias: float = 1.0, ln_lstm: bool = False):
        if ln_lstm:
            raise InvalidArgumentError(
                f"{type(self).__name__}: ln_lstm=True (DyNet's layer-normalised LSTM) is not "
                "there; write the cell as a @dx.function with dx.nn.lstm_state, "
                "normalising its gates (jax.numpy inside the function)")
        self._forget_bias = ops._real(type(self).__name__, "forget_bias", forget_bias)
        super().__init__(layers, input_dim, hidden_dim, pc)

    def _bias_init(self):
        H = self.hidden_dim
        b = np.zeros((4 * H,), np.float32)
        b[H:2 * H] = self._forget_bias
        return b

    _cell, _dropout_cell = _lstm_cell, _lstm_cell_dropout


VanillaLSTMBuilder = LSTMBuilder  # DyNet's name for the same cell (dy.LSTMBuilder is it too)
# DyNet's fused implementation of the same equations (one node per step is dynax's anyway)
CompactVanillaLSTMBuilder = LSTMBuilder


class CoupledLSTMBuilder(_RNNBuilder):
    """DyNet's ``CoupledLSTMBuilder``: an LSTM whose forget gate is ``1 - i``, with peephole
    connections (gates ``i, o, g`` stacked in ``W_x, W_h, b``; full matrices ``W_ic, W_oc``)::

        i = σ(W_ix x + W_ih h + W_ic c + b_i)
        c' = c + (tanh(W_gx x + W_gh h + b_g) - c) ⊙ i
        h' = σ(W_ox x + W_oh h + W_oc c' + b_o) ⊙ tanh(c')

    State per layer is ``(c, h)``, as ``LSTMBuilder``'s. Dropout masks the input and the h
    the products read, not the cell the peepholes read."""

    _name = "coupled_lstm"
    _n_states = 2
    _gates = 3

    def __init__(self, layers: int, input_dim: int, hidden_dim: int, pc):
        super().__init__(layers, input_dim, hidden_dim, pc)
        H = self.hidden_dim
        self.params = [params + (self.pc.add_parameters((H, H), name=f"Wic{layer}"),
                                 self.pc.add_parameters((H, H), name=f"Woc{layer}"))
                       for layer, params in enumerate(self.params)]

    _cell, _dropout_cell = _coupled_lstm_cell, _coupled_lstm_cell_dropout


class GRUBuilder(_RNNBuilder):
    """GRU with gates ``z, r, n`` stacked in ``W_x, W_h, b`` (see the module doc)."""

    _name = "gru"
    _gates = 3
    _cell, _dropout_cell = _gru_cell, _gru_cell_dropout


class BiRNNBuilder:
    """A bidirectional stack (DyNet's ``BiRNNBuilder``).

    Each of the ``layers`` layers has a forward and a backward one-layer ``builder_cls`` of
    ``hidden_dim // 2`` units; a layer's outputs are ``concatenate([fwd_t, bwd_t])`` (size
    ``hidden_dim``) and feed the next layer. Step t of the forward direction and step t of the
    backward one (position n-1-t) are one graph node (both cells, each with its own weights),
    so a layer costs one node and one kernel launch per position, not two.
    """

    def __init__(self, layers: int, input_dim: int, hidden_dim: int, pc, builder_cls=None):
        _check_dims("BiRNNBuilder", layers=layers, input_dim=input_dim, hidden_dim=hidden_dim)
        if hidden_dim % 2:
            raise InvalidArgumentError(f"BiRNNBuilder: hidden_dim must be even (each direction has "
                                       f"hidden_dim // 2 units), got {hidden_dim}")
        builder_cls = LSTMBuilder if builder_cls is None else builder_cls
        if not (isinstance(builder_cls, type) and issubclass(builder_cls, _RNNBuilder)):
            given = (f"an instance of {type(builder_cls).__name__}"
                     if not isinstance(builder_cls, type) else builder_cls.__name__)
            raise ArgumentTypeError(
                f"BiRNNBuilder: builder_cls must be a sequence builder class (LSTMBuilder, "
                f"GRUBuilder, SimpleRNNBuilder, CoupledLSTMBuilder, ...), got {given}")
        self.layers, self.input_dim, self.hidden_dim = int(layers), int(input_dim), int(hidden_dim)
        self.pc = _fresh_subcollection(pc, "birnn")
        self.builder_layers = []
        half = self.hidden_dim // 2
        for layer in range(self.layers):
            in_dim = self.input_dim if layer == 0 else self.hidden_dim
            self.builder_layers.append(
                (builder_cls(1, in_dim, half, self.pc.add_subcollection(f"fwd{layer}")),
                 builder_cls(1, in_dim, half, self.pc.add_subcollection(f"bwd{layer}"))))

    def param_collection(self):
        """The subcollection holding this builder's parameters."""
        return self.pc

    def set_dropout(self, p: float) -> None:
        """Variational dropout of rate ``p`` on the input and recurrent h of every layer of
        both directions (see ``LSTMBuilder.set_dropouts``)."""
        self.set_dropouts(p, p)

    def set_dropouts(self, d: float, d_h: float) -> None:
        """Variational dropout on every layer of both directions: rate ``d`` on the inputs,
        ``d_h`` on the recurrent h; each ``add_inputs``/``transduce`` call draws new masks."""
        _check_rate("BiRNNBuilder.set_dropouts", d)
        _check_rate("BiRNNBuilder.set_dropouts", d_h)
        for fwd, bwd in self.builder_layers:
            fwd.set_dropouts(d, d_h)
            bwd.set_dropouts(d, d_h)

    def disable_dropout(self) -> None:
        """Stop applying dropout."""
        for fwd, bwd in self.builder_layers:
            fwd.disable_dropout()
            bwd.disable_dropout()

    @ops.atomic
    def add_inputs(self, xs) -> list[tuple[RNNState, RNNState]]:
        """Per position, the (forward, backward) states of the top layer (all or nothing)."""
        xs = list(xs)
        if not xs:
            return []
        halves = None  # the layer below's (forward, backward) outputs, not yet concatenated
        for layer, (fwd, bwd) in enumerate(self.builder_layers):
            pairable = type(fwd)._step is _RNNBuilder._step and fwd._cell is not None
            if pairable and halves is not None:
                # the concatenation happens inside the step's kernel: no node per position
                fs, bs = _both_directions(fwd, bwd, halves, split=True)
            else:
                if halves is not None:
                    xs = [ops.concatenate(list(fb)) for fb in halves]
                if pairable:
                    fs, bs = _both_directions(fwd, bwd, xs)
                else:  # a builder class with its own step
                    fs = fwd.initial_state().add_inputs(xs)
                    bs = bwd.initial_state().add_inputs(reversed(xs))[::-1]
            if layer == self.layers - 1:
                return list(zip(fs, bs))
            halves = [(f.output(), b.output()) for f, b in zip(fs, bs)]

    def transduce(self, xs) -> list[Expression]:
        """Per position, the top layer's ``concatenate([fwd, bwd])`` (size ``hidden_dim``)."""
        return [ops.concatenate([f.output(), b.output()]) for f, b in self.add_inputs(xs)]


for _cell in (_rnn_cell, _rnn_cell_dropout, _lstm_cell, _lstm_cell_dropout, _coupled_lstm_cell,
              _coupled_lstm_cell_dropout, _gru_cell, _gru_cell_dropout):
    _cell.op.sequence_step = True  # lone steps continuing a sequence run as runs (engine.py)


# ---- both directions in one node per step ----------------------------------------------------

_PAIRED: dict = {}  # (cell Function, split) -> the Function running two steps of it


def _paired(cell, split: bool = False):
    """A Function running one step of each direction: ``(x, *state, *params)`` twice.

    One node per position instead of two halves a BiRNN layer's nodes and kernel launches
    (measured on the BiLSTM tagger: 86 -> 46 batches per update). With ``split`` each x
    arrives as two halves ``(x_fwd_below, x_bwd_below)``, concatenated inside the kernel.
    """
    both = _PAIRED.get((cell, split))
    if both is None:
        one = cell.fn

        def step_both(*args):
            half = len(args) // 2
            f, b = args[:half], args[half:]
            if split:
                f = (jnp.concatenate(f[:2]),) + f[2:]
                b = (jnp.concatenate(b[:2]),) + b[2:]
            a, b = one(*f), one(*b)
            return (a if isinstance(a, tuple) else (a,)) + (b if isinstance(b, tuple) else (b,))

        step_both.__qualname__ = f"bidirectional{'_split' if split else ''}{cell.op.name}"
        both = _PAIRED[cell, split] = function(step_both)
        both.op.sequence_step = True
    return both


def _both_directions(fwd, bwd, xs, split: bool = False):
    """The states of ``fwd`` over ``xs`` and of ``bwd`` over ``xs`` reversed (aligned with
    ``xs``), with step t of ``fwd`` and step t of ``bwd`` (position n-1-t) in one node.

    With ``split`` each x is a pair of halves, the outputs of a BiRNN layer below (their
    concatenation is what a dropout mask applies to)."""
    if split:
        xf = xs
    else:
        xs = [_as_expr(x, "BiRNNBuilder.add_inputs", f"input {k}") for k, x in enumerate(xs)]
        for x in xs:
            _check_vector("BiRNNBuilder.add_inputs", "input", x, fwd.input_dim)
        xf = [(x,) for x in xs]
    (pf,), (pb,) = fwd.params, bwd.params
    sf, sb = fwd.initial_state(), bwd.initial_state()
    if sf.masks is None and sb.masks is None:
        cell, mf, mb = _paired(fwd._cell, split), (), ()
    else:  # one kernel runs both directions: one without dropout gets masks of ones
        sf, sb = (s if s.masks else RNNState(s.builder, s.layers, None,
                                             s.builder._sequence_masks(always=True))
                  for s in (sf, sb))
        cell, (mf,), (mb,) = _paired(fwd._dropout_cell, split), sf.masks, sb.masks
    n, k = len(xs), fwd._n_states
    fs, bs = [None] * n, [None] * n
    # every argument's kind is known (Expressions, then Parameters), so the nodes go straight
    # to the graph's appender: calling ``cell`` would find the kinds again for every step
    g, op = current_graph(), cell.op
    kinds = ("v" * (len(xf[0]) + k + len(mf)) + "p" * len(pf)) * 2
    for t in range(n):
        u = n - 1 - t
        out = append_node(g, op, kinds, (*xf[t], *sf.layers[0], *mf, *pf,
                                         *xf[u], *sb.layers[0], *mb, *pb))
        fs[t] = sf = RNNState(fwd, (out[:k],), sf, sf.masks)
        bs[u] = sb = RNNState(bwd, (out[k:],), sb, sb.masks)
    return fs, bs
