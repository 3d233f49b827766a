"""Bounded compilation: after one pass over data of varying size and structure, a training
loop (forward, backward, Adam update with sparse lookup rows) compiles nothing more."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx
from dynax.graph.computation_graph import _compile_count


def built(cg):
    """Executables a graph caused: compiled, or loaded from the persistent cache that the
    test session shares (``conftest.py``)."""
    st = cg.stats()
    return st["compiles"] + st["cache_loads"]

V, D, H = 50, 8, 6


@dx.function
def leaf(x, W, b):
    return jnp.tanh(W @ x + b)


@dx.function
def compose(l, r, U, b):
    return jnp.tanh(U @ jnp.concatenate([l, r]) + b)


def random_tree(rng, n):
    if n == 1:
        return int(rng.integers(V))
    k = int(rng.integers(1, n))
    return (random_tree(rng, k), random_tree(rng, n - k))


@pytest.mark.parametrize("strategy", ["agenda", "depth"])
def test_second_epoch_compiles_nothing(strategy):
    pc = dx.ParameterCollection(seed=0)
    E = pc.add_lookup_parameters((V, D))
    W, b = pc.add_parameters((H, D)), pc.add_parameters((H,))
    U, bu = pc.add_parameters((H, 2 * H)), pc.add_parameters((H,))
    Wo = pc.add_parameters((3, H))
    trainer = dx.AdamTrainer(pc, alpha=0.01)
    rng = np.random.default_rng(0)
    # minibatches of 3..12 trees of 1..15 leaves: many different batch sizes and depths
    data = [[(random_tree(rng, int(rng.integers(1, 16))), int(rng.integers(3)))
             for _ in range(int(rng.integers(3, 13)))] for _ in range(6)]

    def encode(t):
        if isinstance(t, int):
            return leaf(E[t], W, b)
        return compose(encode(t[0]), encode(t[1]), U, bu)

    def epoch():
        per_step, losses = [], []
        for batch in data:
            cg = dx.renew_cg(autobatch=strategy)
            loss = dx.esum([dx.pickneglogsoftmax(Wo @ encode(t), y) for t, y in batch])
            losses.append(loss.value())
            loss.backward()
            trainer.update()
            jax.block_until_ready(E.value)
            per_step.append(cg.stats()["compiles"])
        return per_step, losses

    first, losses1 = epoch()
    before = _compile_count()
    second, losses2 = epoch()
    assert sum(first) > 0  # the counter does see compilations
    assert second == [0] * len(data), second
    assert _compile_count() == before  # trainer updates included
    assert np.mean(losses2) < np.mean(losses1)  # and it trains

    # evaluation graphs (train=False) over the same data reuse the training kernels
    before = _compile_count()
    for batch in data:
        dx.renew_cg(autobatch=strategy, train=False)
        loss = dx.esum([dx.pickneglogsoftmax(Wo @ encode(t), y) for t, y in batch])
        assert np.isfinite(loss.value())
    assert _compile_count() == before


def test_second_identical_step_compiles_nothing():
    """As Optax's tests do: once a step has run, the same step again compiles nothing
    (trainer state is committed to the device like the step's outputs)."""
    import optax
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((4, 3))
    E = pc.add_lookup_parameters((10, 3))
    trainer = dx.Trainer(pc, optax.adam(1e-3))
    counts = []
    for step in range(3):
        before = _compile_count()
        dx.renew_cg()
        loss = dx.sum_elems(W @ E[step % 3])
        loss.backward()
        trainer.update()
        counts.append(_compile_count() - before)
    assert counts[0] > 0 and counts[1:] == [0, 0], counts


def test_parameters_of_equal_shape_share_kernels():
    """Two parameter sets of one shape use the same compiled kernels (parameters are kernel
    arguments), e.g. the two directions of a BiRNN."""
    pc = dx.ParameterCollection(seed=0)
    W1, W2 = pc.add_parameters((5, 4)), pc.add_parameters((5, 4))
    x = np.ones(4, np.float32)

    def step(W):
        dx.renew_cg()
        loss = dx.sum_elems(dx.tanh(W @ dx.input(x)))
        loss.backward()
        return loss.value()

    step(W1)
    before = _compile_count()
    v2 = step(W2)
    assert _compile_count() == before
    assert v2 == pytest.approx(float(np.sum(np.tanh(np.asarray(W2.value) @ x))), rel=1e-5)


def test_small_batches_of_small_work_take_the_coarse_ladder():
    """Per-degree attention ops of a GAT come in batches of every size: where a padded
    kernel's work is small, sizes 5 to 16 share one kernel (16 lanes), as its padding costs
    microseconds and each size would be a compilation; a large op keeps the fine ladder."""
    pc = dx.ParameterCollection(seed=0)
    W, Wbig = pc.add_parameters((3, 3)), pc.add_parameters((300, 300))

    def lanes(n):
        cg = dx.renew_cg()
        small = [dx.tanh(W @ dx.input(np.full(3, 0.1 * i, np.float32))) for i in range(n)]
        big = [Wbig @ dx.input(np.full(300, 0.1 * i, np.float32)) for i in range(n)]
        loss = (dx.esum([dx.sum_elems(e) for e in small])  # lists of 16 at most: one node
                + dx.esum([dx.sum_elems(e) for e in big]))
        value = loss.value()
        want = sum(np.tanh(np.asarray(W.value) @ np.full(3, 0.1 * i)).sum()
                   + (np.asarray(Wbig.value) @ np.full(300, 0.1 * i)).sum() for i in range(n))
        assert value == pytest.approx(float(want), rel=1e-4)
        return {(b.sig.op.name, b.sig.params[0].shape if b.sig.params else ()): b.B
                for b in cg.batches}

    for n, big_lanes in ((5, 8), (9, 16), (13, 16)):
        got = lanes(n)
        assert got[("tanh", ())] == 16 and got[("matmul", (3, 3))] == 16, got
        assert got[("matmul", (300, 300))] == big_lanes, got
    lanes(5)
    before = _compile_count()
    lanes(11)  # every kernel at 16 lanes: compiled already
    assert _compile_count() == before


@pytest.mark.parametrize("strategy", ["agenda", "depth"])
def test_restricted_log_softmax_sets_are_data(strategy):
    """A parser's valid actions differ at every step: log_softmax(x, restrict) over
    different index sets runs as one batch, and new sets compile nothing (the set was part
    of the signature: a kernel per set, and a batch per set)."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((6, 4))
    x = np.linspace(-1, 1, 4).astype(np.float32)
    sets = [[0, 1, 2], [3, 5], [1, 2, 3, 4], [0], [2, 4, 5], [0, 1, 2, 3, 4, 5]]

    def step(shift):
        cg = dx.renew_cg(autobatch=strategy)
        h = W @ dx.input(x)
        chosen = [(shift + k) % len(sets) for k in range(4)]
        loss = -dx.esum([dx.pick(dx.log_softmax(h, sets[c]), sets[c][0]) for c in chosen])
        value = loss.value()
        loss.backward()
        W.zero_grad()  # as an update would: the next step's kernels write a fresh gradient
        return cg.stats(), value, chosen

    step(0)
    before = _compile_count()
    st, value, chosen = step(2)  # sets the first graph never used
    assert _compile_count() == before
    assert st["batches"] == 5, st  # matmul, the 4 log-softmaxes, their picks, sum, negate
    z = np.asarray(W.value) @ x
    want = -sum(z[sets[c][0]] - np.log(np.exp(z[sets[c]]).sum()) for c in chosen)
    assert value == pytest.approx(float(want), rel=1e-5)


def test_compile_log_names_the_op_pass_and_lanes(caplog):
    """JAX's compile log (``jax.log_compiles``) names each batch kernel after its op, its
    pass and its lane count, so a user can tell what a slow first update compiles."""
    @dx.function
    def squash_sum(x):
        return jnp.sum(jnp.tanh(x))

    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 2))
    with jax.log_compiles(), caplog.at_level("WARNING"):
        dx.renew_cg()
        loss = dx.esum([squash_sum(W @ dx.input(np.full(2, i, np.float32)))
                        for i in range(3)])
        loss.backward()
    text = caplog.text
    assert "squash_sum_fwd_B4" in text and "squash_sum_bwd_B4" in text, text[-2000:]


def test_stats_count_the_graphs_own_compilations_only():
    """``cg.stats()["compiles"]`` counts what this graph caused (API.md): its kernels and
    the trainer's step, not the user's own ``jax.jit`` calls on the same thread, nor a
    graph that another thread compiles meanwhile."""
    import threading

    import optax

    @dx.function
    def own_cell(x, W):
        return jnp.sin(W @ x)

    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 2))
    trainer = dx.Trainer(pc, optax.sgd(0.1))
    cg = dx.renew_cg()
    loss = dx.sum_elems(own_cell(dx.input(np.ones(2, np.float32)), W))
    loss.backward()
    trainer.update()
    ours = cg.stats()["compiles"]
    assert ours >= 3  # forward, backward, the optimizer step (at least)

    for k in range(3):  # the user's own JAX work on this thread
        jax.jit(lambda v, k=k: v * (k + 2.0))(jnp.ones(5)).block_until_ready()

    def other_thread():
        dx.renew_cg()
        dx.sum_elems(dx.exp(dx.input(np.full(7, 0.25, np.float32)) * 3.0)).value()

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert cg.stats()["compiles"] == ours


@pytest.mark.parametrize("strategy", ["agenda", "depth", "none"])
def test_small_kernels_compile_without_llvm_optimisation(strategy, monkeypatch):
    """On CPU, a kernel of small padded work (``QUICK_MAX_WORK``) compiles at XLA's backend
    optimisation level 0 (half the compile time, as fast to run), a step of a fused scan
    included (a nested jit takes no compiler options: the scan calls the step unjitted),
    and a large one as usual; values and gradients match JAX."""
    from dynax.executor import kernels

    made = {}
    real_jit = jax.jit

    def spy(fn, **kw):
        made[fn.__name__] = kw.get("compiler_options")
        return real_jit(fn, **kw)

    monkeypatch.setattr(kernels.jax, "jit", spy)

    @dx.function
    def quick_step(h, x, W):  # per lane: 9 parameter elements
        return jnp.tanh(W @ h + x)

    @dx.function
    def slow_read(h, V):  # per lane: 9,000 parameter elements
        return jnp.sum(jnp.sin(V @ h))

    pc = dx.ParameterCollection(seed=0)
    W, V = pc.add_parameters((3, 3)), pc.add_parameters((3000, 3))
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(n, 3)).astype(np.float32) for n in (3, 5, 6)]

    dx.renew_cg(autobatch=strategy)
    terms = []
    for seq in xs:
        h = dx.input(np.zeros(3, np.float32))
        for x in seq:
            h = quick_step(h, dx.input(x), W)
            terms.append(slow_read(h, V))
    loss = dx.esum(terms)
    value = loss.value()
    loss.backward()

    def reference(w, v):
        total = 0.0
        for seq in xs:
            h = jnp.zeros(3)
            for x in seq:
                h = jnp.tanh(w @ h + x)
                total = total + jnp.sum(jnp.sin(v @ h))
        return total

    want, (gw, gv) = jax.value_and_grad(reference, argnums=(0, 1))(W.value, V.value)
    assert value == pytest.approx(float(want), rel=1e-5)
    np.testing.assert_allclose(W.grad, gw, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(V.grad, gv, rtol=1e-4, atol=1e-5)

    quick = {n: o for n, o in made.items() if "quick_step_" in n}
    slow = {n: o for n, o in made.items() if "slow_read_" in n}
    assert quick and slow, made
    # a backward run of small steps also takes one_thread_dots (kernels.SMALL_STEP_MAX_WORK)
    bwd_run = {**kernels.QUICK_OPTIONS, **kernels.one_thread_dots()}
    assert all(o == (bwd_run if "_bwd_" in n and "_T" in n else kernels.QUICK_OPTIONS)
               for n, o in quick.items()), quick
    assert all(o is None for o in slow.values()), slow
    if strategy == "agenda":  # 5 batches of 4 lanes in a row: a fused scan, both passes
        assert any("_fwd_B4_T" in n for n in quick) and any("_bwd_B4_T" in n for n in quick)


@pytest.mark.parametrize("strategy", ["agenda", "none"])
def test_after_jax_clear_caches_a_second_identical_step_compiles_nothing(strategy):
    """``jax.clear_caches()`` drops every executable, the gradient-clearing kernel that a
    backward pass compiles ahead for the next pass's use included: the pass after it
    compiles again, and the one after that nothing (a memo of what was compiled ahead
    outlived the cache and left that compilation to the next pass, counted there)."""
    @dx.function
    def cleared_cell(x, W):
        return jnp.tanh(W @ x)

    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 4))
    xs = np.random.default_rng(2).standard_normal((40, 4)).astype(np.float32)

    def step(n):  # n instances: the gradient rows the next pass clears follow n
        cg = dx.renew_cg(autobatch=strategy)
        loss = dx.esum([dx.sum_elems(cleared_cell(dx.input(x), W)) for x in xs[:n]])
        loss.backward()
        W.zero_grad()
        return built(cg)

    step(5)  # leaves 5 instances' rows to clear, and compiles their clearing ahead
    step(40)
    jax.clear_caches()
    assert step(5) > 0  # clears 40's rows; leaves 5's, whose clearing must compile again
    assert step(5) == 0


@pytest.mark.parametrize("strategy", ["agenda", "none"])
def test_a_passes_new_kernels_compile_side_by_side_on_the_pool(strategy, monkeypatch):
    """The new kernels of a pass, forward and backward, are lowered on the graph's thread
    and compiled on ``ahead.py``'s pool before their launches; the graph counts those
    compilations as its own (as many as with the lookahead off), a second graph of the same
    shapes compiles nothing, and values and gradients match JAX either way."""
    import threading

    from dynax.executor import ahead, engine

    @dx.function
    def pool_cell(h, x, W):
        return jnp.tanh(W @ h + x)

    @dx.function
    def pool_read(h, v):
        return jnp.sum(v * h)

    pc = dx.ParameterCollection(seed=0)
    W, v = pc.add_parameters((3, 3)), pc.add_parameters((3,))
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(n, 3)).astype(np.float32) for n in (2, 4, 5)]

    def reference(w, vv):
        total = 0.0
        for seq in xs:
            h = jnp.zeros(3)
            for x in seq:
                h = jnp.tanh(w @ h + x)
            total = total + jnp.sum(vv * h)
        return total

    want, grads = jax.value_and_grad(reference, argnums=(0, 1))(W.value, v.value)
    submitted, threads = [], set()
    submit = ahead.Ahead.submit

    def spy_submit(self, fn, args):
        submitted.append(fn.__name__)
        return submit(self, fn, args)

    def on_compile(name, *args, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            threads.add(threading.current_thread().name)

    monkeypatch.setattr(ahead.Ahead, "submit", spy_submit)
    jax.monitoring.register_event_duration_secs_listener(on_compile)

    def one_pass():
        cg = dx.renew_cg(autobatch=strategy)
        terms = []
        for seq in xs:
            h = dx.input(np.zeros(3, np.float32))
            for x in seq:
                h = pool_cell(h, dx.input(x), W)
            terms.append(pool_read(h, v))
        loss = dx.esum(terms)
        value = loss.value()
        loss.backward()
        assert value == pytest.approx(float(want), rel=1e-5)
        np.testing.assert_allclose(W.grad, grads[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(v.grad, grads[1], rtol=1e-4, atol=1e-5)
        W.zero_grad()
        v.zero_grad()
        return built(cg)

    one_pass()  # arenas and parameter buffers made, as for the passes compared
    jax.clear_caches()  # every kernel of the pass new
    threads.clear()
    submitted.clear()
    with_pool = one_pass()
    threads_used, names = set(threads), list(submitted)
    again = one_pass()
    monkeypatch.setattr(engine, "AHEAD_COMPILE", False)
    jax.clear_caches()
    submitted.clear()
    without = one_pass()

    assert any("pool_cell_fwd" in n for n in names) and any("pool_cell_bwd" in n for n in names)
    assert any(t.startswith("dynax-compile") for t in threads_used), threads_used
    assert with_pool == without > 0 and again == 0
    assert not submitted  # off: each kernel compiled on its launch


def test_evaluation_after_clear_caches_reuses_the_training_kernels():
    """An evaluation graph first (its kernels are residual-free twins), training whose
    products' inputs need gradients (lookups), ``jax.clear_caches()`` (the benchmark harness
    and some tests call it), then training on inputs: a later evaluation runs the training
    variants that hold executables, rather than compiling or loading its emptied twins or
    the emptied variants again (order-dependent failures of this file's tests in session
    72: under xdist, earlier tests' models of these shapes share the kernel families).
    Values equal the twins', the node-by-node reference's and plain JAX's."""
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((3, 5))
    E = pc.add_lookup_parameters((4, 5))
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(5).astype(np.float32) for _ in range(4)]
    ys = [0, 1, 2, 1]

    def graph(train, lookups=False, strategy="agenda"):
        cg = dx.renew_cg(autobatch=strategy, train=train)
        vs = [E[i] for i in range(4)] if lookups else [dx.input(x) for x in xs]
        loss = dx.esum([dx.pickneglogsoftmax(W @ v, y) for v, y in zip(vs, ys)])
        value = loss.value()
        if train:
            loss.backward()
        return cg, value

    cg, first = graph(train=False)
    assert built(cg) > 0  # the twins were made
    graph(train=True, lookups=True)  # the training variants with the products' x flagged
    jax.clear_caches()
    graph(train=True)
    graph(train=True)
    cg, again = graph(train=False)
    assert built(cg) == 0, cg.stats()
    np.testing.assert_allclose(again, first, rtol=1e-6)
    # the training variants' values: those of the node-by-node reference and of plain JAX
    np.testing.assert_allclose(again, graph(train=False, strategy="none")[1], rtol=1e-5)
    w = jnp.asarray(W.value)
    want = sum(-jax.nn.log_softmax(w @ x)[y] for x, y in zip(xs, ys))
    np.testing.assert_allclose(again, want, rtol=1e-5)
