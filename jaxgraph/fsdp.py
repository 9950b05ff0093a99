"""FSDP by sharding constraints: weights live sharded, each layer gathers its own.

Parameters are placed sharded along one mesh axis (`shard`). A layer function un-shards them
with `gather` (a sharding constraint to replicated: an all-gather inside the layer's
executable), so only the running layer's weights are ever gathered. `remat` wraps the layer
in a `jax.checkpoint` policy that saves activations only: the forward's residuals hold the
sharded weights it was given (no copy) and never the gathered ones; the backward executable
gathers again. The gradients come back with the weights' sharding: jaxgraph compiles each
backward with the signature's shardings as output shardings (a reduce-scatter on GPU; on CPU
XLA emits all-reduce + dynamic-slice instead, see docs/fsdp.md).

  mesh = jg.fsdp.make_mesh()
  params = jg.fsdp.shard(params, mesh)
  layer = jg.fsdp.remat(lambda p, x: block(jg.fsdp.gather(p, mesh), x))
  layers = jg.make_graphed([layer] * n, sample_args=[(p, x) for p in params])

Flat layer buffers (`jg.flat.ravel`) shard as whole buffers: `shard` splits each into one
part per device (each part a piece of every weight) and marks it to be gathered before it is
unraveled, so a layer all-gathers one buffer per dtype (not one array per weight), in the
compute dtype if asked, the backward recomputes the gathered slices instead of keeping them
(no `remat` needed for the weights) and reduce-scatters each weight's gradient:

  flat = jg.fsdp.shard([jg.flat.ravel(p) for p in params], mesh, gather_dtype=jnp.bfloat16)
  layers = jg.make_graphed([block] * n, sample_args=[(p, x) for p in flat])

The same program runs over the devices of several processes after
`jax.distributed.initialize()`: the mesh spans `jax.devices()`, every process runs the
same layers, and XLA inserts the cross-process collectives.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxgraph import flat as flat_lib

__all__ = ["MIN_SHARD_SIZE", "batch_sharding", "gather", "make_mesh", "partition_spec", "place",
           "remat", "shard", "shardings"]

# Leaves with fewer elements than this stay replicated: sharding a bias or a norm scale saves
# no memory worth a collective, and gathering it costs one more collective per layer.
MIN_SHARD_SIZE = 1024


def make_mesh(axis: str = "fsdp", devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A one-axis mesh over `devices` (default: `jax.devices()`, every process's devices).

  The axis is `AxisType.Auto` (`jax.make_mesh` defaults to Explicit), so sharding
  constraints inside layer functions work without `jax.set_mesh`.
  """
  devices = jax.devices() if devices is None else list(devices)
  if not devices:
    raise ValueError("make_mesh got no devices; pass a non-empty sequence or None.")
  return jax.make_mesh((len(devices),), (axis,), axis_types=(AxisType.Auto,), devices=devices)


def partition_spec(shape: Sequence[int], axis_size: int, axis: str = "fsdp", *,
                   min_size: int = MIN_SHARD_SIZE) -> PartitionSpec:
  """Where one leaf is sharded: its largest dimension divisible by `axis_size`.

  Ties go to the first such dimension. A leaf with fewer than `min_size` elements, or with
  no dimension divisible by `axis_size`, is replicated (`PartitionSpec()`). The spec has no
  trailing Nones (`P("fsdp")`, not `P("fsdp", None)`), the form XLA gives its outputs.
  """
  size = int(np.prod(shape, dtype=np.int64))
  candidates = [d for d, n in enumerate(shape) if n % axis_size == 0 and n >= axis_size]
  if size < min_size or not candidates:
    return PartitionSpec()
  dim = max(candidates, key=lambda d: (shape[d], -d))
  # No trailing Nones: XLA reports propagated shardings that way, and NamedShardings with
  # P("fsdp", None) and P("fsdp") compare unequal (they would be two signatures).
  return PartitionSpec(*[None] * dim, axis)


def _axis_size(mesh: Mesh, axis: str) -> int:
  if axis not in mesh.shape:
    raise ValueError(f"mesh has axes {tuple(mesh.shape)}, not {axis!r}; pass axis= one of "
                     "them, or build the mesh with jg.fsdp.make_mesh(axis).")
  return mesh.shape[axis]


def shardings(tree: Any, mesh: Mesh, axis: str = "fsdp", *,
              min_size: int = MIN_SHARD_SIZE) -> Any:
  """The `NamedSharding` of every leaf of `tree` (arrays or `jax.ShapeDtypeStruct`s).

  Use it for `jax.jit(..., in_shardings=..., out_shardings=...)` of steps that take the
  params, e.g. the optimizer update.
  """
  n = _axis_size(mesh, axis)
  return jax.tree.map(
      lambda leaf: NamedSharding(mesh, partition_spec(np.shape(leaf), n, axis, min_size=min_size)),
      tree)


def shard(tree: Any, mesh: Mesh, axis: str = "fsdp", *, min_size: int = MIN_SHARD_SIZE,
          gather_dtype: Any = None) -> Any:
  """Places every leaf of `tree` sharded along `axis` (rule: `partition_spec`).

  Every buffer of at least `min_size` elements of every `jg.flat.FlatTree` in `tree` is
  first split in as many parts as the axis has devices (`jg.flat.split`: each device's
  shard holds a piece of every leaf, zero-padded, never unraveled: numerics are unchanged),
  and the FlatTree's layout gathers those buffers (`jg.flat.with_gather`): inside a layer's
  executable one all-gather per buffer, and in its backward one reduce-scatter per leaf
  into the shards. The layer function needs no `gather`, and the gathered slices are
  recomputed by the backward, never kept.

  Args:
    tree: the params: pytrees of arrays, FlatTrees, or both.
    mesh: the FSDP mesh (`make_mesh`).
    axis: the mesh axis to shard along.
    min_size: leaves and buffers with fewer elements stay replicated.
    gather_dtype: for FlatTrees, the dtype their split floating buffers are gathered in (the
      shard is cast before the all-gather, FSDP2's `param_dtype`: `jnp.bfloat16` halves the
      bytes of float32 params), so the layer gets its weights in it; integer buffers keep
      their dtype. Use it where the layer casts its weights to that dtype anyway (a bfloat16
      compute dtype): the layer then computes the same values. Gradients come back in the
      buffers' dtype, and the buffers keep theirs (sharding the result again changes no
      value). None gathers as stored.

  With several processes (`jax.distributed.initialize`) every process passes the same full
  values (e.g. from the same seed) and keeps only the shards of its own devices.
  """
  gather = flat_lib.Gather(mesh, axis, None if gather_dtype is None else np.dtype(gather_dtype))
  n = _axis_size(mesh, axis)

  def prepare(node: Any) -> Any:
    if not isinstance(node, flat_lib.FlatTree):
      return node
    return flat_lib.with_gather(flat_lib.split(node, n, min_size=min_size), gather)

  tree = jax.tree.map(prepare, tree, is_leaf=flat_lib.is_flat)
  return jax.tree.map(place, tree, shardings(tree, mesh, axis, min_size=min_size))


def place(value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """`jax.device_put(value, sharding)`, also where `sharding` spans other processes' devices.

  With several processes, `jax.device_put` of an array committed to this process's device
  onto a replicated sharding over every process's devices returns a malformed array (its
  one local buffer claims every device; `addressable_shards` then raises "An argument array
  had N shard(s)", seen with jax 0.10.2). Such a value goes through the host instead: every
  process holds the same full value, and each keeps the shards of its own devices. A typed
  PRNG key array (`jax.random.key`) is placed as its key data, wrapped again with its impl.
  """
  if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
    # NumPy holds no typed keys: the key's data takes the host path where one is needed.
    return jax.random.wrap_key_data(place(jax.random.key_data(value), sharding),
                                    impl=jax.random.key_impl(value))
  if (isinstance(value, jax.Array) and value.is_fully_addressable
      and not sharding.is_fully_addressable):
    value = np.asarray(value)
  return jax.device_put(value, sharding)


def batch_sharding(mesh: Mesh, axis: str = "fsdp") -> NamedSharding:
  """Data parallel over the FSDP axis: the leading (batch) dimension split along `axis`."""
  _axis_size(mesh, axis)
  return NamedSharding(mesh, PartitionSpec(axis))


def gather(tree: Any, mesh: Mesh | None = None) -> Any:
  """Un-shards `tree` inside a layer function: every leaf constrained to replicated.

  Inside a jaxgraph executable this is an all-gather of the layer's weights. Call it on the
  params at the top of the layer, wrapped in `remat`, so no gathered weight is a residual.

  Args:
    tree: the layer's (sharded) params.
    mesh: the FSDP mesh; None uses the mesh set by `jax.set_mesh`.
  """
  if mesh is None:
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
      raise ValueError("jg.fsdp.gather needs a mesh: pass gather(params, mesh), or build and "
                       "call the layers under `with jax.set_mesh(mesh):`.")
    replicated: NamedSharding | PartitionSpec = PartitionSpec()
  else:
    replicated = NamedSharding(mesh, PartitionSpec())
  return jax.tree.map(lambda leaf: jax.lax.with_sharding_constraint(leaf, replicated), tree)


def remat(fn: Callable[..., Any], policy: Callable[..., bool] | None = None
          ) -> Callable[..., Any]:
  """`fn` under `jax.checkpoint` with a policy that keeps gathered weights out of residuals.

  The default policy, `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`, saves the
  outputs of matmuls (the activations) and recomputes the rest in the backward: the gather
  (re-run from the sharded weights, which the backward already receives), elementwise ops,
  and attention's batched matmuls. A matmul whose output is weight-sized (a product of two
  weights) would be saved too; for full control tag activations with
  `jax.ad_checkpoint.checkpoint_name` and pass
  `policy=jax.checkpoint_policies.save_only_these_names(...)`, or save nothing with
  `jax.checkpoint_policies.nothing_saveable`.

  Wrap once and pass the same function for every layer (`[remat(block)] * n`): identical
  callables with one signature share one compile.
  """
  if policy is None:
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  return jax.checkpoint(fn, policy=policy)
