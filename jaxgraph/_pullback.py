"""The backward of one forward replay: `Pullback` (one-shot, deferred wgrad) and the call of
the backward executables with what the forward kept.

A pullback holds what its backward needs (forward inputs and outputs the backward reads, the
kept residuals, the derived key), and the forward's arguments only where backward hooks will
read them; calling it replays the backward executable once and assembles one gradient per
positional argument, like `jax.vjp`.

With `grad_mask` (`mask_flags`, `masked_vjp`) the leaves left out get float0 gradients;
`partition` and `combine` split a tree by such a mask, so that an optimizer goes over the
trainable part only. Unless `partition` ran before, the first replayed pullback of a process
that returns such gradients says so on the `jaxgraph` logger, naming `partition`
(`note_frozen_grads`): an optimizer given them fails deep inside Optax, with nothing that
names `grad_mask`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import Any, Callable, Literal, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgraph import _capture as capture_lib
from jaxgraph import _hooks as hooks_lib
from jaxgraph import _signature as sig_lib
from jaxgraph import offload as offload_lib

# What a backward returns: the gradients now, and the deferred weight gradients (delay_wgrad).
BackwardResult = tuple[tuple[Any, ...], Callable[[], tuple[Any, ...]] | None]

logger = logging.getLogger("jaxgraph")
# Set once the note on the float0 gradients of frozen leaves was logged (once per process),
# or once `partition` ran: its caller splits such gradients already.
FROZEN_GRADS_KNOWN = threading.Event()


class Owner(Protocol):
  """`GraphedCallable`'s interface inside the package: what the other modules (the cache, a
  pullback, make_graphed's capture and warmup, fused and prefetching steps, pipelines) use
  of a graphed callable, beside its public members. Named by what it does: _graphed.py
  imports this module. docs/gen_api.py leaves these members out of the API page.

  Attributes:
    fn: the function captured (a fused step's: the composed chain).
    index: its position in its `make_graphed` call (its key stream's index).
    name: how errors, logs and profiles name it (`block[3]`).
    trace_names: its forward's and backward's names in a `jax.profiler` trace.
    config: the settings of its `make_graphed` call (`_graphed.Config`).
    counts: what its `stats` report (`_graphed.Counters`).
    phase_hooks: its hooks per phase (`_hooks.by_phase`).
    offloader: which of its kept buffers go to host memory (`offload.Offloader`).
    executables: its executables per signature (`_cache.ExecutableCache`).
    uncaptured_fn: `fn` as it runs outside the executables (under `remat_policy`).
    n_keys: keys its function takes per call (0 without rng; a fused step: one a layer).
    remat_policy: the residual policy its capture applies around `fn`.
    warns_of_constant_keys: whether its capture warns of keys that are constants of `fn`.
  """

  fn: Callable[..., Any]
  index: int
  name: str
  trace_names: tuple[str, str]
  config: Any
  counts: Any
  phase_hooks: dict[hooks_lib.Phase, hooks_lib.Hooks]
  offloader: offload_lib.Offloader
  executables: Any
  uncaptured_fn: Callable[..., Any]
  n_keys: int
  remat_policy: Callable[..., bool] | None
  warns_of_constant_keys: bool

  def exclusive(self) -> Any:
    """Holds the callable for one use (raises if another thread holds it)."""

  def count_replay(self, *, backward: bool) -> None:
    """Counts one forward or backward replay."""

  def flatten(self, args: tuple[Any, ...], key: Any, kwargs: dict[str, Any]
              ) -> tuple[list[Any] | None, Any]:
    """Checks a call's arguments; their leaves (None under a trace) and treedef."""

  def forward(self, args: tuple[Any, ...], leaves: list[Any], treedef: Any, key: Any, *,
              phase: hooks_lib.Phase, iteration: int, microbatch: int, with_pullback: bool,
              stream: Any = None, signature: Any = None) -> Any:
    """One forward in `phase`: hooks, executable, pullback."""

  def require_backward(self, caller: str) -> None:
    """Raises for a callable built inference-only."""

  def differentiated(self, signature: sig_lib.Signature) -> tuple[int, ...]:
    """The argument leaves of `signature` that get gradients."""

  def twin(self, signature: sig_lib.Signature) -> Any:
    """The Explicit twin mesh to trace `signature` on, or None."""

  def stream_inputs(self, stream: Any, taken: Any = None) -> list[Any]:
    """The key stream's inputs to a forward (`stream` overrides base and counter; `taken`:
    the shardings the forward takes them in)."""

  def advance(self, counters: list[Any]) -> None:
    """Moves the key stream on to the counters a forward returned."""


@functools.lru_cache(maxsize=None)
def arg_ranges(treedef: Any) -> tuple[tuple[Any, int, int], ...]:
  """(treedef, first leaf, end leaf) of each positional argument; cached per structure."""
  ranges, start = [], 0
  for child in treedef.children():
    ranges.append((child, start, start + child.num_leaves))
    start += child.num_leaves
  return tuple(ranges)


def argument_leaves(treedef: Any, argnums: tuple[int, ...]) -> tuple[int, ...]:
  """The argument leaves of the positional arguments `argnums` (a FlatTree: its buffers)."""
  return tuple(leaf for argnum, (_, lo, hi) in enumerate(arg_ranges(treedef))
               if argnum in argnums for leaf in range(lo, hi))


def _is_flag(value: Any) -> bool:
  return isinstance(value, (bool, np.bool_))


def mask_flags(grad_mask: Any, args: tuple[Any, ...]) -> tuple[bool, ...] | None:
  """One bool per leaf of `args`: whether `grad_mask` lets it have a gradient (None: no mask).

  `grad_mask` (`make_graphed(..., grad_mask=...)`) is a pytree prefix of the positional
  arguments with bool leaves, each covering the subtree of the arguments it sits over, or a
  function of the arguments returning one.

  Raises:
    TypeError: for a leaf of the mask that is not a bool.
    ValueError: for a mask whose structure is not a prefix of the arguments'.
  """
  if grad_mask is None:
    return None
  prefix = grad_mask(*args) if callable(grad_mask) else grad_mask
  example = ("grad_mask=(False, True) (no gradient for the first argument), or a tree of "
             "bools over an argument's leaves, grad_mask=({'w': False, 'lora': True}, True)")
  bad = [leaf for leaf in jax.tree.leaves(prefix) if not _is_flag(leaf)]
  if bad:
    raise TypeError(f"grad_mask must hold bools (True: gradient), got {bad[0]!r}; e.g. "
                    f"{example}.")
  try:
    return _broadcast(prefix, tuple(args))
  except ValueError as e:
    where = str(e).replace("tree_map tree", "args")  # JAX's name of the tree, here args
    raise ValueError(f"grad_mask does not fit the positional arguments: it must be a pytree "
                     f"prefix of them, e.g. {example}. JAX says: {where}") from None


def _broadcast(prefix: Any, tree: Any) -> tuple[bool, ...]:
  """One bool per leaf of `tree`: the bool of `prefix` sitting over it (a ValueError from
  JAX when `prefix` is not a pytree prefix of `tree`)."""
  per_leaf = jax.tree.map(lambda flag, sub: [bool(flag)] * len(jax.tree.leaves(sub)),
                          prefix, tree)
  return tuple(jax.tree.leaves(per_leaf))


def partition(tree: Any, mask: Any) -> tuple[Any, Any]:
  """Splits `tree` into its trainable part and its frozen part, by a mask like `grad_mask`'s.

  For training a frozen base (LoRA) with an optimizer over the trainable part only, as
  Equinox's `eqx.partition` does: both parts keep `tree`'s structure, with None where the
  other part holds the leaf, and Optax takes a tree with None holes as one without those
  leaves (`tx.init`, `tx.update`, `optax.apply_updates`, global-norm clipping). So AdamW
  keeps no moments for a frozen leaf and never decays it, and the `float0` gradients a
  `grad_mask` gives the frozen leaves are dropped with the frozen part:

    trainable, frozen = jg.partition(params, params_mask)
    opt_state = tx.init(trainable)
    grads, _ = jg.partition(param_grads, params_mask)     # the float0 leaves go to `_`
    updates, opt_state = tx.update(grads, opt_state, trainable)
    params = jg.combine(optax.apply_updates(trainable, updates), frozen)

  Works eagerly and under `jax.jit` (it moves no data). Handed to an optimizer unsplit,
  float0 gradients fail inside Optax ("ufunc 'power' not supported", "Called add with a
  float0 array"); so the first replayed pullback that returns them in a process that never
  called `partition` says so once on the `jaxgraph` logger, naming this recipe.

  Args:
    tree: a pytree: the params of a layer, a list of them, their gradients (a `FlatTree`
      is split by buffer, an `nnx.State` by variable).
    mask: a pytree prefix of `tree` with bool leaves (True: trainable), each covering the
      subtree it sits over, or a function of `tree` returning one: for one argument, what
      `make_graphed(..., grad_mask=...)` holds for it (`{"w": False, "lora": True}`,
      `jg.flat.mask(params, lambda group: group == "lora")`, ...).

  Returns:
    `(trainable, frozen)`; `combine(trainable, frozen)` is `tree` again.

  Raises:
    TypeError: for a leaf of the mask that is not a bool.
    ValueError: for a mask whose structure is not a prefix of `tree`'s.
  """
  FROZEN_GRADS_KNOWN.set()  # no note on float0 gradients: this caller splits them
  prefix = mask(tree) if callable(mask) else mask
  bad = [leaf for leaf in jax.tree.leaves(prefix) if not _is_flag(leaf)]
  if bad:
    raise TypeError(f"partition: the mask must hold bools (True: trainable), got {bad[0]!r}; "
                    "e.g. {'w': False, 'lora': True} over params {'w': ..., 'lora': ...}.")
  try:
    flags = _broadcast(prefix, tree)
  except ValueError as e:
    where = str(e).replace("tree_map tree", "tree")
    raise ValueError("partition: the mask does not fit the tree: it must be a pytree prefix "
                     "of it (a bool per leaf or per subtree), as for one argument of "
                     f"grad_mask. JAX says: {where}") from None
  leaves, treedef = jax.tree.flatten(tree)
  trainable = [leaf if flag else None for leaf, flag in zip(leaves, flags)]
  frozen = [None if flag else leaf for leaf, flag in zip(leaves, flags)]
  return jax.tree.unflatten(treedef, trainable), jax.tree.unflatten(treedef, frozen)


def combine(*trees: Any) -> Any:
  """The parts `partition` split a tree into, put back together: each leaf taken from the
  first of `trees` that holds one (not None) there.

  Raises:
    ValueError: if the trees do not share one structure (parts of different trees).
  """
  def first(*leaves: Any) -> Any:
    return next((leaf for leaf in leaves if leaf is not None), None)

  try:
    return jax.tree.map(first, *trees, is_leaf=lambda leaf: leaf is None)
  except ValueError as e:
    raise ValueError("combine: the parts do not share one structure; pass the parts "
                     f"`partition` split one tree into. JAX says: {e}") from None


def check_carry(layers: Sequence[Any], params: Sequence[Any], x: Any, *rest: Any,
                where: str) -> None:
  """Refuses a `grad_mask` that leaves out a float leaf of the carried input `x` of a layer
  above the first of a stack (`layers[1:]`): its gradient is the cotangent of the layer
  below. Checked once per `make_graphed` call among the layers, before anything runs;
  `x` stands for every layer's input (a stack carries one structure)."""
  checked = set()
  for i, layer in enumerate(layers[1:], 1):
    config = layer.config
    if config.grad_mask is None or id(config) in checked:
      continue
    checked.add(id(config))
    flags = mask_flags(config.grad_mask, (params[i], x, *rest))
    first = len(jax.tree.leaves(params[i]))
    x_leaves = jax.tree.leaves(x)
    if not all(flag for flag, leaf in zip(flags[first:first + len(x_leaves)], x_leaves)
               if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)):
      raise ValueError(
          f"{where}: the grad_mask of {layer.name} leaves out (part of) its input x, the "
          "output of the layer below it, which then would get no cotangent. In a stack, "
          "keep x differentiated and mask the params (and any other argument): "
          "grad_mask=(params_mask, True, ...).")


def note_frozen_grads(name: str, count: int) -> None:
  """Says on the `jaxgraph` logger, once per process and only if `partition` never ran, that
  `name`'s pullback returned float0 gradients for `count` (> 0) float leaves `grad_mask`
  leaves out, and how to give an optimizer the trainable part. (A float0 array cannot raise
  a message of its own when Optax computes with it: JAX and NumPy reject it first, from
  inside Optax, with "Called add with a float0 array" or "ufunc 'power' not supported".)"""
  if not count or FROZEN_GRADS_KNOWN.is_set():
    return
  FROZEN_GRADS_KNOWN.set()
  logger.warning(
      "%s: its pullback returns float0 gradients (no values) for the %d float leaf(s) "
      "grad_mask leaves out. An optimizer cannot take them: optax.adamw and optax.masked "
      "fail inside Optax (\"ufunc 'power' not supported\", 'Called add with a float0 "
      "array'). Give it the trainable part: "
      "trainable, frozen = jaxgraph.partition(params, mask); grads, _ = "
      "jaxgraph.partition(grads, mask); tx.update(grads, opt_state, trainable); params = "
      "jaxgraph.combine(optax.apply_updates(trainable, updates), frozen) "
      "(docs/grad-mask.md). Said once per process.",
      name, count)


def differentiated_leaves(signature: sig_lib.Signature,
                          flags: Sequence[bool] | None = None) -> tuple[int, ...]:
  """The argument leaves that get gradients: those of inexact dtypes (like `jax.vjp`) that
  `flags` (from `mask_flags`; None: all) lets through."""
  return tuple(i for i, s in enumerate(signature.leaves)
               if jnp.issubdtype(s.dtype, jnp.inexact)
               and (flags is None or flags[i]))


def masked_leaves(signature: sig_lib.Signature, grad_mask: Any) -> tuple[int, ...]:
  """The argument leaves of `signature` that get gradients: the float leaves `grad_mask` lets
  through (a callable mask is called with `jax.ShapeDtypeStruct` arguments)."""
  if grad_mask is None:
    return differentiated_leaves(signature)
  args = jax.tree.unflatten(signature.treedef, [sig_lib.abstract(s) for s in signature.leaves])
  return differentiated_leaves(signature, mask_flags(grad_mask, args))


def masked_vjp(fn: Callable[..., Any], args: tuple[Any, ...], grad_mask: Any, *,
               name: str = "a graphed callable"
               ) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]:
  """`jax.vjp(fn, *args)` with respect to the leaves `grad_mask` lets through: the others are
  constants of the linearization, their gradient a float0 zero (as an integer leaf's;
  `note_frozen_grads` tells of the float ones, naming `name`)."""
  flags = mask_flags(grad_mask, args)
  if flags is None:
    return jax.vjp(fn, *args)
  leaves, treedef = jax.tree.flatten(args)
  kept = [i for i, flag in enumerate(flags) if flag]
  frozen = sum(1 for leaf, flag in zip(leaves, flags)
               if not flag and jnp.issubdtype(jnp.result_type(leaf), jnp.inexact))

  def primal(*values: Any) -> Any:
    full = list(leaves)
    for i, value in zip(kept, values):
      full[i] = value
    return fn(*jax.tree.unflatten(treedef, full))

  out, vjp_fn = jax.vjp(primal, *[leaves[i] for i in kept])

  def pullback(cotangents: Any) -> tuple[Any, ...]:
    full = [np.zeros(np.shape(leaf), jax.dtypes.float0) for leaf in leaves]
    for i, grad in zip(kept, vjp_fn(cotangents)):
      full[i] = grad
    note_frozen_grads(name, frozen)
    return tuple(jax.tree.unflatten(treedef, full))

  return out, pullback


def stop_masked(args: tuple[Any, ...], grad_mask: Any) -> tuple[Any, ...]:
  """`args` with `jax.lax.stop_gradient` on the leaves `grad_mask` leaves out (under a user's
  transformation: no gradient flows into them)."""
  flags = mask_flags(grad_mask, args)
  if flags is None:
    return args
  leaves, treedef = jax.tree.flatten(args)
  return jax.tree.unflatten(treedef, [leaf if flag else jax.lax.stop_gradient(leaf)
                                      for leaf, flag in zip(leaves, flags)])


def backward_kinds(diff: tuple[int, ...], treedef: Any, *, delay_wgrad: bool,
                   wgrad_argnums: tuple[int, ...]
                   ) -> list[tuple[capture_lib.BackwardKind, tuple[int, ...]]]:
  """Which backward executables to build and which argument leaves each returns grads of
  (of the differentiated leaves `diff` of arguments of structure `treedef`): one "full", or
  "dgrad" now and "wgrad" (the weights') later."""
  if not delay_wgrad:
    return [("full", diff)]
  weight_leaves = set(argument_leaves(treedef, wgrad_argnums))
  return [("dgrad", tuple(i for i in diff if i not in weight_leaves)),
          ("wgrad", tuple(i for i in diff if i in weight_leaves))]


def frozen_float_leaves(entry: capture_lib.Executables) -> int:
  """How many float argument leaves of `entry` get no gradient (those `grad_mask` leaves
  out: float0 gradients, as an integer leaf's)."""
  differentiated = set(entry.layout.diff)
  return sum(1 for leaf, spec in enumerate(entry.signature.leaves)
             if leaf not in differentiated and jnp.issubdtype(spec.dtype, jnp.inexact))


def assemble(entry: capture_lib.Executables, values: Sequence[Any], select: tuple[int, ...],
             argnums: tuple[int, ...] | None) -> tuple[Any, ...]:
  """Gradients per positional argument, like `jax.vjp`; args outside `argnums` are None."""
  leaves: list[Any] = [None] * len(entry.signature.leaves)
  differentiated = set(entry.layout.diff)
  for leaf, spec in enumerate(entry.signature.leaves):
    if leaf not in differentiated:
      leaves[leaf] = np.zeros(spec.shape, jax.dtypes.float0)  # like jax.vjp, integer inputs
  for leaf, value in zip(select, values):
    leaves[leaf] = value
  return tuple(
      jax.tree.unflatten(child, leaves[lo:hi]) if argnums is None or argnum in argnums else None
      for argnum, (child, lo, hi) in enumerate(arg_ranges(entry.signature.treedef)))


def placed_as(array: jax.Array, sharding: Any) -> jax.Array:
  """`array` under `sharding`, an equivalent spelling of its own placement: the same device
  buffers, no copy."""
  return jax.make_array_from_single_device_arrays(
      array.shape, sharding, [shard.data for shard in array.addressable_shards])


def any_deleted(arrays: Sequence[Any]) -> bool:
  """Whether an array among `arrays` was deleted or donated (a call with it fails)."""
  return any(getattr(x, "is_deleted", lambda: False)() for x in arrays)


@dataclasses.dataclass(eq=False, repr=False)  # holds arrays: no elementwise ==, no dumps
class ExecutableBackward:
  """The backward of one forward replay of `entry`: what it read, and how to run it.

  Attributes:
    owner: the callable that replayed the forward (its name, its loaded executables).
    entry: the executables of the forward's signature.
    needed_inputs: the forward inputs the backward reads (the derived key among them).
    needed_outputs: the forward outputs the backward reads.
    kept: what the forward returned for the backward only (donated to the last backward).
    placements: `(argument leaf, its sharding)` where the executable returns that leaf's
      gradient in another spelling of the same placement (`_signature.respelled`).
    on_host: the positions in `kept` of arrays async offload copied to host memory; the
      backward copies them back first, unless `prefetch` already did.
  """

  owner: Owner
  entry: capture_lib.Executables
  needed_inputs: list[Any]
  needed_outputs: list[Any]
  kept: list[Any]
  placements: tuple[tuple[int, Any], ...] = ()
  on_host: tuple[int, ...] = ()
  # With delay_wgrad, the host arrays the dgrad's prefetch copied back: the wgrad's
  # residuals wait on the host again in between, as in executable mode.
  _host_while_dgrad: dict[int, Any] = dataclasses.field(default_factory=dict)
  # With delay_wgrad, between dgrad and wgrad: what the dgrad returned for the wgrad
  # (`_capture.WgradSplit`), donated to the wgrad.
  _stash: list[Any] = dataclasses.field(default_factory=list)

  def prefetch(self) -> None:
    """Starts copying the kept arrays in host memory back to the device (once)."""
    if self.on_host:
      host = [self.kept[i] for i in self.on_host]
      if "dgrad" in self.entry.backward:
        self._host_while_dgrad = dict(zip(self.on_host, host))
      for i, array in zip(self.on_host, offload_lib.start_to_device(host)):
        self.kept[i] = array
      self.on_host = ()

  def __call__(self, cotangents: Any) -> BackwardResult:
    entry, layout = self.entry, self.entry.layout
    ct_leaves, ct_treedef = jax.tree.flatten(cotangents)
    if ct_treedef != layout.out_treedef:
      raise TypeError(f"the cotangent passed to the pullback of {self.owner.name} has "
                      f"structure {ct_treedef}, but the outputs have {layout.out_treedef}.")
    cts = [ct_leaves[i] for i in layout.ct_leaves]
    if self.on_host and self._mismatched(cts, arrays_only=True):
      raise self._cotangent_error(cts)  # before any residual is copied back for nothing
    first_kind, (_, select) = next(iter(entry.backward.items()))
    try:
      values = self._run(first_kind, cts)
    except (TypeError, ValueError) as e:
      if self._mismatched(cts):  # our message says it all; XLA's below it would only confuse
        raise self._cotangent_error(cts) from None
      raise self._cotangent_error(cts) from e  # the sharding differs: XLA's says how
    if first_kind == "full":
      return assemble(entry, values, select, None), None
    values, self._stash = values[:len(select)], values[len(select):]
    self._keep_for_wgrad()
    wgrad_select = entry.backward["wgrad"][1]
    argnums = self.owner.config.wgrad_argnums
    dgrad_argnums = tuple(i for i in range(len(arg_ranges(entry.signature.treedef)))
                          if i not in argnums)
    return (assemble(entry, values, select, dgrad_argnums),
            lambda: assemble(entry, self._wgrad(cts), wgrad_select, argnums))

  def _keep_for_wgrad(self) -> None:
    """After the dgrad: lets go of what the wgrad does not read (the dgrad was the last use
    of those kept buffers), and puts the kept buffers it reads that wait in host memory back
    there (the device copies went with the dgrad, as in executable mode)."""
    split = self.entry.split
    kept_reads, reads = set(split.kept_reads), set(split.reads)
    for i, array in self._host_while_dgrad.items():
      self.kept[i] = array
    self.on_host = tuple(i for i in self._host_while_dgrad if i in kept_reads)
    self._host_while_dgrad = {}
    self.kept = [k if i in kept_reads else None for i, k in enumerate(self.kept)]
    a = len(self.needed_inputs)
    self.needed_inputs = [v if i in reads else None for i, v in enumerate(self.needed_inputs)]
    self.needed_outputs = [v if a + i in reads else None
                           for i, v in enumerate(self.needed_outputs)]

  def _wgrad(self, cts: list[Any]) -> list[Any]:
    grads = self._run("wgrad", cts)
    self._stash, self.kept = [], []  # donated (best effort): not held past the wgrad
    return grads

  def _run(self, kind: capture_lib.BackwardKind, cts: list[Any]) -> list[Any]:
    self.prefetch()
    owner = self.owner
    exe = owner.executables.local(self.entry, self.entry.backward[kind][0])
    args = [*self.needed_inputs, *self.needed_outputs, *self.kept, *cts]
    if kind == "wgrad":
      args = [args[i] for i in self.entry.split.reads] + self._stash
    try:
      with jax.profiler.TraceAnnotation(owner.trace_names[1]):
        grads = exe(*args)
    except (RuntimeError, ValueError) as e:  # deleted: RuntimeError; donated: ValueError
      if any_deleted(args):
        raise RuntimeError(
            f"the backward of {owner.name} needs arrays from its forward that were deleted "
            "or donated since (e.g. params donated to an optimizer step before the "
            "pullback ran). Run every pullback before donating the forward's inputs.") from e
      raise
    if self.placements:
      placed = dict(self.placements)
      select = self.entry.backward[kind][1]
      grads = [placed_as(g, placed[leaf]) if leaf in placed else g
               for leaf, g in zip(select, grads)] + list(grads[len(select):])  # dgrad: stash
    return grads

  def _mismatched(self, cts: list[Any], *, arrays_only: bool = False
                  ) -> list[tuple[int, Any, Any]]:
    """(output leaf, shape, dtype) of each cotangent whose shape or dtype is not its
    output's; `arrays_only` leaves Python scalars to the executable's own check."""
    specs = self.entry.layout.out_specs
    found = []
    for i, got in zip(self.entry.layout.ct_leaves, cts):
      shape, dtype = getattr(got, "shape", None), getattr(got, "dtype", type(got))
      if (shape, dtype) != (specs[i].shape, specs[i].dtype) and (
          shape is not None or not arrays_only):
        found.append((i, shape, dtype))
    return found

  def _cotangent_error(self, cts: list[Any]) -> TypeError:
    layout = self.entry.layout
    lines = []
    paths = sig_lib.leaf_paths(layout.out_treedef, "cotangents")
    for i, got_shape, got_dtype in self._mismatched(cts):
      want = layout.out_specs[i]
      lines.append(f"{paths[i]}: expected {want.dtype}{list(want.shape)}, got "
                   f"{got_dtype}{list(got_shape) if got_shape is not None else ''}")
    detail = "\n".join(lines) or "(shapes and dtypes match; the sharding differs)"
    return TypeError(f"the cotangent passed to the pullback of {self.owner.name} does not "
                     f"match its outputs:\n{detail}\nA cotangent has the shape and dtype of "
                     "the output.")


class Pullback:
  """The backward of one forward replay. One-shot: a second call raises.

  `pullback(cotangents)` returns one gradient per positional argument of the forward. With
  `delay_wgrad=True` the weight arguments (`wgrad_argnums`) are None there and
  `pullback.wgrad()` returns them later.
  """

  __slots__ = ("_owner", "_event", "_backward", "_wgrad", "_state")

  def __init__(self, owner: Owner, event: hooks_lib.HookEvent,
               backward: Callable[[Any], BackwardResult]):
    self._owner = owner
    self._event = event
    self._backward = backward
    self._wgrad: Callable[[], Any] | None = None
    self._state: Literal["ready", "done", "wgrad_done"] = "ready"

  @property
  def consumed(self) -> bool:
    """Whether the backward ran (a pullback replays it once)."""
    return self._state != "ready"

  def prefetch(self) -> None:
    """Starts copying the residuals this pullback holds in host memory back to the device.

    With async offload (`make_graphed(..., offload_residuals=True)`) the backward copies them
    back itself when it runs, after the backward before it: call `prefetch` a layer ahead
    (`sequential_vjp` and `schedule.Pipeline` do) so the copy overlaps that backward. Returns
    at once; a no-op without async offload (`offload_mode="executable"` copies them inside
    the backward executable), when called again, or after the backward.
    """
    if self._state == "ready" and isinstance(self._backward, ExecutableBackward):
      self._backward.prefetch()

  def __call__(self, cotangents: Any) -> tuple[Any, ...]:
    owner, event = self._owner, self._event
    hooks = owner.phase_hooks[event.phase]
    pre, post = hooks.pre_backward, hooks.backward
    with owner.exclusive():  # a backward is a use of its callable: not concurrent with others
      if self.consumed:  # checked under the lock: two threads cannot both run it
        raise RuntimeError(
            f"this pullback of {owner.name} was already called: a pullback replays its "
            f"backward once (its residuals are released). Call {owner.name}.vjp(...) again "
            "for a new one.")
      if pre:
        hooks_lib.fire(pre, "pre_backward", dataclasses.replace(event, cotangents=cotangents),
                       owner.name)
      backward = self._backward
      grads, self._wgrad = backward(cotangents)
      self._state, self._backward = "done", None
      if event.phase == "replay":
        owner.count_replay(backward=True)
        if (owner.config.grad_mask is not None and not FROZEN_GRADS_KNOWN.is_set()
            and isinstance(backward, ExecutableBackward)):  # else masked_vjp's pullback said
          note_frozen_grads(owner.name, frozen_float_leaves(backward.entry))
      if post:
        hooks_lib.fire(post, "backward",
                       dataclasses.replace(event, cotangents=cotangents, grads=grads), owner.name)
    return grads

  def wgrad(self) -> tuple[Any, ...]:
    """The deferred weight gradients (`delay_wgrad=True`): one entry per positional argument,
    None for arguments outside `wgrad_argnums`. Call once, after the pullback."""
    name = self._owner.name
    if self._state == "ready":
      raise RuntimeError(f"wgrad() of {name} was called before its pullback; call "
                         "pullback(cotangents) first, then pullback.wgrad().")
    if self._state == "wgrad_done":
      raise RuntimeError(f"wgrad() of {name} was already called; it runs once.")
    if self._wgrad is None:
      raise RuntimeError(f"{name} was built without delay_wgrad=True, so its pullback "
                         "already returned every gradient; there is no deferred wgrad.")
    with self._owner.exclusive():
      grads = self._wgrad()
    # Consumed only once it ran: a failed wgrad (e.g. donated weights) raises the same again.
    self._wgrad, self._state = None, "wgrad_done"
    return grads
