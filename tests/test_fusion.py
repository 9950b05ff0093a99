"""Boundary fusion (`sequential_vjp(..., fuse=True)`): numerics, runs, compile counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgraph as jg
from jaxgraph import _fusion as fusion
from jaxgraph import residuals
from jaxgraph import rng as rng_lib
from models import (carry_block, causal_mask, counting, dropout_mlp, init_mlp, masked_block, mlp,
                    reference_stack, trees_equal)

D, H, T = 16, 32, 8


def _params(depth, dtype=jnp.float32):
  return [init_mlp(k, D, H, dtype) for k in jax.random.split(jax.random.key(0), depth)]


def _x(dtype=jnp.float32):
  return jax.random.normal(jax.random.key(1), (T, D)).astype(dtype)


def _sgd(params, grads, lr=0.01):
  return jax.tree.map(lambda p, g: (p - lr * g).astype(p.dtype), params, grads)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_training_matches_jit_vjp_of_the_chain_bitwise(dtype):
  # The math of a fused run is the chain's: the reference is that chain through jax.vjp
  # under jax.jit (forward and backward jitted apart, as replayed), with the stream keys.
  depth = 4
  params, x = _params(depth, dtype), _x(dtype)
  layers = jg.make_graphed([dropout_mlp] * depth, sample_args=[(p, x) for p in params],
                           rng=jax.random.key(7))
  chain = fusion.Composed((dropout_mlp,) * depth)
  ref_params = params
  for step in range(3):
    keys = tuple(rng_lib.stream_key(i, step, layer.rng_base_key)
                 for i, layer in enumerate(layers))
    y, pullback = jg.sequential_vjp(layers, params, x, fuse=True)
    ct = (y / y.size).astype(dtype)
    grads, g_x = pullback(ct)
    y_ref, (grads_ref,), g_x_ref = reference_stack([chain], [tuple(ref_params)], x, ct,
                                                   keys=[keys])
    assert trees_equal(y, y_ref)
    assert trees_equal(g_x, g_x_ref)
    assert trees_equal(tuple(grads), grads_ref)
    params = [_sgd(p, g) for p, g in zip(params, grads)]
    ref_params = [_sgd(p, g) for p, g in zip(ref_params, grads_ref)]
  assert [layer.rng_counter for layer in layers] == [3] * depth


def test_fused_equals_unfused_up_to_rounding_with_the_same_keys():
  # Same keys, same math; XLA fuses across layer boundaries, so the last bits may differ.
  params, x = _params(4), _x()
  build = lambda: jg.make_graphed([dropout_mlp] * 4, sample_args=[(p, x) for p in params],
                                  rng=True)
  fused_layers, plain_layers = build(), build()
  for _ in range(2):
    y, pullback = jg.sequential_vjp(fused_layers, params, x, fuse=True)
    y_plain, pullback_plain = jg.sequential_vjp(plain_layers, params, x)
    grads, g_x = pullback(jnp.ones_like(y))
    grads_plain, g_x_plain = pullback_plain(jnp.ones_like(y_plain))
    np.testing.assert_allclose(y, y_plain, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(g_x, g_x_plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_plain)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert ([layer.rng_counter for layer in fused_layers]
          == [layer.rng_counter for layer in plain_layers] == [2] * 4)


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="bitwise across executables: GPU autotuning may pick other kernels")
@pytest.mark.parametrize("policy", [None, residuals.recompute_elementwise],
                         ids=["all_residuals", "recompute_elementwise"])
def test_fused_equals_per_layer_bitwise_and_keeps_what_the_layers_keep(policy):
  # Barriers between layers and the policy applied per layer: the fused executables run the
  # per-layer program, and keep the layers' residuals plus the activations between layers
  # (which per layer are the next layer's inputs, held anyway).
  depth = 4
  params, x = _params(depth), _x()
  build = lambda: jg.make_graphed([dropout_mlp] * depth, sample_args=[(p, x) for p in params],
                                  rng=True, remat_policy=policy, num_warmup_iters=0)
  fused_layers, plain_layers = build(), build()
  compiles = sum(layer.stats.compiles for layer in fused_layers)
  for _ in range(2):
    y, pullback = jg.sequential_vjp(fused_layers, params, x, fuse=True)
    y_plain, pullback_plain = jg.sequential_vjp(plain_layers, params, x)
    assert trees_equal((y, *pullback(y)), (y_plain, *pullback_plain(y_plain)))
  assert sum(layer.stats.compiles for layer in fused_layers) - compiles == 2  # one pair
  [entry] = fusion.segment(fused_layers).executables.entries.values()
  per_layer = plain_layers[0].stats.residual_bytes
  assert entry.residual_bytes == depth * per_layer + (depth - 1) * x.nbytes


def test_explicit_keys_are_fused_too():
  params, x = _params(3), _x()
  layers = jg.make_graphed([dropout_mlp] * 3, sample_args=[(p, x) for p in params], rng=True)
  keys = list(jax.random.split(jax.random.key(3), 3))
  y, pullback = jg.sequential_vjp(layers, params, x, keys=keys, fuse=True)
  grads, g_x = pullback(jnp.ones_like(y))
  y_ref, (grads_ref,), g_x_ref = reference_stack([fusion.Composed((dropout_mlp,) * 3)],
                                                 [tuple(params)], x, jnp.ones_like(y),
                                                 keys=[tuple(keys)])
  assert trees_equal((y, tuple(grads), g_x), (y_ref, grads_ref, g_x_ref))
  assert [layer.rng_counter for layer in layers] == [0, 0, 0]  # explicit keys: no stream


def test_twelve_identical_layers_fuse_into_one_compiled_pair_without_recompiles():
  layer_fn, calls = counting(mlp)
  params, x = _params(12), _x()
  layers = jg.make_graphed([layer_fn] * 12, sample_args=[(p, x) for p in params],
                           num_warmup_iters=1)
  traces_before = calls()
  compiles_before = sum(layer.stats.compiles for layer in layers)
  for _ in range(3):
    y, pullback = jg.sequential_vjp(layers, params, x, fuse=True)
    pullback(jnp.ones_like(y))
  # One trace of the chain (12 calls of the function inside it), one forward + one backward.
  assert calls() - traces_before == 12
  assert sum(layer.stats.compiles for layer in layers) - compiles_before == 2
  assert layers[0].stats.captures == 2  # its own layer signature, and the fused chain
  assert all(layer.stats.replays == 3 and layer.stats.backward_replays == 3
             for layer in layers)


def test_replay_hooks_split_runs_and_identical_runs_share_one_capture():
  seen = []
  hook = jg.Hooks(pre_forward=[lambda e: seen.append(("fwd", e.index))],
                  backward=[lambda e: seen.append(("bwd", e.index))])
  hooks = [None, None, hook, None, None]
  params, x = _params(5), _x()
  layers = jg.make_graphed([mlp] * 5, hooks, sample_args=[(p, x) for p in params],
                           num_warmup_iters=0)
  assert fusion.runs(layers) == [(0, 2), (2, 3), (3, 5)]
  seen.clear()  # replay hooks fire at capture too
  y, pullback = jg.sequential_vjp(layers, params, x, fuse=True)
  grads, g_x = pullback(jnp.ones_like(y))
  assert seen == [("fwd", 2), ("bwd", 2)]
  assert layers[0].stats.captures == 2 and layers[3].stats.cache_hits == 2  # same chain
  y_ref, grads_ref, g_x_ref = reference_stack([mlp] * 5, params, x, jnp.ones_like(y))
  np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_runs_break_at_other_settings():
  params, x = _params(6), _x()
  first = jg.make_graphed([mlp] * 2, sample_args=[(p, x) for p in params[:2]],
                          num_warmup_iters=0)
  second = jg.make_graphed([mlp] * 2, sample_args=[(p, x) for p in params[2:4]],
                           delay_wgrad=True, num_warmup_iters=0)
  third = jg.make_graphed([mlp] * 2, sample_args=[(p, x) for p in params[4:]],
                          offload_residuals=[True, False], num_warmup_iters=0)
  assert fusion.runs(first + second + third) == [(0, 2), (2, 4), (4, 5), (5, 6)]
  # A layer used twice draws two keys: it never joins a run it is already in.
  assert fusion.runs(first + first) == [(0, 2), (2, 4)]
  y, pullback = jg.sequential_vjp(first + first, params[:4], x, fuse=True)
  grads, _ = pullback(jnp.ones_like(y))
  assert len(grads) == 4 and all(g is not None for g in grads)
  assert len(first[0].config.segments) == 1


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="bitwise across executables: GPU autotuning may pick other kernels")
def test_fused_delay_wgrad_splits_the_segment_backward_bitwise_the_layers():
  """`delay_wgrad=True`: a fused run's pullback returns the input cotangent from one dgrad
  executable, its `wgrad()` every layer's weight gradients from one wgrad executable:
  bitwise the layers split one by one over 2 SGD steps with dropout, the same key
  counters, one capture (forward, dgrad, wgrad), and the split's FLOPs those of the
  segment's one backward (the wgrad exactly the layers' weight products)."""
  depth = 4
  params, x = _params(depth), _x()
  build = lambda delay: jg.make_graphed([dropout_mlp] * depth, rng=True, delay_wgrad=delay,
                                        sample_args=[(p, x) for p in params],
                                        num_warmup_iters=0)
  fused_layers, plain_layers = build(True), build(True)
  compiles = fused_layers[0].stats.compiles
  fused_params = plain_params = params
  for _ in range(2):
    y, pullback = jg.sequential_vjp(fused_layers, fused_params, x, fuse=True)
    y_plain, pullback_plain = jg.sequential_vjp(plain_layers, plain_params, x)
    assert trees_equal(y, y_plain)
    dgrads, g_x = pullback(y)
    dgrads_plain, g_x_plain = pullback_plain(y_plain)
    assert dgrads == dgrads_plain == [None] * depth and trees_equal(g_x, g_x_plain)
    grads, grads_plain = pullback.wgrad(), pullback_plain.wgrad()
    assert len(grads) == depth and trees_equal(grads, grads_plain)
    fused_params = [_sgd(p, g) for p, g in zip(fused_params, grads)]
    plain_params = [_sgd(p, g) for p, g in zip(plain_params, grads_plain)]
  assert ([layer.rng_counter for layer in fused_layers]
          == [layer.rng_counter for layer in plain_layers] == [2] * depth)
  segment = fusion.segment(fused_layers)
  assert fused_layers[0].stats.compiles - compiles == segment.stats.compiles == 3
  [entry] = segment.executables.entries.values()
  flops = {kind: compiled.cost_analysis()["flops"]
           for kind, (compiled, _) in entry.backward.items()}
  one_backward = build(False)
  jg.sequential_vjp(one_backward, params, x, fuse=True)[1](y)
  [full] = fusion.segment(one_backward).executables.entries.values()
  [layer_entry] = plain_layers[0].executables.entries.values()
  assert flops["wgrad"] == depth * layer_entry.backward["wgrad"][0].cost_analysis()["flops"]
  assert flops["dgrad"] + flops["wgrad"] <= 1.05 * full.backward["full"][0].cost_analysis()[
      "flops"]


def test_traced_call_runs_the_functions():
  params, x = _params(3), _x()
  layers = jg.make_graphed([mlp] * 3, sample_args=[(p, x) for p in params])

  @jax.jit
  def loss(params, x):
    y, _ = jg.sequential_vjp(layers, params, x, fuse=True)
    return jnp.sum(y ** 2)

  y_ref, _, _ = reference_stack([mlp] * 3, params, x, jnp.ones((T, D)))
  np.testing.assert_allclose(loss(params, x), jnp.sum(y_ref ** 2), rtol=1e-6)
  assert layers[0].stats.captures == 1  # its own capture only: nothing fused for a trace


def test_beyond_max_captures_runs_unfused():
  params, x = _params(2), _x()
  layers = jg.make_graphed([mlp] * 2, sample_args=[(p, x) for p in params], max_captures=1)
  y, pullback = jg.sequential_vjp(layers, params, x, fuse=True)
  pullback(jnp.ones_like(y))
  segment = fusion.segment(layers)
  assert len(segment.executables.entries) == 1
  x16 = jnp.ones((2 * T, D))
  with pytest.warns(UserWarning, match="max_captures"):
    y, pullback = jg.sequential_vjp(layers, params, x16, fuse=True)
  grads, _ = pullback(jnp.ones_like(y))
  assert len(segment.executables.entries) == 1 and layers[0].stats.fallbacks == 1
  y_ref, grads_ref, _ = reference_stack([mlp] * 2, params, x16, jnp.ones_like(y))
  np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)


def test_reset_drops_the_fused_executables():
  layer_fn, calls = counting(mlp)
  params, x = _params(2), _x()
  layers = jg.make_graphed([layer_fn] * 2, sample_args=[(p, x) for p in params],
                           num_warmup_iters=0)
  y, pullback = jg.sequential_vjp(layers, params, x, fuse=True)
  pullback(jnp.ones_like(y))
  before = calls()
  layers[1].reset()
  assert not layers[0].config.segments
  y, pullback = jg.sequential_vjp(layers, params, x, fuse=True)
  pullback(jnp.ones_like(y))
  assert calls() - before == 2  # the chain was traced again


def test_fused_pullback_is_one_shot_and_keys_are_checked():
  params, x = _params(2), _x()
  layers = jg.make_graphed([dropout_mlp] * 2, sample_args=[(p, x) for p in params], rng=True)
  y, pullback = jg.sequential_vjp(layers, params, x, fuse=True)
  pullback(jnp.ones_like(y))
  with pytest.raises(RuntimeError, match="already called"):
    pullback(jnp.ones_like(y))
  with pytest.raises(TypeError, match="raw uint32"):
    jg.sequential_vjp(layers, params, x, keys=[jax.random.PRNGKey(0)] * 2, fuse=True)
  assert [layer.rng_counter for layer in layers] == [1, 1]  # the refused call drew nothing


def test_a_busy_member_layer_blocks_its_fused_run():
  params, x = _params(2), _x()
  layers = jg.make_graphed([mlp] * 2, sample_args=[(p, x) for p in params])
  with layers[1].exclusive():
    with pytest.raises(RuntimeError, match=r"mlp\[1\] is already running"):
      jg.sequential_vjp(layers, params, x, fuse=True)
    assert not layers[0]._busy.locked()  # the locks taken before the busy one were released
  y, pullback = jg.sequential_vjp(layers, params, x, fuse=True)  # free again
  grads, _ = pullback(jnp.ones_like(y))
  assert len(grads) == 2


def test_fused_consts_train_like_jit_vjp_of_the_chain_bitwise():
  depth = 4
  block, traces = counting(masked_block)
  params, x = _params(depth), _x()
  consts = (jnp.arange(T, dtype=jnp.int32), causal_mask(T))  # positions, an additive mask
  layers = jg.make_graphed([block] * depth, sample_args=[(p, x, *consts) for p in params],
                           rng=jax.random.key(7), num_warmup_iters=1)
  compiles = sum(layer.stats.compiles for layer in layers)
  chain = fusion.Composed((masked_block,) * depth)
  ref_params = params
  for step in range(3):
    keys = tuple(rng_lib.stream_key(i, step, layer.rng_base_key)
                 for i, layer in enumerate(layers))
    y, pullback = jg.sequential_vjp(layers, params, x, consts=consts, fuse=True)
    ct = y / y.size
    grads, g_x = pullback(ct)
    y_ref, (grads_ref,), g_x_ref = reference_stack([chain], [tuple(ref_params)], x, ct,
                                                   keys=[keys], consts=consts)
    assert trees_equal((y, tuple(grads), g_x), (y_ref, grads_ref, g_x_ref))
    params = [_sgd(p, g) for p, g in zip(params, grads)]
    ref_params = [_sgd(p, g) for p, g in zip(ref_params, grads_ref)]
  # One trace of the layer and one of the chain (depth calls); one fused forward + backward.
  assert traces() == 1 + depth
  assert sum(layer.stats.compiles for layer in layers) == compiles + 2


def test_fused_tuple_carry():
  depth = 3
  params = _params(depth)
  carry = (_x(), jnp.float32(0))
  positions = jnp.arange(T, dtype=jnp.int32)
  layers = jg.make_graphed([carry_block] * depth,
                           sample_args=[(p, carry, positions) for p in params])
  (h, aux), pullback = jg.sequential_vjp(layers, params, carry, consts=(positions,), fuse=True)
  ct = (h / h.size, jnp.float32(1))
  grads, g_carry = pullback(ct)
  ref_out, (grads_ref,), g_carry_ref = reference_stack(
      [fusion.Composed((carry_block,) * depth)], [tuple(params)], carry, ct, consts=(positions,))
  assert trees_equal(((h, aux), tuple(grads), g_carry), (ref_out, grads_ref, g_carry_ref))
  assert len(layers[0].config.segments) == 1  # it ran fused


def test_fuse_k_replays_segments_of_at_most_k_layers_that_share_one_compile():
  params, x = _params(7), _x()
  layers = jg.make_graphed([mlp] * 7, sample_args=[(p, x) for p in params],
                           num_warmup_iters=0)
  assert fusion.runs(layers, 3) == [(0, 3), (3, 6), (6, 7)]
  assert fusion.runs(layers, 1) == [(i, i + 1) for i in range(7)]
  ct = jnp.ones_like(x)
  y, pullback = jg.sequential_vjp(layers, params, x, fuse=3)
  grads, g_x = pullback(ct)
  # two segments of 3 share one capture (the same chain); the 7th layer replays alone
  assert len(layers[0].config.segments) == 2
  assert layers[0].stats.captures == 2 and layers[3].stats.cache_hits == 2
  y_one, pullback_one = jg.sequential_vjp(layers, params, x)  # the layers one by one
  grads_one, g_x_one = pullback_one(ct)
  y_all, pullback_all = jg.sequential_vjp(layers, params, x, fuse=True)
  grads_all, g_x_all = pullback_all(ct)
  # The same math in other executables: bitwise on the CPU; on a GPU autotuning may pick
  # other kernels for them (as for fuse=True), so the last bits may differ.
  for other in ((y_one, grads_one, g_x_one), (y_all, grads_all, g_x_all)):
    if jax.default_backend() == "cpu":
      assert trees_equal((y, grads, g_x), other)
    for a, b in zip(jax.tree.leaves((y, grads, g_x)), jax.tree.leaves(other)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  for bad in (0, -2, 1.5, "3"):
    with pytest.raises(TypeError, match="fuse= a bool, or an int >= 1"):
      jg.sequential_vjp(layers, params, x, fuse=bad)
