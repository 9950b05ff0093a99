"""FSDP prefetch across executables: a layer's forward gathers the next layer's weights.

Per-layer FSDP executables start with their all-gather and end with their reduce-scatter,
with nothing of their own to hide them under. `sequential_vjp(..., prefetch=True)` moves each
collective into the executable next to it, where XLA's scheduler runs it under that
executable's compute:

- layer i's forward returns, besides its output, layer i+1's weights gathered (typed reduced
  on the Explicit twin of the FSDP mesh, `jaxgraph._explicit`), and layer i+1 computes on them;
  each layer's gathered weights are kept for its backward (one gather a layer, as the whole
  step does);
- layer i+1's backward returns its weight gradient unreduced (each device's partial sum, no
  collective), and layer i's backward reduce-scatters it into layer i+1's shards beside its
  own compute; the bottom layer gathers and reduces its own weights.

With `fuse=K` each fused segment of K layers is one step of the chain: its first layer takes
the weights the segment below gathered, and hands its gradient down unreduced; its other
layers gather their own inside the segment's executable (where XLA runs each gather under the
layers before it) and reduce-scatter their gradients in its backward.

The layer function is the user's, unchanged, in the global view: it gets its params as it
would unprefetched. Only flat FSDP buffers (`jg.fsdp.shard` of `jg.flat.ravel` trees) are
prefetched: the gather of a buffer is one collective, and its gradient one reduce-scatter.
Leaves of fewer than two dimensions (biases, norm scales) reach the layer replicated: their
gradients are all-reduced in its backward, small next to the weights'.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxgraph import _explicit as explicit_lib
from jaxgraph import _fusion as fusion_lib
from jaxgraph import _graphed as graphed_lib
from jaxgraph import _hooks as hooks_lib
from jaxgraph import _pullback as pullback_lib
from jaxgraph import _signature as sig_lib
from jaxgraph import flat as flat_lib

__all__ = ["PREFETCH_PLATFORMS", "PrefetchStep", "eligible", "steps_of"]

# The platforms where `sequential_vjp` prefetches unless told otherwise: those whose
# collectives run asynchronously beside compute (XLA:CPU's do not: there prefetch only adds
# executables).
PREFETCH_PLATFORMS = frozenset({"gpu"})

logger = logging.getLogger("jaxgraph")

Cuts = tuple[tuple[int, int], ...]  # a chain's steps: per step, its layers [lo, hi) of the run


class Sharded:
  """A FlatTree's sharded buffers as a step argument, which the step gathers itself (a
  FlatTree argument would be unraveled, gathered leaf by leaf, before the step sees it).
  Leaves: the buffers; auxiliary data: the FlatTree's layout."""

  __slots__ = ("buffers", "layout")

  def __init__(self, buffers: Sequence[Any], layout: flat_lib.FlatLayout):
    self.buffers = tuple(buffers)
    self.layout = layout


jax.tree_util.register_pytree_node(
    Sharded, lambda tree: (tree.buffers, tree.layout),
    lambda layout, buffers: Sharded(buffers, layout))


@functools.lru_cache(maxsize=None)
def gathered_layout(layout: flat_lib.FlatLayout) -> flat_lib.FlatLayout:
  """The layout of `layout`'s buffers once gathered: its gathered buffers whole, in the
  gather's dtype, and nothing left to gather."""
  buffers = tuple(spec._replace(dtype=flat_lib.gather_dtype(spec.dtype, layout.gather))
                  if layout.gathered(k) else spec for k, spec in enumerate(layout.buffers))
  gathered = dataclasses.replace(layout, buffers=buffers, gather=None)
  _sources[gathered] = layout
  return gathered


# gathered layout -> a layout it was gathered from (the same leaves and groups: a grad_mask
# of FlatTrees is written for the layer's own layout)
_sources: dict[flat_lib.FlatLayout, flat_lib.FlatLayout] = {}


def gather(tree: Sharded) -> flat_lib.FlatTree:
  """Inside a step: each split buffer of `tree` all-gathered, typed reduced, so that its
  cotangent comes back unreduced and this gather's transpose reduce-scatters it; the other
  buffers as they are. A FlatTree of `gathered_layout`."""
  layout = tree.layout
  gather_ = layout.gather
  sharding = explicit_lib.reduced(explicit_lib.twin(gather_.mesh).explicit, gather_.axis)
  buffers = []
  for k, (buffer, spec) in enumerate(zip(tree.buffers, layout.buffers)):
    if layout.gathered(k):
      dtype = flat_lib.gather_dtype(spec.dtype, gather_)
      if dtype != buffer.dtype:
        # Cast the shard, then gather: XLA would move the cast after the collective (twice
        # the bytes) where the gathered buffer is an output.
        buffer = jax.lax.optimization_barrier(buffer.astype(dtype))
      buffer = jax.sharding.reshard(buffer, sharding)
    buffers.append(buffer)
  return flat_lib.FlatTree(buffers, gathered_layout(layout))


def _replicated_small(leaf: Any) -> Any:
  """A reduced leaf of fewer than two dimensions (a bias, a norm scale) made replicated: a
  layer adds or multiplies it into batch-sharded activations, which JAX refuses for a
  reduced operand; its gradient is then all-reduced in the backward (a few bytes)."""
  if not isinstance(leaf, jax.Array) or leaf.ndim >= 2:
    return leaf
  aval_sharding = jax.typeof(leaf).sharding
  if not aval_sharding.spec.reduced:
    return leaf
  return jax.sharding.reshard(leaf, NamedSharding(aval_sharding.mesh, PartitionSpec()))


@dataclasses.dataclass(frozen=True)
class Prefetching:
  """`step(params, upcoming, x, *consts, key=None)`: one step of a prefetching chain: a layer,
  or a fused segment of adjacent layers (`fn` a `_fusion.Composed` chain).

  Computes `fn(params, x, *consts[, key=key])` on the params gathered. A layer's params: the
  FlatTree of `gathered_layout` the step below returned (unraveled by the capture), or, for
  the first step (`own`), its own `Sharded` buffers, gathered here. A segment's: a tuple, its
  first layer's params as a layer's, then each other layer's `Sharded` buffers, gathered here
  (inside one executable XLA runs each gather under the layers before it) and their gradients
  reduce-scattered by this step's backward. Where `upcoming` (the next step's first layer's
  `Sharded` buffers) is not None it returns `(y, gather(upcoming))`. Equal (and hashed) by its
  fields, so identical layers (segments) share one capture per position: the first of a
  chain, its middle, its last.
  """

  fn: Callable[..., Any]
  own: bool  # gathers its own (first layer's) params: the first step of a chain

  @property
  def __name__(self) -> str:
    return getattr(self.fn, "__name__", type(self.fn).__name__)

  def __call__(self, params: Any, upcoming: Sharded | None, x: Any, *consts: Any,
               key: Any = None) -> Any:
    """The step's output, and the next step's weights gathered where there is one."""
    fused = isinstance(self.fn, fusion_lib.Composed)
    first = params[0] if fused else params
    own = gather(first).unravel() if self.own else first
    if fused:
      own = [own, *(gather(p).unravel() for p in params[1:])]
    args = (jax.tree.map(_replicated_small, own), x, *consts)
    y = self.fn(*args) if key is None else self.fn(*args, key=key)
    return y if upcoming is None else (y, gather(upcoming))


class PrefetchStep(graphed_lib.LayerGroup):
  """A layer, or a fused segment of adjacent layers, replayed as one `Prefetching` step of a
  prefetching chain: the layers' functions, key streams and counters, its executables traced
  on the Explicit twin of their FSDP mesh. Captures and compiles are counted on the first
  layer's `stats`, replays on every layer's."""

  def __init__(self, layers: Sequence[graphed_lib.GraphedCallable], *, own: bool,
               twin: explicit_lib.Twin):
    first = layers[0]
    self._twin_mesh = twin
    if len(layers) == 1:
      fn, name = first.fn, first.name
    else:  # each layer under its own remat_policy, as a fused segment runs it
      fn = fusion_lib.Composed(tuple(layer.fn for layer in layers),
                               remat_policy=first.config.remat_policy)
      name = f"{first.name}..{layers[-1].name}"
    super().__init__(layers, Prefetching(fn, own), offload=False, name=f"prefetch({name})")

  @property
  def layers(self) -> tuple[graphed_lib.GraphedCallable, ...]:
    """The layers this step replays, in order."""
    return self._layers

  @property
  def remat_policy(self) -> Callable[..., bool] | None:
    return self.config.remat_policy if len(self._layers) == 1 else None  # a chain: per layer

  @property
  def warns_of_constant_keys(self) -> bool:
    return len(self._layers) == 1  # a segment's layers warned at their own captures

  def twin(self, signature: sig_lib.Signature) -> explicit_lib.Twin:
    return self._twin_mesh

  def flatten(self, args: tuple[Any, ...], key: Any, kwargs: dict[str, Any]
              ) -> tuple[list[Any] | None, Any]:
    """As a layer's; a segment's `key` is a tuple of one key per layer, each checked by its
    layer."""
    if key is None or len(self._layers) == 1:
      return super().flatten(args, key, kwargs)
    for layer, one in zip(self._layers, key, strict=True):
      layer.flatten((), one, {})
    return super().flatten(args, None, kwargs)

  def differentiated(self, signature: sig_lib.Signature) -> tuple[int, ...]:
    """The params and upcoming buffers and `x` as the layers' `grad_mask` says of
    `(params, x, *consts)` (on the FlatTree each stands for; `x` as the first layer's says);
    the consts none (the chain drops their gradients)."""
    params, upcoming, x, *consts = jax.tree.unflatten(
        signature.treedef, [sig_lib.abstract(s) for s in signature.leaves])
    mask = self.config.grad_mask

    def flags(tree: Any, n: int) -> list[bool]:
      layout = _sources.get(tree.layout, tree.layout)
      as_flat = flat_lib.unflatten(layout, tree.buffers)  # the structure the mask is of
      found = pullback_lib.mask_flags(mask, (as_flat, x, *consts))
      return [True] * n if found is None else list(found[:n])

    trees = list(params) if len(self._layers) > 1 else [params]
    n_first, n_x = len(trees[0].buffers), len(jax.tree.leaves(x))
    first = flags(trees[0], n_first + n_x)
    own = first[:n_first] + [f for tree in trees[1:] for f in flags(tree, len(tree.buffers))]
    upcoming_flags = [] if upcoming is None else flags(upcoming, len(upcoming.buffers))
    return pullback_lib.differentiated_leaves(
        signature, own + upcoming_flags + first[n_first:]
        + [False] * len(jax.tree.leaves(consts)))



def steps_of(layer: graphed_lib.GraphedCallable) -> list[PrefetchStep]:
  """The prefetching steps `layer` leads (its first-of-a-chain and later steps, per mesh, as a
  layer or the first of a fused segment: `PrefetchStep.layers`), each with the executables it
  captured: what to read for a prefetching chain's HLO, where the layers' own executables do
  not run."""
  return [step for key, step in layer.config.segments.items()
          if isinstance(step, PrefetchStep) and step.layers[0] is layer]


def eligible(layer: graphed_lib.GraphedCallable, params: Any) -> bool:
  """Whether a layer can join a prefetching chain: its params one FlatTree whose split
  buffers are gathered over a mesh axis of several devices (`jg.fsdp.shard`), and nothing
  that needs it to run alone: no replay-time hook, no delayed wgrad, no offload."""
  hooks = layer.phase_hooks["replay"]
  layout = getattr(params, "layout", None)
  return (flat_lib.is_flat(params) and layout.gather is not None
          and any(layout.gathered(k) for k in range(len(layout.buffers)))
          and not any(getattr(hooks, kind) for kind in hooks_lib.HOOK_KINDS)
          and not layer.config.delay_wgrad and not layer.offloader.enabled
          and not layer.config.inference_only)


def default(params: Any) -> bool:
  """Whether `sequential_vjp` prefetches where not told: on `PREFETCH_PLATFORMS`."""
  for tree in params:
    if flat_lib.is_flat(tree) and tree.layout.gather is not None:
      return tree.layout.gather.mesh.devices.flat[0].platform in PREFETCH_PLATFORMS
  return False


def runs(layers: Sequence[graphed_lib.GraphedCallable], params: Sequence[Any]
         ) -> list[tuple[int, int, bool]]:
  """`layers` cut into `(start, end, prefetched)` runs: maximal runs of eligible layers of
  one `make_graphed` call whose params share a mesh, and single layers between them."""
  found: list[tuple[int, int, bool]] = []
  for i in range(len(layers)):
    ok = eligible(layers[i], params[i])
    if (ok and found and found[-1][2] and found[-1][1] == i
        and layers[i].config is layers[found[-1][0]].config
        and params[i].layout.gather.mesh == params[found[-1][0]].layout.gather.mesh):
      found[-1] = (found[-1][0], i + 1, True)
    else:
      found.append((i, i + 1, ok))
  return [(a, b, p and b - a > 1) for a, b, p in found]


def _steps(layers: Sequence[graphed_lib.GraphedCallable], cuts: Cuts,
           twin: explicit_lib.Twin) -> list[PrefetchStep]:
  """The PrefetchSteps of a chain's segments (made once per segment and position, kept with
  their `make_graphed` call; the first layer's `stats` count their captures)."""
  config = layers[0].config
  steps = []
  with config.lock:
    for lo, hi in cuts:
      members = tuple(layers[lo:hi])
      key = (*members, "prefetch", lo == 0, twin)
      found = config.segments.get(key)
      if found is None:
        found = config.segments[key] = PrefetchStep(members, own=lo == 0, twin=twin)
      steps.append(found)
  return steps


@functools.lru_cache(maxsize=None)
def _zeros(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> jax.Array:
  """Zeros typed unreduced (read only: shared by every chain that hands them over)."""
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def _zero_if_float0(grad: Any, gathered: jax.Array) -> Any:
  """A gathered buffer's handed-over gradient; zeros where `grad_mask` froze the buffer (its
  float0 gradient is no cotangent of the `gathered` buffer the step below returned)."""
  if grad.dtype != jax.dtypes.float0:
    return grad
  sharding = gathered.sharding
  unreduced = NamedSharding(sharding.mesh, PartitionSpec(unreduced=set(sharding.spec.reduced)))
  return _zeros(gathered.shape, gathered.dtype, unreduced)


class ChainPullback:
  """The backward of a prefetching chain: `(grads_list, g_x) = pullback(ct)`, one-shot.

  Runs the steps' backwards top down, handing each step's unreduced gradient of its first
  layer's weights to the step below, whose backward reduce-scatters it into that layer's
  shards.
  """

  def __init__(self, pullbacks: list[graphed_lib.Pullback], cuts: Cuts,
               structures: list[Any], handed_like: list[Any], twin: explicit_lib.Twin):
    self._pullbacks = pullbacks
    self._cuts = cuts  # per step, its layers [lo, hi) of the chain
    self._twin = twin  # the gradients and the input's cotangent leave on its Auto mesh
    self._structures = structures  # per layer, its params' (a FlatTree's) pytree structure
    self._handed_like = handed_like  # per step, the gathered params it took (None: first)

  @property
  def consumed(self) -> bool:
    return self._pullbacks[-1].consumed

  def prefetch(self) -> None:
    """Nothing to copy back: a prefetching chain does not offload."""

  def wgrad(self) -> Any:
    raise RuntimeError("a prefetching chain has no delayed wgrad (its layers were built "
                       "without delay_wgrad=True).")

  def __call__(self, cotangent: Any) -> tuple[list[Any], Any]:
    grads: list[Any] = [None] * len(self._structures)
    handed = None  # the unreduced gradient of the gathered weights of the step above
    for j in reversed(range(len(self._pullbacks))):
      lo, hi = self._cuts[j]
      ct = cotangent if handed is None else (cotangent, handed)
      own, upcoming, cotangent = self._pullbacks[j](ct)[:3]
      if upcoming is not None:
        grads[hi] = self._to_auto(hi, upcoming.buffers)
      first, others = (own[0], own[1:]) if hi - lo > 1 else (own, ())
      for i, tree in enumerate(others, lo + 1):  # a segment's: reduce-scattered in it
        grads[i] = self._to_auto(i, tree.buffers)
      # dropped as the backward passes: a step's gathered weights live no longer than its
      # own pullback keeps them
      like, self._handed_like[j] = self._handed_like[j], None
      if j:
        handed = jax.tree.map(_zero_if_float0, first, like)
      else:
        grads[lo] = self._to_auto(lo, first.buffers)
    return grads, jax.tree.map(self._twin.to_auto, cotangent)

  def _to_auto(self, layer: int, buffers: Sequence[Any]) -> Any:
    """A layer's gradient buffers as its params' FlatTree, on the params' Auto mesh."""
    return jax.tree.unflatten(self._structures[layer],
                              [self._twin.to_auto(b) for b in buffers])


def _sharded(tree: flat_lib.FlatTree) -> Sharded:
  return Sharded(tree.buffers, tree.layout)


def _step_args(params: Sequence[Any], cuts: Cuts, i: int, first: Any, x: Any,
               consts: tuple[Any, ...]) -> tuple[Any, ...]:
  """The arguments of step `i`: its params (`first`, the first layer's: gathered by the step
  below, or `Sharded` for the first step; a segment's with its other layers' `Sharded`
  buffers), the next step's first layer's `Sharded` buffers (None for the last), `x`, the
  consts."""
  lo, hi = cuts[i]
  own = first if hi - lo == 1 else (first, *(_sharded(p) for p in params[lo + 1:hi]))
  upcoming = _sharded(params[hi]) if i + 1 < len(cuts) else None
  return (own, upcoming, x, *consts)


def _capture_all(steps: Sequence[PrefetchStep], params: Sequence[Any], cuts: Cuts,
                 args: tuple[Any, ...]) -> bool:
  """Captures every step of a chain for its (abstract) input signature before any runs (a
  step that cannot would otherwise fail after the steps below it ran); False where a step is
  past its `max_captures` (the chain then runs unprefetched)."""
  consts = args[3:]
  for i, step in enumerate(steps):
    leaves, treedef = jax.tree.flatten(args)
    entry = step.executables.get(sig_lib.signature_of(leaves, treedef), sampled=True)
    if entry is None:
      return False
    if i + 1 == len(steps):
      break
    kind = "stream" if entry.layout.n_keys else "explicit"
    out_info = entry.forward[kind, True].out_info[:entry.layout.n_out]
    y, gathered = jax.tree.unflatten(entry.layout.out_treedef, out_info)
    args = _step_args(params, cuts, i + 1, gathered, y, consts)
  return True


def chain_vjp(layers: Sequence[graphed_lib.GraphedCallable], params: Sequence[Any], x: Any,
              consts: tuple[Any, ...], keys: Sequence[jax.Array] | None, cuts: Cuts
              ) -> tuple[Any, ChainPullback] | None:
  """The prefetching forward of a run of eligible layers, one step per segment of `cuts`
  (`[lo, hi)` of the run, two or more; a segment of one layer, or fused); None where it
  cannot run: a layer that does not trace on the Explicit twin of its mesh (said once on the
  `jaxgraph` logger) or a step past its max_captures. The run then goes unprefetched."""
  twin = explicit_lib.twin(params[0].layout.gather.mesh)
  steps = _steps(layers, cuts, twin)
  args = _step_args(params, cuts, 0, _sharded(params[0]), x, consts)
  leaves, treedef = jax.tree.flatten(args)
  if any(isinstance(leaf, jax.core.Tracer)
         for leaf in (*leaves, *(() if keys is None else keys))):
    return None
  config = layers[0].config
  key = (tuple(steps), sig_lib.signature_of(leaves, treedef))
  ready = config.prefetch.get(key)
  if ready is None:
    try:
      ready = _capture_all(steps, sig_lib.abstract_tree(list(params)), cuts,
                            sig_lib.abstract_tree(args))
    except Exception as e:  # noqa: BLE001 - any trace failure: the unprefetched run says more
      ready = False
      logger.warning(
          "%s does not trace on the Explicit twin of its FSDP mesh (%s: %s), so its chain "
          "runs without prefetch: each layer gathers and reduces its own weights (the "
          "traceback: logging.getLogger('jaxgraph').setLevel(logging.DEBUG)).",
          layers[0].name, type(e).__name__, str(e).split("\n", 1)[0],
          exc_info=logger.isEnabledFor(logging.DEBUG))
    config.prefetch[key] = ready
  if not ready:
    return None
  pullbacks, handed_like = [], []
  first: Any = None  # the gathered weights of step i's first layer, from step i - 1
  for i, step in enumerate(steps):
    lo, hi = cuts[i]
    step_args = args if i == 0 else _step_args(params, cuts, i, first, x, consts)
    if keys is None:
      out, pullback = step.vjp(*step_args)
    else:  # a segment's: one key per layer
      step_key = keys[lo] if hi - lo == 1 else tuple(keys[lo:hi])
      out, pullback = step.vjp(*step_args, key=step_key)
    handed_like.append(first if i else None)
    x, first = (out, None) if i + 1 == len(steps) else out
    pullbacks.append(pullback)
  return jax.tree.map(twin.to_auto, x), ChainPullback(
      pullbacks, cuts, [jax.tree.structure(p) for p in params], handed_like, twin)
