"""Where the training state and the batches live (`Placement`): one device, or sharded over
a mesh with --fsdp N (`fsdp_mesh`, `shard_threshold`); and the start of a multi-process run
(`check_fsdp`: --coordinator, `jax.distributed`). docs/fsdp.md."""

from __future__ import annotations

import argparse
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxgraph as jg
from jaxgraph import fsdp

from .layers import Params
from .presets import Preset


class Placement:
  """Where the training state and the batches live.

  Without --fsdp (`mesh` None): on JAX's default device, where the arrays are made; every
  method hands back what it gets (`host` is `jax.device_get`), so that run is unchanged.
  With --fsdp N: on a one-axis mesh of N devices (`jg.fsdp.make_mesh`). The params, their
  grads and the optimizer state are sharded along it (`jg.fsdp.shard`: every flat buffer of
  at least `min_size` elements split N ways, a piece of every weight in each part, gathered
  in `gather_dtype` (the compute dtype), the smaller ones replicated: `shard_threshold`
  keeps the norm scales whole), each batch is split along it
  (data parallel over the same devices), scalars and keys are replicated. With several processes
  (`jax.distributed`) the mesh holds every process's devices and `host` gathers the shards
  of all of them.

  On CPU under `jax.distributed` (--coordinator: several processes, or one) every
  executable is waited for before the next one starts (`serial`, `wait`, `hooks`): the
  collectives go through gloo, every device a gloo rank (those of one process too), and two
  executables with collectives that run at once (the CPU runtime starts independent ones
  concurrently, e.g. the next microbatch's embedding forward during this one's backward) can
  pair their collectives wrongly and deadlock (2 processes hung in the first step; one
  process of 8 devices in --check's timing rounds). Without `jax.distributed` one process's
  CPU devices use XLA's in-process collectives, which hang another way: with executions
  piled up on a device (its limit is 32 in flight) on fewer cores than devices
  (docs/reliability.md, "CPU collectives"); so on any CPU mesh each step is waited for
  before the next is dispatched (`wait`). GPU streams run executables in order.
  """

  def __init__(self, mesh: Mesh | None = None, min_size: int = fsdp.MIN_SHARD_SIZE,
               gather_dtype: Any = None):
    self.mesh, self.min_size, self.gather_dtype = mesh, min_size, gather_dtype
    self.on_cpu = mesh is not None and mesh.devices.flat[0].platform == "cpu"
    self.serial = self.on_cpu and jax.distributed.is_initialized()

  @property
  def devices(self) -> int:
    """How many devices the state is split over (1 without a mesh)."""
    return 1 if self.mesh is None else self.mesh.size

  @property
  def replicated(self) -> NamedSharding | None:
    """Whole on every device of the mesh (scalars, keys, positions); None without one."""
    return None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())

  @property
  def batch(self) -> NamedSharding | None:
    """The batch dimension split over the mesh (`jg.fsdp.batch_sharding`)."""
    return None if self.mesh is None else fsdp.batch_sharding(self.mesh)

  def shard(self, params: Params) -> Params:
    """The params placed (`jg.fsdp.shard`): every FlatTree buffer of at least `min_size`
    elements split into one part per device, each part a piece of every weight
    (`jg.flat.split`), sharded, and gathered once per buffer where a layer unravels it; the
    smaller buffers replicated."""
    if self.mesh is None:
      return params
    return fsdp.shard(params, self.mesh, min_size=self.min_size, gather_dtype=self.gather_dtype)

  def shardings(self, tree: Any) -> Any:
    """The sharding of every leaf of `tree` (arrays or abstract values) under the placement
    rule of `shard`, for `jax.jit(..., out_shardings=)`; None without a mesh."""
    if self.mesh is None:
      return None
    return fsdp.shardings(tree, self.mesh, min_size=self.min_size)

  def jit(self, fn: Callable[..., Any], *, out_shardings: Any, **options: Any) -> Any:
    """`jax.jit(fn, **options)`, with `out_shardings` only when there is a mesh."""
    if self.mesh is not None:
      options["out_shardings"] = out_shardings
    return jax.jit(fn, **options)

  def replicate(self, tree: Any) -> Any:
    """Every leaf of `tree` (the same value in every process) whole on every device
    (`jg.fsdp.place`: across processes too, keys included)."""
    if self.mesh is None:
      return tree
    return jax.tree.map(lambda x: fsdp.place(x, self.replicated), tree)

  def wait(self, tree: Any) -> Any:
    """`tree` (a step's results), waited for on a CPU mesh."""
    return jax.block_until_ready(tree) if self.on_cpu else tree

  def hooks(self) -> dict[str, Any]:
    """`make_graphed` options: with `serial`, hooks that wait for every layer's outputs and
    grads (each layer call is one executable)."""
    if not self.serial:
      return {}

    def wait(event: jg.HookEvent) -> None:
      if event.phase != "capture":  # abstract values at capture
        jax.block_until_ready((event.outputs, event.grads))

    return {"hooks": jg.Hooks(forward=[wait], backward=[wait])}

  def put(self, tree: Any) -> Any:
    """Host values (from `host`) back on the devices, placed by the rule of `shard`."""
    return jax.device_put(tree, self.shardings(tree))

  def abstract(self, tree: Any) -> Any:
    """What `put(tree)` would place, as `jax.ShapeDtypeStruct`s (to compile for, without a
    copy on the devices); `tree` itself without a mesh."""
    if self.mesh is None:
      return tree
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
                        tree, self.shardings(tree))

  def host(self, tree: Any) -> Any:
    """`tree` as NumPy arrays holding the whole values (every process gets all of them)."""
    if jax.process_count() == 1:
      return jax.device_get(tree)

    def fetch(x: Any) -> Any:
      if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return multihost_utils.process_allgather(x, tiled=True)
      return jax.device_get(x)

    return jax.tree.map(fetch, tree)

  def local(self, params: Params) -> Params:
    """The params whole on this process's default device, gathered from the mesh (for
    generation: one sequence, nothing to split)."""
    if self.mesh is None:
      return params
    return [jg.flat.with_gather(jax.tree.map(jnp.asarray, p), None)
            for p in self.host(params)]


def shard_threshold(params: Params) -> int:
  """`Placement.min_size` for `params` (FlatTrees): above every "no_decay" buffer, so that
  the norm scales stay whole on every device (a few KB a layer; split, they would cost each
  layer one more all-gather in its forward and backward: the gpu presets' 1,536 and 4,096
  scales of a block are above jg.fsdp's default of 1,024), and at least that default."""
  scales = [spec.size for p in params for spec in p.layout.buffers if spec.group == "no_decay"]
  return max([fsdp.MIN_SHARD_SIZE, *(size + 1 for size in scales)])


def fsdp_mesh(devices: int | None) -> Mesh | None:
  """--fsdp N: a one-axis mesh ("fsdp") over this process's first N devices, or, with
  several processes, over all of them (`parse` checked N); None without --fsdp."""
  if devices is None:
    return None
  return fsdp.make_mesh(devices=jax.devices()[:devices])


def check_fsdp(parser: argparse.ArgumentParser, args: argparse.Namespace,
               preset: Preset) -> None:
  """--fsdp and the multi-process flags (argparse errors); starts `jax.distributed` when
  --coordinator is given, then checks N against the devices of every process."""
  n = args.fsdp
  if n is not None:
    if n < 1:
      parser.error(f"--fsdp takes a number of devices >= 1, got {n}")
    if not args.flat:
      parser.error("--fsdp shards the flat buffers (one all-gather per buffer and layer): "
                   "drop --no-flat")
    if preset.batch % n:
      parser.error(f"--fsdp {n} splits each microbatch of {preset.batch} sequences over {n} "
                   f"devices: pass an N that divides {preset.batch}")
  distributed = (args.coordinator, args.num_processes, args.process_id)
  if any(value is not None for value in distributed):
    if any(value is None for value in distributed):
      parser.error("--coordinator, --num-processes and --process-id start one process of a "
                   "multi-process run together: pass all three")
    if n is None:
      parser.error("several processes train one sharded run: pass --fsdp N, N the number of "
                   "devices of all processes together")
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
      parser.error(f"--process-id takes 0 to --num-processes - 1 ({args.num_processes - 1}), "
                   f"got {args.process_id}")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  if n is None:
    return
  devices = jax.devices()
  if jax.process_count() > 1 and n != len(devices):
    parser.error(f"--fsdp {n} with {jax.process_count()} processes: the mesh holds the "
                 f"devices of every process, {len(devices)} in all: pass --fsdp {len(devices)}")
  if n > len(devices):
    parser.error(f"--fsdp {n} needs {n} devices, found {len(devices)} "
                 f"({devices[0].platform}); on CPU XLA_FLAGS="
                 f"--xla_force_host_platform_device_count={n} makes {n}")

