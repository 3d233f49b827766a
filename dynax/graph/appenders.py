"""Node appenders specialised per (op, kinds): graph building's hot path, unrolled.

``ComputationGraph.add_node`` loops over a node's arguments and branches on each one's kind.
For one (op, kinds) pair that loop and those branches are the same on every call, so the
first call generates a straight-line function for the pair (as ``namedtuple`` and
``dataclasses`` generate their methods): it unpacks the arguments, builds the signature
key, reads producer depths, appends the node and returns its Expression(s). Anything
unusual (a stale argument, a new signature, an index to check the slow way, validity
mode) takes the general ``add_node`` path, which checks, raises, and changes nothing on
failure; so the generated code never needs to report an error itself.
"""
from __future__ import annotations

from ..ops.registry import SIG_CACHE
from .expression import Expression

_APPENDERS: dict = {}  # (op, kinds) -> generated appender


def append_node(g, op, kinds: str, args):
    """Append one node of ``op`` over ``args`` to graph ``g``; its Expression(s)."""
    fn = _APPENDERS.get((op, kinds))
    if fn is None:
        fn = _APPENDERS[op, kinds] = _generate(op, kinds)
    return fn(g, args)


def general(g, op, kinds, args):
    """The checked path: ``add_node``, outputs wrapped as Expressions."""
    v, sig = g.add_node(op, kinds, args)
    return wrap(g, v, sig)


def wrap(g, v, sig):
    if sig.multi:
        return tuple([Expression(g, v + j) for j in range(len(sig.out_akeys))])
    return Expression(g, v)


def _generate(op, kinds: str):
    n = len(kinds)
    a = [f"a{i}" for i in range(n)]
    vpos = [i for i, k in enumerate(kinds) if k == "v"]
    ipos = [i for i, k in enumerate(kinds) if k == "i"]
    key = ", ".join(["op", "kinds"] + [f"ak[{v}]" if k == "v" else ("None" if k == "i" else f"a{i}")
                                       for i, (k, v) in enumerate(zip(kinds, _vals(kinds)))])
    lines = [f"def append(g, args):",
             f"    {', '.join(a)}{',' if n == 1 else ''} = args"]
    guard = ["g.check_validity"] + [f"a{i}.g is not g" for i in vpos]
    lines += [f"    if {' or '.join(guard)}:",
              "        return general(g, op, kinds, args)"]
    for j, i in enumerate(vpos):
        lines.append(f"    v{j} = a{i}.v")
    lines += ["    ak = g.val_akey",
              f"    sig = SIG_CACHE.get(({key},))",
              "    if sig is None:",
              "        return general(g, op, kinds, args)"]
    if ipos:
        ok = " and ".join(f"type(a{i}) is int and 0 <= a{i} < sig.bounds[{j}]"
                          for j, i in enumerate(ipos))
        lines += [f"    if not ({ok}):",
                  "        return general(g, op, kinds, args)",
                  f"    ints = ({', '.join(f'a{i}' for i in ipos)},)"]
    else:
        lines.append("    ints = None")
    nv = len(vpos)
    if nv == 0:
        lines += ["    depth = 1", "    rg = sig.has_params"]
    else:
        vd = [f"vd[v{j}]" for j in range(nv)]
        lines += ["    vd = g.val_depth", "    vr = g.val_rg",
                  f"    depth = {'max(' + ', '.join(vd) + ')' if nv > 1 else vd[0]} + 1",
                  f"    rg = sig.has_params or {' or '.join(f'vr[v{j}]' for j in range(nv))}"]
    lines += ["    node = len(g.node_sig)",
              "    g.node_sig.append(sig)",
              f"    g.node_vals.append(({''.join(f'v{j}, ' for j in range(nv))}))",
              "    g.node_ints.append(ints)",
              "    g.node_depth.append(depth)",
              "    vn = g.val_node",
              "    out = len(vn)",
              "    g.node_out.append(out)",
              "    outs = sig.out_akeys",
              "    if len(outs) == 1:",
              "        vn.append(node)",
              "        ak.append(outs[0])",
              "        vr.append(rg)" if nv else "        g.val_rg.append(rg)",
              "        vd.append(depth)" if nv else "        g.val_depth.append(depth)",
              "        return Expression(g, out) if not sig.multi else (Expression(g, out),)",
              "    m = len(outs)",
              "    vn.extend([node] * m)",
              "    ak.extend(outs)",
              "    g.val_rg.extend([rg] * m)",
              "    g.val_depth.extend([depth] * m)",
              "    return tuple([Expression(g, out + j) for j in range(m)])"]
    namespace = {"op": op, "kinds": kinds, "SIG_CACHE": SIG_CACHE, "general": general,
                 "Expression": Expression}
    # named after this file so that error sites (``sites.user_site``) skip its frames
    code = compile("\n".join(lines), f"{__file__}<{op.name}:{kinds}>", "exec")
    exec(code, namespace)  # noqa: S102  (source built above from kinds only)
    return namespace["append"]


def _vals(kinds):
    """For each position, the name of its value id variable (value positions only)."""
    out, j = [], 0
    for k in kinds:
        out.append(f"v{j}" if k == "v" else None)
        j += k == "v"
    return out
