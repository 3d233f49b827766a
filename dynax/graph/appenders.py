"""Node appenders specialised per (op, kinds): graph building's hot path, unrolled.

``ComputationGraph.add_node`` loops over a node's arguments and branches on each one's kind.
For one (op, kinds) pair that loop and those branches are the same on every call, so the
first call generates a straight-line function for the pair (as ``namedtuple`` and
``dataclasses`` generate their methods): it unpacks the arguments, builds the signature
key, reads producer depths, appends the node and returns its Expression(s). Anything
unusual (a stale argument, a new signature, an index to check the slow way, validity or
immediate mode) takes the general ``add_node`` path, which checks, raises, and changes
nothing on failure; so the generated code never needs to report an error itself.
"""
from __future__ import annotations

import numpy as np

from ..ops.registry import static_type
from .expression import Expression


GENERATE_MAX_ARGS = 64  # longer argument lists (a list op's items) take the general path


def append_node(g, op, kinds: str, args):
    """Append one node of ``op`` over ``args`` to graph ``g``; its Expression(s).

    No appender is generated for more than ``GENERATE_MAX_ARGS`` arguments: generating one
    costs ~0.5 ms an argument and is kept for good (a 1,000-item concatenate: 0.46 s and
    1 MB, and a model concatenating every sentence's scores meets every length), while
    the general path costs about what the generated one does at that length (100 items:
    0.08 against 0.07 ms a node)."""
    fn = op.appenders.get(kinds)
    if fn is None:  # the first call: checked, and it tells how many outputs the op returns
        v, sig = g.add_node(op, kinds, args)
        if len(kinds) <= GENERATE_MAX_ARGS:
            op.appenders[kinds] = _generate(op, kinds, len(sig.out_akeys), sig.multi)
        return _computed_if_immediate(g, wrap(g, v, sig))
    return fn(g, args)


def typed_appender(op, kinds: str):
    """The appender of (op, kinds), once ``append_node`` has made it, led by a check that
    ``args`` are of types of those kinds; it returns None where they are not. Per-instance
    integers ('i') must be NumPy integers of a sized type (``np.int32``, ...), and are
    converted to ``int`` as ``Function.__call__`` does on its general path.

    For ``@dx.function`` calls: checking each argument's type against one pattern costs a
    third of what finding the kinds by a tuple of the types does (the build's costliest
    line in a Tree-LSTM profile)."""
    from ..ops.core import _PARAMETER_TYPES  # which imports this module
    plain = op.appenders[kinds]
    return _generate(op, kinds, plain.n_out, plain.multi, _PARAMETER_TYPES)


def general(g, op, kinds, args):
    """The checked path: ``add_node``, outputs wrapped as Expressions."""
    v, sig = g.add_node(op, kinds, args)
    return _computed_if_immediate(g, wrap(g, v, sig))


def _computed_if_immediate(g, out):
    """In ``immediate_compute`` mode the node is computed now, unless a composite
    construction is under way (``ops.atomic`` computes its nodes once all are built)."""
    if g.immediate_compute and not g.constructing:
        g.forward_to()
    return out


def wrap(g, v, sig):
    """The Expression(s) of a node whose first output value is ``v``."""
    if sig.multi:
        return tuple([Expression(g, v + j) for j in range(len(sig.out_akeys))])
    return Expression(g, v)


# the exact argument types of each kind that a typed appender takes (ops/function.py's
# _fast_kinds); per-instance integers ('i') are NumPy integers, converted to int there
_STATIC_TYPES = frozenset((int, float, str))
_NUMPY_INT_TYPES = frozenset((np.int8, np.int16, np.int32, np.int64,
                              np.uint8, np.uint16, np.uint32, np.uint64))


def _generate(op, kinds: str, n_out: int, multi: bool, parameter_types=None):
    """The appender for (op, kinds), for ops returning ``n_out`` outputs. Given the
    ``parameter_types``, it first checks that ``args`` are of types of those kinds
    (``typed_appender``)."""
    vpos = [i for i, k in enumerate(kinds) if k == "v"]
    ipos = [i for i, k in enumerate(kinds) if k == "i"]
    nv = len(vpos)
    key, j = ["op", "kinds"], 0  # as add_node builds it: akeys, None for ints, else the item
    for i, k in enumerate(kinds):
        if k == "v":
            key.append(f"ak[v{j}]")
            j += 1
        else:
            key.append("None" if k == "i" else f"a{i}")
    spos = [i for i, k in enumerate(kinds) if k == "s"]
    if spos:  # as add_node: statics that Python finds equal (3, 3.0) are told apart
        key.append("(" + "".join(f"static_type(a{i}), " for i in spos) + ")")
    # where the signature is interned (registry.signature_table)
    table = f"a{kinds.index('p')}._signatures" if "p" in kinds else "op_signatures"
    unpack = "".join(f"a{i}, " for i in range(len(kinds)))
    guard = " or ".join(["g.checked_path"] + [f"a{i}.g is not g" for i in vpos])
    lines = ["def append(g, args):"]
    if parameter_types is not None:
        type_sets = {"p": "parameter_types", "s": "static_types", "i": "numpy_int_types"}
        checks = [f"type(a{i}) is not Expression" if k == "v" else
                  f"type(a{i}) not in {type_sets[k]}" for i, k in enumerate(kinds)]
        lines += [f"    if len(args) != {len(kinds)}:",
                  "        return None",
                  f"    {unpack} = args",
                  f"    if {' or '.join(checks)}:",
                  "        return None"]
        if ipos:  # as Function.__call__ converts them for the general path
            lines += [f"    a{i} = int(a{i})" for i in ipos]
            lines.append(f"    args = ({unpack})")
    else:
        lines.append(f"    {unpack} = args")
    lines += [f"    if {guard}:",
              "        return general(g, op, kinds, args)"]
    lines += [f"    v{j} = a{i}.v" for j, i in enumerate(vpos)]
    lines += ["    ak = g.val_akey",
              f"    sig = {table}.get(({', '.join(key)}))",
              "    if sig is None:",
              "        return general(g, op, kinds, args)",
              "    outs = sig.out_akeys",
              f"    if len(outs) != {n_out} or sig.multi is not {multi}:",  # another arity
              "        return general(g, op, kinds, args)"]
    if ipos:
        ok = " and ".join(f"type(a{i}) is int and 0 <= a{i} < sig.bounds[{j}]"
                          for j, i in enumerate(ipos))
        lines += [f"    if not ({ok}):",
                  "        return general(g, op, kinds, args)",
                  f"    ints = ({''.join(f'a{i}, ' for i in ipos)})"]
    else:
        lines.append("    ints = None")
    if nv == 0:
        lines += ["    depth = 1", "    rg = sig.has_params"]
    else:
        depths = ", ".join(f"vd[v{j}]" for j in range(nv))
        lines += ["    vd = g.val_depth", "    vr = g.val_rg",
                  f"    depth = {f'max({depths})' if nv > 1 else depths} + 1",
                  f"    rg = sig.has_params or {' or '.join(f'vr[v{j}]' for j in range(nv))}"]
    lines += ["    node = len(g.node_sig)",
              "    g.node_sig.append(sig)"]
    if op.stops_gradient:
        lines.append("    g.stop_nodes.append(node)")
    lines += [
              f"    g.node_vals.append(({''.join(f'v{j}, ' for j in range(nv))}))",
              "    g.node_ints.append(ints)",
              "    g.node_depth.append(depth)",
              "    vn = g.val_node",
              "    out = len(vn)",
              "    g.node_out.append(out)"]
    if n_out == 1:
        lines += ["    vn.append(node)",
                  "    ak.append(outs[0])",
                  "    g.val_rg.append(rg)",
                  "    g.val_depth.append(depth)",
                  f"    return {'(Expression(g, out),)' if multi else 'Expression(g, out)'}"]
    else:
        def repeated(x):
            return "(" + ", ".join([x] * n_out) + ")"
        exprs = ", ".join(f"Expression(g, out + {j})" for j in range(n_out))
        lines += [f"    vn.extend({repeated('node')})",
                  "    ak.extend(outs)",
                  f"    g.val_rg.extend({repeated('rg')})",
                  f"    g.val_depth.extend({repeated('depth')})",
                  f"    return {exprs}"]
    namespace = {"op": op, "kinds": kinds, "op_signatures": op.signatures, "general": general,
                 "Expression": Expression, "static_type": static_type,
                 "parameter_types": parameter_types, "static_types": _STATIC_TYPES,
                 "numpy_int_types": _NUMPY_INT_TYPES}
    # named after this file so that error sites (``sites.user_site``) skip its frames
    code = compile("\n".join(lines), f"{__file__}<{op.name}:{kinds}>", "exec")
    exec(code, namespace)  # noqa: S102  (source built above from kinds only)
    append = namespace["append"]
    append.n_out, append.multi = n_out, multi  # for typed_appender
    return append
