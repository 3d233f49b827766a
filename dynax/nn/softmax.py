"""Softmax output layers: ``StandardSoftmaxBuilder`` and ``ClassFactoredSoftmaxBuilder``.

Both give ``neg_log_softmax(h, label)`` (a scalar loss Expression) and
``full_log_distribution(h)`` (log-probabilities over the whole vocabulary, shape ``(vocab,)``).
Labels are per-instance integers, so losses with different labels batch together.
``sample(h)`` draws a word from ``p(· | h)``, as DyNet's. As DyNet's, ``bias=False`` builds
no biases, and ``update=False`` on a method reads the weights as constants (no gradient
flows back into them from that use).
"""
from __future__ import annotations

import numbers
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ArgumentTypeError, IndexOutOfRangeError, InvalidArgumentError
from ..graph.computation_graph import as_index
from ..graph.expression import Expression
from ..ops import core as ops
from ..ops.function import function
from ..ops.registry import HEAVY, OpDef
from .parameters import Parameter
from .rnn import _as_expr, _check_dims, _check_vector, _fresh_subcollection, _frozen, _vector_arg


def _weights(who, update, params) -> tuple:
    """``params`` for a node: themselves, or with ``update=False`` their no-gradient copies
    in the current graph (``_frozen``)."""
    return tuple(params) if ops._flag_arg(who, "update", update) else _frozen(params)


def _affine(b, W, h) -> Expression:
    """``W h + b``, or ``W h`` without a bias."""
    return ops.affine_transform([b, W, h]) if b is not None else ops.matmul(W, h)


def _kind(x) -> str:
    return "p" if isinstance(x, Parameter) else "v"


class StandardSoftmaxBuilder:
    """``log p(w | h) = log_softmax(W h + b)[w]`` over a vocabulary of ``vocab_size`` words
    (``W h`` with ``bias=False``)."""

    def __init__(self, input_dim: int, vocab_size: int, pc, bias: bool = True):
        who = "StandardSoftmaxBuilder"
        _check_dims(who, input_dim=input_dim, vocab_size=vocab_size)
        bias = ops._flag_arg(who, "bias", bias)
        self.input_dim, self.vocab_size = int(input_dim), int(vocab_size)
        self.pc = _fresh_subcollection(pc, "softmax")
        self.W = self.pc.add_parameters((self.vocab_size, self.input_dim), name="W")
        self.b = (self.pc.add_parameters((self.vocab_size,), init="zeros", name="b")
                  if bias else None)

    def param_collection(self):
        """The subcollection holding this builder's parameters."""
        return self.pc

    @ops.atomic  # update=False copies the weights first
    def full_logits(self, h, update: bool = True) -> Expression:
        """The unnormalised scores ``W h + b`` (shape ``(vocab,)``)."""
        W, b = _weights("StandardSoftmaxBuilder.full_logits", update, (self.W, self.b))
        return _affine(b, W, _vector_arg("StandardSoftmaxBuilder", "h", h, self.input_dim))

    @ops.atomic
    def neg_log_softmax(self, h, label: int, update: bool = True) -> Expression:
        """``-log p(label | h)`` (a scalar), as one node (``label`` is per-instance data)."""
        W, b = _weights("StandardSoftmaxBuilder.neg_log_softmax", update, (self.W, self.b))
        h = _as_expr(h, "StandardSoftmaxBuilder.neg_log_softmax", "h")
        _check_vector("StandardSoftmaxBuilder", "h", h, self.input_dim)
        if b is None:
            return ops._node(LINEAR_NLL, "v" + _kind(W) + "i", [h, W, label])
        return ops._node(AFFINE_NLL, "v" + _kind(W) + _kind(b) + "i", [h, W, b, label])

    def full_log_distribution(self, h, update: bool = True) -> Expression:
        """``log p(· | h)`` over the whole vocabulary (shape ``(vocab,)``)."""
        return ops.log_softmax(self.full_logits(h, update))

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
LINEAR_NLL = OpDef("neg_log_softmax", lambda h, W, label: ops.PNLS.fn(W @ h, label), HEAVY,
                   index_bounds=lambda avals: (avals[1].shape[0],))  # without a bias


class ClassFactoredSoftmaxBuilder:
    """Class-factored softmax: ``p(w | h) = p(class(w) | h) · p(w | class(w), h)``.

    Two ways to build one::

        ClassFactoredSoftmaxBuilder(input_dim, word_to_class, pc, bias=True)
        ClassFactoredSoftmaxBuilder(input_dim, cluster_file, word_dict, pc, bias=True)  # DyNet's

    Args:
      input_dim: size of ``h``.
      word_to_class: class id of each word: a sequence, or a mapping from every word id
        ``0..V-1`` to its class; ids must be ``0..C-1`` with no class empty. Within a class,
        words are ordered by word id.
      cluster_file, word_dict: DyNet's form. A text file of lines ``class word [...]``
        (whitespace-separated, as Brown clusters are written; further fields are ignored),
        and a mapping from every word to its id ``0..V-1``. Classes are numbered in order of
        first appearance (``class_names`` keeps their names). Words of the file that are not
        in ``word_dict`` are skipped (they can never be labels); a word of ``word_dict``
        that the file leaves without a class is an error.
      pc: the collection that gets a subcollection of this builder's parameters.
      bias: whether the class and word scores have biases (DyNet's ``bias``; default True).

    The arguments after ``word_to_class`` go by position or by name, not both.

    ``p(class | h) = softmax(W_c h + b_c)``; for a class ``k`` of ``n_k > 1`` words,
    ``p(w | k, h) = softmax(R_k h + b_k)`` with its own ``R_k`` (``n_k × input_dim``), so the
    word-level step of all losses in one class runs as one batched kernel. A class of one word
    has no word-level parameters (``p(w | k, h) = 1``).
    """

    def __init__(self, input_dim: int, word_to_class, *args, word_dict=None, pc=None,
                 bias=None):
        who = "ClassFactoredSoftmaxBuilder"
        _check_dims(who, input_dim=input_dim)
        self.class_names = None
        from_file = isinstance(word_to_class, (str, os.PathLike))
        names = ("word_dict", "pc", "bias") if from_file else ("pc", "bias")
        form = (f"(input_dim, {'cluster_file, word_dict' if from_file else 'word_to_class'}, "
                "pc[, bias])")
        if len(args) > len(names):
            raise ArgumentTypeError(f"{who}: the arguments are {form}; got {2 + len(args)}")
        given = dict(zip(names, args))
        for name, value in (("word_dict", word_dict), ("pc", pc), ("bias", bias)):
            if value is None:
                continue
            if name not in names:
                raise ArgumentTypeError(f"{who}: {name}= goes with a cluster file; the "
                                        f"arguments are {form}")
            if name in given:
                raise ArgumentTypeError(f"{who}: {name} given both by position and by name")
            given[name] = value
        missing = [n for n in names[:-1] if n not in given]
        if missing:
            raise ArgumentTypeError(f"{who}: missing {', '.join(missing)}; the arguments are "
                                    f"{form}")
        pc = given["pc"]
        if from_file:
            w2c, self.class_names = _read_cluster_file(who, word_to_class, given["word_dict"])
        else:
            w2c = _class_list(who, word_to_class)
        bias = ops._flag_arg(who, "bias", given.get("bias", True))
        n_classes = max(w2c) + 1
        self.input_dim, self.vocab_size, self.n_classes = int(input_dim), len(w2c), n_classes
        self.word_to_class = w2c
        counts = [0] * n_classes
        self.word_pos = []  # position of each word within its class
        for c in self.word_to_class:
            self.word_pos.append(counts[c])
            counts[c] += 1
        self.class_sizes = counts

        self.pc = _fresh_subcollection(pc, "class_softmax")
        add = self.pc.add_parameters
        self.Wc = add((n_classes, self.input_dim), name="W_class")
        self.bc = add((n_classes,), init="zeros", name="b_class") if bias else None
        self.R, self.bR = [], []  # per class; None for one-word classes
        for k, n in enumerate(counts):
            several = n > 1
            self.R.append(add((n, self.input_dim), name=f"R{k}") if several else None)
            self.bR.append(add((n,), init="zeros", name=f"b{k}") if several and bias else None)
        self._full = function(_full_log_distribution_fn(counts, self.word_to_class,
                                                        self.word_pos, bias))
        self._full_params = [p for p in [self.Wc, self.bc] + [p for pair in zip(self.R, self.bR)
                                                               for p in pair] if p is not None]

    def param_collection(self):
        """The subcollection holding this builder's parameters."""
        return self.pc

    def _h(self, h):
        return _vector_arg("ClassFactoredSoftmaxBuilder", "h", h, self.input_dim)

    def _class_index(self, who, c) -> int:
        try:
            c = as_index(c)
        except TypeError:
            raise ArgumentTypeError(f"{who}: class must be an integer, got {c!r}") from None
        if not 0 <= c < self.n_classes:
            raise IndexOutOfRangeError(f"{who}: class {c} out of range [0, {self.n_classes})")
        return c

    @ops.atomic  # update=False copies the weights first
    def class_logits(self, h, update: bool = True) -> Expression:
        """The class scores ``W_c h + b_c`` (shape ``(n_classes,)``)."""
        Wc, bc = _weights("ClassFactoredSoftmaxBuilder.class_logits", update, (self.Wc, self.bc))
        return _affine(bc, Wc, self._h(h))

    def class_log_distribution(self, h, update: bool = True) -> Expression:
        """``log p(class | h)`` over all classes (shape ``(n_classes,)``)."""
        return ops.log_softmax(self.class_logits(h, update))

    @ops.atomic  # update=False copies the weights first
    def subclass_logits(self, h, c: int, update: bool = True) -> Expression:
        """The scores ``R_c h + b_c`` of the words of class ``c``, in word-id order (shape
        ``(n_c,)``); a class of one word scores it 0."""
        who = "ClassFactoredSoftmaxBuilder.subclass_logits"
        c = self._class_index(who, c)
        if self.R[c] is None:
            self._h(h)  # checked all the same
            return ops.zeros((1,))
        R, b = _weights(who, update, (self.R[c], self.bR[c]))
        return _affine(b, R, self._h(h))

    def subclass_log_distribution(self, h, c: int, update: bool = True) -> Expression:
        """``log p(w | c, h)`` over the words of class ``c`` (see ``subclass_logits``)."""
        return ops.log_softmax(self.subclass_logits(h, c, update))

    @ops.atomic
    def neg_log_softmax(self, h, label: int, update: bool = True) -> Expression:
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
        Wc, bc, R, b = _weights(who, update, (self.Wc, self.bc, self.R[k], self.bR[k]))
        loss = ops.pickneglogsoftmax(_affine(bc, Wc, h), k)
        if R is not None:
            loss = loss + ops.pickneglogsoftmax(_affine(b, R, h), self.word_pos[label])
        return loss

    def full_log_distribution(self, h, update: bool = True) -> Expression:
        """``log p(w | h)`` for every word ``w`` (shape ``(vocab,)``), as one node."""
        who = "ClassFactoredSoftmaxBuilder.full_log_distribution"
        return self._full(self._h(h), *_weights(who, update, self._full_params))

    def full_logits(self, h, update: bool = True) -> Expression:
        """Scores whose softmax is ``p(· | h)``: the log-probabilities themselves
        (``full_log_distribution``), as the factored model has no joint scores."""
        return self.full_log_distribution(h, update)

    def sample(self, h) -> int:
        """A word drawn from ``p(· | h)`` (see ``_gumbel_max``)."""
        return _gumbel_max(self.full_log_distribution(h))


def _class_list(who, word_to_class) -> list[int]:
    """The class of each word id, from a sequence or a ``{word id: class}`` mapping."""
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
    return [int(c) for c in w2c]


def _read_cluster_file(who, path, word_dict) -> tuple[list[int], list[str]]:
    """(class id of each word id, class names) from DyNet's cluster file format."""
    if not isinstance(word_dict, Mapping):
        raise ArgumentTypeError(f"{who}: word_dict must map each word to its id, got "
                                f"{type(word_dict).__name__}")
    bad = next((v for v in word_dict.values()
                if isinstance(v, bool) or not isinstance(v, numbers.Integral)), None)
    if bad is not None:
        raise ArgumentTypeError(f"{who}: word_dict's ids must be ints, got {bad!r}")
    ids = sorted(word_dict.values())
    if not ids:
        raise InvalidArgumentError(f"{who}: word_dict is empty")
    if ids != list(range(len(ids))):
        raise InvalidArgumentError(f"{who}: word_dict's ids must be 0..{len(ids) - 1}, each "
                                   "once")
    names: dict = {}  # class name -> id, in order of first appearance among known words
    w2c: list = [None] * len(ids)
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) < 2:
                raise InvalidArgumentError(f"{who}: {os.fspath(path)}, line {n}: expected "
                                           f"'class word', got {line.strip()!r}")
            name, word = fields[0], fields[1]
            w = word_dict.get(word)
            if w is None:
                continue
            if w2c[w] is not None:
                raise InvalidArgumentError(f"{who}: {os.fspath(path)}, line {n}: word "
                                           f"{word!r} is already in a class")
            w2c[w] = names.setdefault(name, len(names))
    missing = [word for word, w in word_dict.items() if w2c[w] is None]
    if missing:
        raise InvalidArgumentError(
            f"{who}: {len(missing)} word(s) of word_dict have no class in "
            f"{os.fspath(path)}, e.g. {missing[:3]}; give each a line 'class word' (a class "
            "of its own is fine)")
    return w2c, list(names)


def _full_log_distribution_fn(class_sizes, word_to_class, word_pos, bias: bool):
    """The single-instance function ``(h, W_c, [b_c], R_k, [b_k] ...) -> log p(· | h)``,
    with ``R_k`` for the classes of several words and the biases if ``bias``."""
    offsets = np.concatenate([[0], np.cumsum(class_sizes)[:-1]])
    index = np.asarray([offsets[c] + p for c, p in zip(word_to_class, word_pos)], np.int32)

    def class_factored_log_distribution(h, *params):
        it = iter(params)

        def scores():  # the next weights (and bias) applied to h
            W = next(it)
            return W @ h + next(it) if bias else W @ h

        log_pc = jax.nn.log_softmax(scores())
        parts = [log_pc[k:k + 1] if n == 1 else jax.nn.log_softmax(scores()) + log_pc[k]
                 for k, n in enumerate(class_sizes)]
        return jnp.concatenate(parts)[index]  # class-major order -> word order

    return class_factored_log_distribution
