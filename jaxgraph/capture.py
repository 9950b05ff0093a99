"""Trace, lower and compile the forward, backward and wgrad executables of one signature.

The user's function is traced once per signature (`jax.jit(...).trace`). Every executable
is built from that one trace: the forward variants evaluate its jaxpr, the backward ones
unflatten the residuals with the VJP treedef kept on the host (anchors-jax.md §2.1).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Callable, Literal, Sequence

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from jaxgraph import offload as offload_lib
from jaxgraph import rng as rng_lib
from jaxgraph import signature as sig_lib

BackwardKind = Literal["full", "dgrad", "wgrad"]
ForwardKind = Literal["explicit", "stream"]

# Where the backward finds each residual leaf of the VJP: an input of the forward, an output
# the caller already holds, or a leaf the forward returned only for the backward ("kept").
Source = tuple[Literal["in", "out", "kept"], int]


@dataclasses.dataclass(frozen=True)
class Layout:
  """How flat values cross from a forward executable to its backward executables."""

  n_args: int                       # argument leaves; the key, if any, is input n_args
  has_key: bool
  out_treedef: Any
  out_specs: tuple[jax.ShapeDtypeStruct, ...]
  res_treedef: Any
  sources: tuple[Source, ...]
  n_kept: int
  diff: tuple[int, ...]             # argument leaves that get gradients (inexact dtypes)
  needed_inputs: tuple[int, ...]    # forward inputs the backward reads
  needed_outputs: tuple[int, ...]   # forward outputs the backward reads

  @property
  def n_out(self) -> int:
    return len(self.out_specs)

  @property
  def ct_leaves(self) -> tuple[int, ...]:
    """Outputs that take a cotangent (inexact dtypes); the others get float0 zeros."""
    return tuple(i for i, s in enumerate(self.out_specs) if _is_inexact(s.dtype))


@dataclasses.dataclass
class Executables:
  """Everything compiled for one (function, signature): what a GraphedCallable replays."""

  signature: sig_lib.Signature
  layout: Layout
  forward: dict[ForwardKind, Any]
  # name -> (compiled, argument leaves whose grads it returns)
  backward: dict[BackwardKind, tuple[Any, tuple[int, ...]]]
  closed_jaxpr: Any
  offload: bool
  compiles: int
  compile_seconds: float
  inference: dict[ForwardKind, Any] = dataclasses.field(default_factory=dict)


def _is_inexact(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.inexact)


@dataclasses.dataclass
class _Timer:
  compiles: int = 0
  seconds: float = 0.0

  def compile(self, traced: Any) -> Any:
    start = time.perf_counter()
    with warnings.catch_warnings():
      # Residual donation is best effort: XLA may find no output to reuse a buffer for.
      warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
      compiled = traced.lower().compile()
    self.seconds += time.perf_counter() - start
    self.compiles += 1
    return compiled


def trace_forward(fn: Callable[..., Any], signature: sig_lib.Signature, *, rng: bool,
                  name: str) -> tuple[Any, Layout]:
  """Traces `fn` once through `jax.vjp`; returns the closed jaxpr and the residual layout.

  The jaxpr maps `(*arg_leaves[, key])` to `[*output_leaves, *kept_residuals]`.
  """
  n_args = len(signature.leaves)
  diff = tuple(i for i, s in enumerate(signature.leaves) if _is_inexact(s.dtype))
  found: dict[str, Any] = {}

  def forward(*flat):
    arg_leaves, key = list(flat[:n_args]), (flat[n_args] if rng else None)

    def primal(*diff_leaves):
      leaves = list(arg_leaves)
      for i, leaf in zip(diff, diff_leaves):
        leaves[i] = leaf
      args = jax.tree.unflatten(signature.treedef, leaves)
      return fn(*args, key=key) if rng else fn(*args)

    out, vjp_fn = jax.vjp(primal, *[arg_leaves[i] for i in diff])
    out_leaves, out_treedef = jax.tree.flatten(out)
    residuals, res_treedef = jax.tree.flatten(vjp_fn)
    # Residuals that are inputs or outputs are not returned again (that would copy them).
    position = {id(v): ("in", i) for i, v in enumerate(flat)}
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

  in_specs = [sig_lib.abstract(s) for s in signature.leaves]
  if rng:
    in_specs.append(rng_lib.key_spec())
  traced = jax.jit(forward).trace(*in_specs)
  out_info = traced.out_info
  n_out = len(out_info) - found["n_kept"]
  out_specs = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype, weak_type=o.weak_type)
                    for o in out_info[:n_out])
  for i, o in enumerate(out_specs):
    if o.dtype == jax.dtypes.float0:
      raise TypeError(f"{name} returned a float0 value at output leaf {i}.")
  sources = found["sources"]
  layout = Layout(
      n_args=n_args, has_key=rng, out_treedef=found["out_treedef"], out_specs=out_specs,
      res_treedef=found["res_treedef"], sources=sources, n_kept=found["n_kept"], diff=diff,
      needed_inputs=tuple(sorted({i for kind, i in sources if kind == "in"})),
      needed_outputs=tuple(sorted({i for kind, i in sources if kind == "out"})))
  return traced.jaxpr, layout


def _forward_fn(closed: Any, layout: Layout, kind: ForwardKind, *, outputs_only: bool,
                offload: bool) -> Callable[..., list[Any]]:
  run = jex.core.jaxpr_as_fun(closed)

  def finish(values: list[Any]) -> list[Any]:
    outs, kept = values[:layout.n_out], values[layout.n_out:]
    if outputs_only:
      return outs
    return [*outs, *(offload_lib.to_host(k) for k in kept)] if offload else [*outs, *kept]

  if kind == "explicit":
    return lambda *flat: finish(run(*flat))

  def stream_forward(base, index, counter, *arg_leaves):
    key = rng_lib.derive_key(base, index, counter)
    return [*finish(run(*arg_leaves, key)), key, counter + 1]

  return stream_forward


def _stream_prefix() -> list[jax.ShapeDtypeStruct]:
  return [rng_lib.key_spec(), jax.ShapeDtypeStruct((), jnp.uint32),
          jax.ShapeDtypeStruct((), jnp.uint32)]


def _backward_fn(layout: Layout, select: tuple[int, ...], offload: bool) -> Callable[..., Any]:
  a, b, c = len(layout.needed_inputs), len(layout.needed_outputs), layout.n_kept
  ct_leaves = set(layout.ct_leaves)
  diff_position = {leaf: k for k, leaf in enumerate(layout.diff)}

  def backward(*flat):
    ins = dict(zip(layout.needed_inputs, flat[:a]))
    outs = dict(zip(layout.needed_outputs, flat[a:a + b]))
    kept = flat[a + b:a + b + c]
    if offload:
      kept = [offload_lib.to_device(k) for k in kept]
    cts = iter(flat[a + b + c:])
    table = {"in": ins, "out": outs, "kept": kept}
    vjp_fn = jax.tree.unflatten(layout.res_treedef, [table[k][i] for k, i in layout.sources])
    ct = [next(cts) if i in ct_leaves else np.zeros(s.shape, jax.dtypes.float0)
          for i, s in enumerate(layout.out_specs)]
    grads = vjp_fn(jax.tree.unflatten(layout.out_treedef, ct))
    return [grads[diff_position[leaf]] for leaf in select]

  return backward


def capture(fn: Callable[..., Any], signature: sig_lib.Signature, *, rng: bool,
            backward: Sequence[tuple[BackwardKind, tuple[int, ...]]], offload: bool,
            name: str) -> Executables:
  """Traces `fn` once and compiles every executable a GraphedCallable replays for `signature`.

  Args:
    fn: the user's function.
    signature: the signature of the positional arguments.
    rng: whether `fn` takes `key=`; then both forwards (explicit key, per-callable stream)
      are compiled.
    backward: which backward executables to build: ("full", leaves) or ("dgrad", leaves)
      and ("wgrad", leaves); the last one listed receives the residuals as donated buffers
      (device residuals only).
    offload: write the kept residuals to pinned host memory, read them back in the backward.
    name: the callable's name, for errors.
  """
  timer = _Timer()
  start = time.perf_counter()
  closed, layout = trace_forward(fn, signature, rng=rng, name=name)
  trace_seconds = time.perf_counter() - start
  frozen = rng_lib.constant_keys(closed)
  if frozen:
    warnings.warn(
        f"{name}: the traced function contains {frozen[0]}. A key that is a constant of the "
        "executable gives the same random numbers (the same dropout mask) on every replay. "
        "Take the key as an argument: make_graphed(..., rng=True) and fn(..., key=key).",
        stacklevel=4)
  arg_specs = [sig_lib.abstract(s) for s in signature.leaves]
  kinds: tuple[ForwardKind, ...] = ("explicit", "stream") if rng else ("explicit",)
  forward = {}
  for kind in kinds:
    specs = (_stream_prefix() + arg_specs if kind == "stream"
             else arg_specs + ([rng_lib.key_spec()] if rng else []))
    fwd = _forward_fn(closed, layout, kind, outputs_only=False, offload=offload)
    forward[kind] = timer.compile(jax.jit(fwd).trace(*specs))
  out_info = forward["explicit"].out_info
  in_specs = arg_specs + ([rng_lib.key_spec()] if rng else [])
  bwd_specs = ([in_specs[i] for i in layout.needed_inputs]
               + [out_info[i] for i in layout.needed_outputs]
               + list(out_info[layout.n_out:])
               + [out_info[i] for i in layout.ct_leaves])
  first_kept = len(layout.needed_inputs) + len(layout.needed_outputs)
  # Offloaded residuals are host buffers: donating them frees no device memory, and XLA would
  # alias them to device outputs (the result then has the wrong memory kind and aborts).
  donate = () if offload else tuple(range(first_kept, first_kept + layout.n_kept))
  compiled_backward = {}
  for position, (kind, select) in enumerate(backward):
    last = position == len(backward) - 1
    # Each gradient comes back with its input's sharding (FSDP: reduce-scattered weight
    # grads); None (an uncommitted input) leaves the choice to XLA, as before.
    grad_shardings = [signature.leaves[leaf].sharding for leaf in select]
    placed = ({"out_shardings": grad_shardings}
              if any(s is not None for s in grad_shardings) else {})
    bwd = jax.jit(_backward_fn(layout, select, offload), donate_argnums=donate if last else (),
                  **placed)
    compiled_backward[kind] = (timer.compile(bwd.trace(*bwd_specs)), select)
  return Executables(signature=signature, layout=layout, forward=forward,
                     backward=compiled_backward, closed_jaxpr=closed, offload=offload,
                     compiles=timer.compiles, compile_seconds=timer.seconds + trace_seconds)


def inference_forward(entry: Executables, kind: ForwardKind) -> tuple[Any, float]:
  """The forward without residuals (compiled on first use); returns it and compile seconds."""
  if kind not in entry.inference:
    timer = _Timer()
    arg_specs = [sig_lib.abstract(s) for s in entry.signature.leaves]
    specs = (_stream_prefix() + arg_specs if kind == "stream"
             else arg_specs + ([rng_lib.key_spec()] if entry.layout.has_key else []))
    fwd = _forward_fn(entry.closed_jaxpr, entry.layout, kind, outputs_only=True, offload=False)
    entry.inference[kind] = timer.compile(jax.jit(fwd).trace(*specs))
    return entry.inference[kind], timer.seconds
  return entry.inference[kind], 0.0
