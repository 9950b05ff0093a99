"""Small layer functions and the plain-JAX reference the graphed results are compared with."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax


def counting(fn: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[[], int]]:
  """`fn` wrapped to count its calls (for a graphed function: its traces), and a reader of
  the count."""
  calls = 0

  def counted(*args: Any, **kwargs: Any) -> Any:
    nonlocal calls
    calls += 1
    return fn(*args, **kwargs)

  counted.__name__ = fn.__name__  # graphed under fn's name
  return counted, lambda: calls


def devices_for(n: int, platform: str | None = None) -> list[jax.Device]:
  """The devices a test that needs `n` of one platform runs on (`@pytest.mark.devices(n)`).

  Args:
    n: how many devices the test needs.
    platform: None for the default backend's devices when there are `n`, else the CPU
      backend's (8 virtual devices, set up by tests/conftest.py): the multi-device tests
      check plumbing (placement, shardings, collectives in the HLO), which CPU devices show
      as well, so they still run next to one GPU. "cpu" for the CPU backend's only.

  Returns:
    Every device of the platform chosen, or [] when none has `n` (the test is skipped).
  """
  for name in [platform] if platform else [None, "cpu"]:
    try:
      devices = jax.devices(name)
    except RuntimeError:  # that backend is not started (JAX_PLATFORMS)
      continue
    if len(devices) >= n:
      return devices
  return []


def mlp(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  return x + jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def attention(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  """Single-head causal self-attention with a residual, on (T, D) inputs."""
  q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
  logits = (q @ k.T).astype(jnp.float32) / jnp.sqrt(jnp.float32(q.shape[-1]))
  mask = jnp.tril(jnp.ones(logits.shape, bool))
  weights = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1).astype(x.dtype)
  return x + (weights @ v) @ p["wo"]


def dropout_mlp(p: dict[str, jax.Array], x: jax.Array, *, key: jax.Array) -> jax.Array:
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  keep = jax.random.bernoulli(key, 0.8, h.shape)
  return x + jnp.where(keep, h / 0.8, 0).astype(h.dtype) @ p["w2"]


def masked_block(p: dict[str, jax.Array], x: jax.Array, positions: jax.Array, mask: jax.Array,
                 *, key: jax.Array) -> jax.Array:
  """A block with per-step inputs besides `x`: int32 `positions` (T,) and an additive float
  attention `mask` (T, T); then `dropout_mlp`."""
  x = x + jnp.cos(0.1 * positions.astype(x.dtype))[:, None]
  logits = (x @ x.T) / x.shape[-1] + mask
  return dropout_mlp(p, x + jax.nn.softmax(logits, axis=-1) @ x, key=key)


def carry_block(p: dict[str, jax.Array], carry: tuple[jax.Array, jax.Array],
                positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A block whose activation is a tuple `(h, aux)`: `aux` accumulates a per-layer loss."""
  h, aux = carry
  h = mlp(p, h + jnp.sin(positions.astype(h.dtype))[:, None])
  return h, aux + jnp.mean(h ** 2)


def causal_mask(t: int) -> jax.Array:
  return jnp.where(jnp.tril(jnp.ones((t, t), bool)), 0.0, -1e9).astype(jnp.float32)


def init_mlp(key: jax.Array, d: int, h: int, dtype: Any = jnp.float32) -> dict[str, jax.Array]:
  k1, k2 = jax.random.split(key)
  return dict(w1=(jax.random.normal(k1, (d, h)) / d ** 0.5).astype(dtype),
              b1=jnp.zeros((h,), dtype),
              w2=(jax.random.normal(k2, (h, d)) / h ** 0.5).astype(dtype))


def init_attention(key: jax.Array, d: int, dtype: Any = jnp.float32) -> dict[str, jax.Array]:
  ks = jax.random.split(key, 4)
  return {name: (jax.random.normal(k, (d, d)) / d ** 0.5).astype(dtype)
          for name, k in zip(("wq", "wk", "wv", "wo"), ks)}


def reference_stack(fns: Sequence[Callable[..., Any]], params: Sequence[Any], x: Any,
                    ct: Any, keys: Sequence[jax.Array] | None = None,
                    consts: tuple[Any, ...] = ()):
  """Forward and backward through `jax.vjp` under plain `jax.jit`, one layer at a time;
  `f(p, x, *consts[, key=k])`, the consts arguments of the jitted forward (not constants)."""
  fwd = jax.jit(lambda f, p, x, c, k: jax.vjp(lambda p, x: f(p, x, *c, key=k) if k is not None
                                              else f(p, x, *c), p, x), static_argnums=0)
  bwd = jax.jit(lambda v, g: v(g))
  pullbacks = []
  for i, (f, p) in enumerate(zip(fns, params)):
    x, v = fwd(f, p, x, consts, None if keys is None else keys[i])
    pullbacks.append(v)
  y, grads = x, [None] * len(fns)
  for i in reversed(range(len(fns))):
    grads[i], ct = bwd(pullbacks[i], ct)
  return y, grads, ct


def trees_equal(a: Any, b: Any) -> bool:
  """Bitwise equality of two pytrees of arrays (same structure, same bits)."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  return ta == tb and all(
      x.dtype == y.dtype and x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y))
      for x, y in zip(la, lb))


def platform_of(*trees: Any) -> str:
  """The platform of the first JAX array in `trees`; for host data, of the default device."""
  for leaf in jax.tree.leaves(trees):
    if isinstance(leaf, jax.Array):
      return next(iter(leaf.devices())).platform
  default = jax.config.jax_default_device
  if default is None:
    return jax.default_backend()
  return default if isinstance(default, str) else default.platform


def assert_equal_or_close(a: Any, b: Any, *, gpu_rtol: float, gpu_atol: float = 0.0,
                          why: str) -> None:
  """Bitwise equality of two pytrees on CPU; on GPU, equality up to `gpu_rtol` / `gpu_atol`.

  For comparisons between two *different* programs (one whole-step executable against
  per-layer ones, say) that are exact on CPU but not on GPU, where XLA may fuse and order a
  reduction differently in each program even with deterministic ops (which only make one
  executable repeat itself). docs/reliability.md lists the tests that use it.

  Args:
    a: the result under test.
    b: the reference, with the same structure.
    gpu_rtol: relative tolerance on GPU.
    gpu_atol: absolute tolerance on GPU.
    why: why the two programs may round differently on GPU; shown when the check fails.
  """
  platform = platform_of(a, b)
  if platform == "cpu":
    assert trees_equal(a, b), f"not bitwise equal on CPU (on GPU only close: {why})"
    return
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb, (ta, tb)
  for i, (x, y) in enumerate(zip(la, lb)):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                               rtol=gpu_rtol, atol=gpu_atol,
                               err_msg=f"leaf {i} on {platform} (compared up to rounding: {why})")


def optax_update(tx: Any) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
  """A jitted `update(grads, opt_state, params) -> (params, opt_state)` of an optax `tx`."""

  @jax.jit
  def update(grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return update
