"""LSTM language model over Zipfian sentences (the "RNNLM" workload of DyNet's papers).

One-layer LSTM, embeddings 256, hidden 256, vocabulary 10000 (id 0 is the sentence boundary
``<s>``/``</s>``), sentences of 5–40 words (``benchmarks.data``). A sentence ``w_1..w_n`` is
read as ``<s> w_1 .. w_n`` and each state predicts the next token (``w_1 .. w_n </s>``): the
loss is the summed ``-log softmax(W h_t + b)[y_t]`` over all tokens of the batch. Runs at
batch sizes 1, 16 and 64 (``BATCH_SIZES``).

* ``DynaxModel``: per sentence, ``dx.nn.LSTMBuilder`` + ``dx.nn.StandardSoftmaxBuilder``;
  the autobatcher batches the same time step of all sentences and the softmax of all tokens.
* ``HandModel``: padded batch (length bucket: multiple of 8), ``lax.scan`` over time with
  the vmapped cell, the real positions gathered into one ``(N, hidden)`` block (token count
  padded to a geometric bucket and masked) for one big softmax, ``jax.value_and_grad`` and
  Adam, one jitted step per bucket signature.

Run from the repository root: ``python -m benchmarks.tasks.rnnlm [--quick] [--batch 16]``.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dynax as dx

from ..data import MAX_LEN, MIN_LEN, random_sentences
from ..hand import HandBaseline

NAME, UNIT, BATCH = "rnnlm", "sentences", 64
BATCH_SIZES = (1, 16, 64)
LR = 1e-3
VOCAB, EMB, HID = 10000, 256, 256
BOUNDARY = 0  # <s> and </s>


def make_batches(n_batches: int, seed: int, batch_size: int = BATCH, vocab: int = VOCAB,
                 min_len: int = MIN_LEN, max_len: int = MAX_LEN) -> list[list[tuple]]:
    """``n_batches`` lists of ``batch_size`` sentences (tuples of word ids in
    ``[1, vocab)``), deterministic in ``seed``."""
    sents = random_sentences(n_batches * batch_size, seed=seed, vocab=vocab - 1,
                             min_len=min_len, max_len=max_len)
    out = [tuple(w + 1 for w in s.words) for s in sents]  # shift: 0 is the boundary token
    return [out[i * batch_size:(i + 1) * batch_size] for i in range(n_batches)]


def _small_normal(key, shape):
    return 0.1 * jax.random.normal(key, shape)


class DynaxModel:
    """The LSTM LM in dynax, written per sentence."""

    def __init__(self, seed: int = 0, vocab: int = VOCAB, emb: int = EMB, hid: int = HID):
        self.pc = pc = dx.ParameterCollection(seed=seed)
        self.E = pc.add_lookup_parameters((vocab, emb), init=_small_normal, name="E")
        self.lstm = dx.nn.LSTMBuilder(1, emb, hid, pc)
        self.softmax = dx.nn.StandardSoftmaxBuilder(hid, vocab, pc)

    def loss(self, batch):
        """Summed negative log-likelihood of every token (and ``</s>``) of the batch."""
        losses = []
        for sent in batch:
            s = self.lstm.initial_state()
            for x, y in zip((BOUNDARY,) + sent, sent + (BOUNDARY,)):
                s = s.add_input(self.E[x])
                losses.append(self.softmax.neg_log_softmax(s.output(), y))
        return dx.esum(losses)


# ---- the hand-batched JAX baseline -------------------------------------------------------------

def _lstm_cell(x, c, h, Wx, Wh, b):
    """One LSTM step, the equations of ``dx.nn.LSTMBuilder`` (gates i, f, o, g)."""
    i, f, o, g = jnp.split(Wx @ x + Wh @ h + b, 4)
    return dx.nn.lstm_state(i, g, o, (f,), (c,))


def _nll(h, y, W, b):
    return -jax.nn.log_softmax(W @ h + b)[y]


def _round_up(n: int, q: int) -> int:
    return -(-n // q) * q


def _geometric_bucket(n: int, lo: int = 16) -> int:
    """``n`` rounded up to a multiple of a power of two about 1/8 of it (at least ``lo``)."""
    q = max(lo, 1 << max(0, n.bit_length() - 4))
    return _round_up(n, q)


class HandModel(HandBaseline):
    """Padded, bucketed LSTM LM training step, as a skilled JAX user would write it.

    Host: token ids padded to ``(B, L)`` with ``L`` a multiple of 8, and the flat indices
    ``b * L + t`` of the real positions padded to a geometric bucket ``N`` with a mask. Jitted
    step per signature ``(B, L, N)``: ``lax.scan`` of the vmapped cell over time (pad positions
    run after a sentence's end and are never read), gather the ``N`` real states, one
    ``(N, vocab)`` softmax, masked sum, ``jax.value_and_grad``, Adam.
    """

    _P = "lstm/{}0"

    def __init__(self, init: dict):
        super().__init__(init, LR)

    @staticmethod
    def signature(batch) -> tuple:
        """The jit signature of a batch: (sentences, padded length, padded token count)."""
        L = _round_up(max(len(s) for s in batch) + 1, 8)
        return (len(batch), L, _geometric_bucket(sum(len(s) + 1 for s in batch)))

    def pack(self, batch):
        """Inputs, targets, flat positions and mask of one batch, padded to its signature."""
        B, L, N = sig = self.signature(batch)
        inputs = np.zeros((B, L), np.int32)
        targets = np.zeros((N,), np.int32)
        pos = np.zeros((N,), np.int32)
        mask = np.zeros((N,), np.float32)
        k = 0
        for i, s in enumerate(batch):
            n = len(s) + 1
            inputs[i, 1:n] = s
            targets[k:k + n - 1] = s  # target 0 (</s>) at the end
            pos[k:k + n] = i * L + np.arange(n)
            mask[k:k + n] = 1.0
            k += n
        return sig, (inputs, targets, pos, mask)

    @classmethod
    def _loss(cls, params, sig, inputs, targets, pos, mask):
        P = cls._P
        Wx, Wh, b = params[P.format("Wx")], params[P.format("Wh")], params[P.format("b")]
        cell = jax.vmap(_lstm_cell, in_axes=(0, 0, 0, None, None, None))
        B, L = inputs.shape
        zeros = jnp.zeros((B, Wh.shape[1]), jnp.float32)

        def step(carry, x):
            c, h = cell(x, carry[0], carry[1], Wx, Wh, b)
            return (c, h), h

        xs = jnp.swapaxes(params["E"][inputs], 0, 1)  # (L, B, EMB)
        hs = jax.lax.scan(step, (zeros, zeros), xs)[1]  # (L, B, HID)
        hs = jnp.swapaxes(hs, 0, 1).reshape(B * L, -1)[pos]  # real positions only
        nll = jax.vmap(_nll, in_axes=(0, 0, None, None))(
            hs, targets, params["softmax/W"], params["softmax/b"])
        return jnp.sum(mask * nll)


# ---- a quick check without the harness (also used by benchmarks.tasks.parser) ---------------

def quick_compare(task, argv=None) -> None:
    """Train ``task`` a few updates per system from the same start; print loss and items/s.

    Simple wall-clock timing of whole updates (loss, backward, Adam) after warm-up updates;
    no precompilation of the hand baseline's other signatures. For ``benchmarks.harness``'s
    fuller figures use ``benchmarks.run``.
    """
    ap = argparse.ArgumentParser(description=f"quick {task.NAME} comparison")
    ap.add_argument("--quick", action="store_true", help="fewer updates")
    ap.add_argument("--batch", type=int, default=task.BATCH)
    ap.add_argument("--systems", default="agenda,none,hand")
    args = ap.parse_args(argv)
    counts = {"none": (1, 1), "depth": (2, 3), "agenda": (2, 3), "hand": (2, 3)}
    if not args.quick:
        counts = {"none": (1, 3), "depth": (3, 10), "agenda": (3, 10), "hand": (3, 10)}
    n = max(w + t for w, t in counts.values())
    batches = task.make_batches(n, seed=1, batch_size=args.batch)
    print(f"{task.NAME}: batch {args.batch} {task.UNIT}; jax {jax.__version__} on "
          f"{jax.devices()[0].platform}", flush=True)
    for system in args.systems.split(","):
        warm, timed = counts[system]
        losses, secs = [], []
        if system == "hand":
            init = {p.name: np.asarray(p.value) for p in task.DynaxModel(seed=0).pc.parameters()}
            model = task.HandModel(init)
            for batch in batches[:warm + timed]:
                t0 = time.perf_counter()
                losses.append(model.update(batch)[0])
                secs.append(time.perf_counter() - t0)
        else:
            model = task.DynaxModel(seed=0)
            trainer = dx.Trainer(model.pc, optax.adam(task.LR), sparse_updates=True)
            for batch in batches[:warm + timed]:
                t0 = time.perf_counter()
                dx.renew_cg(autobatch=system)
                loss = model.loss(batch)
                losses.append(loss.value())
                loss.backward()
                trainer.update()
                jax.block_until_ready([p.value for p in model.pc.parameters()])
                secs.append(time.perf_counter() - t0)
        rate = args.batch * timed / sum(secs[warm:])
        print(f"{system:>7}: {rate:8.1f} {task.UNIT}/s over {timed} updates after {warm} "
              f"warm-up (first update {secs[0]:.2f} s); loss per item: first "
              f"{losses[0] / args.batch:.4f}, last {losses[-1] / args.batch:.4f}", flush=True)


if __name__ == "__main__":
    import sys
    quick_compare(sys.modules[__name__])
