"""A top-down tree generator that decides its own structure while it runs.

The data
--------
Labelled trees from a small probabilistic context-free grammar (ROOT is a virtual node whose
one child is the sentence S)::

    S  -> NP VP                                         PP -> P NP
    NP -> D N (.45) | D A N (.30) | NP PP (.25)
    VP -> V NP (.45) | V (.20) | V NP PP (.15) | VP PP (.20)

D, A, N, V and P are leaves. Below ``--max-depth`` the recursive rules are switched off, so
trees stay finite; ``log_prob`` gives each tree's exact probability under the generator, so
the held-out loss of the best possible model (the source's entropy) is known.

The model (a doubly-recurrent top-down Tree-LSTM, after Alvarez-Melis & Jaakkola, 2017)
----------------------------------------------------------------------------------------
Every node has an *ancestral* LSTM state, computed from its parent's over ``[E[label];
the parent's fraternal state when the label was chosen]``, and a *fraternal* LSTM state that
starts from its ancestral state and reads each child label as the children are produced.
Before each child, an MLP scores "emit label l as the next child" for every label, plus
STOP ("no more children"); a node whose first decision is STOP is a leaf. Adding a child is
ONE ``@dx.function`` node (``grow``): both LSTM steps, and the scores of the two decisions
that follow (the parent's next one, the child's first one). A node's decisions depend only
on its ancestors and its earlier siblings' labels, never on their subtrees, so all open
nodes of all trees can decide at once.

Training uses teacher forcing: the gold tree fixes every decision, and the loss is the sum
of their ``pickneglogsoftmax``. Generation is value-driven: many trees grow in lockstep;
each round builds the decision scores of every open node, computes them all with ONE
``dx.forward``, samples each decision from the values, and adds the chosen children (and
their states) to the graph -- branching or stopping according to what was just computed.
A depth cap, a cap on children per node and a node cap per tree force STOP, so generation
always terminates.

What to expect
--------------
It prints the data, a learning curve (training loss per tree), the held-out loss per tree
-- untrained, trained, and the generator's own entropy as the floor -- then trees sampled
from the untrained and the trained model with the fraction that the grammar accepts
(none before training, most of them after), and speeds: trees/s of lockstep generation, and
of training under autobatch "none" and "agenda" on the same minibatch.

Run ``python examples/td_treelstm.py`` (``--budget`` seconds for the whole run, ``--quick``
for a smoke-test-sized run, ``--seed`` changes data and initialisation).
"""
from __future__ import annotations

import math
import time

import jax.numpy as jnp
import numpy as np

import dynax as dx
from _training import (compare_speed, count, minibatches, new_kernels, parse_run_args,
                       positive_int, run_parser, train_loop)

# ============================================================================================
# Data: a probabilistic grammar of labelled trees, its sampler, scorer and recogniser.
# ============================================================================================

LABELS = ("S", "NP", "VP", "PP", "D", "A", "N", "V", "P")
LABEL_ID = {l: i for i, l in enumerate(LABELS)}
ROOT = len(LABELS)  # the virtual root's label id (an input only, never emitted)
STOP = len(LABELS)  # the decision "no more children" (an output only)

# label -> [(children, probability, recursive?)]
RULES = {
    "S": [(("NP", "VP"), 1.0, False)],
    "NP": [(("D", "N"), 0.45, False), (("D", "A", "N"), 0.30, False),
           (("NP", "PP"), 0.25, True)],
    "VP": [(("V", "NP"), 0.45, False), (("V",), 0.20, False), (("V", "NP", "PP"), 0.15, True),
           (("VP", "PP"), 0.20, True)],
    "PP": [(("P", "NP"), 1.0, False)],
}
PRODUCTIONS = {lab: {kids for kids, _, _ in rules} for lab, rules in RULES.items()}

# A tree is (label, [children]); the virtual root is ("ROOT", [("S", ...)]).


def _rule_probs(label: str, depth: int, max_depth: int):
    """The generator's rules for ``label`` at ``depth``: recursive ones only above the cap."""
    rules = [(kids, p) for kids, p, rec in RULES[label] if depth < max_depth or not rec]
    z = sum(p for _, p in rules)
    return [(kids, p / z) for kids, p in rules]


def sample_tree(rng: np.random.Generator, max_depth: int, label: str = "S", depth: int = 1):
    if label not in RULES:
        return label, []
    rules = _rule_probs(label, depth, max_depth)
    kids = rules[rng.choice(len(rules), p=[p for _, p in rules])][0]
    return label, [sample_tree(rng, max_depth, k, depth + 1) for k in kids]


def log_prob(tree, max_depth: int, depth: int = 1) -> float:
    """log p(tree) under the generator (``tree`` rooted at S, without the virtual root)."""
    label, children = tree
    if label not in RULES:
        return 0.0
    kids = tuple(c[0] for c in children)
    p = dict(_rule_probs(label, depth, max_depth))[kids]
    return math.log(p) + sum(log_prob(c, max_depth, depth + 1) for c in children)


def well_formed(root) -> bool:
    """Whether a generated tree (with its virtual root) is a tree of the grammar."""
    label, children = root
    if label != "ROOT" or len(children) != 1 or children[0][0] != "S":
        return False

    def ok(node):
        lab, kids = node
        seq = tuple(k[0] for k in kids)
        if lab not in RULES:
            return not kids
        return seq in PRODUCTIONS[lab] and all(ok(k) for k in kids)

    return ok(children[0])


def size(tree) -> int:
    return 1 + sum(size(c) for c in tree[1])


def depth_of(tree) -> int:
    return 1 + max((depth_of(c) for c in tree[1]), default=0)


def bracket(tree) -> str:
    """``(S (NP D N) (VP V))`` notation."""
    label, children = tree
    if label == "ROOT" and len(children) == 1:
        return bracket(children[0])
    if not children:
        return label
    return "(" + label + " " + " ".join(bracket(c) for c in children) + ")"


def make_splits(n_train: int, n_test: int, seed: int, max_depth: int):
    """Train and held-out lists of trees rooted at S; deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    data = [sample_tree(rng, max_depth) for _ in range(n_train + n_test)]
    return data[:n_train], data[n_train:]


# ============================================================================================
# Model
# ============================================================================================

def _lstm(x, h, c, W, b):
    """One LSTM step (gates i, f, o, g stacked in W and b), plain JAX."""
    i, f, o, g = jnp.split(W @ jnp.concatenate([x, h]) + b, 4)
    c2, h2 = dx.nn.lstm_state(i, g, o, (f,), (c,))
    return h2, c2


def _decide(ha, hf, Ua, Uf, b, Wo, bo):
    """Scores of a node's next decision: each label as its next child, or STOP."""
    return Wo @ jnp.tanh(Ua @ ha + Uf @ hf + b) + bo


@dx.function
def grow(e, hf, cf, ha, ca, Wa, ba, Wf, bf, Ua, Uf, b, Wo, bo):
    """Add a child with label embedding ``e`` to a node with ancestral state ``(ha, ca)`` and
    fraternal state ``(hf, cf)``. Returns the child's ancestral state (an LSTM step from
    its parent's over ``[e; hf]``), the parent's next fraternal state (an LSTM step over
    ``e``), and the scores of the two decisions this enables: the parent's next one and the
    child's first one (its fraternal state starts as its ancestral state)."""
    h, c = _lstm(jnp.concatenate([e, hf]), ha, ca, Wa, ba)
    hf2, cf2 = _lstm(e, hf, cf, Wf, bf)
    parent_next = _decide(ha, hf2, Ua, Uf, b, Wo, bo)
    child_first = _decide(h, h, Ua, Uf, b, Wo, bo)
    return h, c, hf2, cf2, parent_next, child_first


class TopDownTreeLSTM:
    """A node while its children are produced: ``(ancestral state, fraternal state, scores
    of its next decision)``, the states LSTM ``(h, c)`` pairs, all made by ``grow`` nodes."""

    def __init__(self, pc: dx.ParameterCollection, dim: int, hidden: int):
        n, H = len(LABELS), hidden
        self.hidden = H
        self.E = pc.add_lookup_parameters((n + 1, dim), init="normal", name="E")  # + ROOT
        forget_open = np.r_[np.zeros(H), np.ones(H), np.zeros(2 * H)]  # forget bias 1
        self.params = (
            pc.add_parameters((4 * H, dim + 2 * H), name="W_anc"),
            pc.add_parameters((4 * H,), init=forget_open, name="b_anc"),
            pc.add_parameters((4 * H, dim + H), name="W_frat"),
            pc.add_parameters((4 * H,), init=forget_open, name="b_frat"),
            pc.add_parameters((H, H), name="U_anc"),
            pc.add_parameters((H, H), name="U_frat"),
            pc.add_parameters((H,), init="zeros", name="b"),
            pc.add_parameters((n + 1, H), name="W_out"),
            pc.add_parameters((n + 1,), init="zeros", name="b_out"))

    def root(self):
        """The virtual root: a ``grow`` over ``E[ROOT]`` from zero states (zero constants of
        its own, so each lane reads its own rows)."""
        z = [dx.zeros((self.hidden,)) for _ in range(4)]
        h, c, _, _, _, first = grow(self.E[ROOT], *z, *self.params)
        return (h, c), (h, c), first

    def child(self, node, label: int):
        """Add a child ``label`` to ``node``: (the child, the parent's next (fraternal state,
        scores))."""
        a, f, _ = node
        h, c, hf, cf, parent_next, child_first = grow(self.E[label], *f, *a, *self.params)
        return ((h, c), (h, c), child_first), ((hf, cf), parent_next)

    # ---- teacher forcing --------------------------------------------------------------------
    def losses(self, tree):
        """``-log p`` of every decision that generates ``tree`` (rooted at S)."""
        out = []

        def expand(node, children):
            for label, grandchildren in children:
                lid = LABEL_ID[label]
                out.append(dx.pickneglogsoftmax(node[2], lid))
                kid, (f, scores) = self.child(node, lid)
                expand(kid, grandchildren)
                node = (node[0], f, scores)
            out.append(dx.pickneglogsoftmax(node[2], STOP))

        expand(self.root(), [tree])
        return out

    # ---- generation -------------------------------------------------------------------------
    def generate(self, n: int, rng: np.random.Generator, max_depth: int = 12,
                 max_children: int = 4, max_nodes: int = 60, autobatch: str = "agenda"):
        """Sample ``n`` trees, all growing in lockstep on one graph.

        Each round: ONE ``dx.forward`` over the decision scores of every open node of every
        tree, then a decision sampled from each node's values; a label adds a ``grow`` node
        (whose outputs hold the next scores of the parent and of the new child), STOP closes
        the node. STOP is forced at ``max_depth``, after ``max_children`` children and once a
        tree has ``max_nodes`` nodes; such trees are flagged as capped. Returns (trees with
        their virtual roots, capped flags).
        """
        dx.renew_cg(autobatch=autobatch)  # no dropout: train=True reuses the training kernels
        roots = [("ROOT", []) for _ in range(n)]
        counts, capped = [1] * n, [False] * n
        # an open node: [tree index, (anc, frat, scores), children list, depth]
        open_nodes = [[i, self.root(), roots[i][1], 0] for i in range(n)]
        while open_nodes:
            dx.forward([node[1][2] for node in open_nodes])
            still = []
            for entry in open_nodes:
                i, node, children, depth = entry
                logits = node[2].npvalue().astype(np.float64)
                p = np.exp(logits - logits.max())
                choice = int(rng.choice(len(p), p=p / p.sum()))
                if choice != STOP and (depth >= max_depth or len(children) >= max_children
                                       or counts[i] >= max_nodes):
                    choice, capped[i] = STOP, True  # a cap overrides the model
                if choice == STOP:
                    continue  # this node is finished
                kid = (LABELS[choice], [])
                children.append(kid)
                counts[i] += 1
                kid_node, (f, scores) = self.child(node, choice)
                entry[1] = (node[0], f, scores)
                still += [entry, [i, kid_node, kid[1], depth + 1]]
            open_nodes = still
        return roots, capped


# ============================================================================================
# Training, evaluation, speed
# ============================================================================================

def train_step(model, trainer, batch, autobatch: str = "agenda"):
    """One minibatch of trees on one graph (teacher forcing); backward and update.
    Returns (summed loss, graph stats)."""
    cg = dx.renew_cg(autobatch=autobatch)
    loss = dx.esum([l for tree in batch for l in model.losses(tree)])
    value = loss.scalar_value()
    loss.backward()
    trainer.update()
    return value, cg.stats()


def forward_values(model, batch, autobatch: str) -> np.ndarray:
    """Every decision's loss for ``batch`` under one strategy (for none-vs-agenda checks).

    The model has no dropout, so a default (``train=True``) graph computes what
    ``train=False`` would, and reuses the training step's compiled forward kernels.
    """
    dx.renew_cg(autobatch=autobatch)
    losses = [l for tree in batch for l in model.losses(tree)]
    dx.forward(losses)
    return np.array([l.scalar_value() for l in losses])


def heldout_loss(model, data, chunk: int = 32) -> float:
    """Mean negative log-likelihood per tree (nats), ``chunk`` trees per graph."""
    total = 0.0
    for start in range(0, len(data), chunk):
        dx.renew_cg()  # no dropout: train=True reuses the training kernels
        losses = [l for tree in data[start:start + chunk] for l in model.losses(tree)]
        total += dx.esum(losses).scalar_value()  # one read (each read is a device round trip)
    return total / len(data)


def sample_report(model, n: int, seed: int, chunk: int = 32, **caps):
    """Sample ``n`` trees (``chunk`` per graph); (trees, fraction well-formed, fraction
    capped). A tree that hit a cap does not count as well-formed."""
    rng = np.random.default_rng(seed)
    trees, capped = [], []
    for start in range(0, n, chunk):
        t, c = model.generate(min(chunk, n - start), rng, **caps)
        trees += t
        capped += c
    ok = float(np.mean([well_formed(t) and not c for t, c in zip(trees, capped)]))
    return trees, ok, float(np.mean(capped))


def parse_args(argv=None):
    ap = run_parser(__doc__, budget_covers="compilation, evaluation and sampling",
                    quick_is="4 small trees, 10 updates, tiny model", train_size=4000)
    ap.add_argument("--max-depth", type=positive_int, default=6,
                    help="generator: no recursive rule below this depth")
    ap.add_argument("--dim", type=positive_int, default=16, help="label embedding size")
    ap.add_argument("--hidden", type=positive_int, default=48, help="LSTM sizes")
    ap.add_argument("--batch", type=positive_int, default=16, help="trees per update")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--samples", type=positive_int, default=64, help="trees sampled before and after")
    ap.add_argument("--gen-max-nodes", type=positive_int, default=60,
                    help="generation: STOP is forced once a tree has this many nodes")
    ap.add_argument("--gen-max-depth", type=positive_int, default=12,
                    help="generation: STOP is forced at this depth")
    ap.add_argument("--speed-batches", type=count, default=1,
                    help="minibatches timed for the none-vs-agenda comparison (0: skip)")
    return parse_run_args(ap, argv, QUICK)


SPEED_RESERVE = 12.0  # seconds kept for the none-vs-agenda comparison (compiles "none" kernels)
EVAL_RESERVE = 4.0  # at most this many seconds kept for the final evaluation
SAMPLE_RESERVE = 6.0  # seconds kept for sampling from the trained model


# --quick: one minibatch of training data, seen at every update, so a tiny run has a fixed
# set of kernel shapes (compilation dominates tiny runs) and a fixed number of updates
QUICK = dict(train_size=4, test_size=4, batch=4, dim=8, hidden=16, lr=2e-2, updates=10,
             samples=4, max_depth=2, gen_max_nodes=16, gen_max_depth=5, speed_batches=0)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()

    # ---- data ---------------------------------------------------------------------------------
    train, test = make_splits(args.train_size, args.test_size, args.seed, args.max_depth)
    sizes = np.array([size(t) for t in train])
    entropy = -float(np.mean([log_prob(t, args.max_depth) for t in test]))
    print(f"Tree generation: {len(train)} train / {len(test)} held-out trees from a PCFG, "
          f"{sizes.mean():.1f} nodes on average (max {sizes.max()}, depth <= "
          f"{max(depth_of(t) for t in train)})")
    print(f"  e.g. {bracket(train[0])}")
    print(f"  the generator's own held-out loss (the floor): {entropy:.3f} nats/tree")

    # ---- model --------------------------------------------------------------------------------
    pc = dx.ParameterCollection(seed=args.seed)
    model = TopDownTreeLSTM(pc, args.dim, args.hidden)
    trainer = dx.AdamTrainer(pc, alpha=args.lr, sparse_updates=True)  # lazy Adam on tables
    print(f"Doubly-recurrent top-down Tree-LSTM: label embedding {args.dim}, LSTMs "
          f"{args.hidden}, {pc.parameter_count()} parameters; Adam lr {args.lr}, "
          f"{args.batch} trees/update")
    batches = minibatches(train, args.batch, np.random.default_rng(args.seed + 1))
    t0 = time.perf_counter()
    # the untrained model on a part of the held-out set (its compilations are mostly the
    # training step's forward kernels; the rest of the set would mostly add new batch sizes)
    before_set = test[:2 * args.batch]
    before = heldout_loss(model, before_set, args.batch)
    caps = dict(max_nodes=args.gen_max_nodes, max_depth=args.gen_max_depth)
    # few untrained samples: they grow to the caps, in many batch sizes (compilations)
    n_untrained = min(args.samples, 16)
    untrained_trees, untrained_ok, _ = sample_report(model, n_untrained, args.seed + 2,
                                                     args.batch, **caps)
    eval_seconds = time.perf_counter() - t0  # compiles included: the final one will be faster
    print(f"  untrained: loss {before:.3f} nats/tree on {len(before_set)} held-out trees; "
          f"{untrained_ok:.0%} of {n_untrained} sampled trees well-formed ({eval_seconds:.1f}s)")

    # ---- training -----------------------------------------------------------------------------
    # the final evaluation finds its kernels compiled: it takes a fraction of the first one
    reserve = (min(eval_seconds, EVAL_RESERVE) + SAMPLE_RESERVE
               + (SPEED_RESERVE if args.speed_batches else 0.0))

    def step(batch):
        loss, stats = train_step(model, trainer, batch)
        return loss, len(batch), stats["compiles"], {}

    curve, updates, trees, train_seconds = train_loop(
        args, step, batches, t_start=t_start, deadline=t_start + args.budget - reserve,
        how="teacher forcing, autobatch='agenda'", unit="tree", show_loss=lambda x: f"{x:7.3f}")

    # ---- evaluation, sampling, speed ----------------------------------------------------------
    after = heldout_loss(model, test, args.batch)
    t0 = time.perf_counter()
    samples, ok, capped = sample_report(model, args.samples, args.seed + 3, args.batch, **caps)
    sample_seconds = time.perf_counter() - t0
    gen_sizes = [size(t) - 1 for t in samples]  # without the virtual root
    speed = None
    if args.speed_batches > 0:
        print(f"Timing {args.speed_batches} minibatch(es) of training with autobatch='none' "
              "and 'agenda' (each after warm-up passes that compile its kernels)...", flush=True)

        def step(batch, strategy):  # (trees, kernels compiled or loaded)
            return len(batch), new_kernels(train_step(model, trainer, batch, strategy)[1])

        speed, _ = compare_speed(step, [next(batches) for _ in range(args.speed_batches)])

    print("Results")
    print(f"  {updates} updates: training loss/tree {curve[0][1]:.3f} (update {curve[0][0]}) -> "
          f"{curve[-1][1]:.3f} (update {curve[-1][0]}); {trees / train_seconds:.0f} trees/s "
          "in the training loop (compilation included)")
    print(f"  held-out loss {after:.3f} nats/tree (untrained {before:.3f}; the generator's "
          f"entropy {entropy:.3f})")
    print(f"  sampled trees well-formed: {ok:.0%} of {len(samples)} from the trained model vs "
          f"{untrained_ok:.0%} of {n_untrained} untrained ({capped:.0%} hit a cap; "
          f"{np.mean(gen_sizes):.1f} nodes on average vs {sizes.mean():.1f} in the data; "
          f"generated in lockstep at {len(samples) / sample_seconds:.0f} trees/s, compilation "
          "included); e.g. (* = not well-formed)")
    for t in samples[:4]:
        print(f"    {'  ' if well_formed(t) else '* '}{bracket(t)}")
    text = bracket(untrained_trees[0])
    print(f"  untrained, e.g. {text[:90] + ' ...' if len(text) > 90 else text}")
    if speed:
        print(f"  training speed, same minibatch(es), kernels warm: none {speed['none']:.0f} "
              f"trees/s, agenda {speed['agenda']:.0f} trees/s ({speed['ratio']:.1f}x faster)")
    print(f"  total {time.perf_counter() - t_start:.1f}s")
    return {"before": before, "after": after, "entropy": entropy, "well_formed": ok,
            "untrained_well_formed": untrained_ok, "capped": capped, "curve": curve,
            "updates": updates, "trees_per_s": trees / train_seconds, "speed": speed}


if __name__ == "__main__":
    main()
