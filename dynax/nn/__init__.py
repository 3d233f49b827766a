"""Parameters, trainers and builders (RNNs, Tree-LSTMs, softmaxes)."""
from .parameters import LookupParameter, Parameter, ParameterCollection
from .flax_interop import FlaxBlock, from_flax  # after .parameters: that import sets up ops/graph
from .initializers import (ConstInitializer, GlorotInitializer, IdentityInitializer,
                           NormalInitializer, NumpyInitializer, UniformInitializer)
from .lstm_state import lstm_state
from .persistence import load, save
from .rnn import (BiRNNBuilder, CompactVanillaLSTMBuilder, CoupledLSTMBuilder, GRUBuilder,
                  LSTMBuilder, RNNState, SimpleRNNBuilder, VanillaLSTMBuilder)
from .softmax import ClassFactoredSoftmaxBuilder, StandardSoftmaxBuilder
from .trainers import (AdadeltaTrainer, AdagradTrainer, AdamTrainer, AmsgradTrainer,
                       CyclicalSGDTrainer, EGTrainer, MomentumSGDTrainer, RMSPropTrainer,
                       SimpleSGDTrainer, Trainer)
from .tree import ChildSumTreeLSTMBuilder, TreeLSTMBuilder

__all__ = ["LookupParameter", "Parameter", "ParameterCollection", "Trainer", "SimpleSGDTrainer",
           "AdagradTrainer", "MomentumSGDTrainer", "RMSPropTrainer", "AdadeltaTrainer",
           "AmsgradTrainer", "CyclicalSGDTrainer", "EGTrainer",
           "AdamTrainer", "SimpleRNNBuilder", "LSTMBuilder", "VanillaLSTMBuilder", "GRUBuilder",
           "BiRNNBuilder", "CoupledLSTMBuilder", "CompactVanillaLSTMBuilder",
           "RNNState", "TreeLSTMBuilder", "ChildSumTreeLSTMBuilder", "StandardSoftmaxBuilder",
           "ClassFactoredSoftmaxBuilder", "FlaxBlock", "from_flax", "save", "load",
           "ConstInitializer", "GlorotInitializer", "IdentityInitializer", "NormalInitializer",
           "NumpyInitializer", "UniformInitializer", "lstm_state"]
