"""One callable's executables, per input signature: found, captured, shared, or none.

`ExecutableCache.get` finds a signature's executables: this callable's, an identical
callable's (the `make_graphed` call's shared cache: identical layers compile once), or
captured now; past `max_captures` none, and the callable runs its `jax.jit` fallback. A
capture after the first says so on the `jaxgraph` logger (docs/semantics.md#signatures).
`local` picks the copy of an executable a callable replays (`per_layer_executables`).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Callable

import jax

from jaxgraph import _capture as capture_lib
from jaxgraph import _pullback as pullback_lib
from jaxgraph import _signature as sig_lib
from jaxgraph import flat as flat_lib

logger = logging.getLogger("jaxgraph")


class ExecutableCache:
  """The executables one callable replays, per signature (its `make_graphed` call's
  `Config.cache` holds the same entries, shared with identical callables)."""

  def __init__(self, owner: pullback_lib.Owner):
    self._owner = owner
    self.entries: dict[sig_lib.Signature, capture_lib.Executables] = {}
    self._own: set[Any] = set()  # cache keys this callable captured (`clear` drops them)
    self.replayed: dict[Any, Any] = {}  # a shared executable -> the one this callable runs
    self.fallback: Callable[..., Any] | None = None  # past max_captures: jax.jit of fn

  @property
  def last(self) -> capture_lib.Executables | None:
    """The executables of the signature captured last; None before any capture."""
    return next(reversed(self.entries.values()), None)

  def clear(self) -> None:
    """Forgets every signature, and drops those this callable captured from the shared
    cache: the next call captures again."""
    config = self._owner.config
    with config.lock:
      for key in self._own:
        config.cache.pop(key, None)
    self.entries.clear()
    self._own.clear()
    self.replayed.clear()
    self.fallback = None

  def get(self, signature: sig_lib.Signature, *, sampled: bool = False
          ) -> capture_lib.Executables | None:
    """The executables for `signature`: cached, captured now, or None (fallback). `sampled`:
    a signature of the sample_args, which make_graphed captures (neither an error nor a log)."""
    entry = self.entries.get(signature)
    if entry is not None:
      return entry
    owner, config = self._owner, self._owner.config
    captured = [] if sampled else list(self.entries)
    if captured and config.on_new_signature == "error":
      raise TypeError(
          f"{owner.name} was called with a signature it did not capture "
          f"(on_new_signature='error'):\n{_new_signature(captured, signature)}\n"
          "Pass arguments like the sample_args, or build with on_new_signature='capture'.")
    if len(self.entries) >= config.max_captures:
      if self.fallback is None:
        warnings.warn(
            f"{owner.name} has captured max_captures={config.max_captures} signatures; calls "
            "with new signatures now run through jax.jit (no hooks are lost, but each new "
            "signature compiles). Raise max_captures, or keep argument shapes fixed.",
            stacklevel=4)
        self.fallback = jax.jit(flat_lib.unravelling(owner.uncaptured_fn),
                                donate_argnums=config.donate_argnums)
      return None
    before = dataclasses.replace(owner.counts)  # a copy: what this capture adds to it
    entry = self._capture(signature)
    if (captured and owner.counts.captures > before.captures  # compiled here: no cache hit
        and logger.isEnabledFor(logging.WARNING)):
      self._log_new_signature(captured, signature,
                              owner.counts.compile_seconds - before.compile_seconds)
    return entry

  def local(self, entry: capture_lib.Executables, exe: Any) -> Any:
    """The executable the callable replays for `exe` of `entry`: `exe` itself, or with
    `per_layer_executables` a loaded copy of its own where an identical callable captured
    `entry` (and replays `exe` itself)."""
    local = self.replayed.get(exe)
    if local is None:
      captured_here = self._key(entry.signature) in self._own
      local = (capture_lib.loaded_copy(exe)
               if self._owner.config.per_layer_executables and not captured_here else exe)
      self.replayed[exe] = local
    return local

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
        self._owner.name, len(self.entries), self._owner.config.max_captures, seconds,
        _new_signature(captured, signature))

  def _key(self, signature: sig_lib.Signature) -> tuple[Any, ...]:
    return (self._owner.fn, signature, self._owner.offloader.in_executables)

  def _capture(self, signature: sig_lib.Signature) -> capture_lib.Executables:
    owner, config = self._owner, self._owner.config
    cache_key = self._key(signature)
    with config.lock:
      entry = config.cache.get(cache_key)
      if entry is None:
        try:
          if config.inference_only:
            entry = capture_lib.capture_inference(
                owner.fn, signature, n_keys=owner.n_keys, name=owner.name,
                donated=pullback_lib.argument_leaves(signature.treedef,
                                                     config.donate_argnums),
                warned_weights=config.warned_weights,
                compiler_options=config.compiler_options)
          else:
            diff = owner.differentiated(signature)
            entry = capture_lib.capture(
                owner.fn, signature, n_keys=owner.n_keys, diff=diff,
                backward=pullback_lib.backward_kinds(
                    diff, signature.treedef, delay_wgrad=config.delay_wgrad,
                    wgrad_argnums=config.wgrad_argnums),
                offload=config.offload if cache_key[-1] else None,
                remat_policy=owner.remat_policy, name=owner.name,
                loose_names=config.offload.names is not None,
                warn_constant_keys=owner.warns_of_constant_keys,
                warned_weights=config.warned_weights, twin=owner.twin(signature),
                compiler_options=config.compiler_options)
        except Exception as e:
          e.add_note(f"while capturing {owner.name} for a new input signature: "
                     f"{sig_lib.describe(signature)}")
          raise
        config.cache[cache_key] = entry
        self._own.add(cache_key)
        owner.counts.captures += 1
        owner.counts.compiled(entry.compiles, entry.compile_seconds)
      else:
        owner.counts.cache_hits += 1
    self.entries[signature] = entry
    owner.offloader.captured(signature, entry.layout.buffers, owner=owner.name)
    return entry


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
