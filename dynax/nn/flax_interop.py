"""Flax modules as dynax blocks: ``dx.nn.from_flax``.

A Flax module written for ONE example (no batch dimension) becomes a callable whose every
call adds ONE node to the current graph. The block is a ``@dx.function`` over
``(inputs..., parameter leaves...)``: the module's parameter pytree is flattened into a fixed
list of dynax ``Parameter``s (shared arguments: one copy serves the whole batch, and their
gradients are summed over it), and unflattened inside the function before ``module.apply``.
So calls from many instances batch into one vmapped kernel, gradients flow through
``jax.vjp`` of that kernel, and a ``dx.Trainer`` over the collection updates the Flax weights.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ArgumentTypeError, ShapeError
from ..graph.expression import Expression
from ..ops import core as ops
from ..ops.core import atomic
from ..ops.function import Function
from .rnn import _fresh_subcollection


def _key_name(k) -> str | None:
    """One component of a parameter name from one step of a pytree path."""
    tu = jax.tree_util
    if isinstance(k, tu.DictKey):
        s = str(k.key)
    elif isinstance(k, tu.GetAttrKey):
        if k.name == "value":  # nnx: the array inside a Variable, not a level of the model
            return None
        s = k.name
    elif isinstance(k, tu.SequenceKey):
        s = str(k.idx)
    elif isinstance(k, tu.FlattenedIndexKey):
        s = str(k.key)
    else:
        s = str(k)
    return re.sub(r"[^\w.-]", "_", s) or "_"  # dynax names allow only letters, digits _ . / -


def _path_name(path) -> str:
    parts = [n for n in map(_key_name, path) if n is not None]
    return "/".join(parts) if parts else "param"


def _as_example(x, i):
    arr = np.asarray(x)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
            or arr.dtype == np.bool_):  # what dx.input takes
        raise ValueError(f"from_flax: example input {i} has dtype {arr.dtype}; dynax values "
                         "are float32 arrays, made from float, int or bool ones")
    return arr.astype(np.float32)


def _unflattener(treedef, shapes, dtypes):
    """Parameter leaves (as stored in dynax) -> the Flax parameter tree."""
    def unflatten(leaves):
        leaves = [jnp.reshape(a, s).astype(d)  # scalars are stored as (1,); dtypes restored
                  for a, s, d in zip(leaves, shapes, dtypes)]
        return jax.tree_util.tree_unflatten(treedef, leaves)
    return unflatten


def _block_function(call, unflatten, n_in, n_out, label, kwargs) -> Function:
    """The single-instance ``(inputs..., parameter leaves...) -> output leaves`` as a node
    type; ``kwargs`` (the static keyword arguments of the module's call) are part of it."""
    kw = dict(kwargs.items)

    def apply(*args):
        outs = jax.tree_util.tree_leaves(call(unflatten(args[n_in:]), args[:n_in], kw))
        outs = [o.astype(jnp.float32) for o in outs]  # dynax values are float32
        return outs[0] if n_out == 1 else tuple(outs)

    suffix = "".join(f",{k}={v!r}" for k, v in kwargs.items)
    apply.__qualname__ = apply.__name__ = f"flax:{label}{suffix}"
    return Function(apply)


_STATIC_TYPES = (bool, int, float, str, type(None), np.bool_, np.integer, np.floating)


# Blocks of equal linen modules with the same parameter layout share one Function, hence
# their compiled kernels (as builders share their cells): a second identical block or a
# rebuilt model compiles nothing new.
_SHARED_FUNCTIONS: dict = {}


class _Keywords:
    """Static keyword arguments of a module's call, hashed and compared by each value's type
    and repr: ``2``, ``2.0`` and ``True`` are different settings (equal as dict keys, they
    would share a kernel), and ``nan`` equals itself (else every call would compile)."""

    __slots__ = ("items", "_key")

    def __init__(self, items: tuple):
        self.items = items
        self._key = tuple((k, type(v), repr(v)) for k, v in items)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Keywords) and self._key == other._key


_jitted_init = jax.jit(lambda module, kw, key, *xs: module.init(key, *xs, **dict(kw.items)),
                       static_argnums=(0, 1))


def _init(module, kwargs, key, *xs):
    """``module.init`` as one compiled program (eagerly it compiles op by op), cached for
    equal modules; modules with unhashable fields get a one-off ``jax.jit``."""
    try:
        hash(module)
    except TypeError:
        return jax.jit(lambda key, *xs: module.init(key, *xs, **dict(kwargs.items)))(key, *xs)
    return _jitted_init(module, kwargs, key, *xs)


def _with_kwargs(kw) -> str:
    return "".join(f", {k}={v!r}" for k, v in kw.items)


def _static_kwargs(who, kwargs) -> _Keywords:
    """Keyword arguments, sorted by name, each value a static scalar."""
    for k, v in kwargs.items():
        if not isinstance(v, _STATIC_TYPES):
            raise ArgumentTypeError(
                f"{who}: keyword argument {k}={v!r} is of type {type(v).__name__}; a block's "
                "keyword arguments are static: Python scalars, strings or None")
    return _Keywords(tuple(sorted(kwargs.items())))


class FlaxBlock:
    """A Flax module applied per instance as one graph node per call (see ``from_flax``).

    Attributes:
      module: the Flax module.
      pc: the subcollection holding its parameters (named after the module).
      params: its dynax ``Parameter``s, in the order of the flattened Flax parameter tree.
      input_shapes: the shape of each input of a single example.
      output_shapes: the shape of each array the module returns, in flattened order.
    """

    def __init__(self, module, pc, params, variant, defaults, unflatten, input_shapes,
                 constants=None):
        self.module = module
        self._constants = constants
        self.pc = pc
        self.params = params
        self.input_shapes = input_shapes
        self._variant, self._unflatten = variant, unflatten
        kwargs, self._default = defaults
        self._call_kwargs = dict(kwargs.items)
        # call_kwargs merged with a call's keywords (a _Keywords) -> (Function, output
        # treedef, output shapes)
        self._variants = {kwargs: self._default}
        self.output_shapes = self._default[2]

    @atomic  # a failed call leaves no constants behind in the graph
    def __call__(self, *inputs, **kwargs):
        """The module's output for one example: Expression(s) in the module's output structure.

        Each input is an Expression (or an array, taken as a constant) of the shape of the
        corresponding example input given to ``from_flax``. Keyword arguments go to the
        module's call (``deterministic=True``, ``train=False``), over ``from_flax``'s
        ``call_kwargs``; they must be Python scalars, strings or None, and are static: calls
        with other values are other node types, compiled and batched apart."""
        variant = self._default
        if kwargs:
            items = _static_kwargs(variant[0].op.name, {**self._call_kwargs, **kwargs})
            variant = self._variants.get(items)
            if variant is None:
                variant = self._variants[items] = self._variant(items)
        fn, out_treedef, out_shapes = variant
        who = fn.op.name
        if len(inputs) != len(self.input_shapes):
            raise ValueError(f"{who}: expected {len(self.input_shapes)} input(s), "
                             f"got {len(inputs)}")
        xs = []
        for i, (x, shape) in enumerate(zip(inputs, self.input_shapes)):
            x = x if isinstance(x, Expression) else ops.input(x)
            if tuple(x.shape) != shape:
                raise ShapeError(f"{who}: input {i} has shape {tuple(x.shape)}, expected "
                                 f"{shape} (the example input's; one example, no batch "
                                 "dimension)")
            xs.append(x)
        out = fn(*xs, *self.params)
        outs = out if len(out_shapes) > 1 else (out,)
        return jax.tree_util.tree_unflatten(out_treedef, list(outs))

    def param_collection(self):
        """The subcollection holding this block's parameters (for ``dx.save``/``dx.load``)."""
        return self.pc

    def flax_params(self):
        """The module's parameter pytree with the current dynax values.

        linen: see ``flax_variables`` for ``module.apply``; nnx: an ``nnx.State``, for
        ``nnx.update(module, block.flax_params())``."""
        return self._unflatten([p.value for p in self.params])  # the user's to keep

    def flax_variables(self):
        """linen: every variable collection of the module, ``"params"`` with the current
        dynax values and the others (e.g. ``batch_stats``) as held constant, for
        ``module.apply(block.flax_variables(), x)`` or to save in Flax's own format."""
        if self._constants is None:
            raise TypeError("flax_variables: an nnx block's module holds its own variables; "
                            "use nnx.update(module, block.flax_params())")
        return {**self._constants, "params": self.flax_params()}

    def __repr__(self):
        return (f"FlaxBlock({type(self.module).__name__}, inputs={self.input_shapes}, "
                f"parameters={len(self.params)})")


def from_flax(module, pc, example_input, name: str | None = None, rng=None,
              variables=None, call_kwargs: dict | None = None) -> FlaxBlock:
    """Wrap a Flax module as a dynax block: one graph node per call, batched by dynax.

    Args:
      module: a ``flax.linen.Module`` (initialised here with ``module.init(rng,
        example_input)``) or a ``flax.nnx.Module`` (already holding its parameters; its
        ``nnx.Param`` values are copied). It must work on ONE example without a batch
        dimension (dynax batches with ``vmap``) and be deterministic when applied (use
        ``dx.dropout`` outside it instead of Flax dropout).
      pc: the ``ParameterCollection`` that gets a subcollection, named after the module (or
        ``name``), with one parameter per leaf of the Flax parameter tree, named by its path
        (``Dense_0/kernel``). Training the collection trains the module's weights.
      example_input: one example: an array, or a tuple of arrays for a module taking several
        positional inputs. Calls must give inputs of these shapes.
      name: the subcollection's name (default: the module's class name); made unique with
        ``_1``, ``_2``, ... as builders do when the collection already has one of that name.
      rng: the ``jax.random`` key for ``module.init`` (default: the next key of ``pc``, so a
        collection's seed fixes the initial weights).
      variables: linen only: the module's variables to start from instead of
        ``module.init`` (pretrained weights: ``{"params": ..., "batch_stats": ...}``, as
        ``module.init`` or ``block.flax_variables()`` returns them); checked against the
        example input.
      call_kwargs: keyword arguments of the module's call for ``init`` and every call of the
        block (``{"train": False}``, ``{"deterministic": True}``); a call's own keywords
        override them. Static: Python scalars, strings or None.

    Returns:
      A ``FlaxBlock``: ``block(x)`` returns the module's output as Expressions (one, or the
      module's output structure holding several). Variables other than parameters (linen
      collections other than ``"params"``, nnx state other than ``nnx.Param``) are held
      constant. The dynax parameters are the trained copy: ``block.flax_params()`` gives
      them back in Flax's layout (linen: ``module.apply(block.flax_variables(), x)``; nnx:
      ``nnx.update(module, block.flax_params())``).
      Parameters and values are float32 in dynax (other float dtypes are cast back inside
      the module). Blocks of equal linen modules share their compiled kernels.

    Raises:
      ValueError: the module fails on the example input, or has non-float parameters or
        outputs; ``dx.ArgumentTypeError`` (a ``ValueError``): a keyword value that is not
        static (a list, an array), here or in a call of the block, or a ``module`` that is
        not a Flax module. Calling the block with
        inputs of other shapes than the example's raises ``dx.ShapeError`` (a
        ``ValueError``). An example with a batch dimension is not
        detected where the module accepts any leading shape (``nn.Dense``): the block then
        takes a whole batch as one instance, so give ONE example.

    Example (``examples/flax_block.py`` trains one on variable-size bags of points)::

        import flax.linen as nn
        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(2)(nn.tanh(nn.Dense(16)(x)))

        pc = dx.ParameterCollection(seed=0)
        mlp = dx.nn.from_flax(MLP(), pc, np.zeros(4, np.float32))  # params in pc["MLP/..."]
        trainer = dx.AdamTrainer(pc, alpha=1e-2)
        dx.renew_cg()
        loss = dx.esum([dx.pickneglogsoftmax(mlp(dx.input(x)), y) for x, y in data])
        loss.backward(); trainer.update()       # the MLP calls ran as one batched kernel
    """
    import flax.linen as linen
    from flax import nnx

    examples = example_input if isinstance(example_input, tuple) else (example_input,)
    if not examples:
        raise ValueError("from_flax: example_input is an empty tuple; give one example")
    examples = tuple(_as_example(x, i) for i, x in enumerate(examples))
    defaults = _static_kwargs("from_flax", dict(call_kwargs or {}))
    shapes = ", ".join(str(x.shape) for x in examples)
    kind = type(module).__name__

    if variables is not None and not isinstance(module, linen.Module):
        raise ArgumentTypeError(f"from_flax: variables= is for linen modules; an nnx module "
                                f"({kind}) holds its own")
    if isinstance(module, linen.Module):
        if variables is None:
            key = pc._next_key() if rng is None else rng
            try:
                variables = _init(module, defaults, key, *examples)
            except Exception as e:
                raise ValueError(f"from_flax: {kind}.init failed on an example input of shape "
                                 f"{shapes}{_with_kwargs(defaults)} (one example, no batch "
                                 f"dimension): {type(e).__name__}: {e}") from e
        elif not hasattr(variables, "keys") or "params" not in variables:
            raise ValueError(f"from_flax: variables must be a dict of variable collections "
                             f"with a 'params' entry, as {kind}.init returns; got "
                             f"{type(variables).__name__}")
        variables = dict(variables)
        params = variables.pop("params", {})
        constants = variables  # other collections (e.g. batch_stats) are held constant

        def call(tree, xs, kw):
            return module.apply({**constants, "params": tree}, *xs, **kw)
        default_name = module.name or kind
    elif isinstance(module, nnx.Module):
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)

        def call(tree, xs, kw):
            return nnx.merge(graphdef, tree, rest)(*xs, **kw)
        default_name, constants = kind, None
    else:
        raise ArgumentTypeError(f"from_flax: expected a flax.linen or flax.nnx Module, "
                                f"got {kind}")

    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [leaf for _, leaf in path_leaves]
    for path, leaf in path_leaves:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise ValueError(f"from_flax: parameter {_path_name(path)!r} of {kind} has dtype "
                             f"{jnp.result_type(leaf)}; only floating parameters are trainable")
    input_shapes = tuple(x.shape for x in examples)
    leaf_shapes = tuple(np.shape(leaf) for leaf in leaves)
    leaf_dtypes = tuple(jnp.result_type(leaf) for leaf in leaves)
    leaf_structs = [jax.ShapeDtypeStruct(s, d) for s, d in zip(leaf_shapes, leaf_dtypes)]
    unflatten = _unflattener(treedef, leaf_shapes, leaf_dtypes)
    shareable = isinstance(module, linen.Module) and not constants

    def variant(kwargs):
        """(Function, output treedef, output shapes) of the module called with ``kwargs``."""
        with_kw = _with_kwargs(kwargs)
        try:
            out = jax.eval_shape(
                lambda tree, *xs: call(jax.tree_util.tree_unflatten(treedef, tree), xs,
                                       dict(kwargs.items)), leaf_structs, *examples)
        except Exception as e:
            raise ValueError(f"from_flax: {kind} failed on an example input of shape {shapes}"
                             f"{with_kw} (one example, no batch dimension): "
                             f"{type(e).__name__}: {e}") from e
        out_leaves, out_treedef = jax.tree_util.tree_flatten(out)
        if not out_leaves:
            raise ValueError(f"from_flax: {kind}{with_kw} returned no arrays")
        for o in out_leaves:
            if not jnp.issubdtype(o.dtype, jnp.floating):
                raise ValueError(f"from_flax: {kind}{with_kw} returns a {o.dtype} array; "
                                 "dynax values are float32")
        share = None
        if shareable:
            share = (module, treedef, leaf_shapes, tuple(map(str, leaf_dtypes)), input_shapes,
                     kwargs)
            try:
                hash(share)
            except TypeError:  # a module with unhashable fields gets its own Function
                share = None
        fn = _SHARED_FUNCTIONS.get(share) if share is not None else None
        if fn is None:
            fn = _block_function(call, unflatten, len(examples), len(out_leaves),
                                 default_name, kwargs)
            if share is not None:
                _SHARED_FUNCTIONS[share] = fn
        return fn, out_treedef, [tuple(o.shape) for o in out_leaves]

    first = variant(defaults)  # checks the module on the example: nothing is added if it fails
    sub = _fresh_subcollection(pc, name or default_name)
    dparams = []
    for path, leaf in path_leaves:
        value = np.asarray(leaf, np.float32)
        dparams.append(sub.add_parameters(value.shape or (1,), init=value.reshape(-1)
                                          if value.shape == () else value,
                                          name=_path_name(path)))
    return FlaxBlock(module, sub, dparams, variant, (defaults, first), unflatten, input_shapes,
                     constants)
