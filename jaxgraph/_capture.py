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

from jaxgraph import _constants as constants_lib
from jaxgraph import _explicit as explicit_lib
from jaxgraph import _signature as sig_lib
from jaxgraph import flat as flat_lib
from jaxgraph import offload as offload_lib
from jaxgraph import rng as rng_lib

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
  # traced on the Explicit twin of the arguments' mesh (`_explicit.Twin`), or None
  twin: explicit_lib.Twin | None = None
  # XLA options every executable of this entry is compiled with (also those compiled later)
  compiler_options: tuple[tuple[str, Any], ...] = ()
  # with delay_wgrad: what the dgrad executable hands the wgrad executable (`split_backward`)
  split: WgradSplit | None = None


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


@dataclasses.dataclass(frozen=True)
class WgradSplit:
  """How one backward is cut into dgrad and wgrad without computing anything twice.

  The dgrad executable returns its gradients, then `stash`: the values of its own computation
  the weight gradients need (the cotangent at the output of each weight-consuming matmul,
  convolution or elementwise op). The wgrad executable takes the backward inputs at `reads`
  (positions among needed inputs, needed outputs, kept buffers and cotangents: the
  activations the weight products read) and the stash, and computes only what is left.
  """

  reads: tuple[int, ...]
  stash: tuple[jax.ShapeDtypeStruct, ...]
  kept_reads: tuple[int, ...]  # the kept buffers among `reads` (positions among the kept)

  @property
  def stash_bytes(self) -> int:
    return sum(math.prod(s.shape) * s.dtype.itemsize for s in self.stash)


# Calls the cut looks into: a jitted helper (`jax.nn.gelu`, a user's `@jax.jit` linear) or a
# rematerialized block is transposed into one equation that returns activation and weight
# cotangents together, which could then only go to the dgrad side whole.
_INLINED = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint",
                      "custom_jvp_call"})
# Primitives that only move or view data: where such an equation reads no cotangent (a slice
# of a packed or flat residual, an offloaded residual's copy back to the device), the wgrad
# side repeats it on the residual rather than keep its result from the dgrad.
_MOVES = frozenset({
    "broadcast_in_dim", "concatenate", "convert_element_type", "copy", "copy_p", "device_put",
    "dynamic_slice", "expand_dims", "reduce_precision", "reshape", "rev",
    "sharding_constraint", "slice", "squeeze", "transpose"})


def _inlined(eqn: Any) -> bool:
  """Whether `_eval_eqns` evaluates the call `eqn` equation by equation: one of `_INLINED`,
  and for a jit, one that places and lays out nothing itself (inlined, such a jit's
  shardings would be lost)."""
  if eqn.primitive.name not in _INLINED:
    return False
  params = eqn.params
  return (all(type(s).__name__ == "UnspecifiedValue"
              for s in (*params.get("in_shardings", ()), *params.get("out_shardings", ())))
          and all(layout is None
                  for layout in (*params.get("in_layouts", ()), *params.get("out_layouts", ())))
          and not params.get("compiler_options_kvs"))


def _eval_eqns(eqns: Sequence[Any], env: dict[Any, Any]) -> None:
  """Evaluates `eqns` in order into `env` (variable -> value), binding each primitive as
  `jax.core.eval_jaxpr` does, and the calls `_inlined` says of equation by equation."""
  def read(v: Any) -> Any:
    return v.val if isinstance(v, jex.core.Literal) else env[v]

  for eqn in eqns:
    args = [read(v) for v in eqn.invars]
    if _inlined(eqn):
      inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
      jaxpr, consts = ((inner.jaxpr, inner.consts) if isinstance(inner, jex.core.ClosedJaxpr)
                       else (inner, ()))
      inner_env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
      _eval_eqns(jaxpr.eqns, inner_env)
      outs = [v.val if isinstance(v, jex.core.Literal) else inner_env[v]
              for v in jaxpr.outvars]
    else:
      with eqn.ctx.manager:
        outs = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
      if not eqn.primitive.multiple_results:
        outs = [outs]
    env.update(zip(eqn.outvars, outs))


def _flat_backward(layout: Layout, select: tuple[int, ...], moved: tuple[int, ...],
                   specs: Sequence[jax.ShapeDtypeStruct]) -> Any:
  """The closed jaxpr of the backward returning the gradients of `select`, with the calls of
  `_INLINED` inlined: one equation per primitive the cut can put on either side."""
  nested = jax.jit(_backward_fn(layout, select, moved)).trace(*specs).jaxpr

  def flat(*args):
    env = dict(zip(nested.jaxpr.constvars, nested.consts)) | dict(zip(nested.jaxpr.invars, args))
    _eval_eqns(nested.jaxpr.eqns, env)
    return [v.val if isinstance(v, jex.core.Literal) else env[v] for v in nested.jaxpr.outvars]

  return jax.jit(flat).trace(*specs).jaxpr


def _needed(jaxpr: Any, roots: Sequence[Any], producer: dict[Any, int]) -> set[int]:
  """The equations of `jaxpr` (indices) that the variables `roots` depend on."""
  needed: set[int] = set()
  stack = [v for v in roots if isinstance(v, jex.core.Var)]
  while stack:
    index = producer.get(stack.pop())
    if index is not None and index not in needed:
      needed.add(index)
      stack.extend(v for v in jaxpr.eqns[index].invars if isinstance(v, jex.core.Var))
  return needed


def split_backward(layout: Layout, dgrad: tuple[int, ...], wgrad: tuple[int, ...],
                   moved: tuple[int, ...], specs: Sequence[jax.ShapeDtypeStruct]
                   ) -> tuple[Callable[..., list[Any]], Callable[..., list[Any]],
                              tuple[int, ...], tuple[Any, ...]]:
  """Cuts the backward of `layout` into a dgrad and a wgrad function that compute each
  equation of it once.

  The backward (all gradients, `specs` its inputs) is traced to one flat jaxpr. The dgrad
  side is every equation the gradients of `dgrad` depend on (and any with effects). Of the
  rest that the gradients of `wgrad` depend on, the wgrad side keeps the contractions (for
  a matmul with a weight, the weight product `xᵀ @ ct`) and whatever reads their results (a
  transpose, the sum over a weight's uses); the dgrad side takes the cheap remainder. A
  value of the dgrad side that the wgrad side reads is stashed: returned by dgrad after its
  gradients, kept until wgrad. An equation that only moves residual data (`_MOVES`: a
  slice of a packed buffer, a copy back from host memory) is repeated on the wgrad side
  instead.

  Returns:
    `(dgrad_fn, wgrad_fn, reads, stash)`: `dgrad_fn(*inputs)` returns the gradients of
    `dgrad` then the stashed values; `wgrad_fn(*[inputs[i] for i in reads], *stash_values)`
    returns the gradients of `wgrad`; `stash` holds the stashed variables (their avals).
  """
  closed = _flat_backward(layout, dgrad + wgrad, moved, specs)
  jaxpr = closed.jaxpr
  producer = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
  n_d = len(dgrad)
  d_outs, w_outs = jaxpr.outvars[:n_d], jaxpr.outvars[n_d:]
  effects = [v for eqn in jaxpr.eqns if eqn.effects for v in eqn.outvars]
  d_side = _needed(jaxpr, [*d_outs, *effects], producer)
  # The wgrad side keeps only the weight products and what follows them; the cheap rest
  # (a bias's sum over the batch, a norm scale's `sum(ct * x_hat)`) moves to the dgrad side,
  # which then stashes a weight-sized gradient, not an activation-sized cotangent, and
  # compiles it next to its producer as the fused backward does (the same XLA rewrites).
  deferred: set[Any] = set()
  for i in sorted(_needed(jaxpr, w_outs, producer) - d_side):
    eqn = jaxpr.eqns[i]
    if eqn.primitive.name in constants_lib.CONTRACTIONS or any(
        v in deferred for v in eqn.invars if isinstance(v, jex.core.Var)):
      deferred.update(eqn.outvars)
    else:
      d_side.add(i)
  # which variables carry a cotangent (the last inputs), for `_MOVES`
  first_ct = len(jaxpr.invars) - len(layout.ct_leaves)
  carries = set(jaxpr.invars[first_ct:])
  for eqn in jaxpr.eqns:
    if any(v in carries for v in eqn.invars if isinstance(v, jex.core.Var)):
      carries.update(eqn.outvars)
  position = {v: i for i, v in enumerate(jaxpr.invars)}
  w_side: set[int] = set()
  stash: dict[Any, None] = {}  # ordered
  reads: set[int] = set()
  stack = [v for v in w_outs if isinstance(v, jex.core.Var)]
  while stack:
    var = stack.pop()
    if var in position:
      reads.add(position[var])
      continue
    index = producer.get(var)
    if index is None or index in w_side:  # a constant, or done
      continue
    eqn = jaxpr.eqns[index]
    if index in d_side and not (eqn.primitive.name in _MOVES and var not in carries):
      stash[var] = None
      continue
    w_side.add(index)
    stack.extend(v for v in eqn.invars if isinstance(v, jex.core.Var))
  stashed = tuple(sorted(stash, key=lambda v: producer[v]))
  d_eqns = [eqn for i, eqn in enumerate(jaxpr.eqns) if i in d_side]
  w_eqns = [eqn for i, eqn in enumerate(jaxpr.eqns) if i in w_side]
  read_vars = [jaxpr.invars[i] for i in sorted(reads)]
  consts = dict(zip(jaxpr.constvars, closed.consts))

  def value(env: dict[Any, Any], v: Any) -> Any:
    return v.val if isinstance(v, jex.core.Literal) else env[v]

  def dgrad_fn(*args):
    env = consts | dict(zip(jaxpr.invars, args))
    _eval_eqns(d_eqns, env)
    return [value(env, v) for v in (*d_outs, *stashed)]

  def wgrad_fn(*args):
    env = consts | dict(zip((*read_vars, *stashed), args))
    _eval_eqns(w_eqns, env)
    return [value(env, v) for v in w_outs]

  return dgrad_fn, wgrad_fn, tuple(sorted(reads)), stashed


def wgrad_bytes(entry: Executables) -> int:
  """The bytes a pullback of `entry` holds from its dgrad to its wgrad: the stash and the
  kept buffers the wgrad reads (0 without a split)."""
  if entry.split is None:
    return 0
  return entry.split.stash_bytes + sum(entry.layout.buffers[i].nbytes
                                       for i in entry.split.kept_reads)


def _compile_split(timer: _Timer, layout: Layout,
                   backward: Sequence[tuple[BackwardKind, tuple[int, ...]]],
                   specs: Sequence[jax.ShapeDtypeStruct], moved: tuple[int, ...],
                   twin: explicit_lib.Twin | None, grad_shardings: Callable[..., Any]
                   ) -> tuple[dict[BackwardKind, tuple[Any, tuple[int, ...]]], WgradSplit]:
  """Compiles the dgrad and wgrad executables of `split_backward`. Each kept buffer is donated
  to the last executable that reads it: dgrad donates those wgrad does not read, wgrad the
  rest and the stash (device buffers only: see `capture`)."""
  (_, dgrad), (_, wgrad) = backward
  with _tracing(twin):
    dgrad_fn, wgrad_fn, reads, stashed = split_backward(layout, dgrad, wgrad, moved, specs)
  first_kept = len(layout.needed_inputs) + len(layout.needed_outputs)
  device_kept = [first_kept + i for i in range(layout.n_kept) if i not in moved]

  def compile_one(fn: Callable[..., Any], select: tuple[int, ...], args: Sequence[Any],
                  donate: Sequence[int], extra: int) -> Any:
    placed = grad_shardings(select)
    if placed is not None:
      placed = {"out_shardings": list(placed) + [None] * extra}
    bwd = jax.jit(fn, donate_argnums=tuple(donate), **(placed or {}))
    with _tracing(twin):
      return timer.compile(bwd.trace(*args))

  d_compiled = compile_one(dgrad_fn, dgrad, specs,
                           [i for i in device_kept if i not in reads], len(stashed))
  stash_specs = tuple(_inside(o, twin) for o in d_compiled.out_info[len(dgrad):])
  w_args = [specs[i] for i in reads] + list(stash_specs)
  w_donate = ([j for j, i in enumerate(reads) if i in device_kept]
              + [len(reads) + j for j in range(len(stashed))])
  w_compiled = compile_one(wgrad_fn, wgrad, w_args, w_donate, 0)
  split = WgradSplit(reads=reads, stash=stash_specs,
                     kept_reads=tuple(i - first_kept for i in reads
                                      if first_kept <= i < first_kept + layout.n_kept))
  return {"dgrad": (d_compiled, dgrad), "wgrad": (w_compiled, wgrad)}, split


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
    diff: the argument leaves that get gradients (`_pullback.differentiated_leaves`).
    backward: which backward executables to build: ("full", leaves), which receives the
      residuals as donated buffers (device residuals only); or ("dgrad", leaves) and
      ("wgrad", leaves), cut from one backward by `split_backward`.
    offload: None, or the policy whose kept buffers the forward executable writes to pinned
      host memory and the backward executable reads back (`"executable"` mode; async
      offload runs the executables without offload, and the host moves the buffers).
    name: the callable's name, for errors.
    warned_weights: closed-over weights warned of already, by id; this capture adds those it
      warns of (`_constants.warn_constant_weights`).
    remat_policy: a `jax.checkpoint` policy choosing the residuals (None: all of `jax.vjp`'s).
    loose_names: keep the residuals named with `checkpoint_name` out of the packed buffers
      (offload selects them by name: `make_graphed(..., offload_names=...)`).
    warn_constant_keys: warn of keys that are constants of `fn` (a fused chain does not:
      such a key is there at every signature, and its layer's own capture warned).
    twin: trace on the Explicit twin of the arguments' mesh (`_explicit.Twin`): every output
      typed on the twin, reduced arguments with unreduced gradients.
    compiler_options: XLA options (name, value) every executable is compiled with.
  """
  timer = _Timer(options=compiler_options)
  start = time.perf_counter()
  closed, layout = trace_forward(fn, signature, n_keys=n_keys, diff=diff, name=name,
                                 remat_policy=remat_policy, loose_names=loose_names, twin=twin)
  trace_seconds = time.perf_counter() - start
  if warn_constant_keys:
    constants_lib.warn_constant_keys(closed, name)
  constants_lib.warn_constant_weights(closed, name, warned_weights)
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

  def grad_shardings(select: tuple[int, ...]) -> list[Any] | None:
    # Each gradient comes back with its input's sharding (FSDP: reduce-scattered weight
    # grads; on a twin, a reduced input's unreduced); None (an uncommitted input) leaves the
    # choice to XLA, as before.
    shardings = [signature.leaves[leaf].sharding if twin is None else
                 _outside(traced.leaves[leaf].sharding, twin, cotangent=True)
                 for leaf in select]
    return shardings if any(s is not None for s in shardings) else None

  compiled_backward, split = {}, None
  if [kind for kind, _ in backward] == ["dgrad", "wgrad"]:
    compiled_backward, split = _compile_split(timer, layout, backward, bwd_specs, moved, twin,
                                              grad_shardings)
  for position, (kind, select) in enumerate(() if split else backward):
    last = position == len(backward) - 1
    placed = grad_shardings(select)
    bwd = jax.jit(_backward_fn(layout, select, moved), donate_argnums=donate if last else (),
                  **({} if placed is None else {"out_shardings": placed}))
    with _tracing(twin):
      compiled_backward[kind] = (timer.compile(bwd.trace(*bwd_specs)), select)
  kept_specs = out_info[layout.n_out:layout.n_out + layout.n_kept]
  return Executables(signature=signature, layout=layout, forward=forward,
                     backward=compiled_backward, closed_jaxpr=closed, moved=moved,
                     compiles=timer.compiles, compile_seconds=timer.seconds + trace_seconds,
                     residual_bytes=sum(math.prod(s.shape) * s.dtype.itemsize
                                        for s in kept_specs),
                     twin=twin, compiler_options=compiler_options, split=split)


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
  constants_lib.warn_constant_keys(closed, name)
  constants_lib.warn_constant_weights(closed, name, warned_weights)
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
