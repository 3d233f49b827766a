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
Every node has an *ancestral* state, an LSTM step (``dx.nn.LSTMBuilder``, branching from
its parent's state: DyNet states are immutable, so all children extend the same parent
state) over ``[E[label]; fraternal state when it was chosen]``; and its children are
produced one by one by a *fraternal* LSTM that starts from the node's ancestral state and
reads each chosen child label. Before each child, a ``@dx.function`` node scores "emit
label l as the next child" for every label, plus STOP ("no more children"); a node whose
first decision is STOP is a leaf. A node's decisions depend only on its ancestors and its
earlier siblings' labels, so all open nodes of all trees can decide at once.

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
(near 0 before training, most of them after), and speeds: trees/s of training, and of
lockstep generation under autobatch "none" and "agenda".

Run ``python examples/td_treelstm.py`` (``--budget`` seconds for the whole run, ``--quick``
for a smoke-test-sized run, ``--seed`` changes data and initialisation).
"""
from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import dynax as dx

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

@dx.function
def decide(h_anc, h_frat, Ua, Uf, b, Wo, bo):
    """Scores of the next decision of a node: each label as its next child, or STOP."""
    return Wo @ jnp.tanh(Ua @ h_anc + Uf @ h_frat + b) + bo


class TopDownTreeLSTM:
    def __init__(self, pc: dx.ParameterCollection, dim: int, hidden: int):
        n = len(LABELS)
        self.E = pc.add_lookup_parameters((n + 1, dim), init="normal", name="E")  # + ROOT
        self.anc = dx.nn.LSTMBuilder(1, dim + hidden, hidden, pc)
        self.frat = dx.nn.LSTMBuilder(1, dim, hidden, pc)
        self.root_in = pc.add_lookup_parameters((1, dim + hidden), init="normal", name="root")
        self.Ua = pc.add_parameters((hidden, hidden), name="Ua")
        self.Uf = pc.add_parameters((hidden, hidden), name="Uf")
        self.b = pc.add_parameters((hidden,), init="zeros", name="b")
        self.Wo = pc.add_parameters((n + 1, hidden), name="Wo")
        self.bo = pc.add_parameters((n + 1,), init="zeros", name="bo")

    # ---- the two recurrences and the decision ----------------------------------------------
    def root(self):
        """(ancestral state, fraternal state) of the virtual root."""
        a = self.anc.initial_state().add_input(self.root_in[0])
        return a, self.frat.initial_state(a.s())

    def child(self, a, f, label: int):
        """States of a new child ``label`` of the node with ancestral state ``a`` whose
        fraternal state is ``f``; and that node's fraternal state after it."""
        a_child = a.add_input(dx.concatenate([self.E[label], f.output()]))
        return a_child, self.frat.initial_state(a_child.s()), f.add_input(self.E[label])

    def scores(self, a, f):
        return decide(a.output(), f.output(), self.Ua, self.Uf, self.b, self.Wo, self.bo)

    # ---- teacher forcing --------------------------------------------------------------------
    def losses(self, tree):
        """``-log p`` of every decision that generates ``tree`` (rooted at S)."""
        out = []

        def expand(a, f, children):
            for label, grandchildren in children:
                lid = LABEL_ID[label]
                out.append(dx.pickneglogsoftmax(self.scores(a, f), lid))
                a_child, f_child, f = self.child(a, f, lid)
                expand(a_child, f_child, grandchildren)
            out.append(dx.pickneglogsoftmax(self.scores(a, f), STOP))

        expand(*self.root(), [tree])
        return out

    # ---- generation -------------------------------------------------------------------------
    def generate(self, n: int, rng: np.random.Generator, max_depth: int = 12,
                 max_children: int = 4, max_nodes: int = 60, autobatch: str = "agenda"):
        """Sample ``n`` trees, all growing in lockstep on one graph.

        Each round: the decision scores of every open node of every tree, ONE ``dx.forward``,
        then a decision sampled from each node's values. STOP is forced at ``max_depth``,
        after ``max_children`` children and once a tree has ``max_nodes`` nodes; such trees
        are flagged as capped. Returns (trees with their virtual roots, capped flags).
        """
        dx.renew_cg(autobatch=autobatch)  # no dropout: train=True reuses the training kernels
        roots = [("ROOT", []) for _ in range(n)]
        counts, capped = [1] * n, [False] * n
        # an open node: [tree index, ancestral state, fraternal state, children list, depth]
        open_nodes = [[i, *self.root(), roots[i][1], 0] for i in range(n)]
        while open_nodes:
            scores = [self.scores(a, f) for _, a, f, _, _ in open_nodes]
            dx.forward(scores)
            still = []
            for node, s in zip(open_nodes, scores):
                i, a, f, children, depth = node
                logits = s.npvalue().astype(np.float64)
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
                a_kid, f_kid, node[2] = self.child(a, f, choice)
                still += [node, [i, a_kid, f_kid, kid[1], depth + 1]]
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


def sample_report(model, n: int, seed: int, chunk: int = 32, autobatch: str = "agenda"):
    """Sample ``n`` trees (``chunk`` per graph); (trees, fraction well-formed, capped)."""
    rng = np.random.default_rng(seed)
    trees, capped = [], []
    for start in range(0, n, chunk):
        t, c = model.generate(min(chunk, n - start), rng, autobatch=autobatch)
        trees += t
        capped += c
    ok = float(np.mean([well_formed(t) and not c for t, c in zip(trees, capped)]))
    return trees, ok, float(np.mean(capped))


def minibatches(data, size: int, rng: np.random.Generator):
    """Endless shuffled minibatches (a new permutation each epoch)."""
    while True:
        order = rng.permutation(len(data))
        for start in range(0, len(order) - size + 1, size):
            yield [data[i] for i in order[start:start + size]]


def compare_speed(model, n: int, seed: int, max_warmup: int = 3) -> dict:
    """Trees/s of lockstep generation of ``n`` trees under "none" and "agenda" (the same
    draws, so the same trees), each timed after warm-up passes that compile its kernels."""
    result = {}
    for strategy in ("none", "agenda"):
        for _ in range(max_warmup):
            model.generate(n, np.random.default_rng(seed), autobatch=strategy)
            if dx.current_graph().stats()["compiles"] == 0:
                break
        t0 = time.perf_counter()
        model.generate(n, np.random.default_rng(seed), autobatch=strategy)
        result[strategy] = n / (time.perf_counter() - t0)
    result["ratio"] = result["agenda"] / result["none"]
    return result


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=80.0,
                    help="seconds for the whole run, compilation, evaluation and sampling included")
    ap.add_argument("--updates", type=int, default=0,
                    help="train for exactly this many updates instead (0: use the budget)")
    ap.add_argument("--min-updates", type=int, default=40,
                    help="train at least this long even if the budget is spent (slow machine)")
    ap.add_argument("--quick", action="store_true",
                    help="8 training trees, 10 updates, no speed comparison (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-size", type=int, default=4000)
    ap.add_argument("--test-size", type=int, default=256)
    ap.add_argument("--max-depth", type=int, default=6,
                    help="generator: no recursive rule below this depth")
    ap.add_argument("--dim", type=int, default=16, help="label embedding size")
    ap.add_argument("--hidden", type=int, default=48, help="LSTM sizes")
    ap.add_argument("--batch", type=int, default=32, help="trees per update")
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--samples", type=int, default=64, help="trees sampled before and after")
    ap.add_argument("--speed-trees", type=int, default=32,
                    help="trees generated for the none-vs-agenda comparison (0: skip)")
    return ap.parse_args(argv)


SPEED_RESERVE = 12.0  # seconds kept for the none-vs-agenda comparison (compiles "none" kernels)


# --quick: one minibatch of training data, seen at every update, so a tiny run has a fixed
# set of kernel shapes (compilation dominates tiny runs) and a fixed number of updates
QUICK = dict(train_size=8, test_size=8, batch=8, dim=8, hidden=16, lr=2e-2, updates=10,
             samples=8, max_depth=4, speed_trees=0)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.quick:
        # the --quick settings, except those given explicitly on the command line
        given = {k for k, v in vars(args).items() if v != parse_args([]).__dict__[k]}
        vars(args).update({k: v for k, v in QUICK.items() if k not in given})
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
    trainer = dx.AdamTrainer(pc, alpha=args.lr)
    print(f"Doubly-recurrent top-down Tree-LSTM: label embedding {args.dim}, LSTMs "
          f"{args.hidden}, {pc.parameter_count()} parameters; Adam lr {args.lr}, "
          f"{args.batch} trees/update")
    batches = minibatches(train, args.batch, np.random.default_rng(args.seed + 1))
    t0 = time.perf_counter()
    before = heldout_loss(model, test, args.batch)
    untrained_trees, untrained_ok, _ = sample_report(model, args.samples, args.seed + 2,
                                                     args.batch)
    eval_seconds = time.perf_counter() - t0  # compiles included: the final one will be faster
    print(f"  untrained: held-out loss {before:.3f} nats/tree; {untrained_ok:.0%} of "
          f"{args.samples} sampled trees well-formed ({eval_seconds:.1f}s)")

    # ---- training -----------------------------------------------------------------------------
    t_train = time.perf_counter()
    reserve = eval_seconds + (SPEED_RESERVE if args.speed_trees else 0.0)
    deadline = t_start + args.budget - reserve
    if args.updates:
        print(f"Training for {args.updates} updates (teacher forcing, autobatch='agenda'):")
        log_every = 0.0
    else:
        log_every = max((deadline - t_train) / 10, 2.0)
        print(f"Training for {max(deadline - t_train, 0):.0f}s, at least {args.min_updates} "
              "updates (teacher forcing, autobatch='agenda'):")
    curve, window, trees, compiles, updates = [], [], 0, 0, 0
    t_log, trees_log = t_train, 0

    def more():
        if args.updates:
            return updates < args.updates
        return time.perf_counter() < deadline or updates < args.min_updates

    while more():
        batch = next(batches)
        loss, stats = train_step(model, trainer, batch)
        window.append(loss / len(batch))
        trees += len(batch)
        compiles += stats["compiles"]
        updates += 1
        now = time.perf_counter()
        if args.updates and (updates % max(args.updates // 4, 1) == 0 or not more()) \
                or not args.updates and (now - t_log >= log_every or not more()):
            curve.append((updates, float(np.mean(window))))
            print(f"  update {updates:5d}  loss/tree {curve[-1][1]:7.3f}  "
                  f"{(trees - trees_log) / (now - t_log):6.0f} trees/s  {compiles:3d} compiles  "
                  f"[{now - t_start:5.1f}s]", flush=True)
            window, t_log, trees_log, compiles = [], now, trees, 0
    train_seconds = time.perf_counter() - t_train

    # ---- evaluation, sampling, speed ----------------------------------------------------------
    after = heldout_loss(model, test, args.batch)
    t0 = time.perf_counter()
    samples, ok, capped = sample_report(model, args.samples, args.seed + 3, args.batch)
    sample_seconds = time.perf_counter() - t0
    gen_sizes = [size(t) - 1 for t in samples]  # without the virtual root
    speed = None
    if args.speed_trees > 0:
        print(f"Timing lockstep generation of {args.speed_trees} trees with autobatch='none' "
              "and 'agenda' (each after warm-up)...", flush=True)
        speed = compare_speed(model, args.speed_trees, args.seed + 4)

    print("Results")
    print(f"  {updates} updates: training loss/tree {curve[0][1]:.3f} (update {curve[0][0]}) -> "
          f"{curve[-1][1]:.3f} (update {curve[-1][0]}); {trees / train_seconds:.0f} trees/s "
          "in the training loop (compilation included)")
    print(f"  held-out loss {after:.3f} nats/tree (untrained {before:.3f}; the generator's "
          f"entropy {entropy:.3f})")
    print(f"  sampled trees well-formed: {ok:.0%} trained vs {untrained_ok:.0%} untrained "
          f"({len(samples)} each; {capped:.0%} hit a cap; {np.mean(gen_sizes):.1f} nodes on "
          f"average vs {sizes.mean():.1f} in the data; {len(samples) / sample_seconds:.0f} "
          "trees/s)")
    for t in samples[:4]:
        print(f"    {'  ' if well_formed(t) else '* '}{bracket(t)}")
    print(f"  untrained, e.g. {bracket(untrained_trees[0])[:100]}")
    if speed:
        print(f"  lockstep generation, kernels warm: none {speed['none']:.1f} trees/s, "
              f"agenda {speed['agenda']:.1f} trees/s ({speed['ratio']:.1f}x faster)")
    print(f"  total {time.perf_counter() - t_start:.1f}s")
    return {"before": before, "after": after, "entropy": entropy, "well_formed": ok,
            "untrained_well_formed": untrained_ok, "capped": capped, "curve": curve,
            "updates": updates, "trees_per_s": trees / train_seconds, "speed": speed}


if __name__ == "__main__":
    main()
