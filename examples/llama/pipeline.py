"""--pipeline N: the model split into stages, one device each, trained through
`jg.schedule.Pipeline` from one Python thread, or with --pipeline-threads from a thread per
stage (`PipelineTrainer`); the stages and their order
(`plan`), the layers graphed for them (`build_stage_layers`), the flags that do not combine
(`check_flags`) and the per-stage report (`stage_report`). docs/llama-options.md."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import operator
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxgraph as jg
from jaxgraph import schedule
from examples.checkpoints import Streams, stream_positions

from .layers import Batches, Params, graphed
from .model import Config
from .trainer import CLIP_NORM, Grads

SCHEDULES = ("1f1b", "interleaved", "zero-bubble")

# What each flag that --pipeline refuses does instead (`check_flags`).
CONFLICTS = {
    "--fsdp": "shards every part over the devices instead of placing parts on them",
    "--offload": "plans its copies for the blocks of one device",
    "--prefetch": "gathers the next block's FSDP shards",
    "--whole-step": "trains without graphed layers",
    "--plain-ends": "leaves the embedding and head outside the graphed layers the pipeline runs",
    "--lora": "trains a masked part through the one-device Trainer",
}


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, depth: int) -> None:
  """--pipeline, --schedule: refuses (`parser.error`, one line) what does not combine
  (--fuse combines with every schedule: each chunk's layers as one fused segment, with
  zero-bubble one dgrad and one deferred wgrad executable a chunk)."""
  if args.pipeline is None:
    if args.schedule is not None:
      parser.error("--schedule orders a pipeline's stages: it needs --pipeline N")
    if args.pipeline_threads:
      parser.error("--pipeline-threads dispatches a pipeline's stages from a thread each: it "
                   "needs --pipeline N")
    return
  n = args.pipeline
  if n < 1:
    parser.error(f"--pipeline takes a number of stages >= 1, got {n}")
  given = [flag for flag, on in (
      ("--fsdp", args.fsdp is not None),
      ("--offload", args.offload.kind != "none"), ("--prefetch", bool(args.prefetch)),
      ("--whole-step", args.whole_step), ("--plain-ends", args.plain_ends),
      ("--lora", args.lora is not None)) if on]
  if given:
    flag = given[0]
    parser.error(f"--pipeline does not combine with {', '.join(given)} ({flag} "
                 f"{CONFLICTS[flag]}): drop {'them' if len(given) > 1 else 'it'}")
  chunks = n * (2 if args.schedule == "interleaved" else 1)
  if chunks > depth:
    parser.error(f"--pipeline {n}"
                 + (" --schedule interleaved" if args.schedule == "interleaved" else "")
                 + f" splits the {depth} blocks into {chunks} chunks of at least one block "
                 f"each: pass at most {depth // (chunks // n)} stages")
  if n > len(jax.devices()):
    parser.error(f"--pipeline {n} needs {n} devices, found {len(jax.devices())} "
                 f"({jax.devices()[0].platform}); on CPU XLA_FLAGS="
                 f"--xla_force_host_platform_device_count={n} gives {n}")


@dataclasses.dataclass(frozen=True)
class Stages:
  """Where each part runs and in what order.

  Attributes:
    devices: one device per stage (the first N of `jax.devices()`).
    chunk_devices: one device per chunk: chunk c on stage c % N (interleaved: 2N chunks).
    sizes: parts (embedding, blocks, head) per chunk: the embedding with the first chunk's
      blocks, the head with the last's.
    order: the merged order of every stage (`jg.schedule.merge_ranks`).
    delay_wgrad: whether the order places deferred weight gradients (zero-bubble).
  """

  devices: list[jax.Device]
  chunk_devices: list[jax.Device]
  sizes: tuple[int, ...]
  order: list[float]
  delay_wgrad: bool

  def ranges(self) -> list[range]:
    """The part indices of each chunk."""
    ends = itertools.accumulate(self.sizes)
    return [range(end - size, end) for size, end in zip(self.sizes, ends)]

  def part_devices(self) -> list[jax.Device]:
    """The device of each part."""
    return [device for device, parts in zip(self.chunk_devices, self.ranges()) for _ in parts]

  def stage_parts(self) -> list[list[int]]:
    """The part indices of each stage."""
    devices = self.part_devices()
    return [[i for i, d in enumerate(devices) if d == device] for device in self.devices]

  def place(self, params: Params) -> Params:
    """Each part's params on its stage's device."""
    return [jax.device_put(p, device) for p, device in zip(params, self.part_devices())]

  def gather(self, params: Params) -> Params:
    """The params on the first device (for the eval layers and generation, captured there)."""
    return jax.device_put(params, self.devices[0])


def plan(stages: int, name: str, depth: int, microbatches: int) -> Stages:
  """The chunks and the order of `--pipeline stages --schedule name` for `depth` blocks and
  `microbatches` a step (every count merges: the builders' default microbatch groups)."""
  devices = jax.devices()[:stages]
  per_rank = 2 if name == "interleaved" else 1
  chunks = stages * per_rank
  blocks = [len(part) for part in np.array_split(np.arange(depth), chunks)]
  sizes = tuple(b + (c == 0) + (c == chunks - 1) for c, b in enumerate(blocks))
  if name == "interleaved":
    build = functools.partial(schedule.interleaved_1f1b, microbatches, per_rank)
  elif name == "zero-bubble":
    build = functools.partial(schedule.zero_bubble, microbatches)
  else:
    build = functools.partial(schedule.one_f_one_b, microbatches)
  order = schedule.merge_ranks([build(pipeline_parallel_size=stages, rank=r)
                                for r in range(stages)])
  return Stages(devices, [devices[c % stages] for c in range(chunks)], sizes, order,
                name == "zero-bubble")


# The pipeline's layers take (params, x, targets) (`jg.schedule.Pipeline` with each
# microbatch's targets as its `consts`): a block's params are its own and the positions; only
# the head reads the targets, and returns the loss; `loss_of` hands it on.


def _embed(fn: Callable[..., Any]) -> Callable[..., Any]:
  def embed(params: Any, tokens: jax.Array, targets: jax.Array, **kwargs: Any) -> jax.Array:
    del targets  # the head's
    return fn(params, tokens, **kwargs)

  embed.__name__ = fn.__name__
  return embed


def _block(fn: Callable[..., Any]) -> Callable[..., Any]:
  def block(params: tuple[Any, jax.Array], x: jax.Array, targets: jax.Array,
            **kwargs: Any) -> jax.Array:
    del targets  # the head's
    own, positions = params
    return fn(own, x, positions, **kwargs)

  block.__name__ = fn.__name__
  return block


def _head(fn: Callable[..., Any], tied: bool) -> Callable[..., Any]:
  def head(params: Any, x: jax.Array, targets: jax.Array, **kwargs: Any) -> jax.Array:
    own, *table = params if tied else (params,)
    return fn(own, x, targets, *table, **kwargs)

  head.__name__ = fn.__name__
  return head


def loss_of(loss: jax.Array, _: None) -> jax.Array:
  """`Pipeline`'s loss_fn: the head's output is already the microbatch's loss."""
  return loss


def stage_params(params: Params, positions: Sequence[jax.Array], config: Config) -> list[Any]:
  """The params of each pipeline layer: each block's with its positions (one per block),
  the tied head's with the embedding's (`tie_head`)."""
  head = (params[-1], params[0]) if config.tie_embeddings else params[-1]
  return [params[0], *zip(params[1:-1], positions), head]


def build_stage_layers(fns: Sequence[Callable[..., Any]], params: Params, stages: Stages,
                       config: Config, batch: int, context: int, positions: jax.Array,
                       **options: Any) -> list[jg.GraphedCallable]:
  """The parts graphed for the pipeline in one `make_graphed` call (the same key-stream
  indices as the one-device run's), captured along the order with samples on each part's
  device."""
  tied = config.tie_embeddings
  wrapped = [_embed(fns[0]), *map(_block, fns[1:-1]), _head(fns[-1], tied)]
  tokens = jax.ShapeDtypeStruct((batch, context), jnp.int32)
  x = jax.ShapeDtypeStruct((batch, context, config.width), config.compute_dtype)
  samples = []
  per_layer = stage_params(params, [positions] * (len(params) - 2), config)
  for i, (p, device) in enumerate(zip(per_layer, stages.part_devices())):
    sharding = jax.sharding.SingleDeviceSharding(device)
    samples.append(jax.tree.map(
        lambda a, s=sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        (p, tokens if i == 0 else x, tokens)))
  return list(jg.make_graphed(wrapped, sample_args=samples, order=stages.order,
                              num_layers_per_chunk=list(stages.sizes),
                              delay_wgrad=stages.delay_wgrad, **options))


def square_sums(microbatches: int, grads: list[Any]) -> list[list[jax.Array]]:
  """Per part, per leaf: the sum of squares of the mean grads (the terms of the global norm,
  as `optax.tree.norm` forms them)."""
  return [[jnp.sum(jnp.square(g / microbatches)) for g in jax.tree.leaves(part)]
          for part in grads]


def global_norm(sums: list[jax.Array]) -> jax.Array:
  """The global norm from its terms, added in leaf order as `optax.tree.norm` adds them."""
  return jnp.sqrt(functools.reduce(operator.add, sums, 0))


def stage_update(tx: optax.GradientTransformation, microbatches: int, total: list[Any],
                 state: Any, params: list[Any], norm: jax.Array) -> tuple[list[Any], Any]:
  """One stage's part of `apply_update`: its mean grads clipped to the global `norm` as
  `optax.clip_by_global_norm(CLIP_NORM)` clips them, then `tx` (the AdamW after the clip)."""
  grads = jax.tree.map(lambda t: t / microbatches, total)
  within = jnp.squeeze(norm < CLIP_NORM)
  grads = jax.tree.map(
      lambda t: jax.lax.select(within, t, (t / norm.astype(t.dtype)) * CLIP_NORM), grads)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


class PipelineTrainer:
  """The graphed training step over pipeline stages: `jg.schedule.Pipeline` runs every
  microbatch's forwards and backwards in the stages' order, each chunk on its device, and
  sums each part's grads over the microbatches on that device; then each stage updates its
  own parts' params and AdamW moments on its device.

  The params and the optimizer state keep the one-device layout (`optimizer`'s state:
  the clip's, then AdamW's with one entry per part), each part's arrays on its stage's
  device (`Stages.place`; the step counts on the first device). The global-norm clip needs
  every part's grads: each stage sums the squares of its own, the sums meet on the first
  device, in leaf order as optax adds them, and the norm goes back to every stage. On the CPU
  the update is bitwise the one-device `apply_update`'s. With tied embeddings the head's
  share of the embedding's grads is summed over the microbatches apart and added once a
  step (the one-device step adds it per microbatch: the same terms, another order of float
  sums).
  """

  def __init__(self, layers: Sequence[jg.GraphedCallable], config: Config,
               tx: optax.GradientTransformation, microbatches: int, stages: Stages,
               positions: jax.Array, *, fuse: bool | int = False, threads: bool = False):
    """`tx`: the AdamW after the clip (`trainer.adamw`); `fuse`: --fuse, each chunk's layers
    replayed as fused segments (`jg.schedule.Pipeline(..., fuse=...)`); `threads`:
    --pipeline-threads, each stage's steps dispatched from a thread of its own
    (`jg.schedule.Pipeline(..., threads=True)`)."""
    self.layers, self.config, self.microbatches = layers, config, microbatches
    self.stages = stages
    chunks = [[layers[i] for i in parts] for parts in stages.ranges()]
    self.pipeline = schedule.Pipeline(chunks, stages.order, loss_fn=loss_of,
                                      devices=stages.chunk_devices, fuse=fuse,
                                      threads=threads)
    self.positions = {device: jax.device_put(positions, device) for device in stages.devices}
    self.parts = stages.stage_parts()
    self._sums = jax.jit(functools.partial(square_sums, microbatches))
    self._norm = jax.jit(global_norm)
    # The summed grads' buffers become the new params, the state's the new state.
    self._update = jax.jit(functools.partial(stage_update, tx, microbatches),
                           donate_argnums=(0, 1))

  def grads(self, params: Params, batches: Batches, positions: jax.Array) -> Grads:
    """The grads (each part's on its stage) and the loss summed over `batches` (one
    (tokens, targets) per microbatch)."""
    del positions  # placed on each stage once (`self.positions`)
    per_layer = stage_params(params, [self.positions[device] for device
                                      in self.stages.part_devices()[1:-1]], self.config)
    result = self.pipeline([[per_layer[i] for i in parts] for parts in self.stages.ranges()],
                           [tokens for tokens, _ in batches], [None] * len(batches),
                           consts=[(targets,) for _, targets in batches])
    grads = [layer_grads for chunk in result.grads for layer_grads in chunk]
    head = grads[-1]
    if self.config.tie_embeddings:
      head, table = head
      grads[0] = jax.tree.map(jnp.add, grads[0], jax.device_put(table, self.stages.devices[0]))
    grads = [grads[0], *(g for g, _ in grads[1:-1]), head]
    loss = result.losses[0]
    for microbatch_loss in result.losses[1:]:
      loss = loss + microbatch_loss
    return grads, loss

  def step(self, params: Params, opt_state: Any, batches: Batches, positions: jax.Array
           ) -> tuple[Params, Any, jax.Array]:
    """One optimizer step over `batches`: (params, opt_state, mean loss)."""
    grads, loss = self.grads(params, batches, positions)
    first = self.stages.devices[0]
    sums: list[Any] = [None] * len(params)
    for parts in self.parts:
      for i, part_sums in zip(parts, self._sums([grads[i] for i in parts])):
        sums[i] = part_sums
    norm = self._norm(jax.device_put([x for part in sums for x in part], first))
    clip_state, states = opt_state[0], self.split_state(opt_state[1])
    params = list(params)
    for s, (parts, device) in enumerate(zip(self.parts, self.stages.devices)):
      updated, states[s] = self._update([grads[i] for i in parts], states[s],
                                        [params[i] for i in parts], jax.device_put(norm, device))
      for i, p in zip(parts, updated):
        params[i] = p
    return params, (clip_state, self.join_state(states, len(params))), loss / self.microbatches

  def split_state(self, state: Any) -> list[Any]:
    """AdamW's state per stage: of each per-part list (the moments) the stage's parts, the
    rest (step counts) copied to the stage's device."""
    count = len(self.stages.part_devices())
    per_part = lambda x: isinstance(x, list) and len(x) == count  # noqa: E731
    return [jax.tree.map(lambda x, p=parts, d=device: [x[i] for i in p] if per_part(x)
                         else jax.device_put(x, d), state, is_leaf=per_part)
            for parts, device in zip(self.parts, self.stages.devices)]

  def join_state(self, states: list[Any], count: int) -> Any:
    """`split_state` undone: the per-part lists whole again, the first stage's counts."""
    def join(*pieces: Any) -> Any:
      if not isinstance(pieces[0], list):
        return pieces[0]
      whole: list[Any] = [None] * count
      for parts, piece in zip(self.parts, pieces):
        for i, x in zip(parts, piece):
          whole[i] = x
      return whole

    return jax.tree.map(join, *states, is_leaf=lambda x: isinstance(x, list))

  def streams(self) -> Streams:
    """The graphed layers' key-stream positions (for a checkpoint)."""
    return stream_positions(graphed(self.layers))

  def seed(self, streams: Streams) -> None:
    """Sets the graphed layers' key streams (from a checkpoint)."""
    for layer, (base, counter) in zip(graphed(self.layers), streams):
      layer.seed(base, counter=counter)


def stage_report(stages: Stages, layers: Sequence[jg.GraphedCallable], params: Params
                 ) -> list[dict[str, Any]]:
  """Per stage: its device, parts, params, the residuals one microbatch's forwards keep
  (`Stats.residual_bytes`) and the device's peak memory where it keeps statistics (GPUs)."""
  counts = [sum(x.size for x in jax.tree.leaves(p)) for p in params]
  report = []
  for s, (device, parts) in enumerate(zip(stages.devices, stages.stage_parts())):
    memory = device.memory_stats() or {}
    report.append({
        "stage": s, "device": str(device),
        "parts": [layers[i].name for i in parts],
        "params": sum(counts[i] for i in parts),
        "residual_bytes": sum(layers[i].stats.residual_bytes for i in parts),
        "peak_bytes": memory.get("peak_bytes_in_use"),
    })
  return report
