"""Flax adapters: an NNX or Linen module as a pure layer function plus its params.

`make_graphed` captures pure functions of arrays. A Flax module is turned into one by
splitting it once, on the host, into its structure and its params; the returned function
merges them again inside the trace and threads the key for dropout:

  fn, params = jaxgraph.flax.nnx_layer(block)            # or linen_layer(module, variables)
  layer = jaxgraph.make_graphed(fn, sample_args=(params, x), rng=True)
  y, pullback = layer.vjp(params, x)                      # the key comes from the layer's stream
  params_grads, x_grads = pullback(ct)
  nnx.update(block, params)                               # write trained params back

Identical modules (equal NNX graph structure, or equal Linen modules and apply arguments,
whatever the Linen modules' names) give equal functions, so N identical blocks compile once.
State a layer updates (a KV cache, BatchNorm statistics) is an argument and an output of the
function: `linen_layer(..., mutable=("cache",))`, `nnx_layer(..., mutable=nnx.Cache)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping, Sequence, overload

import jax
from flax import core as flax_core
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

  With a `mutable` filter (`nnx.BatchStat`, `nnx.Cache`) the function is `fn(params, state,
  *inputs, key=None) -> (out, new_state)`: the variables it selects are merged in from
  `state` and returned after the call, updated; the state output carries no gradient
  (`jax.lax.stop_gradient`): its cotangent is ignored, pass zeros.

  Attributes:
    graphdef: the module's graph structure (`nnx.split`'s first result).
    stream_tags: the tags of its RNG streams (e.g. `("dropout",)`), reseeded from `key`.
    rngs_argument: if set, the module call instead gets `nnx.Rngs(key)` as this keyword
      (for modules that take call-time RNGs: `self.drop(h, rngs=rngs)`). Every use of it
      draws a fresh key (`fold_in(key, n)` for the n-th draw), so several dropout sites
      fed the one `rngs` get independent masks; each stream name (`rngs.dropout`,
      `rngs["attention"]`) falls back to that one default stream.
    mutable: the filter of the variables passed in and returned as state, or None for a
      stateless layer.
  """

  def __init__(self, name: str, graphdef: nnx.GraphDef, rng_state: nnx.State,
               stream_tags: tuple[str, ...], rngs_argument: str | None,
               wrt: Any = nnx.Param, mutable: Any = None):
    self.graphdef = graphdef
    self.stream_tags = stream_tags
    self.rngs_argument = rngs_argument
    self.mutable = mutable
    self._wrt = wrt
    self._rng_state = _fresh(rng_state)
    self._identity = (graphdef, jax.tree.structure(rng_state), stream_tags, rngs_argument,
                      None if mutable is None else (wrt, mutable))
    self.__name__ = name

  def __eq__(self, other: object) -> bool:
    return isinstance(other, NnxLayer) and self._identity == other._identity

  def __hash__(self) -> int:
    return hash(self._identity)

  def __repr__(self) -> str:
    mutable = "" if self.mutable is None else f", mutable={self.mutable}"
    return f"NnxLayer({self.__name__}, stream_tags={self.stream_tags}{mutable})"

  def module(self, params: nnx.State, state: nnx.State | None = None) -> nnx.Module:
    """A module of this structure holding `params` (and `state`, for a `mutable` layer;
    and the RNG state of `nnx_layer` time)."""
    states = (params,) if state is None else (params, state)
    return nnx.merge(self.graphdef, *states, _fresh(self._rng_state))

  def __call__(self, params: nnx.State, *inputs: Any, key: jax.Array | None = None) -> Any:
    """Merges `params` into the module, reseeds its RNG streams from `key` (or passes
    `nnx.Rngs(key)` as `rngs_argument`), calls it. With `mutable`, the first input is the
    state and the result is `(out, new_state)`."""
    if self.mutable is None:
      return self._call(self.module(params), inputs, key)
    state, inputs = _state_input(self, inputs, "mutable variables")
    module = self.module(params, state)
    out = self._call(module, inputs, key)
    new_state = nnx.split(module, self._wrt, nnx.RngState, self.mutable, ...)[3]
    return out, _returned_state(
        self, state, new_state, "Create every variable the layer writes before nnx_layer "
        "(for a KV cache, init_cache), and pass the state nnx_layer returned.")

  def _call(self, module: nnx.Module, inputs: Sequence[Any], key: jax.Array | None) -> Any:
    if key is None:
      return module(*inputs)
    if self.rngs_argument is not None:
      # Not the raw key: nnx.Dropout uses a raw key as is, so every site given it would
      # draw the same mask. An Rngs built here, inside the trace, yields a new key per use.
      return module(*inputs, **{self.rngs_argument: nnx.Rngs(key)})
    if self.stream_tags:
      nnx.reseed(module, **{tag: key for tag in self.stream_tags})
    return module(*inputs)


def _state_input(layer: Any, inputs: Sequence[Any], what: str) -> tuple[Any, list[Any]]:
  """A stateful layer's inputs `(state, *inputs)` split; its state missing is a TypeError."""
  if not inputs:
    raise TypeError(f"{layer!r} takes (params, state, *inputs): the state of its {what} is "
                    "missing.")
  state, *rest = inputs
  return state, rest


def _returned_state(layer: Any, state: Any, new_state: Any, fix: str) -> Any:
  """`new_state` as a stateful layer returns it (no gradient), once it has the structure of
  `state`, so that it can be passed back on the next call; `fix` says how to get there."""
  if jax.tree.structure(new_state) != jax.tree.structure(state):
    raise ValueError(
        f"{layer!r}: the call left its state of another structure than the state passed in, "
        f"so it could not be passed back on the next call:\n  in:  "
        f"{jax.tree.structure(state)}\n  out: {jax.tree.structure(new_state)}\n{fix}")
  return jax.lax.stop_gradient(new_state)


def _type_name(cls: type) -> str:
  """`nnx.BatchStat` for Flax's variable types, the bare name for the user's own."""
  return f"nnx.{cls.__name__}" if cls.__module__.startswith("flax.nnx") else cls.__name__


@overload
def nnx_layer(module: nnx.Module, *, wrt: Any = ..., rngs_argument: str | None = ...,
              mutable: None = ...) -> tuple[NnxLayer, nnx.State]: ...


@overload
def nnx_layer(module: nnx.Module, *, wrt: Any = ..., rngs_argument: str | None = ...,
              mutable: Any) -> tuple[NnxLayer, nnx.State, nnx.State]: ...


def nnx_layer(module: nnx.Module, *, wrt: Any = nnx.Param, rngs_argument: str | None = None,
              mutable: Any = None
              ) -> tuple[NnxLayer, nnx.State] | tuple[NnxLayer, nnx.State, nnx.State]:
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
    mutable: a filter of the variables the layer updates, passed in and returned as state
      (`nnx.BatchStat`, `nnx.Cache`, or a tuple of them); the function is then
      `fn(params, state, *inputs, key=None) -> (out, new_state)`. Create a KV cache
      before splitting (`init_cache`), so the state keeps its shape. The state holds the
      module's own arrays: donated (`donate_argnums=(1,)`), they are deleted in the module
      too; write the last state back with `nnx.update(module, state)`.

  Returns:
    `(fn, params)`: `fn(params, *inputs, key=None)` (an `NnxLayer`) and the `nnx.State` of
    `wrt` variables; with `mutable`, `(fn, params, state)`. Grads of `params` are an
    `nnx.State` of the same structure: they go to `optax` directly, or to an
    `nnx.Optimizer` through `join_states`. Write trained params (and the last state)
    back with `nnx.update(module, params)`.

  Raises:
    ValueError: if the module holds state that is neither selected by `wrt` or `mutable`
      nor RNG state (e.g. `nnx.BatchStat` without `mutable=nnx.BatchStat`).
  """
  wrt, mutable = _as_filter(wrt), _as_filter(mutable)
  for name, value in (("wrt", wrt), ("mutable", mutable)):
    try:
      hash(value)
    except TypeError as e:
      raise TypeError(f"nnx_layer: {name}={value!r} is not hashable; a layer function is "
                      "hashed so that identical layers share one capture. Pass a type or a "
                      f"tuple of types ({name}=(nnx.BatchStat, nnx.Cache)).") from e
  if mutable is None:
    graphdef, params, rng_state, rest = nnx.split(module, wrt, nnx.RngState, ...)
  else:
    graphdef, params, rng_state, state, rest = nnx.split(module, wrt, nnx.RngState, mutable,
                                                         ...)
  if jax.tree.leaves(rest):
    flat = list(nnx.to_flat_state(rest))
    found = ", ".join(f"{'.'.join(map(str, path))} ({type(variable).__name__})"
                      for path, variable in flat)
    types = tuple(dict.fromkeys(_type_name(type(variable)) for _, variable in flat))
    fix = types[0] if len(types) == 1 else f"({', '.join(types)})"
    raise ValueError(
        f"nnx_layer: {type(module).__name__} holds state that is neither params nor RNG "
        f"state: {found}. Pass it as state with nnx_layer(module, mutable={fix}): the "
        "function then takes and returns it, fn(params, state, *inputs) -> (out, "
        "new_state). For state the layer only reads and that should get gradients, select "
        "it with wrt=(nnx.Param, <its type>) instead.")
  tags = sorted({variable.tag for _, variable in nnx.to_flat_state(rng_state)
                 if isinstance(variable, nnx.RngKey)})
  fn = NnxLayer(type(module).__name__, graphdef, rng_state, tuple(tags), rngs_argument,
                wrt, mutable)
  if mutable is None:
    return fn, params
  if not jax.tree.leaves(state):
    raise ValueError(
        f"nnx_layer got mutable={mutable!r}, but no variable of {type(module).__name__} is "
        f"left for it: wrt={wrt!r} selects them first, or the module holds none yet (a KV "
        "cache: call its init_cache first). Drop that type from wrt, or create the state "
        "before nnx_layer.")
  return fn, params, state


def _as_filter(value: Any) -> Any:
  """An NNX filter as a hashable value: a list of filters becomes a tuple (the same filter)."""
  return tuple(value) if isinstance(value, list) else value


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
  """A Linen module's `apply` as a pure function, for `make_graphed`.

  Built by `linen_layer`. Without mutable collections it is `fn(params, *inputs,
  key=None)`: `module.apply({"params": params}, *inputs, rngs={rng_collection: key},
  **apply_kwargs)`, with `rngs` left out when `key` is None. With `mutable` collections
  (a KV cache, BatchNorm statistics) it is `fn(params, state, *inputs, key=None) -> (out,
  state)`: `module.apply({"params": params, **state}, *inputs, mutable=mutable, ...)`,
  returning the updated collections as the new state. The state output carries no
  gradient (`jax.lax.stop_gradient`, as Linen's `has_aux` training step treats it): its
  cotangent is ignored, pass zeros.

  The function applies the module unbound and without its name (`module.clone(name=None,
  parent=None)`): a top-level `apply` computes the same with any name, so blocks named
  `block_0`, `block_1`, ... or taken from a bound parent are equal functions and share one
  capture. Linen folds a submodule's path into its RNG keys: a block graphed alone is
  the top level, so at one key its dropout masks differ from those the block draws inside
  the whole model (`block_0/Dropout_0` there, `Dropout_0` here).

  Attributes:
    module: the Linen module, unbound and without name or parent.
    rng_collection: the RNG collection the key is given to ("dropout").
    apply_kwargs: keyword arguments bound to every `apply` (e.g. `train=True`).
    mutable: the collections passed in and returned as state (e.g. `("cache",)`); empty
      for a stateless layer.
  """

  def __init__(self, module: nn.Module, rng_collection: str, apply_kwargs: Mapping[str, Any],
               mutable: tuple[str, ...] = ()):
    # Deep: a submodule held as a field is unbound and name-free too (a shallow clone keeps
    # it bound to the parent's scope, and a bound module does not hash).
    self.module = module.clone(name=None, parent=None, _deep_clone=True)
    self.rng_collection = rng_collection
    self.apply_kwargs = dict(apply_kwargs)
    self.mutable = mutable
    self._identity = (self.module, rng_collection, tuple(sorted(self.apply_kwargs.items())),
                      mutable)
    self.__name__ = type(module).__name__

  def __eq__(self, other: object) -> bool:
    return isinstance(other, LinenLayer) and self._identity == other._identity

  def __hash__(self) -> int:
    return hash(self._identity)

  def __repr__(self) -> str:
    mutable = f", mutable={self.mutable}" if self.mutable else ""
    return f"LinenLayer({self.__name__}, apply_kwargs={self.apply_kwargs}{mutable})"

  def __call__(self, params: Any, *inputs: Any, key: jax.Array | None = None) -> Any:
    """`module.apply({"params": params}, *inputs, rngs={rng_collection: key},
    **apply_kwargs)`; with `mutable`, the first input is the state and the result is
    `(out, new_state)`."""
    rngs = None if key is None else {self.rng_collection: key}
    if not self.mutable:
      return self.module.apply({"params": params}, *inputs, rngs=rngs, **self.apply_kwargs)
    state, inputs = _state_input(self, inputs, f"mutable collections {list(self.mutable)}")
    state = flax_core.unfreeze(state)
    out, new_state = self.module.apply({"params": params, **state}, *inputs, rngs=rngs,
                                       mutable=list(self.mutable), **self.apply_kwargs)
    # unfrozen: with flax_return_frozendict=True apply returns a FrozenDict, a pytree of
    # another structure than the dict passed in
    new_state = flax_core.unfreeze({name: new_state[name] for name in self.mutable})
    return out, _returned_state(
        self, state, new_state, "Pass the state linen_layer returned, from variables that "
        "`init` created with every variable the layer writes (for a KV cache, init with the "
        "decode flag on).")


def _unhashable(value: Any, path: str) -> list[tuple[str, Any]]:
  """(path, value) of each unhashable value in `value`, into a module's fields by name."""
  if isinstance(value, nn.Module):
    return [found for field in dataclasses.fields(value) if field.name not in ("parent", "name")
            for found in _unhashable(getattr(value, field.name), f"{path}.{field.name}")]
  try:
    hash(value)
  except TypeError:
    return [(path, value)]
  return []


def _unhashable_error(module: nn.Module, apply_kwargs: Mapping[str, Any]) -> TypeError | None:
  """A TypeError naming the module field or apply kwarg that is not hashable, if any."""
  fields = _unhashable(module, type(module).__name__)
  if fields:
    named = ", ".join(f"{p} ({type(v).__name__})" for p, v in fields)
    return TypeError(
        f"linen_layer: the field {named} of the module is not hashable, and a layer "
        "function is hashed by its module so that identical layers share one capture. "
        "Make it hashable (Flax already takes lists as tuples and dicts as FrozenDicts); "
        "arrays go in as params or inputs.")
  kwargs = [(k, v) for k, v in apply_kwargs.items() if _unhashable(v, k)]
  if kwargs:
    named = ", ".join(f"{k} ({type(v).__name__})" for k, v in kwargs)
    return TypeError(
        f"linen_layer: apply_kwargs must be hashable (bools, ints, strings, tuples), got "
        f"{named}; pass arrays as positional inputs of the layer instead, and lists as "
        "tuples.")
  return None


def _mutable_collections(module: nn.Module, variables: Mapping[str, Any],
                         mutable: str | Sequence[str] | bool) -> tuple[str, ...]:
  """`mutable` as a tuple of collection names, checked against `variables`."""
  name = type(module).__name__
  others = sorted(set(variables) - {"params"})
  if mutable is True:
    raise TypeError(
        f"linen_layer got mutable=True for {name}: name the collections passed in and out "
        f"as state instead, e.g. mutable={tuple(others) or ('cache',)} (True would make "
        "params mutable too).")
  if mutable is False or mutable is None:
    mutable = ()
  elif isinstance(mutable, str):
    mutable = (mutable,)
  if (not isinstance(mutable, Sequence)
      or not all(isinstance(c, str) and c for c in mutable)):
    raise TypeError(f"linen_layer: mutable must be a collection name or a sequence of them, "
                    f"e.g. mutable=('cache',), got {mutable!r}.")
  mutable = tuple(dict.fromkeys(mutable))
  if "params" in mutable:
    raise ValueError(f"linen_layer got mutable={mutable} for {name}: params are the layer's "
                     "first argument (they get gradients); list only the other collections.")
  missing = [c for c in mutable if c not in variables]
  if missing:
    raise ValueError(
        f"linen_layer got mutable={mutable}, but the variables of {name} hold no "
        f"{missing} collection (they hold {sorted(variables)}). Pass what `init` returned "
        "when it created them (for a KV cache, init with the decode flag on); the layer "
        "must not create variables at apply, or its state would change shape.")
  unlisted = [c for c in others if c not in mutable]
  if unlisted:
    raise ValueError(
        f"linen_layer: the variables of {name} hold collections {unlisted} besides 'params'. "
        f"Pass them as state: linen_layer(module, variables, mutable={tuple(others)}) gives "
        "(fn, params, state) and fn(params, state, *inputs) returns (out, new_state); "
        "collections the layer only reads come back unchanged.")
  return mutable


@overload
def linen_layer(module: nn.Module, variables: Mapping[str, Any], *,
                rng_collection: str = ..., mutable: Literal[False] = ...,
                **apply_kwargs: Any) -> tuple[LinenLayer, Any]: ...


@overload
def linen_layer(module: nn.Module, variables: Mapping[str, Any], *,
                rng_collection: str = ..., mutable: str | Sequence[str],
                **apply_kwargs: Any) -> tuple[LinenLayer, Any, Any]: ...


def linen_layer(module: nn.Module, variables: Mapping[str, Any], *,
                rng_collection: str = "dropout", mutable: str | Sequence[str] | bool = False,
                **apply_kwargs: Any) -> tuple[LinenLayer, Any] | tuple[LinenLayer, Any, Any]:
  """Turns a Linen module and its variables into a pure layer function and its params.

  Identical modules give equal functions whatever their names, so N blocks built as
  `Block(cfg, name=f"block_{i}")` (or taken from a bound parent) compile once.

  With `mutable`, the named collections are the layer's state, passed in and returned as
  in Linen's `apply(..., mutable=...)`. A KV-cache decode loop (lm1b style), with the
  cache updated in place:

    variables = block.init(key, jnp.ones((batch, max_len, d)), decode=True)  # the cache
    fn, params, cache = linen_layer(block, variables, mutable=("cache",), decode=True)
    step = make_graphed(fn, sample_args=(params, cache, prompt), inference_only=True,
                        donate_argnums=(1,))
    y, cache = step(params, cache, prompt)           # prefill: a signature of its own
    for _ in range(n):
      y, cache = step(params, cache, next_token(y))  # one token: replays, never recompiles

  `state` holds the arrays of `variables` themselves: once donated they are deleted there
  too (copy them first to keep them).

  Training with BatchNorm: `fn, params, stats = linen_layer(m, v, mutable="batch_stats",
  train=True)`; `(y, stats), pullback = layer.vjp(params, stats, x)`; `grads, _, g_x =
  pullback((ct, jax.tree.map(jnp.zeros_like, stats)))`.

  Args:
    module: the Linen module (e.g. one block); its name and parent are dropped (see
      `LinenLayer`).
    variables: what `module.init` returned: "params", plus the collections in `mutable`.
    rng_collection: the RNG collection that receives the threaded key.
    mutable: the collections passed in and returned as state (`"cache"`, `("cache",)` or
      `["batch_stats"]`, as for Linen's `apply`); every collection of `variables` other
      than "params" must be listed. `True` is refused: name the collections.
    **apply_kwargs: static keyword arguments for every `apply` (e.g. `train=True`); they
      must be hashable (bools, ints, strings): arrays go in as positional inputs.

  Returns:
    Without `mutable`: `(fn, params)`, `fn(params, *inputs, key=None)` (a `LinenLayer`)
    and `variables["params"]`. With `mutable`: `(fn, params, state)`, `fn(params, state,
    *inputs, key=None) -> (out, new_state)` and the state, `{collection:
    variables[collection]}` for each collection in `mutable`.

  Raises:
    ValueError: for collections besides "params" not listed in `mutable` (the message
      gives the `mutable=` to pass), or listed ones `variables` lacks.
    TypeError: for a module field or an `apply_kwargs` value that is not hashable (the
      message names it: make a list a tuple), or a `mutable` that is not collection names.
  """
  mutable = _mutable_collections(module, variables, mutable)
  fn = LinenLayer(module, rng_collection, apply_kwargs, mutable)
  try:
    hash(fn)
  except TypeError as e:
    error = _unhashable_error(fn.module, apply_kwargs)
    if error is None:
      raise
    raise error from e
  params = variables.get("params", {})
  if not mutable:
    return fn, params
  return fn, params, flax_core.unfreeze({c: variables[c] for c in mutable})
