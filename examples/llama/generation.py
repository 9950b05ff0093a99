"""Generation with a KV cache: a prefill and a one-token decode captured forward-only, the
blocks donating their caches; the decode loop asserted not to compile."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from examples.corpus import Corpus

from .layers import Layer, Params, build_layers, graphed, tied_inputs
from .model import Cache, Config, Llama


def generation_args(params: Params, config: Config, cache: Cache, length: int
                    ) -> list[tuple[Any, ...]]:
  """`sample_args` of a generation call on `length` new positions of one sequence with a KV
  cache: the prompt's length for the prefill, 1 for a decode step. The head sees the last
  position only."""
  tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
  x = jax.ShapeDtypeStruct((1, length, config.width), config.compute_dtype)
  positions = jax.ShapeDtypeStruct((length,), jnp.int32)
  last = jax.ShapeDtypeStruct((1, 1, config.width), config.compute_dtype)
  return ([(params[0], tokens)] + [(p, x, positions, cache) for p in params[1:-1]]
          + [(params[-1], last, None, *tied_inputs(params, config))])


def generate(prefill: Sequence[Layer], decode: Sequence[Layer], params: Params, config: Config,
             caches: list[Cache], prompt: jax.Array, new_tokens: int, temperature: float,
             key: jax.Array) -> list[int]:
  """Prefills the KV caches with `prompt` (1, length), then decodes `new_tokens` one by one.

  The caches go into every block call, donated, and come back updated (the list holds the
  returned ones). The decode loop must replay without compiling: asserted on the decode
  layers' `stats`.
  """
  table = tied_inputs(params, config)
  length = prompt.shape[1]
  x = prefill[0](params[0], prompt)
  positions = jnp.arange(length)
  for i, (layer, layer_params) in enumerate(zip(prefill[1:-1], params[1:-1])):
    x, caches[i] = layer(layer_params, x, positions, caches[i])
  logits = prefill[-1](params[-1], x[:, -1:], None, *table)

  compiles = [layer.stats.compiles for layer in graphed(decode)]
  out = []
  for t in range(length, length + new_tokens):
    if temperature:
      token = jax.random.categorical(jax.random.fold_in(key, t), logits[:, -1] / temperature)
    else:
      token = jnp.argmax(logits[:, -1], axis=-1)
    token = token.astype(jnp.int32)[:, None]
    out.append(int(token[0, 0]))
    x = decode[0](params[0], token)
    positions = jnp.full((1,), t, jnp.int32)
    for i, (layer, layer_params) in enumerate(zip(decode[1:-1], params[1:-1])):
      x, caches[i] = layer(layer_params, x, positions, caches[i])
    logits = decode[-1](params[-1], x, None, *table)
  after = [layer.stats.compiles for layer in graphed(decode)]
  assert after == compiles, f"the decode loop compiled: {compiles} -> {after}"
  return out


def write_sample(model: Llama, fns: Sequence[Callable[..., Any]], params: Params,
                 corpus: Corpus, graph_ends: bool, new_tokens: int, temperature: float,
                 seed: int) -> dict[str, Any]:
  """Captures a prefill and a decode, generates `new_tokens` after a held-out prompt that
  fills the rest of the context, prints them; returns them with the decode layers' stats."""
  config, context = model.config, corpus.context
  length = context - new_tokens
  # Two more signatures, forward only: the prompt at once, then one token at a time, each
  # block taking its KV cache in and returning it updated.
  caches = model.init_cache(1, context)
  cache = jax.eval_shape(lambda: caches[0])
  begin = time.perf_counter()
  # The blocks donate their cache (argument 3): XLA writes the new keys and values into it
  # instead of copying every layer's whole cache per token.
  donate = {"donate_argnums": (3,)}
  prefill = build_layers(fns, generation_args(params, config, cache, length),
                         graph_ends=graph_ends, inference_only=True, block_options=donate)
  decode = build_layers(fns, generation_args(params, config, cache, 1), graph_ends=graph_ends,
                        inference_only=True, block_options=donate)
  print(f"captured prefill ({length} tokens) and decode (1 token) in "
        f"{time.perf_counter() - begin:.1f} s")
  prompt = corpus.held_out_ids[:length]
  out = generate(prefill, decode, params, config, caches, jnp.asarray(prompt)[None],
                 new_tokens, temperature, jax.random.key(seed))
  block = decode[1].stats
  print(f"decoded {new_tokens} tokens, each block's cache donated: {decode[1].name} compiled "
        f"{block.compiles} executable at capture (the other blocks share it), replayed "
        f"{block.replays} times, and nothing compiled in the decode loop\n"
        f"prompt: {corpus.decode(prompt)!r}\ncontinuation: {corpus.decode(out)!r}")
  return {"prompt": corpus.decode(prompt), "continuation": corpus.decode(out),
          "decode_stats": {layer.name: layer.stats._asdict() for layer in graphed(decode)}}

