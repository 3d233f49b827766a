"""BiLSTM tagger on variable-length sentences (the paper's "BiLSTM" task).

Sentences of 5–40 Zipfian words (vocabulary 20000), embedding 128, one BiLSTM layer of 128
units per direction, an MLP of 32 tanh units (as DyNet's benchmark tagger) and 9 tags,
64 sentences per update, Adam; the loss is the summed cross-entropy of every tag.

* ``DynaxModel``: per sentence, ``dx.nn.BiRNNBuilder`` over the word lookups and one fused
  ``@dx.function`` node per word for the MLP and the tag's cross-entropy (the tag a NumPy
  int: per-instance data); the autobatcher batches across words and sentences.
* ``HandModel``: padded ``[B, T]`` batches (T rounded up to a multiple of 8), the input
  projection of all time steps as one matmul, ``lax.scan`` over time for the recurrence, the
  backward direction as a forward scan over each sentence reversed within its length, a masked
  loss, and the whole step (``value_and_grad`` + Adam) in one ``jax.jit`` per (B, T).

The model classes are generic (layers, MLP or not): ``bilstm_synthetic`` and
``char_tagger`` reuse them.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

import dynax as dx

from ..data import Sentence, random_sentences
from ..hand import HandBaseline

NAME, UNIT, BATCH = "tagger", "sentences", 64
VOCAB, EMB, HID, MLP, N_TAGS, LAYERS = 20000, 128, 128, 32, 9, 1
MIN_LEN, MAX_LEN = 5, 40
LR = 1e-3
LEN_STEP = 8  # the hand baseline pads sentence length to a multiple of this


def make_batches(n_batches: int, seed: int, batch_size: int = BATCH, vocab: int = VOCAB,
                 n_tags: int = N_TAGS, min_len: int = MIN_LEN, max_len: int = MAX_LEN
                 ) -> list[list[Sentence]]:
    """``n_batches`` lists of ``batch_size`` tagged sentences (deterministic in ``seed``)."""
    s = random_sentences(n_batches * batch_size, seed=seed, vocab=vocab, n_tags=n_tags,
                         min_len=min_len, max_len=max_len)
    return [s[i * batch_size:(i + 1) * batch_size] for i in range(n_batches)]


# ---- dynax --------------------------------------------------------------------------------

@dx.function
def mlp_tag(f, b, W1, b1, W2, b2, tag):
    """Cross-entropy of one word's tag under an MLP with tanh on its forward and backward
    states; ``tag`` is a NumPy int (per-instance data: every tag in one signature)."""
    return -jax.nn.log_softmax(W2 @ jnp.tanh(W1 @ jnp.concatenate([f, b]) + b1) + b2)[tag]


@dx.function
def linear_tag(f, b, W, bias, tag):
    """Cross-entropy of one word's tag under one linear layer on its two states."""
    return -jax.nn.log_softmax(W @ jnp.concatenate([f, b]) + bias)[tag]


class TaggerModel:
    """A BiLSTM tagger in dynax, written per sentence.

    ``hid`` is per direction; ``mlp=None`` puts a linear layer on the BiLSTM outputs.
    Subclasses change ``embed`` (the word vectors of one sentence).
    """

    def __init__(self, seed: int = 0, vocab: int = VOCAB, emb: int = EMB, hid: int = HID,
                 mlp: int | None = MLP, n_tags: int = N_TAGS, layers: int = LAYERS):
        self.pc = pc = dx.ParameterCollection(seed=seed)
        self.E = pc.add_lookup_parameters((vocab, emb), init="uniform", name="E")
        self.bi = dx.nn.BiRNNBuilder(layers, emb, 2 * hid, pc, dx.nn.LSTMBuilder)
        if mlp:
            self.out = (pc.add_parameters((mlp, 2 * hid), name="W1"),
                        pc.add_parameters((mlp,), init="zeros", name="b1"),
                        pc.add_parameters((n_tags, mlp), name="W2"),
                        pc.add_parameters((n_tags,), init="zeros", name="b2"))
            self.tag_cell = mlp_tag
        else:
            self.out = (pc.add_parameters((n_tags, 2 * hid), name="W_out"),
                        pc.add_parameters((n_tags,), init="zeros", name="b_out"))
            self.tag_cell = linear_tag
        self.tag_ids = tuple(np.int32(t) for t in range(n_tags))  # NumPy ints, made once

    def embed(self, sentence) -> list:
        """The input vector of every word."""
        E = self.E
        return [E[w] for w in sentence.words]

    def loss(self, batch):
        """Summed cross-entropy of every word's tag over the batch."""
        losses = []
        cell, out, tag_ids = self.tag_cell, self.out, self.tag_ids
        for s in batch:
            # the top layer's (forward, backward) states: the loss cell reads both halves
            # directly, which saves a concatenate node per word; scores and loss are one node
            for (f, b), t in zip(self.bi.add_inputs(self.embed(s)), s.tags):
                losses.append(cell(f.output(), b.output(), *out, tag_ids[t]))
        return dx.esum(losses)


DynaxModel = TaggerModel


# ---- hand-batched JAX -----------------------------------------------------------------------

def lstm_scan(x, Wx, Wh, b):
    """One LSTM direction over ``x`` ``[B, T, in]`` from zero state: ``[B, T, H]``.

    The same cell as ``dx.nn.LSTMBuilder`` (gates i, f, o, g). The input projection of
    every step is one matmul outside the scan; the scan carries only the recurrence.
    """
    B = x.shape[0]
    H = Wh.shape[1]
    xw = jnp.einsum("bti,gi->tbg", x, Wx) + b[None, None, :]  # [T, B, 4H]

    def step(carry, xt):
        c, h = carry
        i, f, o, g = jnp.split(xt + h @ Wh.T, 4, axis=-1)
        c, h = dx.nn.lstm_state(i, g, o, (f,), (c,))
        return (c, h), h

    zero = jnp.zeros((B, H), x.dtype)
    _, hs = jax.lax.scan(step, (zero, zero), xw)
    return jnp.swapaxes(hs, 0, 1)


def reverse_index(lengths, T):
    """``[B, T]`` positions that reverse each row within its length (padding stays put).

    A forward scan over ``x[rev]`` is the backward direction; since the padding stays after
    the words, it never reaches a word's state, so the recurrence needs no mask. The map is
    its own inverse, so ``out[rev]`` puts the results back in word order.
    """
    t = jnp.arange(T)[None, :]
    L = lengths[:, None]
    return jnp.where(t < L, L - 1 - t, t)


def _take_time(x, idx):
    return jnp.take_along_axis(x, idx[:, :, None], axis=1)


def bilstm(params, x, lengths, layers, prefix="birnn/"):
    """A stacked BiLSTM over padded ``x`` ``[B, T, in]``: the (forward, backward) top states."""
    rev = reverse_index(lengths, x.shape[1])
    for k in range(layers):
        fw = [params[f"{prefix}fwd{k}/lstm/{n}0"] for n in ("Wx", "Wh", "b")]
        bw = [params[f"{prefix}bwd{k}/lstm/{n}0"] for n in ("Wx", "Wh", "b")]
        hf = lstm_scan(x, *fw)
        hb = _take_time(lstm_scan(_take_time(x, rev), *bw), rev)
        if k < layers - 1:
            x = jnp.concatenate([hf, hb], axis=-1)
    return hf, hb


def tag_scores(params, hf, hb):
    """Tag scores ``[B, T, tags]`` from the top BiLSTM states (MLP or linear, as the model)."""
    h = jnp.concatenate([hf, hb], axis=-1)
    if "W1" in params:
        z = jnp.tanh(h @ params["W1"].T + params["b1"][None, None, :])
        return z @ params["W2"].T + params["b2"][None, None, :]
    return h @ params["W_out"].T + params["b_out"][None, None, :]


def masked_nll(scores, tags, lengths):
    """Summed cross-entropy over the words (padding masked out)."""
    logp = jax.nn.log_softmax(scores, axis=-1)
    nll = -jnp.take_along_axis(logp, tags[..., None], axis=-1)[..., 0]
    mask = jnp.arange(tags.shape[1])[None, :] < lengths[:, None]
    return jnp.sum(jnp.where(mask, nll, 0.0))


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class HandTagger(HandBaseline):
    """The hand-batched BiLSTM tagger (see the module doc). Sizes and the number of layers are
    read off the initial parameters."""

    len_step = LEN_STEP

    def __init__(self, init: dict):
        super().__init__(init, LR)
        self.layers = sum(1 for k in init if re.fullmatch(r"birnn/fwd\d+/lstm/Wx0", k))

    def pack(self, batch):
        """(signature, host arrays) of a batch: words and tags ``[B, T]`` padded with 0."""
        T = round_up(max(len(s.words) for s in batch), self.len_step)
        words = np.zeros((len(batch), T), np.int32)
        tags = np.zeros((len(batch), T), np.int32)
        lengths = np.array([len(s.words) for s in batch], np.int32)
        for i, s in enumerate(batch):
            words[i, :len(s.words)] = s.words
            tags[i, :len(s.tags)] = s.tags
        return (len(batch), T), (words, tags, lengths)

    def inputs(self, params, words, lengths, *extra):
        """The word vectors ``[B, T, emb]`` (the char tagger overrides this)."""
        return params["E"][words]

    def _loss(self, params, sig, words, tags, lengths, *extra):
        x = self.inputs(params, words, lengths, *extra)
        hf, hb = bilstm(params, x, lengths, self.layers)
        return masked_nll(tag_scores(params, hf, hb), tags, lengths)


HandModel = HandTagger
