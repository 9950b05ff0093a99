"""`sequential_vjp`: a stack of graphed layers chained forward, pulled back in reverse.

The top of the replay path: each layer replays its own executable pair (`_graphed.py`); with
`fuse=True` each run of hook-free neighbours replays as one (`_fusion.py`); with `prefetch`
each run of FSDP layers (or of fused segments) hands its collectives from executable to
executable (`prefetch.py`).
Imports run one way (docs/design.md): none of those imports this module.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from jaxgraph import _fusion as fusion_lib
from jaxgraph import _pullback as pullback_lib
from jaxgraph import flat as flat_lib
from jaxgraph import prefetch as prefetch_lib
from jaxgraph._graphed import GraphedCallable, Pullback  # by name: docs/api.md shows the types


class SequentialPullback:
  """The pullback of `sequential_vjp`: `(grads_list, g_x) = pullback(ct)`; one-shot."""

  def __init__(self, steps: list[tuple[int, int, Pullback]]):
    self._steps = steps  # (first layer, end layer, its pullback); a fused run spans several
    self._failed_at: int | None = None
    self._called = False

  def __call__(self, cotangent: Any) -> tuple[list[Any], Any]:
    if self._failed_at is not None:
      raise RuntimeError(
          f"this sequential_vjp pullback failed part-way, in the backward of layers"
          f"[{self._failed_at}] (the layers after it already ran theirs); it cannot be resumed. "
          "Run sequential_vjp again for a new one.")
    if self._called:
      raise RuntimeError("this sequential_vjp pullback was already called: it replays every "
                         "layer's backward once. Run sequential_vjp again for a new one.")
    grads: list[Any] = [None] * (self._steps[-1][1] if self._steps else 0)
    for position in reversed(range(len(self._steps))):
      lo, hi, pullback = self._steps[position]
      try:
        # Async offload: this layer's residuals first (at the top), then the layer below's,
        # which come back while this backward computes.
        pullback.prefetch()
        if position:
          self._steps[position - 1][2].prefetch()
        g_params, cotangent = pullback(cotangent)[:2]  # consts' gradients are dropped
      except BaseException:
        if position < len(self._steps) - 1 or pullback.consumed:
          self._failed_at = lo
        raise
      grads[lo:hi] = fusion_lib.per_layer(g_params, lo, hi)
    self._called = True
    return grads, cotangent

  def wgrad(self) -> list[Any]:
    """With `delay_wgrad=True`: the deferred params grads of every layer, in layer order."""
    return [grad for lo, hi, pullback in self._steps
            for grad in fusion_lib.per_layer(pullback.wgrad()[0], lo, hi)]


def sequential_vjp(layers: Sequence[GraphedCallable], params_list: Sequence[Any], x: Any, *,
                   consts: tuple[Any, ...] = (), keys: Sequence[jax.Array] | None = None,
                   fuse: bool | int = False, prefetch: bool | None = None
                   ) -> tuple[Any, SequentialPullback]:
  """Chains `x = layer(params, x, *consts)` through a stack; returns `(y, pullback)`.

  Args:
    layers: graphed callables taking `(params, x, *consts)` (and `key=` with `rng=True`),
      each returning the structure of `x`.
    params_list: one params pytree per layer.
    x: the input of the first layer: the carry, any pytree (e.g. a tuple `(h, aux)` when
      every layer returns one of that structure).
    consts: the per-step inputs besides the activation (positions, an attention mask, a
      cache), passed to every layer after `x`. They get no gradient: the pullback drops
      theirs (a layer's backward still computes the gradient of a float const; a fused
      chain stops it instead).
    keys: one key per layer, or None to draw from each layer's own stream.
    fuse: boundary fusion. Each maximal run of adjacent layers without replay-time hooks
      (from one `make_graphed` call, with the same offload setting) replays as one forward
      and one backward executable (with `delay_wgrad`, one dgrad and one wgrad executable:
      `pullback.wgrad()` runs each run's once), compiled on the first such call
      (identical runs share it): a host boundary only where a hook needs one. The same
      keys and counters as unfused, and the same math: each layer under its own
      `remat_policy`, and an optimization barrier between layers, so that XLA fuses
      nothing across them (the fused executables run the per-layer kernels). An int `k`
      cuts each run into segments of `k` layers and a shorter remainder (identical segments
      share one compile): at most two compiles per run, a segment's and its remainder's (a
      remainder of one layer replays unfused), the host calls fall `k`-fold, and inside a
      segment XLA's scheduler can overlap a layer's FSDP all-gather with the layer before's
      compute. `fuse=1` is unfused. With `prefetch`, each segment is one step of the
      prefetching chain (below), and a run compiles its first, middle and last segment.
    prefetch: FSDP prefetch across executables (`jaxgraph.prefetch`): in each run of
      adjacent layers whose params are flat FSDP buffers (`jg.fsdp.shard` of FlatTrees) and
      that have no replay-time hook, delayed wgrad or offload, layer i's forward also
      gathers layer i+1's weights, each layer's gathered weights are kept for its backward,
      and layer i's backward reduce-scatters layer i+1's weight gradient under its own
      compute. With `fuse`, the same across segments: a segment's forward also gathers the
      next segment's first layer's weights and its backward reduce-scatters that layer's
      gradient; the segment's other layers gather and reduce their own inside it. The same
      math as unprefetched (the gradients' reductions may add in another order); a run
      holds every layer's gathered weights from its forward to its backward. Compiles
      three executable pairs per run of identical layers or segments (its first, middle
      and last step; a shorter remainder is the last). None (default): on GPUs
      (`prefetch.PREFETCH_PLATFORMS`), where the collectives run beside compute. A run whose
      layer does not trace on the Explicit twin of its mesh runs unprefetched, said once on
      the `jaxgraph` logger.

  Returns:
    `(y, pullback)` with `pullback(ct) -> (grads_list, g_x)`: `grads_list[i]` is the gradient
    of `params_list[i]`.
  """
  if len(layers) != len(params_list):
    raise ValueError(f"sequential_vjp got {len(layers)} layers but {len(params_list)} params.")
  if keys is not None and len(keys) != len(layers):
    raise ValueError(f"sequential_vjp got {len(layers)} layers but {len(keys)} keys.")
  if not isinstance(consts, tuple):
    raise TypeError(f"sequential_vjp takes consts= a tuple of the extra positional arguments "
                    f"of every layer, e.g. consts=(positions, mask), got "
                    f"{type(consts).__name__}; for one argument write consts=(mask,).")
  for i, layer in enumerate(layers):
    if not isinstance(layer, GraphedCallable):
      raise TypeError(f"sequential_vjp: layers[{i}] is a {type(layer).__name__}, not a "
                      "GraphedCallable; build the stack with jaxgraph.make_graphed.")
    layer.require_backward(f"sequential_vjp (layers[{i}])")
  pullback_lib.check_carry(layers, params_list, x, *consts, where="sequential_vjp")
  longest = fusion_lib.longest_run(fuse, "sequential_vjp")
  steps: list[tuple[int, int, Any]] = []
  for cuts, chain in _plan_of(layers, params_list, longest, prefetch):
    lo, hi = cuts[0][0], cuts[-1][1]
    replayed = None
    if chain is not None:  # None where it cannot replay so: its segments as without prefetch
      replayed = prefetch_lib.chain_vjp(layers[lo:hi], params_list[lo:hi], x, consts,
                                        None if keys is None else keys[lo:hi], chain)
    if replayed is not None:
      x, pullback = replayed
      steps.append((lo, hi, pullback))
      continue
    for lo, hi in cuts:
      x = _segment(layers, params_list, x, consts, keys, lo, hi, steps)
  return x, SequentialPullback(steps)


Cuts = tuple[tuple[int, int], ...]
Plan = list[tuple[Cuts, Cuts | None]]


def _plan_of(layers: Sequence[GraphedCallable], params_list: Sequence[Any],
             longest: int | None, prefetch: bool | None) -> Plan:
  """`_plan` (with `prefetch=None` as `prefetch_lib.default` says), kept in the first layer's
  `Config` per layers, params' layouts, `fuse` and `prefetch`: what it reads of every layer
  does not change between calls, and reading it again is host time on every step."""
  if not layers:
    return []
  key = (tuple(layers), tuple(p.layout if flat_lib.is_flat(p) else None for p in params_list),
         longest, prefetch, prefetch_lib.PREFETCH_PLATFORMS)
  plans = layers[0].config.plans
  plan = plans.get(key)
  if plan is None:
    on = prefetch_lib.default(params_list) if prefetch is None else bool(prefetch)
    plan = plans[key] = _plan(layers, params_list, longest, on)
  return plan


def _plan(layers: Sequence[GraphedCallable], params_list: Sequence[Any], longest: int | None,
          prefetch: bool) -> Plan:
  """How a chain replays: a list of `(cuts, chain)`, `cuts` the `[lo, hi)` segments of one
  run (fused where longer than one layer, `fusion_lib.runs`); `chain` None, one segment,
  else two or more replayed as one prefetching chain (`prefetch_lib.chain_vjp`), the same
  cuts counted from the run's first layer."""
  found = prefetch_lib.runs(layers, params_list) if prefetch else [(0, len(layers), False)]
  merged: list[tuple[int, int, bool]] = []  # neighbours that do not prefetch, as one
  for lo, hi, prefetched in found:
    if merged and not prefetched and not merged[-1][2]:
      merged[-1] = (merged[-1][0], hi, False)
    else:
      merged.append((lo, hi, prefetched))
  plan: Plan = []
  for lo, hi, prefetched in merged:
    cuts = tuple((lo + a, lo + b) for a, b in fusion_lib.runs(layers[lo:hi], longest))
    if prefetched and len(cuts) > 1:
      plan.append((cuts, tuple((a - lo, b - lo) for a, b in cuts)))
    else:
      plan.extend(((cut,), None) for cut in cuts)
  return plan


def _segment(layers: Sequence[GraphedCallable], params_list: Sequence[Any], x: Any,
             consts: tuple[Any, ...], keys: Sequence[jax.Array] | None, lo: int, hi: int,
             steps: list[tuple[int, int, Any]]) -> Any:
  """Layers `[lo, hi)` replayed as one fused segment, or each on its own where they are one
  layer or cannot replay fused; their pullbacks appended to `steps`."""
  if hi - lo > 1:
    replayed = fusion_lib.segment(layers[lo:hi]).vjp_chain(
        params_list[lo:hi], x, consts, None if keys is None else keys[lo:hi])
    if replayed is not None:
      x, pullback = replayed
      steps.append((lo, hi, pullback))
      return x
  return _one_by_one(layers, params_list, x, consts, keys, lo, hi, steps)


def _one_by_one(layers: Sequence[GraphedCallable], params_list: Sequence[Any], x: Any,
                consts: tuple[Any, ...], keys: Sequence[jax.Array] | None, lo: int, hi: int,
                steps: list[tuple[int, int, Any]]) -> Any:
  """Layers `[lo, hi)` replayed each on its own; their pullbacks appended to `steps`."""
  for i in range(lo, hi):
    if keys is None:
      x, pullback = layers[i].vjp(params_list[i], x, *consts)
    else:
      x, pullback = layers[i].vjp(params_list[i], x, *consts, key=keys[i])
    steps.append((i, i + 1, pullback))
  return x
