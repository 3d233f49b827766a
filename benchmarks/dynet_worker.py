"""DyNet's side of ``benchmarks.vs_dynet``: the tagger and the Tree-LSTM in DyNet itself.

Runs under a Python that has DyNet (``import dynet``); it imports nothing of dynax or JAX,
so it needs neither. The parent (``vs_dynet.DyNetSystem``) talks to it through one JSON
object per line: on stdin a configuration first, then ``{"op": "batch", "id", "data"}``
(a minibatch, sent once) and ``{"op": "update", "id"}``; each reply is a line starting
with ``@@ `` (DyNet writes its own messages to stderr).

The models are written the way a DyNet user would, per instance, with DyNet's own
autobatching (``autobatch=1``, its agenda strategy) and its LSTM builder, and they compute
the same functions as the dynax task models: they start from the dynax model's initial
parameters (sent as an ``.npz``), so the first update's loss must agree with dynax's.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np


def reply(obj) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Tagger:
    """BiLSTM tagger: word lookups, one LSTM builder per direction (``CompactVanilla``:
    fused nodes; or ``Vanilla``), a tanh MLP and the tag's cross-entropy per word
    (``benchmarks.tasks.tagger``)."""

    def __init__(self, dy, pc, init, lstm_kind="compact", forget_bias=1.0):
        self.dy = dy
        self.E = pc.lookup_parameters_from_numpy(init["E"])
        self.dirs = []
        for d in ("fwd", "bwd"):
            emb, hid = init[d + "_Wx"].shape[1], init[d + "_Wh"].shape[1]
            if lstm_kind == "compact":  # fused gate / cell / output nodes, forget bias 1
                lstm = dy.CompactVanillaLSTMBuilder(1, emb, hid, pc)
            else:  # the same LSTM as a dozen elementary nodes per step
                lstm = dy.VanillaLSTMBuilder(1, emb, hid, pc, forget_bias=forget_bias)
            Wx, Wh, b = lstm.get_parameters()[0]
            Wx.set_value(init[d + "_Wx"])
            Wh.set_value(init[d + "_Wh"])
            # DyNet's builder adds forget_bias to the f gate (gates i, f, o, g, as dynax's)
            b_dy = init[d + "_b"].copy()
            b_dy[hid:2 * hid] -= forget_bias
            b.set_value(b_dy)
            self.dirs.append(lstm)
        self.W1, self.b1, self.W2, self.b2 = (pc.parameters_from_numpy(init[k])
                                              for k in ("W1", "b1", "W2", "b2"))

    def loss(self, batch):
        dy, E = self.dy, self.E
        fwd, bwd = self.dirs
        losses = []
        for words, tags in batch:
            xs = [E[w] for w in words]
            fs = fwd.initial_state().transduce(xs)
            bs = bwd.initial_state().transduce(xs[::-1])[::-1]
            for f, b, t in zip(fs, bs, tags):
                h = dy.tanh(dy.affine_transform([self.b1, self.W1, dy.concatenate([f, b])]))
                losses.append(dy.pickneglogsoftmax(
                    dy.affine_transform([self.b2, self.W2, h]), t))
        return dy.esum(losses)


class TreeLSTM:
    """Binary (N-ary, N = 2) Tree-LSTM classifier over post-order trees
    (``benchmarks.tasks.treelstm``)."""

    def __init__(self, dy, pc, init):
        self.dy = dy
        self.E = pc.lookup_parameters_from_numpy(init["E"])
        self.W_leaf, self.b_leaf, self.U, self.b_comp, self.W_out, self.b_out = (
            pc.parameters_from_numpy(init[k])
            for k in ("W_leaf", "b_leaf", "U", "b_comp", "W_out", "b_out"))
        self.H = init["U"].shape[1] // 2

    def encode(self, words, children):
        dy, H, n = self.dy, self.H, len(words)

        def rec(i):
            if i < n:  # a leaf: gates i, o, u
                g = dy.affine_transform([self.b_leaf, self.W_leaf, self.E[words[i]]])
                c = dy.cmult(dy.logistic(dy.pick_range(g, 0, H)),
                             dy.tanh(dy.pick_range(g, 2 * H, 3 * H)))
                return dy.cmult(dy.logistic(dy.pick_range(g, H, 2 * H)), dy.tanh(c)), c
            left, right = children[i - n]
            hl, cl = rec(left)
            hr, cr = rec(right)
            g = dy.affine_transform([self.b_comp, self.U, dy.concatenate([hl, hr])])
            gate = [dy.pick_range(g, k * H, (k + 1) * H) for k in range(5)]  # i fl fr o u
            c = (dy.cmult(dy.logistic(gate[0]), dy.tanh(gate[4]))
                 + dy.cmult(dy.logistic(gate[1]), cl) + dy.cmult(dy.logistic(gate[2]), cr))
            return dy.cmult(dy.logistic(gate[3]), dy.tanh(c)), c

        return rec(2 * n - 2)  # the root is the last node in post-order

    def loss(self, batch):
        dy = self.dy
        losses = []
        for words, children, label in batch:
            h, _ = self.encode(words, children)
            losses.append(dy.pickneglogsoftmax(
                dy.affine_transform([self.b_out, self.W_out, h]), label))
        return dy.esum(losses)


def main() -> None:
    cfg = json.loads(sys.stdin.readline())
    try:
        import dynet_config
        dynet_config.set(mem=str(cfg.get("mem", 2048)), random_seed=1,
                         autobatch=int(cfg.get("autobatch", 1)))
        import dynet as dy
    except ImportError as e:
        reply({"error": f"cannot import DyNet in {sys.executable}: {e}"})
        return
    init = dict(np.load(cfg["init"]))
    pc = dy.ParameterCollection()
    model = (Tagger(dy, pc, init, cfg.get("lstm", "compact")) if cfg["task"] == "tagger"
             else TreeLSTM(dy, pc, init))
    trainer = dy.AdamTrainer(pc, alpha=cfg["lr"])  # beta 0.9 / 0.999, eps 1e-8 as optax
    trainer.set_clip_threshold(0.0)  # no clipping: the same update as optax.adam
    reply({"ready": True})
    batches = {}
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "batch":
            batches[msg["id"]] = msg["data"]
        elif msg["op"] == "update":
            c0, h0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
            dy.renew_cg()
            loss = model.loss(batches[msg["id"]])
            t1 = time.perf_counter()
            value = loss.value()  # DyNet's autobatcher schedules and runs the forward here
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            trainer.update()
            t4 = time.perf_counter()
            reply({"total": t4 - t0, "cpu": time.process_time() - c0,
                   "host_cpu": time.thread_time() - h0, "build": t1 - t0,
                   "forward": t2 - t1, "backward": t3 - t2, "update": t4 - t3,
                   "loss": value})
        elif msg["op"] == "quit":
            break


if __name__ == "__main__":
    main()
