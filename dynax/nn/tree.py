"""Tree-LSTM builders (Tai, Socher & Manning 2015): binary N-ary and Child-Sum.

Every node of a tree is built with ``@dx.function`` cells, so the autobatcher runs all the
nodes that are ready together (the leaves, then each level of compositions, across all the
trees of a graph) as one kernel per cell type.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..errors import InvalidArgumentError
from ..graph.expression import Expression
from ..ops import core as ops
from ..ops.function import function
from .lstm_state import lstm_state
from .rnn import _as_expr, _check_dims, _check_vector, _fresh_subcollection, _vector_arg


@function
def _leaf_cell(x, W, b):
    i, o, u = jnp.split(W @ x + b, 3)
    c, h = lstm_state(i, u, o)
    return h, c


@function
def _compose_cell(hl, cl, hr, cr, Ul, Ur, b):
    i, fl, fr, o, u = jnp.split(Ul @ hl + Ur @ hr + b, 5)
    c, h = lstm_state(i, u, o, (fl, fr), (cl, cr))
    return h, c


@function
def _child_forget(x, hk, ck, Wf, Uf, bf):
    return jax.nn.sigmoid(Wf @ x + Uf @ hk + bf) * ck


@function
def _child_sum_cell(x, h_sum, fc_sum, W, U, b):
    i, o, u = jnp.split(W @ x + U @ h_sum + b, 3)
    c = jax.nn.sigmoid(i) * jnp.tanh(u) + fc_sum
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


def _pairwise_sum(xs):
    """Sum of a non-empty list as a balanced tree of ``a + b`` nodes (log2(n) levels)."""
    while len(xs) > 1:
        xs = [ops.add(xs[i], xs[i + 1]) if i + 1 < len(xs) else xs[i]
              for i in range(0, len(xs), 2)]
    return xs[0]


def _check_pair(who, what, pair, dim):
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise InvalidArgumentError(f"{who}: {what} must be an (h, c) pair, got {pair!r}")
    h, c = _as_expr(pair[0], who, f"{what} h"), _as_expr(pair[1], who, f"{what} c")
    _check_vector(who, f"{what} h", h, dim)
    _check_vector(who, f"{what} c", c, dim)
    return h, c


class TreeLSTMBuilder:
    """Binary (N-ary, N = 2) Tree-LSTM.

    ``leaf(x)``: ``i, o, u`` from ``W x + b``; ``c = σ(i) ⊙ tanh(u)``, ``h = σ(o) ⊙ tanh(c)``.
    ``compose((hl, cl), (hr, cr))``: ``i, f_l, f_r, o, u`` from ``U_l hl + U_r hr + b``;
    ``c = σ(i) ⊙ tanh(u) + σ(f_l) ⊙ cl + σ(f_r) ⊙ cr``, ``h = σ(o) ⊙ tanh(c)``.
    Each call is one graph node; both return ``(h, c)``.
    """

    def __init__(self, input_dim: int, hidden_dim: int, pc):
        _check_dims("TreeLSTMBuilder", input_dim=input_dim, hidden_dim=hidden_dim)
        self.input_dim, self.hidden_dim = int(input_dim), int(hidden_dim)
        H = self.hidden_dim
        self.pc = _fresh_subcollection(pc, "tree_lstm")
        self.W = self.pc.add_parameters((3 * H, self.input_dim), name="W")
        self.b_leaf = self.pc.add_parameters((3 * H,), init="zeros", name="b_leaf")
        self.Ul = self.pc.add_parameters((5 * H, H), name="U_l")
        self.Ur = self.pc.add_parameters((5 * H, H), name="U_r")
        self.b = self.pc.add_parameters((5 * H,), init="zeros", name="b")

    def param_collection(self):
        """The subcollection holding this builder's parameters."""
        return self.pc

    def leaf(self, x) -> tuple[Expression, Expression]:
        """``(h, c)`` of a leaf reading ``x`` (a vector of ``input_dim``)."""
        x = _vector_arg("TreeLSTMBuilder.leaf", "x", x, self.input_dim)
        return _leaf_cell(x, self.W, self.b_leaf)

    def compose(self, left, right) -> tuple[Expression, Expression]:
        """``(h, c)`` of an internal node from its children's ``(h, c)`` pairs."""
        try:
            (hl, cl), (hr, cr) = left, right
            fast = (type(hl) is Expression and type(cl) is Expression
                    and type(hr) is Expression and type(cr) is Expression)
        except (TypeError, ValueError):  # not two pairs: the checked path says what is wrong
            fast = False
        if not fast:
            return ops.atomic(self._compose)(left, right)  # arrays: constants undone on failure
        return self._compose(left, right)

    def _compose(self, left, right):
        who = "TreeLSTMBuilder.compose"
        hl, cl = _check_pair(who, "left", left, self.hidden_dim)
        hr, cr = _check_pair(who, "right", right, self.hidden_dim)
        return _compose_cell(hl, cl, hr, cr, self.Ul, self.Ur, self.b)


class ChildSumTreeLSTMBuilder:
    """Child-Sum Tree-LSTM: any number of unordered children per node.

    With ``h̃ = Σ_k h_k``: ``i, o, u`` from ``W x + U h̃ + b``; one forget gate per child
    ``f_k = σ(W_f x + U_f h_k + b_f)``; ``c = σ(i) ⊙ tanh(u) + Σ_k f_k ⊙ c_k``,
    ``h = σ(o) ⊙ tanh(c)``.

    Batching: each child's forget term ``f_k ⊙ c_k`` is its own node (one signature whatever
    the number of children), the sums over children are balanced trees of pairwise additions
    (one signature for every number of children, unlike a padded ``dx.esum``), and the main
    cell takes the sums, so nodes with different numbers of children share every kernel.
    """

    def __init__(self, input_dim: int, hidden_dim: int, pc):
        _check_dims("ChildSumTreeLSTMBuilder", input_dim=input_dim, hidden_dim=hidden_dim)
        self.input_dim, self.hidden_dim = int(input_dim), int(hidden_dim)
        H = self.hidden_dim
        self.pc = _fresh_subcollection(pc, "child_sum_tree_lstm")
        self.W = self.pc.add_parameters((3 * H, self.input_dim), name="W")
        self.U = self.pc.add_parameters((3 * H, H), name="U")
        self.b = self.pc.add_parameters((3 * H,), init="zeros", name="b")
        self.Wf = self.pc.add_parameters((H, self.input_dim), name="W_f")
        self.Uf = self.pc.add_parameters((H, H), name="U_f")
        self.bf = self.pc.add_parameters((H,), init="zeros", name="b_f")

    def param_collection(self):
        """The subcollection holding this builder's parameters."""
        return self.pc

    @ops.atomic
    def node(self, x, children=()) -> tuple[Expression, Expression]:
        """``(h, c)`` of a node reading ``x`` with ``children``, a list of ``(h, c)`` pairs.

        ``x`` may be None (a node without input, e.g. an internal constituency node): zeros.
        """
        who = "ChildSumTreeLSTMBuilder.node"
        x = ops.zeros((self.input_dim,)) if x is None else _as_expr(x, who, "x")
        _check_vector(who, "x", x, self.input_dim)
        pairs = [_check_pair(who, f"child {k}", ch, self.hidden_dim)
                 for k, ch in enumerate(children)]
        if pairs:
            h_sum = _pairwise_sum([h for h, _ in pairs])
            fc_sum = _pairwise_sum([_child_forget(x, h, c, self.Wf, self.Uf, self.bf)
                                    for h, c in pairs])
        else:
            h_sum = fc_sum = ops.zeros((self.hidden_dim,))
        return _child_sum_cell(x, h_sum, fc_sum, self.W, self.U, self.b)
