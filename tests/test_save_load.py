"""``dx.save`` / ``dx.load``: round trips of collections and builders, and failure modes."""
import os
import stat

import numpy as np
import pytest

import dynax as dx

IN = HID = VOCAB = 4  # equal sizes: fewer distinct shapes to initialise and compile


class Model:
    """Embeddings, a 2-layer LSTM, a BiRNN, a Tree-LSTM and two softmaxes in one collection."""

    def __init__(self, seed, pc=None):
        self.pc = dx.ParameterCollection(seed=seed) if pc is None else pc
        self.E = self.pc.add_lookup_parameters((VOCAB, IN), name="E")
        self.lstm = dx.nn.LSTMBuilder(2, IN, HID, self.pc)
        self.bi = dx.nn.BiRNNBuilder(1, IN, HID, self.pc, dx.nn.LSTMBuilder)
        self.tree = dx.nn.TreeLSTMBuilder(IN, HID, self.pc)
        self.sm = dx.nn.StandardSoftmaxBuilder(HID, VOCAB, self.pc)
        self.cfsm = dx.nn.ClassFactoredSoftmaxBuilder(HID, [0, 0, 1, 1], self.pc)

    def builders(self):
        return [self.lstm, self.bi, self.tree, self.sm, self.cfsm]

    def loss(self, words):
        xs = [self.E[w] for w in words]
        hs = self.lstm.initial_state().transduce(xs)
        losses = [self.sm.neg_log_softmax(h, w) for h, w in zip(hs[:-1], words[1:])]
        losses += [self.cfsm.neg_log_softmax(h, w) for h, w in zip(self.bi.transduce(xs), words)]
        (hl, cl), (hr, cr) = self.tree.leaf(xs[0]), self.tree.leaf(xs[1])
        h, _ = self.tree.compose((hl, cl), (hr, cr))
        losses.append(self.sm.neg_log_softmax(h, words[2]))
        return dx.esum(losses)


def values(params):
    return {p.name: np.array(p.value) for p in params}


def assert_same(got, want):
    assert list(got) == list(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def scramble(params):
    """Shift every value (constant-initialised biases too) so that a load has work to do."""
    for p in params:
        p.set_value(np.asarray(p.value) + 0.5)


def test_collection_round_trip_is_bit_exact(tmp_path):
    a, b = Model(0), Model(1)
    scramble(b.pc.parameters())
    want = values(a.pc.parameters())
    for k, v in values(b.pc.parameters()).items():
        assert not np.array_equal(v, want[k]), k
    path = tmp_path / "m.npz"
    dx.save(path, [a.pc])
    assert dx.load(path, b.pc) is b.pc
    assert_same(values(b.pc.parameters()), want)


def test_builders_round_trip_into_a_list(tmp_path):
    a = Model(0)
    # the new builders live elsewhere: in a subcollection of a collection with another seed
    b = Model(1, dx.ParameterCollection(seed=1).add_subcollection("restored"))
    scramble(b.pc.parameters())
    path = tmp_path / "m.npz"
    dx.save(path, a.builders())
    E_before = np.array(b.E.value)
    loaded = dx.load(path, b.builders())
    assert loaded == b.builders()
    for ba, bb in zip(a.builders(), b.builders()):
        pa, pb = ba.param_collection().parameters(), bb.param_collection().parameters()
        assert len(pa) == len(pb) > 0
        for p, q in zip(pa, pb):
            np.testing.assert_array_equal(np.asarray(q.value), np.asarray(p.value), err_msg=q.name)
    np.testing.assert_array_equal(np.asarray(b.E.value), E_before)  # not saved: untouched


def test_builders_saved_load_into_collection_by_name(tmp_path):
    a, b = Model(0), Model(1)
    scramble(b.pc.parameters())
    path = tmp_path / "m.npz"
    dx.save(path, [a.lstm, a.sm, a.E])
    E_a = np.array(a.E.value)
    tree_before = values(b.tree.param_collection().parameters())
    dx.load(path, b.pc)
    for x, y in [(a.lstm, b.lstm), (a.sm, b.sm)]:
        assert_same(values(y.param_collection().parameters()),
                    values(x.param_collection().parameters()))
    np.testing.assert_array_equal(np.asarray(b.E.value), E_a)
    assert_same(values(b.tree.param_collection().parameters()), tree_before)


def test_files_interoperate_with_pc_save_and_populate(tmp_path):
    a, b, c = Model(0), Model(1), Model(2)
    scramble(b.pc.parameters() + c.pc.parameters())
    dx.save(tmp_path / "dx.npz", [a.pc])
    a.pc.save(tmp_path / "pc.npz")
    c.pc.populate(tmp_path / "dx.npz")
    dx.load(tmp_path / "pc.npz", b.pc)
    want = values(a.pc.parameters())
    assert_same(values(b.pc.parameters()), want)
    assert_same(values(c.pc.parameters()), want)


def test_subcollection_loads_into_a_subcollection_of_another_name(tmp_path):
    a, b = dx.ParameterCollection(seed=0), dx.ParameterCollection(seed=1)
    W = a.add_subcollection("enc").add_parameters((HID, HID), name="W")
    other = b.add_parameters((HID, HID), name="other")
    enc2 = b.add_subcollection("encoder")
    W2 = enc2.add_parameters((HID, HID), name="W")
    other_before = np.array(other.value)
    path = tmp_path / "enc.npz"
    dx.save(path, [a.add_subcollection("enc")])
    dx.load(path, enc2)
    np.testing.assert_array_equal(np.asarray(W2.value), np.asarray(W.value))
    np.testing.assert_array_equal(np.asarray(other.value), other_before)
    W2.set_value(np.zeros((HID, HID)))
    enc2.populate(path)
    np.testing.assert_array_equal(np.asarray(W2.value), np.asarray(W.value))


@pytest.mark.parametrize("save", ["pc.save", "dx.save"])
def test_a_subcollection_populates_from_a_whole_models_file(tmp_path, save):
    """``enc.populate(path)`` after ``pc.save(path)`` (or ``dx.save(path, [pc])``) reads the
    file's ``enc/...`` entries, as the README says; ``dx.load`` into the sub-collection
    refuses the file's other entries and changes nothing."""
    a, b = dx.ParameterCollection(seed=0), dx.ParameterCollection(seed=1)
    for pc in (a, b):
        enc = pc.add_subcollection("enc")
        enc.add_parameters((HID, HID), name="W")
        enc.add_lookup_parameters((VOCAB, IN), name="E")
        pc.add_parameters((HID,), name="top")
    path = tmp_path / "whole.npz"
    a.save(path) if save == "pc.save" else dx.save(path, [a])
    top_before = np.array(b["top"].value)
    with pytest.raises(ValueError, match="holds parameter 'enc/enc/E' but the collection has "
                                         "no parameter of that name.*or use populate, which "
                                         "ignores entries 'enc' lacks"):
        dx.load(path, b.add_subcollection("enc"))
    assert not np.array_equal(b["enc/W"].value, a["enc/W"].value)
    b.add_subcollection("enc").populate(path)
    for name in ("enc/W", "enc/E"):
        np.testing.assert_array_equal(np.asarray(b[name].value), np.asarray(a[name].value))
    np.testing.assert_array_equal(np.asarray(b["top"].value), top_before)


def test_populate_names_what_the_file_has_relative_to_the_collection(tmp_path):
    """A missing parameter's error lists the file's names relative to the sub-collection
    where they lie in it, and whole where they do not (no name cut off in the middle)."""
    a = dx.ParameterCollection(seed=0)
    lstm = dx.nn.LSTMBuilder(1, IN, HID, a)
    path = tmp_path / "lstm.npz"
    dx.save(path, [lstm])
    enc = dx.ParameterCollection(seed=1).add_subcollection("enc")
    enc.add_parameters((HID,), name="W")
    with pytest.raises(ValueError, match=r"has no parameter named 'W' \(it has \['lstm/"):
        enc.populate(path)


@pytest.mark.parametrize("case", ["fewer_layers", "shape", "count", "collection_missing"])
def test_mismatch_raises_and_changes_nothing(tmp_path, case):
    a = Model(0)
    path = tmp_path / "m.npz"
    dx.save(path, [a.sm, a.lstm])
    pc = dx.ParameterCollection(seed=5)
    sm = dx.nn.StandardSoftmaxBuilder(HID, VOCAB, pc)  # fits: staged before the failure
    if case == "fewer_layers":
        target, match = [sm, dx.nn.LSTMBuilder(1, IN, HID, pc)], "parameter 'W[xh]1'"
    elif case == "shape":
        target, match = [sm, dx.nn.LSTMBuilder(2, IN, HID + 2, pc)], r"Wx0.*\(24, 4\).*\(16, 4\)"
    elif case == "count":
        target, match = [sm], "2 object"
    else:  # a collection without the saved LSTM
        target, match = pc, "parameter 'lstm/W[xh]0'"
    before = values(pc.parameters())
    with pytest.raises(ValueError, match=match) as err:
        dx.load(path, target)
    assert "m.npz" in str(err.value)
    assert_same(values(pc.parameters()), before)


def test_truncated_or_corrupt_file_raises_and_changes_nothing(tmp_path):
    a, b = Model(0), Model(1)
    path = tmp_path / "m.npz"
    dx.save(path, a.builders())
    data = path.read_bytes()
    before = values(b.pc.parameters())
    for bad in (data[: len(data) // 2], data[:-40], b"not a zip file"):
        path.write_bytes(bad)
        with pytest.raises(ValueError, match="truncated or corrupt"):
            dx.load(path, b.builders())
    assert_same(values(b.pc.parameters()), before)
    with pytest.raises(FileNotFoundError):
        dx.load(tmp_path / "absent.npz", b.pc)


def test_a_plain_npy_file_is_refused_clearly_and_changes_nothing(tmp_path):
    """np.save's file holds one bare array: np.load returns it, not an archive."""
    b = Model(1)
    before = values(b.pc.parameters())
    path = tmp_path / "w.npy"
    np.save(path, np.ones((2, 2), np.float32))
    for call in (lambda: b.pc.populate(path), lambda: dx.load(path, b.pc)):
        with pytest.raises(ValueError, match=r"w\.npy is not a readable dynax parameter "
                                             r"file .*one ndarray \(np\.save's\)"):
            call()
    assert_same(values(b.pc.parameters()), before)


def test_failed_save_leaves_the_previous_file(tmp_path):
    a, b = Model(0), Model(1)
    path = tmp_path / "m.npz"
    dx.save(path, [a.pc])
    with pytest.raises(TypeError, match="str"):
        dx.save(path, [b.pc, "not a model"])
    dx.load(path, b.pc)
    assert_same(values(b.pc.parameters()), values(a.pc.parameters()))
    assert [f.name for f in tmp_path.iterdir()] == ["m.npz"]  # no temporary file left


@pytest.mark.parametrize("strategy", ["none", "agenda"])
def test_loaded_model_gives_identical_loss(tmp_path, strategy):
    a, b = Model(0), Model(1)
    words = [1, 3, 0, 2, 3]

    def loss(model):
        dx.renew_cg(autobatch=strategy)
        return model.loss(words).scalar_value()

    want = loss(a)
    assert loss(b) != want
    path = tmp_path / "m.npz"
    dx.save(path, [a.E] + a.builders())
    dx.load(path, [b.E] + b.builders())
    assert loss(b) == want


@pytest.mark.parametrize("name", ["file", "allow_pickle"])
def test_any_parameter_name_round_trips(tmp_path, name):
    """Names are file entries, never keyword arguments of a NumPy call (``np.savez(file,
    **arrays)`` failed on ``file`` and swallowed ``allow_pickle`` as its flag)."""
    pc = dx.ParameterCollection(seed=0)
    enc = pc.add_subcollection("enc")
    p = enc.add_parameters((2,), init=np.array([1.0, 2.0], np.float32), name=name)
    path = tmp_path / "m.npz"
    enc.save(path)
    assert sorted(np.load(path).files) == sorted(["__dynax_format__", name])
    p.set_value(np.zeros(2, np.float32))
    enc.populate(path)
    np.testing.assert_array_equal(p.value, [1.0, 2.0])


def test_a_reserved_parameter_name_is_refused_at_save(tmp_path):
    pc = dx.ParameterCollection(seed=0)
    pc.add_parameters((2,), name="__dynax_format__")
    path = tmp_path / "m.npz"
    with pytest.raises(ValueError, match="__dynax_format__.*reserved"):
        pc.save(path)
    assert not path.exists()


def test_save_keeps_the_files_mode_and_a_symlink(tmp_path):
    """A save replaces the file as ``open(path, 'w')`` would: the mode of the file it
    replaces (a new one: the umask's), and through a symlink (mkstemp's private 0600
    temporary and a replaced link were what users saw)."""
    pc = dx.ParameterCollection(seed=0)
    pc.add_parameters((2,), name="W")
    old_umask = os.umask(0o022)
    try:
        new = tmp_path / "new.npz"
        pc.save(new)
        assert stat.S_IMODE(os.stat(new).st_mode) == 0o644
        old = tmp_path / "old.npz"
        old.write_text("old")
        os.chmod(old, 0o640)
        pc.save(old)
        assert stat.S_IMODE(os.stat(old).st_mode) == 0o640
        link = tmp_path / "link.npz"
        link.symlink_to(old)
        pc.save(link)
        assert link.is_symlink() and os.path.samefile(link, old)
        pc.populate(old)
    finally:
        os.umask(old_umask)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux's /proc only")
def test_a_new_files_mode_comes_from_the_umask_without_changing_it(tmp_path, monkeypatch):
    """Where the OS reports the umask (Linux), a save reads it there: setting it to read it
    gave files that other threads created in that instant no umask."""
    pc = dx.ParameterCollection(seed=0)
    pc.add_parameters((2,), name="W")
    old_umask = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", lambda *a: pytest.fail("save changed the umask"))
        pc.save(tmp_path / "new.npz")
        monkeypatch.undo()
        assert stat.S_IMODE(os.stat(tmp_path / "new.npz").st_mode) == 0o640
    finally:
        os.umask(old_umask)


def test_without_proc_the_umask_is_read_by_setting_it_and_back(monkeypatch):
    from dynax.nn import persistence

    def no_proc(*args, **kwargs):
        raise FileNotFoundError("/proc/self/status")

    monkeypatch.setattr(persistence, "open", no_proc, raising=False)
    old_umask = os.umask(0o077)
    try:
        assert persistence._umask() == 0o077
        assert os.umask(0o077) == 0o077  # and it is set back
    finally:
        os.umask(old_umask)


@pytest.mark.parametrize("fault", [OSError(28, "No space left on device"), KeyboardInterrupt()],
                         ids=["disk_full", "interrupted"])
def test_a_save_failing_while_writing_leaves_the_previous_file(tmp_path, monkeypatch, fault):
    """An error (or Ctrl-C) while the new file is written: the temporary file is removed,
    the previous file is left as it was, and the error reaches the caller as it is."""
    a, b = Model(0), Model(1)
    path = tmp_path / "m.npz"
    dx.save(path, [a.pc])
    data = path.read_bytes()
    write, calls = np.lib.format.write_array, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # two members written, then the fault
            raise fault
        return write(*args, **kwargs)

    monkeypatch.setattr(np.lib.format, "write_array", failing)
    with pytest.raises(type(fault)):
        dx.save(path, [b.pc])
    assert len(calls) == 3
    monkeypatch.undo()
    assert [f.name for f in tmp_path.iterdir()] == ["m.npz"]
    assert path.read_bytes() == data
    dx.load(path, b.pc)
    assert_same(values(b.pc.parameters()), values(a.pc.parameters()))


@pytest.mark.parametrize("entries,match", [
    ({"__dynax_format__": np.asarray(2)}, "has format version 2, expected 1"),
    ({}, "has format version None, expected 1"),
    ({"__dynax_format__": np.asarray([1])}, r"has format version \[1\], expected 1"),
    ({"__dynax_format__": np.asarray(1), "__dynax_objects__": np.asarray([""])},
     "has a corrupt object manifest"),
    ({"__dynax_format__": np.asarray(1), "__dynax_objects__": np.asarray([""]),
      "__dynax_kinds__": np.asarray([1])}, "has a corrupt object manifest"),
    ({"__dynax_format__": np.asarray(1), "__dynax_objects__": np.asarray([""]),
      "__dynax_kinds__": np.asarray(["ParameterCollection"]), "3:V": np.zeros(2)},
     "holds an entry '3:V' that belongs to no saved object"),
    ({"__dynax_format__": np.asarray(1), "__dynax_objects__": np.asarray([""]),
      "__dynax_kinds__": np.asarray(["ParameterCollection"]), "V": np.zeros(2)},
     "holds an entry 'V' that belongs to no saved object"),
], ids=["version", "no_version", "version_not_scalar", "no_kinds", "kinds_not_str",
        "index_past_the_objects", "no_index"])
def test_files_of_another_format_are_refused_and_change_nothing(tmp_path, entries, match):
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((HID, IN), name="W")
    before = np.array(W.value)
    path = tmp_path / "m.npz"
    manifest = "__dynax_objects__" in entries
    np.savez(path, **{("0:W" if manifest else "W"): np.zeros((HID, IN)), **entries})
    for restore, who in [(pc.populate, "populate"), (lambda p: dx.load(p, pc), "load"),
                         (lambda p: dx.load(p, [pc]), "load")]:
        with pytest.raises(ValueError, match=f"{who}: .*m.npz {match}"):
            restore(path)
    np.testing.assert_array_equal(W.value, before)


def test_a_parameter_stored_as_text_is_refused_and_changes_nothing(tmp_path):
    pc = dx.ParameterCollection(seed=0)
    W = pc.add_parameters((2, 3), name="W")
    V = pc.add_parameters((2,), name="V")  # staged first: fits, and must stay as it was
    before = np.array(W.value), np.array(V.value)
    path = tmp_path / "m.npz"
    np.savez(path, __dynax_format__=np.asarray(1), V=np.ones(2),
                W=np.array([["a", "b", "c"]] * 2))
    for restore, who in [(pc.populate, "populate"), (lambda p: dx.load(p, pc), "load")]:
        with pytest.raises(ValueError, match=f"{who}: .*m.npz holds a <U1 array for "
                                             "parameter 'W'"):
            restore(path)
    np.testing.assert_array_equal(W.value, before[0])
    np.testing.assert_array_equal(V.value, before[1])


def test_save_takes_one_object_and_refuses_none(tmp_path):
    a, b = Model(0), Model(1)
    path = tmp_path / "m.npz"
    dx.save(path, a.pc)  # one object, not in a list: as [a.pc]
    z = np.load(path)
    assert list(z["__dynax_kinds__"]) == ["ParameterCollection"]
    assert len(z.files) == len(a.pc.parameters()) + 3
    dx.load(path, [b.pc])
    assert_same(values(b.pc.parameters()), values(a.pc.parameters()))
    empty = tmp_path / "empty.npz"
    for nothing in ([], ()):
        with pytest.raises(ValueError, match="save: no objects given"):
            dx.save(empty, nothing)
    for call in (lambda: dx.save(empty, [object()]), lambda: dx.load(path, [object()])):
        with pytest.raises(dx.ArgumentTypeError, match="cannot save or load a object; expected "
                                                       "a ParameterCollection"):
            call()  # a TypeError, and a ValueError as every construction error
    assert not empty.exists()


def test_a_target_with_a_parameter_the_saved_object_lacks_is_named(tmp_path):
    a = dx.ParameterCollection(seed=0)
    path = tmp_path / "lstm.npz"
    dx.save(path, [dx.nn.LSTMBuilder(1, IN, HID, a)])
    b = dx.ParameterCollection(seed=1)
    deeper = dx.nn.LSTMBuilder(2, IN, HID, b)
    before = values(b.parameters())
    with pytest.raises(ValueError, match=r"load: LSTMBuilder \(object 0\) has parameter "
                                         r"'lstm/Wh1' but the LSTMBuilder saved as object 0 "
                                         r"in .*lstm.npz has no 'Wh1'"):
        dx.load(path, [deeper])
    assert_same(values(b.parameters()), before)


def test_a_shape_mismatch_names_the_saved_and_the_given_kind(tmp_path):
    saved = dx.ParameterCollection(seed=0)
    saved.add_parameters((VOCAB + 1, HID), name="W")
    saved.add_parameters((VOCAB + 1,), name="b")
    path = tmp_path / "c.npz"
    dx.save(path, [saved])
    sm = dx.nn.StandardSoftmaxBuilder(HID, VOCAB, dx.ParameterCollection(seed=1))
    before = values(sm.pc.parameters())
    with pytest.raises(ValueError, match=r"parameter 'softmax/W' has shape \(4, 4\) but "
                                         r".*c.npz holds shape \(5, 4\) \(object 0 was saved "
                                         r"from a ParameterCollection but is loaded into a "
                                         r"StandardSoftmaxBuilder\)"):
        dx.load(path, [sm])
    assert_same(values(sm.pc.parameters()), before)


def test_a_child_sum_tree_lstm_round_trips(tmp_path):
    a = dx.nn.ChildSumTreeLSTMBuilder(IN, HID, dx.ParameterCollection(seed=0))
    b = dx.nn.ChildSumTreeLSTMBuilder(IN, HID, dx.ParameterCollection(seed=1))
    assert b.param_collection() is b.pc and len(b.pc.parameters()) == 6
    scramble(b.pc.parameters())
    path = tmp_path / "cs.npz"
    dx.save(path, [a])
    assert list(np.load(path)["__dynax_kinds__"]) == ["ChildSumTreeLSTMBuilder"]
    dx.load(path, [b])
    assert_same(values(b.pc.parameters()), values(a.pc.parameters()))
