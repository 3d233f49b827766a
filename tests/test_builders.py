"""Builders (RNN/LSTM/GRU/BiRNN, Tree-LSTMs, softmaxes) against pure-JAX references.

Every test builds several instances of different sizes in one graph so that batching
happens, and checks values and parameter gradients under all three strategies. Builders
live at module scope so that kernels compiled for one strategy serve the others.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynax as dx
from reference import STRATEGIES, ref_binary_tree, ref_child_sum_tree, ref_gru, ref_lstm

TOL = dict(rtol=1e-5, atol=1e-5)
IN, HID = 3, 4
RNG = np.random.default_rng(0)
PC = dx.ParameterCollection(seed=0)

sig, tanh = jax.nn.sigmoid, jnp.tanh


def _rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _zero_grads():
    for p in PC.parameters():
        p.zero_grad()


_REFERENCE: dict = {}  # test key -> (reference outputs, reference gradients)


def _check(key, outs, params, ref_outs, ref_loss):
    """Values of ``outs`` equal ``ref_outs(vals)`` and each ``p.grad`` equals
    ``jax.grad(ref_loss)(vals)``, with ``vals`` the parameters' values. The reference is
    computed once per ``key`` (the data are the same under every strategy).

    References run eagerly: a jitted, unrolled reference takes seconds to compile."""
    if key not in _REFERENCE:
        vals = [p.value for p in params]
        _REFERENCE[key] = ref_outs(vals), jax.grad(ref_loss)(vals)
    want_outs, want_grads = _REFERENCE[key]
    for o, r in zip(outs, want_outs, strict=True):
        np.testing.assert_allclose(o.npvalue(), np.asarray(r), **TOL)
    for p, g in zip(params, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(p.grad), np.asarray(g), err_msg=p.name, **TOL)


def _check_batches(cg, strategy, factor):
    """'none' launches one kernel per node; 'agenda' at least ``factor`` times fewer."""
    stats = cg.stats()
    if strategy == "none":
        assert stats["batches"] == stats["nodes"], stats
    if strategy == "agenda":
        assert stats["batches"] * factor < stats["nodes"], stats


def _flat(lists):
    return [x for xs in lists for x in xs]


def _dot_loss(outs, weights):
    """dynax loss sum_t <out_t, w_t> (a fixed random projection of every output)."""
    return dx.esum([dx.dot_product(o, dx.input(w)) for o, w in zip(outs, weights)])


# ---- references of the recurrent cells ----------------------------------------------------------

def ref_rnn(x, state, Wx, Wh, b):
    return (tanh(Wx @ x + Wh @ state[0] + b),)


def ref_coupled_step(x, c, hr, Wx, Wh, b, Wic, Woc):
    """DyNet's CoupledLSTMBuilder equations (lstm.h); ``hr`` is the h its products read."""
    gi, go, gg = jnp.split(Wx @ x + Wh @ hr + b, 3)
    i = sig(gi + Wic @ c)
    c2 = c * (1 - i) + tanh(gg) * i
    return c2, sig(go + Woc @ c2) * tanh(c2)


def ref_coupled(x, state, *params):
    return ref_coupled_step(x, state[0], state[1], *params)


REFS = {dx.nn.SimpleRNNBuilder: ref_rnn, dx.nn.LSTMBuilder: ref_lstm, dx.nn.GRUBuilder: ref_gru,
        dx.CoupledLSTMBuilder: ref_coupled}
N_STATES = {dx.nn.SimpleRNNBuilder: 1, dx.nn.LSTMBuilder: 2, dx.nn.GRUBuilder: 1,
            dx.CoupledLSTMBuilder: 2}


def ref_transduce(cell, vals, layers, xs, init_states):
    """Top-layer outputs over ``xs``; ``vals`` = flat [Wx0, Wh0, b0, Wx1, ...] (a coupled
    LSTM's layers have five)."""
    states = list(init_states)
    outs = []
    k = len(vals) // layers
    for x in xs:
        inp = x
        for layer in range(layers):
            states[layer] = cell(inp, states[layer], *vals[k * layer:k * layer + k])
            inp = states[layer][-1]
        outs.append(inp)
    return outs


# Two layers for the LSTM, one for the others: the layer stacking is shared code, and every
# extra layer is another signature to compile kernels for.
LAYERS = {dx.nn.SimpleRNNBuilder: 1, dx.nn.LSTMBuilder: 2, dx.nn.GRUBuilder: 1,
          dx.CoupledLSTMBuilder: 1}
BUILDERS = {cls: cls(LAYERS[cls], IN, HID, PC) for cls in REFS}
SEQ_LENGTHS = (3, 5, 4, 4)  # batches of 4 (and 1): few kernel sizes to compile


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cls", list(REFS), ids=lambda c: c.__name__)
def test_rnn_builder_values_and_grads(cls, strategy):
    builder, cell, layers = BUILDERS[cls], REFS[cls], LAYERS[cls]
    rng = np.random.default_rng(1)  # the same data under every strategy
    seqs = [[rng.standard_normal(IN, np.float32) for _ in range(n)] for n in SEQ_LENGTHS]
    weights = [[rng.standard_normal(HID, np.float32) for _ in range(n)] for n in SEQ_LENGTHS]
    _zero_grads()
    cg = dx.renew_cg(autobatch=strategy)
    outs = [builder.initial_state().transduce([dx.input(x) for x in xs]) for xs in seqs]
    loss = _dot_loss(_flat(outs), _flat(weights))
    loss.backward()

    zero = (jnp.zeros(HID),) * N_STATES[cls]

    def ref_outs(vals):
        return [o for xs in seqs for o in ref_transduce(cell, vals, layers, xs, [zero] * layers)]

    def ref_loss(vals):
        return sum(jnp.dot(o, w) for o, w in zip(ref_outs(vals), _flat(weights)))

    def ref_loss_and_outs(vals):
        return [ref_loss(vals)] + ref_outs(vals)

    _check(cls, [loss] + _flat(outs), builder.pc.parameters(), ref_loss_and_outs, ref_loss)
    _check_batches(cg, strategy, 3)
    if strategy == "agenda":  # one batch per (layer, step) cell + a few for the loss
        assert cg.stats()["batches"] <= layers * max(SEQ_LENGTHS) + 6, cg.stats()


@pytest.mark.parametrize("cls", list(REFS), ids=lambda c: c.__name__)
def test_initial_state_vectors(cls):
    builder, cell, n, L = BUILDERS[cls], REFS[cls], N_STATES[cls], LAYERS[cls]
    init = [_rand(HID) for _ in range(n * L)]  # DyNet order: [c_1, c_2, h_1, h_2] for LSTM
    xs, ws = [_rand(IN) for _ in range(3)], [_rand(HID) for _ in range(3)]
    _zero_grads()
    dx.renew_cg()
    s0 = builder.initial_state([dx.input(v) for v in init])
    assert len(s0.s()) == n * L and len(s0.h()) == L
    np.testing.assert_allclose(s0.output().npvalue(), init[-1])
    outs = s0.transduce([dx.input(x) for x in xs])
    _dot_loss(outs, ws).backward()
    init_states = [tuple(jnp.asarray(init[k * L + layer]) for k in range(n))
                   for layer in range(L)]

    def ref_outs(vals):
        return ref_transduce(cell, vals, L, xs, init_states)

    def ref_loss(vals):
        return sum(jnp.dot(o, w) for o, w in zip(ref_outs(vals), ws))

    _check(("init", cls), outs, builder.pc.parameters(), ref_outs, ref_loss)


def test_state_api_and_errors():
    lstm = BUILDERS[dx.nn.LSTMBuilder]
    dx.renew_cg()
    s0 = lstm.initial_state()
    a, b = s0.add_input(dx.input(_rand(IN))), s0.add_input(dx.input(_rand(IN)))
    assert a.prev() is s0 and s0.prev() is None
    assert len(a.h()) == 2 and len(a.s()) == 4 and a.s()[2:] == a.h()
    assert a.output() is a.h()[-1] and a.output().shape == (HID,)
    assert not np.allclose(a.output().npvalue(), b.output().npvalue())  # s0 was reused
    assert len(s0.add_inputs([dx.input(_rand(IN))] * 3)) == 3
    assert s0.transduce([]) == []
    with pytest.raises(ValueError, match="input"):
        s0.add_input(dx.input(_rand(IN + 1)))
    with pytest.raises(ValueError, match="expected 4 vectors"):
        lstm.initial_state([dx.zeros((HID,))] * 2)
    with pytest.raises(ValueError, match="shape"):
        lstm.initial_state([dx.zeros((HID + 1,))] * 4)
    with pytest.raises(ValueError, match="layers"):
        dx.nn.LSTMBuilder(0, IN, HID, PC)
    with pytest.raises(dx.ArgumentTypeError, match=r"LSTMBuilder.initial_state: vecs is a list "
                                                   r"of 4 vectors .*got one Expression"):
        lstm.initial_state(dx.zeros((HID,)))  # was "an Expression is not iterable"
    with pytest.raises(ValueError, match="even"):
        dx.nn.BiRNNBuilder(1, IN, 5, PC, dx.nn.LSTMBuilder)


@pytest.mark.parametrize("given, said", [
    (lambda pc: dx.nn.LSTMBuilder(1, IN, HID, pc), "an instance of LSTMBuilder"),
    (lambda pc: "lstm", "an instance of str"),
    (lambda pc: dx.nn.TreeLSTMBuilder, "TreeLSTMBuilder")])
def test_birnn_refuses_what_is_not_a_sequence_builder_class(given, said):
    """A builder instance, a name or a tree builder failed inside the constructor with
    Python's own errors ('object is not callable', a wrong argument count)."""
    pc = dx.ParameterCollection(seed=0)
    builder_cls = given(pc)
    n = len(pc.parameters())
    with pytest.raises(dx.ArgumentTypeError, match=f"BiRNNBuilder: builder_cls must be a "
                                                   f"sequence builder class .*got {said}"):
        dx.nn.BiRNNBuilder(1, IN, 2 * HID, pc, builder_cls)
    assert len(pc.parameters()) == n  # no parameter left behind


def test_a_missing_input_names_the_builder_call():
    """None (a state's input that was never set) was turned into an object array and
    refused by ``input`` as a dtype; it names the builder call and what it got, and adds
    nothing to the graph."""
    gru = dx.nn.GRUBuilder(1, IN, HID, PC)
    tree = dx.nn.ChildSumTreeLSTMBuilder(IN, HID, PC)
    softmax = dx.nn.StandardSoftmaxBuilder(HID, 5, PC)
    bi = dx.nn.BiRNNBuilder(1, IN, 2 * HID, PC, dx.nn.LSTMBuilder)
    cg = dx.renew_cg()
    s0 = gru.initial_state()
    leaf, x = tree.node(dx.input(_rand(IN)), []), dx.input(_rand(IN))
    before = cg.stats()["nodes"], len(cg.val_node)
    for call, match in (
            (lambda: s0.add_input(None), r"GRUBuilder.add_input: input must be an Expression, "
                                         r"a Parameter or an array, got NoneType None"),
            (lambda: gru.initial_state([None]), r"GRUBuilder.initial_state: vector 0 must be"),
            (lambda: tree.node(None, [(leaf[0], None)]),
             r"ChildSumTreeLSTMBuilder.node: child 0 c must be .* got NoneType"),
            (lambda: softmax.neg_log_softmax(None, 0),
             r"StandardSoftmaxBuilder.neg_log_softmax: h must be"),
            (lambda: bi.add_inputs([x, None]),
             r"BiRNNBuilder.add_inputs: input 1 must be")):
        with pytest.raises(dx.ArgumentTypeError, match=match):
            call()
        assert (cg.stats()["nodes"], len(cg.val_node)) == before


def test_parameters_layout():
    pc = dx.ParameterCollection(seed=1)
    l1, l2 = dx.nn.LSTMBuilder(2, IN, HID, pc), dx.nn.LSTMBuilder(1, IN, HID, pc)
    assert [p.name for p in l1.pc.parameters()] == [
        "lstm/Wx0", "lstm/Wh0", "lstm/b0", "lstm/Wx1", "lstm/Wh1", "lstm/b1"]
    assert all(p.name.startswith("lstm_1/") for p in l2.pc.parameters())
    b = np.asarray(l1.params[0][2].value)
    np.testing.assert_array_equal(b, np.r_[np.zeros(HID), np.ones(HID), np.zeros(2 * HID)])
    assert l1.params[1][0].shape == (4 * HID, HID)
    gru = dx.nn.GRUBuilder(1, IN, HID, pc)
    assert gru.params[0][0].shape == (3 * HID, IN)
    assert pc.parameter_count() == sum(int(np.prod(p.shape)) for p in pc.parameters())


def test_dynet_builder_accessors():
    """DyNet's get_parameters / get_parameter_expressions (per layer), set_dropout(d, d_h)
    (CompactVanillaLSTMBuilder's), and the builder names DyNet has."""
    pc = dx.ParameterCollection(seed=2)
    lstm, coupled = dx.VanillaLSTMBuilder(2, IN, HID, pc), dx.CoupledLSTMBuilder(1, IN, HID, pc)
    assert lstm.get_parameters() == [list(layer) for layer in lstm.params]
    assert [p.name for p in coupled.get_parameters()[0]] == [
        "coupled_lstm/" + n for n in ("Wx0", "Wh0", "b0", "Wic0", "Woc0")]
    assert [p.shape for p in coupled.get_parameters()[0]] == [
        (3 * HID, IN), (3 * HID, HID), (3 * HID,), (HID, HID), (HID, HID)]
    dx.renew_cg()
    exprs = lstm.get_parameter_expressions()
    assert [len(layer) for layer in exprs] == [3, 3]
    for e, p in zip(_flat(exprs), _flat(lstm.get_parameters())):
        np.testing.assert_array_equal(e.npvalue(), p.as_array())
    lstm.set_dropout(0.2, 0.1)
    assert (lstm.dropout_rate, lstm.dropout_rate_h) == (0.2, 0.1)
    lstm.set_dropout(0.3)
    assert (lstm.dropout_rate, lstm.dropout_rate_h) == (0.3, 0.3)
    assert dx.CompactVanillaLSTMBuilder is dx.LSTMBuilder is dx.VanillaLSTMBuilder


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_initial_state_without_update(strategy):
    """DyNet's ``initial_state(update=False)``: the same values, no gradient into the
    builder's weights, while what feeds the sequence (a learned start vector) still gets
    its gradient; the weights' copies are made once per graph, so the steps of all
    sequences batch as with ``update=True``."""
    pc = dx.ParameterCollection(seed=3)
    lstm = dx.LSTMBuilder(2, IN, HID, pc)
    start = pc.add_parameters((IN,), name="start")
    rng = np.random.default_rng(8)
    seqs = [[rng.standard_normal(IN, np.float32) for _ in range(n)] for n in SEQ_LENGTHS]
    weights = [rng.standard_normal(HID, np.float32) for _ in range(sum(SEQ_LENGTHS) + 4)]
    cg = dx.renew_cg(autobatch=strategy)
    outs = _flat(lstm.initial_state(update=False).transduce([start] + [dx.input(x) for x in xs])
                 for xs in seqs)
    loss = _dot_loss(outs, weights)
    loss.backward()
    assert [sg.op.name for sg in cg.node_sig].count("nobackprop") == 6  # 3 weights x 2 layers
    vals = [p.value for p in lstm.pc.parameters()]
    zero = (jnp.zeros(HID),) * 2

    def ref_outs(x0):
        return [o for xs in seqs for o in ref_transduce(ref_lstm, vals, 2, [x0] + xs, [zero] * 2)]

    def ref_loss(x0):
        return sum(jnp.dot(o, w) for o, w in zip(ref_outs(x0), weights))

    for o, r in zip(outs, ref_outs(start.value), strict=True):
        np.testing.assert_allclose(o.npvalue(), np.asarray(r), **TOL)
    np.testing.assert_allclose(start.grad, jax.grad(ref_loss)(start.value), **TOL)
    assert not any(np.any(np.asarray(p.grad)) for p in lstm.pc.parameters())
    _check_batches(cg, strategy, 3)
    with pytest.raises(dx.ArgumentTypeError, match="update must be True or False"):
        lstm.initial_state(update=None)


def test_weights_copies_removed_by_a_failed_construction_are_made_again():
    """A failed all-or-nothing construction removes the copies it made; the next sequence
    of the graph makes them again instead of reading value ids that now hold other nodes."""
    lstm = BUILDERS[dx.nn.LSTMBuilder]

    @dx.ops.core.atomic
    def fails():
        lstm.initial_state(update=False).add_input(xs[0])
        raise RuntimeError("fails after the copies were made")

    dx.renew_cg()
    xs = [dx.input(_rand(IN)) for _ in range(3)]
    with pytest.raises(RuntimeError):
        fails()
    frozen = lstm.initial_state(update=False).transduce(xs)
    plain = lstm.initial_state().transduce(xs)
    for f, p in zip(frozen, plain):
        np.testing.assert_allclose(f.npvalue(), p.npvalue(), **TOL)


def test_dropout():
    lstm = BUILDERS[dx.nn.LSTMBuilder]
    xs = [_rand(IN) for _ in range(3)]

    def run(train=True, seed=3):
        dx.renew_cg(train=train, seed=seed)
        return [o.npvalue() for o in lstm.initial_state().transduce([dx.input(x) for x in xs])]

    plain = run()
    try:
        lstm.set_dropout(0.0)
        cg = dx.renew_cg()
        lstm.initial_state().transduce([dx.input(x) for x in xs])
        assert not any(s.op.name == "dropout" for s in cg.node_sig)
        np.testing.assert_allclose(run(), plain, **TOL)
        lstm.set_dropout(0.5)
        np.testing.assert_allclose(run(train=False), plain, **TOL)
        dropped = run()
        assert not np.allclose(dropped, plain)
        cg = dx.renew_cg()
        lstm.initial_state().transduce([dx.input(x) for x in xs])
        names = [s.op.name for s in cg.node_sig]
        # DyNet's variational dropout: one mask per layer for x and one for h, per sequence
        assert names.count("dropout") == 2 * LAYERS[dx.nn.LSTMBuilder]
        np.testing.assert_allclose(run(), dropped, **TOL)  # same seed, same masks
        with pytest.raises(ValueError):
            lstm.set_dropout(1.0)
    finally:
        lstm.disable_dropout()
    np.testing.assert_allclose(run(), plain, **TOL)


def ref_dropout_cell(cls, x, state, params, mx, mh):
    """One step of ``cls`` with variational dropout: x is masked, and so is the h that the
    recurrent products read (a GRU's carried h is not, nor the cell a peephole reads)."""
    x, h = x * mx, state[-1]
    hr = h * mh
    if cls is dx.CoupledLSTMBuilder:
        return ref_coupled_step(x, state[0], hr, *params)
    Wx, Wh, b = params
    if cls is dx.nn.SimpleRNNBuilder:
        return (tanh(Wx @ x + Wh @ hr + b),)
    if cls is dx.nn.LSTMBuilder:
        i, f, o, g = jnp.split(Wx @ x + Wh @ hr + b, 4)
        c2 = sig(i) * tanh(g) + sig(f) * state[0]
        return c2, sig(o) * tanh(c2)
    H = h.shape[0]
    gx, gh = Wx @ x + b, Wh[:2 * H] @ hr
    z, r = sig(gx[:H] + gh[:H]), sig(gx[H:2 * H] + gh[H:])
    n = tanh(gx[2 * H:] + Wh[2 * H:] @ (r * hr))
    return ((1 - z) * n + z * h,)


@pytest.fixture
def recorded_masks(monkeypatch):
    """Every dropout mask the builders draw, in order, as (rate, Expression)."""
    from dynax.nn import rnn
    masks, draw = [], rnn._mask

    def recording(dim, p):
        m = draw(dim, p)
        masks.append((p, m))
        return m
    monkeypatch.setattr(rnn, "_mask", recording)
    return masks


def _check_mask(rate, m):
    v = m.npvalue()
    assert set(np.unique(v)) <= {0.0, np.float32(1 / (1 - rate))}, (rate, v)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cls", list(REFS), ids=lambda c: c.__name__)
def test_variational_dropout_values_and_grads(cls, strategy, recorded_masks):
    """Each sequence draws one x mask and one h mask per layer when it starts, and every
    step reuses them: values and gradients equal a pure-JAX model given those masks, under
    every strategy (the masks depend on the graph's seed and the build order only)."""
    builder, layers = BUILDERS[cls], LAYERS[cls]
    rng = np.random.default_rng(6)
    seqs = [[rng.standard_normal(IN, np.float32) for _ in range(n)] for n in SEQ_LENGTHS]
    weights = [rng.standard_normal(HID, np.float32) for _ in range(sum(SEQ_LENGTHS))]
    _zero_grads()
    builder.set_dropouts(0.4, 0.3)
    try:
        cg = dx.renew_cg(autobatch=strategy, seed=11)
        outs = _flat(builder.initial_state().transduce([dx.input(x) for x in xs])
                     for xs in seqs)
    finally:
        builder.disable_dropout()
    names = [sg.op.name for sg in cg.node_sig]
    assert names.count("dropout") == 2 * layers * len(seqs)  # none per step
    assert len(recorded_masks) == 2 * layers * len(seqs)
    _dot_loss(outs, weights).backward()
    masks = [m.npvalue() for _, m in recorded_masks]
    for rate, m in recorded_masks:
        _check_mask(rate, m)
    assert not np.allclose(masks[0], masks[2 * layers])  # each sequence has its own

    def ref_outs(vals):
        outs, k = [], 0
        for xs in seqs:
            seq_masks = masks[k:k + 2 * layers]
            k += 2 * layers

            def cell(x, state, *params):  # which layer: by the weights' input size
                layer = 0 if params[0].shape[1] == IN else 1
                return ref_dropout_cell(cls, x, state, params, *seq_masks[2 * layer:][:2])
            zero = (jnp.zeros(HID),) * N_STATES[cls]
            outs += ref_transduce(cell, vals, layers, xs, [zero] * layers)
        return outs

    def ref_loss(vals):
        return sum(jnp.dot(o, w) for o, w in zip(ref_outs(vals), weights))

    _check(f"dropout-{cls.__name__}", outs, builder.pc.parameters(), ref_outs, ref_loss)
    _check_batches(cg, strategy, 2)


def test_dropout_rates_are_checked_and_h_rate_alone_masks_h_only(recorded_masks):
    lstm = dx.nn.LSTMBuilder(1, IN, HID, dx.ParameterCollection(seed=0))
    for bad in (1.0, -0.1, "0.5", True, None):
        with pytest.raises(dx.InvalidArgumentError, match="set_dropouts: a dropout rate"):
            lstm.set_dropouts(0.1, bad)
    assert (lstm.dropout_rate, lstm.dropout_rate_h) == (0.0, 0.0)  # unchanged by a failure
    lstm.set_dropouts(0.0, 0.5)
    dx.renew_cg(seed=1)
    lstm.initial_state().add_input(dx.input(_rand(IN))).output().forward()
    (px, mx), (ph, mh) = recorded_masks
    assert (px, ph) == (0.0, 0.5)
    np.testing.assert_array_equal(mx.npvalue(), np.ones(IN, np.float32))
    _check_mask(0.5, mh)


def test_state_set_h_and_set_s():
    """``set_h`` replaces every layer's h and keeps an LSTM's cells; ``set_s`` replaces all;
    the next step reads the new vectors. Bad input changes nothing in the graph."""
    lstm = BUILDERS[dx.nn.LSTMBuilder]
    vals = [p.value for p in lstm.pc.parameters()]
    x1, x2 = _rand(IN), _rand(IN)
    h_new = [_rand(HID), _rand(HID)]
    s_new = [_rand(HID) for _ in range(4)]
    cg = dx.renew_cg()
    s1 = lstm.initial_state().add_input(dx.input(x1))
    s2 = s1.set_h([dx.input(h_new[0]), h_new[1]])  # an Expression, or an array
    assert s2.prev() is s1 and s2.h()[1].shape == (HID,)
    assert s2.s()[:2] == s1.s()[:2]  # the cells are kept
    for h, want in zip(s2.h(), h_new):
        np.testing.assert_array_equal(h.npvalue(), want)
    c_1, c_2 = (c.npvalue() for c in s1.s()[:2])
    want = ref_transduce(ref_lstm, vals, 2, [x2], [(c_1, h_new[0]), (c_2, h_new[1])])
    np.testing.assert_allclose(s2.add_input(dx.input(x2)).output().npvalue(), want[0], **TOL)
    s3 = s1.set_s(s_new)
    got = [v.npvalue() for v in s3.s()]
    np.testing.assert_array_equal(np.stack(got), np.stack(s_new))
    want = ref_transduce(ref_lstm, vals, 2, [x2], [(s_new[0], s_new[2]), (s_new[1], s_new[3])])
    np.testing.assert_allclose(s3.add_input(dx.input(x2)).output().npvalue(), want[0], **TOL)
    before = cg.stats()["nodes"], len(cg.val_node)
    with pytest.raises(dx.InvalidArgumentError, match=r"state.set_h: expected 2 vectors"):
        s1.set_h([h_new[0]])
    with pytest.raises(dx.ShapeError, match=r"state.set_s: each vector must have shape \(4,\)"):
        s1.set_s(s_new[:3] + [np.zeros(3, np.float32)])
    assert (cg.stats()["nodes"], len(cg.val_node)) == before
    dx.renew_cg()
    with pytest.raises(dx.StaleExpressionError, match="state.set_h"):
        s1.set_h(h_new)


# ---- bidirectional ------------------------------------------------------------------------------

# SimpleRNN cells keep compilation cheap; the BiRNN logic does not depend on the cell type.
BI = dx.nn.BiRNNBuilder(2, IN, 2 * HID, PC, dx.nn.SimpleRNNBuilder)  # HID units per direction


def ref_birnn(cell, n_states, layers, vals, xs):
    zero = (jnp.zeros(HID),) * n_states
    k = len(vals) // (2 * layers)  # weights per direction and layer
    for layer in range(layers):  # per layer: fwd Wx, Wh, b (...) then bwd Wx, Wh, b (...)
        v = vals[2 * k * layer:2 * k * (layer + 1)]
        f = ref_transduce(cell, v[:k], 1, xs, [zero])
        b = ref_transduce(cell, v[k:], 1, xs[::-1], [zero])[::-1]
        xs = [jnp.concatenate([fo, bo]) for fo, bo in zip(f, b)]
    return xs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_birnn(strategy):
    params = BI.pc.parameters()
    assert len(params) == 12 and params[0].shape == (HID, IN)
    assert params[6].shape == (HID, 2 * HID)  # layer 2 reads the concatenated outputs
    rng = np.random.default_rng(2)
    seqs = [[rng.standard_normal(IN, np.float32) for _ in range(n)] for n in SEQ_LENGTHS]
    weights = [rng.standard_normal(2 * HID, np.float32) for _ in range(sum(SEQ_LENGTHS))]
    _zero_grads()
    cg = dx.renew_cg(autobatch=strategy)
    outs = _flat(BI.transduce([dx.input(x) for x in xs]) for xs in seqs)
    assert all(o.shape == (2 * HID,) for o in outs)
    _dot_loss(outs, weights).backward()

    def ref_outs(vals):
        return _flat(ref_birnn(ref_rnn, 1, 2, vals, xs) for xs in seqs)

    def ref_loss(vals):
        return sum(jnp.dot(o, w) for o, w in zip(ref_outs(vals), weights))

    _check("birnn", outs, params, ref_outs, ref_loss)
    _check_batches(cg, strategy, 2)
    assert BI.transduce([]) == []


def test_birnn_lstm_values():
    pc = dx.ParameterCollection(seed=3)
    bi = dx.nn.BiRNNBuilder(1, IN, 2 * HID, pc, dx.nn.LSTMBuilder)
    xs = [_rand(IN) for _ in range(3)]
    dx.renew_cg()
    outs = bi.transduce([dx.input(x) for x in xs])
    want = ref_birnn(ref_lstm, 2, 1, [p.value for p in pc.parameters()], xs)
    np.testing.assert_allclose(np.stack([o.npvalue() for o in outs]), np.stack(want), **TOL)


@pytest.mark.parametrize("strategy", ("none", "agenda"))
def test_birnn_two_layers_with_dropout_set(strategy, recorded_masks):
    """Dropout keeps one node per position and layer (layer 2 still reads the halves below
    directly: its x mask applies to their concatenation inside the kernel). Evaluated with
    ``train=False`` the values equal the plain BiLSTM's. Trained, values and gradients equal a
    pure-JAX BiLSTM given the masks, one pair per direction, layer and sequence; a direction
    without dropout (here layer 2's backward one) runs the same kernel with masks of ones."""
    pc = dx.ParameterCollection(seed=5)
    bi = dx.nn.BiRNNBuilder(2, IN, 2 * HID, pc, dx.nn.LSTMBuilder)
    bi.set_dropout(0.3)
    seqs = [[_rand(IN) for _ in range(n)] for n in (4, 3)]
    cg = dx.renew_cg(autobatch=strategy, train=False)
    outs = bi.transduce([dx.input(x) for x in seqs[0]])
    names = [s.op.name for s in cg.node_sig]
    assert names.count("concatenate") == len(seqs[0])  # transduce's only
    assert "dropout" not in names and not recorded_masks
    vals = [p.value for p in pc.parameters()]
    want = ref_birnn(ref_lstm, 2, 2, vals, seqs[0])
    np.testing.assert_allclose(np.stack([o.npvalue() for o in outs]), np.stack(want), **TOL)

    bi.builder_layers[1][1].disable_dropout()
    weights = [_rand(2 * HID) for _ in range(7)]
    cg = dx.renew_cg(autobatch=strategy, seed=4)
    outs = _flat(bi.transduce([dx.input(x) for x in xs]) for xs in seqs)
    names = [s.op.name for s in cg.node_sig]
    assert names.count("bidirectional_split_lstm_cell_dropout") == 7
    assert names.count("concatenate") == 7
    _dot_loss(outs, weights).backward()
    assert len(recorded_masks) == 2 * 2 * 2 * len(seqs)  # (x, h) x directions x layers
    masks = [m.npvalue() for _, m in recorded_masks]
    for rate, m in recorded_masks:
        _check_mask(rate, m)
    rates = [r for r, _ in recorded_masks]
    assert rates[4:8] == [0.3, 0.3, 0.0, 0.0]  # layer 2: forward, then backward (ones)

    def ref_outs(vals):
        outs = []
        for n, xs in enumerate(seqs):
            for layer in range(2):
                m = masks[8 * n + 4 * layer:][:4]  # forward (x, h), backward (x, h)
                v = vals[6 * layer:6 * layer + 6]
                zero = (jnp.zeros(HID),) * 2

                def cell(direction):
                    return lambda x, st, *params: ref_dropout_cell(
                        dx.nn.LSTMBuilder, x, st, params, *m[2 * direction:][:2])
                f = ref_transduce(cell(0), v[:3], 1, xs, [zero])
                b = ref_transduce(cell(1), v[3:], 1, xs[::-1], [zero])[::-1]
                xs = [jnp.concatenate([fo, bo]) for fo, bo in zip(f, b)]
            outs += xs
        return outs

    def ref_loss(vals):
        return sum(jnp.dot(o, w) for o, w in zip(ref_outs(vals), weights))

    for p in pc.parameters():  # keyed per strategy: each run has its own collection
        assert np.abs(np.asarray(p.grad)).sum() > 0
    _check(f"birnn-dropout-{strategy}", outs, pc.parameters(), ref_outs, ref_loss)


def test_birnn_one_node_per_position_and_layer():
    """Both directions' steps at a position are one node: a 2-layer BiRNN over n inputs adds
    n paired nodes per layer, not 2n; layer 2 reads layer 1's two halves directly (the
    concatenation is inside its kernel), so only transduce's outputs are concatenations."""
    n = 5
    cg = dx.renew_cg()
    xs = [dx.input(_rand(IN)) for _ in range(n)]
    before = len(cg.node_sig)
    BI.transduce(xs)
    names = [s.op.name for s in cg.node_sig[before:]]
    paired = [m for m in names if m.startswith("bidirectional")]
    assert len(paired) == 2 * n, names  # n per layer
    assert sum(m.startswith("bidirectional_split") for m in names) == n, names  # layer 2
    assert len(names) == 2 * n + n, names  # + transduce's n concatenations


def test_initial_states_share_the_graph_s_zero_vector_until_a_rollback_removes_it():
    """Every sequence's zero initial state is one constant per graph and size (the char
    tagger starts ~600 sequences per update); a failed construction that made it takes it
    away, and the next initial state makes it again."""
    cg = dx.renew_cg()
    pc = dx.ParameterCollection(seed=3)
    lstm = dx.nn.LSTMBuilder(2, IN, HID, pc)
    first = lstm.initial_state()
    consts = sum(1 for n in cg.val_node if n == -1)
    zero = first.s()[0]
    for _ in range(5):
        s = lstm.initial_state()
        assert [e.v for e in s.s()] == [zero.v] * 4  # c and h of both layers
    assert sum(1 for n in cg.val_node if n == -1) == consts
    np.testing.assert_array_equal(zero.npvalue(), np.zeros(HID, np.float32))

    from dynax.ops.core import atomic  # a composite construction: all or nothing

    @atomic
    def start_then_fail():
        lstm.initial_state()
        raise ValueError("after the initial state")

    cg = dx.renew_cg()
    with pytest.raises(ValueError):
        start_then_fail()
    assert len(cg.val_node) == 0  # the zero vector went with the failed construction
    x = dx.input(_rand(IN))
    state = lstm.initial_state().add_input(x)
    assert all(cg.val_node[e.v] == -1 for e in lstm.initial_state().s())
    np.testing.assert_allclose(state.output().npvalue(),
                               lstm.initial_state(vecs=[dx.zeros((HID,))] * 4)
                               .add_input(x).output().npvalue(), rtol=1e-6)


class _ScaledRNN(dx.nn.SimpleRNNBuilder):
    """A builder with its own step: BiRNNBuilder must run its directions separately."""

    def _step(self, params, x, state, masks=None):
        return super()._step(params, 0.5 * x, state, masks)


@pytest.mark.parametrize("strategy", ("none", "agenda"))
def test_birnn_with_a_custom_step(strategy):
    pc = dx.ParameterCollection(seed=4)
    bi = dx.nn.BiRNNBuilder(1, IN, 2 * HID, pc, _ScaledRNN)
    xs = [_rand(IN) for _ in range(4)]
    dx.renew_cg(autobatch=strategy)
    outs = bi.transduce([dx.input(x) for x in xs])
    want = ref_birnn(ref_rnn, 1, 1, [p.value for p in pc.parameters()], [0.5 * x for x in xs])
    np.testing.assert_allclose(np.stack([o.npvalue() for o in outs]), np.stack(want), **TOL)


@pytest.mark.parametrize("strategy", ("none", "agenda"))
def test_birnn_of_two_layers_with_a_custom_step(strategy):
    """Layer 2 of builders with their own step reads the concatenated outputs below (a
    concatenation node per position), through the builder's step."""
    pc = dx.ParameterCollection(seed=4)
    bi = dx.nn.BiRNNBuilder(2, IN, 2 * HID, pc, _ScaledRNN)
    xs = [_rand(IN) for _ in range(4)]
    cg = dx.renew_cg(autobatch=strategy)
    outs = bi.transduce([dx.input(x) for x in xs])
    names = [s.op.name for s in cg.node_sig]
    assert names.count("concatenate") == 2 * len(xs)  # between the layers, and transduce's
    assert not any(m.startswith("bidirectional") for m in names)

    def scaled(x, state, *params):
        return ref_rnn(0.5 * x, state, *params)

    want = ref_birnn(scaled, 1, 2, [p.value for p in pc.parameters()], xs)
    np.testing.assert_allclose(np.stack([o.npvalue() for o in outs]), np.stack(want), **TOL)


def test_birnn_disable_dropout_stops_it_in_both_directions_of_every_layer():
    pc = dx.ParameterCollection(seed=6)
    bi = dx.nn.BiRNNBuilder(2, IN, 2 * HID, pc, dx.nn.SimpleRNNBuilder)
    xs = [_rand(IN) for _ in range(3)]

    def run(seed=2):
        cg = dx.renew_cg(seed=seed)
        outs = [o.npvalue() for o in bi.transduce([dx.input(x) for x in xs])]
        return np.stack(outs), [s.op.name for s in cg.node_sig]

    plain, _ = run()
    bi.set_dropout(0.5)
    dropped, names = run()
    assert "dropout" in names and not np.allclose(dropped, plain)
    bi.disable_dropout()
    assert all(b.dropout_rate == b.dropout_rate_h == 0.0 for pair in bi.builder_layers
               for b in pair)
    again, names = run()
    assert "dropout" not in names
    np.testing.assert_allclose(again, plain, **TOL)


@pytest.mark.parametrize("strategy", ("none", "agenda"))
def test_birnn_of_coupled_lstms(strategy):
    """Two layers of CoupledLSTMBuilder (five weights a direction) in the one-node-per-
    position path: values and gradients against the reference."""
    pc = dx.ParameterCollection(seed=5)
    bi = dx.BiRNNBuilder(2, IN, 2 * HID, pc, dx.CoupledLSTMBuilder)
    rng = np.random.default_rng(12)  # the same data under every strategy
    xs = [rng.standard_normal(IN, np.float32) for _ in range(4)]
    ws = [rng.standard_normal(2 * HID, np.float32) for _ in range(4)]
    cg = dx.renew_cg(autobatch=strategy)
    outs = bi.transduce([dx.input(x) for x in xs])
    _dot_loss(outs, ws).backward()
    assert cg.stats()["nodes"] - 3 * len(xs) <= 2 * len(xs) + 2  # a node per position and layer
    params = pc.parameters()

    def ref_outs(vals):
        return ref_birnn(ref_coupled, 2, 2, vals, xs)

    def ref_loss(vals):
        return sum(jnp.dot(o, w) for o, w in zip(ref_outs(vals), ws))

    _check("birnn-coupled", outs, params, ref_outs, ref_loss)


# ---- tree-LSTMs ----------------------------------------------------------------------------------

TREE = dx.nn.TreeLSTMBuilder(IN, HID, PC)
CHILD_SUM = dx.nn.ChildSumTreeLSTMBuilder(IN, HID, PC)


def _random_binary_tree(rng, n_leaves):
    """A nested tuple over leaf indices 0..n-1 (leaves are ints)."""
    nodes = list(range(n_leaves))
    while len(nodes) > 1:
        i = int(rng.integers(len(nodes) - 1))
        nodes[i:i + 2] = [(nodes[i], nodes[i + 1])]
    return nodes[0]


def _binary_tree(t, leaf_expr):
    if isinstance(t, int):
        return TREE.leaf(leaf_expr[t])
    return TREE.compose(_binary_tree(t[0], leaf_expr), _binary_tree(t[1], leaf_expr))


def _tree_loss(roots, weights):
    return _dot_loss(_flat(roots), weights)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tree_lstm(strategy):
    params = TREE.pc.parameters()
    rng = np.random.default_rng(3)
    sizes = (1, 2, 5, 7, 4)
    trees = [_random_binary_tree(rng, n) for n in sizes]
    xs = [[rng.standard_normal(IN, np.float32) for _ in range(n)] for n in sizes]
    weights = [rng.standard_normal(HID, np.float32) for _ in range(2 * len(sizes))]
    _zero_grads()
    cg = dx.renew_cg(autobatch=strategy)
    roots = [_binary_tree(t, [dx.input(x) for x in x_]) for t, x_ in zip(trees, xs)]
    _tree_loss(roots, weights).backward()

    def ref_roots(vals):
        return _flat(ref_binary_tree(vals, t, x_) for t, x_ in zip(trees, xs))

    def ref_loss(vals):  # <h, w> + <c, w'> at every root
        return sum(jnp.dot(a, w) for a, w in zip(ref_roots(vals), weights))

    _check("tree", _flat(roots), params, ref_roots, ref_loss)
    _check_batches(cg, strategy, 3)
    if strategy == "agenda":  # leaves in one batch, then one per tree level
        names = [s.op.name for s in cg.node_sig]
        n_cells = names.count("_leaf_cell") + names.count("_compose_cell")
        assert n_cells == sum(2 * n - 1 for n in sizes)
        assert cg.stats()["batches"] <= 1 + 6 + 3, cg.stats()  # leaves, levels, loss
    with pytest.raises(ValueError):
        TREE.compose(roots[0], (roots[1][0],))
    with pytest.raises(ValueError):
        TREE.leaf(dx.input(np.zeros(IN + 1)))


def _random_child_sum_tree(rng, depth, counts):
    """A node is (x_index, children); child counts are taken from ``counts`` (then 0..2)."""
    k = 0 if depth == 0 else counts.pop() if counts else int(rng.integers(0, 3))
    return int(rng.integers(10)), [_random_child_sum_tree(rng, depth - 1, counts)
                                   for _ in range(k)]


def _child_sum_tree(t, xs):
    return CHILD_SUM.node(xs[t[0]], [_child_sum_tree(c, xs) for c in t[1]])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_child_sum_tree_lstm(strategy):
    params = CHILD_SUM.pc.parameters()
    rng = np.random.default_rng(4)
    xs_np = [rng.standard_normal(IN, np.float32) for _ in range(10)]
    trees = [_random_child_sum_tree(rng, 2, [0, 1, 2, 3, 4, 5]),
             _random_child_sum_tree(rng, 3, [3]), _random_child_sum_tree(rng, 0, []),
             _random_child_sum_tree(rng, 1, [5])]
    weights = [rng.standard_normal(HID, np.float32) for _ in range(2 * len(trees))]
    _zero_grads()
    cg = dx.renew_cg(autobatch=strategy)
    xs = [dx.input(x) for x in xs_np]
    roots = [_child_sum_tree(t, xs) for t in trees]
    _tree_loss(roots, weights).backward()

    def ref_roots(vals):
        return _flat(ref_child_sum_tree(vals, t, xs_np) for t in trees)

    def ref_loss(vals):
        return sum(jnp.dot(a, w) for a, w in zip(ref_roots(vals), weights))

    _check("child_sum", _flat(roots), params, ref_roots, ref_loss)
    _check_batches(cg, strategy, 2)
    names = [s.op.name for s in cg.node_sig]
    counts = {len(t[1]) for t in [trees[0]] + trees[0][1]}
    assert counts >= {0, 1, 2, 3, 4, 5}  # every child count from 0 to 5 occurs
    if strategy == "agenda":  # cells of one tree level share a kernel whatever their arity
        n_cells, n_forget = names.count("_child_sum_cell"), names.count("_child_forget")
        assert cg.stats()["batches"] < (n_cells + n_forget) / 2, cg.stats()


def test_child_sum_without_input():
    dx.renew_cg()
    h, c = CHILD_SUM.node(None, [CHILD_SUM.node(dx.input(np.ones(IN)))])
    assert h.shape == c.shape == (HID,)
    assert np.isfinite(h.npvalue()).all()


# ---- softmaxes ----------------------------------------------------------------------------------

VOCAB = 9
WORD_TO_CLASS = [0, 1, 0, 2, 1, 0, 3, 1, 0]  # class sizes 4, 3, 1, 1
SOFT = dx.nn.StandardSoftmaxBuilder(HID, VOCAB, PC)
CLASS_SOFT = dx.nn.ClassFactoredSoftmaxBuilder(HID, WORD_TO_CLASS, PC)
SOFT_NO_BIAS = dx.nn.StandardSoftmaxBuilder(HID, VOCAB, PC, bias=False)
CLASS_SOFT_NO_BIAS = dx.nn.ClassFactoredSoftmaxBuilder(HID, WORD_TO_CLASS, PC, False)


def _biased(vals, bias):
    """(weights, biases) of a softmax builder's parameter list; zero biases without any."""
    if bias:
        return vals[::2], vals[1::2]
    return vals, [0.0] * len(vals)


def ref_standard(vals, h, bias=True):
    (W,), (b,) = _biased(vals, bias)
    return jax.nn.log_softmax(W @ h + b)


def ref_class_factored(vals, h, bias=True):
    (Wc, *Rs), (bc, *bs) = _biased(vals, bias)
    log_pc = jax.nn.log_softmax(Wc @ h + bc)
    word_logps = {}  # class -> log p(w | class, h) for the words of the class, in word order
    for k, R, b in zip((0, 1), Rs, bs):  # classes 2 and 3 have one word
        word_logps[k] = jax.nn.log_softmax(R @ h + b)
    out = []
    for w, k in enumerate(WORD_TO_CLASS):
        pos = WORD_TO_CLASS[:w].count(k)
        out.append(log_pc[k] + (word_logps[k][pos] if k in word_logps else 0.0))
    return jnp.stack(out)


def _no_bias(ref):
    return lambda vals, h: ref(vals, h, bias=False)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("builder,ref", [
    (SOFT, ref_standard), (CLASS_SOFT, ref_class_factored),
    (SOFT_NO_BIAS, _no_bias(ref_standard)), (CLASS_SOFT_NO_BIAS, _no_bias(ref_class_factored))],
    ids=["standard", "class_factored", "standard_no_bias", "class_factored_no_bias"])
def test_softmax(builder, ref, strategy):
    params = builder.pc.parameters()
    rng = np.random.default_rng(5)
    hs = [rng.standard_normal(HID, np.float32) for _ in range(12)]
    labels = list(range(VOCAB)) + [int(w) for w in rng.integers(VOCAB, size=3)]
    _zero_grads()
    cg = dx.renew_cg(autobatch=strategy)
    h_exprs = [dx.input(h) for h in hs]
    losses = [builder.neg_log_softmax(h, y) for h, y in zip(h_exprs, labels)]
    dists = [builder.full_log_distribution(h) for h in h_exprs[:3]]
    assert all(d.shape == (VOCAB,) for d in dists) and losses[0].shape == ()
    # the loss goes through both neg_log_softmax and full_log_distribution
    loss = dx.esum(losses) - dx.esum([dx.pick(d, y) for d, y in zip(dists, labels[3:])])
    loss.backward()

    def ref_loss(vals):
        nll = sum(-ref(vals, h)[y] for h, y in zip(hs, labels))
        return nll - sum(ref(vals, h)[y] for h, y in zip(hs[:3], labels[3:]))

    def ref_outs(vals):
        return [-ref(vals, h)[y] for h, y in zip(hs, labels)] + [ref(vals, h) for h in hs[:3]]

    _check(builder, losses + dists, params, ref_outs, ref_loss)
    for d in dists:
        np.testing.assert_allclose(np.exp(d.npvalue()).sum(), 1.0, rtol=1e-5)
    _check_batches(cg, strategy, 3)
    with pytest.raises(ValueError):
        builder.neg_log_softmax(h_exprs[0], VOCAB)
    with pytest.raises(ValueError):
        builder.neg_log_softmax(dx.input(np.zeros(HID + 1)), 0)


def test_class_factored_layout_and_errors():
    assert CLASS_SOFT.class_sizes == [4, 3, 1, 1]
    assert [p.shape for p in CLASS_SOFT.pc.parameters()] == [
        (4, HID), (4,), (4, HID), (4,), (3, HID), (3,)]
    assert [p.shape for p in CLASS_SOFT_NO_BIAS.pc.parameters()] == [(4, HID), (4, HID), (3, HID)]
    assert [p.shape for p in SOFT_NO_BIAS.pc.parameters()] == [(VOCAB, HID)]
    with pytest.raises(ValueError, match="class 1 has no word"):
        dx.nn.ClassFactoredSoftmaxBuilder(HID, [0, 2, 2], PC)
    with pytest.raises(ValueError):
        dx.nn.ClassFactoredSoftmaxBuilder(HID, [], PC)
    dx.renew_cg()
    lc = CLASS_SOFT.class_log_distribution(dx.input(np.ones(HID)))
    np.testing.assert_allclose(np.exp(lc.npvalue()).sum(), 1.0, rtol=1e-5)


def test_class_factored_refuses_bad_arguments_and_adds_nothing(tmp_path):
    pc = dx.ParameterCollection(seed=0)
    cls = dx.nn.ClassFactoredSoftmaxBuilder
    path = tmp_path / "clusters.txt"
    path.write_text("1 the\n2 cat\n")
    cases = [
        (TypeError, r"missing pc; the arguments are \(input_dim, word_to_class, pc\[, bias\]\)",
         lambda: cls(HID, [0, 1])),
        (TypeError, "pc given both by position and by name", lambda: cls(HID, [0, 1], pc, pc=pc)),
        (TypeError, "bias given both by position and by name",
         lambda: cls(HID, [0, 1], pc, False, bias=True)),
        (TypeError, "word_dict= goes with a cluster file",
         lambda: cls(HID, [0, 1], pc, word_dict={"a": 0})),
        (TypeError, r"the arguments are \(input_dim, word_to_class, pc\[, bias\]\); got 5",
         lambda: cls(HID, [0, 1], pc, True, "extra")),
        (ValueError, "class of word 1 must be a non-negative int, got -1",
         lambda: cls(HID, [0, -1, 0], pc)),
        (ValueError, "class of word 0 must be a non-negative int, got 1.0",
         lambda: cls(HID, [1.0, 0], pc)),
        (ValueError, "class of word 1 must be a non-negative int, got True",
         lambda: cls(HID, [0, True], pc)),
        (TypeError, "word_dict must map each word to its id, got list",
         lambda: cls(HID, path, ["the", "cat"], pc)),
        (ValueError, r"word_dict's ids must be 0..1, each once",
         lambda: cls(HID, path, {"the": 0, "cat": 2}, pc)),
        (ValueError, r"word_dict's ids must be 0..1, each once",
         lambda: cls(HID, path, {"the": 1, "cat": 1}, pc)),
        (ValueError, "word_dict is empty", lambda: cls(HID, path, {}, pc)),
        (TypeError, "word_dict's ids must be ints, got 'x'",
         lambda: cls(HID, path, {"the": 0, "cat": "x"}, pc)),
    ]
    for error, match, make in cases:
        with pytest.raises(error, match=f"ClassFactoredSoftmaxBuilder: {match}"):
            make()
    assert pc.parameters() == []


@pytest.mark.parametrize("strategy", ["none", "agenda"])
def test_parameters_as_builder_inputs(strategy):
    """A Parameter joins a graph by itself (API.md), builders included: a learned initial
    state, a learned start input, a learned leaf vector. It computes what ``dx.parameter(p)``
    computes, and its gradient reaches ``p.grad``."""
    pc = dx.ParameterCollection(seed=0)
    lstm = dx.nn.LSTMBuilder(1, 3, 4, pc)
    bi = dx.nn.BiRNNBuilder(1, 3, 4, pc, dx.nn.LSTMBuilder)
    tree = dx.nn.TreeLSTMBuilder(3, 4, pc)
    soft = dx.nn.StandardSoftmaxBuilder(4, 6, pc)
    start = pc.add_parameters((3,), init="normal", name="start")
    c0 = pc.add_parameters((4,), init="normal", name="c0")
    h0 = pc.add_parameters((4,), init="normal", name="h0")

    def loss(wrap):
        s = lstm.initial_state([wrap(c0), wrap(h0)]).add_input(wrap(start))
        leaf_h, _ = tree.leaf(wrap(start))
        terms = [soft.neg_log_softmax(s.output(), 2), dx.sum_elems(leaf_h)]
        terms += [dx.sum_elems(h) for h in bi.transduce([wrap(start), dx.input(np.ones(3))])]
        terms.append(dx.sum_elems(soft.full_log_distribution(wrap(h0))))
        return dx.esum(terms)

    results = []
    for wrap in (lambda p: p, dx.parameter):
        dx.renew_cg(autobatch=strategy)
        value = loss(wrap)
        v = value.value()
        value.backward()
        results.append((v, [np.array(p.grad) for p in (start, c0, h0)]))
        for p in pc.parameters():
            p.zero_grad()
    (v1, g1), (v2, g2) = results
    assert v1 == pytest.approx(v2, rel=1e-6)
    for a, b in zip(g1, g2):
        assert np.abs(a).sum() > 0
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_stale_state_is_named_and_adds_nothing():
    """A state of a replaced graph, given a current input with dropout on: the error names
    the builder's call and the state, and the graph is unchanged (the layer's dropout node
    used to be left behind, and the error named the internal cell)."""
    lstm = dx.nn.LSTMBuilder(1, IN, HID, dx.ParameterCollection(seed=0))
    lstm.set_dropout(0.5)
    dx.renew_cg()
    old = lstm.initial_state()
    cg = dx.renew_cg()
    x = dx.input(_rand(IN))
    before = cg.stats()["nodes"], len(cg.val_node)
    with pytest.raises(dx.StaleExpressionError, match="LSTMBuilder.add_input: this state"):
        old.add_input(x)
    assert (cg.stats()["nodes"], len(cg.val_node)) == before


def test_state_vectors_are_lists_as_in_dynet():
    """``s.h() + [x]`` works as it does in DyNet (h() and s() return lists)."""
    dx.renew_cg()
    s = BUILDERS[dx.nn.LSTMBuilder].initial_state()
    x = dx.zeros((HID,))
    assert s.h() + [x] == [*s.h(), x] and isinstance(s.s(), list)


def test_a_builder_without_a_collection_is_a_clear_error():
    for make in (lambda: dx.nn.LSTMBuilder(1, IN, HID, None),
                 lambda: dx.nn.TreeLSTMBuilder(IN, HID, None),
                 lambda: dx.nn.StandardSoftmaxBuilder(HID, 3, None)):
        with pytest.raises(TypeError, match="ParameterCollection, got NoneType"):
            make()


@pytest.mark.parametrize("strategy", ("none", "agenda"))
@pytest.mark.parametrize("builder,ref", [(SOFT, ref_standard), (CLASS_SOFT, ref_class_factored),
                                         (SOFT_NO_BIAS, _no_bias(ref_standard))],
                         ids=["standard", "class_factored", "standard_no_bias"])
def test_softmax_without_update(builder, ref, strategy):
    """DyNet's ``update=False``: the same values, no gradient into the builder's weights,
    the gradient of ``h`` (here a parameter) as ``jax.grad`` gives it with the weights held
    constant; one no-gradient copy of each weight per graph."""
    pc = dx.ParameterCollection(seed=4)
    hs = [pc.add_parameters((HID,), init="normal") for _ in range(5)]
    labels = [0, 4, 6, 8, 4]
    _zero_grads()
    cg = dx.renew_cg(autobatch=strategy)
    losses = [builder.neg_log_softmax(h, y, update=False) for h, y in zip(hs, labels)]
    dists = [builder.full_log_distribution(h, update=False) for h in hs[:2]]
    loss = dx.esum(losses) - dx.esum([dx.pick(d, 3) for d in dists])
    loss.backward()
    n_weights = len(builder.pc.parameters())
    assert [sg.op.name for sg in cg.node_sig].count("nobackprop") == n_weights
    vals = [p.value for p in builder.pc.parameters()]

    def ref_loss(hv):
        return (sum(-ref(vals, h)[y] for h, y in zip(hv, labels))
                - sum(ref(vals, h)[3] for h in hv[:2]))

    hv = [h.value for h in hs]
    assert loss.value() == pytest.approx(float(ref_loss(hv)), rel=1e-5)
    for h, g in zip(hs, jax.grad(ref_loss)(hv)):
        np.testing.assert_allclose(h.grad, g, **TOL)
    assert not any(np.any(np.asarray(p.grad)) for p in builder.pc.parameters())
    for method in (builder.neg_log_softmax, builder.full_log_distribution):
        with pytest.raises(dx.ArgumentTypeError, match="update must be True or False"):
            method(hs[0], *([0] if method == builder.neg_log_softmax else []), update=1)


def test_class_factored_parts_and_logits():
    """DyNet's class_logits, subclass_logits, subclass_log_distribution and full_logits,
    against the reference's parts."""
    rng = np.random.default_rng(9)
    h = rng.standard_normal(HID, np.float32)
    Wc, bc, R0, b0, R1, b1 = [p.value for p in CLASS_SOFT.pc.parameters()]
    dx.renew_cg()
    e = dx.input(h)
    np.testing.assert_allclose(CLASS_SOFT.class_logits(e).npvalue(), Wc @ h + bc, **TOL)
    np.testing.assert_allclose(CLASS_SOFT.subclass_logits(e, 1).npvalue(), R1 @ h + b1, **TOL)
    np.testing.assert_allclose(CLASS_SOFT.subclass_log_distribution(e, 0).npvalue(),
                               jax.nn.log_softmax(R0 @ h + b0), **TOL)
    np.testing.assert_allclose(CLASS_SOFT.subclass_log_distribution(e, 3).npvalue(), [0.0])
    np.testing.assert_allclose(CLASS_SOFT.full_logits(e).npvalue(),
                               ref_class_factored([p.value for p in CLASS_SOFT.pc.parameters()],
                                                  h), **TOL)
    np.testing.assert_allclose(SOFT_NO_BIAS.full_logits(e).npvalue(),
                               SOFT_NO_BIAS.W.value @ h, **TOL)
    with pytest.raises(dx.IndexOutOfRangeError, match=r"class 4 out of range \[0, 4\)"):
        CLASS_SOFT.subclass_logits(e, 4)
    with pytest.raises(dx.ArgumentTypeError, match="class must be an integer"):
        CLASS_SOFT.subclass_logits(e, 1.5)


def test_class_factored_reads_a_dynet_cluster_file(tmp_path):
    """DyNet's form, ``(rep_dim, cluster_file, word_dict, pc, bias)``: classes numbered in
    order of first appearance, fields after the word ignored, words outside the dictionary
    skipped; a word left without a class, a word in two classes or a short line is an
    error naming it."""
    path = tmp_path / "clusters.txt"
    path.write_text("0110\tthe\t52\n0110 a\n\n10 dog\n10\tcat\t3\n10 zebra\n111 ran\n")
    words = {"the": 0, "cat": 1, "ran": 2, "a": 3, "dog": 4}
    pc = dx.ParameterCollection(seed=0)
    cf = dx.ClassFactoredSoftmaxBuilder(HID, str(path), words, pc, False)
    assert cf.word_to_class == [0, 1, 2, 0, 1] and cf.class_names == ["0110", "10", "111"]
    assert cf.bc is None and cf.class_sizes == [2, 2, 1]
    dx.renew_cg()
    d = cf.full_log_distribution(dx.input(np.ones(HID)))
    np.testing.assert_allclose(np.exp(d.npvalue()).sum(), 1.0, rtol=1e-5)
    with pytest.raises(ValueError, match=r"1 word\(s\) of word_dict have no class .*'owl'"):
        dx.ClassFactoredSoftmaxBuilder(HID, path, {**words, "owl": 5}, pc)
    path.write_text("1 the\n2 the\n")
    with pytest.raises(ValueError, match="line 2: word 'the' is already in a class"):
        dx.ClassFactoredSoftmaxBuilder(HID, path, {"the": 0}, pc)
    path.write_text("1 the\nlonely\n")
    with pytest.raises(ValueError, match="line 2: expected 'class word', got 'lonely'"):
        dx.ClassFactoredSoftmaxBuilder(HID, path, {"the": 0}, pc)
    with pytest.raises(TypeError, match=r"\(input_dim, cluster_file, word_dict, pc\[, bias\]\)"):
        dx.ClassFactoredSoftmaxBuilder(HID, path, pc)


def test_class_factored_takes_its_arguments_by_name_as_its_docstring_names_them(tmp_path):
    """``pc=``, ``word_dict=`` and ``bias=`` by name build the same builder as by position
    (same parameters, same distribution)."""
    path = tmp_path / "clusters.txt"
    path.write_text("1 the\n1 a\n2 cat\n")
    words = {"the": 0, "cat": 1, "a": 2}
    built = []
    for make in (lambda pc: dx.ClassFactoredSoftmaxBuilder(HID, path, words, pc, False),
                 lambda pc: dx.ClassFactoredSoftmaxBuilder(HID, path, word_dict=words, pc=pc,
                                                           bias=False),
                 lambda pc: dx.ClassFactoredSoftmaxBuilder(HID, [0, 1, 0], pc=pc, bias=False)):
        pc = dx.ParameterCollection(seed=0)
        cf = make(pc)
        dx.renew_cg()
        built.append(([p.name for p in pc.parameters()],
                      cf.full_log_distribution(dx.input(np.ones(HID))).npvalue()))
    for names, dist in built[1:]:
        assert names == built[0][0]
        np.testing.assert_array_equal(dist, built[0][1])


def test_class_factored_takes_a_mapping_and_labels_as_other_ops_do():
    """``word_to_class`` as DyNet users write it, ``{word: class}``, means what the list
    does (it was read as its keys: a wrong model, silently); labels are checked as
    ``pickneglogsoftmax`` checks them: NumPy and 0-d integers in, bools and floats out."""
    pc = dx.ParameterCollection(seed=0)
    as_dict = dx.nn.ClassFactoredSoftmaxBuilder(HID, {0: 1, 1: 0, 2: 1}, pc)
    assert as_dict.word_to_class == [1, 0, 1] and as_dict.class_sizes == [1, 2]
    with pytest.raises(ValueError, match="keys must be the word ids 0..2; 1 is missing"):
        dx.nn.ClassFactoredSoftmaxBuilder(HID, {0: 0, 2: 0, 3: 0}, pc)
    dx.renew_cg()
    h = dx.input(_rand(HID))
    want = as_dict.neg_log_softmax(h, 2).scalar_value()
    for label in (np.int64(2), np.array(2), jnp.int32(2)):
        assert as_dict.neg_log_softmax(h, label).scalar_value() == pytest.approx(want)
    for bad in (True, 1.0, "1"):
        with pytest.raises(IndexError, match="label must be an integer"):
            as_dict.neg_log_softmax(h, bad)


@pytest.mark.parametrize("builder", [SOFT, CLASS_SOFT], ids=["standard", "class_factored"])
def test_softmax_sample_follows_the_distribution(builder):
    """``sample(h)`` draws words with the model's probabilities (Gumbel-max with the graph's
    seeded noise: a fixed seed gives the same draws, another seed other draws). ``h`` is
    drawn from a generator of its own: from the module's, it depended on which tests ran
    before in the worker, and some orders made a distribution so peaked that two seeds
    drew the same 600 words."""
    h = 3.0 * np.random.default_rng(7).standard_normal(HID).astype(np.float32)
    n = 600

    def draws(seed):
        cg = dx.renew_cg(seed=seed)
        p = np.exp(builder.full_log_distribution(dx.input(h)).npvalue())
        return p, [builder.sample(dx.input(h)) for _ in range(n)], cg

    p, got, cg = draws(1)
    assert p.max() < 0.9, p  # other seeds draw other words
    assert all(isinstance(w, int) for w in got)
    freq = np.bincount(got, minlength=VOCAB) / n
    np.testing.assert_allclose(freq, p, atol=0.06)  # 3.3 standard errors at p = 0.5
    assert draws(1)[1] == got and draws(2)[1] != got


@pytest.mark.parametrize("bad", [lambda: 3, lambda: None, lambda: "h",
                                 lambda: np.ones(HID, np.float32),  # one vector, not a list
                                 lambda: dx.input(np.ones(HID, np.float32))])
def test_set_h_takes_a_list(bad):
    dx.renew_cg()
    s = BUILDERS[dx.nn.GRUBuilder].initial_state()
    with pytest.raises(dx.ArgumentTypeError,
                       match="GRUBuilder state.set_h: expected a list of 1 vectors, got"):
        s.set_h(bad())
