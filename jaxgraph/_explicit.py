"""Explicit-mode twins of FSDP meshes: executables that hand partial sums to each other.

JAX's Explicit sharding mode types two states an Auto mesh cannot: *reduced* (`{R}`, the
array is replicated, and its cotangent is a partial sum) and *unreduced* (`{U}`, every device
holds a partial sum; `jax.sharding.reshard` to a sharded or replicated type reduces it where
it is called). An executable may take `{R}` inputs and return `{U}` outputs, so a layer's
backward can return its weight gradient unreduced and the next backward reduce-scatter it
under its own compute (`jaxgraph.prefetch`).

A `Twin` traces an executable on the Explicit twin of the Auto mesh its arguments live on (the
same devices in the same order, every axis Explicit). Its inputs and outputs are all typed on
the twin (jax 0.11 refuses a program whose shardings are on two meshes, even twins); it takes
arrays of the Auto mesh as they are (the same devices and layout: the call compares
placements, not types), and `to_auto` hands an output back to the user's side, the same
buffers on the Auto mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxgraph import _signature as sig_lib


@dataclasses.dataclass(frozen=True)
class Twin:
  """An Auto mesh and its Explicit twin.

  Attributes:
    auto: the mesh the user's arrays live on (every axis `AxisType.Auto`).
    explicit: the same devices and axes, every axis `AxisType.Explicit`.
  """

  auto: Mesh
  explicit: Mesh

  def inside(self, sharding: Any, *, cotangent: bool = False) -> Any:
    """Where a value lives inside the twin's trace: an Auto-mesh sharding moved to the twin,
    and with `cotangent` a reduced type turned into its cotangent's, unreduced."""
    if not isinstance(sharding, NamedSharding):
      return sharding
    spec = sharding.spec
    if sharding.mesh == self.auto:
      return NamedSharding(self.explicit, spec, memory_kind=sharding.memory_kind)
    if cotangent and spec.reduced:
      return NamedSharding(sharding.mesh, _respec(spec, unreduced=spec.reduced),
                           memory_kind=sharding.memory_kind)
    return sharding

  def outside(self, spec: PartitionSpec, *, cotangent: bool) -> NamedSharding:
    """Where a value of the twin's trace with `spec` leaves the executable, on the twin: a
    reduced one as it is (as a cotangent, unreduced), any other in the canonical spelling."""
    if spec.reduced:
      return NamedSharding(self.explicit,
                           _respec(spec, unreduced=spec.reduced) if cotangent else spec)
    if spec.unreduced:
      return NamedSharding(self.explicit, spec)
    return NamedSharding(self.explicit, _respec(spec))

  def to_auto(self, value: Any) -> Any:
    """An array an executable on the twin returned, on the Auto mesh: the same device
    buffers, no copy (anything else as it is)."""
    sharding = getattr(value, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh != self.explicit:
      return value
    auto = NamedSharding(self.auto, _respec(sharding.spec), memory_kind=sharding.memory_kind)
    return jax.make_array_from_single_device_arrays(
        value.shape, auto, [shard.data for shard in value.addressable_shards])

  def signature(self, signature: sig_lib.Signature) -> sig_lib.Signature:
    """`signature` with every leaf of the Auto mesh moved to the twin (what is traced)."""
    leaves = tuple(leaf._replace(sharding=self.inside(leaf.sharding))
                   for leaf in signature.leaves)
    return signature._replace(leaves=leaves)

  @contextlib.contextmanager
  def tracing(self) -> Iterator[None]:
    """The context a trace on the twin runs in: its mesh set, so that values the trace makes
    (zeros of a cotangent, constants) are typed on it."""
    with jax.set_mesh(self.explicit):
      yield


def _respec(spec: PartitionSpec, *, unreduced: Any = frozenset()) -> PartitionSpec:
  """`spec`'s partitions, without trailing Nones, unreduced over `unreduced`, reduced over no
  axis."""
  partitions = list(spec.partitions)
  while partitions and partitions[-1] is None:
    partitions.pop()
  return PartitionSpec(*partitions, unreduced=frozenset(unreduced))


_twins: dict[Mesh, Twin] = {}


def twin(mesh: Mesh) -> Twin:
  """The `Twin` of an Auto mesh (one per mesh, so executables of one mesh share it)."""
  found = _twins.get(mesh)
  if found is None:
    if any(kind != AxisType.Auto for kind in mesh.axis_types):
      raise ValueError(f"twin takes a mesh whose axes are all AxisType.Auto (jg.fsdp.make_mesh "
                       f"builds one), got axis types {mesh.axis_types}.")
    explicit = Mesh(mesh.devices, mesh.axis_names,
                    axis_types=(AxisType.Explicit,) * len(mesh.axis_names))
    found = _twins[mesh] = Twin(mesh, explicit)
  return found


def reduced(mesh: Mesh, axis: str) -> NamedSharding:
  """Replicated over `mesh` and typed reduced over `axis`: a gathered weight whose cotangent
  stays a partial sum."""
  return NamedSharding(mesh, PartitionSpec(reduced={axis}))
