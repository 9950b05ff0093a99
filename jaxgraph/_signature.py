"""Abstract input signatures: what an executable was compiled for, and readable diffs."""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding


class LeafSpec(NamedTuple):
  """What one input leaf must look like for an executable to accept it."""

  shape: tuple[int, ...]
  dtype: np.dtype
  weak_type: bool
  # None means "uncommitted on the default device"; anything else is matched exactly.
  sharding: Sharding | None


class Signature(NamedTuple):
  """A pytree structure plus one `LeafSpec` per leaf. Hashable: it keys executable caches.

  `default_device` is the device `jax.default_device(...)` named when the signature was
  taken (None outside such a context): where the unplaced leaves (`sharding=None`) live, so
  a capture under one default device is not replayed for arrays on another.
  """

  treedef: Any
  leaves: tuple[LeafSpec, ...]
  default_device: Any = None


# default device (None: JAX's first device) -> the shardings that mean "no placement"
_default_shardings: dict[Any, frozenset[Sharding]] = {}
_canonical: dict[Sharding, Sharding] = {}
# Shardings seen whose canonical form is another object: the same placement spelled
# differently (`P(None, "fsdp")` on a one-device mesh is `P()`). Empty in most programs, so
# the gradients' respelling (`respelled`) costs nothing there.
_respelled: set[Sharding] = set()


def _canonicalize(sharding: Sharding) -> Sharding:
  """One object per placement: `P("fsdp", None)` and `P("fsdp")` place a leaf the same way,
  and XLA reports outputs in the short form, so params would change signature after a step.
  Likewise a dimension split along mesh axes of size 1 is not split at all (XLA reports
  `P()` for the output of a layer whose input was `P("fsdp")` on a one-device mesh)."""
  if isinstance(sharding, NamedSharding):
    spec = tuple(_drop_unit_axes(entry, sharding.mesh.shape)
                 for entry in sharding.spec.partitions)
    while spec and spec[-1] is None:
      spec = spec[:-1]
    # Explicit-mode reduced / unreduced axes are types, not placements: kept as they are.
    spec = PartitionSpec(*spec, reduced=sharding.spec.reduced,
                         unreduced=sharding.spec.unreduced)
    return NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)
  return sharding


def _drop_unit_axes(entry: Any, sizes: Any) -> Any:
  """One `PartitionSpec` entry without the mesh axes of size 1 (None if none is left)."""
  if isinstance(entry, str):
    return None if sizes[entry] == 1 else entry
  if isinstance(entry, tuple):
    axes = tuple(axis for axis in entry if sizes[axis] != 1)
    return None if not axes else axes[0] if len(axes) == 1 else axes
  return entry  # None, PartitionSpec.UNCONSTRAINED


def _default_device(setting: Any) -> jax.Device:
  """The device of JAX's `jax_default_device` setting: a device, a platform name, or None.
  This process's first device, as JAX places an array (with several processes,
  `jax.devices()[0]` is process 0's: process 1's arrays looked placed elsewhere)."""
  if isinstance(setting, str):
    return jax.local_devices(backend=setting)[0]
  return setting if setting is not None else jax.local_devices()[0]


def _unplaced(setting: Any) -> frozenset[Sharding]:
  """The shardings that mean "no placement" under the `jax_default_device` setting: the
  default device's. Arrays made under `jax.default_device(d)` sit on d, as an unplaced leaf
  would."""
  defaults = _default_shardings.get(setting)
  if defaults is None:
    device = _default_device(setting)
    defaults = _default_shardings[setting] = frozenset(
        {SingleDeviceSharding(device), SingleDeviceSharding(device, memory_kind="device")})
  return defaults


def _sharding_key(sharding: Sharding | None, unplaced: frozenset[Sharding]) -> Sharding | None:
  if sharding is None or sharding in unplaced:
    return None
  canonical = _canonical.get(sharding)
  if canonical is None:
    canonical = _canonicalize(sharding)
    if canonical == sharding:
      canonical = sharding
    else:
      _respelled.add(sharding)
    _canonical[sharding] = canonical
  return canonical


def respelled(leaves: Sequence[Any], indices: Sequence[int]) -> tuple[tuple[int, Sharding], ...]:
  """`(leaf, its sharding)` for the leaves among `indices` whose sharding a signature holds in
  its canonical spelling, not their own (a gradient is placed back like its argument)."""
  if not _respelled:
    return ()
  # A reduced leaf's gradient is of another type (unreduced): never placed like the leaf.
  return tuple((i, sharding) for i in indices
               if (sharding := getattr(leaves[i], "sharding", None)) in _respelled
               and not sharding.spec.reduced)


def leaf_spec(leaf: Any) -> LeafSpec:
  """The `LeafSpec` of an array, a NumPy array, a Python scalar or a `jax.ShapeDtypeStruct`.

  Raises:
    TypeError: for anything that is not an array (strings, objects, ...).
  """
  return _leaf_spec(leaf, _unplaced(jax.config.jax_default_device))


def _leaf_spec(leaf: Any, unplaced: frozenset[Sharding]) -> LeafSpec:
  if isinstance(leaf, jax.Array):
    return LeafSpec(leaf.shape, leaf.dtype, leaf.weak_type,
                    _sharding_key(leaf.sharding, unplaced))
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return LeafSpec(leaf.shape, leaf.dtype, bool(leaf.weak_type),
                    _sharding_key(leaf.sharding, unplaced))
  try:
    aval = jax.typeof(leaf)
  except TypeError as e:
    raise TypeError(f"{type(leaf).__name__} is not an array") from e
  return LeafSpec(aval.shape, aval.dtype, aval.weak_type, None)


def signature_of(leaves: Sequence[Any], treedef: Any) -> Signature:
  """The signature of already-flattened leaves (`TypeError` names the first non-array leaf)."""
  setting = jax.config.jax_default_device
  unplaced = _unplaced(setting)
  try:
    return Signature(treedef, tuple(_leaf_spec(leaf, unplaced) for leaf in leaves),
                     None if setting is None else _default_device(setting))
  except TypeError:
    for path, leaf in zip(leaf_paths(treedef), leaves):
      try:
        leaf_spec(leaf)
      except TypeError as e:
        raise TypeError(
            f"argument {path} is a {type(leaf).__name__}, not an array: every leaf of the "
            "arguments must be a jax.Array, a NumPy array, a Python scalar or a "
            "jax.ShapeDtypeStruct. Bind non-array arguments with functools.partial before "
            "calling make_graphed.") from e
    raise


def abstract(spec: LeafSpec) -> jax.ShapeDtypeStruct:
  """A `jax.ShapeDtypeStruct` to lower an executable for `spec`."""
  return jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=spec.sharding,
                              weak_type=spec.weak_type)


def abstract_tree(tree: Any) -> Any:
  """`tree` with each leaf as the `jax.ShapeDtypeStruct` of its signature (what hooks and a
  callable `grad_mask` see at capture)."""
  return jax.tree.map(lambda leaf: abstract(leaf_spec(leaf)), tree)


def leaf_paths(treedef: Any, prefix: str = "args") -> list[str]:
  """Readable paths (`args[1]['w']`) of the leaves of an argument tuple."""
  dummy = jax.tree.unflatten(treedef, range(treedef.num_leaves))
  return [prefix + jax.tree_util.keystr(path)
          for path, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


def format_spec(spec: LeafSpec, *, placement: bool = False) -> str:
  """`float32[8,16]`, with its weak type and sharding where it has them; `placement`: says
  also where a leaf without a sharding is (where two specs differ in sharding)."""
  text = f"{spec.dtype}[{','.join(map(str, spec.shape))}]"
  if spec.weak_type:
    text += " (weakly typed: a Python scalar)"
  if spec.sharding is not None:
    text += f" with sharding {spec.sharding}"
  elif placement:
    text += " with no sharding (on the default device)"
  return text


def describe(signature: Signature, prefix: str = "args") -> str:
  """One line: every leaf's path and spec (`args[0]['w']: float32[4,4], args[1]: ...`)."""
  specs = [f"{path}: {format_spec(spec)}"
           for path, spec in zip(leaf_paths(signature.treedef, prefix), signature.leaves)]
  return ", ".join(specs) or f"{prefix}: no array leaves"


def describe_mismatch(expected: Signature, got: Signature, prefix: str = "args") -> str:
  """Lines saying where `got` differs from `expected`: argument path, expected vs. got."""
  if expected.treedef != got.treedef:
    return (f"{prefix} has a different pytree structure: expected {expected.treedef}, "
            f"got {got.treedef}")
  lines = []
  for path, e, g in zip(leaf_paths(got.treedef, prefix), expected.leaves, got.leaves):
    if e != g:
      placed = e.sharding != g.sharding  # then say where an unsharded leaf is
      lines.append(f"{path}: expected {format_spec(e, placement=placed)}, "
                   f"got {format_spec(g, placement=placed)}")
  if expected.default_device != got.default_device:
    lines.append(f"the default device (jax.default_device): expected "
                 f"{expected.default_device}, got {got.default_device}")
  return "\n".join(lines)


def _distance(expected: Signature, got: Signature) -> tuple[int, int, int]:
  """(another structure, leaves that differ, their fields that differ): lower is closer."""
  if expected.treedef != got.treedef:
    return 1, 0, 0
  pairs = [(e, g) for e, g in zip(expected.leaves, got.leaves) if e != g]
  device = expected.default_device != got.default_device
  return 0, len(pairs) + device, sum(a != b for e, g in pairs for a, b in zip(e, g))


def closest(captured: Iterable[Signature], got: Signature) -> Signature:
  """Of the `captured` signatures, the one `got` differs from least: the fewest differing
  leaves, then the fewest differing fields of them (shape, dtype, weak type, sharding);
  another pytree structure counts as the most; the first of equals. Diffs name
  what changed against it, as JAX's cache-miss explanations (`jax_explain_cache_misses`) diff
  against the closest previous key."""
  return min(captured, key=lambda signature: _distance(signature, got))


def sharding_changed(expected: Signature, got: Signature) -> bool:
  """Whether a leaf of `got` is placed otherwise than in `expected` (same structure)."""
  return expected.treedef == got.treedef and any(
      e.sharding != g.sharding for e, g in zip(expected.leaves, got.leaves))
