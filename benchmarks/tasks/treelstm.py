"""Tree-LSTM sentiment classifier (Tai et al., 2015), the workload of DyNet's autobatching paper.

A binary N-ary Tree-LSTM over 64 trees per update, 5–40 leaves each, embeddings 300, hidden
150, 5 classes at the root, vocabulary 20000, Adam.

* ``DynaxModel``: written per tree, one ``@dx.function`` cell per tree node (a leaf cell and a
  compose cell), recursion in Python; the autobatcher finds the batches.
* ``HandModel``: what a skilled JAX user writes by hand: nodes grouped by height across the
  64 trees, one vmapped cell per level, the whole forward + ``jax.value_and_grad`` + Adam in
  one jitted step per bucketed shape signature.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

import dynax as dx

from ..data import N_CLASSES, VOCAB, Tree, tree_batches
from ..hand import HandBaseline

NAME, UNIT, BATCH = "treelstm", "trees", 64
EMB, HID = 300, 150
LR = 1e-3


def make_batches(n_batches: int, seed: int, batch_size: int = BATCH, vocab: int = VOCAB,
                 **kw) -> list[list[Tree]]:
    """``n_batches`` lists of ``batch_size`` random labelled trees (deterministic in ``seed``)."""
    return tree_batches(n_batches, batch_size, seed=seed, vocab=vocab, **kw)


# ---- the cells: single-instance JAX, shared by dynax and the baseline -------------------------

def _leaf(x, W, b):
    """Leaf of a binary Tree-LSTM: gates i, o, u from the word vector; no children."""
    i, o, u = jnp.split(W @ x + b, 3)
    c, h = dx.nn.lstm_state(i, u, o)
    return h, c


def _compose(hl, cl, hr, cr, U, b):
    """Internal node of a binary (N-ary, N=2) Tree-LSTM: one forget gate per child."""
    i, fl, fr, o, u = jnp.split(U @ jnp.concatenate([hl, hr]) + b, 5)
    c, h = dx.nn.lstm_state(i, u, o, (fl, fr), (cl, cr))
    return h, c


def _root_loss(h, W, b, label):
    """Cross-entropy of a tree's label from its root state."""
    return -jax.nn.log_softmax(W @ h + b)[label]


leaf_cell = dx.function(_leaf)
compose_cell = dx.function(_compose)
root_loss_cell = dx.function(_root_loss)


def _small_normal(key, shape):
    return 0.1 * jax.random.normal(key, shape)


class DynaxTreeLSTM:
    """The Tree-LSTM classifier in dynax: per-tree code, autobatched."""

    def __init__(self, seed: int = 0, vocab: int = VOCAB, emb: int = EMB, hid: int = HID,
                 n_classes: int = N_CLASSES):
        self.pc = pc = dx.ParameterCollection(seed=seed)
        self.E = pc.add_lookup_parameters((vocab, emb), init=_small_normal, name="E")
        self.W_leaf = pc.add_parameters((3 * hid, emb), name="W_leaf")
        self.b_leaf = pc.add_parameters((3 * hid,), init="zeros", name="b_leaf")
        self.U = pc.add_parameters((5 * hid, 2 * hid), name="U")
        self.b_comp = pc.add_parameters((5 * hid,), init="zeros", name="b_comp")
        self.W_out = pc.add_parameters((n_classes, hid), name="W_out")
        self.b_out = pc.add_parameters((n_classes,), init="zeros", name="b_out")
        self.label_ids = tuple(np.int32(y) for y in range(n_classes))  # per-instance ints

    def encode(self, tree: Tree):
        """(h, c) of the root; one leaf or compose node per tree node, recursively."""
        words, children, n = tree.words, tree.children, tree.n_leaves

        def rec(i):
            if i < n:
                return leaf_cell(self.E[words[i]], self.W_leaf, self.b_leaf)
            left, right = children[i - n]
            return compose_cell(*rec(left), *rec(right), self.U, self.b_comp)

        return rec(tree.root)

    def loss(self, trees):
        """Summed cross-entropy of the root labels."""
        losses = []
        for t in trees:
            h, _ = self.encode(t)
            losses.append(root_loss_cell(h, self.W_out, self.b_out, self.label_ids[t.label]))
        return dx.esum(losses)

    def initial_values(self) -> dict:
        return {p.name: p.value for p in self.pc.parameters()}


# ---- the hand-batched JAX baseline ---------------------------------------------------------

def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


class HandBatched(HandBaseline):
    """Level-order batching by hand, as a skilled JAX user would write it.

    Per update, on the host: every tree node gets its height (leaves 0); nodes of one height
    across the 64 trees form a level, and each node a slot in one state buffer (leaves first,
    then level by level). In one jitted step: embed and run the leaf cell over all leaves, then
    the compose cell level by level, gathering children's (h, c) from the buffer and writing the
    level's results back; root logits, summed cross-entropy, ``jax.value_and_grad``, Adam.

    Bounded compilation: the leaf count and each wide level's width are padded to powers of
    two; the narrow levels (at most ``tail_width`` nodes; level widths only shrink with
    height) run in a ``lax.scan`` of fixed width ``tail_width`` whose length is padded to a
    multiple of 4. The jit cache key is (leaf bucket, wide level buckets, tail length): a few
    dozen signatures over a whole dataset. Padded lanes read slot 0 and write slots nobody
    reads, so no gradient reaches them. Sizes are read off the initial parameters.
    """

    def __init__(self, init: dict, tail_width: int = 32):
        super().__init__(init, LR)
        self.tail_width = tail_width

    # -- host side: plan the levels of one batch --
    def pack(self, trees):
        """The static signature and the int arrays for one batch."""
        T = self.tail_width
        leaf_slot, heights = [], []
        n_leaves = 0
        for t in trees:
            leaf_slot.append(n_leaves)
            n_leaves += t.n_leaves
            heights.append(t.heights())
        max_h = max(h[-1] for h in heights)
        levels = [[] for _ in range(max_h + 1)]  # (tree index, node id) per height
        for ti, (t, h) in enumerate(zip(trees, heights)):
            n = t.n_leaves
            for node in range(n, t.n_nodes):
                levels[h[node]].append((ti, node))
        widths = [len(lv) for lv in levels[1:]]
        wide = [_bucket(w) for w in widths if w > T]
        tail_len = -(-(len(widths) - len(wide)) // 4) * 4
        Lb = _bucket(n_leaves)
        sig = (Lb, tuple(wide), tail_len, T)

        # slots: leaves [0, Lb), then each wide level, then tail_len levels of T slots
        slot = [None] * len(trees)
        for ti, t in enumerate(trees):
            slot[ti] = list(range(leaf_slot[ti], leaf_slot[ti] + t.n_leaves)) + [0] * (
                t.n_leaves - 1)
        pads = wide + [T] * tail_len
        kids = np.zeros((sum(pads), 2), np.int32)
        off, row = Lb, 0
        for lv, pad in zip(levels[1:], pads):
            for j, (ti, node) in enumerate(lv):
                s = slot[ti]
                left, right = trees[ti].children[node - trees[ti].n_leaves]
                kids[row + j] = (s[left], s[right])
                s[node] = off + j
            off += pad
            row += pad
        words = np.zeros(Lb, np.int32)
        words[:n_leaves] = [w for t in trees for w in t.words]
        roots = np.array([slot[ti][-1] for ti in range(len(trees))], np.int32)
        labels = np.array([t.label for t in trees], np.int32)
        return sig, (words, kids, roots, labels)

    # -- device side: one jitted training step per signature --
    @staticmethod
    def _loss(params, sig, words, kids, roots, labels):
        Lb, wide, tail_len, T = sig
        leaf = jax.vmap(_leaf, in_axes=(0, None, None))
        compose = jax.vmap(_compose, in_axes=(0, 0, 0, 0, None, None))
        U, bc = params["U"], params["b_comp"]
        hid = U.shape[1] // 2
        total = Lb + sum(wide) + tail_len * T
        h, c = leaf(params["E"][words], params["W_leaf"], params["b_leaf"])
        H = jnp.zeros((total, hid), h.dtype).at[:Lb].set(h)
        C = jnp.zeros((total, hid), c.dtype).at[:Lb].set(c)
        off = Lb
        for w in wide:  # wide levels, unrolled
            l, r = kids[off - Lb:off - Lb + w, 0], kids[off - Lb:off - Lb + w, 1]
            h, c = compose(H[l], C[l], H[r], C[r], U, bc)
            H = H.at[off:off + w].set(h)
            C = C.at[off:off + w].set(c)
            off += w
        if tail_len:  # narrow levels, one scan step each
            def level(carry, xs):
                H, C = carry
                k, o = xs
                h, c = compose(H[k[:, 0]], C[k[:, 0]], H[k[:, 1]], C[k[:, 1]], U, bc)
                H = jax.lax.dynamic_update_slice_in_dim(H, h, o, 0)
                C = jax.lax.dynamic_update_slice_in_dim(C, c, o, 0)
                return (H, C), None

            tail_kids = kids[off - Lb:].reshape(tail_len, T, 2)
            offs = off + T * jnp.arange(tail_len, dtype=jnp.int32)
            (H, C), _ = jax.lax.scan(level, (H, C), (tail_kids, offs))
        logits = H[roots] @ params["W_out"].T + params["b_out"][None, :]
        logp = jax.nn.log_softmax(logits)
        return -jnp.sum(jnp.take_along_axis(logp, labels[:, None], axis=1))


# the task interface
DynaxModel = DynaxTreeLSTM
HandModel = HandBatched
