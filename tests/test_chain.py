"""`sequential_vjp` (_chain.py): a stack chained with per-step inputs and tuple carries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxgraph as jg
from jaxgraph import rng as rng_lib
from models import (carry_block, causal_mask, counting, init_mlp, masked_block,
                    reference_stack, trees_equal)

D, H, T = 16, 32, 8


def _sgd(params, grads, lr=0.01):
  return jax.tree.map(lambda p, g: (p - lr * g).astype(p.dtype), params, grads)


def test_sequential_vjp_consts_train_like_jit_vjp_bitwise():
  depth = 4
  block, traces = counting(masked_block)
  params = [init_mlp(k, D, H) for k in jax.random.split(jax.random.key(0), depth)]
  x = jax.random.normal(jax.random.key(1), (T, D))
  consts = (jnp.arange(T, dtype=jnp.int32), causal_mask(T))  # positions, an additive mask
  layers = jg.make_graphed([block] * depth, sample_args=[(p, x, *consts) for p in params],
                           rng=jax.random.key(7), num_warmup_iters=1)
  compiles = sum(layer.stats.compiles for layer in layers)
  assert (traces(), compiles) == (1, 2)  # N identical layers: one forward, one backward
  ref_params = params
  for step in range(3):
    keys = [rng_lib.stream_key(i, step, layer.rng_base_key) for i, layer in enumerate(layers)]
    y, pullback = jg.sequential_vjp(layers, params, x, consts=consts)
    ct = y / y.size
    grads, g_x = pullback(ct)
    y_ref, grads_ref, g_x_ref = reference_stack([masked_block] * depth, ref_params, x, ct,
                                                keys=keys, consts=consts)
    assert trees_equal((y, grads, g_x), (y_ref, grads_ref, g_x_ref))
    params = [_sgd(p, g) for p, g in zip(params, grads)]
    ref_params = [_sgd(p, g) for p, g in zip(ref_params, grads_ref)]
  assert (traces(), sum(layer.stats.compiles for layer in layers)) == (1, compiles)


def test_sequential_vjp_carries_a_tuple():
  depth = 3
  params = [init_mlp(k, D, H) for k in jax.random.split(jax.random.key(0), depth)]
  carry = (jax.random.normal(jax.random.key(1), (T, D)), jnp.float32(0))
  positions = jnp.arange(T, dtype=jnp.int32)
  layers = jg.make_graphed([carry_block] * depth,
                           sample_args=[(p, carry, positions) for p in params])
  (h, aux), pullback = jg.sequential_vjp(layers, params, carry, consts=(positions,))
  ct = (h / h.size, jnp.float32(1))
  grads, g_carry = pullback(ct)
  ref_out, grads_ref, g_carry_ref = reference_stack([carry_block] * depth, params, carry, ct,
                                                    consts=(positions,))
  assert trees_equal(((h, aux), grads, g_carry), (ref_out, grads_ref, g_carry_ref))
  assert isinstance(g_carry, tuple) and aux > 0


def test_sequential_vjp_consts_must_be_a_tuple():
  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  layers = jg.make_graphed([masked_block], sample_args=[(params, x, jnp.arange(T),
                                                         causal_mask(T))], rng=True)
  with pytest.raises(TypeError, match=r"consts= a tuple .* got ArrayImpl; for one argument"):
    jg.sequential_vjp(layers, [params], x, consts=causal_mask(T))
