"""PRNG keys: validation and per-callable streams (`stream_key`: the key a replay draws)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["stream_key"]

# Warmup draws from its own stream so that no user-visible stream advances before step 0.
_WARMUP_SEED = 0x5EED


def is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def check_key(key: Any, owner: str) -> None:
  """Typed keys only: a legacy `uint32[2]` key gets an error that names the fix."""
  if is_key(key):
    if key.shape != ():
      raise TypeError(f"{owner} takes one key (shape ()), got a key array of shape {key.shape}; "
                      "index or split it first.")
    return
  shape = getattr(key, "shape", None)
  dtype = getattr(key, "dtype", None)
  if shape == (2,) and dtype == np.uint32:
    raise TypeError(f"{owner} got a raw uint32[2] key (jax.random.PRNGKey). jaxgraph takes "
                    "typed keys: use jax.random.key(seed), or wrap the old one with "
                    "jax.random.wrap_key_data(key).")
  raise TypeError(f"{owner} takes key= a typed PRNG key (jax.random.key), got {key!r}.")


def derive_key(base: jax.Array, index: jax.Array, counter: jax.Array) -> jax.Array:
  """The key of one replay in a stream; traced inside the forward executable."""
  return jax.random.fold_in(jax.random.fold_in(base, index), counter)


@dataclasses.dataclass(eq=False)  # holds key arrays: no elementwise ==
class KeyStream:
  """One callable's key stream: draw n is `derive_key(base, index, counter + n)`, derived
  inside the forward executable, which also returns the next counter (kept on the device:
  a host-side draw would cost a dispatch per replay).

  Attributes:
    base: the stream's base key.
    index: the callable's index, a uint32 scalar.
    counter: the next draw, a uint32 scalar (an array the last forward returned).
    placed: base and index placed where a forward takes them, per (base's, index's)
      sharding: placed once there (an argument placed otherwise, a single-device key given
      to an executable over a mesh, costs a copy to every device on every call).
  """

  base: jax.Array
  index: jax.Array
  counter: jax.Array
  placed: dict[tuple[Any, Any], tuple[jax.Array, jax.Array]] = dataclasses.field(
      default_factory=dict)
  # (the `taken` triple, the counter sharding found fit for it, its placed base and index):
  # a replay of the forward that ran last, given the counter it returned, checks nothing
  _last: tuple[Any, Any, tuple[jax.Array, jax.Array]] | None = dataclasses.field(
      default=None, repr=False)

  def inputs(self, override: tuple[jax.Array, jax.Array] | None = None,
             taken: tuple[Any, Any, Any] | None = None,
             place: Callable[[jax.Array, Any], jax.Array] | None = None) -> list[jax.Array]:
    """(base, index, counter) for a stream forward; `override` replaces base and counter
    (warmup draws from a stream of its own). With `taken` (the shardings the forward takes
    the three in) and `place` (`jaxgraph.fsdp.place`, which also places across processes):
    placed there, base and index once per placement, the counter where it is elsewhere (the
    last forward ran on other devices)."""
    if override is not None:
      return [override[0], self.index, override[1]]
    if taken is None or place is None:
      return [self.base, self.index, self.counter]
    counter, last = self.counter, self._last
    if last is not None and last[0] is taken and counter.sharding is last[1]:
      return [*last[2], counter]
    base_at, index_at, counter_at = taken
    found = self.placed.get((base_at, index_at))
    if found is None:
      found = self.placed[base_at, index_at] = (place(self.base, base_at),
                                                place(self.index, index_at))
    if not _same(counter.sharding, counter_at, counter.ndim):
      counter = place(counter, counter_at)
    self._last = (taken, counter.sharding, found)
    return [*found, counter]


def _same(a: Any, b: Any, ndim: int) -> bool:
  return a is b or a == b or a.is_equivalent_to(b, ndim)


def stream_key(index: int, counter: int, base: jax.Array) -> jax.Array:
  """The key callable `index` draws from its stream at `counter`, for a reference built
  outside jaxgraph (a whole-step `jax.jit`) to reproduce a graphed run's dropout bit for bit.

  Without `key=`, replay n of the callable at position `index` of its `make_graphed` call,
  seeded with `base` (`rng=` or `g.seed(base, counter=c)`), draws
  `stream_key(index, c + n, base)`: `fold_in(fold_in(base, index), c + n)`. Warmup draws
  from a stream of its own, so replay 0 is the first draw of the user's stream.
  """
  return derive_key(base, jnp.uint32(index), jnp.uint32(counter))


def key_spec() -> jax.ShapeDtypeStruct:
  key = jax.random.key(0)
  return jax.ShapeDtypeStruct(key.shape, key.dtype)


def warmup_base() -> jax.Array:
  return jax.random.key(_WARMUP_SEED)
