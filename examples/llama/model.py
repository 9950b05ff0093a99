"""A Llama-style decoder in Flax NNX, written as an NNX user would write it.

RMSNorm, rotary position embeddings, grouped-query attention, a SwiGLU MLP, tied or untied
embeddings, residual dropout with call-time RNGs, fp32 params with bf16 compute, and a KV
cache for generation. Nothing in this file knows about jaxgraph; `layers.py` graphs it. The
only shape the model owes to graphing is one every NNX model already has: it is a list of
parts (`Llama.embed`, `Llama.blocks`, `Llama.head`), each a module whose `__call__` takes
arrays. See docs/llama.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

# Per layer: {"k": ..., "v": ...}, each (batch, cache length, kv heads, head dim).
Cache = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Config:
  """The model's shape and numerics.

  Attributes:
    vocab: number of token ids.
    width: model (residual stream) width.
    depth: number of decoder blocks.
    heads: query heads.
    kv_heads: key/value heads (grouped-query attention; divides `heads`).
    hidden: SwiGLU hidden width.
    dropout: residual dropout rate after attention and after the MLP (0 switches it off).
    tie_embeddings: the head projects with the embedding table instead of its own matrix.
    compute_dtype: the dtype of matmuls and activations; params stay float32.
    attention: `jax.nn.dot_product_attention` implementation for the causal (training and
      eval) attention: "cudnn" on GPU, None (XLA) elsewhere. Cached attention always uses XLA.
    rope_base: base of the rotary frequencies.
  """

  vocab: int
  width: int
  depth: int
  heads: int
  kv_heads: int
  hidden: int
  dropout: float = 0.0
  tie_embeddings: bool = True
  compute_dtype: Any = jnp.bfloat16
  attention: str | None = None
  rope_base: float = 10_000.0

  @property
  def head_dim(self) -> int:
    return self.width // self.heads


def _linear(config: Config, inputs: int, outputs: int, rngs: nnx.Rngs) -> nnx.Linear:
  # float32 params (the optimizer's master copy), cast to compute_dtype inside the call: the
  # gradients of the params come back float32.
  return nnx.Linear(inputs, outputs, use_bias=False, dtype=config.compute_dtype,
                    param_dtype=jnp.float32, rngs=rngs)


def _norm(config: Config, rngs: nnx.Rngs) -> nnx.RMSNorm:
  return nnx.RMSNorm(config.width, dtype=config.compute_dtype, param_dtype=jnp.float32,
                     rngs=rngs)


def rotary(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding of `x` (batch, length, heads, head dim) at `positions`."""
  half = x.shape[-1] // 2
  frequencies = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[:, None] * frequencies  # (length, half)
  cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
  first, second = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return rotated.astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query causal self-attention with rotary embeddings and an optional KV cache."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.config = config
    head_dim = config.head_dim
    self.query = _linear(config, config.width, config.heads * head_dim, rngs)
    self.key = _linear(config, config.width, config.kv_heads * head_dim, rngs)
    self.value = _linear(config, config.width, config.kv_heads * head_dim, rngs)
    self.out = _linear(config, config.heads * head_dim, config.width, rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, cache: Cache | None = None
               ) -> tuple[jax.Array, Cache | None]:
    """Attends `x` (batch, length, width) at `positions` (length,).

    Without a cache: causal attention within `x` (training, eval). With one: writes this
    call's keys and values at `positions` and attends to the cache up to each position
    (prefill of a prompt, then one token per decode step).
    """
    config = self.config
    batch, length, _ = x.shape
    q = self.query(x).reshape(batch, length, config.heads, config.head_dim)
    k = self.key(x).reshape(batch, length, config.kv_heads, config.head_dim)
    v = self.value(x).reshape(batch, length, config.kv_heads, config.head_dim)
    q, k = rotary(q, positions, config.rope_base), rotary(k, positions, config.rope_base)
    if cache is None:
      # In Auto sharding mode, also where jaxgraph traces the block on an Explicit mesh (FSDP
      # prefetch): cuDNN's kernel partitions itself there, and would be typed replicated
      # under Explicit axes. On an Auto mesh, or none, auto_axes changes nothing.
      attend = jax.sharding.auto_axes(
          lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                       implementation=config.attention),
          out_sharding=jax.typeof(q).sharding)
      out = attend(q, k, v)
    else:
      start = (0, positions[0], 0, 0)
      cache = {"k": jax.lax.dynamic_update_slice(cache["k"], k, start),
               "v": jax.lax.dynamic_update_slice(cache["v"], v, start)}
      visible = jnp.arange(cache["k"].shape[1])[None, :] <= positions[:, None]
      out = jax.nn.dot_product_attention(q, cache["k"], cache["v"], mask=visible[None, None])
    return self.out(out.reshape(batch, length, config.heads * config.head_dim)), cache


class SwiGLU(nnx.Module):
  """`down(silu(gate(x)) * up(x))`."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.gate = _linear(config, config.width, config.hidden, rngs)
    self.up = _linear(config, config.width, config.hidden, rngs)
    self.down = _linear(config, config.hidden, config.width, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """A pre-norm decoder block, with dropout on the attention and MLP residual branches.

  Dropout draws from call-time `rngs` (two sites, two different keys); without `rngs` the
  block is deterministic (eval, generation).
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.attention_norm = _norm(config, rngs)
    self.attention = Attention(config, rngs=rngs)
    self.mlp_norm = _norm(config, rngs)
    self.mlp = SwiGLU(config, rngs=rngs)
    self.attention_dropout = nnx.Dropout(config.dropout)
    self.mlp_dropout = nnx.Dropout(config.dropout)

  def __call__(self, x: jax.Array, positions: jax.Array, cache: Cache | None = None, *,
               rngs: nnx.Rngs | None = None) -> jax.Array | tuple[jax.Array, Cache]:
    """`x` (batch, length, width) at `positions` (length,); returns `x`, or `(x, cache)`."""
    deterministic = rngs is None
    attended, cache = self.attention(self.attention_norm(x), positions, cache)
    x = x + self.attention_dropout(attended, deterministic=deterministic, rngs=rngs)
    x = x + self.mlp_dropout(self.mlp(self.mlp_norm(x)), deterministic=deterministic, rngs=rngs)
    return x if cache is None else (x, cache)


class Head(nnx.Module):
  """Final norm and the projection to the vocabulary (the embedding table when tied)."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.norm = _norm(config, rngs)
    self.out = None if config.tie_embeddings else _linear(config, config.width, config.vocab,
                                                          rngs)

  def __call__(self, x: jax.Array, targets: jax.Array | None = None,
               table: jax.Array | None = None) -> jax.Array:
    """The mean cross-entropy against `targets`, or float32 logits when `targets` is None.

    `table` is the embedding table (vocab, width) when the embeddings are tied.
    """
    x = self.norm(x)
    logits = self.out(x) if self.out is not None else x @ table.astype(x.dtype).T
    logits = logits.astype(jnp.float32)
    if targets is None:
      return logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


class Llama(nnx.Module):
  """Embedding, `depth` decoder blocks, head."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = nnx.Embed(config.vocab, config.width, dtype=config.compute_dtype,
                           param_dtype=jnp.float32, rngs=rngs)
    self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.depth)])
    self.head = Head(config, rngs=rngs)

  def __call__(self, tokens: jax.Array, targets: jax.Array | None = None, *,
               rngs: nnx.Rngs | None = None) -> jax.Array:
    """The plain (ungraphed) forward: loss with `targets`, else logits."""
    positions = jnp.arange(tokens.shape[-1])
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, positions, rngs=rngs)
    table = self.embed.embedding[...] if self.config.tie_embeddings else None
    return self.head(x, targets, table)

  def init_cache(self, batch: int, length: int) -> list[Cache]:
    """An empty KV cache per block, for `length` positions."""
    config = self.config
    shape = (batch, length, config.kv_heads, config.head_dim)
    return [{"k": jnp.zeros(shape, config.compute_dtype),
             "v": jnp.zeros(shape, config.compute_dtype)} for _ in range(config.depth)]
