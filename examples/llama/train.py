"""Train the Llama-style model of model.py with every decoder block graphed, then generate.

  PYTHONPATH=. python examples/llama/train.py --preset cpu    # 1.5 min of CPU time, 2 cores
  PYTHONPATH=. python examples/llama/train.py --preset tiny   # 12 steps, mostly compiling (CI)
  PYTHONPATH=. python examples/llama/train.py --preset gpu    # one GPU; also times one
                                                              # whole-step jax.jit of the model
  ... --stop-after 40, then the same command with --resume    # bitwise the uninterrupted run
  ... --check           # the same steps under one whole-step jax.jit, compared
  ... --plain-ends      # embedding and head under plain jax.jit instead of graphed
  ... --untied --dropout 0 --microbatches 4 --dtype float32
  ... --flat            # each part's params as flat buffers (jg.flat): fewer leaves per call

Training: fp32 master params and bf16 compute inside each layer; Optax AdamW without decay on
the norms, global-norm clipping, a warmup-cosine schedule; gradient accumulation over
microbatches; a held-out loss every `eval_every` steps through a forward-only
(`inference_only=True`) capture of the layers; Orbax checkpoints holding each layer's key-stream
position; a tqdm bar; `loss.png` (train and held-out) and `metrics.json` in `--out`. Then
generation with a KV cache: a prefill and a one-token decode, two signatures, each captured
once, the blocks donating their cache (updated in place, not copied), and the decode loop
asserted not to compile. docs/llama.md walks through it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxgraph as jg

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # examples/common.py
from common import (CORPUS, Checkpoints, Corpus, Streams, params_digest, plot,  # noqa: E402
                    run_parser, stream_keys, stream_positions)
from model import Cache, Config, Llama  # noqa: E402

try:
  from tqdm import tqdm
except ImportError:  # tqdm is optional (the "examples" extra): then the log lines only

  class tqdm:  # noqa: N801 (tqdm's name)
    """The part of tqdm's interface used here, without a bar."""

    def __init__(self, iterable: Any, **_: Any):
      self._iterable = iterable

    def __iter__(self) -> Any:
      return iter(self._iterable)

    def set_postfix(self, **_: Any) -> None:
      pass

    def write(self, line: str) -> None:
      print(line, flush=True)

    def close(self) -> None:
      pass


Params = list[Any]  # one nnx.State per part (embedding, blocks..., head); FlatTrees with --flat
Layer = Any  # a jg.GraphedCallable, or a PlainLayer with --plain-ends


@dataclasses.dataclass(frozen=True)
class Preset:
  context: int
  width: int
  depth: int
  heads: int
  kv_heads: int
  hidden: int
  batch: int          # sequences per microbatch
  microbatches: int   # accumulated per optimizer step
  steps: int
  learning_rate: float
  dropout: float
  eval_every: int
  eval_batches: int
  checkpoint_every: int
  attention: str | None = None  # jax.nn.dot_product_attention implementation (training)
  check: bool = False           # run --check by default (the GPU preset: both throughputs)


PRESETS = {
    "tiny": Preset(context=32, width=32, depth=2, heads=4, kv_heads=2, hidden=64, batch=8,
                   microbatches=2, steps=12, learning_rate=3e-3, dropout=0.1, eval_every=6,
                   eval_batches=2, checkpoint_every=10),
    "cpu": Preset(context=64, width=128, depth=4, heads=4, kv_heads=2, hidden=352, batch=16,
                  microbatches=2, steps=250, learning_rate=3e-3, dropout=0.1, eval_every=50,
                  eval_batches=4, checkpoint_every=100),
    "gpu": Preset(context=512, width=768, depth=12, heads=12, kv_heads=4, hidden=2048,
                  batch=16, microbatches=2, steps=300, learning_rate=6e-4, dropout=0.1,
                  eval_every=100, eval_batches=8, checkpoint_every=150, attention="cudnn",
                  check=True),
}


# --------------------------------------------------------------------------------- layers


class PlainLayer:
  """An end layer (embedding, head) under plain `jax.jit`, called like a GraphedCallable."""

  def __init__(self, fn: Callable[..., Any]):
    self._jitted = jax.jit(jg.flat.unravelling(fn))  # takes FlatTree params too (--flat)

  def __call__(self, *args: Any) -> Any:
    return self._jitted(*args)

  def vjp(self, *args: Any) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]:
    return jax.vjp(self._jitted, *args)


def split(model: Llama) -> tuple[list[Callable[..., Any]], Params]:
  """Each part of `model` as a pure function and its params; the blocks take call-time
  dropout rngs."""
  fns, params = zip(jg.flax.nnx_layer(model.embed),
                    *(jg.flax.nnx_layer(block, rngs_argument="rngs") for block in model.blocks),
                    jg.flax.nnx_layer(model.head))
  return list(fns), list(params)


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


def tied_table(params: Params, config: Config) -> tuple[jax.Array, ...]:
  """The head's extra input: the embedding table when the embeddings are tied (with
  --flat, a slice of the embedding's buffer)."""
  return (jg.flat.unravel(params[0])["embedding"][...],) if config.tie_embeddings else ()


# ------------------------------------------------------------------------------- training

Grads = tuple[Params, jax.Array]  # summed grads and summed loss over the microbatches so far


def accumulate(total: Grads, grads: Params, table_grad: jax.Array | None,
               loss: jax.Array) -> Grads:
  """Adds one microbatch's grads and loss; `table_grad` is the tied head's share of the
  embedding table's grad (None when it is already in `grads[0]`)."""
  if table_grad is not None:
    # The embedding's only param is its table (with --flat, the one buffer holding it).
    grads = [jax.tree.map(lambda g: g + table_grad.reshape(g.shape), grads[0]), *grads[1:]]
  return jax.tree.map(jnp.add, total, (grads, loss))


def apply_update(tx: optax.GradientTransformation, microbatches: int, total: Grads,
                 opt_state: Any, params: Params) -> tuple[Params, Any, jax.Array]:
  """Averages the accumulated grads and loss over the microbatches; one optimizer update."""
  grads, loss = jax.tree.map(lambda t: t / microbatches, total)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def decays(path: tuple[Any, ...]) -> bool:
  """Weight decay on the matrices (kernels, the embedding table), not on the norm scales."""
  return any(getattr(k, "key", None) in ("kernel", "embedding") for k in path)


def decay_mask(params: Params) -> Params:
  """`decays` per leaf of the params, or per buffer of FlatTree params (--flat)."""
  if any(jg.flat.is_flat(p) for p in params):
    return jg.flat.mask(params, lambda group: group == "decay")
  return jax.tree_util.tree_map_with_path(lambda path, _: decays(path), params)


def flat_group(path: tuple[Any, ...], leaf: jax.Array) -> str:
  """--flat's buffers: "decay" and "no_decay" leaves apart, so that the AdamW mask is one
  bool per buffer."""
  return "decay" if decays(path) else "no_decay"


def optimizer(preset: Preset, steps: int) -> optax.GradientTransformation:
  warmup = max(1, steps // 20)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, preset.learning_rate, warmup, max(steps, warmup + 1), preset.learning_rate / 10)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask))


class Trainer:
  """The graphed training step and the pieces it shares with the whole-step reference."""

  def __init__(self, layers: Sequence[Layer], config: Config, tx: optax.GradientTransformation,
               microbatches: int, params: Params, opt_state: Any):
    self.layers, self.config, self.tx, self.microbatches = layers, config, tx, microbatches
    self.one = jnp.ones((), jnp.float32)  # the loss cotangent
    zeros = jax.jit(lambda params: (jax.tree.map(jnp.zeros_like, params),
                                    jnp.zeros((), jnp.float32)))
    # Compiled ahead like the layers, so the first step pays for no compile.
    self.zeros = zeros.lower(params).compile()
    total = jax.eval_shape(zeros, params)
    table = (jax.eval_shape(lambda: tied_table(params, config))[0]
             if config.tie_embeddings else None)
    self.accumulate = jax.jit(accumulate, donate_argnums=0).lower(
        total, total[0], table, total[1]).compile()
    # The summed grads' buffers become the new params (donating the params too would leave
    # one of the two unused).
    self.apply = jax.jit(functools.partial(apply_update, tx, microbatches),
                         donate_argnums=(0, 1)).lower(total, opt_state, params).compile()

  def microbatch(self, params: Params, tokens: jax.Array, targets: jax.Array,
                 positions: jax.Array) -> tuple[jax.Array, Params, jax.Array | None]:
    """Graphed forwards, then graphed backwards in reverse: (loss, grads, table grad)."""
    embed, blocks, head = self.layers[0], self.layers[1:-1], self.layers[-1]
    x, embed_pullback = embed.vjp(params[0], tokens)
    x, blocks_pullback = jg.sequential_vjp(blocks, params[1:-1], x, consts=(positions,))
    loss, head_pullback = head.vjp(params[-1], x, targets, *tied_table(params, self.config))
    head_grads, x_grads, _, *tied_grads = head_pullback(self.one)
    block_grads, x_grads = blocks_pullback(x_grads)
    embed_grads, _ = embed_pullback(x_grads)
    table_grad = tied_grads[0] if tied_grads else None
    return loss, [embed_grads, *block_grads, head_grads], table_grad

  def grads(self, params: Params, batches: Sequence[tuple[jax.Array, jax.Array]],
            positions: jax.Array) -> Grads:
    """The grads and loss summed over `batches` (one (tokens, targets) per microbatch)."""
    total = self.zeros(params)
    for tokens, targets in batches:
      loss, grads, table_grad = self.microbatch(params, tokens, targets, positions)
      total = self.accumulate(total, grads, table_grad, loss)
    return total

  def step(self, params: Params, opt_state: Any, batches: Sequence[tuple[jax.Array, jax.Array]],
           positions: jax.Array) -> tuple[Params, Any, jax.Array]:
    """One optimizer step over `batches`: (params, opt_state, mean loss)."""
    return self.apply(self.grads(params, batches, positions), opt_state, params)


def step_batches(corpus: Corpus, step: int, microbatches: int
                 ) -> list[tuple[jax.Array, jax.Array]]:
  return [corpus.batch_at(step * microbatches + m) for m in range(microbatches)]


def evaluate(layers: Sequence[Layer], params: Params, config: Config, corpus: Corpus,
             batches: int, positions: jax.Array) -> float:
  """Mean held-out loss through the forward-only layers (no residuals are kept)."""
  losses = []
  for index in range(batches):
    tokens, targets = corpus.eval_batch(index)
    x = layers[0](params[0], tokens)
    for layer, layer_params in zip(layers[1:-1], params[1:-1]):
      x = layer(layer_params, x, positions)
    losses.append(layers[-1](params[-1], x, targets, *tied_table(params, config)))
  return float(jnp.mean(jnp.stack(losses)))


# ------------------------------------------------------------------- whole-step reference


def make_whole_step(fns: Sequence[Callable[..., Any]], trainer: Trainer) -> Any:
  """The same step as one `jax.jit`: the same layer functions, keys, accumulation, update."""
  config, microbatches = trainer.config, trainer.microbatches
  embed_fn, block_fns, head_fn = fns[0], fns[1:-1], fns[-1]

  def loss_fn(params, tokens, targets, positions, keys):
    params = jg.flat.unravel(params)  # --flat: differentiated through the unravelling
    x = embed_fn(params[0], tokens)
    for fn, layer_params, key in zip(block_fns, params[1:-1], keys):
      x = fn(layer_params, x, positions, key=key)
    return head_fn(params[-1], x, targets, *tied_table(params, config))

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, tokens, targets, positions, keys):
    total = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
    for m in range(microbatches):
      loss, grads = jax.value_and_grad(loss_fn)(params, tokens[m], targets[m], positions,
                                                keys[m])
      total = accumulate(total, grads, None, loss)
    # The summed grads are returned too, for --check to compare.
    return *apply_update(trainer.tx, microbatches, total, opt_state, params), total

  return step


def block_keys(streams: Streams, graph_ends: bool, offset: int, microbatches: int
               ) -> list[list[jax.Array]]:
  """Per microbatch, the keys the blocks' streams draw in the step `offset` steps on."""
  keys = [stream_keys(streams, offset * microbatches + m) for m in range(microbatches)]
  return [k[1:-1] if graph_ends else k for k in keys]


def first_step_grads(trainer: Trainer, params: Params, corpus: Corpus, step: int,
                     positions: jax.Array) -> Grads:
  """The graphed grads of training step `step` (not applied); the key streams are rewound,
  so the training run that follows draws the same keys."""
  layers = graphed(trainer.layers)
  streams = stream_positions(layers)
  total = trainer.grads(params, step_batches(corpus, step, trainer.microbatches), positions)
  for layer, (base, counter) in zip(layers, streams):
    layer.seed(base, counter=counter)
  return total


def compare_with_whole_step(fns: Sequence[Callable[..., Any]], trainer: Trainer,
                            start: tuple[Params, Any, Streams], graph_ends: bool,
                            corpus: Corpus, steps: range, positions: jax.Array,
                            losses: Sequence[float], first_grads: Grads, params: Params
                            ) -> dict[str, Any]:
  """Reruns `steps` from `start` under one whole-step `jax.jit` with the same keys.

  Returns the differences to the graphed run (the first step's summed grads and loss,
  `first_grads`; every step's loss; the final `params`) and the whole step's compile time
  and throughput.
  """
  check_params, check_state, streams = start
  microbatches = trainer.microbatches

  def inputs(offset: int) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
    batches = step_batches(corpus, steps[offset], microbatches)
    return (jnp.stack([t for t, _ in batches]), jnp.stack([t for _, t in batches]), positions,
            block_keys(streams, graph_ends, offset, microbatches))

  begin = time.perf_counter()
  whole_step = make_whole_step(fns, trainer).lower(check_params, check_state,
                                                   *inputs(0)).compile()
  compile_seconds = time.perf_counter() - begin

  def max_diff(a: Params, b: Params) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))

  # The keys are drawn before the loop (the graphed layers draw theirs on the device).
  step_inputs = [inputs(offset) for offset in range(len(steps))]
  check_losses = []
  for offset, step_input in enumerate(step_inputs):
    check_params, check_state, loss, total = whole_step(check_params, check_state, *step_input)
    check_losses.append(loss)
    if offset == 0:
      whole_first = total
  check_losses = [float(loss) for loss in check_losses]
  return {
      "first_step_loss_diff": abs(float(first_grads[1]) - float(whole_first[1])),
      "first_step_max_grad_diff": max_diff(first_grads[0], whole_first[0]),
      "max_loss_diff": max(abs(a - b) for a, b in zip(losses, check_losses)),
      "last_max_param_diff": max_diff(params, check_params),
      "whole_step_compile_seconds": round(compile_seconds, 3),
      "throughput": throughput_rounds(trainer, whole_step, params, check_state, corpus,
                                      positions, step_inputs[0][3]),
  }


def throughput_rounds(trainer: Trainer, whole_step: Any, params: Params, opt_state: Any,
                      corpus: Corpus, positions: jax.Array, keys: Any, *, rounds: int = 3,
                      steps: int = 10) -> dict[str, list[float]]:
  """Tokens/s of the graphed step and of the whole-step jit, timed alternately: `rounds`
  rounds of `steps` steps each, from copies of `params` and `opt_state` (the results are
  dropped). Batches are made inside the timed loop for both, as in training."""
  microbatches = trainer.microbatches
  tokens_per_step = microbatches * corpus.batch * corpus.context
  rates: dict[str, list[float]] = {"graphed": [], "whole_step": []}

  def graphed_step(state: tuple[Params, Any], step: int) -> tuple[Params, Any]:
    new_params, new_state, _ = trainer.step(*state, step_batches(corpus, step, microbatches),
                                            positions)
    return new_params, new_state

  def whole(state: tuple[Params, Any], step: int) -> tuple[Params, Any]:
    batches = step_batches(corpus, step, microbatches)
    new_params, new_state, _, _ = whole_step(
        *state, jnp.stack([t for t, _ in batches]), jnp.stack([t for _, t in batches]),
        positions, keys)
    return new_params, new_state

  for index in range(rounds):
    order = [("graphed", graphed_step), ("whole_step", whole)]
    for name, run in (order if index % 2 == 0 else order[::-1]):
      state = (jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt_state))
      state = jax.block_until_ready(run(state, 0))  # not timed: one step to settle
      begin = time.perf_counter()
      for step in range(1, steps + 1):
        state = run(state, step)
      jax.block_until_ready(state)
      rates[name].append(round(steps * tokens_per_step / (time.perf_counter() - begin), 1))
  return rates


def report_check(found: dict[str, Any], graphed_rate: float, compute_dtype: Any,
                 steps: int) -> None:
  """Prints what `compare_with_whole_step` found, why it is not bitwise, both throughputs."""
  bitwise = found["first_step_loss_diff"] == 0 and found["first_step_max_grad_diff"] == 0
  print(f"--check against one whole-step jax.jit (compiled in "
        f"{found['whole_step_compile_seconds']:.1f} s), same keys: first step "
        f"{'bitwise equal' if bitwise else 'NOT bitwise equal'} (|loss diff| "
        f"{found['first_step_loss_diff']:.3g}, max |grad diff| "
        f"{found['first_step_max_grad_diff']:.3g}); over {steps} steps max |loss diff| "
        f"{found['max_loss_diff']:.3g}, final max |param diff| "
        f"{found['last_max_param_diff']:.3g}.")
  if not bitwise:
    why = ("where XLA keeps the bf16 activations in excess precision "
           "(XLA_FLAGS=--xla_allow_excess_precision=false rounds them, as the graphed layers "
           "do)" if compute_dtype == jnp.bfloat16 else
           "and its fused kernels sum some products in another order (last-bit differences)")
    print(f"  Not bitwise: the whole step fuses across layer boundaries, {why}. See "
          "docs/llama.md.")
  rates = found["throughput"]
  graphed, whole = (statistics.median(rates[k]) for k in ("graphed", "whole_step"))
  spread = lambda k: 100 * (max(rates[k]) - min(rates[k])) / statistics.median(rates[k])
  print(f"tokens/s, {len(rates['graphed'])} alternating rounds (median, spread): graphed "
        f"{graphed:,.0f} ({spread('graphed'):.0f}%), whole-step jax.jit {whole:,.0f} "
        f"({spread('whole_step'):.0f}%), graphed/whole-step {graphed / whole:.3f} "
        f"(the training loop above: {graphed_rate:,.0f} graphed)")


# ----------------------------------------------------------------------------- generation


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
          + [(params[-1], last, None, *tied_table(params, config))])


def generate(prefill: Sequence[Layer], decode: Sequence[Layer], params: Params, config: Config,
             caches: list[Cache], prompt: jax.Array, new_tokens: int, temperature: float,
             key: jax.Array) -> list[int]:
  """Prefills the KV caches with `prompt` (1, length), then decodes `new_tokens` one by one.

  The caches go into every block call, donated, and come back updated (the list holds the
  returned ones). The decode loop must replay without compiling: asserted on the decode
  layers' `stats`.
  """
  table = tied_table(params, config)
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


# ----------------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
  parser = run_parser(__doc__.split("\n\n")[0], PRESETS)
  parser.add_argument("--check", action=argparse.BooleanOptionalAction,
                      help="also run the steps under one whole-step jax.jit and compare "
                           "(default: on for --preset gpu)")
  parser.add_argument("--plain-ends", action="store_true",
                      help="embedding and head under plain jax.jit instead of graphed")
  parser.add_argument("--untied", action="store_true", help="a head matrix of its own")
  parser.add_argument("--dropout", type=float, help="residual dropout rate (default: preset)")
  parser.add_argument("--microbatches", type=int, help="per step (default: the preset's)")
  parser.add_argument("--flat", action="store_true",
                      help="each part's params as flat buffers (jg.flat.ravel), one per "
                           "(decay group, dtype): fewer leaves per executable call")
  parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                      help="compute dtype (params are float32 either way)")
  parser.add_argument("--attention", choices=("xla", "cudnn"),
                      help="dot_product_attention implementation (default: the preset's)")
  parser.add_argument("--generate", type=int, default=48, help="tokens to generate at the end")
  parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/llama"))
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  for name in ("steps", "stop_after", "microbatches"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} takes a number >= 1")
  return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse(argv)
  preset = PRESETS[args.preset]
  preset = dataclasses.replace(preset, **{
      name: value for name, value in (("dropout", args.dropout),
                                       ("microbatches", args.microbatches),
                                       ("attention", args.attention)) if value is not None})
  if preset.attention == "cudnn" and args.dtype != "bfloat16":
    sys.exit("cuDNN attention computes in bf16 or fp16: with --dtype float32 pass "
             "--attention xla")
  check = preset.check if args.check is None else args.check
  total = args.steps or preset.steps
  stop = min(total, args.stop_after or total)
  graph_ends = not args.plain_ends
  args.out.mkdir(parents=True, exist_ok=True)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; preset {args.preset}: {preset}")

  corpus = Corpus(CORPUS, preset.context, preset.batch, args.seed, held_out=0.1)
  config = Config(vocab=len(corpus.chars), width=preset.width, depth=preset.depth,
                  heads=preset.heads, kv_heads=preset.kv_heads, hidden=preset.hidden,
                  dropout=preset.dropout, tie_embeddings=not args.untied,
                  compute_dtype=jnp.dtype(args.dtype),
                  attention=None if preset.attention == "xla" else preset.attention)
  model = Llama(config, rngs=nnx.Rngs(params=args.seed))

  fns, params = split(model)
  print(f"{sum(x.size for x in jax.tree.leaves(params)):,} params ({len(params)} parts), "
        f"vocab {config.vocab}, {len(corpus.ids):,} training and "
        f"{len(corpus.held_out_ids):,} held-out characters")
  if args.flat:  # from here on params, grads and the optimizer state are FlatTrees
    params = [jg.flat.ravel(p, group=flat_group) for p in params]
    print(f"params held flat: {len(jax.tree.leaves(params))} buffers for "
          f"{sum(len(p.layout.slots) for p in params)} leaves")

  # Capture. Training: forward + backward, dropout keys from each layer's stream. Eval: a
  # forward-only copy of the same functions without keys (dropout off), for the same shapes.
  tokens = jax.ShapeDtypeStruct((preset.batch, preset.context), jnp.int32)
  x = jax.ShapeDtypeStruct((preset.batch, preset.context, config.width), config.compute_dtype)
  positions = jnp.arange(preset.context)
  table = tied_table(params, config)
  sample_args = ([(params[0], tokens)] + [(p, x, positions) for p in params[1:-1]]
                 + [(params[-1], x, tokens, *table)])
  begin = time.perf_counter()
  train_layers = build_layers(fns, sample_args, graph_ends=graph_ends,
                              rng=jax.random.key(args.seed))
  eval_layers = build_layers(fns, sample_args, graph_ends=graph_ends, inference_only=True)
  capture_seconds = time.perf_counter() - begin
  print(f"captured training and eval layers in {capture_seconds:.1f} s (incl. warmup)"
        + ("" if graph_ends else "; embedding and head run under plain jax.jit"))
  for kind, layers in (("train", train_layers), ("eval", eval_layers)):
    for layer in graphed(layers):
      s = layer.stats
      print(f"  {kind:<5} {layer.name:<12} captures {s.captures}  cache hits {s.cache_hits}  "
            f"compiles {s.compiles}  compile {s.compile_seconds:.2f} s")

  tx = optimizer(preset, total)
  opt_state = tx.init(params)
  trainer = Trainer(train_layers, config, tx, preset.microbatches, params, opt_state)

  checkpoints = Checkpoints.for_run(args.out, resume=args.resume)
  metrics_path = args.out / "metrics.json"
  first, losses, eval_losses = 0, [], []
  restored = checkpoints.restore(params, opt_state, graphed(train_layers)) if args.resume else None
  if restored is not None:
    first, params, opt_state = restored
    metrics = json.loads(metrics_path.read_text())
    losses = metrics["losses"][:first]
    eval_losses = [(s, l) for s, l in metrics["eval_losses"] if s <= first]
    print(f"resumed from step {first} ({checkpoints.directory})")
  elif args.resume:
    print("no checkpoint to resume from; starting at step 0")
  if check:
    check_start = (jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt_state),
                   stream_positions(graphed(train_layers)))
    first_grads = first_step_grads(trainer, params, corpus, first + 1, positions)

  # Training. Losses stay on the device until a log point reads them; eval and checkpoint
  # time is not counted as training time.
  tokens_per_step = preset.microbatches * preset.batch * preset.context
  pending: list[jax.Array] = []
  seconds, mark = 0.0, time.perf_counter()
  bar = tqdm(range(first + 1, stop + 1), initial=first, total=total, desc="train",
             unit="step", mininterval=1.0)
  for step in bar:
    params, opt_state, loss = trainer.step(params, opt_state,
                                           step_batches(corpus, step, preset.microbatches),
                                           positions)
    pending.append(loss)
    evaluate_now = step % preset.eval_every == 0 or step == total
    save = step % preset.checkpoint_every == 0 or step == stop
    if not (evaluate_now or save or step % 10 == 0):
      continue
    losses.extend(float(l) for l in pending)
    pending.clear()
    seconds += time.perf_counter() - mark
    rate = (step - first) * tokens_per_step / seconds
    bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{rate:,.0f}")
    if evaluate_now:
      eval_losses.append((step, evaluate(eval_layers, params, config, corpus,
                                         preset.eval_batches, positions)))
      bar.write(f"step {step:>5}: train loss {losses[-1]:.4f}, held-out loss "
                f"{eval_losses[-1][1]:.4f}")
    if save:
      checkpoints.save(step, params, opt_state, graphed(train_layers))
      metrics_path.write_text(json.dumps({"step": step, "losses": losses,
                                          "eval_losses": eval_losses}))
    mark = time.perf_counter()
  bar.close()

  run_steps = stop - first
  result: dict[str, Any] = {
      "preset": args.preset, "step": stop, "losses": losses, "eval_losses": eval_losses,
      "final_loss": losses[-1], "train_seconds": round(seconds, 3),
      "capture_seconds": round(capture_seconds, 3),
      "tokens_per_second": round(run_steps * tokens_per_step / seconds, 1) if seconds else None,
      "params_sha256": params_digest(params),
      "stats": {f"{kind} {layer.name}": layer.stats._asdict()
                for kind, layers in (("train", train_layers), ("eval", eval_layers))
                for layer in graphed(layers)},
  }
  held_out = f", held-out {eval_losses[-1][1]:.4f}" if eval_losses else ""
  print(f"trained steps {first + 1}-{stop}: final loss {losses[-1]:.4f}{held_out}; "
        f"{result['tokens_per_second'] or 0:,.0f} tok/s graphed ({seconds:.1f} s of training)")

  if check and run_steps:
    found = compare_with_whole_step(fns, trainer, check_start, graph_ends, corpus,
                                    range(first + 1, stop + 1), positions, losses[first:],
                                    first_grads, params)
    result["check"] = found
    report_check(found, result["tokens_per_second"], config.compute_dtype, run_steps)

  plot(losses, args.out / "loss.png", f"Llama ({args.preset}), blocks graphed", eval_losses)
  metrics_path.write_text(json.dumps(result, indent=1))

  if args.generate:
    result["generation"] = write_sample(model, fns, params, corpus, graph_ends,
                                        min(args.generate, preset.context // 2),
                                        args.temperature, args.seed)
    metrics_path.write_text(json.dumps(result, indent=1))
  print(f"wrote {args.out / 'loss.png'}, {metrics_path}, {checkpoints.directory}")
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
