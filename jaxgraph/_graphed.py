"""`GraphedCallable`: replays one function's cached executables from the host.

Its parts: the callable's state (`Config` shared by one `make_graphed` call, `Counters`
behind `Stats`, a `rng.KeyStream`) and the replay of one forward executable, whose backward
is a `_pullback.Pullback`. Which executables a signature replays is its
`_cache.ExecutableCache`'s, which kept buffers go to host memory the `offload.Offloader`'s, which
argument leaves get gradients `_pullback`'s (`masked_leaves`, `masked_vjp`), and which hooks
fire in a phase `_hooks.by_phase`'s. What the rest of the package uses of a callable is
`_pullback.Owner`.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Callable, Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxgraph import _cache as cache_lib
from jaxgraph import _capture as capture_lib
from jaxgraph import _hooks as hooks_lib
from jaxgraph import _pullback as pullback_lib
from jaxgraph import _signature as sig_lib
from jaxgraph import flat as flat_lib
from jaxgraph import fsdp as fsdp_lib
from jaxgraph import offload as offload_lib
from jaxgraph import rng as rng_lib
from jaxgraph._pullback import Pullback

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
  # None for every float leaf (`_pullback.mask_flags`)
  grad_mask: Any = None
  # (function, signature, offload inside the executables) -> executables, shared by
  # identical callables
  cache: dict[Any, capture_lib.Executables] = dataclasses.field(default_factory=dict)
  # adjacent layers -> their FusedSegment (sequential_vjp(..., fuse=True)); a layer and
  # whether it is first -> its PrefetchStep (sequential_vjp(..., prefetch=True))
  segments: dict[tuple[Any, ...], Any] = dataclasses.field(default_factory=dict)
  # (a prefetching chain's steps, its first input signature) -> whether it prefetches
  prefetch: dict[tuple[Any, ...], bool] = dataclasses.field(default_factory=dict)
  # (a chain's layers, its params' layouts, fuse, prefetch) -> how sequential_vjp replays it
  # (`_chain._plan`: which layers fuse and prefetch, checked once, not on every call)
  plans: dict[tuple[Any, ...], Any] = dataclasses.field(default_factory=dict)
  # id -> closed-over weight a capture warned of (ConstantWeightWarning once per array)
  warned_weights: dict[int, Any] = dataclasses.field(default_factory=dict)
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@dataclasses.dataclass
class Counters:
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

  def snapshot(self, segments: list[Counters], residual_bytes: int,
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
               hooks: hooks_lib.Hooks, capture_time_hooks: hooks_lib.Hooks, offload: bool,
               name: str | None = None):
    self.fn = fn
    self.index = index
    self.name = name or f"{getattr(fn, '__name__', type(fn).__name__)}[{index}]"
    # Each replay shows up under these names in a jax.profiler trace (TensorBoard, Perfetto).
    self.trace_names = (f"jaxgraph {self.name} forward", f"jaxgraph {self.name} backward")
    self.config = config
    # What runs outside the executables (traced calls, the jax.jit fallback): the same math
    # as the captured executables, so under the same residual policy.
    self.uncaptured_fn = (fn if self.remat_policy is None else
                          jax.checkpoint(fn, policy=self.remat_policy, prevent_cse=False))
    self.phase_hooks = hooks_lib.by_phase(hooks, capture_time_hooks)
    self.offloader = offload_lib.Offloader(config.offload, enabled=offload)
    self.executables = cache_lib.ExecutableCache(self)
    self.counts = Counters()
    self._busy = threading.Lock()
    self._stream: rng_lib.KeyStream | None = None
    if config.rng:
      self.seed(jax.random.key(0))

  def __repr__(self) -> str:
    return f"GraphedCallable({self.name}, signatures={len(self.executables.entries)})"

  # ----------------------------------------------------------------------------- public API

  @property
  def stats(self) -> Stats:
    """Counters: captures, cache hits, compiles, compile seconds, replays, fallbacks.

    The captures and compiles of fused segments (`sequential_vjp(..., fuse=True)`) count on
    their first layer.
    """
    last = self.executables.last
    residual_bytes = offload_bytes = wgrad_bytes = 0
    if last is not None:
      residual_bytes = last.residual_bytes
      offload_bytes = self.offloader.nbytes(last.layout.buffers)
      wgrad_bytes = capture_lib.wgrad_bytes(last)
    return self.counts.snapshot([segment.counts for segment in self._led_segments()],
                                residual_bytes, offload_bytes, wgrad_bytes)

  @property
  def kept_buffers(self) -> tuple[offload_lib.Buffer, ...]:
    """The buffers one `vjp` keeps for its backward (kept residuals, the small ones packed by
    dtype), for the signature captured last; () before any capture.

    What `make_graphed(..., offload_min_bytes=, offload_names=)` select from, and what
    `jaxgraph.offload.plan` takes per layer to move part of each layer
    (`[b.nbytes for b in g.kept_buffers]`). They sum to `stats.residual_bytes`.
    """
    last = self.executables.last
    return () if last is None else last.layout.buffers

  def reset(self) -> None:
    """Drops this callable's executables, and those of fused segments it belongs to; its
    next call captures again (and counts anew)."""
    config = self.config
    with config.lock:
      dropped = [key for key in config.segments if self in key]
      segments = [config.segments.pop(key) for key in dropped]
      config.prefetch.clear()
    for segment in segments:
      segment.reset()
    self.executables.clear()
    self.offloader.clear()

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
    leaves, treedef = self.flatten(args, key, kwargs)
    if leaves is None:
      return self._call_traced(args, key)
    with self.exclusive():
      return self.forward(args, leaves, treedef, key, phase="replay",
                          iteration=self.counts.replays, microbatch=0, with_pullback=False)[0]

  def vjp(self, *args: Any, key: jax.Array | None = None,
          **kwargs: Any) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]:
    """Replays the forward; returns `(outputs, pullback)` like `jax.vjp`.

    Raises:
      TypeError: for a callable built with `make_graphed(..., inference_only=True)`, which
        has no backward.
    """
    self.require_backward("vjp")
    leaves, treedef = self.flatten(args, key, kwargs)
    if leaves is None:
      return self._vjp_traced(args, key)
    with self.exclusive():
      return self.forward(args, leaves, treedef, key, phase="replay",
                          iteration=self.counts.replays, microbatch=0, with_pullback=True)

  # ------------------------------------------ the package's interface (`_pullback.Owner`)

  def require_backward(self, caller: str) -> None:
    if self.config.inference_only:
      raise TypeError(
          f"{caller}: {self.name} was built with make_graphed(..., inference_only=True), so "
          "it has no backward executable and keeps no residuals. Call it for the outputs "
          "only (y = layer(*args)), or build it without inference_only=True to train it.")

  def exclusive(self) -> Any:
    if not self._busy.acquire(blocking=False):
      raise RuntimeError(
          f"{self.name} is already running in another thread. A GraphedCallable is not "
          "reentrant and not shared across threads (its key stream and counters would race); "
          "different GraphedCallables may run in different threads.")
    return _Release(self._busy)

  def flatten(self, args: tuple[Any, ...], key: Any, kwargs: dict[str, Any]
              ) -> tuple[list[Any] | None, Any]:
    if kwargs:
      raise TypeError(
          f"{self.name} got keyword arguments {sorted(kwargs)}; only positional arguments are "
          "captured" + (" (and key=)" if self.config.rng else "") + ". Pass them "
          "positionally, or bind them with functools.partial before make_graphed.")
    if key is not None and not self.config.rng:
      raise TypeError(f"{self.name} got key= but was built with rng=False; build it with "
                      "make_graphed(..., rng=True) to thread keys.")
    leaves, treedef = jax.tree.flatten(args)
    if any(isinstance(value, jax.core.Tracer) for value in (*leaves, key)):
      return None, treedef
    if key is not None:
      rng_lib.check_key(key, self.name)
    return leaves, treedef

  def count_replay(self, *, backward: bool) -> None:
    if backward:
      self.counts.backward_replays += 1
    else:
      self.counts.replays += 1

  def differentiated(self, signature: sig_lib.Signature) -> tuple[int, ...]:
    """The argument leaves of `signature` that get gradients (`_pullback.masked_leaves`)."""
    return pullback_lib.masked_leaves(signature, self.config.grad_mask)

  def forward(self, args: tuple[Any, ...], leaves: list[Any], treedef: Any, key: Any, *,
              phase: hooks_lib.Phase, iteration: int, microbatch: int, with_pullback: bool,
              stream: tuple[jax.Array, jax.Array] | None = None,
              signature: sig_lib.Signature | None = None) -> Any:
    """One forward: hooks, executable, pullback. `stream` overrides the key stream (warmup);
    `signature` is that of `leaves`, where the caller already has it."""
    if signature is None:
      signature = sig_lib.signature_of(leaves, treedef)
    entry = self.executables.get(signature)
    hooks = self.phase_hooks[phase]
    event = hooks_lib.HookEvent(self.index, phase, iteration, microbatch, args)
    if hooks.pre_forward:
      hooks_lib.fire(hooks.pre_forward, "pre_forward", event, self.name)
    if entry is None:
      result = self._fallback_forward(args, key, with_pullback, event)
    else:
      result = self._replay_forward(entry, leaves, key, with_pullback, event, stream)
    if phase == "replay":
      self.count_replay(backward=False)
    if hooks.forward:
      hooks_lib.fire(hooks.forward, "forward", dataclasses.replace(event, outputs=result[0]),
                     self.name)
    return result

  @property
  def n_keys(self) -> int:
    return 1 if self.config.rng else 0

  @property
  def remat_policy(self) -> Callable[..., bool] | None:
    """The residual policy applied around `fn` (a fused chain applies it per function)."""
    return self.config.remat_policy

  def twin(self, signature: sig_lib.Signature) -> Any:
    """The `_explicit.Twin` to trace `signature` on, or None: as it is (a prefetching step
    traces on the twin of its FSDP mesh)."""
    return None

  @property
  def warns_of_constant_keys(self) -> bool:
    """Whether a capture warns of keys that are constants of `fn` (a frozen dropout mask)."""
    return True

  def stream_inputs(self, stream: tuple[jax.Array, jax.Array] | None,
                    taken: Sequence[tuple[Any, Any, Any]] | None = None) -> list[jax.Array]:
    """(base, index, counter) for the stream forward; `stream` overrides base and counter;
    `taken`: the shardings the forward takes them in, a triple per stream (they are placed
    there)."""
    return self._stream.inputs(stream, None if taken is None else taken[0], fsdp_lib.place)

  def advance(self, counters: list[jax.Array]) -> None:
    (self._stream.counter,) = counters

  # ----------------------------------------------------------------------------- internals

  def _led_segments(self) -> list[Any]:
    return [segment for key, segment in self.config.segments.items() if key[0] is self]

  def _require_rng(self) -> None:
    if not self.config.rng:
      raise ValueError(f"{self.name} was built with rng=False; it has no key stream.")

  def _call_traced(self, args: tuple[Any, ...], key: Any) -> Any:
    # under the user's jax.grad too, no gradient where the mask says
    args = pullback_lib.stop_masked(args, self.config.grad_mask)
    args = flat_lib.unravel(args)  # as inside a capture: fn sees its own pytrees
    if self.config.rng:
      if key is None:
        raise TypeError(f"{self.name} was called under a JAX transformation without key=; "
                        "its own stream lives outside traces, so pass key= explicitly.")
      return self.uncaptured_fn(*args, key=key)
    return self.uncaptured_fn(*args)

  def _vjp_traced(self, args: tuple[Any, ...], key: Any) -> Any:
    return pullback_lib.masked_vjp(lambda *a: self._call_traced(a, key), args,
                                   self.config.grad_mask)

  def _replay_forward(self, entry: capture_lib.Executables, leaves: list[Any], key: Any,
                      with_pullback: bool, event: hooks_lib.HookEvent,
                      stream: tuple[jax.Array, jax.Array] | None) -> Any:
    layout = entry.layout
    stream_mode = layout.n_keys > 0 and key is None
    kind: capture_lib.ForwardKind = "stream" if stream_mode else "explicit"
    inputs = leaves if key is None else leaves + (list(key) if layout.n_keys > 1 else [key])
    exe, seconds = capture_lib.forward_executable(entry, kind, residuals=with_pullback)
    if seconds:
      self.counts.compiled(1, seconds)
    taken = _stream_shardings(exe, layout.n_keys) if stream_mode else None
    exe = self.executables.local(entry, exe)
    try:
      with jax.profiler.TraceAnnotation(self.trace_names[0]):
        values = (exe(*self.stream_inputs(stream, taken), *inputs) if stream_mode
                  else exe(*inputs))
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
    to_host = self.offloader.to_host.get(entry.signature, ()) if with_pullback else ()
    if to_host:
      offload_lib.start_to_host_in(kept, to_host)
    if stream_mode and stream is None:  # the key is spent only once nothing can fail
      self.advance(counters)
    if not with_pullback:
      return (jax.tree.unflatten(layout.out_treedef, values),)
    backward = pullback_lib.ExecutableBackward(
        self, entry, needed_inputs=[inputs[i] for i in layout.needed_inputs],
        needed_outputs=[outs[i] for i in layout.needed_outputs], kept=kept, on_host=to_host,
        placements=sig_lib.respelled(leaves, layout.diff))
    hooks = self.phase_hooks[event.phase]
    if not (hooks.pre_backward or hooks.backward):
      # Without backward hooks nobody reads the args again: don't keep them alive.
      event = hooks_lib.HookEvent(event.index, event.phase, event.iteration, event.microbatch, ())
    return jax.tree.unflatten(layout.out_treedef, outs), Pullback(self, event, backward)

  def _fallback_forward(self, args: tuple[Any, ...], key: Any, with_pullback: bool,
                        event: hooks_lib.HookEvent) -> Any:
    jitted = self.executables.fallback
    from_stream = self.config.rng and key is None
    if self.config.rng:
      if from_stream:
        base, index, counter = _beside(args, self._stream.inputs())
        key = rng_lib.derive_key(base, index, counter)
      fn = lambda *a: jitted(*a, key=key)
    else:
      fn = jitted
    if not with_pullback:
      result = (fn(*args),)
    else:
      out, vjp_fn = pullback_lib.masked_vjp(fn, args, self.config.grad_mask)
      result = out, Pullback(self, event, lambda ct: (vjp_fn(ct), None))
    # Counted (and the stream advanced) only once the call succeeded.
    self.counts.fallbacks += 1
    if from_stream:
      self._stream.counter = counter + jnp.uint32(1)
    return result


class LayerGroup(GraphedCallable):
  """Adjacent layers replayed as one step (a fused segment, a prefetching step): `fn` runs
  them all, each on its own key stream and counter, so a group's replay draws what the
  layers would one by one. Replays are counted on the group and on every layer."""

  def __init__(self, layers: Sequence[GraphedCallable], fn: Callable[..., Any], *,
               offload: bool, name: str):
    first = layers[0]
    self._layers = tuple(layers)
    super().__init__(fn, first.index, first.config, hooks=hooks_lib.NO_HOOKS,
                     capture_time_hooks=hooks_lib.NO_HOOKS, offload=offload, name=name)

  @property
  def n_keys(self) -> int:
    return len(self._layers) if self.config.rng else 0

  def stream_inputs(self, stream: tuple[jax.Array, jax.Array] | None,
                    taken: Sequence[tuple[Any, Any, Any]] | None = None) -> list[jax.Array]:
    return [value for i, layer in enumerate(self._layers)
            for value in layer.stream_inputs(stream, None if taken is None
                                             else taken[i:i + 1])]

  def advance(self, counters: list[jax.Array]) -> None:
    for layer, counter in zip(self._layers, counters):
      layer.advance([counter])

  def count_replay(self, *, backward: bool) -> None:
    super().count_replay(backward=backward)
    for layer in self._layers:
      layer.count_replay(backward=backward)


def _beside(args: tuple[Any, ...], values: list[jax.Array]) -> list[jax.Array]:
  """`values` replicated on the devices of the first committed array of `args`, where they
  are elsewhere: a key the fallback's jit derives from them must sit with its arguments (a
  replay over a mesh leaves the stream's counter there)."""
  committed = next((leaf for leaf in jax.tree.leaves(args)
                    if isinstance(leaf, jax.Array) and leaf.committed), None)
  if committed is None:
    return values
  sharding = committed.sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  elif not isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return values
  return [value if value.sharding.device_set == sharding.device_set
          else fsdp_lib.place(value, sharding) for value in values]


# compiled stream forward -> the shardings it takes each stream's (base, index, counter) in
_taken: weakref.WeakKeyDictionary[Any, list[tuple[Any, Any, Any]]] = (
    weakref.WeakKeyDictionary())


def _stream_shardings(exe: Any, n_keys: int) -> list[tuple[Any, Any, Any]]:
  """The shardings a compiled stream forward takes its `n_keys` streams' inputs in (its
  first `3 * n_keys` arguments), a triple per stream, read once per executable (the same
  triples every call: `KeyStream.inputs` knows them by identity)."""
  found = _taken.get(exe)
  if found is None:
    flat = jax.tree.leaves(exe.input_shardings)[:3 * n_keys]
    found = _taken[exe] = [tuple(flat[i:i + 3]) for i in range(0, 3 * n_keys, 3)]
  return found


class _Release:
  __slots__ = ("_lock",)

  def __init__(self, lock: threading.Lock):
    self._lock = lock

  def __enter__(self) -> None:
    pass

  def __exit__(self, *exc: Any) -> None:
    self._lock.release()
