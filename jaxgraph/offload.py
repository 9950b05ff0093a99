"""Residual offload: which kept residuals move to host memory, how, and which layers to pick.

An offloaded layer's forward keeps some of its residuals in `pinned_host` memory until its
backward. `Policy` says which ones (by size, by `checkpoint_name`) and how they travel:

* `"async"` (the default): the executables are those of a layer without offload. The host
  starts each copy to `pinned_host` as soon as the forward is enqueued and drops the device
  array (the runtime keeps it until the copy has read it), and starts the copy back one
  layer ahead of the backward (`Pullback.prefetch`). Both run on the runtime's transfer
  streams, so they overlap the next layers' compute.
* `"executable"`: the forward executable writes the residuals to `pinned_host` and the
  backward executable copies them back before any compute reads them; each copy is serial
  with its executable.

`Offloader` applies a policy to one layer: which kept buffers of each signature it captured go
to host memory, and in async mode the copies there, started as each forward replay returns.

`plan` picks the layers, and the buffers of each, whose copies hide behind compute, from
measured link speeds (`measure_link`), per-layer times and each layer's kept buffers.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import typing
import warnings
from typing import Any, Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp

# What docs/api.md shows; the copy helpers are the library's own.
__all__ = ["Buffer", "Link", "Plan", "Policy", "measure_link", "plan", "predict_seconds"]

Mode = Literal["async", "executable"]
MODES: tuple[Mode, ...] = typing.get_args(Mode)


class Buffer(NamedTuple):
  """One buffer a forward keeps for its backward: a residual, or small ones packed together.

  Attributes:
    nbytes: its size.
    name: the `jax.ad_checkpoint.checkpoint_name` of the residual; None when it has none,
      or for a buffer of packed residuals.
  """

  nbytes: int
  name: str | None


@dataclasses.dataclass(frozen=True)
class Policy:
  """Which kept buffers of an offloaded layer move to host memory, and how.

  Attributes:
    mode: "async" (host-issued copies that overlap compute) or "executable" (copies inside
      the forward and backward executables).
    min_bytes: offload only buffers of at least this many bytes.
    names: offload only residuals named one of these with `checkpoint_name`; None: named
      or not. With both, a buffer must pass both.
  """

  mode: Mode = "async"
  min_bytes: int = 0
  names: frozenset[str] | None = None

  def select(self, buffers: Sequence[Buffer]) -> tuple[int, ...]:
    """The positions of the buffers this policy offloads."""
    return tuple(i for i, b in enumerate(buffers)
                 if b.nbytes >= self.min_bytes and (self.names is None or b.name in self.names))


# ------------------------------------------------------------------- copies inside executables


def to_host(x: jax.Array) -> jax.Array:
  """Inside a forward executable: place a residual in host memory."""
  return jax.device_put(x, jax.memory.Space.Host)


def to_device(x: jax.Array) -> jax.Array:
  """Inside a backward executable: bring a residual back before any compute reads it.

  Without this XLA compiles the backward's reads of a host buffer into host compute.
  """
  return jax.device_put(x, jax.memory.Space.Device)


# ---------------------------------------------------------------------- copies from the host


def start_to_host(arrays: Sequence[jax.Array]) -> list[jax.Array]:
  """Starts copying device arrays to pinned host memory; returns the host arrays at once.

  One batched `jax.device_put` between memory kinds of the same devices: the runtime enqueues
  the copies behind whatever computes the arrays, and keeps each source alive until its copy
  has read it, so the caller drops the device arrays right away.
  """
  return jax.device_put(list(arrays),
                        [a.sharding.with_memory_kind("pinned_host") for a in arrays])


def start_to_device(arrays: Sequence[jax.Array]) -> list[jax.Array]:
  """Starts copying host arrays back to device memory; returns the device arrays at once (an
  executable reading one waits for its copy)."""
  return jax.device_put(list(arrays), [a.sharding.with_memory_kind("device") for a in arrays])


class Offloader:
  """One layer's offload: which kept buffers of each captured signature go to host memory,
  and in async mode the copies there (the copies back: `Pullback.prefetch`).

  Attributes:
    policy: the policy of the layer's `make_graphed` call.
    enabled: whether this layer offloads at all (`offload_residuals`).
    to_host: signature -> the positions of the kept buffers its forward replays copy to host
      memory (async mode).
  """

  def __init__(self, policy: Policy, *, enabled: bool):
    self.policy = policy
    self.enabled = enabled
    self.to_host: dict[Any, tuple[int, ...]] = {}

  @property
  def in_executables(self) -> bool:
    """Whether the executables copy (executable mode). Async offload leaves them as without
    offload, so layers with and without it share them."""
    return self.enabled and self.policy.mode == "executable"

  def selected(self, buffers: Sequence[Buffer]) -> tuple[int, ...]:
    """The positions of the kept `buffers` this layer offloads (by either mode)."""
    return self.policy.select(buffers) if self.enabled else ()

  def nbytes(self, buffers: Sequence[Buffer]) -> int:
    """The bytes of the kept `buffers` this layer keeps in host memory."""
    return sum(buffers[i].nbytes for i in self.selected(buffers))

  def captured(self, signature: Any, buffers: Sequence[Buffer], *, owner: str) -> None:
    """Takes in the kept `buffers` of a signature `owner` just captured: warns where
    `policy.names` names none of them, and notes the copies its replays start."""
    names = self.policy.names
    if self.enabled and names is not None and not any(b.name in names for b in buffers):
      warnings.warn(
          f"{owner}: offload_names={sorted(names)} names no residual this layer keeps, so "
          "it offloads nothing. Names are read from checkpoint_name calls in the function "
          "itself (not inside a nested jax.jit); check the spelling, or pass "
          "offload_names=None to offload every residual.", stacklevel=6)
    if self.policy.mode == "async":
      self.to_host[signature] = self.selected(buffers)

  def clear(self) -> None:
    self.to_host.clear()


def start_to_host_in(kept: list[jax.Array], positions: tuple[int, ...]) -> None:
  """Starts copying `kept[i]` to pinned host memory for each of `positions`, replacing each
  by its host array. Started as the forward returns, the copies run while the next layers
  compute; nothing holds the device arrays after, and the runtime frees each once its copy
  has read it."""
  for i, array in zip(positions, start_to_host([kept[i] for i in positions])):
    kept[i] = array


def check_backend_supports_offload() -> None:
  """Raises a clear error when the default backend has no pinned host memory."""
  device = jax.devices()[0]
  kinds = {m.kind for m in device.addressable_memories()}
  if "pinned_host" not in kinds:
    raise ValueError(
        f"offload_residuals=True needs a 'pinned_host' memory kind, but {device.platform} "
        f"device {device} has only {sorted(kinds)}. Use offload_residuals=False on this "
        "backend.")


# ------------------------------------------------------------------------------- planning


class Link(NamedTuple):
  """Measured copy speeds between device and pinned host memory, in bytes per second."""

  to_host: float
  to_device: float


def measure_link(nbytes: int = 1 << 30, *, repeats: int = 5) -> Link:
  """Times `start_to_host` and `start_to_device` of one `nbytes` buffer on the default device
  (the copies async offload issues); the median of `repeats`, each waited for alone."""
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  seconds: dict[str, list[float]] = {"to_host": [], "to_device": []}
  for _ in range(repeats + 1):  # the first round allocates host memory: not counted
    jax.block_until_ready(x)
    start = time.perf_counter()
    (host,) = jax.block_until_ready(start_to_host([x]))
    middle = time.perf_counter()
    jax.block_until_ready(start_to_device([host]))
    seconds["to_host"].append(middle - start)
    seconds["to_device"].append(time.perf_counter() - middle)
  return Link(*(nbytes / statistics.median(s[1:]) for s in seconds.values()))


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `plan` offloads, and why.

  Attributes:
    flags: one bool per layer, for `make_graphed(..., offload_residuals=flags)`.
    min_bytes: for `make_graphed(..., offload_min_bytes=min_bytes)`: an offloaded layer moves
      its kept buffers of at least this many bytes; 0 moves them all (whole layers).
    moved_bytes: per layer, the bytes it moves (0 for a layer not offloaded).
    offloaded_bytes: residual bytes per step that leave the device (`sum(moved_bytes)`).
    resident_bytes: residual bytes that stay.
    compute_seconds: the step's forwards and backwards without offload.
    predicted_seconds: the step with these copies, as `predict_seconds` models it.
    reason: what decided the choice, in words.
  """

  flags: tuple[bool, ...]
  min_bytes: int
  moved_bytes: tuple[int, ...]
  offloaded_bytes: int
  resident_bytes: int
  compute_seconds: float
  predicted_seconds: float
  reason: str

  def __str__(self) -> str:
    n = sum(self.flags)
    part = (f", of each its kept buffers of at least {_size(self.min_bytes)}"
            if self.min_bytes and n else "")
    # The model never predicts a step faster than its compute: max() drops a rounding -0.0%.
    slower = max(self.predicted_seconds / self.compute_seconds - 1, 0.0)
    return (f"offload {n} of {len(self.flags)} layers (the first {n}){part}: "
            f"{_size(self.offloaded_bytes)} to host, {_size(self.resident_bytes)} stay; "
            "predicted step "
            f"{self.predicted_seconds * 1e3:.1f} ms vs {self.compute_seconds * 1e3:.1f} ms "
            f"without offload ({slower:+.1%}). {self.reason}")


def predict_seconds(flags: Sequence[bool], residual_bytes: Sequence[int],
                    forward_seconds: Sequence[float], backward_seconds: Sequence[float],
                    link: Link) -> float:
  """The step time of async offload, modelled: one copy stream each way, in issue order.

  Layer i's copy out starts once its forward and the previous copy out are done; its copy
  back starts when the backward of layer i + 1 starts (the prefetch), once its copy out and
  the previous copy back are done; its backward waits for it. Compute is not slowed by the
  copies (they share the device's memory bandwidth: a lower bound).
  """
  clock, out_free, out_done = 0.0, 0.0, {}
  for i, offloaded in enumerate(flags):
    clock += forward_seconds[i]
    if offloaded:
      out_free = out_done[i] = max(out_free, clock) + residual_bytes[i] / link.to_host
  in_free, issue = 0.0, clock
  for i in reversed(range(len(flags))):
    start = clock
    if flags[i]:
      in_free = max(in_free, issue, out_done[i]) + residual_bytes[i] / link.to_device
      start = max(clock, in_free)
    issue, clock = start, start + backward_seconds[i]
  return clock


def plan(residual_bytes: Sequence[int | Sequence[int]], forward_seconds: Sequence[float],
         backward_seconds: Sequence[float], link: Link, *, budget_bytes: int | None = None,
         max_slowdown: float | None = None) -> Plan:
  """Picks what to offload: the first n layers (the backward needs the last ones first), and
  of each, every kept buffer or only those of at least some size.

  Moving part of every layer can hide copies that whole layers cannot: a layer's copy out
  overlaps the next layers' forwards and its copy back the backward of the layer above, so
  what hides is bounded by the compute each copy runs beside. The plan tries every
  (n, size) pair, the sizes being those of the layers' buffers, and models each with
  `predict_seconds`. Give exactly one goal: `budget_bytes`, the residual bytes that may stay
  on device (the fastest plan that meets it; of equally fast ones, the one moving the
  fewest bytes), or `max_slowdown`, a fraction of the step time the copies may add (the plan
  moving the most bytes within it; of those, the fastest).

  Args:
    residual_bytes: per layer, what its forward keeps: the sizes of its kept buffers
      (`[b.nbytes for b in g.kept_buffers]`), or one int, its offloadable bytes
      (`Stats.offload_bytes` of a layer built with `offload_residuals=True`), moved whole.
      Where any layer is given as an int, every layer moves whole (`min_bytes` 0).
    forward_seconds: per layer, its forward's device time.
    backward_seconds: per layer, its backward's device time.
    link: copy speeds (`measure_link`).
    budget_bytes: the device-memory budget for residuals.
    max_slowdown: e.g. 0.05 for at most 5% slower.

  Returns:
    The `Plan`; `str(plan)` reports it.
  """
  layers = len(residual_bytes)
  if len(forward_seconds) != layers or len(backward_seconds) != layers:
    raise ValueError(f"plan got {layers} residual sizes but {len(forward_seconds)} forward "
                     f"and {len(backward_seconds)} backward times; give one of each per layer.")
  if (budget_bytes is None) == (max_slowdown is None):
    raise ValueError("plan takes exactly one goal: budget_bytes=(residual bytes allowed on "
                     "device) or max_slowdown=(a fraction, e.g. 0.05).")
  goal = budget_bytes if budget_bytes is not None else max_slowdown
  if goal < 0:
    raise ValueError(f"plan got {'budget_bytes' if budget_bytes is not None else 'max_slowdown'}"
                     f"={goal}; it must be >= 0.")
  whole = any(not isinstance(b, Sequence) for b in residual_bytes)
  buffers = [tuple(int(s) for s in b) if isinstance(b, Sequence) else (int(b),)
             for b in residual_bytes]
  total = sum(map(sum, buffers))
  compute = sum(forward_seconds) + sum(backward_seconds)
  # Every size a buffer has: moving those of at least `size` is one choice per layer. The
  # smallest moves every buffer: min_bytes 0.
  sizes = sorted({s for layer in buffers for s in layer}, reverse=True)
  thresholds = [0] if whole or len(sizes) <= 1 else [*sizes[:-1], 0]

  def candidate(n: int, min_bytes: int) -> Plan:
    moved = tuple(sum(s for s in layer if s >= min_bytes) if i < n else 0
                  for i, layer in enumerate(buffers))
    flags = tuple(i < n for i in range(layers))
    return Plan(flags, min_bytes if n else 0, moved, sum(moved), total - sum(moved), compute,
                predict_seconds(flags, moved, forward_seconds, backward_seconds, link), "")

  candidates = [candidate(0, 0)] + [candidate(n, t) for t in thresholds
                                    for n in range(1, layers + 1)]
  if budget_bytes is not None:
    # Offloading every buffer of every layer leaves 0 bytes: some candidate always fits.
    best = min((c for c in candidates if c.resident_bytes <= budget_bytes),
               key=lambda c: (c.predicted_seconds, c.offloaded_bytes))
    return dataclasses.replace(best, reason=(
        f"The fastest choice that leaves at most {_size(budget_bytes)} of "
        f"offloadable residuals on device{_per_layer(best, forward_seconds, link)}"))
  limit = compute * (1 + max_slowdown)
  best = max((c for c in candidates if c.predicted_seconds <= limit),
             key=lambda c: (c.offloaded_bytes, -c.predicted_seconds))
  return dataclasses.replace(best, reason=(
      f"The most bytes whose copies keep the step within {max_slowdown:.0%} of "
      f"{compute * 1e3:.1f} ms{_per_layer(best, forward_seconds, link)}"))


def _per_layer(chosen: Plan, forward_seconds: Sequence[float], link: Link) -> str:
  """The first offloaded layer's copy out against its forward, for `Plan.reason`."""
  if not chosen.offloaded_bytes:
    return "."
  i = chosen.flags.index(True)
  return (f": layer {i} moves {_size(chosen.moved_bytes[i])}, "
          f"{chosen.moved_bytes[i] / link.to_host * 1e3:.2f} ms to host beside a "
          f"{forward_seconds[i] * 1e3:.2f} ms forward.")


def _size(nbytes: float) -> str:
  return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
