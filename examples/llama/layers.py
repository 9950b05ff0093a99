"""The model as layers: each part (embedding, blocks, head) a pure function with its params
(`split`), the tied head (`tie_head`), and the `make_graphed` calls that capture them
(`build_layers`; `PlainLayer` for --plain-ends)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

import jaxgraph as jg

from .model import Config, Llama

# --residuals: the graphed layers' `make_graphed(..., remat_policy=...)`.
RESIDUAL_POLICIES: dict[str, Callable[..., bool] | None] = {
    "recompute": jg.residuals.recompute_elementwise, "all": None}

Params = list[Any]  # one nnx.State per part (embedding, blocks..., head); FlatTrees with --flat
Layer = Any  # a jg.GraphedCallable, or a PlainLayer with --plain-ends
Batches = Sequence[tuple[jax.Array, jax.Array]]  # one (tokens, targets) per microbatch


class PlainLayer:
  """An end layer (embedding, head) under plain `jax.jit`, called like a GraphedCallable."""

  def __init__(self, fn: Callable[..., Any]):
    self._jitted = jax.jit(jg.flat.unravelling(fn))  # takes FlatTree params too (--flat)

  def __call__(self, *args: Any) -> Any:
    return self._jitted(*args)

  def vjp(self, *args: Any) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]:
    out, pullback = jax.vjp(self._jitted, *args)

    def backward(cotangent: Any) -> tuple[Any, ...]:
      # Each grad placed like its input, as a graphed layer's backward returns it (--fsdp:
      # sharded like the params; XLA's choice for the transposed jit may be replicated).
      def place(grad: Any, arg: Any) -> Any:
        if isinstance(grad, jax.Array) and isinstance(arg, jax.Array) and (
            grad.sharding != arg.sharding):
          return jax.device_put(grad, arg.sharding)
        return grad

      return jax.tree.map(place, pullback(cotangent), args)

    return out, backward


def split(model: Llama) -> tuple[list[Callable[..., Any]], Params]:
  """Each part of `model` as a pure function and its params; the blocks take call-time
  dropout rngs."""
  fns, params = zip(jg.flax.nnx_layer(model.embed),
                    *(jg.flax.nnx_layer(block, rngs_argument="rngs") for block in model.blocks),
                    jg.flax.nnx_layer(model.head))
  fns = list(fns)
  if model.config.tie_embeddings:
    fns[-1] = tie_head(fns[-1])
  return fns, list(params)


def tie_head(head_fn: Callable[..., Any]) -> Callable[..., Any]:
  """The head of tied embeddings taking the embedding's params as its last input (not the
  table): it reads the table from them inside its own executables, and its pullback returns
  the table's gradient shaped like the embedding's params (a FlatTree with --flat), which
  `accumulate` adds to the embedding's own. With --fsdp the table's all-gather is then part
  of the head's executables and its gradient comes back sharded like the embedding's buffer,
  instead of an eager gather before every head call: an executable of its own, outside the
  layers (one such hung a run of 2 CPU processes; `Placement.serial`)."""

  def head(params: Any, x: jax.Array, targets: jax.Array | None, embed: Any,
           **kwargs: Any) -> jax.Array:
    return head_fn(params, x, targets, embed["embedding"][...], **kwargs)

  head.__name__ = head_fn.__name__
  return head


def build_layers(fns: Sequence[Callable[..., Any]], sample_args: Sequence[tuple[Any, ...]], *,
                 graph_ends: bool, block_options: dict[str, Any] | None = None,
                 **options: Any) -> list[Layer]:
  """One `make_graphed` call over the blocks, and over the embedding and head unless plain.

  `block_options` (the decode's `donate_argnums`: only blocks take a cache) apply to the
  blocks alone, which then get a `make_graphed` call of their own (and the ends another).
  """
  if graph_ends and not block_options:
    return list(jg.make_graphed(list(fns), sample_args=list(sample_args), **options))
  blocks = jg.make_graphed(list(fns[1:-1]), sample_args=list(sample_args[1:-1]), **options,
                           **(block_options or {}))
  if not graph_ends:
    return [PlainLayer(fns[0]), *blocks, PlainLayer(fns[-1])]
  embed, head = jg.make_graphed([fns[0], fns[-1]], sample_args=[sample_args[0], sample_args[-1]],
                                **options)
  return [embed, *blocks, head]


def graphed(layers: Sequence[Layer]) -> list[jg.GraphedCallable]:
  return [layer for layer in layers if isinstance(layer, jg.GraphedCallable)]


def tied_inputs(params: Params, config: Config) -> tuple[Any, ...]:
  """The head's extra input: the embedding's params when the embeddings are tied
  (`tie_head`)."""
  return (params[0],) if config.tie_embeddings else ()

