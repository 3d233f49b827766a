"""dynax: DyNet-style dynamic computation graphs on JAX, autobatched on the fly.

Data flows one way: ``graph`` records per-instance nodes, ``batcher`` plans which of them
run together, ``executor`` runs each batch as one cached, jitted, vmapped XLA kernel
(forward, and ``jax.vjp`` backward), ``nn`` holds parameters and updates them with Optax.
"""
from . import nn
from .device import (get_device, set_compilation_cache, set_cpu_threads, set_device,
                     set_xla_thread_nice)
from .errors import (ArgumentTypeError, DTypeError, DynaxError, IndexOutOfRangeError,
                     InvalidArgumentError, NonFiniteValueError, NonScalarBackwardError,
                     PrecisionWarning, ShapeError, StaleExpressionError)
from .graph import ComputationGraph, Expression, current_graph, renew_cg
from .heap import settled_heap
from .nn import (AdadeltaTrainer, AdagradTrainer, AdamTrainer, AmsgradTrainer,
                 CyclicalSGDTrainer, EGTrainer, LookupParameter, MomentumSGDTrainer, Parameter,
                 ParameterCollection, RMSPropTrainer, SimpleSGDTrainer, Trainer, load, save)
# DyNet spells builders and initializers at the top level (dy.LSTMBuilder); they live in dx.nn
from .nn import (BiRNNBuilder, ChildSumTreeLSTMBuilder, ClassFactoredSoftmaxBuilder,
                 CompactVanillaLSTMBuilder, ConstInitializer, CoupledLSTMBuilder,
                 GlorotInitializer, GRUBuilder, IdentityInitializer, LSTMBuilder,
                 NormalInitializer, NumpyInitializer, SimpleRNNBuilder, StandardSoftmaxBuilder,
                 TreeLSTMBuilder, UniformInitializer, VanillaLSTMBuilder)
from .ops.core import (abs, add, affine_transform, average, binary_log_loss, cdiv, cmult,
                       concatenate, concatenate_cols, div, dot_product, dropout, emax, esum, exp,
                       hinge, input, inputTensor, inputVector, log, log_softmax, logistic,
                       lookup, matmul, mul, negate, ones, parameter, pick, pickneglogsoftmax,
                       random_bernoulli, random_gumbel, random_normal, random_uniform, rectify,
                       reshape, scalarInput, softmax, sqrt, square, squared_distance, sub,
                       sum_elems, tanh, transpose, zeros)
from .ops.extra import *  # noqa: F401,F403  (DyNet's further ops; see extra.__all__)
from .ops.conv import (conv2d, conv2d_bias, filter1d_narrow, fold_rows, kmax_pooling, kmh_ngram,
                       maxpooling2d)
from .ops.function import Function, function

Model = ParameterCollection  # DyNet's older name for it
cg = current_graph  # DyNet's dy.cg(): the current graph


def forward(exprs) -> None:
    """Compute a list of expressions together (one autobatched pass over what is pending)."""
    exprs = list(exprs)
    for e in exprs:
        if not isinstance(e, Expression):
            raise ArgumentTypeError(f"forward: expected Expressions, got {type(e).__name__}")
        e.g.check_alive()
        if e.g is not exprs[0].g:
            raise ArgumentTypeError("forward: the expressions belong to different graphs "
                                    "(each thread builds its own); pass one graph's at a time")
    if exprs:
        # their values are also copied to the host together, so reading each one after
        # this (``e.npvalue()``, ``e.value()``) is a host-side lookup, not a device round trip
        exprs[0].g.fetch([e.v for e in exprs])


def release_memory() -> None:
    """Drop this thread's pooled arenas (values and gradients); they are re-created on
    demand. The values of the current graph go with them, so it ends: its expressions
    raise ``StaleExpressionError`` from now on, and the next operation starts a new graph.
    Reads after it run no backward pass ahead (a training loop's, see ``dynax/README.md``)
    until a ``backward()`` of a read loss, so they allocate no gradient arena."""
    from .graph.computation_graph import _engine, retire_current_graph
    retire_current_graph("whose values dx.release_memory() dropped")
    _engine().release_memory()


# DyNet names with no counterpart here, and what to write instead: a ported program's
# AttributeError says so (README, "Coming from DyNet")
_ONE_INSTANCE = ("there is no batch dimension: build one instance at a time and the "
                 "autobatcher batches them (dx.esum over a minibatch's losses)")
_NEW_GRAPH = "build a new graph (dx.renew_cg) per input and use dx.input"
_NO_REVERT = ("nodes of a discarded hypothesis may stay in the graph: backward runs only the "
              "loss's ancestors")
_DYNET_HINTS = {
    "lookup_batch": _ONE_INSTANCE, "pickneglogsoftmax_batch": _ONE_INSTANCE,
    "concatenate_to_batch": _ONE_INSTANCE, "sum_batches": _ONE_INSTANCE,
    "pick_batch_elem": _ONE_INSTANCE, "pick_batch_elems": _ONE_INSTANCE,
    "mean_batches": _ONE_INSTANCE, "reshape_batch": _ONE_INSTANCE,
    "vecInput": _NEW_GRAPH, "matInput": _NEW_GRAPH, "inputMatrix": "use dx.input(array)",
    "cg_checkpoint": _NO_REVERT, "cg_revert": _NO_REVERT,
    "strided_select": "use x[a:b] (dx.pick_range) or dx.select_rows / dx.select_cols",
    "FastLSTMBuilder": "use dx.nn.LSTMBuilder (or CoupledLSTMBuilder for peepholes)",
    "print_graphviz": "cg.stats() reports the graph's nodes and batches",
}


def __getattr__(name):
    hint = _DYNET_HINTS.get(name)
    if hint is None:
        raise AttributeError(f"module 'dynax' has no attribute {name!r}")
    raise AttributeError(f"module 'dynax' has no attribute {name!r} (DyNet's): {hint}")


__version__ = "0.1.0"
