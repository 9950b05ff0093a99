"""`GraphedCallable`: replays cached executables from the host; pullbacks."""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
from typing import Any, Callable, Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgraph import capture as capture_lib
from jaxgraph import flat as flat_lib
from jaxgraph import hooks as hooks_lib
from jaxgraph import rng as rng_lib
from jaxgraph import signature as sig_lib

OnNewSignature = Literal["capture", "error"]


class Stats(NamedTuple):
  """Counters of one GraphedCallable (a snapshot; read `g.stats` again for new values).

  Attributes:
    captures: signatures this callable traced and compiled itself.
    cache_hits: signatures served by the capture of an identical callable (same function,
      same signature): identical layers compile once.
    compiles: XLA executables this callable compiled (forward variants, backward, wgrad).
    compile_seconds: time spent tracing, lowering and compiling them.
    replays: forward replays (calls and `vjp`), warmup excluded.
    backward_replays: backward replays (pullback calls), warmup excluded.
    fallbacks: calls run through plain `jax.jit` after `max_captures` signatures.
    residual_bytes: bytes one `vjp` keeps alive for its backward besides the arguments and
      outputs the caller holds anyway (kept residuals), for the signature captured last; 0
      before any capture. Lower it with `make_graphed(..., remat_policy=...)`.
  """

  captures: int
  cache_hits: int
  compiles: int
  compile_seconds: float
  replays: int
  backward_replays: int
  fallbacks: int
  residual_bytes: int


@dataclasses.dataclass
class Config:
  """Settings shared by the callables of one `make_graphed` call."""

  rng: bool
  delay_wgrad: bool
  wgrad_argnums: tuple[int, ...]
  max_captures: int
  on_new_signature: OnNewSignature
  inference_only: bool = False  # forward-only capture: no residuals, no backward
  remat_policy: Callable[..., bool] | None = None
  donate_argnums: tuple[int, ...] = ()  # inference only: positional args the forward donates
  per_layer_executables: bool = False  # each callable replays its own loaded copy
  # (function, signature, offload) -> executables, shared by identical callables
  cache: dict[Any, capture_lib.Executables] = dataclasses.field(default_factory=dict)
  # adjacent layers -> their FusedSegment (sequential_vjp(..., fuse=True))
  segments: dict[tuple[Any, ...], Any] = dataclasses.field(default_factory=dict)
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@functools.lru_cache(maxsize=None)
def _arg_ranges(treedef: Any) -> tuple[tuple[Any, int, int], ...]:
  """(treedef, first leaf, end leaf) of each positional argument; cached per structure."""
  ranges, start = [], 0
  for child in treedef.children():
    ranges.append((child, start, start + child.num_leaves))
    start += child.num_leaves
  return tuple(ranges)


def _donated_leaves(treedef: Any, argnums: tuple[int, ...]) -> tuple[int, ...]:
  """The argument leaves of the positional arguments `argnums` (a FlatTree: its buffers)."""
  return tuple(leaf for argnum, (_, lo, hi) in enumerate(_arg_ranges(treedef))
               if argnum in argnums for leaf in range(lo, hi))


def _backward_plan(config: Config, signature: sig_lib.Signature
                   ) -> list[tuple[capture_lib.BackwardKind, tuple[int, ...]]]:
  diff = [i for i, s in enumerate(signature.leaves) if jnp.issubdtype(s.dtype, jnp.inexact)]
  if not config.delay_wgrad:
    return [("full", tuple(diff))]
  weight_leaves = {leaf for argnum, (_, lo, hi) in enumerate(_arg_ranges(signature.treedef))
                   if argnum in config.wgrad_argnums for leaf in range(lo, hi)}
  return [("dgrad", tuple(i for i in diff if i not in weight_leaves)),
          ("wgrad", tuple(i for i in diff if i in weight_leaves))]


def _float0_like(spec: sig_lib.LeafSpec) -> np.ndarray:
  return np.zeros(spec.shape, jax.dtypes.float0)


def _assemble(entry: capture_lib.Executables, values: Sequence[Any], select: tuple[int, ...],
              argnums: tuple[int, ...] | None) -> tuple[Any, ...]:
  """Gradients per positional argument, like `jax.vjp`; args outside `argnums` are None."""
  leaves: list[Any] = [None] * len(entry.signature.leaves)
  differentiated = set(entry.layout.diff)
  for leaf, spec in enumerate(entry.signature.leaves):
    if leaf not in differentiated:
      leaves[leaf] = _float0_like(spec)  # like jax.vjp: float0 zeros for integer inputs
  for leaf, value in zip(select, values):
    leaves[leaf] = value
  return tuple(
      jax.tree.unflatten(child, leaves[lo:hi]) if argnums is None or argnum in argnums else None
      for argnum, (child, lo, hi) in enumerate(_arg_ranges(entry.signature.treedef)))


class Pullback:
  """The backward of one forward replay. One-shot: a second call raises.

  `pullback(cotangents)` returns one gradient per positional argument of the forward. With
  `delay_wgrad=True` the weight arguments (`wgrad_argnums`) are None there and
  `pullback.wgrad()` returns them later.
  """

  __slots__ = ("_owner", "_event", "_backward", "_wgrad", "_state")

  def __init__(self, owner: GraphedCallable, event: hooks_lib.HookEvent,
               backward: Callable[[Any], tuple[tuple[Any, ...], Callable[[], Any] | None]]):
    self._owner = owner
    self._event = event
    self._backward = backward
    self._wgrad: Callable[[], Any] | None = None
    self._state: Literal["ready", "done", "wgrad_done"] = "ready"

  def __call__(self, cotangents: Any) -> tuple[Any, ...]:
    owner, event = self._owner, self._event
    if self._state != "ready":
      raise RuntimeError(
          f"this pullback of {owner.name} was already called: a pullback replays its backward "
          f"once (its residuals are released). Call {owner.name}.vjp(...) again for a new one.")
    hooks = owner._backward_hooks(event.phase)
    with owner._exclusive():  # a backward is a use of its callable: not concurrent with others
      if hooks[0]:
        hooks_lib.fire(hooks[0], "pre_backward",
                       dataclasses.replace(event, cotangents=cotangents), owner.name)
      grads, self._wgrad = self._backward(cotangents)
      self._state, self._backward = "done", None
      if event.phase == "replay":
        owner._count_replay(backward=True)
      if hooks[1]:
        hooks_lib.fire(hooks[1], "backward",
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
    with self._owner._exclusive():
      grads = self._wgrad()
    # Consumed only once it ran: a failed wgrad (e.g. donated weights) raises the same again.
    self._wgrad, self._state = None, "wgrad_done"
    return grads


class GraphedCallable:
  """A function replayed from ahead-of-time compiled executables. Built by `make_graphed`.

  `g(*args)` replays the forward; `y, pullback = g.vjp(*args)` also returns the pullback.
  Called with tracers (inside `jax.jit`, `jax.grad`, `jax.vmap`) it runs the original
  function instead, so graphed layers compose with whole-step transformations.
  """

  def __init__(self, fn: Callable[..., Any], index: int, config: Config, *,
               hooks: hooks_lib.Hooks, capture_time_hooks: hooks_lib.Hooks, offload: bool):
    self.fn = fn
    # What runs outside the executables (traced calls, the jax.jit fallback): the same math
    # as the captured executables, so under the same residual policy.
    self._uncaptured_fn = (fn if config.remat_policy is None else
                           jax.checkpoint(fn, policy=config.remat_policy, prevent_cse=False))
    self.index = index
    self._set_name(f"{getattr(fn, '__name__', type(fn).__name__)}[{index}]")
    self._config = config
    self._hooks = hooks
    self._capture_time_hooks = capture_time_hooks
    self._offload = offload
    self._entries: dict[sig_lib.Signature, capture_lib.Executables] = {}
    self._own: set[Any] = set()  # cache keys this callable captured (reset() drops them)
    self._replayed: dict[Any, Any] = {}  # a shared executable -> the one this callable runs
    self._fallback: Callable[..., Any] | None = None
    self._busy = threading.Lock()
    self._captures = self._cache_hits = self._compiles = 0
    self._compile_seconds = 0.0
    self._replays = self._backward_replays = self._fallbacks = 0
    if config.rng:
      self._index_array = jnp.uint32(index)
      self.seed(jax.random.key(0))

  def _set_name(self, name: str) -> None:
    self.name = name
    # Each replay shows up under these names in a jax.profiler trace (TensorBoard, Perfetto).
    self._trace_names = (f"jaxgraph {name} forward", f"jaxgraph {name} backward")

  def __repr__(self) -> str:
    return f"GraphedCallable({self.name}, signatures={len(self._entries)})"

  # ----------------------------------------------------------------------------- public API

  @property
  def stats(self) -> Stats:
    """Counters: captures, cache hits, compiles, compile seconds, replays, fallbacks.

    The captures and compiles of fused segments (`sequential_vjp(..., fuse=True)`) count on
    their first layer.
    """
    captures, hits, compiles, seconds = (self._captures, self._cache_hits, self._compiles,
                                         self._compile_seconds)
    for segment in self._led_segments():
      captures += segment._captures
      hits += segment._cache_hits
      compiles += segment._compiles
      seconds += segment._compile_seconds
    last = next(reversed(self._entries.values()), None)
    return Stats(captures, hits, compiles, seconds, self._replays, self._backward_replays,
                 self._fallbacks, last.residual_bytes if last is not None else 0)

  def reset(self) -> None:
    """Drops this callable's executables, and those of fused segments it belongs to; its
    next call captures again (and counts anew)."""
    config = self._config
    with config.lock:
      for key in self._own:
        config.cache.pop(key, None)
      dropped = [key for key in config.segments if self in key]
      segments = [config.segments.pop(key) for key in dropped]
    for segment in segments:
      segment.reset()
    self._entries.clear()
    self._own.clear()
    self._replayed.clear()
    self._fallback = None

  def _count_replay(self, *, backward: bool) -> None:
    if backward:
      self._backward_replays += 1
    else:
      self._replays += 1

  def _led_segments(self) -> list[Any]:
    return [segment for key, segment in self._config.segments.items() if key[0] is self]

  def seed(self, key: jax.Array | int, *, counter: int = 0) -> None:
    """Sets this callable's key stream (`rng=True`): base key and position.

    Without an explicit `key=`, replay n of callable i uses
    `fold_in(fold_in(base, i), counter + n)`, derived inside the forward executable.
    Restore a checkpoint with `g.seed(base, counter=saved_counter)`.
    """
    if not self._config.rng:
      raise ValueError(f"{self.name} was built with rng=False; it has no key stream.")
    if isinstance(key, int):
      key = jax.random.key(key)
    rng_lib.check_key(key, f"{self.name}.seed")
    self._base_key = key
    self._counter = jnp.uint32(counter)

  @property
  def rng_base_key(self) -> jax.Array:
    """The base key of this callable's stream (save it with `rng_counter` to resume)."""
    self._require_rng()
    return self._base_key

  @property
  def rng_counter(self) -> int:
    """How many keys this callable's stream has drawn (reading it waits for the device)."""
    self._require_rng()
    return int(self._counter)

  def __call__(self, *args: Any, key: jax.Array | None = None, **kwargs: Any) -> Any:
    """Replays the forward executable (no residuals are kept)."""
    leaves, treedef = self._flatten(args, key, kwargs)
    if leaves is None:
      return self._call_traced(args, key)
    with self._exclusive():
      return self._forward(args, leaves, treedef, key, phase="replay", iteration=self._replays,
                           microbatch=0, with_pullback=False)[0]

  def vjp(self, *args: Any, key: jax.Array | None = None,
          **kwargs: Any) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]:
    """Replays the forward; returns `(outputs, pullback)` like `jax.vjp`.

    Raises:
      TypeError: for a callable built with `make_graphed(..., inference_only=True)`, which
        has no backward.
    """
    self._require_backward("vjp")
    leaves, treedef = self._flatten(args, key, kwargs)
    if leaves is None:
      return self._vjp_traced(args, key)
    with self._exclusive():
      return self._forward(args, leaves, treedef, key, phase="replay", iteration=self._replays,
                           microbatch=0, with_pullback=True)

  # ----------------------------------------------------------------------------- internals

  def _require_rng(self) -> None:
    if not self._config.rng:
      raise ValueError(f"{self.name} was built with rng=False; it has no key stream.")

  def _require_backward(self, caller: str) -> None:
    if self._config.inference_only:
      raise TypeError(
          f"{caller}: {self.name} was built with make_graphed(..., inference_only=True), so "
          "it has no backward executable and keeps no residuals. Call it for the outputs "
          "only (y = layer(*args)), or build it without inference_only=True to train it.")

  def _exclusive(self) -> Any:
    if not self._busy.acquire(blocking=False):
      raise RuntimeError(
          f"{self.name} is already running in another thread. A GraphedCallable is not "
          "reentrant and not shared across threads (its key stream and counters would race); "
          "different GraphedCallables may run in different threads.")
    return _Release(self._busy)

  def _flatten(self, args: tuple[Any, ...], key: Any, kwargs: dict[str, Any]
               ) -> tuple[list[Any] | None, Any]:
    if kwargs:
      raise TypeError(
          f"{self.name} got keyword arguments {sorted(kwargs)}; only positional arguments are "
          "captured" + (" (and key=)" if self._config.rng else "") + ". Pass them "
          "positionally, or bind them with functools.partial before make_graphed.")
    if key is not None and not self._config.rng:
      raise TypeError(f"{self.name} got key= but was built with rng=False; build it with "
                      "make_graphed(..., rng=True) to thread keys.")
    leaves, treedef = jax.tree.flatten(args)
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves) or isinstance(key, jax.core.Tracer):
      return None, treedef
    if key is not None:
      rng_lib.check_key(key, self.name)
    return leaves, treedef

  def _call_traced(self, args: tuple[Any, ...], key: Any) -> Any:
    args = flat_lib.unravel(args)  # as inside a capture: fn sees its own pytrees
    if self._config.rng:
      if key is None:
        raise TypeError(f"{self.name} was called under a JAX transformation without key=; "
                        "its own stream lives outside traces, so pass key= explicitly.")
      return self._uncaptured_fn(*args, key=key)
    return self._uncaptured_fn(*args)

  def _vjp_traced(self, args: tuple[Any, ...], key: Any) -> Any:
    return jax.vjp(lambda *a: self._call_traced(a, key), *args)

  def _backward_hooks(self, phase: hooks_lib.Phase) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    if phase == "replay":
      return self._hooks.pre_backward, self._hooks.backward
    merged = self._capture_time_hooks + self._hooks
    return merged.pre_backward, merged.backward

  def _forward_hooks(self, phase: hooks_lib.Phase) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    if phase == "replay":
      return self._hooks.pre_forward, self._hooks.forward
    merged = self._capture_time_hooks + self._hooks
    return merged.pre_forward, merged.forward

  def _entry(self, signature: sig_lib.Signature) -> capture_lib.Executables | None:
    """The executables for `signature`: cached, captured now, or None (fallback)."""
    entry = self._entries.get(signature)
    if entry is not None:
      return entry
    config = self._config
    if self._entries and config.on_new_signature == "error":
      expected = next(iter(self._entries))
      raise TypeError(
          f"{self.name} was called with a signature it did not capture "
          "(on_new_signature='error'):\n" + sig_lib.describe_mismatch(expected, signature) +
          "\nPass arguments like the sample_args, or build with on_new_signature='capture'.")
    if len(self._entries) >= config.max_captures:
      if self._fallback is None:
        warnings.warn(
            f"{self.name} has captured max_captures={config.max_captures} signatures; calls "
            "with new signatures now run through jax.jit (no hooks are lost, but each new "
            "signature compiles). Raise max_captures, or keep argument shapes fixed.",
            stacklevel=4)
        self._fallback = jax.jit(flat_lib.unravelling(self._uncaptured_fn),
                                 donate_argnums=config.donate_argnums)
      return None
    return self._capture(signature)

  def _capture(self, signature: sig_lib.Signature) -> capture_lib.Executables:
    config = self._config
    cache_key = (self.fn, signature, self._offload)
    with config.lock:
      entry = config.cache.get(cache_key)
      if entry is None:
        try:
          if config.inference_only:
            entry = capture_lib.capture_inference(
                self.fn, signature, n_keys=self._n_keys, name=self.name,
                donated=_donated_leaves(signature.treedef, config.donate_argnums))
          else:
            entry = capture_lib.capture(
                self.fn, signature, n_keys=self._n_keys,
                backward=_backward_plan(config, signature), offload=self._offload,
                remat_policy=config.remat_policy, name=self.name)
        except Exception as e:
          e.add_note(f"while capturing {self.name} for a new input signature: "
                     f"{sig_lib.describe(signature)}")
          raise
        config.cache[cache_key] = entry
        self._own.add(cache_key)
        self._captures += 1
        self._compiles += entry.compiles
        self._compile_seconds += entry.compile_seconds
      else:
        self._cache_hits += 1
    self._entries[signature] = entry
    return entry

  def _forward(self, args: tuple[Any, ...], leaves: list[Any], treedef: Any, key: Any, *,
               phase: hooks_lib.Phase, iteration: int, microbatch: int, with_pullback: bool,
               stream: tuple[jax.Array, jax.Array] | None = None,
               signature: sig_lib.Signature | None = None) -> Any:
    """One forward: hooks, executable, pullback. `stream` overrides the key stream (warmup);
    `signature` is that of `leaves`, where the caller already has it."""
    if signature is None:
      signature = sig_lib.signature_of(leaves, treedef)
    entry = self._entry(signature)
    pre, post = self._forward_hooks(phase)
    event = hooks_lib.HookEvent(self.index, phase, iteration, microbatch, args)
    if pre:
      hooks_lib.fire(pre, "pre_forward", event, self.name)
    if entry is None:
      result = self._fallback_forward(args, key, with_pullback, event)
    else:
      result = self._replay_forward(entry, leaves, key, with_pullback, event, stream)
    if phase == "replay":
      self._count_replay(backward=False)
    if post:
      hooks_lib.fire(post, "forward", dataclasses.replace(event, outputs=result[0]), self.name)
    return result

  def _local(self, entry: capture_lib.Executables, exe: Any) -> Any:
    """The executable this callable replays for `exe` of `entry`: `exe` itself, or with
    `per_layer_executables` a loaded copy of its own where an identical callable captured
    `entry` (and replays `exe` itself)."""
    local = self._replayed.get(exe)
    if local is None:
      captured_here = (self.fn, entry.signature, self._offload) in self._own
      local = (capture_lib.loaded_copy(exe)
               if self._config.per_layer_executables and not captured_here else exe)
      self._replayed[exe] = local
    return local

  @property
  def _n_keys(self) -> int:
    return 1 if self._config.rng else 0

  def _stream_inputs(self, stream: tuple[jax.Array, jax.Array] | None) -> list[jax.Array]:
    """(base, index, counter) for the stream forward; `stream` overrides base and counter."""
    base, counter = stream if stream is not None else (self._base_key, self._counter)
    return [base, self._index_array, counter]

  def _advance(self, counters: list[jax.Array]) -> None:
    (self._counter,) = counters

  def _replay_forward(self, entry: capture_lib.Executables, leaves: list[Any], key: Any,
                      with_pullback: bool, event: hooks_lib.HookEvent,
                      stream: tuple[jax.Array, jax.Array] | None) -> Any:
    layout = entry.layout
    stream_mode = layout.n_keys > 0 and key is None
    kind: capture_lib.ForwardKind = "stream" if stream_mode else "explicit"
    inputs = leaves if key is None else leaves + (list(key) if layout.n_keys > 1 else [key])
    exe, seconds = capture_lib.forward_executable(entry, kind, residuals=with_pullback)
    if seconds:
      self._compiles += 1
      self._compile_seconds += seconds
    exe = self._local(entry, exe)
    try:
      with jax.profiler.TraceAnnotation(self._trace_names[0]):
        values = (exe(*self._stream_inputs(stream), *inputs) if stream_mode else exe(*inputs))
    except (RuntimeError, ValueError) as e:  # deleted: RuntimeError; donated: ValueError
      if entry.donated and any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
        raise RuntimeError(
            f"{self.name} got an array that was deleted or donated, e.g. a cache donated "
            "to an earlier call (make_graphed(..., donate_argnums=...)). Pass the arrays "
            "that call returned instead.") from e
      raise
    if stream_mode:
      # outputs and kept residuals, then one derived key and one next counter per key
      n = len(values) - 2 * layout.n_keys
      derived, counters = values[n:n + layout.n_keys], values[n + layout.n_keys:]
      values = values[:n]
      inputs = inputs + derived
      if stream is None:
        self._advance(counters)
    if not with_pullback:
      return (jax.tree.unflatten(layout.out_treedef, values),)
    outs, kept = values[:layout.n_out], values[layout.n_out:]
    out = jax.tree.unflatten(layout.out_treedef, outs)
    needed_inputs = [inputs[i] for i in layout.needed_inputs]
    needed_outputs = [outs[i] for i in layout.needed_outputs]
    owner = self

    def run(kind: capture_lib.BackwardKind, cts: list[Any]) -> list[Any]:
      exe = owner._local(entry, entry.backward[kind][0])
      try:
        with jax.profiler.TraceAnnotation(owner._trace_names[1]):
          return exe(*needed_inputs, *needed_outputs, *kept, *cts)
      except (RuntimeError, ValueError) as e:  # deleted: RuntimeError; donated: ValueError
        if any(getattr(x, "is_deleted", lambda: False)() for x in needed_inputs + needed_outputs):
          raise RuntimeError(
              f"the backward of {owner.name} needs arrays from its forward that were deleted "
              "or donated since (e.g. params donated to an optimizer step before the "
              "pullback ran). Run every pullback before donating the forward's inputs.") from e
        raise

    def backward(cotangents: Any):
      ct_leaves, ct_treedef = jax.tree.flatten(cotangents)
      if ct_treedef != layout.out_treedef:
        raise TypeError(f"the cotangent passed to the pullback of {owner.name} has structure "
                        f"{ct_treedef}, but the outputs have {layout.out_treedef}.")
      cts = [ct_leaves[i] for i in layout.ct_leaves]
      first_kind, (_, select) = next(iter(entry.backward.items()))
      try:
        values = run(first_kind, cts)
      except (TypeError, ValueError) as e:
        raise owner._cotangent_error(entry, cts) from e
      if first_kind == "full":
        return _assemble(entry, values, select, None), None
      wgrad_select = entry.backward["wgrad"][1]
      argnums = owner._config.wgrad_argnums
      dgrad_argnums = tuple(i for i in range(len(_arg_ranges(entry.signature.treedef)))
                            if i not in argnums)
      return (_assemble(entry, values, select, dgrad_argnums),
              lambda: _assemble(entry, run("wgrad", cts), wgrad_select, argnums))

    if not any(self._backward_hooks(event.phase)):
      # Without backward hooks nobody reads the args again: don't keep them alive.
      event = hooks_lib.HookEvent(event.index, event.phase, event.iteration, event.microbatch, ())
    return out, Pullback(self, event, backward)

  def _cotangent_error(self, entry: capture_lib.Executables, cts: list[Any]) -> TypeError:
    layout = entry.layout
    expected = [layout.out_specs[i] for i in layout.ct_leaves]
    lines = []
    paths = sig_lib.leaf_paths(layout.out_treedef, "cotangents")
    for i, want, got in zip(layout.ct_leaves, expected, cts):
      got_shape, got_dtype = getattr(got, "shape", None), getattr(got, "dtype", type(got))
      if (got_shape, got_dtype) != (want.shape, want.dtype):
        lines.append(f"{paths[i]}: expected {want.dtype}{list(want.shape)}, got "
                     f"{got_dtype}{list(got_shape) if got_shape is not None else ''}")
    detail = "\n".join(lines) or "(shapes and dtypes match; the sharding differs)"
    return TypeError(f"the cotangent passed to the pullback of {self.name} does not match its "
                     f"outputs:\n{detail}\nA cotangent has the shape and dtype of the output.")

  def _fallback_forward(self, args: tuple[Any, ...], key: Any, with_pullback: bool,
                        event: hooks_lib.HookEvent) -> Any:
    jitted = self._fallback
    from_stream = self._config.rng and key is None
    if self._config.rng:
      if from_stream:
        key = rng_lib.derive_key(self._base_key, self._index_array, self._counter)
      fn = lambda *a: jitted(*a, key=key)
    else:
      fn = jitted
    if not with_pullback:
      result = (fn(*args),)
    else:
      out, vjp_fn = jax.vjp(fn, *args)
      result = out, Pullback(self, event, lambda ct: (vjp_fn(ct), None))
    # Counted (and the stream advanced) only once the call succeeded.
    self._fallbacks += 1
    if from_stream:
      self._counter = self._counter + jnp.uint32(1)
    return result


class _Release:
  __slots__ = ("_lock",)

  def __init__(self, lock: threading.Lock):
    self._lock = lock

  def __enter__(self) -> None:
    pass

  def __exit__(self, *exc: Any) -> None:
    self._lock.release()
