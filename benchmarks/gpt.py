"""The GPT block stack the benchmarks run (the model of ../shared/bench/bench_jax.py).

Pre-LayerNorm causal self-attention and a GELU MLP, each added to the residual stream
through dropout; bf16 weights and activations, LayerNorm statistics in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

DTYPE = jnp.bfloat16
LR = 1e-3
DROPOUT = 0.1
# The platforms whose default attention is cuDNN's fused kernel; elsewhere XLA's (cuDNN
# attention does not compile for XLA:CPU).
@dataclasses.dataclass(frozen=True)
class Size:
  """One model size: width, heads, sequence length, batch and depth."""

  name: str
  d: int
  heads: int
  seq: int
  batch: int
  layers: int


SIZES = {
    "tiny": Size("tiny", d=32, heads=2, seq=8, batch=2, layers=2),
    "small": Size("small", d=512, heads=8, seq=256, batch=8, layers=12),
    "medium": Size("medium", d=2048, heads=16, seq=1024, batch=8, layers=12),
    "large": Size("large", d=4096, heads=32, seq=2048, batch=4, layers=12),
}


def init_block(key: jax.Array, d: int) -> dict[str, Any]:
  """The parameters of one block (bf16)."""
  ks = jax.random.split(key, 4)

  def linear(k: jax.Array, fan_in: int, fan_out: int) -> dict[str, jax.Array]:
    w = jax.random.normal(k, (fan_in, fan_out), jnp.float32) / fan_in ** 0.5
    return dict(w=w.astype(DTYPE), b=jnp.zeros((fan_out,), DTYPE))

  def norm() -> dict[str, jax.Array]:
    return dict(g=jnp.ones((d,), DTYPE), b=jnp.zeros((d,), DTYPE))

  return dict(ln1=norm(), qkv=linear(ks[0], d, 3 * d), proj=linear(ks[1], d, d), ln2=norm(),
              fc1=linear(ks[2], d, 4 * d), fc2=linear(ks[3], 4 * d, d))


def init_params(size: Size) -> list[dict[str, Any]]:
  return [init_block(k, size.d) for k in jax.random.split(jax.random.key(0), size.layers)]


def init_input(size: Size) -> jax.Array:
  x = jax.random.normal(jax.random.key(1), (size.batch, size.seq, size.d), jnp.float32)
  return x.astype(DTYPE)


def _layernorm(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
  return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * p["g"] + p["b"]


def _dropout(key: jax.Array | None, x: jax.Array) -> jax.Array:
  if key is None:
    return x
  keep = jax.random.bernoulli(key, 1 - DROPOUT, x.shape)
  return jnp.where(keep, x / (1 - DROPOUT), 0).astype(x.dtype)


def make_block(heads: int, attention: str | None, *, name_matmul_inputs: bool = False
               ) -> Callable[..., jax.Array]:
  """`block(params, x, *, key=None)`: dropout when a key is given, none without one.

  `attention` is `jax.nn.dot_product_attention`'s implementation ("cudnn", "xla" or None).
  `name_matmul_inputs` tags the normed inputs and the GELU output (what the forward writes
  out anyway, as matmul operands) with `checkpoint_name`, so a residual policy that saves
  named values (`jaxgraph.residuals.recompute_elementwise`) keeps them rather than
  recomputing them in the backward.
  """
  name = checkpoint_name if name_matmul_inputs else (lambda value, _: value)

  def block(p: dict[str, Any], x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
    b, t, d = x.shape
    k1, k2 = jax.random.split(key) if key is not None else (None, None)
    qkv = (name(_layernorm(p["ln1"], x), "matmul_input") @ p["qkv"]["w"]
           + p["qkv"]["b"]).reshape(b, t, 3, heads, d // heads)
    a = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True,
                                     implementation=attention).reshape(b, t, d)
    x = x + _dropout(k1, a @ p["proj"]["w"] + p["proj"]["b"])
    h = jax.nn.gelu(name(_layernorm(p["ln2"], x), "matmul_input") @ p["fc1"]["w"]
                    + p["fc1"]["b"], approximate=False)
    return x + _dropout(k2, name(h, "matmul_input") @ p["fc2"]["w"] + p["fc2"]["b"])

  return block


def loss(y: jax.Array) -> jax.Array:
  return jnp.mean(y.astype(jnp.float32) ** 2)


def sgd(params: Any, grads: Any) -> Any:
  return jax.tree.map(lambda p, g: (p - LR * g).astype(p.dtype), params, grads)
