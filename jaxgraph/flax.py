"""Flax adapters: an NNX or Linen module as a pure layer function plus its params.

`make_graphed` captures pure functions of arrays. A Flax module is turned into one by
splitting it once, on the host, into its structure and its params; the returned function
merges them again inside the trace and threads the key for dropout:

  fn, params = jaxgraph.flax.nnx_layer(block)            # or linen_layer(module, variables)
  layer = jaxgraph.make_graphed(fn, sample_args=(params, x), rng=True)
  y, pullback = layer.vjp(params, x)                      # the key comes from the layer's stream
  params_grads, x_grads = pullback(ct)
  nnx.update(block, params)                               # write trained params back

Identical modules (equal NNX graph structure, or equal Linen modules and apply arguments)
give equal functions, so N identical blocks compile once.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
from flax import linen as nn
from flax import nnx

__all__ = ["LinenLayer", "NnxLayer", "join_states", "linen_layer", "nnx_layer"]


def _fresh(state: nnx.State) -> nnx.State:
  # New Variable objects created in the current trace: flax forbids mutating (dropout
  # advancing its RngCount) a Variable created outside it (`TraceContextError`).
  return jax.tree.map(lambda value: value, state)


class NnxLayer:
  """An NNX module's `__call__` as a pure function `fn(params, *inputs, key=None)`.

  Built by `nnx_layer`. Inside the trace it merges the module's graph structure with
  `params` and, when `key` is given, reseeds every RNG stream of the module exactly as
  `nnx.reseed(module, **{tag: key for tag in stream_tags})` does, then calls the module.
  Without `key` the module's RNG state as it was at `nnx_layer` time is used (a constant of
  the executable: the same dropout mask on every call; `make_graphed` warns when that
  happens). A module without RNG streams ignores `key`, so deterministic layers can share
  one `make_graphed(..., rng=True)` call with dropout layers.

  Attributes:
    graphdef: the module's graph structure (`nnx.split`'s first result).
    stream_tags: the tags of its RNG streams (e.g. `("dropout",)`), reseeded from `key`.
    rngs_argument: if set, the module call instead gets `nnx.Rngs(key)` as this keyword
      (for modules that take call-time RNGs: `self.drop(h, rngs=rngs)`). Every use of it
      draws a fresh key (`fold_in(key, n)` for the n-th draw), so several dropout sites
      fed the one `rngs` get independent masks; each stream name (`rngs.dropout`,
      `rngs["attention"]`) falls back to that one default stream.
  """

  def __init__(self, name: str, graphdef: nnx.GraphDef, rng_state: nnx.State,
               stream_tags: tuple[str, ...], rngs_argument: str | None):
    self.graphdef = graphdef
    self.stream_tags = stream_tags
    self.rngs_argument = rngs_argument
    self._rng_state = _fresh(rng_state)
    self._identity = (graphdef, jax.tree.structure(rng_state), stream_tags, rngs_argument)
    self.__name__ = name

  def __eq__(self, other: object) -> bool:
    return isinstance(other, NnxLayer) and self._identity == other._identity

  def __hash__(self) -> int:
    return hash(self._identity)

  def __repr__(self) -> str:
    return f"NnxLayer({self.__name__}, stream_tags={self.stream_tags})"

  def module(self, params: nnx.State) -> nnx.Module:
    """A module of this structure holding `params` (and the RNG state of `nnx_layer` time)."""
    return nnx.merge(self.graphdef, params, _fresh(self._rng_state))

  def __call__(self, params: nnx.State, *inputs: Any, key: jax.Array | None = None) -> Any:
    """Merges `params` into the module, reseeds its RNG streams from `key` (or passes
    `nnx.Rngs(key)` as `rngs_argument`), calls it."""
    module = self.module(params)
    if key is None:
      return module(*inputs)
    if self.rngs_argument is not None:
      # Not the raw key: nnx.Dropout uses a raw key as is, so every site given it would
      # draw the same mask. An Rngs built here, inside the trace, yields a new key per use.
      return module(*inputs, **{self.rngs_argument: nnx.Rngs(key)})
    if self.stream_tags:
      nnx.reseed(module, **{tag: key for tag in self.stream_tags})
    return module(*inputs)


def nnx_layer(module: nnx.Module, *, wrt: Any = nnx.Param,
              rngs_argument: str | None = None) -> tuple[NnxLayer, nnx.State]:
  """Splits an NNX module into a pure layer function and its params, for `make_graphed`.

  Args:
    module: the layer (e.g. one transformer block). Its `__call__` takes the inputs
      positionally. Dropout may hold a stream (`nnx.Dropout(rate, rngs=rngs)`), reseeded
      from the threaded key on every call; or the module takes call-time RNGs, see
      `rngs_argument`. Switch dropout off with `module.eval()` before splitting.
    wrt: the filter selecting the params (the first argument of the function, the one
      that gets gradients): `nnx.Param` by default.
    rngs_argument: the keyword under which the module's `__call__` takes call-time RNGs
      (e.g. "rngs" for `def __call__(self, x, *, rngs=None)`); it receives
      `nnx.Rngs(key)`, built from the threaded key inside the executable, so each dropout
      site that draws from it gets its own mask (the backward replays the same ones).

  Returns:
    `(fn, params)`: `fn(params, *inputs, key=None)` (an `NnxLayer`) and the `nnx.State` of
    `wrt` variables. Grads of `params` are an `nnx.State` of the same structure: they go to
    `optax` directly, or to an `nnx.Optimizer` through `join_states`. Write trained params
    back with `nnx.update(module, params)`.

  Raises:
    ValueError: if the module holds state that is neither selected by `wrt` nor RNG state
      (e.g. `nnx.BatchStat`): its updates could not leave the executable.
  """
  graphdef, params, rng_state, rest = nnx.split(module, wrt, nnx.RngState, ...)
  if jax.tree.leaves(rest):
    found = ", ".join(f"{'.'.join(map(str, path))} ({type(variable).__name__})"
                      for path, variable in nnx.to_flat_state(rest))
    raise ValueError(
        f"nnx_layer: {type(module).__name__} holds state that is neither params nor RNG "
        f"state: {found}. A graphed layer returns only its outputs, so updates to that state "
        "(e.g. BatchNorm statistics) would be lost. Use a stateless layer (LayerNorm instead "
        "of BatchNorm), or, for state the layer only reads, select it with wrt=(nnx.Param, "
        "<its type>) to pass it in as an argument (it then gets gradients too).")
  tags = sorted({variable.tag for _, variable in nnx.to_flat_state(rng_state)
                 if isinstance(variable, nnx.RngKey)})
  fn = NnxLayer(type(module).__name__, graphdef, rng_state, tuple(tags), rngs_argument)
  return fn, params


def join_states(model: nnx.Module, parts: Sequence[nnx.Module],
                states: Sequence[nnx.State]) -> nnx.State:
  """Joins the per-layer states of submodules of `model` into one `nnx.State` of `model`.

  Use it to hand the grads of graphed layers to one optimizer of the whole model,
  `nnx.Optimizer(model, tx, wrt=nnx.Param).update(model, join_states(model, parts, grads))`,
  or to write back every layer's params at once with `nnx.update(model, ...)`.

  Args:
    model: the model the parts belong to.
    parts: submodules of `model` (e.g. its blocks), each given to `nnx_layer`.
    states: one state per part (its params, or the grads of its params).

  Returns:
    An `nnx.State` of `model` holding exactly the given states at the parts' paths.
  """
  if len(parts) != len(states):
    raise ValueError(f"join_states got {len(parts)} parts but {len(states)} states.")
  paths = {id(node): path for path, node in nnx.iter_graph(model)}
  flat = {}
  for i, (part, state) in enumerate(zip(parts, states)):
    if id(part) not in paths:
      raise ValueError(f"join_states: parts[{i}] ({type(part).__name__}) is not a submodule "
                       f"of the {type(model).__name__} given as model.")
    for path, value in nnx.to_flat_state(state):
      flat[paths[id(part)] + tuple(path)] = value
  return nnx.from_flat_state(flat)


class LinenLayer:
  """A Linen module's `apply` as a pure function `fn(params, *inputs, key=None)`.

  Built by `linen_layer`: `module.apply({"params": params}, *inputs, rngs={collection:
  key}, **apply_kwargs)`, with `rngs` left out when `key` is None.

  Attributes:
    module: the Linen module.
    rng_collection: the RNG collection the key is given to ("dropout").
    apply_kwargs: keyword arguments bound to every `apply` (e.g. `train=True`).
  """

  def __init__(self, module: nn.Module, rng_collection: str, apply_kwargs: Mapping[str, Any]):
    self.module = module
    self.rng_collection = rng_collection
    self.apply_kwargs = dict(apply_kwargs)
    self._identity = (module, rng_collection, tuple(sorted(self.apply_kwargs.items())))
    self.__name__ = type(module).__name__

  def __eq__(self, other: object) -> bool:
    return isinstance(other, LinenLayer) and self._identity == other._identity

  def __hash__(self) -> int:
    return hash(self._identity)

  def __repr__(self) -> str:
    return f"LinenLayer({self.__name__}, apply_kwargs={self.apply_kwargs})"

  def __call__(self, params: Any, *inputs: Any, key: jax.Array | None = None) -> Any:
    """`module.apply({"params": params}, *inputs, rngs={rng_collection: key}, **apply_kwargs)`."""
    rngs = None if key is None else {self.rng_collection: key}
    return self.module.apply({"params": params}, *inputs, rngs=rngs, **self.apply_kwargs)


def linen_layer(module: nn.Module, variables: Mapping[str, Any], *,
                rng_collection: str = "dropout", **apply_kwargs: Any) -> tuple[LinenLayer, Any]:
  """Turns a Linen module and its variables into a pure layer function and its params.

  Args:
    module: the Linen module (e.g. one block).
    variables: what `module.init` returned; only the "params" collection is allowed.
    rng_collection: the RNG collection that receives the threaded key.
    **apply_kwargs: static keyword arguments for every `apply` (e.g. `train=True`); they
      must be hashable (bools, ints, strings): arrays go in as positional inputs.

  Returns:
    `(fn, params)`: `fn(params, *inputs, key=None)` (a `LinenLayer`) and
    `variables["params"]`.

  Raises:
    ValueError: for collections other than "params" (e.g. "batch_stats"), whose updates
      could not leave the executable.
    TypeError: for unhashable `apply_kwargs`.
  """
  others = sorted(set(variables) - {"params"})
  if others:
    raise ValueError(
        f"linen_layer: the variables of {type(module).__name__} hold collections {others} "
        "besides 'params'. A graphed layer returns only its outputs, so mutable collections "
        "(e.g. batch_stats) would not be updated; use a stateless layer (LayerNorm) or write "
        "the pure function yourself and return the new collections as outputs.")
  fn = LinenLayer(module, rng_collection, apply_kwargs)
  try:
    hash(fn)
  except TypeError as e:
    raise TypeError("linen_layer: apply_kwargs must be hashable (bools, ints, strings); pass "
                    "arrays as positional inputs of the layer instead.") from e
  return fn, variables.get("params", {})
