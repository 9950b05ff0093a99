"""Flat layer buffers: a pytree of parameters held as one 1-D buffer per (group, dtype).

The runtime's host cost of calling an executable grows with its number of argument and
output arrays (~4 µs per leaf on a GPU). A layer with a dozen weights passes a dozen leaves
to its forward and gets a dozen gradients back from its backward; raveled, it passes one
buffer per dtype and gets one gradient buffer per dtype back:

  flat_params = [jg.flat.ravel(p) for p in params]          # FlatTree: buffers + layout
  layers = jg.make_graphed([block] * n, sample_args=[(p, x) for p in flat_params])
  y, pullback = jg.sequential_vjp(layers, flat_params, x)   # block still gets its own pytree
  grads, _ = pullback(ct)                                   # FlatTrees of the same layout
  updates, opt_state = tx.update(grads, opt_state, flat_params)  # optax, unchanged

A `FlatTree` is a registered pytree whose leaves are its buffers and whose auxiliary data is
its `FlatLayout` (static and hashable), so equal layouts give equal signatures and N
identical layers still compile once. A GraphedCallable unravels every FlatTree among its
arguments inside the trace (and on its traced and `jax.jit` fallback paths), so the layer
function sees its own pytree; the backward recomputes those slices from the buffers it
already receives instead of keeping copies of them as residuals.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["FlatLayout", "FlatTree", "Gather", "mask", "ravel", "split", "unravel", "with_gather"]

Group = str | None


class Slot(NamedTuple):
  """Where one leaf of the raveled tree lives in its buffer.

  In a buffer of one part (`BufferSpec.parts`) the leaf is `buffer[offset:offset + size]`;
  in a buffer of several parts its k-th piece starts `offset` elements into chunk k.
  """

  buffer: int
  offset: int
  shape: tuple[int, ...]

  @property
  def size(self) -> int:
    return math.prod(self.shape)


class BufferSpec(NamedTuple):
  """One buffer: the leaves of one (group, dtype), `size` elements in `length`.

  With `parts` > 1 every leaf is split into `parts` equal pieces (its last one zero-padded)
  and piece k of every leaf lives in chunk k (`length // parts` elements). Sharded `parts`
  ways along its one dimension, the buffer then holds on each device a whole piece of every
  leaf, so each leaf's gradient is reduce-scattered into the devices' chunks on its own
  (FSDP2 lays out its all-gather buffers so). `ravel` makes one part, `split` several.
  """

  group: Group
  dtype: np.dtype
  size: int
  length: int
  parts: int = 1

  @property
  def name(self) -> str:
    """The buffer's key in the pytree (and in checkpoints): `float32`, `decay.float32`."""
    return self.dtype.name if self.group is None else f"{self.group}.{self.dtype.name}"

  def piece(self, slot: Slot) -> int:
    """The elements of one piece of the leaf at `slot` (its size in a buffer of one part)."""
    return -(-slot.size // self.parts)


class Gather(NamedTuple):
  """How a layer un-shards buffers split over a mesh axis (FSDP); `jg.fsdp.shard` sets it.

  Every buffer of as many parts as the axis has devices (`BufferSpec.parts`), placed sharded
  along `axis`, is all-gathered before it is unraveled, a floating buffer's shard cast to
  `dtype` first when set (so the collective moves `dtype`'s bytes, FSDP2's `param_dtype`).
  Its gradient is reduce-scattered back in the buffer's own dtype, leaf by leaf.

  Attributes:
    mesh: the mesh the buffers are sharded over.
    axis: the mesh axis they are split along.
    dtype: the dtype the layer gets the gathered floating leaves in; None keeps the
      buffer's. Integer leaves keep theirs.
  """

  mesh: Mesh
  axis: str
  dtype: np.dtype | None = None

  @property
  def parts(self) -> int:
    return self.mesh.shape[self.axis]


@dataclasses.dataclass(frozen=True, repr=False)
class FlatLayout:
  """The static part of a `FlatTree`: hashable, compared by value (it is the pytree's
  auxiliary data, so it is part of every signature the FlatTree appears in).

  Attributes:
    treedef: the structure of the raveled tree.
    slots: per leaf of the tree (in flattening order), where it lives.
    buffers: per buffer, its group, dtype, used size, length and parts.
    gather: if set, the buffers split over its mesh axis are all-gathered before they are
      unraveled (`jg.fsdp.shard` sets it: one all-gather per buffer and layer).
  """

  treedef: Any
  slots: tuple[Slot, ...]
  buffers: tuple[BufferSpec, ...]
  gather: Gather | None = None

  def __repr__(self) -> str:
    buffers = ", ".join(f"{b.name}[{b.length}]" for b in self.buffers)
    return f"FlatLayout({len(self.slots)} leaves in {buffers or 'no buffers'})"

  def gathered(self, buffer: int) -> bool:
    """Whether buffer `buffer` is all-gathered before it is unraveled."""
    parts = self.buffers[buffer].parts
    return self.gather is not None and parts > 1 and parts == self.gather.parts


def _reshape(value: Any, shape: tuple[int, ...]) -> Any:
  """`value.reshape(shape)`. A value typed reduced or unreduced over Explicit mesh axes (a
  prefetched weight, its gradient: `jaxgraph.prefetch`) is given its result's type: jax
  0.10.2 cannot infer it through a reshape that drops dimensions."""
  sharding = jax.typeof(value).sharding
  spec = sharding.spec
  if not (spec.reduced or spec.unreduced):
    return value.reshape(shape)
  typed = NamedSharding(sharding.mesh,
                        PartitionSpec(reduced=spec.reduced, unreduced=spec.unreduced))
  return jax.lax.reshape(value, shape, out_sharding=typed)


def _slice(buffer: Any, slot: Slot, spec: BufferSpec,
           sharding: NamedSharding | None = None) -> Any:
  """The leaf at `slot` of the whole `buffer` of `spec`. With `sharding` its (parts, piece)
  pieces are constrained to it first: the transpose of `_assemble` with that sharding."""
  if spec.parts == 1:
    return _reshape(jax.lax.slice_in_dim(buffer, slot.offset, slot.offset + slot.size),
                    slot.shape)
  piece = spec.piece(slot)
  chunks = _reshape(buffer, (spec.parts, spec.length // spec.parts))
  pieces = jax.lax.slice_in_dim(chunks, slot.offset, slot.offset + piece, axis=1)
  if sharding is not None:
    pieces = jax.lax.with_sharding_constraint(pieces, sharding)
  whole = jax.lax.slice_in_dim(_reshape(pieces, (spec.parts * piece,)), 0, slot.size)
  return _reshape(whole, slot.shape)


def _assemble(leaves: Sequence[Any], slots: Sequence[Slot], spec: BufferSpec,
              sharding: NamedSharding | None = None) -> Any:
  """The buffer of `spec` that holds `leaves` at `slots` (every leaf of the buffer, in slot
  order), in the buffer's dtype, zeros for padding. With `sharding` (the gradient of a
  gathered buffer) each leaf's pieces are constrained to it, piece k on the device of chunk
  k: XLA reduce-scatters each leaf's gradient summed over the devices."""
  flat = [_reshape(jnp.asarray(leaf).astype(spec.dtype), (slot.size,))
          for leaf, slot in zip(leaves, slots)]
  if spec.parts == 1:
    tail = [jnp.zeros((spec.length - spec.size,), spec.dtype)] if spec.length > spec.size else []
    return jnp.concatenate(flat + tail)
  pieces = []
  for leaf, slot in zip(flat, slots):
    piece = spec.piece(slot)
    leaf = _reshape(jax.lax.pad(leaf, jnp.zeros((), spec.dtype),
                                [(0, piece * spec.parts - slot.size, 0)]), (spec.parts, piece))
    pieces.append(leaf if sharding is None else jax.lax.with_sharding_constraint(leaf, sharding))
  return _reshape(jax.lax.concatenate(pieces, 1), (spec.length,))


def gather_dtype(dtype: np.dtype, gather: Gather) -> np.dtype:
  """The dtype a buffer of `dtype` is gathered in: `gather.dtype` for a floating one; an
  integer buffer keeps its own (its values would not survive a float cast). The package's,
  not in `__all__`."""
  if gather.dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    return dtype
  return gather.dtype


def _all_gather(buffer: Any, gather: Gather) -> Any:
  """The whole buffer on every device, from its shards: one all-gather, in `gather_dtype`
  (the shard is cast before the collective; XLA does not move a cast across a gather whose
  result feeds several slices)."""
  dtype = gather_dtype(buffer.dtype, gather)
  return jax.shard_map(lambda shard: jax.lax.all_gather(shard.astype(dtype), gather.axis,
                                                        tiled=True),
                       mesh=gather.mesh, in_specs=PartitionSpec(gather.axis),
                       out_specs=PartitionSpec(), check_vma=False)(buffer)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _gathered_leaves(buffer: Any, spec: BufferSpec, slots: tuple[Slot, ...],
                     gather: Gather) -> list[Any]:
  """The leaves at `slots` (every leaf of the buffer) of a sharded floating buffer,
  all-gathered in one collective.

  Its derivative (`_gathered_leaves_jvp`) slices each leaf from the sharded tangent: linear,
  so forward mode uses it as it is and reverse mode transposes it into `_assemble` with the
  pieces' sharding, the gradient a graphed layer's backward computes (`Expansion.gradients`):
  each leaf's gradient reduce-scattered into the shards, where autodiff through the
  all-gather would reduce the whole buffer.
  """
  whole = _all_gather(buffer, gather)
  return [_slice(whole, slot, spec) for slot in slots]


@_gathered_leaves.defjvp
def _gathered_leaves_jvp(spec: BufferSpec, slots: tuple[Slot, ...], gather: Gather,
                         primals: tuple[Any], tangents: tuple[Any]
                         ) -> tuple[list[Any], list[Any]]:
  """The gathered leaves, and their tangents sliced from the buffer's tangent as it lies,
  each leaf's pieces on the devices of their chunks (`_slice` with `_pieces_sharding`)."""
  (buffer,), (tangent,) = primals, tangents
  sharding, dtype = _pieces_sharding(gather), gather_dtype(spec.dtype, gather)
  leaves = [_slice(tangent, slot, spec, sharding).astype(dtype) for slot in slots]
  return _gathered_leaves(buffer, spec, slots, gather), leaves


def _pieces_sharding(gather: Gather) -> NamedSharding:
  """Where a gathered leaf's (parts, piece) gradient goes: piece k to the device of chunk k."""
  return NamedSharding(gather.mesh, PartitionSpec(gather.axis))


class FlatTree:
  """A pytree held as one 1-D buffer per (group, dtype); see `ravel`.

  Its pytree leaves are the buffers and its auxiliary data the `FlatLayout`, so
  `jax.tree.map`, `optax`, `jax.device_put` and checkpointers see one array per buffer.

  Attributes:
    buffers: the 1-D buffers, one per `layout.buffers` entry.
    layout: the static layout: the tree's structure and where each leaf lives.
  """

  __slots__ = ("buffers", "layout")

  def __init__(self, buffers: Sequence[Any], layout: FlatLayout):
    """Pairs buffers with a layout (e.g. restored buffers with the layout they were saved
    with); checks that each buffer has its spec's dtype and length.

    Raises:
      ValueError: if the number of buffers, or a buffer's shape or dtype, does not match
        `layout`.
    """
    buffers = tuple(buffers)
    if len(buffers) != len(layout.buffers):
      raise ValueError(f"FlatTree got {len(buffers)} buffers for a layout of "
                       f"{len(layout.buffers)} ({layout}); pass the buffers it was raveled "
                       "into, in order.")
    for buffer, spec in zip(buffers, layout.buffers):
      _check_buffer(buffer, spec, layout)
    self.buffers = buffers
    self.layout = layout

  def __repr__(self) -> str:
    return f"FlatTree({self.layout})"

  def unravel(self) -> Any:
    """The tree this was raveled from (leaves sliced out of the buffers; padding dropped).

    Works eagerly and under transformations, forward and reverse mode autodiff included
    (the slices and the gather are differentiable).

    Raises:
      ValueError: if a buffer is not an array of the layout's length and dtype (e.g. a
        FlatTree of optimizer masks or shardings), or, eagerly, if a buffer the layout
        gathers does not lie on the gather's mesh.
    """
    layout = self.layout
    for k, (buffer, spec) in enumerate(zip(self.buffers, layout.buffers)):
      _check_buffer(buffer, spec, layout)
      if layout.gathered(k):
        _check_on_mesh(buffer, spec, layout)
    leaves: list[Any] = [None] * len(layout.slots)
    for k, (buffer, spec) in enumerate(zip(self.buffers, layout.buffers)):
      members = [j for j, slot in enumerate(layout.slots) if slot.buffer == k]
      slots = tuple(layout.slots[j] for j in members)
      if not layout.gathered(k):
        values = [_slice(buffer, slot, spec) for slot in slots]
      elif jnp.issubdtype(spec.dtype, jnp.floating):
        values = _gathered_leaves(buffer, spec, slots, layout.gather)
      else:  # no tangent to slice: an integer buffer is not differentiated
        whole = _all_gather(buffer, layout.gather)
        values = [_slice(whole, slot, spec) for slot in slots]
      for j, value in zip(members, values):
        leaves[j] = value
    return jax.tree.unflatten(layout.treedef, leaves)


def _flatten_with_keys(tree: FlatTree) -> tuple[tuple[tuple[Any, Any], ...], FlatLayout]:
  keys = (jax.tree_util.DictKey(spec.name) for spec in tree.layout.buffers)
  return tuple(zip(keys, tree.buffers)), tree.layout


def _flatten(tree: FlatTree) -> tuple[tuple[Any, ...], FlatLayout]:
  return tree.buffers, tree.layout


def unflatten(layout: FlatLayout, buffers: Sequence[Any]) -> FlatTree:
  """A FlatTree of `layout` holding `buffers`, unchecked (the package's, not in `__all__`)."""
  # JAX unflattens with anything as leaves (tracers, shardings, None, optax's MaskedNode):
  # no checks here.
  tree = object.__new__(FlatTree)
  tree.buffers = tuple(buffers)
  tree.layout = layout
  return tree


jax.tree_util.register_pytree_with_keys(FlatTree, _flatten_with_keys, unflatten, _flatten)


def _check_buffer(buffer: Any, spec: BufferSpec, layout: FlatLayout) -> None:
  shape, dtype = getattr(buffer, "shape", None), getattr(buffer, "dtype", None)
  if dtype == jax.dtypes.float0:
    raise ValueError(
        f"buffer {spec.name!r} of {layout} is a float0 gradient: the gradient of an integer "
        f"buffer ({spec.dtype}), as jax.vjp gives for integer inputs, has no values to "
        "unravel. Unravel the params instead, or keep integer leaves out of the raveled tree.")
  if shape != (spec.length,) or dtype != spec.dtype:
    got = (f"{dtype}{list(shape)}" if shape is not None and dtype is not None
           else type(buffer).__name__)
    raise ValueError(f"buffer {spec.name!r} of {layout} must be a {spec.dtype}[{spec.length}] "
                     f"array, got {got}; a FlatTree's buffers come from `ravel` of a tree of "
                     "this layout (FlatTree(buffers, layout) pairs them explicitly).")


def _check_on_mesh(buffer: Any, spec: BufferSpec, layout: FlatLayout) -> None:
  """An eager buffer that `layout` gathers lies on the devices of the gather's mesh."""
  if not isinstance(buffer, jax.Array) or isinstance(buffer, jax.core.Tracer):
    return
  mesh = layout.gather.mesh
  if buffer.sharding.device_set != set(mesh.devices.flat):
    raise ValueError(
        f"buffer {spec.name!r} of {layout} lies on {len(buffer.sharding.device_set)} "
        f"device(s), not on the {mesh.size} devices of the mesh its layout all-gathers it "
        f"over (axis {layout.gather.axis!r}); to unravel buffers moved off that mesh (e.g. "
        "to one device), drop the gather first: jg.flat.with_gather(tree, None).unravel().")


def is_flat(node: Any) -> bool:
  return isinstance(node, FlatTree)


def ravel(tree: Any, *, group: Callable[[tuple[Any, ...], Any], Group] | None = None
          ) -> FlatTree:
  """Ravels the array leaves of `tree` into one 1-D buffer per (group, dtype).

  Leaves keep their dtypes (a float32 and a bfloat16 weight give two buffers); buffers are
  ordered by first appearance in the tree's flattening order. Works eagerly, under
  `jax.jit`, and under `jax.eval_shape` (abstract sample args: a FlatTree of
  `jax.ShapeDtypeStruct`s).

  Args:
    tree: a pytree of arrays (e.g. a layer's params dict, or an `nnx.State`).
    group: optional `group(path, leaf) -> str | None` splitting the buffers further, e.g.
      `lambda path, leaf: "decay" if leaf.ndim > 1 else "no_decay"` so that an optimizer
      mask (`mask`) can treat each buffer as a whole.

  Returns:
    A `FlatTree`; `.unravel()` gives `tree` back. Weak types are not kept (a buffer is
    strongly typed).

  Raises:
    TypeError: for a leaf that is not an array, a leaf of an extended dtype (PRNG keys),
      or a group that is not a string or None.
  """
  leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  index: dict[tuple[Group, np.dtype], int] = {}
  members: list[list[Any]] = []
  specs: list[list[Any]] = []  # group, dtype, size per buffer (mutable while filling)
  slots = []
  for path, leaf in leaves_with_paths:
    where = "leaf " + (jax.tree_util.keystr(path) or "(root)")
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not hasattr(leaf, "shape"):
      raise TypeError(f"ravel: {where} is a {type(leaf).__name__}, not an array; ravel "
                      "takes a pytree of arrays.")
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
      raise TypeError(f"ravel: {where} has dtype {leaf.dtype} (a PRNG key?), which cannot be "
                      "concatenated into a buffer; keep keys out of the raveled tree.")
    name = None if group is None else group(path, leaf)
    if name is not None and not isinstance(name, str):
      raise TypeError(f"ravel: group returned {name!r} for {where}; it must return a str "
                      "(the buffer's name) or None.")
    key = (name, np.dtype(dtype))
    if key not in index:
      index[key] = len(specs)
      specs.append([name, key[1], 0])
      members.append([])
    k = index[key]
    shape = tuple(leaf.shape)
    slots.append(Slot(k, specs[k][2], shape))
    specs[k][2] += math.prod(shape)
    members[k].append(leaf)
  layout = FlatLayout(treedef, tuple(slots),
                      tuple(BufferSpec(g, d, n, n) for g, d, n in specs))
  buffers = [_concatenate(parts, spec.dtype) for parts, spec in zip(members, layout.buffers)]
  return unflatten(layout, buffers)


def _concatenate(parts: Sequence[Any], dtype: np.dtype) -> Any:
  if all(isinstance(p, jax.ShapeDtypeStruct) for p in parts):
    return jax.ShapeDtypeStruct((sum(math.prod(p.shape) for p in parts),), dtype)
  return jnp.concatenate([jnp.asarray(p, dtype).reshape(-1) for p in parts])


def unravel(tree: Any) -> Any:
  """`tree` with every `FlatTree` in it (at any depth) replaced by its unraveled tree
  (`tree` itself when it holds none)."""
  if not any(isinstance(node, FlatTree) for node in jax.tree.leaves(tree, is_leaf=is_flat)):
    return tree
  return jax.tree.map(lambda node: node.unravel() if isinstance(node, FlatTree) else node,
                      tree, is_leaf=is_flat)


def unravelling(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn` called with every FlatTree among its positional arguments unraveled."""

  @functools.wraps(fn)
  def call(*args: Any, **kwargs: Any) -> Any:
    return fn(*unravel(args), **kwargs)

  return call


def mask(tree: Any, predicate: Callable[[Group], bool]) -> Any:
  """One bool per buffer of every FlatTree in `tree`: `predicate(group)`.

  For optimizer masks over flat params, e.g. weight decay on the "decay" buffers only:
  `optax.adamw(lr, mask=lambda p: jg.flat.mask(p, lambda group: group == "decay"))`.

  Raises:
    TypeError: if `tree` has a leaf outside any FlatTree (it would have no group).
  """

  def node_mask(node: Any) -> Any:
    if not isinstance(node, FlatTree):
      raise TypeError(f"flat.mask: found a {type(node).__name__} leaf outside any FlatTree; "
                      "mask takes FlatTrees (or pytrees of them), whose buffers have groups.")
    return unflatten(node.layout, [bool(predicate(s.group)) for s in node.layout.buffers])

  return jax.tree.map(node_mask, tree, is_leaf=is_flat)


def split(tree: FlatTree, parts: int, *, min_size: int = 0) -> FlatTree:
  """The same tree with every buffer of at least `min_size` elements in `parts` parts.

  Each leaf of such a buffer is split into `parts` equal pieces, its last one zero-padded,
  and piece k of every leaf goes to chunk k of the buffer (`BufferSpec`): sharded `parts`
  ways, the buffer then holds a piece of every leaf on every device, and a layer's backward
  reduce-scatters each leaf's gradient into the chunks (`jg.fsdp.shard` splits into the
  mesh axis size). The padding is never unraveled, gets zero gradients, and stays zero
  under elementwise optimizers: numerics are unchanged. Smaller buffers keep their layout.
  The leaves are re-laid as the buffers store them (not in a gather's dtype), and a tree
  whose buffers are already in `parts` parts comes back as it is: splitting a sharded tree
  again changes no value.

  Raises:
    TypeError: if `tree` is not a FlatTree.
    ValueError: if `parts` < 1, or a buffer to re-lay holds no values (a mask or abstract
      buffers).
  """
  if not isinstance(tree, FlatTree):
    raise TypeError(f"flat.split takes a FlatTree, got {type(tree).__name__}.")
  if parts < 1:
    raise ValueError(f"flat.split: parts must be >= 1, got {parts}.")
  layout = tree.layout
  specs = list(layout.buffers)
  for k, spec in enumerate(specs):
    if spec.size >= min_size and spec.parts != parts:
      chunk = sum(-(-slot.size // parts) for slot in layout.slots if slot.buffer == k)
      specs[k] = spec._replace(length=chunk * parts, parts=parts)
  if tuple(specs) == layout.buffers:
    return tree
  slots, offsets = [], [0] * len(specs)  # offsets within a chunk (in the buffer, one part)
  for slot in layout.slots:
    spec = specs[slot.buffer]
    slots.append(slot._replace(offset=offsets[slot.buffer]))
    offsets[slot.buffer] += spec.piece(slot)
  new = dataclasses.replace(layout, slots=tuple(slots), buffers=tuple(specs))
  # Without the gather: it would hand out the leaves in its dtype (bfloat16 rounds float32).
  leaves = jax.tree.leaves(with_gather(tree, None).unravel())
  buffers = [_assemble([leaves[j] for j, slot in enumerate(slots) if slot.buffer == k],
                       [slot for slot in slots if slot.buffer == k], spec)
             for k, spec in enumerate(specs)]
  return FlatTree(buffers, new)


def with_gather(tree: FlatTree, gather: Gather | None) -> FlatTree:
  """The same buffers with a layout that all-gathers the split ones before unravelling.

  Inside a layer's executable each buffer of `gather.parts` parts (`split`), sharded along
  `gather.axis`, is then all-gathered once (not each leaf), a floating one in `gather.dtype`
  when set, and its gradient reduce-scattered leaf by leaf; `jg.fsdp.shard` sets it. None:
  unravel the buffers as they are (e.g. gathered to one device for generation).
  """
  if not isinstance(tree, FlatTree):
    raise TypeError(f"flat.with_gather takes a FlatTree, got {type(tree).__name__}.")
  if gather is not None and gather.dtype is not None:
    gather = gather._replace(dtype=np.dtype(gather.dtype))
  return unflatten(dataclasses.replace(tree.layout, gather=gather), tree.buffers)


@dataclasses.dataclass(frozen=True)
class Expansion:
  """How the argument leaves of a signature map to the leaves the layer function sees.

  Every FlatTree among the arguments is replaced by its tree: each of its leaves is a slice
  of one argument leaf (a buffer); every other argument leaf is itself. Built by
  `expansion` for `jaxgraph._capture`: the forward differentiates with respect to the
  expanded leaves, the backward recomputes the slices it needs from the buffers and
  concatenates the slices' gradients into one gradient per buffer.

  Attributes:
    treedef: the structure of the arguments with every FlatTree unraveled.
    inputs: per expanded leaf, the argument leaf it comes from.
    slots: per expanded leaf, its slot in that buffer (None: the argument leaf itself).
    layouts: per argument leaf, the layout of its FlatTree (None: not a buffer).
  """

  treedef: Any
  inputs: tuple[int, ...]
  slots: tuple[Slot | None, ...]
  layouts: tuple[FlatLayout | None, ...]

  @functools.cached_property
  def _members(self) -> dict[int, list[int]]:
    """Per argument leaf, its expanded leaves in buffer order."""
    members: dict[int, list[int]] = {}
    for j, i in enumerate(self.inputs):
      members.setdefault(i, []).append(j)
    return members

  def expand(self, leaves: Sequence[Any]) -> list[Any]:
    """The expanded leaves of the argument leaves `leaves` (slices of the buffers)."""
    expanded = self.slices(dict(enumerate(leaves)), range(len(self.inputs)))
    return [expanded[j] for j in range(len(self.inputs))]

  def slices(self, leaves: Mapping[int, Any], wanted: Sequence[int]) -> dict[int, Any]:
    """The expanded leaves `wanted`, from the argument leaves they come from (a buffer its
    layout gathers is all-gathered once)."""
    whole: dict[int, Any] = {}
    out = {}
    for j in wanted:
      i, slot = self.inputs[j], self.slots[j]
      if slot is None:
        out[j] = leaves[i]
        continue
      layout = self.layouts[i]
      if i not in whole:
        whole[i] = (_all_gather(leaves[i], layout.gather) if layout.gathered(slot.buffer)
                    else leaves[i])
      out[j] = _slice(whole[i], slot, layout.buffers[slot.buffer])
    return out

  def gradients(self, grads: Mapping[int, Any], select: Sequence[int]) -> list[Any]:
    """One gradient per argument leaf in `select`, from the gradients of expanded leaves:
    a buffer's holds its slices' gradients (`_assemble`: reduce-scattered leaf by leaf
    where the layout gathers the buffer), zeros for padding."""
    out = []
    for i in select:
      layout, members = self.layouts[i], self._members[i]
      if layout is None:
        out.append(grads[members[0]])
        continue
      buffer = self.slots[members[0]].buffer
      sharding = _pieces_sharding(layout.gather) if layout.gathered(buffer) else None
      out.append(_assemble([grads[j] for j in members], [self.slots[j] for j in members],
                           layout.buffers[buffer], sharding))
    return out


@functools.lru_cache(maxsize=None)
def expansion(treedef: Any) -> Expansion:
  """The `Expansion` of argument leaves of structure `treedef` (cached per structure)."""
  args = jax.tree.unflatten(treedef, range(treedef.num_leaves))
  inputs: list[int] = []
  slots: list[Slot | None] = []
  layouts: list[FlatLayout | None] = [None] * treedef.num_leaves
  for node in jax.tree.leaves(args, is_leaf=is_flat):
    if isinstance(node, FlatTree):
      for i in node.buffers:
        layouts[i] = node.layout
      # in slot order: the flattening order of the unraveled tree
      for slot in node.layout.slots:
        inputs.append(node.buffers[slot.buffer])
        slots.append(slot)
    else:
      inputs.append(node)
      slots.append(None)
  expanded = jax.tree.map(
      lambda node: (jax.tree.unflatten(node.layout.treedef, [0] * len(node.layout.slots))
                    if isinstance(node, FlatTree) else node), args, is_leaf=is_flat)
  return Expansion(jax.tree.structure(expanded), tuple(inputs), tuple(slots), tuple(layouts))
