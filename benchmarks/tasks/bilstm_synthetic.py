"""Synthetic BiLSTM tagger, every sentence 40 words (the paper's Section 4.1 / Figure 2).

The ideal case for hand batching: no padding. Embedding 200 over a vocabulary of 1000, two
BiLSTM layers of 256 units per direction, a linear layer to 300 tags, 64 sentences per
update, Adam. The models are ``tagger``'s (``TaggerModel`` with ``layers=2, mlp=None``;
``HandTagger``, which here always runs one (64, 40) signature).
"""
from __future__ import annotations

from . import tagger

NAME, UNIT, BATCH = "bilstm_synthetic", "sentences", 64
VOCAB, EMB, HID, N_TAGS, LAYERS, LENGTH = 1000, 200, 256, 300, 2, 40
LR = tagger.LR


def make_batches(n_batches: int, seed: int, batch_size: int = BATCH, vocab: int = VOCAB,
                 n_tags: int = N_TAGS, length: int = LENGTH) -> list:
    """``n_batches`` lists of ``batch_size`` tagged sentences of exactly ``length`` words."""
    return tagger.make_batches(n_batches, seed, batch_size, vocab=vocab, n_tags=n_tags,
                               min_len=length, max_len=length)


class DynaxModel(tagger.TaggerModel):
    """The two-layer BiLSTM tagger with a linear output layer, written per sentence."""

    def __init__(self, seed: int = 0, vocab: int = VOCAB, emb: int = EMB, hid: int = HID,
                 n_tags: int = N_TAGS, layers: int = LAYERS):
        super().__init__(seed, vocab=vocab, emb=emb, hid=hid, mlp=None, n_tags=n_tags,
                         layers=layers)


HandModel = tagger.HandTagger
