"""Saving and restoring parameter values: NumPy ``.npz`` files, written atomically.

Two entry points share one file format:

* ``pc.save(path)`` / ``pc.populate(path)``: one collection, keys are parameter names relative
  to the collection.
* ``dx.save(path, objects)`` / ``dx.load(path, target)``: DyNet's form, for a list of
  collections, builders and parameters. Object ``i``'s parameters are keyed
  ``"i:<name relative to the object's collection>"``, and two manifest arrays record, per
  object, the name prefix of its collection and its class name.

Every file has a ``__dynax_format__`` entry. A save goes to a temporary file in the same folder
and is renamed over the target, so an interrupted save leaves the previous file intact. A load
reads and checks every name and shape before it changes anything.
"""
from __future__ import annotations

import os
import stat
import tempfile
import zipfile

import numpy as np

from ..errors import ArgumentTypeError

FORMAT_VERSION = 1
FORMAT_KEY = "__dynax_format__"
OBJECTS_KEY = "__dynax_objects__"  # per saved object: the name prefix of its collection
KINDS_KEY = "__dynax_kinds__"  # per saved object: its class name (for error messages)
SEP = ":"  # object index : relative name (":" cannot occur in a parameter name)
COLLECTION = "ParameterCollection"  # the manifest's kind for a saved collection


# ---- the file --------------------------------------------------------------------------------

def _write_npz(arrays: dict, path) -> None:
    """Write ``arrays`` (plus the format version) to ``path`` atomically, as an ``.npz``
    that ``np.load`` reads. Written member by member (``np.savez`` takes the names as
    keyword arguments, so a parameter named ``file`` would clash with its own). The file
    keeps the mode of the one it replaces (a new one: the umask's), and a symlink at
    ``path`` keeps pointing at the file it names, which is what gets replaced."""
    path = os.path.realpath(os.fspath(path))
    arrays = dict(arrays)
    arrays[FORMAT_KEY] = np.asarray(FORMAT_VERSION)
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"save: the folder of {path!r} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=".dynax-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:  # closes fd however the write ends
            os.fchmod(f.fileno(), _mode_for(path))  # mkstemp makes it private (0600)
            with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
                for name, a in arrays.items():
                    with z.open(name + ".npy", "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, np.asanyarray(a), allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _mode_for(path) -> int:
    """The permissions a save gives ``path``: those of the file there, else what a new
    file gets under the process's umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask. Linux reports it in /proc; elsewhere it is read by setting it
    and back, which for that instant gives files other threads create no umask."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0)
    os.umask(umask)
    return umask


def load_arrays(path, who: str = "populate") -> dict:
    """All arrays of a dynax file; a clear ``ValueError`` if it is truncated or corrupt."""
    path = os.fspath(path)
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):  # a .npy file: one bare array
            raise ValueError(f"it holds one {type(z).__name__} (np.save's), not an archive "
                             "of named arrays")
        with z:
            arrays = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
        raise ValueError(f"{who}: {path} is not a readable dynax parameter file "
                         f"(of pc.save or dx.save; or truncated or corrupt): {e}") from None
    version = arrays.pop(FORMAT_KEY, None)
    if version is None or version.shape != () or int(version) != FORMAT_VERSION:
        raise ValueError(f"{who}: {path} has format version {version}, "
                         f"expected {FORMAT_VERSION}")
    return arrays


def _read_objects(path, who: str) -> list[tuple[str, str, dict]]:
    """Per saved object: ``(collection prefix, class name, {relative name: array})``.

    A file written by ``pc.save`` reads as one ``ParameterCollection`` with prefix ``""``."""
    arrays = load_arrays(path, who)
    if OBJECTS_KEY not in arrays:
        return [("", COLLECTION, arrays)]
    prefixes, kinds = arrays.pop(OBJECTS_KEY), arrays.pop(KINDS_KEY, None)
    if (prefixes.ndim != 1 or prefixes.dtype.kind != "U" or kinds is None
            or kinds.shape != prefixes.shape or kinds.dtype.kind != "U"):
        raise ValueError(f"{who}: {path} has a corrupt object manifest")
    objects = [(str(p), str(k), {}) for p, k in zip(prefixes.tolist(), kinds.tolist())]
    for key, a in arrays.items():
        index, sep, rel = key.partition(SEP)
        if not sep or not index.isdigit() or int(index) >= len(objects):
            raise ValueError(f"{who}: {path} holds an entry {key!r} that belongs to no saved "
                             f"object (the file is corrupt)")
        objects[int(index)][2][rel] = a
    return objects


def _full_names(objects, prefix: str, who: str) -> dict:
    """``{full parameter name: array}`` for restoring into the collection with ``prefix``.

    A saved collection maps onto that collection itself (names relative to it); saved
    builders and parameters keep the full names they were built with."""
    out, source = {}, {}
    for i, (saved, kind, arrays) in enumerate(objects):
        for rel, a in arrays.items():
            name = (prefix if kind == COLLECTION else saved) + rel
            if name in out:  # two saved objects claim one parameter: refuse to guess
                raise ValueError(f"{who}: saved objects {source[name]} and {i} both map to "
                                 f"parameter {name!r}; load them as a list of objects instead")
            out[name], source[name] = a, i
    return out


def _stage(staged, p, name, a, path, who):
    if a.dtype.kind not in "fiub":  # set_value would fail half-way through the commit
        raise ValueError(f"{who}: {path} holds a {a.dtype} array for parameter {name!r}")
    if tuple(a.shape) != p.shape:
        raise ValueError(f"{who}: parameter {name!r} has shape {p.shape} but {path} holds "
                         f"shape {tuple(a.shape)}")
    staged.append((p, a))


def _commit(staged) -> None:
    for p, a in staged:  # every check passed: only now change values
        p.set_value(a)


# ---- one collection (pc.save / pc.populate) --------------------------------------------------

def save_parameters(params, path, strip: str = "") -> None:
    """Write ``params`` keyed by their names with the prefix ``strip`` removed."""
    arrays = {p.name[len(strip):]: np.asarray(p._value) for p in params}
    for name in arrays:
        if name in (FORMAT_KEY, OBJECTS_KEY, KINDS_KEY):
            raise ValueError(f"save: parameter name {name!r} is reserved by dynax's file "
                             "format; give the parameter another name")
    _write_npz(arrays, path)


def populate_parameters(params, path, strip: str = "") -> None:
    """Restore each of ``params`` (a collection's, whose names start with ``strip``).

    Reads files of ``pc.save`` and of ``dx.save`` (matched as ``dx.load`` into a collection
    does). Entries of the file that no parameter asks for are ignored. A sub-collection
    whose names the file lacks relative to it reads them by full name, if the file has all
    of them that way: the file of a whole model (``pc.save``), read into its ``enc/`` part."""
    path = os.fspath(path)
    objects = _read_objects(path, "populate")
    arrays = _full_names(objects, strip, "populate")
    if strip and any(p.name not in arrays for p in params):
        whole = _full_names(objects, "", "populate")
        if all(p.name in whole for p in params):
            arrays = whole
    staged = []
    for p in params:
        if p.name not in arrays:
            raise ValueError(f"populate: {path} has no parameter named "
                             f"{p.name[len(strip):]!r} (it has "
                             f"{sorted(_relative(k, strip) for k in arrays)[:10]})")
        _stage(staged, p, p.name[len(strip):], arrays[p.name], path, "populate")
    _commit(staged)


def _relative(name: str, prefix: str) -> str:
    return name[len(prefix):] if name.startswith(prefix) else name


# ---- lists of objects (dx.save / dx.load) ----------------------------------------------------

def _object_parameters(obj, who: str):
    """``(collection prefix, parameters)`` of a collection, a builder or a parameter."""
    from .parameters import Parameter, ParameterCollection
    if isinstance(obj, ParameterCollection):
        return obj._prefix, obj.parameters()
    if isinstance(obj, Parameter):
        return obj.name, [obj]  # its relative name is ""
    getter = getattr(obj, "param_collection", None)
    if callable(getter):
        pc = getter()
        return pc._prefix, pc.parameters()
    raise ArgumentTypeError(f"{who}: cannot save or load a {type(obj).__name__}; expected a "
                            "ParameterCollection, a Parameter or a builder with "
                            "param_collection()")


def save(path, objects) -> None:
    """Save the parameter values of ``objects`` to ``path`` (DyNet's ``dy.save``).

    Args:
      path: the file to write (``.npz``; written to a temporary file, then renamed over
        ``path``, so an interrupted save never leaves a half-written file).
      objects: a list of ``ParameterCollection``s, builders (anything with
        ``param_collection()``: ``LSTMBuilder``, ``BiRNNBuilder``, ``TreeLSTMBuilder``,
        ``StandardSoftmaxBuilder``, ``dx.nn.from_flax`` blocks, ...) and ``Parameter``s, or
        one such object.

    Example::

        dx.save("model.npz", [lstm, softmax])    # or dx.save("model.npz", [pc])
        # later, after building lstm2 and softmax2 exactly as before:
        dx.load("model.npz", [lstm2, softmax2])  # or dx.load("model.npz", pc2)
    """
    if not isinstance(objects, (list, tuple)):
        objects = [objects]
    if not objects:
        raise ValueError("save: no objects given")
    from .parameters import ParameterCollection
    arrays, prefixes, kinds = {}, [], []
    for i, obj in enumerate(objects):
        prefix, params = _object_parameters(obj, "save")
        prefixes.append(prefix)
        kinds.append(COLLECTION if isinstance(obj, ParameterCollection) else type(obj).__name__)
        for p in params:
            arrays[f"{i}{SEP}{p.name[len(prefix):]}"] = np.asarray(p._value)
    arrays[OBJECTS_KEY] = np.asarray(prefixes, dtype=str)
    arrays[KINDS_KEY] = np.asarray(kinds, dtype=str)
    _write_npz(arrays, path)


def load(path, target):
    """Restore values saved by ``dx.save`` into identically built objects; returns ``target``.

    dynax builders are plain Python objects, so (unlike DyNet's ``dy.load``) ``load`` does not
    construct them: build the model as before, then load into it, in one of two ways:

    * ``target`` a list (or one object) of collections, builders and parameters, in the order
      given to ``save``: object ``i`` must have exactly the parameters (names relative to its
      own collection, and shapes) that saved object ``i`` had. The objects may live anywhere,
      e.g. in a fresh collection of a different name.
    * ``target`` a ``ParameterCollection`` (DyNet's ``dy.load(path, pc)``): a saved
      collection is restored into ``target`` itself (by names relative to each), saved builders
      and parameters into the parameters of ``target``'s model that have the full names they
      had when saved (``lstm/Wx0``), so build them the same way in the same order.
      ``target`` may hold more parameters; those are left alone. Files of ``pc.save`` load
      this way too, and ``pc.populate`` reads files of ``dx.save`` the same way.

    Raises ``ValueError`` naming the parameter, the shapes and the file on a missing or extra
    name, a shape mismatch, a different number of objects, or a truncated or corrupt file;
    nothing is changed then. ``FileNotFoundError`` if ``path`` does not exist.

    So ``lstm, softmax = dx.load("model.npz", [lstm, softmax])`` reads as in DyNet.
    """
    from .parameters import ParameterCollection
    path = os.fspath(path)
    objects = _read_objects(path, "load")
    staged = []
    if isinstance(target, ParameterCollection):
        names = target._root._names
        for name, a in sorted(_full_names(objects, target._prefix, "load").items()):
            p = names.get(name)
            if p is None:
                have = [q.name for q in target.parameters()]
                hint = ("; dynax does not construct the saved objects (DyNet's dy.load does): "
                        "build the model into the collection first, as before saving, then "
                        "load into it") if not have else ""
                if target._prefix and any(kind == COLLECTION for _, kind, _ in objects):
                    hint += ("; a saved collection maps onto the target by names relative to "
                             "each: load into the collection that was saved, or use "
                             f"populate, which ignores entries {target._prefix[:-1]!r} lacks")
                raise ValueError(f"load: {path} holds parameter {name!r} but the collection "
                                 f"has no parameter of that name (it has {have[:10]}){hint}")
            _stage(staged, p, name, a, path, "load")
    else:
        targets = list(target) if isinstance(target, (list, tuple)) else [target]
        if len(targets) != len(objects):
            raise ValueError(f"load: {path} holds {len(objects)} object(s) "
                             f"({', '.join(k for _, k, _ in objects)}) but {len(targets)} "
                             "object(s) were given")
        for i, (obj, (_, kind, arrays)) in enumerate(zip(targets, objects)):
            prefix, params = _object_parameters(obj, "load")
            mine = {p.name[len(prefix):]: p for p in params}
            extra = sorted(set(mine) - set(arrays))
            if extra:
                raise ValueError(f"load: {type(obj).__name__} (object {i}) has parameter "
                                 f"{mine[extra[0]].name!r} but the {kind} saved as object {i} "
                                 f"in {path} has no {extra[0]!r} (it has {sorted(arrays)[:10]})")
            missing = sorted(set(arrays) - set(mine))
            if missing:
                raise ValueError(f"load: the {kind} saved as object {i} in {path} has "
                                 f"parameter {missing[0]!r} but the {type(obj).__name__} given "
                                 f"as object {i} has none of that name "
                                 f"(it has {sorted(mine)[:10]})")
            try:
                for rel, p in mine.items():
                    _stage(staged, p, p.name, arrays[rel], path, "load")
            except ValueError as e:
                if kind == type(obj).__name__:
                    raise
                raise ValueError(f"{e} (object {i} was saved from a {kind} but is loaded into "
                                 f"a {type(obj).__name__})") from None
    _commit(staged)
    return target
