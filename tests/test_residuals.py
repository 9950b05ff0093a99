"""Residual policies (`make_graphed(..., remat_policy=...)`) and `stats.residual_bytes`."""

from __future__ import annotations

import contextlib
import functools
import io
import math
import re

import jax
from jax import ad_checkpoint
import jax.numpy as jnp
import pytest

import jaxgraph as jg
from jaxgraph import residuals
from models import counting, init_mlp, mlp, reference_stack, trees_equal

D, H, T = 16, 64, 8


def norm_block(p, x, *, key):
  """A pre-norm block with float32 statistics, an exact GELU and dropout: the elementwise
  intermediates the policy recomputes."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  centered = x32 - mean
  normed = (centered * jax.lax.rsqrt((centered ** 2).mean(-1, keepdims=True) + 1e-5))
  h = jax.nn.gelu(normed.astype(x.dtype) @ p["w1"] + p["b1"], approximate=False)
  keep = jax.random.bernoulli(key, 0.9, h.shape)
  return x + jnp.where(keep, h / 0.9, 0).astype(x.dtype) @ p["w2"]


def _checkpointed(fn, policy):
  return jax.checkpoint(fn, policy=policy, prevent_cse=False)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_policy_training_bitwise_vs_checkpointed_vjp(dtype):
  params = [init_mlp(k, D, H, dtype) for k in jax.random.split(jax.random.key(0), 3)]
  x = jax.random.normal(jax.random.key(1), (T, D)).astype(dtype)
  policy = residuals.recompute_elementwise
  layers = jg.make_graphed([norm_block] * 3, sample_args=[(p, x) for p in params], rng=True,
                           remat_policy=policy)
  reference = _checkpointed(norm_block, policy)
  ref_params = params
  for step in range(3):
    keys = [jax.random.key(10 * step + i) for i in range(3)]
    y, pullback = jg.sequential_vjp(layers, params, x, keys=keys)
    ct = (y / y.size).astype(dtype)
    grads, g_x = pullback(ct)
    y_ref, grads_ref, g_x_ref = reference_stack([reference] * 3, ref_params, x, ct, keys)
    assert trees_equal((y, grads, g_x), (y_ref, grads_ref, g_x_ref))
    params = jax.tree.map(lambda p, g: (p - 0.1 * g).astype(p.dtype), params, grads)
    ref_params = jax.tree.map(lambda p, g: (p - 0.1 * g).astype(p.dtype), ref_params,
                              grads_ref)


def test_stream_keys_pair_forward_and_backward_under_policy():
  """Masks are saved (comparisons are saveable): the backward of a streamed forward uses the
  forward's mask, whatever runs in between."""
  params = init_mlp(jax.random.key(0), D, H)
  x = jax.random.normal(jax.random.key(1), (T, D))
  layer = jg.make_graphed(norm_block, sample_args=(params, x), rng=jax.random.key(5),
                          remat_policy=residuals.recompute_elementwise)
  explicit = jax.random.fold_in(jax.random.fold_in(jax.random.key(5), 0), 0)
  y, pullback = layer.vjp(params, x)
  layer(params, x)  # advances the stream between forward and backward
  reference = _checkpointed(norm_block, residuals.recompute_elementwise)
  y_ref, vjp_ref = jax.jit(lambda p, x: jax.vjp(lambda p, x: reference(p, x, key=explicit),
                                                p, x))(params, x)
  assert trees_equal(y, y_ref)
  assert trees_equal(pullback(jnp.ones_like(y)),
                     jax.jit(lambda v, g: v(g))(vjp_ref, jnp.ones_like(y)))


_ITEMSIZE = {"f32": 4, "bf16": 2, "bool": 1, "u32": 4, "i32": 4}


def _saved_text(fn, *args):
  """What `jax.vjp(fn)` saves, as `print_saved_residuals` prints it (`f32[8,64] output of
  ...`, one line each)."""
  text = io.StringIO()
  with contextlib.redirect_stdout(text):
    ad_checkpoint.print_saved_residuals(fn, *args)
  return text.getvalue()


def _kept_bytes(fn, *args):
  """Bytes of what `jax.vjp(fn)` saves besides its arguments: jax's own account."""
  total = 0
  for line in _saved_text(fn, *args).splitlines():
    match = re.match(r"(\w+)\[([\d,]*)\] (.*)", line)
    assert match, line
    dtype, shape, source = match.groups()
    if not source.startswith("from the argument"):
      total += _ITEMSIZE[dtype] * math.prod(int(n) for n in shape.split(",") if n)
  return total


def test_residual_bytes_match_jax_account_and_policy_lowers_them():
  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  key = jax.random.key(1)
  plain = jg.make_graphed(norm_block, sample_args=(params, x), rng=True)
  policed = jg.make_graphed(norm_block, sample_args=(params, x), rng=True,
                            remat_policy=residuals.recompute_elementwise)
  assert plain.stats.residual_bytes == _kept_bytes(
      lambda p, x: norm_block(p, x, key=key), params, x)
  assert policed.stats.residual_bytes == _kept_bytes(
      _checkpointed(lambda p, x: norm_block(p, x, key=key), residuals.recompute_elementwise),
      params, x)
  assert 0 < policed.stats.residual_bytes < plain.stats.residual_bytes


def test_policy_keeps_one_compile_for_identical_layers():
  layer, traces = counting(mlp)
  params = [init_mlp(k, D, H) for k in jax.random.split(jax.random.key(0), 6)]
  x = jnp.ones((T, D))
  layers = jg.make_graphed([layer] * 6, sample_args=[(p, x) for p in params],
                           remat_policy=residuals.recompute_elementwise)
  compiles = sum(l.stats.compiles for l in layers)
  for _ in range(3):
    y, pullback = jg.sequential_vjp(layers, params, x)
    pullback(jnp.ones_like(y))
  assert traces() == 1
  assert sum(l.stats.captures for l in layers) == 1
  assert sum(l.stats.compiles for l in layers) == compiles


def test_policy_must_be_callable():
  params = init_mlp(jax.random.key(0), D, H)
  with pytest.raises(TypeError, match="remat_policy must be a jax.checkpoint policy"):
    jg.make_graphed(mlp, sample_args=(params, jnp.ones((T, D))), remat_policy="elementwise")


def test_named_values_are_saved_under_the_policy():
  """`checkpoint_name` keeps an elementwise value the policy would otherwise recompute.

  The bytes are compared with jax's own account of the same checkpointed function, not with
  a count written here: which unnamed values jax saves differs between versions (jax 0.11
  saves more of this block than 0.10 without the name)."""

  def block(p, x, *, name):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return x + (ad_checkpoint.checkpoint_name(h, "activation") if name else h) @ p["w2"]

  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  for name in (False, True):
    layer = jg.make_graphed(functools.partial(block, name=name), sample_args=(params, x),
                            remat_policy=residuals.recompute_elementwise)
    y, pullback = layer.vjp(params, x)
    reference = _checkpointed(functools.partial(block, name=name),
                              residuals.recompute_elementwise)
    y_ref, vjp_ref = jax.jit(lambda p, x: jax.vjp(reference, p, x))(params, x)
    assert trees_equal((y, pullback(jnp.ones_like(y))),
                       (y_ref, jax.jit(lambda v, g: v(g))(vjp_ref, jnp.ones_like(y))))
    assert layer.stats.residual_bytes == _kept_bytes(reference, params, x)
    assert ("named 'activation'" in _saved_text(reference, params, x)) == name


def test_fallback_and_traced_calls_run_under_the_policy():
  """Past `max_captures` (jax.jit fallback) and inside a user's transformation the function
  runs under the same policy as its executables: the same saved values, so the same bits."""
  params = init_mlp(jax.random.key(0), D, H)
  policy = residuals.recompute_elementwise
  layer = jg.make_graphed(mlp, sample_args=(params, jnp.ones((T, D))), max_captures=1,
                          remat_policy=policy)
  reference = jax.jit(lambda p, x: jax.vjp(_checkpointed(mlp, policy), p, x))
  x = jax.random.normal(jax.random.key(1), (T + 1, D))
  with pytest.warns(UserWarning, match="max_captures"):
    y, pullback = layer.vjp(params, x)
  assert layer.stats.fallbacks == 1
  y_ref, vjp_ref = reference(params, x)
  assert trees_equal((y, pullback(jnp.ones_like(y))),
                     (y_ref, jax.jit(lambda v, g: v(g))(vjp_ref, jnp.ones_like(y))))
  traced = jax.jit(lambda p, x: jax.vjp(layer, p, x)[1](jnp.ones_like(x)))(params, x)
  assert trees_equal(traced, jax.jit(lambda v, g: v(g))(vjp_ref, jnp.ones_like(y)))
