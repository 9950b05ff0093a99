"""Lifetimes: pullbacks whose forward buffers were deleted or donated, and pullbacks dropped
without being called (nothing leaks: live device arrays and host RSS stay flat)."""

from __future__ import annotations

import gc
import os
import time

import jax
import jax.numpy as jnp
import pytest

import jaxgraph as jg
from test_bad_input import bitwise

# Default-suite replay count for the leak tests; `-m slow` runs LONG_REPLAYS.
REPLAYS = int(os.environ.get("JAXGRAPH_LEAK_REPLAYS", "10000"))
LONG_REPLAYS = 100_000
B, D = 32, 256


def layer(p, x):
  """Keeps two residuals that are neither inputs nor outputs (B x D float32 each)."""
  return jnp.tanh(x @ p["w1"]) @ p["w2"] + p["b"]


def keyed_layer(p, x, *, key):
  return layer(p, x) * jax.random.bernoulli(key, 0.9, (B, D))


def _params(seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w1": jax.random.normal(k1, (D, D)) / D, "w2": jax.random.normal(k2, (D, D)) / D,
          "b": jnp.zeros((D,))}


X = jnp.linspace(-1, 1, B * D, dtype=jnp.float32).reshape(B, D)
CT = jnp.ones((B, D), jnp.float32)

_push = jax.jit(lambda p, x: jax.vjp(layer, p, x))
_pull = jax.jit(lambda v, c: v(c))


def _copy(tree):
  return jax.tree.map(lambda a: a + 0, tree)


# ----------------------------------------------------------------- deleted / donated buffers

@pytest.fixture(scope="module")
def graphed():
  return jg.make_graphed(layer, sample_args=(_params(), X), num_warmup_iters=1)


def test_layer_backward_reads_inputs_not_outputs(graphed):
  """The cases below delete what the backward needs: both inputs, no output."""
  layout = next(iter(graphed.executables.entries.values())).layout
  assert len(layout.packing.shapes) == 2  # two residuals (one buffer where packing is on)
  # Leaves: b, w1, w2, x. The backward reads w1, w2 and x (b's grad needs none of them).
  assert set(layout.needed_inputs) == {1, 2, 3}
  assert layout.needed_outputs == ()


def _delete(what: str, p, x):
  if what == "x":
    x.delete()
  elif what == "w1":
    p["w1"].delete()
  elif what == "donated_params":
    step = jax.jit(lambda p: jax.tree.map(lambda a: a * 0.5, p), donate_argnums=0)
    new = step(p)
    assert p["w1"].is_deleted(), "the backend did not donate"
    return new
  elif what == "donated_x":
    jax.jit(lambda x: x * 2, donate_argnums=0)(x)
    assert x.is_deleted()


@pytest.mark.parametrize("what", ["x", "w1", "donated_params", "donated_x"])
def test_pullback_after_its_forward_buffers_are_gone(graphed, what):
  p, x = _copy(_params()), X + 0
  y, pull = graphed.vjp(p, x)
  before = graphed.stats
  _delete(what, p, x)
  for _ in range(2):  # the same clear error again: the pullback was not consumed
    with pytest.raises(RuntimeError, match=r"backward of layer\[0\] needs arrays from its "
                                           r"forward that were deleted or donated"):
      pull(CT)
  assert graphed.stats == before
  # The callable itself is unaffected.
  p, x = _params(), X
  y, pull = graphed.vjp(p, x)
  y_ref, v = _push(p, x)
  assert bitwise(y, y_ref) and bitwise(pull(CT), _pull(v, CT))


def test_wgrad_after_params_were_donated():
  """The wgrad reads activations and the cotangents the dgrad kept, not the weights: it runs
  after an optimizer step donated them; not after its input was donated."""
  p = _copy(_params())
  g = jg.make_graphed(layer, sample_args=(p, X), num_warmup_iters=0, delay_wgrad=True)
  _, v = _push(_params(), X)
  ref_grads, ref_x = _pull(v, CT)
  y, pull = g.vjp(p, X)
  _, g_x = pull(CT)                      # dgrad before the optimizer step: fine
  assert bitwise(g_x, ref_x)
  _delete("donated_params", p, X)
  assert bitwise(pull.wgrad()[0], ref_grads)
  x = _copy(X)
  y, pull = g.vjp(_params(), x)
  pull(CT)
  _delete("donated_x", None, x)
  for _ in range(2):  # not consumed by the failure: the same clear error again
    with pytest.raises(RuntimeError, match=r"deleted or donated"):
      pull.wgrad()


def test_deleting_forward_outputs_is_harmless(graphed):
  """Outputs the backward does not read may be deleted before the pullback runs."""
  y, pull = graphed.vjp(_params(), X)
  y.delete()
  _, v = _push(_params(), X)
  assert bitwise(pull(CT), _pull(v, CT))


def test_grads_are_fresh_arrays(graphed):
  """Grads are owned by the caller: deleting them leaves the next backward intact."""
  p = _params()
  for _ in range(2):
    y, pull = graphed.vjp(p, X)
    grads = pull(CT)
    _, v = _push(p, X)
    assert bitwise(grads, _pull(v, CT))
    for leaf in jax.tree.leaves(grads):
      leaf.delete()


# ------------------------------------------------------------------------------------ leaks

def _rss_mib() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  raise RuntimeError("no VmRSS")


def _settle():
  gc.collect()
  jax.effects_barrier()


def _run_leak_check(step, replays: int, residual_bytes: int) -> dict[str, float]:
  """Runs `step` `replays` times; live arrays must return to the baseline exactly, RSS must
  grow by far less than what `replays` leaked residuals would take."""
  for _ in range(200):   # warm every cache first
    step()
  _settle()
  live, rss = len(jax.live_arrays()), _rss_mib()
  start = time.perf_counter()
  checkpoints = []
  for i in range(replays):
    step()
    if (i + 1) % max(1, replays // 4) == 0:
      _settle()
      checkpoints.append(len(jax.live_arrays()))
  _settle()
  growth = _rss_mib() - rss
  leak_if_leaking = replays * residual_bytes / 2**20
  assert checkpoints and all(c == live for c in checkpoints), (live, checkpoints)
  assert len(jax.live_arrays()) == live
  assert growth < max(32.0, 0.05 * leak_if_leaking), (growth, leak_if_leaking)
  return {"replays": replays, "seconds": time.perf_counter() - start, "rss_growth_mib": growth}


def _stepper(kind: str):
  p = _params()
  residual = 2 * B * D * 4
  if kind == "vjp_dropped":
    g = jg.make_graphed(layer, sample_args=(p, X), num_warmup_iters=0)
    return (lambda: g.vjp(p, X)), residual, g
  if kind == "vjp_called":
    g = jg.make_graphed(layer, sample_args=(p, X), num_warmup_iters=0)
    return (lambda: g.vjp(p, X)[1](CT)), residual, g
  if kind == "call":
    g = jg.make_graphed(layer, sample_args=(p, X), num_warmup_iters=0)
    return (lambda: g(p, X)), B * D * 4, g
  if kind == "rng_stream_dropped":
    g = jg.make_graphed(keyed_layer, sample_args=(p, X), num_warmup_iters=0, rng=True)
    return (lambda: g.vjp(p, X)), residual, g
  if kind == "sequential_dropped":
    layers = jg.make_graphed([layer] * 3, sample_args=[(p, X)] * 3, num_warmup_iters=0)
    return (lambda: jg.sequential_vjp(layers, [p] * 3, X)), 3 * residual, layers[0]
  if kind == "delay_wgrad_half_done":  # dgrad ran, wgrad never called
    g = jg.make_graphed(layer, sample_args=(p, X), num_warmup_iters=0, delay_wgrad=True)
    return (lambda: g.vjp(p, X)[1](CT)), residual, g
  raise ValueError(kind)


LEAK_KINDS = ["vjp_dropped", "vjp_called", "call", "rng_stream_dropped", "sequential_dropped",
              "delay_wgrad_half_done"]


def test_ten_thousand_dropped_pullbacks_leak_nothing():
  step, residual, g = _stepper("vjp_dropped")
  result = _run_leak_check(step, REPLAYS, residual)
  assert g.stats.replays == REPLAYS + 200 and g.stats.backward_replays == 0
  assert g.stats.captures == 1 and g.stats.compiles == 2
  print(f"\nleak check: {result}")


@pytest.mark.parametrize("kind", LEAK_KINDS[1:])
def test_replays_leak_nothing(kind):
  step, residual, g = _stepper(kind)
  _run_leak_check(step, max(1, REPLAYS // 10), residual)
  assert g.stats.fallbacks == 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", LEAK_KINDS)
def test_long_run_leaks_nothing(kind):
  step, residual, g = _stepper(kind)
  result = _run_leak_check(step, LONG_REPLAYS, residual)
  print(f"\n{kind}: {result}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", LEAK_KINDS)
def test_replays_leak_no_device_memory_on_gpu(kind):
  device = jax.devices()[0]
  assert device.platform == "gpu"
  step, residual, g = _stepper(kind)
  step()
  _settle()
  in_use = device.memory_stats()["bytes_in_use"]
  result = _run_leak_check(step, REPLAYS, residual)
  _settle()
  growth = device.memory_stats()["bytes_in_use"] - in_use
  assert growth <= residual, (growth, residual)
  print(f"\n{kind} on {device.device_kind}: {result}, device bytes growth {growth}")


def test_held_pullbacks_are_released_when_dropped():
  """Holding pullbacks keeps exactly their kept residuals alive; dropping them frees them."""
  p = _params()
  g = jg.make_graphed(layer, sample_args=(p, X), num_warmup_iters=0)
  n_kept = next(iter(g.executables.entries.values())).layout.n_kept
  held = [g.vjp(p, X) for _ in range(10)]
  _settle()
  live = len(jax.live_arrays())
  held += [g.vjp(p, X) for _ in range(1000)]
  _settle()
  assert len(jax.live_arrays()) - live == 1000 * (n_kept + 1)   # residuals + the output
  del held
  _settle()
  assert len(jax.live_arrays()) == live - 10 * (n_kept + 1)
