"""Deterministic synthetic data shared by the benchmarks and examples.

* ``random_trees``: binary constituency-like trees with 5–40 leaves over a vocabulary, each with
  a root label in ``0..n_classes-1``.
* ``random_sentences``: sentences of 5–40 words, each word with a tag.

Words are drawn from a Zipf–Mandelbrot distribution (a few frequent words, a long tail) as in real
text, so the embeddings of the frequent words get trained quickly. Labels are a learnable
function of the words: every word has a "polarity" ``word % n_classes`` and a tree's label is
the most frequent polarity among its leaves, a bag-of-words
"sentiment" that a Tree-LSTM can learn, so training loss goes down. Everything is a function of
the ``seed`` only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VOCAB = 20000
N_CLASSES = 5
MIN_LEN, MAX_LEN = 5, 40


@dataclass(frozen=True)
class Tree:
    """A binary tree in flat post-order form.

    Node ``i < n_leaves`` is the leaf holding ``words[i]`` (left to right); node
    ``n_leaves + j`` is internal with children ``children[j] = (left, right)``. Children always
    come before their parent, and the root is the last node.
    """

    words: tuple  # leaf word ids, len n_leaves
    children: tuple  # (left, right) node ids of each internal node, len n_leaves - 1
    label: int  # root class

    @property
    def n_leaves(self) -> int:
        return len(self.words)

    @property
    def n_nodes(self) -> int:
        return 2 * len(self.words) - 1

    @property
    def root(self) -> int:
        return self.n_nodes - 1

    def heights(self) -> list[int]:
        """Height of every node: 0 for leaves, 1 + the max of the children's otherwise."""
        h = [0] * self.n_nodes
        n = self.n_leaves
        for j, (l, r) in enumerate(self.children):
            h[n + j] = 1 + max(h[l], h[r])
        return h

    def depth(self) -> int:
        """Height of the root."""
        return self.heights()[-1]


_CDF: dict = {}


def _zipf_words(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    """``n`` word ids in ``[0, vocab)`` from a Zipf–Mandelbrot law ``p(w) ~ 1 / (w + 10)``
    (word 0 the most frequent, about 1% of tokens; a long tail)."""
    cdf = _CDF.get(vocab)
    if cdf is None:
        p = 1.0 / (np.arange(vocab) + 10.0)
        cdf = _CDF[vocab] = np.cumsum(p / p.sum())
    return np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), vocab - 1)


def tree_label(words, n_classes: int = N_CLASSES) -> int:
    """The majority word polarity ``w % n_classes``; on a tie, the tied polarity that occurs
    first (left to right), so no class is favoured."""
    pol = np.asarray(words) % n_classes
    counts = np.bincount(pol, minlength=n_classes)
    tied = counts == counts.max()
    return int(next(p for p in pol if tied[p]))


def _random_shape(rng: np.random.Generator, n: int) -> tuple:
    """Children lists (post-order) of a random binary tree over leaves 0..n-1.

    Each span is split at a uniformly random point, which gives a realistic mix of
    balanced and skewed subtrees.
    """
    children: list = []

    def build(lo: int, hi: int) -> int:  # node id of the subtree over leaves [lo, hi)
        if hi - lo == 1:
            return lo
        k = int(rng.integers(lo + 1, hi))
        left = build(lo, k)
        right = build(k, hi)
        children.append((left, right))
        return n + len(children) - 1

    build(0, n)
    return tuple(children)


def random_trees(count: int, seed: int = 0, vocab: int = VOCAB, n_classes: int = N_CLASSES,
                 min_leaves: int = MIN_LEN, max_leaves: int = MAX_LEN) -> list[Tree]:
    """``count`` random labelled binary trees with ``min_leaves..max_leaves`` leaves."""
    rng = np.random.default_rng(seed)
    trees = []
    for _ in range(count):
        n = int(rng.integers(min_leaves, max_leaves + 1))
        words = tuple(int(w) for w in _zipf_words(rng, n, vocab))
        trees.append(Tree(words, _random_shape(rng, n), tree_label(words, n_classes)))
    return trees


def tree_batches(n_batches: int, batch_size: int = 64, seed: int = 0, **kw) -> list[list[Tree]]:
    """``n_batches`` lists of ``batch_size`` trees (one list per training update)."""
    trees = random_trees(n_batches * batch_size, seed=seed, **kw)
    return [trees[i * batch_size:(i + 1) * batch_size] for i in range(n_batches)]


@dataclass(frozen=True)
class Sentence:
    """A tagged sentence: ``words[i]`` has tag ``tags[i]``."""

    words: tuple
    tags: tuple


def random_sentences(count: int, seed: int = 0, vocab: int = VOCAB, n_tags: int = 17,
                     min_len: int = MIN_LEN, max_len: int = MAX_LEN) -> list[Sentence]:
    """``count`` tagged sentences of ``min_len..max_len`` words.

    A word's tag is ``word % n_tags``, except that a word following a word of tag 0 gets tag
    ``(word + 1) % n_tags``: mostly a lexical choice, with a little context for a BiLSTM.
    """
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(min_len, max_len + 1))
        words = _zipf_words(rng, n, vocab)
        tags = words % n_tags
        tags[1:] = np.where(tags[:-1] == 0, (words[1:] + 1) % n_tags, tags[1:])
        out.append(Sentence(tuple(int(w) for w in words), tuple(int(t) for t in tags)))
    return out


# ---- additions for the benchmark suite (new generators; the ones above are unchanged) --------

def zipf_counts(n_tokens: int, vocab: int = VOCAB, seed: int = 0) -> np.ndarray:
    """Word frequencies in a synthetic Zipfian corpus of ``n_tokens`` tokens (same law as the
    sentences); ``counts[w]`` is how often word ``w`` occurs. Used to call words rare."""
    rng = np.random.default_rng(seed)
    return np.bincount(_zipf_words(rng, n_tokens, vocab), minlength=vocab)


def word_spellings(vocab: int = VOCAB, n_chars: int = 60, seed: int = 0,
                   min_chars: int = 3, max_chars: int = 12) -> list[tuple]:
    """A spelling (tuple of character ids in ``[0, n_chars)``) for every word id.

    Lengths are uniform in ``min_chars..max_chars``. The last character is ``word % n_chars``,
    a suffix that carries part of the word's tag (tags are ``word % n_tags``), so a character
    model has something to learn; the rest is random.
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_chars, max_chars + 1, size=vocab)
    chars = rng.integers(0, n_chars, size=(vocab, max_chars))
    out = []
    for w in range(vocab):
        s = [int(c) for c in chars[w, :lengths[w] - 1]]
        out.append(tuple(s) + (w % n_chars,))
    return out


@dataclass(frozen=True)
class CharSentence:
    """A tagged sentence whose rare words carry their spelling: ``chars[i]`` is a tuple of
    character ids if word ``i`` is rare, else None."""

    words: tuple
    tags: tuple
    chars: tuple


_RARE: dict = {}
_SPELL: dict = {}


def rare_words(vocab: int = VOCAB, corpus_tokens: int = 200_000, min_count: int = 5,
               seed: int = 7) -> np.ndarray:
    """A boolean mask over word ids: seen fewer than ``min_count`` times in a synthetic Zipfian
    corpus of ``corpus_tokens`` tokens (with the defaults, about 16% of the tokens of
    ``random_sentences`` are rare)."""
    key = (vocab, corpus_tokens, min_count, seed)
    if key not in _RARE:
        _RARE[key] = zipf_counts(corpus_tokens, vocab, seed) < min_count
    return _RARE[key]


def char_sentences(count: int, seed: int = 0, vocab: int = VOCAB, n_tags: int = 9,
                   n_chars: int = 60, min_len: int = MIN_LEN, max_len: int = MAX_LEN,
                   corpus_tokens: int = 200_000, min_count: int = 5) -> list[CharSentence]:
    """``random_sentences`` (same words and tags for the same arguments) with the spelling of
    every rare word (``rare_words``; spellings from ``word_spellings``)."""
    rare = rare_words(vocab, corpus_tokens, min_count)
    key = (vocab, n_chars)
    if key not in _SPELL:
        _SPELL[key] = word_spellings(vocab, n_chars)
    spell = _SPELL[key]
    out = []
    for s in random_sentences(count, seed, vocab, n_tags, min_len, max_len):
        chars = tuple(spell[w] if rare[w] else None for w in s.words)
        out.append(CharSentence(s.words, s.tags, chars))
    return out
