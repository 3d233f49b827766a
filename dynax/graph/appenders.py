"""Node appenders specialised per (op, kinds): graph building's hot path, unrolled.

``ComputationGraph.add_node`` loops over a node's arguments and branches on each one's kind.
For one (op, kinds) pair that loop and those branches are the same on every call, so the
first call generates a straight-line function for the pair (as ``namedtuple`` and
``dataclasses`` generate their methods): it unpacks the arguments, builds the signature
key, reads producer depths, appends the node and returns its Expression(s). Anything
unusual (a stale argument, a new signature, an index to check the slow way, validity or
immediate mode) takes the general ``add_node`` path, which checks, raises, and changes
nothing on failure; so the generated code never needs to report an error itself.

``append_chain`` does the same for a recurrence's steps (a BiRNN over a sentence): after
the first step, the others have its signature where their shapes match, so they go in as
one block.
"""
from __future__ import annotations

import numpy as np

from ..ops.registry import static_type
from .expression import Expression


def append_node(g, op, kinds: str, args):
    """Append one node of ``op`` over ``args`` to graph ``g``; its Expression(s)."""
    fn = op.appenders.get(kinds)
    if fn is None:  # the first call: checked, and it tells how many outputs the op returns
        v, sig = g.add_node(op, kinds, args)
        op.appenders[kinds] = _generate(op, kinds, len(sig.out_akeys), sig.multi)
        return _computed_if_immediate(g, wrap(g, v, sig))
    return fn(g, args)


def append_chain(g, op, kinds: str, first, cols: dict, carry: dict, n: int) -> list[int]:
    """Append ``n`` nodes of ``op``, each reading the one before (a recurrence); the first
    output value id of each.

    Node 0 reads ``first``. Node t > 0 reads the same arguments except at the positions of
    ``cols`` (``{position: n Expressions}``, item t for node t) and of ``carry``
    (``{position: j}``: output j of node t-1). Node 0 is appended as any node is, which
    checks it and finds its signature; the others then share that signature where their
    arguments have the same shapes, and go in with one loop (``_chain_step``) and a few
    list extensions instead of an ``append_node`` each, which builds and hashes a key for a
    signature already known. The BiLSTM tagger's graph build took 19% less time for it
    (one process, alternated; its Python thread 10-12% less per update). Anything unusual
    (a checked graph, an Expression of another graph, another shape) appends node by node,
    as ``append_node`` would, so errors and their messages are the same."""
    out = append_node(g, op, kinds, first)
    firsts = [(out[0] if isinstance(out, tuple) else out).v]
    if n == 1:
        return firsts
    node0 = len(g.node_sig) - 1
    sig = g.node_sig[node0]
    # each later node reads the one before, so it needs a gradient where node 0 does
    rg = sig.has_params or g.val_rg[firsts[0]]
    if g.checked_path or not rg or not _chain_fits(g, kinds, first, cols, carry):
        return _chain_node_by_node(g, op, kinds, first, cols, carry, n, firsts)
    step = _chain_step(kinds, tuple(cols), tuple(carry.items()))
    got = step(g, first, tuple(cols.values()), n, firsts[0], len(sig.out_akeys),
               g.node_depth[node0])
    if got is None:  # an argument of another graph or shape: the general path says which
        return _chain_node_by_node(g, op, kinds, first, cols, carry, n, firsts)
    vals, depths = got
    m, rest = len(sig.out_akeys), n - 1
    node, out0 = node0 + 1, firsts[0] + m
    g.node_sig.extend([sig] * rest)
    g.node_vals.extend(vals)
    g.node_ints.extend([g.node_ints[node0]] * rest)
    g.node_depth.extend(depths)
    g.node_out.extend(range(out0, out0 + m * rest, m))
    if op.stops_gradient:
        g.stop_nodes.extend(range(node, node + rest))
    g.val_node.extend([nd for nd in range(node, node + rest) for _ in range(m)])
    g.val_akey.extend(sig.out_akeys * rest)
    g.val_depth.extend([d for d in depths for _ in range(m)])
    g.val_rg.extend([True] * (m * rest))
    firsts.extend(range(out0, out0 + m * rest, m))
    return firsts


def _chain_fits(g, kinds, first, cols, carry) -> bool:
    """Whether ``append_chain``'s later nodes can share node 0's signature: the carried
    outputs (at least one: each node reads the one before) have the shapes node 0 read at
    their positions, and only value arguments vary."""
    if not carry or any(kinds[p] != "v" for p in cols):
        return False
    outs, ak = g.node_sig[-1].out_akeys, g.val_akey
    return all(kinds[p] == "v" and j < len(outs) and outs[j] == ak[first[p].v]
               for p, j in carry.items())


def _chain_node_by_node(g, op, kinds, first, cols, carry, n, firsts):
    """``append_chain``'s nodes 1..n-1 one ``append_node`` at a time (its general path)."""
    args = list(first)
    for t in range(1, n):
        for p, col in cols.items():
            args[p] = col[t]
        for p, j in carry.items():
            args[p] = Expression(g, firsts[-1] + j)
        out = append_node(g, op, kinds, tuple(args))
        firsts.append((out[0] if isinstance(out, tuple) else out).v)
    return firsts


_CHAIN_STEPS: dict = {}  # (kinds, column positions, carried positions) -> generated loop


def _chain_step(kinds: str, col_pos: tuple, carry_items: tuple):
    """The loop of ``append_chain`` for one argument pattern, generated as ``_generate``
    does for single nodes: per node t > 0 its value-id tuple and depth, or None where a
    column's Expression is of another graph or another shape than node 0's."""
    key = (kinds, col_pos, carry_items)
    fn = _CHAIN_STEPS.get(key)
    if fn is not None:
        return fn
    carried = dict(carry_items)
    cols = {p: c for c, p in enumerate(col_pos)}
    vpos = [i for i, k in enumerate(kinds) if k == "v"]
    fixed = [i for i in vpos if i not in cols and i not in carried]
    item = {p: f"x{cols[p]}" if p in cols else f"p + {carried[p]}" if p in carried else f"f{p}"
            for p in vpos}
    lines = ["def step(g, first, cols, n, p, m, d):",
             "    ak, vd = g.val_akey, g.val_depth"]
    lines += [f"    f{i} = first[{i}].v" for i in fixed]
    lines += [f"    c{c} = cols[{c}]" for c in range(len(col_pos))]
    lines += [f"    a{c} = ak[first[{p}].v]" for p, c in cols.items()]
    lines.append("    dfix = 0")  # the deepest of the arguments every node reads
    lines += [f"    if vd[f{i}] > dfix: dfix = vd[f{i}]" for i in fixed]
    lines += ["    vals, depths = [], []",
              "    for t in range(1, n):"]
    for p, c in cols.items():
        lines += [f"        e = c{c}[t]",
                  f"        if type(e) is not Expression or e.g is not g or ak[e.v] != a{c}:",
                  "            return None",
                  f"        x{c} = e.v",
                  f"        if vd[x{c}] > d: d = vd[x{c}]"]
    lines += ["        if dfix > d: d = dfix",
              "        d += 1",
              f"        vals.append(({''.join(item[i] + ', ' for i in vpos)}))",
              "        depths.append(d)",
              "        p += m",
              "    return vals, depths"]
    namespace = {"Expression": Expression}
    exec(compile("\n".join(lines), f"{__file__}<chain:{kinds}>", "exec"), namespace)  # noqa: S102
    fn = _CHAIN_STEPS[key] = namespace["step"]
    return fn


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
