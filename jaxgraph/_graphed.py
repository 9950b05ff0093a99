"""`GraphedCallable`: replays one function's cached executables from the host.

Its parts: the callable's state (`Config` shared by one `make_graphed` call, `_Counters`
behind `Stats`, a `rng.KeyStream`), finding or capturing the executables of a signature,
and the replay of one forward executable, whose backward is a `pullback.Pullback`
(pullback.py). Which kept buffers go to host memory is the `offload.Offloader`'s, which
argument leaves get gradients pullback.py's (`masked_leaves`, `masked_vjp`), and which hooks
fire in a phase `hooks.by_phase`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import warnings
from typing import Any, Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp

from jaxgraph import _capture as capture_lib
from jaxgraph import _hooks as hooks_lib
from jaxgraph import _pullback as pullback_lib
from jaxgraph import _signature as sig_lib
from jaxgraph import flat as flat_lib
from jaxgraph import offload as offload_lib
from jaxgraph import rng as rng_lib
from jaxgraph._pullback import Pullback  # by name: docs/api.md shows the type

OnNewSignature = Literal["capture", "error"]

# A capture after a callable's first says so here, at WARNING (docs/semantics.md#signatures).
logger = logging.getLogger("jaxgraph")


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
    offload_bytes: of those, the bytes it keeps in host memory (`offload_residuals`); 0 for
      a callable not offloaded.
    wgrad_bytes: with `delay_wgrad=True`, the bytes a pullback holds from its dgrad to its
      wgrad (freed by the wgrad): what the dgrad returned for the weight products (the
      cotangents at the weight-consuming ops; a norm's or bias's gradient itself) and the
      kept residuals the wgrad reads; the dgrad frees the other residuals. 0 without
      `delay_wgrad`.
  """

  captures: int
  cache_hits: int
  compiles: int
  compile_seconds: float
  replays: int
  backward_replays: int
  fallbacks: int
  residual_bytes: int
  offload_bytes: int
  wgrad_bytes: int = 0


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
  # XLA options of every executable these callables compile (sorted (name, value) pairs)
  compiler_options: tuple[tuple[str, Any], ...] = ()
  offload: offload_lib.Policy = offload_lib.Policy()  # of the callables offloaded
  # which argument leaves get gradients: a prefix of the arguments, a function of them, or
  # None for every float leaf (`pullback.mask_flags`)
  grad_mask: Any = None
  # (function, signature, offload inside the executables) -> executables, shared by
  # identical callables
  cache: dict[Any, capture_lib.Executables] = dataclasses.field(default_factory=dict)
  # adjacent layers -> their FusedSegment (sequential_vjp(..., fuse=True)); a layer and
  # whether it is first -> its PrefetchStep (sequential_vjp(..., prefetch=True))
  segments: dict[tuple[Any, ...], Any] = dataclasses.field(default_factory=dict)
  # (a prefetching chain's steps, its first input signature) -> whether it prefetches
  prefetch: dict[tuple[Any, ...], bool] = dataclasses.field(default_factory=dict)
  # id -> closed-over weight a capture warned of (ConstantWeightWarning once per array)
  warned_weights: dict[int, Any] = dataclasses.field(default_factory=dict)
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@dataclasses.dataclass
class _Counters:
  """What `Stats` reports, as this callable counts it (a fused segment's too)."""

  captures: int = 0
  cache_hits: int = 0
  compiles: int = 0
  compile_seconds: float = 0.0
  replays: int = 0
  backward_replays: int = 0
  fallbacks: int = 0

  def compiled(self, compiles: int, seconds: float) -> None:
    self.compiles += compiles
    self.compile_seconds += seconds

  def snapshot(self, segments: list[_Counters], residual_bytes: int,
               offload_bytes: int, wgrad_bytes: int) -> Stats:
    """`Stats` of these counts, with the captures and compiles of `segments` added."""
    return Stats(self.captures + sum(c.captures for c in segments),
                 self.cache_hits + sum(c.cache_hits for c in segments),
                 self.compiles + sum(c.compiles for c in segments),
                 self.compile_seconds + sum(c.compile_seconds for c in segments),
                 self.replays, self.backward_replays, self.fallbacks, residual_bytes,
                 offload_bytes, wgrad_bytes)


class GraphedCallable:
  """A function replayed from ahead-of-time compiled executables. Built by `make_graphed`.

  `g(*args)` replays the forward; `y, pullback = g.vjp(*args)` also returns the pullback.
  Called with tracers (inside `jax.jit`, `jax.grad`, `jax.vmap`) it runs the original
  function instead, so graphed layers compose with whole-step transformations.
  """

  def __init__(self, fn: Callable[..., Any], index: int, config: Config, *,
               hooks: hooks_lib.Hooks, capture_time_hooks: hooks_lib.Hooks, offload: bool):
    self.fn = fn
    self.index = index
    self._set_name(f"{getattr(fn, '__name__', type(fn).__name__)}[{index}]")
    self._config = config
    # What runs outside the executables (traced calls, the jax.jit fallback): the same math
    # as the captured executables, so under the same residual policy.
    self._uncaptured_fn = (fn if self._remat_policy is None else
                           jax.checkpoint(fn, policy=self._remat_policy, prevent_cse=False))
    self._hooks = hooks_lib.by_phase(hooks, capture_time_hooks)
    self._offload = offload_lib.Offloader(config.offload, enabled=offload)
    self._entries: dict[sig_lib.Signature, capture_lib.Executables] = {}
    self._own: set[Any] = set()  # cache keys this callable captured (reset() drops them)
    self._replayed: dict[Any, Any] = {}  # a shared executable -> the one this callable runs
    self._fallback: Callable[..., Any] | None = None
    self._busy = threading.Lock()
    self._counts = _Counters()
    self._stream: rng_lib.KeyStream | None = None
    if config.rng:
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
    last = next(reversed(self._entries.values()), None)
    residual_bytes = offload_bytes = wgrad_bytes = 0
    if last is not None:
      residual_bytes = last.residual_bytes
      offload_bytes = self._offload.nbytes(last.layout.buffers)
      wgrad_bytes = capture_lib.wgrad_bytes(last)
    return self._counts.snapshot([segment._counts for segment in self._led_segments()],
                                 residual_bytes, offload_bytes, wgrad_bytes)

  @property
  def kept_buffers(self) -> tuple[offload_lib.Buffer, ...]:
    """The buffers one `vjp` keeps for its backward (kept residuals, the small ones packed by
    dtype), for the signature captured last; () before any capture.

    What `make_graphed(..., offload_min_bytes=, offload_names=)` select from, and what
    `jaxgraph.offload.plan` takes per layer to move part of each layer
    (`[b.nbytes for b in g.kept_buffers]`). They sum to `stats.residual_bytes`.
    """
    last = next(reversed(self._entries.values()), None)
    return () if last is None else last.layout.buffers

  def reset(self) -> None:
    """Drops this callable's executables, and those of fused segments it belongs to; its
    next call captures again (and counts anew)."""
    config = self._config
    with config.lock:
      for key in self._own:
        config.cache.pop(key, None)
      dropped = [key for key in config.segments if self in key]
      segments = [config.segments.pop(key) for key in dropped]
      config.prefetch.clear()
    for segment in segments:
      segment.reset()
    self._entries.clear()
    self._own.clear()
    self._replayed.clear()
    self._offload.clear()
    self._fallback = None

  def _count_replay(self, *, backward: bool) -> None:
    if backward:
      self._counts.backward_replays += 1
    else:
      self._counts.replays += 1

  def _led_segments(self) -> list[Any]:
    return [segment for key, segment in self._config.segments.items() if key[0] is self]

  def seed(self, key: jax.Array | int, *, counter: int = 0) -> None:
    """Sets this callable's key stream (`rng=True`): base key and position.

    Without an explicit `key=`, replay n of callable i uses
    `fold_in(fold_in(base, i), counter + n)`, derived inside the forward executable.
    Restore a checkpoint with `g.seed(base, counter=saved_counter)`.
    """
    self._require_rng()
    if isinstance(key, int):
      key = jax.random.key(key)
    rng_lib.check_key(key, f"{self.name}.seed")
    self._stream = rng_lib.KeyStream(key, jnp.uint32(self.index), jnp.uint32(counter))

  @property
  def rng_base_key(self) -> jax.Array:
    """The base key of this callable's stream (save it with `rng_counter` to resume)."""
    self._require_rng()
    return self._stream.base

  @property
  def rng_counter(self) -> int:
    """How many keys this callable's stream has drawn (reading it waits for the device)."""
    self._require_rng()
    return int(self._stream.counter)

  def __call__(self, *args: Any, key: jax.Array | None = None, **kwargs: Any) -> Any:
    """Replays the forward executable (no residuals are kept)."""
    leaves, treedef = self._flatten(args, key, kwargs)
    if leaves is None:
      return self._call_traced(args, key)
    with self._exclusive():
      return self._forward(args, leaves, treedef, key, phase="replay",
                           iteration=self._counts.replays, microbatch=0, with_pullback=False)[0]

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
      return self._forward(args, leaves, treedef, key, phase="replay",
                           iteration=self._counts.replays, microbatch=0, with_pullback=True)

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
    if any(isinstance(value, jax.core.Tracer) for value in (*leaves, key)):
      return None, treedef
    if key is not None:
      rng_lib.check_key(key, self.name)
    return leaves, treedef

  def _call_traced(self, args: tuple[Any, ...], key: Any) -> Any:
    # under the user's jax.grad too, no gradient where the mask says
    args = pullback_lib.stop_masked(args, self._config.grad_mask)
    args = flat_lib.unravel(args)  # as inside a capture: fn sees its own pytrees
    if self._config.rng:
      if key is None:
        raise TypeError(f"{self.name} was called under a JAX transformation without key=; "
                        "its own stream lives outside traces, so pass key= explicitly.")
      return self._uncaptured_fn(*args, key=key)
    return self._uncaptured_fn(*args)

  def _vjp_traced(self, args: tuple[Any, ...], key: Any) -> Any:
    return pullback_lib.masked_vjp(lambda *a: self._call_traced(a, key), args,
                                   self._config.grad_mask)

  def _entry(self, signature: sig_lib.Signature, *, sampled: bool = False
             ) -> capture_lib.Executables | None:
    """The executables for `signature`: cached, captured now, or None (fallback). `sampled`:
    a signature of the sample_args, which make_graphed captures (neither an error nor a log)."""
    entry = self._entries.get(signature)
    if entry is not None:
      return entry
    config = self._config
    captured = [] if sampled else list(self._entries)
    if captured and config.on_new_signature == "error":
      raise TypeError(
          f"{self.name} was called with a signature it did not capture "
          f"(on_new_signature='error'):\n{_new_signature(captured, signature)}\n"
          "Pass arguments like the sample_args, or build with on_new_signature='capture'.")
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
    before = dataclasses.replace(self._counts)  # a copy: what this capture adds to it
    entry = self._capture(signature)
    if (captured and self._counts.captures > before.captures  # compiled here: no cache hit
        and logger.isEnabledFor(logging.WARNING)):
      self._log_new_signature(captured, signature,
                              self._counts.compile_seconds - before.compile_seconds)
    return entry

  def _log_new_signature(self, captured: list[sig_lib.Signature],
                         signature: sig_lib.Signature, seconds: float) -> None:
    """Says on the `jaxgraph` logger that a signature after the first was captured: where it
    differs from the closest one captured before, and what it cost."""
    logger.warning(
        "%s captured a new input signature (%d of max_captures=%d; compiled in %.2f s). It "
        "differs from the closest one captured before:\n%s\nArguments like the "
        "sample_args replay without compiling. make_graphed(..., on_new_signature='error') "
        "raises here instead; a program that means to capture several signatures silences "
        "this with logging.getLogger('jaxgraph').setLevel(logging.ERROR).",
        self.name, len(self._entries), self._config.max_captures, seconds,
        _new_signature(captured, signature))

  def _cache_key(self, signature: sig_lib.Signature) -> tuple[Any, ...]:
    return (self.fn, signature, self._offload.in_executables)

  def _capture(self, signature: sig_lib.Signature) -> capture_lib.Executables:
    config = self._config
    cache_key = self._cache_key(signature)
    with config.lock:
      entry = config.cache.get(cache_key)
      if entry is None:
        try:
          if config.inference_only:
            entry = capture_lib.capture_inference(
                self.fn, signature, n_keys=self._n_keys, name=self.name,
                donated=pullback_lib.argument_leaves(signature.treedef,
                                                    config.donate_argnums),
                warned_weights=config.warned_weights,
                compiler_options=config.compiler_options)
          else:
            diff = self._differentiated(signature)
            entry = capture_lib.capture(
                self.fn, signature, n_keys=self._n_keys, diff=diff,
                backward=pullback_lib.backward_plan(
                    diff, signature.treedef, delay_wgrad=config.delay_wgrad,
                    wgrad_argnums=config.wgrad_argnums),
                offload=config.offload if cache_key[-1] else None,
                remat_policy=self._remat_policy, name=self.name,
                loose_names=config.offload.names is not None,
                warn_constant_keys=self._warns_of_constant_keys,
                warned_weights=config.warned_weights, twin=self._twin(signature),
                compiler_options=config.compiler_options)
        except Exception as e:
          e.add_note(f"while capturing {self.name} for a new input signature: "
                     f"{sig_lib.describe(signature)}")
          raise
        config.cache[cache_key] = entry
        self._own.add(cache_key)
        self._counts.captures += 1
        self._counts.compiled(entry.compiles, entry.compile_seconds)
      else:
        self._counts.cache_hits += 1
    self._entries[signature] = entry
    self._offload.captured(signature, entry.layout.buffers, owner=self.name)
    return entry

  def _differentiated(self, signature: sig_lib.Signature) -> tuple[int, ...]:
    """The argument leaves of `signature` that get gradients (`pullback.masked_leaves`)."""
    return pullback_lib.masked_leaves(signature, self._config.grad_mask)

  def _forward(self, args: tuple[Any, ...], leaves: list[Any], treedef: Any, key: Any, *,
               phase: hooks_lib.Phase, iteration: int, microbatch: int, with_pullback: bool,
               stream: tuple[jax.Array, jax.Array] | None = None,
               signature: sig_lib.Signature | None = None) -> Any:
    """One forward: hooks, executable, pullback. `stream` overrides the key stream (warmup);
    `signature` is that of `leaves`, where the caller already has it."""
    if signature is None:
      signature = sig_lib.signature_of(leaves, treedef)
    entry = self._entry(signature)
    hooks = self._hooks[phase]
    event = hooks_lib.HookEvent(self.index, phase, iteration, microbatch, args)
    if hooks.pre_forward:
      hooks_lib.fire(hooks.pre_forward, "pre_forward", event, self.name)
    if entry is None:
      result = self._fallback_forward(args, key, with_pullback, event)
    else:
      result = self._replay_forward(entry, leaves, key, with_pullback, event, stream)
    if phase == "replay":
      self._count_replay(backward=False)
    if hooks.forward:
      hooks_lib.fire(hooks.forward, "forward", dataclasses.replace(event, outputs=result[0]),
                     self.name)
    return result

  def _local(self, entry: capture_lib.Executables, exe: Any) -> Any:
    """The executable this callable replays for `exe` of `entry`: `exe` itself, or with
    `per_layer_executables` a loaded copy of its own where an identical callable captured
    `entry` (and replays `exe` itself)."""
    local = self._replayed.get(exe)
    if local is None:
      captured_here = self._cache_key(entry.signature) in self._own
      local = (capture_lib.loaded_copy(exe)
               if self._config.per_layer_executables and not captured_here else exe)
      self._replayed[exe] = local
    return local

  @property
  def _n_keys(self) -> int:
    return 1 if self._config.rng else 0

  @property
  def _remat_policy(self) -> Callable[..., bool] | None:
    """The residual policy applied around `fn` (a fused chain applies it per function)."""
    return self._config.remat_policy

  def _twin(self, signature: sig_lib.Signature) -> Any:
    """The `explicit.Twin` to trace `signature` on, or None: as it is (a prefetching step
    traces on the twin of its FSDP mesh)."""
    return None

  @property
  def _warns_of_constant_keys(self) -> bool:
    """Whether a capture warns of keys that are constants of `fn` (a frozen dropout mask)."""
    return True

  def _stream_inputs(self, stream: tuple[jax.Array, jax.Array] | None) -> list[jax.Array]:
    """(base, index, counter) for the stream forward; `stream` overrides base and counter."""
    return self._stream.inputs(stream)

  def _advance(self, counters: list[jax.Array]) -> None:
    (self._stream.counter,) = counters

  def _replay_forward(self, entry: capture_lib.Executables, leaves: list[Any], key: Any,
                      with_pullback: bool, event: hooks_lib.HookEvent,
                      stream: tuple[jax.Array, jax.Array] | None) -> Any:
    layout = entry.layout
    stream_mode = layout.n_keys > 0 and key is None
    kind: capture_lib.ForwardKind = "stream" if stream_mode else "explicit"
    inputs = leaves if key is None else leaves + (list(key) if layout.n_keys > 1 else [key])
    exe, seconds = capture_lib.forward_executable(entry, kind, residuals=with_pullback)
    if seconds:
      self._counts.compiled(1, seconds)
    exe = self._local(entry, exe)
    try:
      with jax.profiler.TraceAnnotation(self._trace_names[0]):
        values = (exe(*self._stream_inputs(stream), *inputs) if stream_mode else exe(*inputs))
    except (RuntimeError, ValueError) as e:  # deleted: RuntimeError; donated: ValueError
      if entry.donated and pullback_lib.any_deleted(leaves):
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
    outs, kept = values[:layout.n_out], values[layout.n_out:]
    to_host = self._offload.to_host.get(entry.signature, ()) if with_pullback else ()
    if to_host:
      offload_lib.start_to_host_in(kept, to_host)
    if stream_mode and stream is None:  # the key is spent only once nothing can fail
      self._advance(counters)
    if not with_pullback:
      return (jax.tree.unflatten(layout.out_treedef, values),)
    backward = pullback_lib.ExecutableBackward(
        self, entry, needed_inputs=[inputs[i] for i in layout.needed_inputs],
        needed_outputs=[outs[i] for i in layout.needed_outputs], kept=kept, on_host=to_host,
        placements=sig_lib.respelled(leaves, layout.diff))
    hooks = self._hooks[event.phase]
    if not (hooks.pre_backward or hooks.backward):
      # Without backward hooks nobody reads the args again: don't keep them alive.
      event = hooks_lib.HookEvent(event.index, event.phase, event.iteration, event.microbatch, ())
    return jax.tree.unflatten(layout.out_treedef, outs), Pullback(self, event, backward)

  def _fallback_forward(self, args: tuple[Any, ...], key: Any, with_pullback: bool,
                        event: hooks_lib.HookEvent) -> Any:
    jitted = self._fallback
    from_stream = self._config.rng and key is None
    if self._config.rng:
      if from_stream:
        key = rng_lib.derive_key(*self._stream.inputs())
      fn = lambda *a: jitted(*a, key=key)
    else:
      fn = jitted
    if not with_pullback:
      result = (fn(*args),)
    else:
      out, vjp_fn = pullback_lib.masked_vjp(fn, args, self._config.grad_mask)
      result = out, Pullback(self, event, lambda ct: (vjp_fn(ct), None))
    # Counted (and the stream advanced) only once the call succeeded.
    self._counts.fallbacks += 1
    if from_stream:
      self._stream.counter = self._stream.counter + jnp.uint32(1)
    return result


def _new_signature(captured: list[sig_lib.Signature], signature: sig_lib.Signature) -> str:
  """Where `signature` differs from the closest of the `captured` ones, and, where a sharding
  changed, what that costs."""
  closest = sig_lib.closest(captured, signature)
  text = sig_lib.describe_mismatch(closest, signature)
  if sig_lib.sharding_changed(closest, signature):
    text += ("\nA sharding changed, and gradients come back placed like their arguments: "
             "params that lost their FSDP sharding get replicated gradients. Keep the params' "
             "shardings through the optimizer, e.g. jax.jit(update, "
             "out_shardings=jaxgraph.fsdp.shardings(params, mesh)).")
  return text


class _Release:
  __slots__ = ("_lock",)

  def __init__(self, lock: threading.Lock):
    self._lock = lock

  def __enter__(self) -> None:
    pass

  def __exit__(self, *exc: Any) -> None:
    self._lock.release()
