"""jaxgraph: per-layer ahead-of-time capture and replay for JAX, with host hooks.

A port of the partial-capture semantics of Transformer Engine's and PyTorch's
`make_graphed_callables`: see docs/index.md.
"""

from jaxgraph import flat
from jaxgraph import fsdp
from jaxgraph import schedule
from jaxgraph.api import make_graphed
from jaxgraph.graphed import GraphedCallable, Pullback, Stats, sequential_vjp
from jaxgraph.hooks import HookEvent, Hooks, is_capturing

__version__ = "0.1.0"

__all__ = [
    "GraphedCallable",
    "HookEvent",
    "Hooks",
    "Pullback",
    "Stats",
    "flat",
    "fsdp",
    "is_capturing",
    "make_graphed",
    "schedule",
    "sequential_vjp",
]
