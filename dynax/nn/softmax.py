"""Softmax output layers: ``StandardSoftmaxBuilder`` and ``ClassFactoredSoftmaxBuilder``.

Both give ``neg_log_softmax(h, label)`` (a scalar loss Expression) and
``full_log_distribution(h)`` (log-probabilities over the whole vocabulary, shape ``(vocab,)``).
Labels are per-instance integers, so losses with different labels batch together.
``sample(h)`` draws a word from ``p(· | h)``, as DyNet's.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import IndexOutOfRangeError, InvalidArgumentError
from ..graph.computation_graph import as_index
from ..graph.expression import Expression
from ..ops import core as ops
from ..ops.function import function
from ..ops.registry import HEAVY, OpDef
from .rnn import _as_expr, _check_dims, _check_vector, _fresh_subcollection, _vector_arg


class StandardSoftmaxBuilder:
    """``log p(w | h) = log_softmax(W h + b)[w]`` over a vocabulary of ``vocab_size`` words."""

    def __init__(self, input_dim: int, vocab_size: int, pc):
        _check_dims("StandardSoftmaxBuilder", input_dim=input_dim, vocab_size=vocab_size)
        self.input_dim, self.vocab_size = int(input_dim), int(vocab_size)
        self.pc = _fresh_subcollection(pc, "softmax")
        self.W = self.pc.add_parameters((self.vocab_size, self.input_dim), name="W")
        self.b = self.pc.add_parameters((self.vocab_size,), init="zeros", name="b")

    def param_collection(self):
        """The subcollection holding this builder's parameters."""
        return self.pc

    def full_logits(self, h) -> Expression:
        """The unnormalised scores ``W h + b`` (shape ``(vocab,)``)."""
        h = _vector_arg("StandardSoftmaxBuilder", "h", h, self.input_dim)
        return ops.affine_transform([self.b, self.W, h])

    @ops.atomic
    def neg_log_softmax(self, h, label: int) -> Expression:
        """``-log p(label | h)`` (a scalar), as one node (``label`` is per-instance data)."""
        h = _as_expr(h)
        _check_vector("StandardSoftmaxBuilder", "h", h, self.input_dim)
        return ops._node(AFFINE_NLL, "vppi", [h, self.W, self.b, label])

    def full_log_distribution(self, h) -> Expression:
        """``log p(· | h)`` over the whole vocabulary (shape ``(vocab,)``)."""
        return ops.log_softmax(self.full_logits(h))

    def sample(self, h) -> int:
        """A word drawn from ``p(· | h)`` (see ``_gumbel_max``)."""
        return _gumbel_max(self.full_log_distribution(h))


def _gumbel_max(log_p: Expression) -> int:
    """A draw from ``exp(log_p)``: the argmax of ``log_p`` plus Gumbel noise (Gumbel-max).
    The noise is ``dx.random_gumbel``, drawn from the graph's seed, so a fixed seed
    reproduces the draws. Reading the result computes what the graph has pending."""
    return int(np.argmax((log_p + ops.random_gumbel(log_p.shape)).npvalue()))


def _affine_nll(h, W, b, label):
    """``affine_transform([b, W, h])`` then ``pickneglogsoftmax``: the two ops' own math."""
    return ops.PNLS.fn(ops.AFFINE.fn(b, W, h), label)


# The loss of a standard softmax as ONE op: the (vocab,) logits then live only inside its
# kernel. As two nodes (affine, then pickneglogsoftmax) they were written to an arena, gathered
# back, their cotangent scatter-added into a gradient arena and read again: four passes over
# tokens x vocab floats (RNN LM, 1,500 tokens x 10,000 words: 60 MB each) and two launches.
AFFINE_NLL = OpDef("neg_log_softmax", _affine_nll, HEAVY,
                   index_bounds=lambda avals: (avals[1].shape[0],))  # label < vocab


class ClassFactoredSoftmaxBuilder:
    """Class-factored softmax: ``p(w | h) = p(class(w) | h) · p(w | class(w), h)``.

    Args:
      input_dim: size of ``h``.
      word_to_class: class id of each word: a sequence, or a mapping from every word id
        ``0..V-1`` to its class; ids must be ``0..C-1`` with no class empty. Within a class,
        words are ordered by word id.
      pc: the collection that gets a subcollection of this builder's parameters.

    ``p(class | h) = softmax(W_c h + b_c)``; for a class ``k`` of ``n_k > 1`` words,
    ``p(w | k, h) = softmax(R_k h + b_k)`` with its own ``R_k`` (``n_k × input_dim``), so the
    word-level step of all losses in one class runs as one batched kernel. A class of one word
    has no word-level parameters (``p(w | k, h) = 1``).
    """

    def __init__(self, input_dim: int, word_to_class, pc):
        _check_dims("ClassFactoredSoftmaxBuilder", input_dim=input_dim)
        who = "ClassFactoredSoftmaxBuilder"
        if isinstance(word_to_class, Mapping):  # {word: class}, as DyNet users write it
            missing = sorted(set(range(len(word_to_class))) - set(word_to_class))
            if missing:
                raise InvalidArgumentError(
                    f"{who}: word_to_class maps {len(word_to_class)} words, so its keys must "
                    f"be the word ids 0..{len(word_to_class) - 1}; {missing[0]!r} is missing")
            w2c = [word_to_class[w] for w in range(len(word_to_class))]
        else:
            w2c = list(word_to_class)
        if not w2c:
            raise InvalidArgumentError(f"{who}: word_to_class is empty")
        for w, c in enumerate(w2c):
            if not isinstance(c, numbers.Integral) or isinstance(c, bool) or c < 0:
                raise InvalidArgumentError(
                    f"{who}: class of word {w} must be a non-negative int, got {c!r}")
        n_classes = max(w2c) + 1
        sizes = np.bincount(np.asarray(w2c, np.int64), minlength=n_classes)
        if (sizes == 0).any():
            raise InvalidArgumentError(
                f"{who}: class ids must be 0..{n_classes - 1} with every class "
                f"used; class {int(np.argmin(sizes))} has no word")
        self.input_dim, self.vocab_size, self.n_classes = int(input_dim), len(w2c), n_classes
        self.word_to_class = [int(c) for c in w2c]
        counts = [0] * n_classes
        self.word_pos = []  # position of each word within its class
        for c in self.word_to_class:
            self.word_pos.append(counts[c])
            counts[c] += 1
        self.class_sizes = counts

        self.pc = _fresh_subcollection(pc, "class_softmax")
        self.Wc = self.pc.add_parameters((n_classes, self.input_dim), name="W_class")
        self.bc = self.pc.add_parameters((n_classes,), init="zeros", name="b_class")
        self.R, self.bR = [], []  # per class; None for one-word classes
        for k, n in enumerate(counts):
            if n == 1:
                self.R.append(None)
                self.bR.append(None)
            else:
                self.R.append(self.pc.add_parameters((n, self.input_dim), name=f"R{k}"))
                self.bR.append(self.pc.add_parameters((n,), init="zeros", name=f"b{k}"))
        self._full = function(_full_log_distribution_fn(counts, self.word_to_class,
                                                        self.word_pos))
        self._full_params = [self.Wc, self.bc] + [p for pair in zip(self.R, self.bR)
                                                  for p in pair if p is not None]

    def param_collection(self):
        """The subcollection holding this builder's parameters."""
        return self.pc

    def _h(self, h):
        return _vector_arg("ClassFactoredSoftmaxBuilder", "h", h, self.input_dim)

    def class_log_distribution(self, h) -> Expression:
        """``log p(class | h)`` over all classes (shape ``(n_classes,)``)."""
        return ops.log_softmax(ops.affine_transform([self.bc, self.Wc, self._h(h)]))

    def neg_log_softmax(self, h, label: int) -> Expression:
        """``-log p(label | h) = -log p(class | h) - log p(label | class, h)`` (a scalar)."""
        who = "ClassFactoredSoftmaxBuilder.neg_log_softmax"
        try:  # as the other ops take labels
            label = as_index(label)
        except TypeError:
            raise IndexOutOfRangeError(f"{who}: label must be an integer, got "
                                       f"{label!r}") from None
        if not 0 <= label < self.vocab_size:
            raise IndexOutOfRangeError(
                f"{who}: label {label!r} out of range [0, {self.vocab_size})")
        h = self._h(h)  # after the label check: a failure adds nothing to the graph
        k = self.word_to_class[label]
        loss = ops.pickneglogsoftmax(ops.affine_transform([self.bc, self.Wc, h]), k)
        if self.R[k] is not None:
            word_logits = ops.affine_transform([self.bR[k], self.R[k], h])
            loss = loss + ops.pickneglogsoftmax(word_logits, self.word_pos[label])
        return loss

    def full_log_distribution(self, h) -> Expression:
        """``log p(w | h)`` for every word ``w`` (shape ``(vocab,)``), as one node."""
        return self._full(self._h(h), *self._full_params)

    def sample(self, h) -> int:
        """A word drawn from ``p(· | h)`` (see ``_gumbel_max``)."""
        return _gumbel_max(self.full_log_distribution(h))


def _full_log_distribution_fn(class_sizes, word_to_class, word_pos):
    """The single-instance function ``(h, W_c, b_c, R_k, b_k ...) -> log p(· | h)``."""
    offsets = np.concatenate([[0], np.cumsum(class_sizes)[:-1]])
    index = np.asarray([offsets[c] + p for c, p in zip(word_to_class, word_pos)], np.int32)

    def class_factored_log_distribution(h, Wc, bc, *Rb):
        log_pc = jax.nn.log_softmax(Wc @ h + bc)
        parts, j = [], 0
        for k, n in enumerate(class_sizes):
            if n == 1:
                parts.append(log_pc[k:k + 1])
            else:
                R, b = Rb[j], Rb[j + 1]
                j += 2
                parts.append(jax.nn.log_softmax(R @ h + b) + log_pc[k])
        return jnp.concatenate(parts)[index]  # class-major order -> word order

    return class_factored_log_distribution
