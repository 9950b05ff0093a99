"""Trace, lower and compile the forward, backward and wgrad executables of one signature.

The user's function is traced once per signature (`jax.jit(...).trace`). Every executable
is built from that one trace: the forward variants evaluate its jaxpr, the backward ones
unflatten the residuals with the VJP treedef kept on the host. The VJP object `jax.vjp`
returns is a pytree of its residuals; its treedef holds the linearized jaxpr and is unequal
across traces, so only the leaves cross executables (https://github.com/jax-ml/jax/issues/24053).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pickle
import time
import warnings
from typing import Any, Callable, Collection, Literal, Sequence

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax.experimental import serialize_executable

from jaxgraph import explicit as explicit_lib
from jaxgraph import flat as flat_lib
from jaxgraph import offload as offload_lib
from jaxgraph import rng as rng_lib
from jaxgraph import signature as sig_lib

BackwardKind = Literal["full", "dgrad", "wgrad"]
ForwardKind = Literal["explicit", "stream"]

# Kept residuals of at most this many bytes travel packed, one flat buffer per dtype, rather
# than one array each: the runtime's host cost per executable call grows with its leaf count
# (~4 µs per leaf on a GPU), while copying a small residual costs the device next to nothing.
PACK_MAX_BYTES = 4 << 20
# The platforms where packing is exact. XLA duplicates a cheap elementwise producer into the
# fusion that feeds the concatenation; XLA:CPU compiles that copy to other code (another
# loop shape, other multiply-add contractions), so a packed residual can differ in its last
# bits from the value the rest of the forward used (a BatchNorm block's normalized
# activations, tests/test_flax.py). XLA:GPU emits the same per-element code in both.
PACK_PLATFORMS = frozenset({"gpu"})


@dataclasses.dataclass(frozen=True)
class Packing:
  """How kept residuals travel from a forward to its backward: `loose` ones as themselves,
  each group concatenated into one flat buffer (exact: data movement only)."""

  loose: tuple[int, ...]
  groups: tuple[tuple[int, ...], ...]
  shapes: tuple[tuple[int, ...], ...]  # of every kept residual

  @property
  def n_buffers(self) -> int:
    return len(self.loose) + len(self.groups)

  def pack(self, kept: Sequence[Any]) -> list[Any]:
    return ([kept[i] for i in self.loose]
            + [jnp.concatenate([kept[i].reshape(-1) for i in group]) for group in self.groups])

  def unpack(self, buffers: Sequence[Any]) -> list[Any]:
    kept: list[Any] = [None] * len(self.shapes)
    for i, buffer in zip(self.loose, buffers):
      kept[i] = buffer
    for group, buffer in zip(self.groups, buffers[len(self.loose):]):
      offset = 0
      for i in group:
        size = math.prod(self.shapes[i])
        kept[i] = buffer[offset:offset + size].reshape(self.shapes[i])
        offset += size
    return kept


def plan_packing(kept: Sequence[Any], *, enabled: bool,
                 loose: Collection[int] = ()) -> Packing:
  """Groups the small kept residuals by dtype; weak-typed and key-typed ones stay loose (a
  flat buffer would drop their type), as do those at positions `loose` (named residuals
  offload selects by name) and a group of one."""
  by_dtype: dict[Any, list[int]] = {}
  for i, aval in enumerate(kept):
    if (enabled and not aval.weak_type and i not in loose
        and not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)
        and math.prod(aval.shape) * aval.dtype.itemsize <= PACK_MAX_BYTES):
      by_dtype.setdefault(aval.dtype, []).append(i)
  groups = tuple(tuple(g) for g in by_dtype.values() if len(g) > 1)
  packed = {i for g in groups for i in g}
  return Packing(loose=tuple(i for i in range(len(kept)) if i not in packed), groups=groups,
                 shapes=tuple(tuple(aval.shape) for aval in kept))


# Where the backward finds each residual leaf of the VJP: an input of the forward, a slice of
# a flat input buffer (a leaf of an unraveled FlatTree, recomputed from the buffer: never
# stored), an output the caller already holds, or a leaf the forward returned only for the
# backward ("kept").
Source = tuple[Literal["in", "slice", "out", "kept"], int]


@dataclasses.dataclass(frozen=True)
class Layout:
  """How flat values cross from a forward executable to its backward executables."""

  n_args: int                       # argument leaves; the keys, if any, follow them
  n_keys: int                       # 0 without rng; 1, or one per function of a fused chain
  out_treedef: Any
  out_specs: tuple[jax.ShapeDtypeStruct, ...]
  res_treedef: Any
  sources: tuple[Source, ...]
  packing: Packing
  diff: tuple[int, ...]             # argument leaves that get gradients (inexact, not masked)
  expansion: flat_lib.Expansion     # argument leaves -> leaves `fn` sees (FlatTrees unraveled)
  expanded_diff: tuple[int, ...]    # expanded leaves differentiated (those of `diff`)
  needed_inputs: tuple[int, ...]    # forward inputs the backward reads
  needed_outputs: tuple[int, ...]   # forward outputs the backward reads
  buffers: tuple[offload_lib.Buffer, ...]  # size and name of each kept buffer (packed)

  @property
  def n_out(self) -> int:
    return len(self.out_specs)

  @property
  def n_kept(self) -> int:
    """Buffers the forward returns for the backward only (kept residuals, packed)."""
    return self.packing.n_buffers

  @property
  def ct_leaves(self) -> tuple[int, ...]:
    """Outputs that take a cotangent (inexact dtypes); the others get float0 zeros."""
    return tuple(i for i, s in enumerate(self.out_specs) if _is_inexact(s.dtype))


@dataclasses.dataclass
class Executables:
  """Everything compiled for one (function, signature): what a GraphedCallable replays."""

  signature: sig_lib.Signature
  layout: Layout
  # (kind, with residuals) -> compiled; the one capture replays first is compiled eagerly,
  # the others on first use (`forward_executable`)
  forward: dict[tuple[ForwardKind, bool], Any]
  # name -> (compiled, argument leaves whose grads it returns)
  backward: dict[BackwardKind, tuple[Any, tuple[int, ...]]]
  closed_jaxpr: Any
  moved: tuple[int, ...]            # kept buffers the executables move to host and back
  compiles: int
  compile_seconds: float
  residual_bytes: int               # what one forward keeps for its backward (kept, packed)
  donated: tuple[int, ...] = ()     # argument leaves the outputs-only forwards donate
  # traced on the Explicit twin of the arguments' mesh (`explicit.Twin`), or None
  twin: explicit_lib.Twin | None = None
  # XLA options every executable of this entry is compiled with (also those compiled later)
  compiler_options: tuple[tuple[str, Any], ...] = ()


def _is_inexact(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.inexact)


@dataclasses.dataclass
class _Timer:
  options: tuple[tuple[str, Any], ...] = ()  # XLA compile options (make_graphed's)
  compiles: int = 0
  seconds: float = 0.0

  def compile(self, traced: Any) -> Any:
    start = time.perf_counter()
    with warnings.catch_warnings():
      # Donation (of residuals; of inference inputs, `donate_argnums`) is best effort: XLA
      # may find no output to reuse a buffer for, and that buffer then stays alive.
      warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
      # None without options: jax's own executable cache applies only then
      compiled = traced.lower().compile(dict(self.options) if self.options else None)
    self.seconds += time.perf_counter() - start
    self.compiles += 1
    return compiled


def _apply(fn: Callable[..., Any], args: tuple[Any, ...], keys: Sequence[Any]) -> Any:
  """`fn(*args)`, with `key=` one key, or a tuple of them (a fused chain), when there are."""
  if not keys:
    return fn(*args)
  return fn(*args, key=keys[0] if len(keys) == 1 else tuple(keys))


def _trace_specs(signature: sig_lib.Signature, n_keys: int) -> list[jax.ShapeDtypeStruct]:
  return [sig_lib.abstract(s) for s in signature.leaves] + [rng_lib.key_spec()] * n_keys


def _output_specs(out_info: Sequence[Any], name: str) -> tuple[jax.ShapeDtypeStruct, ...]:
  specs = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype, weak_type=o.weak_type)
                for o in out_info)
  for i, o in enumerate(specs):
    if o.dtype == jax.dtypes.float0:
      raise TypeError(f"{name} returned a float0 value at output leaf {i}.")
  return specs


def _trace(forward: Callable[..., Any], specs: Sequence[jax.ShapeDtypeStruct],
           name: str) -> Any:
  """`jax.jit(forward).trace(*specs)`, refusing a function that closes over a tracer.

  A tracer the function closes over (leaked from a trace that has ended, or of a trace
  still running around `make_graphed`) becomes an extra input of the traced jaxpr, which no
  executable built from it could be given.
  """
  traced = jax.jit(forward).trace(*specs)
  invars = traced.jaxpr.jaxpr.invars
  if len(invars) > len(specs):
    # jax puts the closed-over tracers first
    found = ", ".join(v.aval.str_short() for v in invars[:len(invars) - len(specs)])
    raise jax.errors.UnexpectedTracerError(
        f"{name} closes over a JAX tracer ({found}), not an array: a value of a jax.jit, "
        "jax.grad or jax.vmap trace, leaked from a trace that has ended (kept in a global, "
        "a list or an object during an earlier jit), or of the trace around a make_graphed "
        "called inside one. Close over concrete arrays computed outside any trace, or pass "
        "the value as an argument (in sample_args and on every call).")
  return traced


def trace_forward(fn: Callable[..., Any], signature: sig_lib.Signature, *, n_keys: int,
                  diff: tuple[int, ...], name: str,
                  remat_policy: Callable[..., bool] | None = None,
                  loose_names: bool = False,
                  twin: explicit_lib.Twin | None = None) -> tuple[Any, Layout]:
  """Traces `fn` once through `jax.vjp`; returns the closed jaxpr and the residual layout.

  The jaxpr maps `(*arg_leaves, *keys)` to `[*output_leaves, *kept_residuals]`. `fn` gets
  `key=` one key when `n_keys == 1`, a tuple of `n_keys` keys when more (a fused chain).
  The VJP is taken with respect to the argument leaves `diff` only: the others are
  constants of the linearization, so the backward computes nothing for them (and the
  forward keeps nothing only their gradients would read). Every FlatTree among the
  arguments reaches `fn` unraveled; the VJP is taken with respect to the unraveled leaves,
  so the slices it keeps are recomputed by the backward.
  With `remat_policy`, `fn` runs under `jax.checkpoint` with that policy: only what the
  policy saves is kept, the rest is recomputed in the backward. With `twin`, `fn` is traced
  on the Explicit twin of the arguments' mesh.
  """
  n_args = len(signature.leaves)
  expansion = flat_lib.expansion(signature.treedef)
  differentiated = set(diff)
  expanded_diff = tuple(j for j, i in enumerate(expansion.inputs) if i in differentiated)
  found: dict[str, Any] = {}

  def forward(*flat):
    arg_leaves, keys = list(flat[:n_args]), flat[n_args:]
    expanded = expansion.expand(arg_leaves)

    def primal(*diff_leaves):
      leaves = list(expanded)
      for j, leaf in zip(expanded_diff, diff_leaves):
        leaves[j] = leaf
      return _apply(fn, jax.tree.unflatten(expansion.treedef, leaves), keys)

    if remat_policy is not None:
      # No CSE across forward and backward is possible: they are different executables.
      primal = jax.checkpoint(primal, policy=remat_policy, prevent_cse=False)
    out, vjp_fn = jax.vjp(primal, *[expanded[j] for j in expanded_diff])
    out_leaves, out_treedef = jax.tree.flatten(out)
    residuals, res_treedef = jax.tree.flatten(vjp_fn)
    # Residuals that are inputs, slices of inputs or outputs are not returned again (that
    # would copy them).
    position = {id(v): ("slice", j) for j, v in enumerate(expanded)}
    position.update({id(v): ("in", i) for i, v in enumerate(flat)})
    position.update({id(v): ("out", i) for i, v in enumerate(out_leaves)})
    sources, kept = [], []
    for r in residuals:
      if id(r) not in position:
        position[id(r)] = ("kept", len(kept))
        kept.append(r)
      sources.append(position[id(r)])
    found.update(out_treedef=out_treedef, res_treedef=res_treedef, sources=tuple(sources),
                 n_kept=len(kept))
    return [*out_leaves, *kept]

  with _tracing(twin):
    traced = _trace(forward, _trace_specs(_traced(signature, twin), n_keys), name)
  out_info = traced.out_info
  n_out = len(out_info) - found["n_kept"]
  out_specs = _output_specs(out_info[:n_out], name)
  sources = found["sources"]
  names = kept_names(traced.jaxpr.jaxpr, n_out)
  packing = plan_packing(
      out_info[n_out:], enabled=_packs(signature),
      loose={i for i, n in enumerate(names) if n is not None} if loose_names else ())
  sizes = [math.prod(o.shape) * o.dtype.itemsize for o in out_info[n_out:]]
  buffers = ([offload_lib.Buffer(sizes[i], names[i]) for i in packing.loose]
             + [offload_lib.Buffer(sum(sizes[i] for i in g), None) for g in packing.groups])
  layout = Layout(
      n_args=n_args, n_keys=n_keys, out_treedef=found["out_treedef"], out_specs=out_specs,
      res_treedef=found["res_treedef"], sources=sources, packing=packing, diff=diff,
      expansion=expansion, expanded_diff=expanded_diff,
      needed_inputs=tuple(sorted({i for kind, i in sources if kind == "in"}
                                 | {expansion.inputs[j] for kind, j in sources
                                    if kind == "slice"})),
      needed_outputs=tuple(sorted({i for kind, i in sources if kind == "out"})),
      buffers=tuple(buffers))
  return traced.jaxpr, layout


def _traced(signature: sig_lib.Signature, twin: explicit_lib.Twin | None) -> sig_lib.Signature:
  """The signature a trace sees: `signature`, on the Explicit twin of its mesh with `twin`."""
  return signature if twin is None else twin.signature(signature)


def _tracing(twin: explicit_lib.Twin | None) -> Any:
  return contextlib.nullcontext() if twin is None else twin.tracing()


def _packs(signature: sig_lib.Signature) -> bool:
  """Whether the kept residuals of `signature` travel packed: its arguments are unplaced (a
  flat buffer needs one layout on one device) on a device of `PACK_PLATFORMS`."""
  device = signature.default_device or jax.devices()[0]
  return (device.platform in PACK_PLATFORMS
          and all(s.sharding is None for s in signature.leaves))


# Primitives that pass a value through unchanged on its way to becoming a residual: the
# rounding `jax.checkpoint` puts on every value its policy saves.
_PASS_THROUGH = frozenset({"reduce_precision", "copy", "copy_p"})


def kept_names(jaxpr: Any, n_out: int) -> list[str | None]:
  """The `checkpoint_name` of each kept residual (the jaxpr's outputs after `n_out`): the
  name of the `name` equation that produced it, through pass-through primitives."""
  producer = {id(v): eqn for eqn in jaxpr.eqns for v in eqn.outvars}
  names: list[str | None] = []
  for var in jaxpr.outvars[n_out:]:
    eqn = producer.get(id(var))
    while eqn is not None and eqn.primitive.name in _PASS_THROUGH:
      eqn = producer.get(id(eqn.invars[0]))
    names.append(eqn.params["name"] if eqn is not None and eqn.primitive.name == "name"
                 else None)
  return names


def trace_inference(fn: Callable[..., Any], signature: sig_lib.Signature, *, n_keys: int,
                    name: str) -> tuple[Any, Layout]:
  """Traces `fn` once as it is, not through `jax.vjp`: a forward that keeps nothing.

  The jaxpr maps `(*arg_leaves, *keys)` to the output leaves; FlatTrees among the arguments
  reach `fn` unraveled. The layout has no residuals and no differentiated leaves, so only
  outputs-only forwards are built from it; a function `jax.vjp` cannot trace (a
  `lax.while_loop` of a decode step) traces here.
  """
  n_args = len(signature.leaves)
  found: dict[str, Any] = {}
  expansion = flat_lib.expansion(signature.treedef)

  def forward(*flat):
    args = jax.tree.unflatten(expansion.treedef, expansion.expand(list(flat[:n_args])))
    out_leaves, found["out_treedef"] = jax.tree.flatten(_apply(fn, args, flat[n_args:]))
    return out_leaves

  traced = _trace(forward, _trace_specs(signature, n_keys), name)
  layout = Layout(
      n_args=n_args, n_keys=n_keys, out_treedef=found["out_treedef"],
      out_specs=_output_specs(traced.out_info, name), res_treedef=None, sources=(),
      packing=plan_packing((), enabled=False), diff=(), needed_inputs=(), needed_outputs=(),
      expansion=expansion, expanded_diff=(), buffers=())
  return traced.jaxpr, layout


def _forward_fn(closed: Any, layout: Layout, kind: ForwardKind, *, outputs_only: bool,
                moved: tuple[int, ...]) -> Callable[..., list[Any]]:
  run = jex.core.jaxpr_as_fun(closed)

  def finish(values: list[Any]) -> list[Any]:
    outs = values[:layout.n_out]
    if outputs_only:
      return outs
    kept = layout.packing.pack(values[layout.n_out:])
    return [*outs, *(offload_lib.to_host(k) if i in moved else k for i, k in enumerate(kept))]

  if kind == "explicit":
    return lambda *flat: finish(run(*flat))

  def stream_forward(*flat):
    # (base, index, counter) per key, then the argument leaves
    streams, arg_leaves = flat[:3 * layout.n_keys], flat[3 * layout.n_keys:]
    keys = [rng_lib.derive_key(*streams[i:i + 3]) for i in range(0, len(streams), 3)]
    return [*finish(run(*arg_leaves, *keys)), *keys, *(c + 1 for c in streams[2::3])]

  return stream_forward


def _forward_specs(signature: sig_lib.Signature, layout: Layout,
                   kind: ForwardKind) -> list[jax.ShapeDtypeStruct]:
  arg_specs = [sig_lib.abstract(s) for s in signature.leaves]
  if kind == "explicit":
    return arg_specs + [rng_lib.key_spec()] * layout.n_keys
  counter = jax.ShapeDtypeStruct((), jnp.uint32)
  return [rng_lib.key_spec(), counter, counter] * layout.n_keys + arg_specs


def _compile_forward(timer: _Timer, closed: Any, layout: Layout, signature: sig_lib.Signature,
                     kind: ForwardKind, *, residuals: bool, moved: tuple[int, ...],
                     twin: explicit_lib.Twin | None, donate: tuple[int, ...] = ()) -> Any:
  """Compiles a forward of `closed`. On a twin, its outputs are placed on the twin in their
  canonical spelling; kept residuals, keys and counters stay where XLA puts them."""
  fwd = _forward_fn(closed, layout, kind, outputs_only=not residuals, moved=moved)
  placed = {}
  if twin is not None:
    outs = [_outside(aval.sharding, twin, cotangent=False)
            for aval in closed.out_avals[:layout.n_out]]
    rest = ((layout.n_kept if residuals else 0)
            + (2 * layout.n_keys if kind == "stream" else 0))
    placed = {"out_shardings": outs + [None] * rest}
  with _tracing(twin):
    traced = jax.jit(fwd, donate_argnums=donate, **placed).trace(
        *_forward_specs(_traced(signature, twin), layout, kind))
  return timer.compile(traced)


def _inside(spec: jax.ShapeDtypeStruct, twin: explicit_lib.Twin | None, *,
            cotangent: bool = False) -> jax.ShapeDtypeStruct:
  """An output's spec as a backward traced on `twin` takes it (as a cotangent: unreduced)."""
  if twin is None:
    return spec
  return jax.ShapeDtypeStruct(spec.shape, spec.dtype, weak_type=spec.weak_type,
                              sharding=twin.inside(spec.sharding, cotangent=cotangent))


def _outside(sharding: Any, twin: explicit_lib.Twin, *, cotangent: bool) -> Any:
  """Where a value typed `sharding` on the twin leaves an executable (None: unplaced)."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return None
  return twin.outside(sharding.spec, cotangent=cotangent)


def _donated_positions(donated: Sequence[int], layout: Layout,
                       kind: ForwardKind) -> tuple[int, ...]:
  """The positions of the donated argument leaves among a forward's inputs: the stream
  forward's start after `(base, index, counter)` per key."""
  shift = 3 * layout.n_keys if kind == "stream" else 0
  return tuple(shift + i for i in donated)


def _backward_fn(layout: Layout, select: tuple[int, ...],
                 moved: tuple[int, ...]) -> Callable[..., Any]:
  a, b, c = len(layout.needed_inputs), len(layout.needed_outputs), layout.n_kept
  ct_leaves = set(layout.ct_leaves)
  sliced = sorted({j for kind, j in layout.sources if kind == "slice"})

  def backward(*flat):
    ins = dict(zip(layout.needed_inputs, flat[:a]))
    outs = dict(zip(layout.needed_outputs, flat[a:a + b]))
    kept = [offload_lib.to_device(k) if i in moved else k
            for i, k in enumerate(flat[a + b:a + b + c])]
    kept = layout.packing.unpack(kept)
    cts = iter(flat[a + b + c:])
    slices = layout.expansion.slices(ins, sliced)
    table = {"in": ins, "slice": slices, "out": outs, "kept": kept}
    vjp_fn = jax.tree.unflatten(layout.res_treedef, [table[k][i] for k, i in layout.sources])
    ct = [next(cts) if i in ct_leaves else np.zeros(s.shape, jax.dtypes.float0)
          for i, s in enumerate(layout.out_specs)]
    grads = vjp_fn(jax.tree.unflatten(layout.out_treedef, ct))
    return layout.expansion.gradients(dict(zip(layout.expanded_diff, grads)), select)

  return backward


def capture(fn: Callable[..., Any], signature: sig_lib.Signature, *, n_keys: int,
            diff: tuple[int, ...],
            backward: Sequence[tuple[BackwardKind, tuple[int, ...]]],
            offload: offload_lib.Policy | None, name: str, warned_weights: dict[int, Any],
            remat_policy: Callable[..., bool] | None = None, loose_names: bool = False,
            warn_constant_keys: bool = True,
            twin: explicit_lib.Twin | None = None,
            compiler_options: tuple[tuple[str, Any], ...] = ()) -> Executables:
  """Traces `fn` once and compiles every executable a GraphedCallable replays for `signature`.

  Args:
    fn: the user's function.
    signature: the signature of the positional arguments.
    n_keys: how many keys `fn` takes as `key=` (0 without rng; see `trace_forward`). With
      keys the stream forward (what warmup and keyless replays run) is compiled now, the
      explicit-key forward on first use.
    diff: the argument leaves that get gradients (`pullback.differentiated_leaves`).
    backward: which backward executables to build: ("full", leaves) or ("dgrad", leaves)
      and ("wgrad", leaves); the last one listed receives the residuals as donated buffers
      (device residuals only).
    offload: None, or the policy whose kept buffers the forward executable writes to pinned
      host memory and the backward executable reads back (`"executable"` mode; async
      offload runs the executables without offload, and the host moves the buffers).
    name: the callable's name, for errors.
    warned_weights: closed-over weights warned of already, by id; this capture adds those it
      warns of (`_warn_constant_weights`).
    remat_policy: a `jax.checkpoint` policy choosing the residuals (None: all of `jax.vjp`'s).
    loose_names: keep the residuals named with `checkpoint_name` out of the packed buffers
      (offload selects them by name: `make_graphed(..., offload_names=...)`).
    warn_constant_keys: warn of keys that are constants of `fn` (a fused chain does not:
      such a key is there at every signature, and its layer's own capture warned).
    twin: trace on the Explicit twin of the arguments' mesh (`explicit.Twin`): every output
      typed on the twin, reduced arguments with unreduced gradients.
    compiler_options: XLA options (name, value) every executable is compiled with.
  """
  timer = _Timer(options=compiler_options)
  start = time.perf_counter()
  closed, layout = trace_forward(fn, signature, n_keys=n_keys, diff=diff, name=name,
                                 remat_policy=remat_policy, loose_names=loose_names, twin=twin)
  trace_seconds = time.perf_counter() - start
  if warn_constant_keys:
    _warn_constant_keys(closed, name)
  _warn_constant_weights(closed, name, warned_weights)
  first: ForwardKind = "stream" if n_keys else "explicit"
  moved = offload.select(layout.buffers) if offload is not None else ()
  forward = {(first, True): _compile_forward(timer, closed, layout, signature, first,
                                             residuals=True, moved=moved, twin=twin)}
  out_info = forward[first, True].out_info  # outputs, kept residuals, then stream keys/counters
  traced = _traced(signature, twin)
  in_specs = _forward_specs(traced, layout, "explicit")
  bwd_specs = ([in_specs[i] for i in layout.needed_inputs]
               + [_inside(out_info[i], twin) for i in layout.needed_outputs]
               + [_inside(o, twin) for o in out_info[layout.n_out:layout.n_out + layout.n_kept]]
               + [_inside(out_info[i], twin, cotangent=True) for i in layout.ct_leaves])
  first_kept = len(layout.needed_inputs) + len(layout.needed_outputs)
  # Offloaded residuals are host buffers: donating them frees no device memory, and XLA would
  # alias them to device outputs (the result then has the wrong memory kind and aborts).
  donate = tuple(first_kept + i for i in range(layout.n_kept) if i not in moved)
  compiled_backward = {}
  for position, (kind, select) in enumerate(backward):
    last = position == len(backward) - 1
    # Each gradient comes back with its input's sharding (FSDP: reduce-scattered weight
    # grads; on a twin, a reduced input's unreduced); None (an uncommitted input) leaves the
    # choice to XLA, as before.
    grad_shardings = [signature.leaves[leaf].sharding if twin is None else
                      _outside(traced.leaves[leaf].sharding, twin, cotangent=True)
                      for leaf in select]
    placed = ({"out_shardings": grad_shardings}
              if any(s is not None for s in grad_shardings) else {})
    bwd = jax.jit(_backward_fn(layout, select, moved), donate_argnums=donate if last else (),
                  **placed)
    with _tracing(twin):
      compiled_backward[kind] = (timer.compile(bwd.trace(*bwd_specs)), select)
  kept_specs = out_info[layout.n_out:layout.n_out + layout.n_kept]
  return Executables(signature=signature, layout=layout, forward=forward,
                     backward=compiled_backward, closed_jaxpr=closed, moved=moved,
                     compiles=timer.compiles, compile_seconds=timer.seconds + trace_seconds,
                     residual_bytes=sum(math.prod(s.shape) * s.dtype.itemsize
                                        for s in kept_specs),
                     twin=twin, compiler_options=compiler_options)


def capture_inference(fn: Callable[..., Any], signature: sig_lib.Signature, *, n_keys: int,
                      name: str, warned_weights: dict[int, Any],
                      donated: Sequence[int] = (),
                      compiler_options: tuple[tuple[str, Any], ...] = ()) -> Executables:
  """Traces `fn` once, forward only, and compiles the one executable a plain call replays.

  That is the outputs-only forward: the stream forward with keys (`n_keys > 0`; it still
  returns the next counters), else the plain one. No residuals, no backward; the
  explicit-key forward compiles on first use (`forward_executable(..., residuals=False)`).
  Both donate the argument leaves `donated` (as `jax.jit(..., donate_argnums=...)`); a
  buffer XLA finds no output to reuse for is not donated, without a warning.
  `warned_weights` and `compiler_options` as in `capture`.
  """
  start = time.perf_counter()
  closed, layout = trace_inference(fn, signature, n_keys=n_keys, name=name)
  trace_seconds = time.perf_counter() - start
  _warn_constant_keys(closed, name)
  _warn_constant_weights(closed, name, warned_weights)
  entry = Executables(signature=signature, layout=layout, forward={}, backward={},
                      closed_jaxpr=closed, moved=(), compiles=0, compile_seconds=0.0,
                      residual_bytes=0, donated=tuple(donated),
                      compiler_options=compiler_options)
  _, compile_seconds = forward_executable(entry, "stream" if n_keys else "explicit",
                                          residuals=False)
  entry.compiles, entry.compile_seconds = 1, trace_seconds + compile_seconds
  return entry


def loaded_copy(compiled: Any) -> Any:
  """A second loaded instance of `compiled` (the same binary; no compile), on the same
  devices in the same order, or `compiled` itself where the backend cannot serialize it.

  XLA's GPU command buffers remember the buffer addresses they were recorded with, per
  loaded executable, and re-record their kernel nodes when a call passes other buffers. One
  executable replayed by 12 layers sees 12 sets of parameter buffers in turn and re-records
  on every call; a copy per layer sees the same buffers step after step. So it goes for an
  executable over several devices (FSDP), on each of them.
  """
  shardings = jax.tree.leaves(compiled.input_shardings)
  if not shardings:
    return compiled
  # The executable's device assignment: its inputs' devices in the order it was compiled for
  # (a mesh's order), which the copy must keep.
  devices = list(shardings[0]._device_assignment)
  if (devices[0].platform == "cpu" and jax.config.jax_enable_compilation_cache
      and jax.config.jax_compilation_cache_dir):
    # XLA:CPU (jax 0.10.2): a copy of an executable the persistent compilation cache served
    # fails when called ("Function ... not found"); on the CPU a copy gains nothing anyway.
    return compiled
  try:
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                     backend=devices[0].client,
                                                     execution_devices=devices)
  # Not serializable here: XLA refuses (ValueError, RuntimeError, NotImplementedError), or
  # the executable holds Python objects pickle cannot take (AttributeError, TypeError,
  # PicklingError: a custom_partitioning rule's closure, as in cuDNN attention sharded).
  except (ValueError, NotImplementedError, RuntimeError, AttributeError, TypeError,
          pickle.PicklingError):
    return compiled


class ConstantWeightWarning(UserWarning):
  """A function given to `make_graphed` closes over a float array that feeds a matmul or a
  convolution: a weight baked into the executables, which gets no gradient and does not
  follow later updates of the array (docs/semantics.md, "Functions of their arguments",
  says which arrays count). Any size counts: a 16x16 weight trains no better as a constant
  than a large one, and a fixed matrix that is meant (a 3x3 colour transform, a Hadamard
  rotation) costs one warning per `make_graphed` call, where a missed weight costs a run.
  Where a fixed matrix is meant:
  `warnings.filterwarnings("ignore", category=jaxgraph.ConstantWeightWarning)`."""


# Operations through which a closed-over array is still that array on its way into a matmul
# (a weight is cast, transposed, reshaped or sliced first).
_WEIGHT_PATH = frozenset({
    "broadcast_in_dim", "convert_element_type", "copy", "copy_p", "dynamic_slice",
    "expand_dims", "reduce_precision", "reshape", "rev", "sharding_constraint", "slice",
    "squeeze", "transpose"})
_CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})


def constant_weights(closed: Any) -> list[str]:
  """Descriptions of the closed-over float arrays of a traced function that act as weights.

  An array counts when all of these hold: it is a constant of the jaxpr (an array the
  function closes over, not one it computes: a rotary table built from `iota` inside the
  function is not a constant), its dtype is a float (of any size), and it is an operand of
  a `dot_general` or a convolution, directly or through casts, transposes, reshapes and
  slices, also inside nested jits, `jax.checkpoint` and custom derivatives. Masks (bool,
  int) and tables used elementwise (rotary sin/cos, biases, a causal mask added to scores)
  are not weights.
  """
  return [description for description, _ in _constant_weight_arrays(closed)]


def _constant_weight_arrays(closed: Any) -> list[tuple[str, Any]]:
  """(description, array) of each weight `constant_weights` finds, in order."""
  found: dict[Any, tuple[str, Any]] = {}  # the constant's variable -> (description, array)

  # `tainted` maps a variable to the constant it carries: (its variable, (description, array))
  def visit(jaxpr: Any, tainted: dict[Any, tuple[Any, tuple[str, Any]]]) -> None:
    if isinstance(jaxpr, jex.core.ClosedJaxpr):
      tainted = {**tainted, **{
          var: (var, (f"{value.dtype}{list(value.shape)}", value))
          for var, value in zip(jaxpr.jaxpr.constvars, jaxpr.consts)
          if jnp.issubdtype(value.dtype, jnp.inexact)}}
      jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
      sources = [tainted.get(v) if isinstance(v, jex.core.Var) else None for v in eqn.invars]
      name = eqn.primitive.name
      if name in _CONTRACTIONS:
        found.update(s for s in sources if s)
      elif name in _WEIGHT_PATH:
        if sources[0]:
          tainted[eqn.outvars[0]] = sources[0]
      else:  # a nested jaxpr may use a tainted operand, or close over arrays of its own
        for sub in rng_lib._subjaxprs(eqn):  # the one walker of nested jaxprs
          inner = sub.jaxpr if isinstance(sub, jex.core.ClosedJaxpr) else sub
          passed = len(inner.invars) == len(sources)  # operands passed on one to one
          visit(sub, {var: s for var, s in zip(inner.invars, sources) if s} if passed else {})

  visit(closed, {})
  return list(found.values())


def _warn_constant_weights(closed: Any, name: str, warned: dict[int, Any]) -> None:
  """Warns of the closed-over weights of `closed` not in `warned` (ids of arrays warned of,
  the arrays kept so that no id is reused), and adds them: a weight is named once per
  `make_graphed` call, also where a fused chain or another signature traces it again."""
  weights = [(description, array) for description, array in _constant_weight_arrays(closed)
             if id(array) not in warned]
  if not weights:
    return
  warned.update((id(array), array) for _, array in weights)
  warnings.warn(
      f"{name}: the traced function closes over {len(weights)} float array(s) that feed a "
      f"matmul or a convolution ({', '.join(d for d, _ in weights)}). They are constants of "
      "the executables: the pullback returns no gradient for them, and changing them later "
      "does not change the graphed function. If they are weights, pass them as arguments "
      "(in sample_args and on every call; make_graphed(..., grad_mask=...) keeps frozen "
      "ones out of the backward). If they are meant to be fixed, silence this with "
      "warnings.filterwarnings('ignore', category=jaxgraph.ConstantWeightWarning).",
      ConstantWeightWarning, stacklevel=5)


def _warn_constant_keys(closed: Any, name: str) -> None:
  frozen = rng_lib.constant_keys(closed)
  if frozen:
    warnings.warn(
        f"{name}: the traced function contains {frozen[0]}. A key that is a constant of the "
        "executable gives the same random numbers (the same dropout mask) on every replay. "
        "Take the key as an argument: make_graphed(..., rng=True) and fn(..., key=key).",
        stacklevel=5)


def forward_executable(entry: Executables, kind: ForwardKind, *,
                       residuals: bool) -> tuple[Any, float]:
  """A forward of `entry` (compiled on first use); returns it and the seconds compiled now.

  `residuals=False` is the inference forward: outputs only, nothing kept for a backward;
  it donates the argument leaves `entry.donated`, as the forward captured first does.
  """
  compiled = entry.forward.get((kind, residuals))
  if compiled is not None:
    return compiled, 0.0
  timer = _Timer(options=entry.compiler_options)
  donate = () if residuals else _donated_positions(entry.donated, entry.layout, kind)
  compiled = _compile_forward(timer, entry.closed_jaxpr, entry.layout, entry.signature, kind,
                              residuals=residuals, moved=entry.moved if residuals else (),
                              twin=entry.twin, donate=donate)
  entry.forward[kind, residuals] = compiled
  return compiled, timer.seconds
