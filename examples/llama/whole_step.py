"""The same training step as one whole-step `jax.jit` (`WholeStep`): the same layer
functions, keys, accumulation and update; what --whole-step trains with and --check compares
and times the graphed step against."""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxgraph as jg
import jaxgraph.rng
from examples.checkpoints import Streams

from .layers import Batches, Params, tied_inputs
from .model import Config
from .placement import Placement
from .trainer import Grads, accumulate, apply_update


def make_whole_step(fns: Sequence[Callable[..., Any]], config: Config,
                    tx: optax.GradientTransformation, microbatches: int,
                    block_streams: range, remat_policy: Callable[..., bool] | None = None,
                    graph_ends: bool = True, placement: Placement | None = None,
                    params: Params | None = None, opt_state: Any = None
                    ) -> tuple[Callable[..., Grads], Callable[..., Any]]:
  """The same step as one `jax.jit`: the same layer functions, keys, accumulation, update.

  The keys are drawn inside, from the streams' base keys and counters (arguments, never
  constants), as the graphed layers draw theirs: block i's key in microbatch m is the one its
  stream `block_streams[i]` draws m draws on. Returns `(grads, step)`: the summed grads and
  loss of one step under `jax.jit` (--check compares them), and the jitted step, which also
  returns the counters advanced by `microbatches`. With `remat_policy` (the graphed layers'
  --residuals), the grads run each graphed part (the ends too unless `graph_ends` is False)
  under `jax.checkpoint` with it: the same math as the graphed layers, for the bitwise
  comparison. The step stays the plain one a user writes. With a `placement` on a mesh
  (--fsdp) the step returns the params and optimizer state with the shardings of
  `params` and `opt_state` (the graphed step's), the loss and counters replicated.
  """
  placement = placement or Placement()
  graphed_parts = range(len(fns)) if graph_ends else range(1, len(fns) - 1)

  def loss_fn(params, tokens, targets, positions, keys, policy=None):
    parts = [fn if policy is None or i not in graphed_parts else
             jax.checkpoint(fn, policy=policy, prevent_cse=False) for i, fn in enumerate(fns)]
    embed_fn, block_fns, head_fn = parts[0], parts[1:-1], parts[-1]
    params = jg.flat.unravel(params)  # --flat: differentiated through the unravelling
    x = embed_fn(params[0], tokens)
    for fn, layer_params, key in zip(block_fns, params[1:-1], keys):
      x = fn(layer_params, x, positions, key=key)
    return head_fn(params[-1], x, targets, *tied_inputs(params, config))

  def grads(params, batches, positions, bases, counters, policy=None):
    total = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
    for m, (tokens, targets) in enumerate(batches):
      keys = [jaxgraph.rng.stream_key(s, counters[s] + m, bases[s]) for s in block_streams]
      loss, microbatch_grads = jax.value_and_grad(loss_fn)(params, tokens, targets, positions,
                                                           keys, policy)
      total = accumulate(total, microbatch_grads, None, loss)
    return total

  def step(params, opt_state, batches, positions, bases, counters):
    total = grads(params, batches, positions, bases, counters)
    return (*apply_update(tx, microbatches, total, opt_state, params),
            counters + jnp.uint32(microbatches))

  scalar = placement.replicated
  step = placement.jit(step, donate_argnums=(0, 1, 5), out_shardings=(
      placement.shardings(params), placement.shardings(opt_state), scalar, scalar))
  return jax.jit(functools.partial(grads, policy=remat_policy)), step


def initial_streams(seed: int, count: int) -> Streams:
  """The key streams `make_graphed(..., rng=jax.random.key(seed))` gives `count` callables."""
  return [(jax.random.key(seed), 0)] * count


class WholeStep:
  """The training step as one `jax.jit` (--whole-step, --check), called like `Trainer`.

  Its keys come from the streams the graphed layers would draw from (one base key and
  counter per graphed layer; the blocks' are used), held on the device and advanced inside
  the executable, so a step pays no host work for them. Compiled at construction, for the
  shardings of `params`, `opt_state` and `batches` (--fsdp: the graphed step's).
  """

  def __init__(self, fns: Sequence[Callable[..., Any]], config: Config,
               tx: optax.GradientTransformation, microbatches: int, streams: Streams,
               graph_ends: bool, params: Params, opt_state: Any, batches: Batches,
               positions: jax.Array, remat_policy: Callable[..., bool] | None = None,
               placement: Placement | None = None):
    self.microbatches = microbatches
    self.placement = placement or Placement()
    self.seed(streams)
    first = 1 if graph_ends else 0  # the blocks' streams (the embedding's is first)
    self.grads, step = make_whole_step(fns, config, tx, microbatches,
                                       range(first, first + config.depth), remat_policy,
                                       graph_ends, self.placement, params, opt_state)
    begin = time.perf_counter()
    self.compiled = step.lower(params, opt_state, batches, positions, self.bases,
                               self.counters).compile()
    self.compile_seconds = time.perf_counter() - begin

  def step(self, params: Params, opt_state: Any, batches: Batches, positions: jax.Array
           ) -> tuple[Params, Any, jax.Array]:
    """One optimizer step over `batches`: (params, opt_state, mean loss); donates both."""
    params, opt_state, loss, self.counters = self.placement.wait(self.compiled(
        params, opt_state, batches, positions, self.bases, self.counters))
    return params, opt_state, loss

  def streams(self) -> Streams:
    return [(base, int(counter)) for base, counter in zip(self.bases, np.asarray(self.counters))]

  def seed(self, streams: Streams) -> None:
    self.bases = self.placement.replicate(tuple(base for base, _ in streams))
    self.counters = self.placement.replicate(
        jnp.asarray([counter for _, counter in streams], jnp.uint32))

