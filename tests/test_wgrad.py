"""`delay_wgrad=True`: dgrad now, wgrad later, bitwise equal to the fused backward; one-shot
errors; the FLOPs of the full, dgrad and wgrad executables (docs/pipeline.md: the split
computes nothing twice); and what the dgrad keeps for the wgrad."""

from __future__ import annotations

import functools
import weakref
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


def _dropout(x: jax.Array, key: jax.Array | None) -> jax.Array:
  if key is None:
    return x
  return jnp.where(jax.random.bernoulli(key, 0.9, x.shape), x / 0.9, 0)


def gpt_block(params: dict[str, jax.Array], x: jax.Array, *,
              key: jax.Array | None = None) -> jax.Array:
  """Pre-LN GPT block: causal multi-head attention and a GELU MLP, residuals around both;
  with `key`, dropout on the attention weights and the MLP's hidden activations."""
  batch, length, width = x.shape
  keys = (None, None) if key is None else jax.random.split(key)
  h = _layer_norm(x, params["ln1_scale"], params["ln1_bias"])
  q, k, v = (t.reshape(batch, length, HEADS, width // HEADS)
             for t in jnp.split(h @ params["wqkv"], 3, axis=-1))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(width // HEADS)
  scores = jnp.where(jnp.tril(jnp.ones((length, length), bool)), scores, -1e9)
  weights = _dropout(jax.nn.softmax(scores, -1), keys[0])
  attention = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
  x = x + attention.reshape(batch, length, width) @ params["wo"]
  h = _layer_norm(x, params["ln2_scale"], params["ln2_bias"])
  return x + _dropout(jax.nn.gelu(h @ params["w1"]), keys[1]) @ params["w2"]


def tied(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  """One weight used twice (its gradient sums two products)."""
  return jnp.tanh(x @ params["w"]) @ params["w"].T


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


def tied_case(batch: int = 8, width: int = 16) -> tuple[Any, jax.Array]:
  k1, k2 = jax.random.split(jax.random.key(2))
  return ({"w": jax.random.normal(k1, (width, width)) / np.sqrt(width)},
          jax.random.normal(k2, (batch, width)))


def weight_product_flops(name: str) -> int:
  """FLOPs of the weight gradients' matmuls (`xᵀ @ ct` per use of a weight matrix)."""
  x = CASES[name][1]()[1]
  if name == "mlp":
    return 2 * 2 * x.size * mlp_case()[0]["w1"].shape[1]
  if name == "tied":  # and the sum of the two products
    return 2 * 2 * x.size * x.shape[-1] + x.shape[-1] ** 2
  width = x.shape[-1]
  return 2 * x.size * (3 * width + width + 4 * width + 4 * width)


# name -> (function, sample arguments, whether it takes a dropout key)
CASES = {"mlp": (mlp, mlp_case, False), "gpt_block": (gpt_block, gpt_case, True),
         "tied": (tied, tied_case, False)}


@functools.cache
def graphed(name: str, delay_wgrad: bool) -> tuple[jg.GraphedCallable, ...]:
  """Two identical layers of a case (one compile), fused or split; shared by the tests."""
  fn, case, rng = CASES[name]
  params, x = case()
  return jg.make_graphed([fn] * 2, sample_args=[(params, x)] * 2, num_warmup_iters=1,
                         delay_wgrad=delay_wgrad, rng=jax.random.key(7) if rng else False)


def assert_trees_equal(a: Any, b: Any) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  leaves = list(zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  assert leaves
  for x, y in leaves:
    assert np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", sorted(CASES))
def test_dgrad_plus_wgrad_bitwise_equal_fused(name):
  """Three SGD steps of two layers (the GPT blocks with dropout, both seeded alike): the
  split backward's input and weight gradients, and so the trained weights, are bitwise
  those of the fused one."""
  params, x = CASES[name][1]()
  trained = {False: [params] * 2, True: [params] * 2}
  for _ in range(3):
    grads = {}
    for delay in (False, True):
      h, pullbacks = x, []
      for layer, p in zip(graphed(name, delay), trained[delay]):
        h, pullback = layer.vjp(p, h)
        pullbacks.append(pullback)
      ct, weight_grads = jnp.cos(h), [None, None]
      for i in (1, 0):
        weight_grads[i], ct = pullbacks[i](ct)
      if delay:
        assert weight_grads == [None, None]  # the weights' grads wait for wgrad()
        weight_grads = [pullback.wgrad()[0] for pullback in pullbacks]
      grads[delay] = (h, weight_grads, ct)
      trained[delay] = [jax.tree.map(lambda w, g: w - 0.1 * g, p, g)
                        for p, g in zip(trained[delay], weight_grads)]
    assert_trees_equal(grads[True], grads[False])
  assert_trees_equal(trained[True], trained[False])


@jax.jit
def _linear(x: jax.Array, w: jax.Array) -> jax.Array:
  return x @ w


def scanned(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  """Sub-layers under `lax.scan`: one equation for the cut (its weight gradient is dgrad's)."""
  h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params["ws"])
  return h @ params["wo"]


def conv(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  y = jax.lax.conv_general_dilated(x, params["k"], (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return jax.nn.relu(y * params["scale"] + params["bias"])


def jitted(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  return _linear(jnp.tanh(_linear(x, params["w1"])), params["w2"])


def test_split_of_other_layers_bitwise_equal_fused():
  """A scan over sub-layers, a convolution with an elementwise scale and bias, and jitted
  helpers under a remat policy: split bitwise equal to fused, nothing computed twice."""
  keys = jax.random.split(jax.random.key(3), 3)
  normal = lambda k, shape: jax.random.normal(k, shape) / np.sqrt(np.prod(shape[:-1]))
  cases = [
      (scanned, {"ws": normal(keys[0], (3, 8, 8)), "wo": normal(keys[1], (8, 8))},
       jnp.ones((4, 8)), {}),
      (conv, {"k": normal(keys[0], (3, 3, 4, 8)), "scale": jnp.full(8, 1.1),
              "bias": jnp.zeros(8)}, jax.random.normal(keys[2], (2, 6, 6, 4)), {}),
      (jitted, {"w1": normal(keys[0], (8, 16)), "w2": normal(keys[1], (16, 8))},
       jnp.ones((4, 8)), {"remat_policy": jax.checkpoint_policies.nothing_saveable})]
  for fn, params, x, options in cases:
    fused, split = (jg.make_graphed(fn, sample_args=(params, x), num_warmup_iters=0,
                                    delay_wgrad=delay, **options) for delay in (False, True))
    y, pullback = fused.vjp(params, x)
    y_split, pullback_split = split.vjp(params, x)
    ct = jnp.cos(y)
    _, g_x = pullback_split(ct)
    assert_trees_equal((y_split, pullback_split.wgrad()[0], g_x), (y, *pullback(ct)))
    (entry,) = split.executables.entries.values()
    if fn is scanned:
      assert params["ws"].shape in [s.shape for s in entry.split.stash]
    if jax.default_backend() == "cpu":  # cost_analysis counts GEMMs on the CPU only
      (fused_entry,) = fused.executables.entries.values()
      flops = {kind: compiled.cost_analysis()["flops"] for kind, (compiled, _) in
               [*entry.backward.items(), *fused_entry.backward.items()]}
      assert flops["dgrad"] + flops["wgrad"] <= 1.05 * flops["full"]


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
    (entry,) = graphed(name, delay)[0].executables.entries.values()
    for kind, (compiled, _) in entry.backward.items():
      flops[kind] = compiled.cost_analysis()["flops"]
  return flops


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="cost_analysis counts GEMM "
                    "FLOPs on CPU; on GPU the GEMMs are library calls it does not count")
@pytest.mark.parametrize("name", sorted(CASES))
def test_split_backward_computes_nothing_twice(name):
  """wgrad is only the weight products (the dgrad returned the cotangents they need), and
  dgrad + wgrad is not more than the fused backward (XLA fuses the three programs
  differently: the split counts a few elementwise FLOPs fewer on small blocks)."""
  flops = backward_flops(name)
  assert flops["wgrad"] == weight_product_flops(name)
  assert flops["dgrad"] + flops["wgrad"] <= 1.05 * flops["full"]


def test_what_dgrad_keeps_for_wgrad():
  """The dgrad keeps the cotangent at `x @ w1`'s output for `dw1 = xᵀ @ ct` (`dw2` reads
  the outer cotangent and a residual), frees the residuals only it reads, and the wgrad
  frees the rest; `Stats.wgrad_bytes` is what is held in between."""
  params, x = mlp_case()
  layer = graphed("mlp", True)[0]
  y, pullback = layer.vjp(params, x)
  backward = pullback._backward
  pullback(jnp.ones_like(y))
  assert [a.shape for a in backward._stash] == [(x.shape[0], params["w1"].shape[1])]
  # Residuals only the dgrad read are let go; where the small ones travel packed in one
  # buffer (capture.PACK_PLATFORMS: GPUs) the wgrad reads that buffer, so it stays.
  assert (None in backward.kept) != bool(backward.entry.layout.packing.groups)
  held = [a for a in backward._stash + backward.kept if a is not None]
  assert sum(a.nbytes for a in held) == layer.stats.wgrad_bytes > 0
  assert graphed("mlp", False)[0].stats.wgrad_bytes == 0
  refs = [weakref.ref(a) for a in held]
  del held
  pullback.wgrad()
  assert all(ref() is None or ref().is_deleted() for ref in refs)
