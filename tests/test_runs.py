"""Fused runs: consecutive batches of one kernel (an RNN over a single sentence: one 1-lane
step per word) run as one launch of a loop with room for a number of steps (a narrow run's:
the next power of two, at least 4; a wide one's: fixed per size), the steps it lacks
padding that never runs. Values and gradients must equal the node-by-node reference and
``jax.grad`` of the same math, for runs filling their kernel or not, with and without
residuals, and for a loss in the middle of a run."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx
from dynax.executor import engine as engine_module
from dynax.graph.computation_graph import _compile_count
from dynax.ops.registry import live_signatures
from reference import clear_kernels

TOL = dict(rtol=1e-5, atol=1e-5)
IN, HID = 3, 4
PC = dx.ParameterCollection(seed=0)
LSTM = dx.nn.LSTMBuilder(1, IN, HID, PC)


def ref_states(vals, xs):
    """Plain-JAX LSTM (the builder's gate order i, f, o, g); hidden state after each input."""
    Wx, Wh, b = vals
    c = h = jnp.zeros(HID)
    hs = []
    for x in xs:
        i, f, o, g = jnp.split(Wx @ x + Wh @ h + b, 4)
        c = jax.nn.sigmoid(i) * jnp.tanh(g) + jax.nn.sigmoid(f) * c
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        hs.append(h)
    return hs


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return ([rng.standard_normal(IN).astype(np.float32) for _ in range(n)],
            [rng.standard_normal(HID).astype(np.float32) for _ in range(n)])


def _run(strategy, xs, ws, upto=None, train=True):
    """Loss sum_t <h_t, w_t> over the first ``upto`` steps of an LSTM over ``xs``; all steps
    are computed first, so a loss in the middle leaves later steps in the same run."""
    for p in PC.parameters():
        p.zero_grad()
    cg = dx.renew_cg(autobatch=strategy, train=train)
    hs = LSTM.initial_state().transduce([dx.input(x) for x in xs])
    dx.forward(hs)  # the steps alone first: consecutive batches under every strategy
    upto = len(xs) if upto is None else upto
    loss = dx.esum([dx.dot_product(h, dx.input(w)) for h, w in zip(hs[:upto], ws)])
    value = loss.scalar_value()
    loss.backward()
    return value, [h.npvalue() for h in hs], [np.asarray(p.grad) for p in PC.parameters()], \
        cg.stats()


def _check(value, grads, ref_value, ref_grads, loss_fn):
    """``value`` and ``grads`` equal the node-by-node reference's and those of ``loss_fn``
    (the same math in plain JAX, over the LSTM's parameter values) and ``jax.grad``."""
    vals = [p.value for p in PC.parameters()]
    np.testing.assert_allclose(value, ref_value, **TOL)
    np.testing.assert_allclose(value, loss_fn(vals), **TOL)
    for g, r, j in zip(grads, ref_grads, jax.grad(loss_fn)(vals)):
        np.testing.assert_allclose(g, r, **TOL)
        np.testing.assert_allclose(g, j, **TOL)


# the first step differs (no gradient flows into its zero state): runs of n-1 steps, in
# kernels of 4 (2 of them padding), 4 (full), 8 (1 padding), 16 (4)
@pytest.mark.parametrize("n", [3, 5, 8, 13])
@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_a_run_equals_node_by_node_and_jax_grad(strategy, n):
    xs, ws = _data(n)
    value, hs, grads, stats = _run(strategy, xs, ws)
    ref_value, ref_hs, ref_grads, ref_stats = _run("none", xs, ws)
    assert ref_stats["launches"] == ref_stats["batches"] == ref_stats["nodes"]  # never fused
    assert stats["launches"] < stats["batches"], stats  # the steps ran as runs
    vals = [p.value for p in PC.parameters()]

    def loss_fn(vals):
        return sum(jnp.dot(h, w) for h, w in zip(ref_states(vals, xs), ws))

    _check(value, grads, ref_value, ref_grads, loss_fn)
    for h, r, j in zip(hs, ref_hs, ref_states(vals, xs)):
        np.testing.assert_allclose(h, r, **TOL)
        np.testing.assert_allclose(h, j, **TOL)


def _forward_steps(xs):
    """The LSTM's steps over ``xs`` alone, computed; the graph's stats."""
    cg = dx.renew_cg(autobatch="agenda")
    dx.forward(LSTM.initial_state().transduce([dx.input(x) for x in xs]))
    return cg.stats()


def _run_kernels():
    """The LSTM's run kernels: ``{key: kernel}``."""
    mine = set(PC.parameters())
    return {key: k for sig in live_signatures() if mine & set(sig.params)
            for key, k in sig.kernels.items() if key[0] == "fwd_run"}


def test_runs_up_to_a_kernels_capacity_share_it():
    """Runs of 2, 3 and 4 steps launch one kernel of 4 steps, compiled once (the number of
    steps is data). The first step, which reads the zero initial state (no gradient flows
    into it), joins the run with the later steps' gradient flags
    (``engine._joined_flags``), where it used to compile and launch a single kernel of its
    own. (Values and gradients: test_a_run_equals_node_by_node_and_jax_grad and
    test_a_lone_step_of_a_sequence_runs_in_its_run_kernel.)"""
    clear_kernels()
    xs, _ = _data(5, seed=5)
    for n in (2, 3, 4):
        stats = _forward_steps(xs[:n])
        assert (stats["launches"], stats["batches"]) == (1, n), stats
        (key, kern), = _run_kernels().items()
        assert key[-1] == 4 and kern.fn._cache_size() == 1, (key, kern.fn._cache_size())
    assert _single_kernels() == {}, _single_kernels().keys()


def _single_kernels():
    """The LSTM's forward kernels of one batch: ``{key: kernel}``."""
    mine = set(PC.parameters())
    return {key: k for sig in live_signatures() if mine & set(sig.params)
            for key, k in sig.kernels.items() if key[0] == "fwd" and k.fn._cache_size()}


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_a_lone_step_of_a_sequence_runs_in_its_run_kernel(strategy):
    """Two sentences of 3 and 2 words: the first two steps (2 lanes) run as one run, the
    first joining it although no gradient flows into the zero state it reads; then the
    longer sentence's 1-lane step runs alone, and as it continues its sequence in this
    forward pass it launches its size's run kernel instead of a single kernel of its own.
    No single kernel is compiled. Values and gradients equal the node-by-node reference
    and jax.grad."""
    clear_kernels()
    data = [_data(n, seed=60 + n) for n in (3, 2)]

    def run(strategy):
        for p in PC.parameters():
            p.zero_grad()
        cg = dx.renew_cg(autobatch=strategy)
        hss = [LSTM.initial_state().transduce([dx.input(x) for x in xs]) for xs, _ in data]
        dx.forward([h for hs in hss for h in hs])
        loss = dx.esum([dx.dot_product(h, dx.input(w))
                        for hs, (_, ws) in zip(hss, data) for h, w in zip(hs, ws)])
        value = loss.scalar_value()
        loss.backward()
        return value, [np.asarray(p.grad) for p in PC.parameters()], cg

    value, grads, cg = run(strategy)
    lanes = sorted(int(b.packet[0, 0]) for b in cg.batches
                   if b.sig.op.sequence_step and b.packet.ndim == 2)
    assert lanes == [1, 2], lanes  # the 2-lane steps and the lone third step ran as runs
    assert _single_kernels() == {}, _single_kernels().keys()
    ref_value, ref_grads, _ = run("none")

    def loss_fn(vals):
        return sum(jnp.dot(h, w) for xs, ws in data for h, w in zip(ref_states(vals, xs), ws))

    _check(value, grads, ref_value, ref_grads, loss_fn)
    clear_kernels()


def test_a_lone_step_running_its_distinct_lanes_only_keeps_its_single_kernel(monkeypatch):
    """Two identical sentences: each step's second lane repeats its first, and a step run
    on its distinct lanes only (repeats.py) is launched alone with a packet of its own
    layout, which a run kernel cannot read; values and gradients equal jax.grad."""
    monkeypatch.setattr(engine_module, "REPEATS_MIN_WORK", 1)
    clear_kernels()
    dx.release_memory()  # no plan reused (a replayed one looks for no repeats)
    for sig in live_signatures():
        sig.repeats = None  # looked for in the next batch (earlier tests' found none)
    xs, ws = _data(3, seed=90)
    for p in PC.parameters():
        p.zero_grad()
    cg = dx.renew_cg(autobatch="agenda")
    inputs = [dx.input(x) for x in xs]  # both read the same values: their lanes repeat
    hss = [LSTM.initial_state().transduce(inputs) for _ in range(2)]
    dx.forward([h for hs in hss for h in hs])
    assert cg.stats()["repeated_lanes"] > 0 and _run_kernels() == {}
    loss = dx.esum([dx.dot_product(h, dx.input(w)) for hs in hss for h, w in zip(hs, ws)])
    value = loss.scalar_value()
    loss.backward()
    vals = [p.value for p in PC.parameters()]

    def loss_fn(vals):
        return 2 * sum(jnp.dot(h, w) for h, w in zip(ref_states(vals, xs), ws))

    np.testing.assert_allclose(value, loss_fn(vals), **TOL)
    for p, j in zip(PC.parameters(), jax.grad(loss_fn)(vals)):
        np.testing.assert_allclose(p.grad, j, **TOL)


def test_a_sequence_stepped_one_forward_pass_at_a_time_launches_single_kernels():
    """A decoder's steps, one ``dx.forward`` each, read states of earlier passes: they
    launch the single kernel (a run kernel's launch would hold a residual buffer set with
    room for a whole run per step) and equal jax.grad."""
    clear_kernels()
    from dynax.graph.computation_graph import _engine
    dx.release_memory()
    xs, ws = _data(5, seed=70)
    for p in PC.parameters():
        p.zero_grad()
    cg = dx.renew_cg(autobatch="agenda")
    state, hs = LSTM.initial_state(), []
    for x in xs:
        state = state.add_input(dx.input(x))
        hs.append(state.output())
        dx.forward([hs[-1]])
    loss = dx.esum([dx.dot_product(h, dx.input(w)) for h, w in zip(hs, ws)])
    value = loss.scalar_value()
    loss.backward()
    assert _run_kernels() == {} and not any(b.packet.ndim == 2 for b in cg.batches)
    assert _engine().residuals.free == {}
    vals = [p.value for p in PC.parameters()]

    def loss_fn(vals):
        return sum(jnp.dot(h, w) for h, w in zip(ref_states(vals, xs), ws))

    np.testing.assert_allclose(value, loss_fn(vals), **TOL)
    for p, j in zip(PC.parameters(), jax.grad(loss_fn)(vals)):
        np.testing.assert_allclose(p.grad, j, **TOL)


def test_a_step_of_a_user_function_keeps_its_single_kernel_when_alone():
    """Only dx.nn's RNN cells are marked as sequence steps: a lone step of a user's
    recurrent @dx.function (a tree's composition, say) launches its single kernel."""
    @dx.function
    def cell(h, z, W):
        return jnp.tanh(W @ h + z)

    pc = dx.ParameterCollection(seed=1)
    W = pc.add_parameters((HID, HID))
    dx.renew_cg(autobatch="agenda")
    x = np.ones(HID, np.float32)
    h1 = cell(dx.input(x), dx.input(x), W)
    h2 = cell(h1, dx.square(h1), W)  # a batch of squares between the two steps
    dx.forward([h2])
    assert cell.op.sequence_step is False
    w = np.asarray(W.value)
    r1 = np.tanh(w @ x + x)
    np.testing.assert_allclose(h2.npvalue(), np.tanh(w @ r1 + r1 ** 2), **TOL)
    kinds = {key[0] for sig in live_signatures() if W in sig.params for key in sig.kernels}
    assert kinds == {"fwd"}, kinds


def test_a_runs_residuals_are_stacked_one_buffer_each():
    """A run stacks each of its step's residuals in a buffer of its own, (T, ...), where a
    single batch packs its small residuals into one flat buffer (kernels._pack): XLA then
    writes each residual in place instead of concatenating them first."""
    xs, _ = _data(6, seed=6)
    cg = dx.renew_cg(autobatch="agenda")
    dx.forward(LSTM.initial_state().transduce([dx.input(x) for x in xs]))
    runs = [b for b in cg.batches if b.packet.ndim == 2]
    assert runs
    for run in runs:
        kept = [j for kind, j in run.forward.meta["spec"] if kind == "r"]
        assert len(run.saved) == len(kept) > 1
        assert all(r.shape[0] == run.packet.shape[0] for r in run.saved)


def test_a_loss_in_the_middle_of_a_run():
    """Steps after the loss ran in the same launch; their zero cotangents change nothing."""
    xs, ws = _data(8, seed=1)
    value, _, grads, stats = _run("agenda", xs, ws, upto=5)
    assert stats["launches"] < stats["batches"]
    vals = [p.value for p in PC.parameters()]

    def loss_fn(vals):
        return sum(jnp.dot(h, w) for h, w in zip(ref_states(vals, xs)[:5], ws))

    np.testing.assert_allclose(value, loss_fn(vals), **TOL)
    for g, j in zip(grads, jax.grad(loss_fn)(vals)):
        np.testing.assert_allclose(g, j, **TOL)


def test_switching_fusion_off_changes_launches_only(monkeypatch):
    xs, ws = _data(7, seed=2)
    fused = _run("agenda", xs, ws)
    monkeypatch.setattr(engine_module, "FUSE_RUNS", False)
    single = _run("agenda", xs, ws)
    assert single[3]["launches"] == single[3]["batches"] == fused[3]["batches"]
    assert fused[3]["launches"] < fused[3]["batches"]
    np.testing.assert_allclose(fused[0], single[0], **TOL)
    for a, b in zip(fused[1] + fused[2], single[1] + single[2]):
        np.testing.assert_allclose(a, b, **TOL)


def test_evaluation_reuses_trained_runs_and_backward_recomputes():
    """A train=False graph saves no residuals: it reuses the training run kernels (compiling
    nothing) and its backward recomputes the forward pass inside the reversed scan."""
    xs, ws = _data(7, seed=3)
    trained = _run("agenda", xs, ws)
    before = _compile_count()
    dx.renew_cg(autobatch="agenda", train=False)
    hs = LSTM.initial_state().transduce([dx.input(x) for x in xs])
    dx.forward(hs)
    assert _compile_count() == before
    for h, r in zip(hs, trained[1]):
        np.testing.assert_allclose(h.npvalue(), r, **TOL)
    evaluated = _run("agenda", xs, ws, train=False)
    np.testing.assert_allclose(evaluated[0], trained[0], **TOL)
    for a, b in zip(evaluated[2], trained[2]):
        np.testing.assert_allclose(a, b, **TOL)


def test_steps_above_the_size_limit_launch_one_by_one(monkeypatch):
    """Large steps are compute-bound, where a scan costs more than the launches it saves."""
    xs, ws = _data(8, seed=4)
    fused = _run("agenda", xs, ws)
    lanes_times_params = sum(int(np.prod(p.shape)) for p in PC.parameters())  # a lone step: 1 lane
    monkeypatch.setattr(engine_module, "FUSE_MAX_MACS", lanes_times_params - 1)
    single = _run("agenda", xs, ws)
    assert fused[3]["launches"] < fused[3]["batches"] == single[3]["launches"]
    np.testing.assert_allclose(single[0], fused[0], **TOL)


def _multi(strategy, seqs, ws):
    """Loss sum over sequences and steps of <h_t, w_t>: the sequences' steps batch together
    (lanes = sequences still running), so runs are a few lanes wide, some of them padding."""
    for p in PC.parameters():
        p.zero_grad()
    dx.renew_cg(autobatch=strategy)
    states = [LSTM.initial_state().transduce([dx.input(x) for x in xs]) for xs in seqs]
    dx.forward([h for hs in states for h in hs])  # the steps first: consecutive batches
    loss = dx.esum([dx.dot_product(h, dx.input(w_t))
                    for hs, w in zip(states, ws) for h, w_t in zip(hs, w)])
    value = loss.scalar_value()
    loss.backward()
    return value, [np.asarray(p.grad) for p in PC.parameters()]


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_narrow_runs_take_weight_gradients_after_the_loop(strategy, monkeypatch):
    """Runs of at most DEFER_MAX_LANES lanes compute their weight gradients in one product
    after the reversed loop (kernels.backward_run_kernel), over their padding steps too
    (masked to nothing): equal to jax.grad, to the node-by-node reference, and to the
    per-step accumulation it replaces."""
    from dynax.executor import kernels
    lengths = (6, 3, 9)  # 3 lanes (bucket 4: one padded), then 2, then 1
    data = [_data(n, seed=10 + n) for n in lengths]
    seqs, ws = [d[0] for d in data], [d[1] for d in data]
    deferred = []
    real = kernels._run_param_grads
    monkeypatch.setattr(kernels, "_run_param_grads",
                        lambda sig, modes, B, T: deferred.append(B) or real(sig, modes, B, T))
    clear_kernels()  # earlier tests compiled these runs already
    value, grads = _multi(strategy, seqs, ws)
    assert deferred and max(deferred) > 1, deferred  # padded multi-lane runs were deferred
    ref_value, ref_grads = _multi("none", seqs, ws)
    monkeypatch.setattr(kernels, "DEFER_MAX_LANES", 0)
    clear_kernels()
    step_value, step_grads = _multi(strategy, seqs, ws)
    vals = [p.value for p in PC.parameters()]

    def loss_fn(vals):
        return sum(jnp.dot(h, w_t) for xs, w in zip(seqs, ws)
                   for h, w_t in zip(ref_states(vals, xs), w))

    for v in (value, step_value, ref_value):
        np.testing.assert_allclose(v, loss_fn(vals), **TOL)
    for g, r, s, j in zip(grads, ref_grads, step_grads, jax.grad(loss_fn)(vals)):
        np.testing.assert_allclose(g, j, **TOL)
        np.testing.assert_allclose(g, r, **TOL)
        np.testing.assert_allclose(g, s, **TOL)
    clear_kernels()  # later tests get the usual (deferring) kernels


def _wide(monkeypatch, lane_steps, value_elements=1 << 20):
    """Every run wide (its weight gradients inside the loop), with room for
    ``lane_steps`` lanes x steps, and ``value_elements`` of their values; the LSTM's
    kernels compiled anew."""
    from dynax.executor import kernels
    monkeypatch.setattr(kernels, "DEFER_MAX_LANES", 0)
    monkeypatch.setattr(engine_module, "RUN_LANE_STEPS", lane_steps)
    monkeypatch.setattr(engine_module, "RUN_VALUE_ELEMENTS", value_elements)
    clear_kernels()


def _pool():
    from dynax.graph.computation_graph import _engine
    return _engine().residuals


# a lane of the LSTM's step reads x, c and h and writes c and h
LANE_VALUES = IN + 4 * HID


@pytest.mark.parametrize("limit", ["lanes", "values"])
@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_wide_runs_share_one_kernel_per_size_and_longer_runs_launch_it_again(
        strategy, limit, monkeypatch):
    """A wide run kernel has room for RUN_LANE_STEPS / B steps, or fewer where their values
    would pass RUN_VALUE_ELEMENTS (here 4 either way), whatever the run's length: runs of
    4 to 13 steps (the first step, reading the zero state, among them) share it, a longer
    run launching it again for its next steps. Values and gradients equal the node-by-node
    reference and jax.grad."""
    if limit == "lanes":
        _wide(monkeypatch, 4)
    else:
        _wide(monkeypatch, 512, value_elements=4 * LANE_VALUES)
    for n in (4, 6, 9, 13):
        xs, ws = _data(n, seed=30 + n)
        value, hs, grads, _ = _run(strategy, xs, ws)
        ref_value, ref_hs, ref_grads, _ = _run("none", xs, ws)
        steps = _forward_steps(xs)  # the run's launches, 4 steps each at most
        assert steps["launches"] == -(-n // 4), (n, steps)
        assert {key[-1] for key in _run_kernels()} == {4}, _run_kernels().keys()

        def loss_fn(vals):
            return sum(jnp.dot(h, w) for h, w in zip(ref_states(vals, xs), ws))

        _check(value, grads, ref_value, ref_grads, loss_fn)
        for h, r in zip(hs, ref_hs):
            np.testing.assert_allclose(h, r, **TOL)
    clear_kernels()


def test_run_residual_buffers_come_back_for_the_next_graph(monkeypatch):
    """A run's residual buffers go back to the pool when its graph is replaced, and the
    next graph's runs take them instead of making new ones; a shorter run after a longer
    one leaves the longer one's rows behind its steps, which nothing reads: its gradients
    still equal jax.grad's. dx.release_memory() lets the buffers go."""
    from dynax.executor import scratch
    _wide(monkeypatch, 16)  # one kernel of 16 steps
    made = []
    real_new = scratch._new
    monkeypatch.setattr(scratch, "_new", lambda shapes: made.append(1) or real_new(shapes))
    for n, fresh in ((14, 1), (14, 0), (6, 0), (9, 0)):
        xs, ws = _data(n, seed=40 + n)
        made.clear()
        value, _, grads, _ = _run("agenda", xs, ws)
        assert len(made) == fresh, (n, made)
        vals = [p.value for p in PC.parameters()]

        def loss_fn(vals):
            return sum(jnp.dot(h, w) for h, w in zip(ref_states(vals, xs), ws))

        np.testing.assert_allclose(value, loss_fn(vals), **TOL)
        for g, j in zip(grads, jax.grad(loss_fn)(vals)):
            np.testing.assert_allclose(g, j, **TOL)
    dx.renew_cg()
    (_, free), = [(fn, free) for fn, free in _pool().free.items()
                          if fn in {k.fn for k in _run_kernels().values()}]
    assert len(free) == 1 and all(b.shape[0] == 16 for b in free[0])
    dx.release_memory()
    assert _pool().free == {}
    clear_kernels()


def test_a_run_kernels_buffer_shapes_are_traced_once(monkeypatch):
    """Two runs of one kernel in one graph hold a buffer set each; the second set is made
    from the shapes traced for the first (tracing a step cost ~0.2 s on a slow machine)."""
    from dynax.executor import scratch
    _wide(monkeypatch, 16)
    dx.release_memory()
    traced, made = [], []
    real_trace, real_new = scratch.run_residuals, scratch._new
    monkeypatch.setattr(scratch, "run_residuals",
                        lambda *a: traced.append(1) or real_trace(*a))
    monkeypatch.setattr(scratch, "_new", lambda shapes: made.append(1) or real_new(shapes))
    xs, _ = _data(6, seed=80)
    cg = dx.renew_cg(autobatch="agenda")
    for _ in range(2):  # two forward passes: two launches, each keeping its set
        dx.forward(LSTM.initial_state().transduce([dx.input(x) for x in xs]))
    runs = [b for b in cg.batches if b.packet.ndim == 2]
    assert len(runs) == 2 and runs[0].saved[0] is not runs[1].saved[0]
    assert (len(made), len(traced)) == (2, 1), (made, traced)
    dx.release_memory()
    clear_kernels()


def test_evaluation_runs_give_their_buffers_back_at_once(monkeypatch):
    """A train=False run keeps no residuals: its buffers go back to the pool as soon as it
    is launched, so an evaluation loop's forward passes all use one set."""
    from dynax.executor import scratch
    _wide(monkeypatch, 16)
    xs, ws = _data(9, seed=50)
    _run("agenda", xs, ws)  # compiles the training kernels, which evaluation reuses
    made = []
    real_new = scratch._new
    monkeypatch.setattr(scratch, "_new", lambda shapes: made.append(1) or real_new(shapes))
    cg = dx.renew_cg(autobatch="agenda", train=False)
    for _ in range(3):  # three graphs' worth of runs in one graph
        dx.forward(LSTM.initial_state().transduce([dx.input(x) for x in xs]))
    assert made == [] and not any(b.saved for b in cg.batches)
    clear_kernels()


def _backward_run_kernels(monkeypatch, seed: int):
    """For every run wide (``DEFER_MAX_LANES`` 0), then all narrow (8): ``(lanes, kernels)``,
    ``kernels`` mapping each kernel ``_jit`` made in an agenda pass over three LSTM
    sequences to its ``(accumulates, one_thread)``; the pass's value and gradients are
    checked against jax.grad and the node-by-node reference first."""
    from dynax.executor import kernels
    jitted = {}
    real = kernels._jit

    def recording(fn, name, donate, work, accumulates=False, one_thread=False):
        jitted[name] = (accumulates, one_thread)
        return real(fn, name, donate, work, accumulates, one_thread)
    monkeypatch.setattr(kernels, "_jit", recording)
    data = [_data(n, seed=seed + n) for n in (6, 3, 9)]
    seqs, ws = [d[0] for d in data], [d[1] for d in data]

    def loss_fn(vals):
        return sum(jnp.dot(h, w_t) for xs, w in zip(seqs, ws)
                   for h, w_t in zip(ref_states(vals, xs), w))

    for lanes in (0, 8):
        monkeypatch.setattr(kernels, "DEFER_MAX_LANES", lanes)
        clear_kernels()
        jitted.clear()
        value, grads = _multi("agenda", seqs, ws)
        ref_value, ref_grads = _multi("none", seqs, ws)
        _check(value, grads, ref_value, ref_grads, loss_fn)
        yield lanes, dict(jitted)
    clear_kernels()


def _is_backward_run(name: str) -> bool:
    return name.startswith("_lstm_cell_bwd_") and "_T" in name


def test_a_runs_weight_gradients_accumulate_in_their_matmuls(monkeypatch):
    """A run's backward adds each step's weight gradient to its buffer; on CPU its kernel
    compiles under ``kernels.accumulating_dots()`` (the product accumulates into the buffer,
    no second kernel adds it), a narrow run (its product after the loop) without it; the
    gradients still equal jax.grad and the node-by-node reference. (Steps larger than
    ``SMALL_STEP_MAX_WORK``: set to 0 here, as this test's LSTM is small.)"""
    from dynax.executor import kernels
    monkeypatch.setattr(kernels, "SMALL_STEP_MAX_WORK", 0)
    for lanes, jitted in _backward_run_kernels(monkeypatch, seed=20):
        accumulates = lanes == 0  # every run wide, or all narrow
        runs = [name for name in jitted if _is_backward_run(name)]
        assert runs and all(jitted[n][0] is accumulates for n in runs), jitted
        assert not any(jitted[n][0] for n in jitted if n not in runs), jitted  # esum: no weights


def test_small_steps_backward_runs_take_one_thread_products(monkeypatch):
    """A run's backward over steps of at most ``SMALL_STEP_MAX_WORK`` compiles under
    ``kernels.one_thread_dots()`` and does not accumulate (its products leave YNNPACK);
    forward runs and other kernels keep the defaults; the gradients still equal jax.grad
    and the node-by-node reference, wide runs and narrow ones alike."""
    for _, jitted in _backward_run_kernels(monkeypatch, seed=30):
        bwd_runs = [n for n in jitted if _is_backward_run(n)]
        assert bwd_runs and all(jitted[n] == (False, True) for n in bwd_runs), jitted
        assert not any(jitted[n][1] for n in jitted if n not in bwd_runs), jitted


def test_one_thread_dots_compile_products_outside_ynnpack():
    """Under ``one_thread_dots()`` XLA:CPU compiles a product as its own ``dot``, where by
    default it is a YNNPACK fusion; the result is the same. An empty dict (a jaxlib without
    the options) is allowed, and then nothing is asserted of it."""
    from dynax.executor import kernels
    options = kernels.one_thread_dots()
    if jax.devices()[0].platform != "cpu" or not options:
        pytest.skip("the options are XLA:CPU's, and this jaxlib lacks them")

    def step(x, w):
        return jnp.tanh(x @ w.T)

    args = (jnp.ones((64, 128)) * 0.01, jnp.ones((512, 128)))

    def ynn_fusions(opts):
        hlo = jax.jit(step, compiler_options=opts).lower(*args).compile().as_text()
        return sum("ynn_fusion" in line and "fusion(" in line for line in hlo.splitlines())

    if ynn_fusions(None) == 0:
        pytest.skip("this jaxlib does not compile the product to YNNPACK by default")
    assert ynn_fusions(options) == 0
    np.testing.assert_allclose(jax.jit(step, compiler_options=options)(*args), step(*args),
                               rtol=1e-5)


def test_accumulating_dots_fuse_the_add_into_the_matmul():
    """Under ``accumulating_dots()`` XLA:CPU compiles ``g + dy^T x`` to one library call
    reading ``g`` (no separate add); the default compiles a product and an add. An empty
    dict (a jaxlib without the option) is allowed, and then nothing is asserted of it."""
    from dynax.executor import kernels
    options = kernels.accumulating_dots()
    if jax.devices()[0].platform != "cpu" or not options:
        pytest.skip("the option is XLA:CPU's, and this jaxlib lacks it")

    def step(g, x, dy):
        return g + jax.lax.optimization_barrier(dy.T) @ x

    args = (jnp.zeros((512, 256)), jnp.ones((64, 256)), jnp.ones((64, 512)))

    def adds(opts):
        hlo = jax.jit(step, compiler_options=opts).lower(*args).compile().as_text()
        entry = hlo[hlo.index("ENTRY"):]
        return sum(" add(" in line or "wrapped_add" in line for line in entry.splitlines())

    assert adds(None) == 1
    assert adds(options) == 0
    np.testing.assert_allclose(jax.jit(step, compiler_options=options)(*args),
                               step(*args), rtol=1e-5)


def test_a_dropped_models_run_kernels_serve_the_next_model_until_cleared():
    """Kernels belong to families shared by models of equal sizes and outlive the model that
    compiled them: a new LSTM of the same sizes runs the dropped one's 8-step run kernel
    without building anything, and ``clear_kernels`` (which the tests above rely on) forgets
    it although no live signature names it; a stale one made this file's kernel-size tests
    depend on what ran before them in the worker (session 71)."""
    import gc
    from dynax.nn import rnn

    def run_model(seed):
        pc = dx.ParameterCollection(seed=seed)
        lstm = dx.nn.LSTMBuilder(1, IN, HID, pc)
        xs, ws = _data(7, seed=seed)
        dx.renew_cg(autobatch="agenda")
        hs = lstm.initial_state().transduce([dx.input(x) for x in xs])
        dx.forward(hs)
        loss = dx.esum([dx.dot_product(h, dx.input(w)) for h, w in zip(hs, ws)])
        loss.value()
        loss.backward()

    def run_steps():
        return {key[-1] for fam in rnn._lstm_cell.op.kernel_families.values()
                for key in fam.kernels if key[0] == "fwd_run"}

    clear_kernels()
    run_model(1)
    dx.renew_cg()
    dx.release_memory()  # no plan keeps the dropped model's signatures
    gc.collect()
    assert 8 in run_steps()
    before = _compile_count()
    run_model(2)
    assert _compile_count() == before  # the dropped model's kernels ran the new one
    dx.renew_cg()
    dx.release_memory()
    gc.collect()
    clear_kernels()
    assert run_steps() == set()
