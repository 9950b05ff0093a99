"""jaxgraph: per-layer ahead-of-time capture and replay for JAX, with host hooks.

A port of the partial-capture semantics of Transformer Engine's and PyTorch's
`make_graphed_callables`: see docs/index.md. The public names are `__all__` here and in the
public submodules it lists; modules named with a leading `_` are internal (docs/design.md).
"""

import importlib
import types

from jaxgraph import flat
from jaxgraph import fsdp
from jaxgraph import offload
from jaxgraph import prefetch
from jaxgraph import residuals
from jaxgraph import rng
from jaxgraph import schedule
from jaxgraph._api import make_graphed
from jaxgraph._chain import sequential_vjp
from jaxgraph._constants import ConstantWeightWarning
from jaxgraph._graphed import GraphedCallable, Stats
from jaxgraph._hooks import HookEvent, Hooks, is_capturing
from jaxgraph._pullback import Pullback, combine, partition

__version__ = "0.1.0"

# Imported on first use (`jaxgraph.flax.nnx_layer`): importing Flax more than doubles the
# import time of jaxgraph, which users of plain JAX functions should not pay.
_LAZY_SUBMODULES = ("flax",)

__all__ = [
    "ConstantWeightWarning",
    "GraphedCallable",
    "HookEvent",
    "Hooks",
    "Pullback",
    "Stats",
    "combine",
    "flax",
    "flat",
    "fsdp",
    "is_capturing",
    "make_graphed",
    "offload",
    "partition",
    "prefetch",
    "residuals",
    "rng",
    "schedule",
    "sequential_vjp",
]


def __getattr__(name: str) -> types.ModuleType:
  """`jaxgraph.flax` without an import of its own: imports the submodule on first access."""
  if name in _LAZY_SUBMODULES:
    return importlib.import_module(f"jaxgraph.{name}")
  raise AttributeError(f"module 'jaxgraph' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY_SUBMODULES))
