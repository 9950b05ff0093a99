"""The graphed training step (`Trainer`): per microbatch the layers' forwards and backwards
replayed, the grads accumulated, one AdamW update; the optimizer, and the held-out loss
(`evaluate`)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
from typing import Any, Iterator, Protocol, Sequence

import jax
import jax.numpy as jnp
import optax

import jaxgraph as jg
from examples.checkpoints import Streams, stream_positions
from examples.corpus import Corpus

from .layers import Batches, Layer, Params, graphed, tied_inputs
from .model import Config
from .placement import Placement
from .presets import Preset

Grads = tuple[Params, jax.Array]  # summed grads and summed loss over the microbatches so far
# One microbatch's grads, the tied head's share of the embedding's grads (or None), its loss.
Microbatch = tuple[Params, Any, jax.Array]


def accumulate(total: Grads | None, grads: Params, table_grads: Any, loss: jax.Array
               ) -> Grads:
  """Adds one microbatch's grads and loss (to nothing where `total` is None); `table_grads`
  is the tied head's share of the embedding's grads, shaped like them (None when it is
  already in `grads[0]`)."""
  if table_grads is not None:
    grads = [jax.tree.map(jnp.add, grads[0], table_grads), *grads[1:]]
  return (grads, loss) if total is None else jax.tree.map(jnp.add, total, (grads, loss))


def fold(total: Grads | None, microbatches: Sequence[Microbatch]) -> Grads:
  """`accumulate` of each of `microbatches` in turn."""
  for microbatch in microbatches:
    total = accumulate(total, *microbatch)
  return total



@dataclasses.dataclass(frozen=True)
class AccumulationPlan:
  """The calls that sum a step's grads, each as (first, n): the grads of the next `n`
  microbatches added to nothing (`first`) or to the running total. The first two
  microbatches go into one call: max(1, M - 1) calls for M microbatches, then the update's
  (with a total made of zeros first, a sum per microbatch and the update: M + 2 calls).
  The update stays an executable of its own: summed inside it, the params' last bits
  differed after a few steps on XLA:CPU (other fusions of the AdamW arithmetic)."""

  microbatches: int

  @property
  def calls(self) -> list[tuple[bool, int]]:
    """The sums of a step, in order."""
    m = self.microbatches
    return [(True, m)] if m <= 2 else [(True, 2)] + [(False, 1)] * (m - 2)


def apply_update(tx: optax.GradientTransformation, microbatches: int, total: Grads,
                 opt_state: Any, params: Params) -> tuple[Params, Any, jax.Array]:
  """Averages the accumulated grads and loss over the microbatches; one optimizer update."""
  grads, loss = jax.tree.map(lambda t: t / microbatches, total)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def decays(path: tuple[Any, ...]) -> bool:
  """Weight decay on the matrices (kernels, the embedding table), not on the norm scales."""
  return any(getattr(k, "key", None) in ("kernel", "embedding") for k in path)


def decay_mask(params: Params) -> Params:
  """`decays` per leaf of the params, or per buffer of FlatTree params (--flat)."""
  if any(jg.flat.is_flat(p) for p in params):
    return jg.flat.mask(params, lambda group: group == "decay")
  return jax.tree_util.tree_map_with_path(lambda path, _: decays(path), params)


def flat_group(path: tuple[Any, ...], leaf: jax.Array) -> str:
  """--flat's buffers: "decay" and "no_decay" leaves apart, so that the AdamW mask is one
  bool per buffer."""
  return "decay" if decays(path) else "no_decay"


# The global norm the grads are clipped to (`optimizer`).
CLIP_NORM = 1.0


def adamw(preset: Preset, steps: int) -> optax.GradientTransformation:
  """AdamW without decay on the norms, on a warmup-cosine schedule: the optimizer after
  the clip."""
  warmup = max(1, steps // 20)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, preset.learning_rate, warmup, max(steps, warmup + 1), preset.learning_rate / 10)
  return optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask)


def optimizer(preset: Preset, steps: int) -> optax.GradientTransformation:
  """Global-norm clipping, then `adamw`."""
  return optax.chain(optax.clip_by_global_norm(CLIP_NORM), adamw(preset, steps))


class Stepper(Protocol):
  """A training step (`Trainer`: graphed; `WholeStep`: one jax.jit) with its key streams."""

  microbatches: int

  def step(self, params: Params, opt_state: Any, batches: Batches, positions: jax.Array
           ) -> tuple[Params, Any, jax.Array]: ...

  def streams(self) -> Streams: ...

  def seed(self, streams: Streams) -> None: ...


class Trainer:
  """The graphed training step: forwards and backwards replayed per layer, accumulated over
  the microbatches, one optimizer update (`step`).

  With `masks` (per part, which params train: LoRA's adapters, lora.py) the grads are summed
  and the optimizer runs over that part only (`jg.partition`: the frozen params' float0
  grads are dropped), and the step puts the updated part back beside the frozen one
  (`jg.combine`); `opt_state` is then the state of the trained part.
  """

  def __init__(self, layers: Sequence[Layer], config: Config, tx: optax.GradientTransformation,
               microbatches: int, params: Params, opt_state: Any,
               placement: Placement | None = None, fuse: bool | int = False,
               prefetch: bool | None = None,
               masks: list[Any] | None = None):
    placement = self.placement = placement or Placement()
    self.layers, self.config, self.tx, self.microbatches = layers, config, tx, microbatches
    self.fuse = fuse  # the blocks' hook-free runs (of at most `fuse` blocks) as one
    # executable pair each (docs/fusion.md)
    self.prefetch = prefetch  # FSDP prefetch across the blocks (None: jaxgraph's default)
    self.masks = masks
    self.one = placement.replicate(jnp.ones((), jnp.float32))  # the loss cotangent
    trained = self.split(params)[0]
    # --fsdp: the summed grads, the params and the optimizer state keep their shardings
    # (a params sharding that changed would be a new signature for every layer).
    grads, state = placement.shardings(trained), placement.shardings(opt_state)
    scalar = placement.replicated
    # A step sums its grads in executables that take them as the microbatches return them,
    # two microbatches to the first (`AccumulationPlan`).
    self.plan = AccumulationPlan(microbatches)
    one = self._microbatch_shapes(trained, config.tie_embeddings, self.one.sharding)
    self._fold = placement.jit(fold, donate_argnums=(0, 1), out_shardings=(grads, scalar))
    total = jax.eval_shape(self._fold, None, [one])  # with the sums' shardings
    with warnings.catch_warnings():
      # a loss or a table share has no output of its shape to be written into
      warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
      # Compiled ahead like the layers, so the first step pays for no compile.
      self.folds = {(first, n): self._fold.lower(None if first else total, [one] * n).compile()
                    for first, n in sorted(set(self.plan.calls), reverse=True)}
    # The summed grads' buffers become the new params (donating the params too would leave
    # one of the two unused).
    self.apply = placement.jit(functools.partial(apply_update, tx, microbatches),
                               donate_argnums=(0, 1), out_shardings=(grads, state, scalar)
                               ).lower(total, opt_state, trained).compile()

  @staticmethod
  def _microbatch_shapes(trained: Params, tied: bool, scalar: Any) -> Microbatch:
    """What one microbatch gives the sums (`_microbatches`): grads placed like the params,
    the loss (a scalar placed as `scalar`)."""
    like = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    return (like(trained), like(trained[0]) if tied else None,
            jax.ShapeDtypeStruct((), jnp.float32, sharding=scalar))

  def bookkeeping(self) -> list[tuple[str, Any, int]]:
    """(name, compiled, calls a step) of the step's executables other than the layers'."""
    calls = collections.Counter(self.plan.calls)
    return ([(f"accumulate {n}" + (" (first)" if first else ""), compiled, calls[first, n])
             for (first, n), compiled in self.folds.items()] + [("update", self.apply, 1)])

  def split(self, tree: Params) -> tuple[Params, Params | None]:
    """The part of a params-shaped tree (params, grads) that trains, and the rest (None
    without masks: all of it trains)."""
    return (tree, None) if self.masks is None else jg.partition(tree, self.masks)

  def microbatch(self, params: Params, tokens: jax.Array, targets: jax.Array,
                 positions: jax.Array) -> tuple[jax.Array, Params, jax.Array | None]:
    """Graphed forwards, then graphed backwards in reverse: (loss, grads, table grad)."""
    embed, blocks, head = self.layers[0], self.layers[1:-1], self.layers[-1]
    x, embed_pullback = embed.vjp(params[0], tokens)
    x, blocks_pullback = jg.sequential_vjp(blocks, params[1:-1], x, consts=(positions,),
                                           fuse=self.fuse, prefetch=self.prefetch)
    loss, head_pullback = head.vjp(params[-1], x, targets, *tied_inputs(params, self.config))
    head_grads, x_grads, _, *tied_grads = head_pullback(self.one)
    block_grads, x_grads = blocks_pullback(x_grads)
    embed_grads, _ = embed_pullback(x_grads)
    table_grads = tied_grads[0] if tied_grads else None
    return loss, [embed_grads, *block_grads, head_grads], table_grads

  def _microbatches(self, params: Params, batches: Sequence[tuple[jax.Array, jax.Array]],
                    positions: jax.Array) -> Iterator[Microbatch]:
    """Each microbatch's grads of the trained part, table grads and loss, in turn."""
    for tokens, targets in batches:
      loss, grads, table_grads = self.microbatch(params, tokens, targets, positions)
      if self.masks is not None:  # the trained part: the frozen params' float0 grads dropped
        grads = self.split(grads)[0]
        table_grads = None if table_grads is None else jg.partition(table_grads,
                                                                    self.masks[0])[0]
      yield grads, table_grads, loss

  def grads(self, params: Params, batches: Sequence[tuple[jax.Array, jax.Array]],
            positions: jax.Array) -> Grads:
    """The grads and loss summed over `batches` (one (tokens, targets) per microbatch)."""
    total = None
    for microbatch in self._microbatches(params, batches, positions):
      total = self._fold(total, [microbatch])
    return total

  def step(self, params: Params, opt_state: Any, batches: Sequence[tuple[jax.Array, jax.Array]],
           positions: jax.Array) -> tuple[Params, Any, jax.Array]:
    """One optimizer step over `batches`: (params, opt_state, mean loss)."""
    trained, frozen = self.split(params)
    calls, total, pending = self.plan.calls, None, []
    for microbatch in self._microbatches(params, batches, positions):
      pending.append(microbatch)
      (first, n), *rest = calls
      if len(pending) == n:
        total, pending, calls = self.folds[first, n](total, pending), [], rest
    trained, opt_state, loss = self.apply(total, opt_state, trained)
    params = trained if frozen is None else jg.combine(trained, frozen)
    return self.placement.wait((params, opt_state, loss))

  def streams(self) -> Streams:
    """The graphed layers' key-stream positions (for a checkpoint)."""
    return stream_positions(graphed(self.layers))

  def seed(self, streams: Streams) -> None:
    """Sets the graphed layers' key streams (from a checkpoint)."""
    for layer, (base, counter) in zip(graphed(self.layers), streams):
      layer.seed(base, counter=counter)


def evaluate(layers: Sequence[Layer], params: Params, config: Config, corpus: Corpus,
             batches: int, positions: jax.Array) -> float:
  """Mean held-out loss through the forward-only layers (no residuals are kept)."""
  losses = []
  for index in range(batches):
    tokens, targets = corpus.eval_batch(index)
    x = layers[0](params[0], tokens)
    for layer, layer_params in zip(layers[1:-1], params[1:-1]):
      x = layer(layer_params, x, positions)
    losses.append(layers[-1](params[-1], x, targets, *tied_inputs(params, config)))
  return float(jnp.mean(jnp.stack(losses)))

