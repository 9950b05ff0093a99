"""Boundary fusion: adjacent hook-free layers of a chain replayed as one forward + backward.

A host boundary after every layer is what hooks need, and what costs time where layers are
small (each replayed executable pays the runtime's per-call cost). `sequential_vjp(...,
fuse=True)` pays it only where a replay-time hook sits: each maximal run of layers that have
no replay-time hook (and the same settings) becomes one `FusedSegment`, a GraphedCallable of
the composed chain with the layers' own key streams threaded through it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax

from jaxgraph import _graphed as graphed_lib
from jaxgraph import _hooks as hooks_lib
from jaxgraph import _pullback as pullback_lib
from jaxgraph import _signature as sig_lib


@dataclasses.dataclass(frozen=True)
class Composed:
  """`chain(params, x, *consts, key=None)`: `x = fns[i](params[i], x, *consts[, key=key[i]])`
  in turn, each function as its layer's executables run it.

  The consts (`sequential_vjp(..., consts=...)`) are shared by every function and get no
  gradient: the chain stops it, so its backward does not compute it. Equal (and hashed) by
  its fields, so identical segments share one capture.

  Attributes:
    fns: the layers' functions.
    remat_policy: the layers' `jax.checkpoint` policy, applied to each function (as each
      layer's capture applies it), not around the chain: the chain then keeps what its
      layers keep. Around the chain it would recompute the activations between layers in
      the backward, where each layer's backward reads them as inputs.
    barriers: an optimization barrier on the activation between two functions (and on its
      cotangent in the backward), so that XLA fuses no op of one layer with one of the next:
      the fused executables run the per-layer kernels and compute what the layers do one by
      one. Only the activation: params, keys and consts that came out of a barrier would be
      new values, kept for the backward as copies.
  """

  fns: tuple[Callable[..., Any], ...]
  remat_policy: Callable[..., bool] | None = None
  barriers: bool = True

  @property
  def __name__(self) -> str:
    return "chain"

  def __call__(self, params: Sequence[Any], x: Any, *consts: Any,
               key: Sequence[Any] | None = None) -> Any:
    consts = jax.lax.stop_gradient(consts)
    for i, (fn, p) in enumerate(zip(self.fns, params)):
      if self.remat_policy is not None:
        fn = jax.checkpoint(fn, policy=self.remat_policy, prevent_cse=False)
      if self.barriers and i:
        x = jax.lax.optimization_barrier(x)
      x = fn(p, x, *consts) if key is None else fn(p, x, *consts, key=key[i])
    return x


def fusable(layer: graphed_lib.GraphedCallable) -> bool:
  """Whether a layer may share executables with its neighbours: no replay-time hook (a hook
  needs the host boundary)."""
  hooks = layer.phase_hooks["replay"]
  return not any(getattr(hooks, kind) for kind in hooks_lib.HOOK_KINDS)


def per_layer(grads: Any, lo: int, hi: int) -> list[Any]:
  """The params gradients of a replayed run `[lo, hi)` (its pullback's, or its `wgrad()`'s
  first entry), one per layer: a fused segment's are a tuple of them, a layer's its own, and
  None (weights deferred to the wgrad) stands for each layer's."""
  if grads is None:
    return [None] * (hi - lo)
  return list(grads) if hi - lo > 1 else [grads]


def longest_run(fuse: bool | int, where: str) -> int | None:
  """The longest fused run that `where`'s `fuse=` asks for: None (no bound) for True, 1 (every
  layer alone) for False, else the int, at least 1."""
  if isinstance(fuse, bool):
    return None if fuse else 1
  if isinstance(fuse, int) and fuse >= 1:
    return fuse
  raise TypeError(f"{where} takes fuse= a bool, or an int >= 1 (the longest fused run, in "
                  f"layers), got {fuse!r}.")


def runs(layers: Sequence[graphed_lib.GraphedCallable], longest: int | None = None
         ) -> list[tuple[int, int]]:
  """`[lo, hi)` runs of `layers`: maximal runs of fusable layers from one `make_graphed`
  call with the same offload setting, each layer at most once in a run (a repeated layer
  draws a new key per call), of at most `longest` layers (None: no bound); every other
  layer is a run of its own."""
  runs: list[tuple[int, int]] = []
  members: set[graphed_lib.GraphedCallable] = set()  # of the last run
  for i, layer in enumerate(layers):
    if (runs and layer not in members and fusable(layer)
        and (longest is None or runs[-1][1] - runs[-1][0] < longest)
        and _joins(layers[runs[-1][0]], layer)):
      runs[-1] = (runs[-1][0], i + 1)
      members.add(layer)
    else:
      runs.append((i, i + 1))
      members = {layer}
  return runs


def _joins(first: graphed_lib.GraphedCallable, layer: graphed_lib.GraphedCallable) -> bool:
  return (fusable(first) and layer.config is first.config
          and layer.offloader.enabled == first.offloader.enabled)


class FusedSegment(graphed_lib.LayerGroup):
  """Adjacent layers replayed as one forward and one backward executable.

  With `delay_wgrad=True` layers the chain's backward is split as a layer's is
  (`_capture.split_backward`): one dgrad executable, which returns the input cotangent and
  stashes what every layer's weight products need, and one wgrad executable with all of
  them. The segment shares its layers' `Config`, so their `wgrad_argnums`: the chain's
  argument 0 is the tuple of the layers' params, as a layer's argument 0 is its params.

  Keys come from each layer's own stream (or `keys=`), so a fused replay computes what the
  layers would one by one, and advances the same counters. Captures and compiles are counted
  on the first layer's `stats`; replays on every layer's.
  """

  def __init__(self, layers: Sequence[graphed_lib.GraphedCallable]):
    first = layers[0]
    chain = Composed(tuple(layer.fn for layer in layers), remat_policy=first.config.remat_policy)
    super().__init__(layers, chain, offload=first.offloader.enabled,
                     name=f"fused({first.name}..{layers[-1].name})")

  @property
  def remat_policy(self) -> None:
    return None  # the chain applies it per function

  @property
  def warns_of_constant_keys(self) -> bool:
    return False  # a constant key is in its layer at every signature: that capture warned

  def differentiated(self, signature: sig_lib.Signature) -> tuple[int, ...]:
    """With a `grad_mask`: each layer's params leaves as its mask says of `(params_i, x,
    *consts)`, the input `x` as the first layer's says; the consts none (the chain stops
    their gradient)."""
    mask = self.config.grad_mask
    if mask is None:
      return super().differentiated(signature)
    params, x, *consts = jax.tree.unflatten(
        signature.treedef, [sig_lib.abstract(s) for s in signature.leaves])
    flags: list[bool] = []
    for p in params:
      flags += pullback_lib.mask_flags(mask, (p, x, *consts))[:len(jax.tree.leaves(p))]
    n_first = len(jax.tree.leaves(params[0]))
    flags += pullback_lib.mask_flags(mask, (params[0], x, *consts))[
        n_first:n_first + len(jax.tree.leaves(x))]
    flags += [False] * len(jax.tree.leaves(consts))
    return pullback_lib.differentiated_leaves(signature, flags)

  def exclusive(self) -> Any:
    acquired = []
    try:
      for owner in (self, *self._layers):
        acquired.append(graphed_lib.GraphedCallable.exclusive(owner))
    except BaseException:
      for release in acquired:
        release.__exit__(None, None, None)
      raise
    return _ReleaseAll(acquired)

  def replayable(self, signature: sig_lib.Signature) -> bool:
    """Whether `signature` is captured or may be (within `max_captures`); otherwise the
    layers run one by one, each under its own max_captures and fallback."""
    entries = self.executables.entries
    return signature in entries or len(entries) < self.config.max_captures

  def vjp_chain(self, params: Sequence[Any], x: Any, consts: tuple[Any, ...],
                keys: Sequence[jax.Array] | None) -> tuple[Any, graphed_lib.Pullback] | None:
    """The fused forward of `(params, x, *consts)`; None where it cannot run fused (tracers,
    or a signature beyond max_captures): the caller then runs the layers one by one. The
    pullback returns `(params grads, x grad, *zero grads of the consts)`; with
    `delay_wgrad=True` (`wgrad_argnums=(0,)`) the params grads are None there, and
    `pullback.wgrad()[0]` returns them, a tuple of one per layer."""
    args = (tuple(params), x, *consts)
    leaves, treedef = jax.tree.flatten(args)
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
      return None
    if keys is not None:
      for layer, key in zip(self._layers, keys):
        layer.flatten((), key, {})  # the same key checks as an unfused call
    signature = sig_lib.signature_of(leaves, treedef)
    if not self.replayable(signature):
      return None
    with self.exclusive():
      return self.forward(args, leaves, treedef, None if keys is None else tuple(keys),
                          phase="replay", iteration=self.counts.replays, microbatch=0,
                          with_pullback=True, signature=signature)


class _ReleaseAll:
  __slots__ = ("_releases",)

  def __init__(self, releases: list[Any]):
    self._releases = releases

  def __enter__(self) -> None:
    pass

  def __exit__(self, *exc: Any) -> None:
    for release in reversed(self._releases):
      release.__exit__(None, None, None)


def segment(layers: Sequence[graphed_lib.GraphedCallable]) -> FusedSegment:
  """The FusedSegment of these layers, made once and kept with their `make_graphed` call."""
  config = layers[0].config
  key = tuple(layers)
  with config.lock:
    found = config.segments.get(key)
    if found is None:
      found = config.segments[key] = FusedSegment(layers)
  return found

