"""BiLSTM tagger with character-based embeddings of rare words (the paper's "BiLSTM w/ char").

``tagger``'s model (embedding 128, BiLSTM 128 per direction, MLP 32, 9 tags, vocabulary
20000, 5–40 words, 64 sentences per update, Adam), except that a word seen fewer than 5 times
in a 200k-token synthetic Zipfian corpus (about 16% of the tokens) is embedded by a
character BiLSTM instead of a lookup: character embedding 20 (the DyNet paper's size) and 64
units per direction, whose final forward and backward states concatenate to the word's 128-d
vector (as in DyNet's benchmark tagger, where the char BiLSTM has half the word embedding
size per direction).

* ``DynaxModel``: per word, ``if rare: char BiRNN else lookup``, plain Python control flow;
  the autobatcher batches the character LSTM steps of all rare words of the batch.
* ``HandModel``: the tagger's padded scans, plus all rare tokens of the batch packed into one
  ``[R, Lc]`` character matrix (R rounded up to a multiple of 32, Lc to a multiple of 4) run
  through their own scans and scattered into the word inputs with ``jnp.where``.
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

import dynax as dx

from ..data import CharSentence, char_sentences
from . import tagger
from .tagger import round_up

NAME, UNIT, BATCH = "char_tagger", "sentences", 64
VOCAB, EMB, HID, MLP, N_TAGS = tagger.VOCAB, tagger.EMB, tagger.HID, tagger.MLP, tagger.N_TAGS
N_CHARS, CEMB = 60, 20  # character vocabulary and embedding; char hidden is EMB // 2
CORPUS_TOKENS = 200_000  # rare = seen < 5 times in a synthetic corpus of this size
LR = tagger.LR
RARE_STEP, CHAR_STEP = 32, 4  # the hand baseline's padding of rare tokens and word length


def make_batches(n_batches: int, seed: int, batch_size: int = BATCH, vocab: int = VOCAB,
                 n_tags: int = N_TAGS, n_chars: int = N_CHARS, min_len: int = tagger.MIN_LEN,
                 max_len: int = tagger.MAX_LEN, corpus_tokens: int = CORPUS_TOKENS
                 ) -> list[list[CharSentence]]:
    """``n_batches`` lists of ``batch_size`` tagged sentences, rare words spelled out
    (the same words and tags as ``tagger.make_batches`` with the same arguments)."""
    s = char_sentences(n_batches * batch_size, seed, vocab=vocab, n_tags=n_tags,
                       n_chars=n_chars, min_len=min_len, max_len=max_len,
                       corpus_tokens=corpus_tokens)
    return [s[i * batch_size:(i + 1) * batch_size] for i in range(n_batches)]


class DynaxModel(tagger.TaggerModel):
    """The char tagger in dynax: the word vector of a rare word comes from a char BiLSTM."""

    def __init__(self, seed: int = 0, vocab: int = VOCAB, emb: int = EMB, hid: int = HID,
                 mlp: int | None = MLP, n_tags: int = N_TAGS, n_chars: int = N_CHARS,
                 cemb: int = CEMB):
        super().__init__(seed, vocab=vocab, emb=emb, hid=hid, mlp=mlp, n_tags=n_tags)
        self.C = self.pc.add_lookup_parameters((n_chars, cemb), init="uniform", name="C")
        # emb // 2 units per direction, so the two final states concatenate to emb
        self.char_bi = dx.nn.BiRNNBuilder(1, cemb, emb, self.pc.add_subcollection("char"),
                                          dx.nn.LSTMBuilder)

    def embed(self, sentence) -> list:
        E, C = self.E, self.C
        out = []
        for w, spelling in zip(sentence.words, sentence.chars):
            if spelling is None:
                out.append(E[w])
            else:
                states = self.char_bi.add_inputs([C[c] for c in spelling])
                # last forward state, and the backward state after reading back to char 0
                out.append(dx.concatenate([states[-1][0].output(), states[0][1].output()]))
        return out


class HandModel(tagger.HandTagger):
    """The hand-batched char tagger (see the module doc)."""

    def pack(self, batch):
        (B, T), (words, tags, lengths) = super().pack(batch)
        rare_pos = np.zeros((B, T), np.int32)
        is_rare = np.zeros((B, T), bool)
        spellings = []
        for i, s in enumerate(batch):
            for t, ch in enumerate(s.chars):
                if ch is not None:
                    rare_pos[i, t] = len(spellings)
                    is_rare[i, t] = True
                    spellings.append(ch)
        R = round_up(max(1, len(spellings)), RARE_STEP)
        Lc = round_up(max((len(c) for c in spellings), default=1), CHAR_STEP)
        chars = np.zeros((R, Lc), np.int32)
        clen = np.ones(R, np.int32)  # padding rows: one char 0, never read
        for r, ch in enumerate(spellings):
            chars[r, :len(ch)] = ch
            clen[r] = len(ch)
        return (B, T, R, Lc), (words, tags, lengths, chars, clen, rare_pos, is_rare)

    def inputs(self, params, words, lengths, chars, clen, rare_pos, is_rare):
        x = params["E"][words]
        hf, hb = tagger.bilstm(params, params["C"][chars], clen, 1, prefix="char/birnn/")
        last = jnp.take_along_axis(hf, (clen - 1)[:, None, None], axis=1)[:, 0]
        rare_vec = jnp.concatenate([last, hb[:, 0]], axis=-1)  # [R, emb]
        return jnp.where(is_rare[:, :, None], rare_vec[rare_pos], x)
