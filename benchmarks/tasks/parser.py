"""Transition-based dependency parser: 64 arc-standard parsers stepped in lockstep.

The hardest workload of DyNet's autobatching paper (Neubig et al., 2017, Table 1): a BiLSTM
encodes each sentence, then a greedy transition system makes one decision per step from an
MLP over the encodings of a few stack and buffer items. Which vectors feed a decision depends
on the decisions before it, so the scores must be computed (``dx.forward``) at every step;
running ``b`` parsers side by side lets one step be batched across them.

Model (BIST-like, Kiperwasser & Goldberg 2016, unlabeled):

* tokens ``ROOT w_1 .. w_n`` (ROOT is an extra embedding row), embeddings ``EMB`` = 100,
  a one-layer BiLSTM of ``HID`` = 200 (100 per direction) over them;
* features of a configuration: the encodings of the stack items ``s0, s1, s2`` and the first
  buffer item ``b0``, a learned ``pad`` vector where a slot is empty;
* scores of the three actions ``W2 tanh(W1 [s0; s1; s2; b0] + b1) + b2`` (MLP hidden 100).

Transition system: arc-standard, positions ``0`` (ROOT) .. ``n``. SHIFT moves ``b0`` onto the
stack; LEFT-ARC makes ``s0`` the head of ``s1`` (not ROOT) and pops ``s1``; RIGHT-ARC makes
``s1`` the head of ``s0`` and pops ``s0`` (from ROOT only once the buffer is empty, so ROOT
gets one dependent). A sentence of ``n`` words takes exactly ``2n`` transitions.

Training scheme: *non-deterministic oracle, no error exploration* (Goldberg & Nivre, 2013).
In a configuration from which the gold tree is still reachable, an action is *zero-cost* when
the gold tree stays reachable after it (cheap exact test, see ``Parser.zero_cost``). After each
batched forward, every parser follows its model's highest-scoring zero-cost action (the model
chooses among the gold-consistent derivations, e.g. attach now or shift a right dependent
first), so the path and the features do depend on the computed scores; the gold tree is
always reached. The loss of a step is BIST's margin hinge
``max(0, 1 - max_{zero-cost} s + max_{valid, not zero-cost} s)`` (the two arg-maxes picked on
the host from the computed scores), taken where some valid action is wrong. Steps with a single
valid action are not scored (no decision to make). ``Parser.static_oracle`` gives the canonical
gold derivation (used by the tests).

Synthetic data: Zipfian sentences of 5–40 words (``benchmarks.data``) with random projective
trees, one word attached to ROOT.

* ``DynaxModel``: written per sentence and per parser; each step builds one score expression
  per unfinished parser and calls ``dx.forward`` on all of them, so the autobatcher runs the
  step's MLP across the parsers as a few kernels (and the BiLSTMs of all sentences, in the first
  forward). The hinge terms are built after the last step so they batch together.
* ``HandModel``: what a skilled JAX user writes: a jitted padded BiLSTM (``lax.scan``, length
  buckets) gives the encodings and keeps their ``jax.vjp``; a host-side loop steps the 64
  parsers, calling a jitted batched MLP once per step on features gathered by index; then one
  jitted step gathers the recorded features and applies loss + grad (the encoder's through
  the kept vjp) + Adam.

Run from the repository root: ``python -m benchmarks.tasks.parser [--quick]``.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dynax as dx

from ..data import MAX_LEN, MIN_LEN, random_sentences
from ..hand import HandBaseline

NAME, UNIT, BATCH = "parser", "sentences", 64
LR = 1e-3
VOCAB, EMB, HID, MLP = 10000, 100, 200, 100
SHIFT, LEFT, RIGHT = 0, 1, 2
N_ACTIONS = 3
N_FEATS = 4  # s0, s1, s2, b0
ACTION_IDS = tuple(np.int32(a) for a in range(N_ACTIONS))  # per-instance ints of dx.function


# ---- data -------------------------------------------------------------------------------------

def random_projective_heads(rng: np.random.Generator, n: int) -> tuple:
    """Gold heads of a random projective tree over words ``1..n``: ``heads[0] = -1`` (ROOT),
    ``heads[i]`` in ``0..n``, exactly one word attached to ROOT.

    A span gets a uniformly random head; the rest of the span on each side of it is cut at
    random points into consecutive sub-spans, each built the same way and attached to that
    head, which gives a mix of flat and deep trees (and only projective ones).
    """
    heads = [-1] + [0] * n

    def build(lo: int, hi: int) -> int:  # head of span [lo, hi)
        h = int(rng.integers(lo, hi))
        attach(lo, h, h)
        attach(h + 1, hi, h)
        return h

    def attach(lo: int, hi: int, h: int) -> None:
        while lo < hi:
            k = int(rng.integers(lo + 1, hi + 1))
            heads[build(lo, k)] = h
            lo = k

    heads[build(1, n + 1)] = 0
    return tuple(heads)


class ParsedSentence:
    """Words ``w_1..w_n`` (ids in ``[0, vocab)``) and gold ``heads`` (length ``n + 1``,
    position 0 is ROOT with head -1)."""

    __slots__ = ("words", "heads")

    def __init__(self, words: tuple, heads: tuple):
        self.words, self.heads = words, heads

    def __len__(self):
        return len(self.words)


def make_batches(n_batches: int, seed: int, batch_size: int = BATCH, vocab: int = VOCAB,
                 min_len: int = MIN_LEN, max_len: int = MAX_LEN) -> list[list[ParsedSentence]]:
    """``n_batches`` lists of ``batch_size`` parsed sentences (deterministic in ``seed``)."""
    sents = random_sentences(n_batches * batch_size, seed=seed, vocab=vocab,
                             min_len=min_len, max_len=max_len)
    rng = np.random.default_rng(seed + 7919)  # trees from their own stream
    out = [ParsedSentence(s.words, random_projective_heads(rng, len(s.words))) for s in sents]
    return [out[i * batch_size:(i + 1) * batch_size] for i in range(n_batches)]


# ---- the transition system (host side, shared by both systems) --------------------------------

class Parser:
    """An arc-standard configuration of one sentence, with gold bookkeeping.

    ``stack`` holds positions (bottom first, ROOT = 0 at the bottom), the buffer is
    ``b .. n``; ``heads`` are the arcs made so far (-1 = none). ``pending[w]`` counts the gold
    dependents of ``w`` not yet attached, ``rpending[w]`` those to its right.
    """

    __slots__ = ("n", "gold", "stack", "b", "heads", "pending", "rpending")

    def __init__(self, gold_heads):
        self.gold = gold = list(gold_heads)
        self.n = n = len(gold) - 1
        self.pending = [0] * (n + 1)
        self.rpending = [0] * (n + 1)
        for d in range(1, n + 1):
            self.pending[gold[d]] += 1
            if d > gold[d]:
                self.rpending[gold[d]] += 1
        self.stack = [0]
        self.b = 1
        self.heads = [-1] * (n + 1)

    def done(self) -> bool:
        return self.b > self.n and len(self.stack) == 1

    def valid(self) -> tuple:
        """Which of SHIFT, LEFT, RIGHT may be applied."""
        st, s = self.stack, len(self.stack)
        return (self.b <= self.n,
                s >= 2 and st[-2] != 0,
                s >= 2 and (st[-2] != 0 or self.b > self.n))

    def zero_cost(self) -> tuple:
        """Which actions keep the gold tree reachable, assuming it is reachable now.

        Arc-standard, projective gold tree: a configuration whose arcs are gold and whose
        popped words are complete can still reach the gold tree iff every stack item ``x``
        below the top, with ``y`` the item just above it, either has ``y`` among its gold
        descendants (what lies above ``x`` can be reduced into ``x``), or has its head on its
        right and no unattached left dependent (``x`` may go under its head before ever being
        on top again). Hence LEFT and RIGHT cost nothing iff they add a gold arc to a complete
        dependent, and SHIFT iff the pair (top, ``b0``) it creates meets the condition. The
        tests check this against exhaustive search.
        """
        v = self.valid()
        st, g = self.stack, self.gold
        s0 = st[-1]
        shift = False
        if v[0]:
            x = self.b
            while x > s0:  # a descendant's path to s0 stays right of s0 (projectivity)
                x = g[x]
            shift = x == s0 or (g[s0] > s0 and self.pending[s0] == self.rpending[s0])
        if len(st) < 2:
            return (shift, False, False)
        s1 = st[-2]
        left = v[1] and g[s1] == s0 and self.pending[s1] == 0
        right = v[2] and g[s0] == s1 and self.pending[s0] == 0
        return (shift, left, right)

    def static_oracle(self) -> int:
        """The canonical gold action: LEFT, else RIGHT, else SHIFT (eager reduction)."""
        zc = self.zero_cost()
        if zc[LEFT]:
            return LEFT
        if zc[RIGHT]:
            return RIGHT
        if zc[SHIFT]:
            return SHIFT
        raise RuntimeError("static_oracle: the gold tree is no longer reachable")

    def apply(self, a: int) -> None:
        st = self.stack
        if a == SHIFT:
            st.append(self.b)
            self.b += 1
            return
        if a == LEFT:
            d = st.pop(-2)
            h = st[-1]
        else:
            d = st.pop()
            h = st[-1]
        self.heads[d] = h
        if self.gold[d] == h:
            self.pending[h] -= 1
            if d > h:
                self.rpending[h] -= 1

    def features(self) -> tuple:
        """Positions of ``s0, s1, s2, b0`` (-1 where the slot is empty)."""
        st = self.stack
        k = len(st)
        return (st[-1], st[-2] if k > 1 else -1, st[-3] if k > 2 else -1,
                self.b if self.b <= self.n else -1)


def choose(scores: np.ndarray, valid, zero_cost) -> tuple:
    """(action to follow, correct, wrong) from one step's scores: the best zero-cost action
    (followed), and the best valid non-zero-cost action (None if there is none)."""
    best_c = best_w = None
    for a in range(N_ACTIONS):
        if zero_cost[a]:
            if best_c is None or scores[a] > scores[best_c]:
                best_c = a
        elif valid[a]:
            if best_w is None or scores[a] > scores[best_w]:
                best_w = a
    return best_c, best_c, best_w


def only_action(valid) -> int | None:
    """The action when exactly one is valid (no decision, nothing to score), else None."""
    if sum(valid) == 1:
        return valid.index(True)
    return None


# ---- dynax ----------------------------------------------------------------------------------

def _small_normal(key, shape):
    return 0.1 * jax.random.normal(key, shape)


class DynaxModel:
    """The parser in dynax: per-sentence encoding, per-parser steps, one ``dx.forward`` per
    step over all unfinished parsers."""

    def __init__(self, seed: int = 0, vocab: int = VOCAB, emb: int = EMB, hid: int = HID,
                 mlp: int = MLP):
        self.pc = pc = dx.ParameterCollection(seed=seed)
        self.root = vocab  # embedding row of the ROOT token
        self.E = pc.add_lookup_parameters((vocab + 1, emb), init=_small_normal, name="E")
        self.bilstm = dx.nn.BiRNNBuilder(1, emb, hid, pc, dx.nn.LSTMBuilder)
        self.pad = pc.add_parameters((hid,), init=_small_normal, name="pad")
        self.W1 = pc.add_parameters((mlp, N_FEATS * hid), name="W1")
        self.b1 = pc.add_parameters((mlp,), init="zeros", name="b1")
        self.W2 = pc.add_parameters((N_ACTIONS, mlp), name="W2")
        self.b2 = pc.add_parameters((N_ACTIONS,), init="zeros", name="b2")

    def scores(self, enc, pad, feats):
        """Action scores of one configuration (an Expression of shape (3,)): one fused node,
        so a lockstep step is one kernel across the parsers."""
        xs = [enc[j] if j >= 0 else pad for j in feats]
        return score_cell(*xs, self.W1, self.b1, self.W2, self.b2)

    def loss(self, batch):
        """Summed hinge loss of all parsers' decisions."""
        encs = [self.bilstm.transduce([self.E[self.root]] + [self.E[w] for w in s.words])
                for s in batch]
        pad = dx.parameter(self.pad)  # one node for every empty slot, so concats share a signature
        parsers = [Parser(s.heads) for s in batch]
        terms = []  # (scores, correct, wrong)
        active = list(range(len(batch)))
        while active:
            scored = []
            for i in active:
                p = parsers[i]
                a = only_action(p.valid())
                if a is not None:
                    p.apply(a)
                else:
                    scored.append((i, self.scores(encs[i], pad, p.features())))
            if scored:
                dx.forward([e for _, e in scored])  # this step, batched across the parsers
                for i, e in scored:
                    p = parsers[i]
                    a, c, w = choose(e.npvalue(), p.valid(), p.zero_cost())
                    if w is not None:
                        terms.append((e, c, w))
                    p.apply(a)
            active = [i for i in active if not parsers[i].done()]
        if not terms:
            raise ValueError("parser loss: no decision with a wrong action in this batch")
        # built after the last step, so the hinge terms of all steps batch together; the
        # actions are NumPy ints, per-instance data, so all terms share one signature (Python
        # ints would be static: a signature, and batch sizes to compile, per action pair)
        return dx.esum([margin_cell(e, ACTION_IDS[c], ACTION_IDS[w]) for e, c, w in terms])


@dx.function
def score_cell(*args):
    """MLP action scores from the N_FEATS feature vectors (then W1, b1, W2, b2)."""
    feats, (W1, b1, W2, b2) = args[:-4], args[-4:]
    return _mlp(jnp.concatenate(feats), W1, b1, W2, b2)


@dx.function
def margin_cell(scores, correct, wrong):
    """BIST's hinge ``max(0, 1 - s[correct] + s[wrong])`` of one decision."""
    return jax.nn.relu(1.0 - scores[correct] + scores[wrong])


# ---- the hand-batched JAX baseline -------------------------------------------------------------

def _lstm_cell(x, c, h, Wx, Wh, b):
    """One LSTM step, the equations of ``dx.nn.LSTMBuilder`` (gates i, f, o, g)."""
    i, f, o, g = jnp.split(Wx @ x + Wh @ h + b, 4)
    return dx.nn.lstm_state(i, g, o, (f,), (c,))


def _mlp(x, W1, b1, W2, b2):
    return W2 @ jnp.tanh(W1 @ x + b1) + b2


def run_lstm(xs, Wx, Wh, b):
    """Hidden states of a batched LSTM over ``xs`` (time, batch, dim), zero initial state."""
    cell = jax.vmap(_lstm_cell, in_axes=(0, 0, 0, None, None, None))
    H = Wh.shape[1]
    zeros = jnp.zeros((xs.shape[1], H), xs.dtype)

    def step(carry, x):
        c, h = cell(x, carry[0], carry[1], Wx, Wh, b)
        return (c, h), h

    return jax.lax.scan(step, (zeros, zeros), xs)[1]


def _round_up(n: int, q: int) -> int:
    return -(-n // q) * q


def _geometric_bucket(n: int, lo: int = 16) -> int:
    """``n`` rounded up to a multiple of a power of two about 1/8 of it (at least ``lo``): a
    handful of sizes over a range, at most 12.5% padding."""
    q = max(lo, 1 << max(0, n.bit_length() - 4))
    return _round_up(n, q)


class HandModel(HandBaseline):
    """Hand-batched parser training step, as a skilled JAX user would write it.

    Per update: (1) host: pad the token ids to a length bucket (multiple of 8); (2) jitted
    BiLSTM encode (``lax.scan`` forward, and over per-sentence reversed indices backward) into
    a table of ``B * L`` encodings plus the ``pad`` row; (3) host loop over the steps: the
    features of every parser that has a decision to make are gathered by index in one jitted
    batched MLP call (fixed width ``B``), the scores come back to the host, which picks and
    applies actions with the same rule as the dynax model and records (features, correct,
    wrong); (4) one jitted step: gather the recorded features (padded and masked), hinge
    loss, ``jax.value_and_grad`` w.r.t. the parameters and the table, the table's gradient
    taken back through the encoder by the ``jax.vjp`` that (2) kept (so the BiLSTM runs
    forward once per update; re-encoding in the step made the baseline 8-22% slower), Adam.

    The recorded decisions are padded to a bucket of their upper bound, ``2 n`` per sentence of
    ``n`` words (one per transition), not of their count: the count depends on the decisions,
    which drift as the model trains, so a bucket of it met new shapes (compilations) in timed
    updates; the bound is known from the batch alone (``signature``), so every shape can be
    compiled ahead. About 90% of the transitions record one (those where some valid action is
    wrong; 0.89-0.91 over 30 batches of 64), so the extra padding is small.

    ``update`` returns the host seconds of the packing and of the transition loop, the device
    calls and their waits excluded.
    """

    @staticmethod
    def signature(batch) -> tuple:
        """The shapes of an update: batch size, padded length, decision bucket."""
        B = len(batch)
        L = _round_up(max(len(s) for s in batch) + 1, 8)
        return ("step", B, L, _geometric_bucket(sum(2 * len(s) for s in batch)))

    def __init__(self, init: dict):
        super().__init__(init, LR)
        self.root = self.params["E"].shape[0] - 1
        self.encode = jax.jit(lambda params, words, lens: jax.vjp(
            lambda p: self._encode(p, words, lens), params))  # the table, and its vjp
        self.score = jax.jit(self._score)

    @staticmethod
    def _encode(params, words, lens):
        """(B * L + 1, HID) table: each token's ``[fwd; bwd]`` encoding, then ``pad``."""
        p = "birnn/{}0/lstm/{}0"
        B, L = words.shape
        x = params["E"][words]  # (B, L, EMB)
        t = jnp.arange(L, dtype=jnp.int32)[None, :]
        # the backward LSTM reads each sentence reversed; pads stay after the real tokens
        rev = jnp.where(t < lens[:, None], lens[:, None] - 1 - t, t)
        x_rev = jnp.take_along_axis(x, rev[:, :, None], axis=1)
        hf = run_lstm(jnp.swapaxes(x, 0, 1), *(params[p.format("fwd", k)]
                                              for k in ("Wx", "Wh", "b")))
        hb = run_lstm(jnp.swapaxes(x_rev, 0, 1), *(params[p.format("bwd", k)]
                                                  for k in ("Wx", "Wh", "b")))
        hf = jnp.swapaxes(hf, 0, 1)
        hb = jnp.take_along_axis(jnp.swapaxes(hb, 0, 1), rev[:, :, None], axis=1)
        enc = jnp.concatenate([hf, hb], axis=-1).reshape(B * L, -1)
        return jnp.concatenate([enc, params["pad"][None, :]], axis=0)

    @staticmethod
    def _score(params, table, idx):
        """Scores (N, 3) of N configurations given as (N, 4) rows of ``table``."""
        x = table[idx].reshape(idx.shape[0], -1)
        return jax.vmap(_mlp, in_axes=(0, None, None, None, None))(
            x, params["W1"], params["b1"], params["W2"], params["b2"])

    @classmethod
    def _table_loss(cls, params, table, idx, cw, mask):
        """The summed hinge loss of the recorded decisions, given the encodings."""
        s = cls._score(params, table, idx)
        sc = jnp.take_along_axis(s, cw, axis=1)  # (T, 2): correct, wrong
        return jnp.sum(mask * jax.nn.relu(1.0 - sc[:, 0] + sc[:, 1]))

    @classmethod
    def _loss(cls, params, sig, words, lens, idx, cw, mask):
        """The whole loss as one function of the parameters (the step's math, for tests)."""
        return cls._table_loss(params, cls._encode(params, words, lens), idx, cw, mask)

    def _step(self, sig, params, opt_state, enc_vjp, table, idx, cw, mask):
        loss, (g_params, g_table) = jax.value_and_grad(self._table_loss, argnums=(0, 1))(
            params, table, idx, cw, mask)
        (g_enc,) = enc_vjp(g_table)
        grads = jax.tree.map(jnp.add, g_params, g_enc)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def update(self, batch) -> tuple[float, float]:
        """One training update; returns (summed loss, host seconds)."""
        t0 = time.perf_counter()
        device_s = 0.0
        sig = self.signature(batch)
        _, B, L, T = sig
        words = np.zeros((B, L), np.int32)
        lens = np.zeros((B,), np.int32)
        for i, s in enumerate(batch):
            words[i, 0] = self.root
            words[i, 1:len(s) + 1] = s.words
            lens[i] = len(s) + 1
        pad_row = B * L
        self.signatures.add(("encode", B, L))
        d0 = time.perf_counter()
        table, enc_vjp = self.encode(self.params, words, lens)
        device_s += time.perf_counter() - d0

        parsers = [Parser(s.heads) for s in batch]
        rec_idx, rec_cw = [], []
        active = list(range(B))
        idx = np.full((B, N_FEATS), pad_row, np.int32)  # fixed width B: one score signature
        self.signatures.add(("score", B, L))
        while active:
            idx.fill(pad_row)
            scored = []
            for i in active:
                p = parsers[i]
                a = only_action(p.valid())
                if a is not None:
                    p.apply(a)
                    continue
                idx[i] = [i * L + j if j >= 0 else pad_row for j in p.features()]
                scored.append(i)
            if scored:
                d0 = time.perf_counter()
                scores = np.asarray(self.score(self.params, table, idx))
                device_s += time.perf_counter() - d0
                for i in scored:
                    p = parsers[i]
                    a, c, w = choose(scores[i], p.valid(), p.zero_cost())
                    if w is not None:
                        rec_idx.append(idx[i].copy())
                        rec_cw.append((c, w))
                    p.apply(a)
            active = [i for i in active if not parsers[i].done()]

        n = len(rec_idx)
        if not n:
            raise ValueError("parser loss: no decision with a wrong action in this batch")
        idx_all = np.full((T, N_FEATS), pad_row, np.int32)
        idx_all[:n] = rec_idx
        cw = np.zeros((T, 2), np.int32)
        cw[:n] = rec_cw
        mask = np.zeros((T,), np.float32)
        mask[:n] = 1.0
        self.signatures.add(sig)
        d0 = time.perf_counter()
        self.params, self.opt_state, loss = self.step(sig, self.params, self.opt_state,
                                                      enc_vjp, table, idx_all, cw, mask)
        loss = float(loss)
        device_s += time.perf_counter() - d0
        return loss, time.perf_counter() - t0 - device_s


def main(argv=None) -> None:
    """Quick comparison of agenda, none and the hand baseline (see ``rnnlm.quick_compare``)."""
    import sys

    from .rnnlm import quick_compare
    quick_compare(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
