"""`delay_wgrad=True`: dgrad now, wgrad later, bitwise equal to the fused backward; one-shot
errors; and the FLOPs of the full, dgrad and wgrad executables (docs/pipeline.md)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgraph as jg

HEADS = 4


def mlp(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  """Two matmuls: x @ w1 -> gelu -> @ w2."""
  return jax.nn.gelu(x @ params["w1"]) @ params["w2"]


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def gpt_block(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  """Pre-LN GPT block: causal multi-head attention and a GELU MLP, residuals around both."""
  batch, length, width = x.shape
  h = _layer_norm(x, params["ln1_scale"], params["ln1_bias"])
  q, k, v = (t.reshape(batch, length, HEADS, width // HEADS)
             for t in jnp.split(h @ params["wqkv"], 3, axis=-1))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(width // HEADS)
  scores = jnp.where(jnp.tril(jnp.ones((length, length), bool)), scores, -1e9)
  attention = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
  x = x + attention.reshape(batch, length, width) @ params["wo"]
  h = _layer_norm(x, params["ln2_scale"], params["ln2_bias"])
  return x + jax.nn.gelu(h @ params["w1"]) @ params["w2"]


def mlp_case(batch: int = 8, width: int = 16, hidden: int = 64) -> tuple[Any, jax.Array]:
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.random.normal(k1, (width, hidden)) / np.sqrt(width),
            "w2": jax.random.normal(k2, (hidden, width)) / np.sqrt(hidden)}
  return params, jax.random.normal(k3, (batch, width))


def gpt_case(batch: int = 2, length: int = 8, width: int = 16) -> tuple[Any, jax.Array]:
  keys = jax.random.split(jax.random.key(1), 5)
  normal = lambda k, shape: jax.random.normal(k, shape) / np.sqrt(shape[0])
  params = {"ln1_scale": jnp.ones(width), "ln1_bias": jnp.zeros(width),
            "ln2_scale": jnp.ones(width), "ln2_bias": jnp.zeros(width),
            "wqkv": normal(keys[0], (width, 3 * width)), "wo": normal(keys[1], (width, width)),
            "w1": normal(keys[2], (width, 4 * width)), "w2": normal(keys[3], (4 * width, width))}
  return params, jax.random.normal(keys[4], (batch, length, width))


CASES = {"mlp": (mlp, mlp_case), "gpt_block": (gpt_block, gpt_case)}


@functools.cache
def graphed(name: str, delay_wgrad: bool) -> tuple[jg.GraphedCallable, ...]:
  """Two identical layers of a case (one compile), fused or split; shared by the tests."""
  fn, case = CASES[name]
  params, x = case()
  return jg.make_graphed([fn] * 2, sample_args=[(params, x)] * 2, num_warmup_iters=1,
                         delay_wgrad=delay_wgrad)


def assert_trees_equal(a: Any, b: Any) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  leaves = list(zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  assert leaves
  for x, y in leaves:
    assert np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", sorted(CASES))
def test_dgrad_plus_wgrad_bitwise_equal_fused(name):
  params, x = CASES[name][1]()
  fused, split = graphed(name, False), graphed(name, True)
  y_fused, pull_fused = jg.sequential_vjp(fused, [params, params], x)
  y_split, pull_split = jg.sequential_vjp(split, [params, params], x)
  assert_trees_equal(y_split, y_fused)
  ct = jnp.cos(y_fused)
  grads_fused, gx_fused = pull_fused(ct)
  grads_now, gx_split = pull_split(ct)
  assert grads_now == [None, None]  # the weights' grads wait for wgrad()
  assert_trees_equal(gx_split, gx_fused)
  assert_trees_equal(pull_split.wgrad(), grads_fused)


def test_wgrad_of_one_layer_returns_weights_only():
  params, x = mlp_case()
  layer = jg.make_graphed(mlp, sample_args=(params, x), delay_wgrad=True, num_warmup_iters=0)
  fused = jg.make_graphed(mlp, sample_args=(params, x), num_warmup_iters=0)
  y, pullback = layer.vjp(params, x)
  ct = jnp.ones_like(y)
  g_params, g_x = pullback(ct)
  w_params, w_x = pullback.wgrad()
  f_params, f_x = fused.vjp(params, x)[1](ct)
  assert g_params is None and w_x is None
  assert_trees_equal((w_params, g_x), (f_params, f_x))


def test_wgrad_errors():
  params, x = mlp_case()
  layer = jg.make_graphed(mlp, sample_args=(params, x), delay_wgrad=True, num_warmup_iters=0)
  y, pullback = layer.vjp(params, x)
  with pytest.raises(RuntimeError, match="before its pullback"):
    pullback.wgrad()
  pullback(jnp.ones_like(y))
  pullback.wgrad()
  with pytest.raises(RuntimeError, match="already called"):
    pullback.wgrad()
  with pytest.raises(RuntimeError, match="already called"):
    pullback(jnp.ones_like(y))
  fused = jg.make_graphed(mlp, sample_args=(params, x), num_warmup_iters=0)
  y, pullback = fused.vjp(params, x)
  pullback(jnp.ones_like(y))
  with pytest.raises(RuntimeError, match="without delay_wgrad=True"):
    pullback.wgrad()


def backward_flops(name: str) -> dict[str, float]:
  """`cost_analysis()` FLOPs of the fused backward and of the dgrad and wgrad executables."""
  flops = {}
  for delay in (False, True):
    (entry,) = graphed(name, delay)[0]._entries.values()
    for kind, (compiled, _) in entry.backward.items():
      flops[kind] = compiled.cost_analysis()["flops"]
  return flops


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="cost_analysis counts GEMM "
                    "FLOPs on CPU; on GPU the GEMMs are library calls it does not count")
def test_backward_flops_of_split_mlp():
  """dgrad is the activation-gradient chain; wgrad recomputes all of it but its last matmul,
  so the split costs one extra `ct @ w2.T` (2 * batch * hidden * width FLOPs) for a 2-matmul
  MLP, plus the elementwise GELU derivative it needs again."""
  params, x = mlp_case()
  (batch, width), hidden = x.shape, params["w1"].shape[1]
  flops = backward_flops("mlp")
  matmul = 2 * batch * width * hidden
  assert flops["dgrad"] < flops["full"] and flops["wgrad"] < flops["full"]
  overhead = flops["dgrad"] + flops["wgrad"] - flops["full"]
  elementwise = flops["full"] - 4 * matmul  # the fused backward: 4 matmuls + GELU'
  assert matmul <= overhead <= matmul + elementwise


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="cost_analysis counts GEMM "
                    "FLOPs on CPU; on GPU the GEMMs are library calls it does not count")
def test_backward_flops_of_split_gpt_block():
  """In a GPT block every weight but the last feeds later matmuls, and ln1's scale and bias
  need the cotangent of ln1's output, i.e. even the input gradient of the first matmul: wgrad
  recomputes nearly the whole dgrad chain, skipping only ln1's own input gradient."""
  flops = backward_flops("gpt_block")
  batch, length, width = gpt_case()[1].shape
  first_matmul_dx = 2 * batch * length * width * 3 * width  # d(h @ wqkv)/dh
  assert flops["dgrad"] < flops["full"]
  assert flops["full"] - first_matmul_dx < flops["wgrad"] < flops["full"]
