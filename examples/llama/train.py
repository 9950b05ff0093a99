"""Train the Llama-style model of model.py with every decoder block graphed, then generate.

  PYTHONPATH=. python examples/llama/train.py --preset cpu    # 1.5 min of CPU time, 2 cores
  PYTHONPATH=. python examples/llama/train.py --preset tiny   # 12 steps, mostly compiling (CI)
  PYTHONPATH=. python examples/llama/train.py --preset gpu    # one GPU; also times one
                                                              # whole-step jax.jit of the model
  PYTHONPATH=. python examples/llama/train.py --preset gpu-1b # ~1B params on one 80 GB GPU
  ... --stop-after 40, then the same command with --resume    # bitwise the uninterrupted run
  ... --fresh           # a new run in an --out that holds one (moved to OUT/earlier-N/)
  ... --check           # the same steps under one whole-step jax.jit, compared and timed
  ... --whole-step      # the same training loop through one whole-step jax.jit instead
  ... --rounds 5 --round-steps 40   # how tokens/s is measured (steady-state rounds)
  ... --plain-ends      # embedding and head under plain jax.jit instead of graphed
  ... --untied --dropout 0 --microbatches 4 --dtype float32
  ... --no-flat         # params as pytrees instead of flat buffers (jg.flat, the default)
  ... --residuals all   # keep every jax.vjp residual (default: recompute elementwise ones)
  ... --fsdp 8          # params, grads and AdamW state sharded over 8 devices (jg.fsdp),
                        # each batch split over them; --check's whole step sharded alike
  ... --fsdp 8 --coordinator HOST:PORT --num-processes 2 --process-id I
                        # one of 2 processes of one run (jax.distributed); docs/fsdp.md
  ... --context 8192 --batch 2 --vocab 8192 --text stdlib   # tokens per sequence, vocabulary
  ... --offload slowdown=5%   # the blocks' residuals in host memory as jaxgraph.offload.plan
                              # picks them (also: all, memory=4GiB); docs/llama.md

Training: fp32 master params and bf16 compute inside each layer; Optax AdamW without decay on
the norms, global-norm clipping, a warmup-cosine schedule; gradient accumulation over
microbatches; a held-out loss every `eval_every` steps through a forward-only
(`inference_only=True`) capture of the layers; Orbax checkpoints holding each layer's key-stream
position, the run's config, the loss history and a digest of every array, verified on resume;
a tqdm bar; tokens/s measured in steady-state rounds; `loss.png` (train and held-out) and
`metrics.json` in `--out`. Then generation with a KV cache: a prefill and a one-token decode,
two signatures, each captured once, the blocks donating their cache (updated in place, not
copied), and the decode loop asserted not to compile. docs/llama.md walks through it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import pathlib
import re
import statistics
import sys
import time
from typing import Any, Callable, Literal, NamedTuple, Protocol, Sequence

# Before jax starts a GPU: it reserves 75% of the GPU's memory by default, and gpu-1b's
# --check (on by default) peaks at about 64 GB, over the 60 GB that leaves of 80
# (docs/llama.md#gpu-1b-a-1b-parameter-preset). A value set in the environment is kept.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import jaxgraph as jg  # noqa: E402
import jaxgraph.rng  # noqa: E402
from jaxgraph import fsdp  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # examples/common.py
import vocabulary as vocab_lib  # noqa: E402
from common import (Checkpoints, Corpus, Streams,  # noqa: E402
                    check_out, check_resume, params_digest, plot, progress_bar,
                    resume_command, run_parser, stream_positions, write_json)
from model import Cache, Config, Llama  # noqa: E402

# --residuals: the graphed layers' `make_graphed(..., remat_policy=...)`.
RESIDUAL_POLICIES: dict[str, Callable[..., bool] | None] = {
    "recompute": jg.residuals.recompute_elementwise, "all": None}

Params = list[Any]  # one nnx.State per part (embedding, blocks..., head); FlatTrees with --flat
Layer = Any  # a jg.GraphedCallable, or a PlainLayer with --plain-ends
Batches = Sequence[tuple[jax.Array, jax.Array]]  # one (tokens, targets) per microbatch


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
  check: bool = False           # run --check by default (the GPU presets: both throughputs)
  # The training text (vocabulary.TEXTS) and its vocabulary: a byte-level BPE of `vocab`
  # tokens trained on it, or None: its characters. docs/llama.md says why these.
  text: str = "fables"
  vocab: int | None = None
  # Tokens/s: after a warm-up of `round_steps` untimed steps, rounds of `round_steps` steps
  # between device syncs; --check times `rounds` rounds of each step, alternating.
  rounds: int = 3
  round_steps: int = 10


PRESETS = {
    "tiny": Preset(context=32, width=32, depth=2, heads=4, kv_heads=2, hidden=64, batch=8,
                   microbatches=2, steps=12, learning_rate=3e-3, dropout=0.1, eval_every=6,
                   eval_batches=2, checkpoint_every=10, rounds=2, round_steps=3),
    "cpu": Preset(context=64, width=128, depth=4, heads=4, kv_heads=2, hidden=352, batch=16,
                  microbatches=2, steps=250, learning_rate=3e-3, dropout=0.1, eval_every=50,
                  eval_batches=4, checkpoint_every=100, rounds=3, round_steps=10),
    "gpu": Preset(context=512, width=768, depth=12, heads=12, kv_heads=4, hidden=2048,
                  batch=16, microbatches=2, steps=300, learning_rate=6e-4, dropout=0.1,
                  eval_every=100, eval_batches=8, checkpoint_every=150, attention="cudnn",
                  check=True, rounds=5, round_steps=40, text="stdlib", vocab=8192),
    # ~1.06B params (TinyLlama's shape, 22 blocks of 47.2M, with an 8,192-token embedding),
    # 16,384 tokens a step as `gpu`; memory in docs/llama.md.
    "gpu-1b": Preset(context=2048, width=2048, depth=22, heads=16, kv_heads=8, hidden=5632,
                     batch=4, microbatches=2, steps=200, learning_rate=3e-4, dropout=0.0,
                     eval_every=100, eval_batches=4, checkpoint_every=200, attention="cudnn",
                     check=True, rounds=5, round_steps=40, text="stdlib", vocab=8192),
}


def model_config(preset: Preset, vocab: int, *, untied: bool = False,
                 dtype: str = "bfloat16") -> Config:
  """The model's `Config` for `preset` (and the --untied, --dtype flags)."""
  return Config(vocab=vocab, width=preset.width, depth=preset.depth, heads=preset.heads,
                kv_heads=preset.kv_heads, hidden=preset.hidden, dropout=preset.dropout,
                tie_embeddings=not untied, compute_dtype=jnp.dtype(dtype),
                attention=None if preset.attention == "xla" else preset.attention)


# ----------------------------------------------------------------------------- vocabulary


def load_vocabulary(preset: Preset, cache: pathlib.Path
                    ) -> tuple[vocab_lib.Text, vocab_lib.Vocabulary]:
  """The preset's text and its vocabulary: its characters, or a byte-level BPE of
  `preset.vocab` tokens read from `cache` (trained on the text and saved there the first
  time, keyed by a digest of the text and the size)."""
  text = vocab_lib.TEXTS[preset.text]()
  if preset.vocab is None:
    return text, vocab_lib.Characters(text)
  return text, vocab_lib.subwords(text, preset.vocab, cache)


def make_corpus(preset: Preset, seed: int, cache: pathlib.Path,
                sharding: Any = None) -> tuple[vocab_lib.Text, Corpus]:
  """The preset's text as token ids (encoded once per vocabulary and kept in `cache`), the
  last 10% held out."""
  text, vocabulary = load_vocabulary(preset, cache)
  return text, Corpus(vocab_lib.encoded(vocabulary, text, cache), vocabulary, preset.context,
                      preset.batch, seed, held_out=0.1, sharding=sharding)


def vocabulary_record(text: vocab_lib.Text, vocabulary: vocab_lib.Vocabulary
                      ) -> dict[str, Any]:
  """What a checkpoint records of its vocabulary (--resume compares the digest)."""
  return {**vocabulary.record(), "text": text.name, "text_digest": text.digest}


def describe_vocabulary(record: dict[str, Any]) -> str:
  return (f"{record['kind']} of {record['size']:,} tokens (digest {record['digest'][:12]}) "
          f"of the {record['text']}")


def check_vocabulary(parser: argparse.ArgumentParser, out: pathlib.Path, preset: Preset,
                     cache: pathlib.Path) -> None:
  """With --resume: refuses (`parser.error`) a checkpoint trained with another vocabulary
  (tokenizer digest) than this run's, naming both. Checkpoints written before vocabularies
  were recorded used the fables' characters."""
  directory = out / "checkpoints"
  latest = Checkpoints(directory).latest_meta() if directory.is_dir() else None
  if latest is None:
    return
  saved = latest[1].get("vocabulary") or vocabulary_record(
      vocab_lib.fables(), vocab_lib.Characters(vocab_lib.fables()))
  ours = vocabulary_record(*load_vocabulary(preset, cache))
  if saved["digest"] != ours["digest"]:
    parser.error(f"--resume: the checkpoint in {directory} was trained with "
                 f"{describe_vocabulary(saved)}; this run's vocabulary is "
                 f"{describe_vocabulary(ours)}. Token ids mean other things under another "
                 "vocabulary: resume where the checkpoint's text and tokenizer are (the same "
                 f"Python for the standard library; its tokenizer file: "
                 f"{saved.get('file', 'none, characters')}), or start a new run with another "
                 "--out (or without --resume)")


# --------------------------------------------------------------------------------- layers


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


# ------------------------------------------------------------------------------ placement


class Placement:
  """Where the training state and the batches live.

  Without --fsdp (`mesh` None): on JAX's default device, where the arrays are made; every
  method hands back what it gets (`host` is `jax.device_get`), so that run is unchanged.
  With --fsdp N: on a one-axis mesh of N devices (`jg.fsdp.make_mesh`). The params, their
  grads and the optimizer state are sharded along it (`jg.fsdp.shard`: every flat buffer of
  at least `min_size` elements split N ways, a piece of every weight in each part, gathered
  in `gather_dtype` (the compute dtype), the smaller ones replicated: `shard_threshold`
  keeps the norm scales whole), each batch is split along it
  (data parallel over the same devices), scalars and keys are replicated. With several processes
  (`jax.distributed`) the mesh holds every process's devices and `host` gathers the shards
  of all of them.

  On CPU under `jax.distributed` (--coordinator: several processes, or one) every
  executable is waited for before the next one starts (`serial`, `wait`, `hooks`): the
  collectives go through gloo, every device a gloo rank (those of one process too), and two
  executables with collectives that run at once (the CPU runtime starts independent ones
  concurrently, e.g. the next microbatch's embedding forward during this one's backward) can
  pair their collectives wrongly and deadlock (2 processes hung in the first step; one
  process of 8 devices in --check's timing rounds). Without `jax.distributed` one process's
  CPU devices use XLA's in-process collectives, which hang another way: with executions
  piled up on a device (its limit is 32 in flight) on fewer cores than devices
  (docs/reliability.md, "CPU collectives"); so on any CPU mesh each step is waited for
  before the next is dispatched (`wait`). GPU streams run executables in order.
  """

  def __init__(self, mesh: Mesh | None = None, min_size: int = fsdp.MIN_SHARD_SIZE,
               gather_dtype: Any = None):
    self.mesh, self.min_size, self.gather_dtype = mesh, min_size, gather_dtype
    self.on_cpu = mesh is not None and mesh.devices.flat[0].platform == "cpu"
    self.serial = self.on_cpu and jax.distributed.is_initialized()

  @property
  def devices(self) -> int:
    """How many devices the state is split over (1 without a mesh)."""
    return 1 if self.mesh is None else self.mesh.size

  @property
  def replicated(self) -> NamedSharding | None:
    """Whole on every device of the mesh (scalars, keys, positions); None without one."""
    return None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())

  @property
  def batch(self) -> NamedSharding | None:
    """The batch dimension split over the mesh (`jg.fsdp.batch_sharding`)."""
    return None if self.mesh is None else fsdp.batch_sharding(self.mesh)

  def shard(self, params: Params) -> Params:
    """The params placed (`jg.fsdp.shard`: FlatTree buffers padded, sharded, and gathered
    once per buffer where a layer unravels them)."""
    if self.mesh is None:
      return params
    return fsdp.shard(params, self.mesh, min_size=self.min_size, gather_dtype=self.gather_dtype)

  def shardings(self, tree: Any) -> Any:
    """The sharding of every leaf of `tree` (arrays or abstract values) under the placement
    rule of `shard`, for `jax.jit(..., out_shardings=)`; None without a mesh."""
    if self.mesh is None:
      return None
    return fsdp.shardings(tree, self.mesh, min_size=self.min_size)

  def jit(self, fn: Callable[..., Any], *, out_shardings: Any, **options: Any) -> Any:
    """`jax.jit(fn, **options)`, with `out_shardings` only when there is a mesh."""
    if self.mesh is not None:
      options["out_shardings"] = out_shardings
    return jax.jit(fn, **options)

  def replicate(self, tree: Any) -> Any:
    """Every leaf of `tree` (the same value in every process) whole on every device."""
    if self.mesh is None:
      return tree

    def put(x: Any) -> Any:
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(put(jax.random.key_data(x)),
                                        impl=jax.random.key_impl(x))
      # From the host: an array committed to one device cannot go to another process's.
      return jax.device_put(np.asarray(x), self.replicated)

    return jax.tree.map(put, tree)

  def wait(self, tree: Any) -> Any:
    """`tree` (a step's results), waited for on a CPU mesh."""
    return jax.block_until_ready(tree) if self.on_cpu else tree

  def hooks(self) -> dict[str, Any]:
    """`make_graphed` options: with `serial`, hooks that wait for every layer's outputs and
    grads (each layer call is one executable)."""
    if not self.serial:
      return {}

    def wait(event: jg.HookEvent) -> None:
      if event.phase != "capture":  # abstract values at capture
        jax.block_until_ready((event.outputs, event.grads))

    return {"hooks": jg.Hooks(forward=[wait], backward=[wait])}

  def put(self, tree: Any) -> Any:
    """Host values (from `host`) back on the devices, placed by the rule of `shard`."""
    return jax.device_put(tree, self.shardings(tree))

  def abstract(self, tree: Any) -> Any:
    """What `put(tree)` would place, as `jax.ShapeDtypeStruct`s (to compile for, without a
    copy on the devices); `tree` itself without a mesh."""
    if self.mesh is None:
      return tree
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
                        tree, self.shardings(tree))

  def host(self, tree: Any) -> Any:
    """`tree` as NumPy arrays holding the whole values (every process gets all of them)."""
    if jax.process_count() == 1:
      return jax.device_get(tree)

    def fetch(x: Any) -> Any:
      if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return multihost_utils.process_allgather(x, tiled=True)
      return jax.device_get(x)

    return jax.tree.map(fetch, tree)

  def local(self, params: Params) -> Params:
    """The params whole on this process's default device, gathered from the mesh (for
    generation: one sequence, nothing to split)."""
    if self.mesh is None:
      return params
    return [jg.flat.with_gather(jax.tree.map(jnp.asarray, p), None)
            for p in self.host(params)]


# ------------------------------------------------------------------------------- training

Grads = tuple[Params, jax.Array]  # summed grads and summed loss over the microbatches so far


def accumulate(total: Grads, grads: Params, table_grads: Any, loss: jax.Array) -> Grads:
  """Adds one microbatch's grads and loss; `table_grads` is the tied head's share of the
  embedding's grads, shaped like them (None when it is already in `grads[0]`)."""
  if table_grads is not None:
    grads = [jax.tree.map(jnp.add, grads[0], table_grads), *grads[1:]]
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
  """The graphed training step: forwards and backwards replayed per layer, accumulated over
  the microbatches, one optimizer update (`step`)."""

  def __init__(self, layers: Sequence[Layer], config: Config, tx: optax.GradientTransformation,
               microbatches: int, params: Params, opt_state: Any,
               placement: Placement | None = None, fuse: bool = False):
    placement = self.placement = placement or Placement()
    self.layers, self.config, self.tx, self.microbatches = layers, config, tx, microbatches
    self.fuse = fuse  # the blocks' hook-free runs as one executable pair (docs/fusion.md)
    self.one = placement.replicate(jnp.ones((), jnp.float32))  # the loss cotangent
    # --fsdp: the summed grads, the params and the optimizer state keep their shardings
    # (a params sharding that changed would be a new signature for every layer).
    grads, state = placement.shardings(params), placement.shardings(opt_state)
    scalar = placement.replicated
    zeros = placement.jit(lambda params: (jax.tree.map(jnp.zeros_like, params),
                                          jnp.zeros((), jnp.float32)),
                          out_shardings=(grads, scalar))
    # Compiled ahead like the layers, so the first step pays for no compile.
    self.zeros = zeros.lower(params).compile()
    total = jax.eval_shape(zeros, params)
    table = total[0][0] if config.tie_embeddings else None  # shaped like the embedding's
    self.accumulate = placement.jit(accumulate, donate_argnums=0, out_shardings=(grads, scalar)
                                    ).lower(total, total[0], table, total[1]).compile()
    # The summed grads' buffers become the new params (donating the params too would leave
    # one of the two unused).
    self.apply = placement.jit(functools.partial(apply_update, tx, microbatches),
                               donate_argnums=(0, 1), out_shardings=(grads, state, scalar)
                               ).lower(total, opt_state, params).compile()

  def microbatch(self, params: Params, tokens: jax.Array, targets: jax.Array,
                 positions: jax.Array) -> tuple[jax.Array, Params, jax.Array | None]:
    """Graphed forwards, then graphed backwards in reverse: (loss, grads, table grad)."""
    embed, blocks, head = self.layers[0], self.layers[1:-1], self.layers[-1]
    x, embed_pullback = embed.vjp(params[0], tokens)
    x, blocks_pullback = jg.sequential_vjp(blocks, params[1:-1], x, consts=(positions,),
                                           fuse=self.fuse)
    loss, head_pullback = head.vjp(params[-1], x, targets, *tied_inputs(params, self.config))
    head_grads, x_grads, _, *tied_grads = head_pullback(self.one)
    block_grads, x_grads = blocks_pullback(x_grads)
    embed_grads, _ = embed_pullback(x_grads)
    table_grads = tied_grads[0] if tied_grads else None
    return loss, [embed_grads, *block_grads, head_grads], table_grads

  def grads(self, params: Params, batches: Sequence[tuple[jax.Array, jax.Array]],
            positions: jax.Array) -> Grads:
    """The grads and loss summed over `batches` (one (tokens, targets) per microbatch)."""
    total = self.zeros(params)
    for tokens, targets in batches:
      loss, grads, table_grads = self.microbatch(params, tokens, targets, positions)
      total = self.accumulate(total, grads, table_grads, loss)
    return total

  def step(self, params: Params, opt_state: Any, batches: Sequence[tuple[jax.Array, jax.Array]],
           positions: jax.Array) -> tuple[Params, Any, jax.Array]:
    """One optimizer step over `batches`: (params, opt_state, mean loss)."""
    return self.placement.wait(self.apply(self.grads(params, batches, positions), opt_state,
                                          params))

  def streams(self) -> Streams:
    """The graphed layers' key-stream positions (for a checkpoint)."""
    return stream_positions(graphed(self.layers))

  def seed(self, streams: Streams) -> None:
    """Sets the graphed layers' key streams (from a checkpoint)."""
    for layer, (base, counter) in zip(graphed(self.layers), streams):
      layer.seed(base, counter=counter)


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
    losses.append(layers[-1](params[-1], x, targets, *tied_inputs(params, config)))
  return float(jnp.mean(jnp.stack(losses)))


# ----------------------------------------------------------------------------- whole step


class Stepper(Protocol):
  """A training step (`Trainer`: graphed; `WholeStep`: one jax.jit) with its key streams."""

  microbatches: int

  def step(self, params: Params, opt_state: Any, batches: Batches, positions: jax.Array
           ) -> tuple[Params, Any, jax.Array]: ...

  def streams(self) -> Streams: ...

  def seed(self, streams: Streams) -> None: ...


def make_whole_step(fns: Sequence[Callable[..., Any]], config: Config,
                    tx: optax.GradientTransformation, microbatches: int,
                    block_streams: range, remat_policy: Callable[..., bool] | None = None,
                    graph_ends: bool = True, placement: Placement | None = None,
                    params: Params | None = None, opt_state: Any = None
                    ) -> tuple[Callable[..., Grads], Callable[..., Any]]:
  """The same step as one `jax.jit`: the same layer functions, keys, accumulation, update.

  The keys are drawn inside, from the streams' base keys and counters (arguments, never
  constants), as the graphed layers draw theirs: block i's key in microbatch m is the one its
  stream `block_streams[i]` draws m draws on. Returns `(grads, step)`: the summed grads and
  loss of one step under `jax.jit` (--check compares them), and the jitted step, which also
  returns the counters advanced by `microbatches`. With `remat_policy` (the graphed layers'
  --residuals), the grads run each graphed part (the ends too unless `graph_ends` is False)
  under `jax.checkpoint` with it: the same math as the graphed layers, for the bitwise
  comparison. The step stays the plain one a user writes. With a `placement` on a mesh
  (--fsdp) the step returns the params and optimizer state with the shardings of
  `params` and `opt_state` (the graphed step's), the loss and counters replicated.
  """
  placement = placement or Placement()
  graphed_parts = range(len(fns)) if graph_ends else range(1, len(fns) - 1)

  def loss_fn(params, tokens, targets, positions, keys, policy=None):
    parts = [fn if policy is None or i not in graphed_parts else
             jax.checkpoint(fn, policy=policy, prevent_cse=False) for i, fn in enumerate(fns)]
    embed_fn, block_fns, head_fn = parts[0], parts[1:-1], parts[-1]
    params = jg.flat.unravel(params)  # --flat: differentiated through the unravelling
    x = embed_fn(params[0], tokens)
    for fn, layer_params, key in zip(block_fns, params[1:-1], keys):
      x = fn(layer_params, x, positions, key=key)
    return head_fn(params[-1], x, targets, *tied_inputs(params, config))

  def grads(params, batches, positions, bases, counters, policy=None):
    total = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
    for m, (tokens, targets) in enumerate(batches):
      keys = [jaxgraph.rng.stream_key(s, counters[s] + m, bases[s]) for s in block_streams]
      loss, microbatch_grads = jax.value_and_grad(loss_fn)(params, tokens, targets, positions,
                                                           keys, policy)
      total = accumulate(total, microbatch_grads, None, loss)
    return total

  def step(params, opt_state, batches, positions, bases, counters):
    total = grads(params, batches, positions, bases, counters)
    return (*apply_update(tx, microbatches, total, opt_state, params),
            counters + jnp.uint32(microbatches))

  scalar = placement.replicated
  step = placement.jit(step, donate_argnums=(0, 1, 5), out_shardings=(
      placement.shardings(params), placement.shardings(opt_state), scalar, scalar))
  return jax.jit(functools.partial(grads, policy=remat_policy)), step


def initial_streams(seed: int, count: int) -> Streams:
  """The key streams `make_graphed(..., rng=jax.random.key(seed))` gives `count` callables."""
  return [(jax.random.key(seed), 0)] * count


class WholeStep:
  """The training step as one `jax.jit` (--whole-step, --check), called like `Trainer`.

  Its keys come from the streams the graphed layers would draw from (one base key and
  counter per graphed layer; the blocks' are used), held on the device and advanced inside
  the executable, so a step pays no host work for them. Compiled at construction, for the
  shardings of `params`, `opt_state` and `batches` (--fsdp: the graphed step's).
  """

  def __init__(self, fns: Sequence[Callable[..., Any]], config: Config,
               tx: optax.GradientTransformation, microbatches: int, streams: Streams,
               graph_ends: bool, params: Params, opt_state: Any, batches: Batches,
               positions: jax.Array, remat_policy: Callable[..., bool] | None = None,
               placement: Placement | None = None):
    self.microbatches = microbatches
    self.placement = placement or Placement()
    self.seed(streams)
    first = 1 if graph_ends else 0  # the blocks' streams (the embedding's is first)
    self.grads, step = make_whole_step(fns, config, tx, microbatches,
                                       range(first, first + config.depth), remat_policy,
                                       graph_ends, self.placement, params, opt_state)
    begin = time.perf_counter()
    self.compiled = step.lower(params, opt_state, batches, positions, self.bases,
                               self.counters).compile()
    self.compile_seconds = time.perf_counter() - begin

  def step(self, params: Params, opt_state: Any, batches: Batches, positions: jax.Array
           ) -> tuple[Params, Any, jax.Array]:
    """One optimizer step over `batches`: (params, opt_state, mean loss); donates both."""
    params, opt_state, loss, self.counters = self.placement.wait(self.compiled(
        params, opt_state, batches, positions, self.bases, self.counters))
    return params, opt_state, loss

  def streams(self) -> Streams:
    return [(base, int(counter)) for base, counter in zip(self.bases, np.asarray(self.counters))]

  def seed(self, streams: Streams) -> None:
    self.bases = self.placement.replicate(tuple(base for base, _ in streams))
    self.counters = self.placement.replicate(
        jnp.asarray([counter for _, counter in streams], jnp.uint32))


class Start(NamedTuple):
  """Where --check's rerun starts: the params and optimizer state on the host (on the device,
  a second copy through the whole run: 12.5 GB more at gpu-1b), and the key streams."""

  params: Params
  opt_state: Any
  streams: Streams


def first_step_grads(trainer: Trainer, params: Params, corpus: Corpus, step: int,
                     positions: jax.Array) -> Grads:
  """The graphed grads of training step `step` (not applied); the key streams are rewound,
  so the training run that follows draws the same keys."""
  streams = trainer.streams()
  total = trainer.grads(params, step_batches(corpus, step, trainer.microbatches), positions)
  trainer.seed(streams)
  return total


def max_diff(a: Any, b: Any) -> float:
  return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def compare_with_whole_step(whole: WholeStep, start: Start, corpus: Corpus, steps: range,
                            positions: jax.Array, losses: Sequence[float], first_grads: Grads,
                            params: Params) -> tuple[dict[str, Any], tuple[Params, Any]]:
  """Reruns `steps` from `start` under the whole-step `jax.jit` with the same keys.

  Returns the differences to the graphed run (the first step's summed grads and loss,
  `first_grads`, against the whole step's under one `jax.jit`; every step's loss; the final
  `params`) and the whole step's compile time; and the whole step's final state.
  """
  host = whole.placement.host
  check_params, check_state = whole.placement.put((start.params, start.opt_state))
  whole.seed(start.streams)
  microbatches = whole.microbatches
  total = host(whole.grads(check_params, step_batches(corpus, steps[0], microbatches),
                           positions, whole.bases, whole.counters))
  found: dict[str, Any] = {
      "first_step_loss_diff": abs(float(first_grads[1]) - float(total[1])),
      "first_step_max_grad_diff": max_diff(first_grads[0], total[0])}
  del total
  check_losses = []
  for step in steps:
    check_params, check_state, loss = whole.step(
        check_params, check_state, step_batches(corpus, step, microbatches), positions)
    check_losses.append(loss)
  check_losses = [float(loss) for loss in check_losses]
  found.update({
      "max_loss_diff": max(abs(a - b) for a, b in zip(losses, check_losses)),
      "last_max_param_diff": max_diff(host(params), host(check_params)),
      "whole_step_compile_seconds": round(whole.compile_seconds, 3)})
  return found, (check_params, check_state)


# -------------------------------------------------------------------------------- tokens/s


class RoundTimer:
  """The training loop's tokens/s, measured as `throughput_rounds` measures: rounds of
  `round_steps` steps between device syncs; the first round (the warm-up after capture or
  resume) not counted; evaluation and checkpoints paused out of the clock.

  Call `start()` before the loop, `step_done(loss)` after every step (True: a round ended
  and the clock is stopped), `stop(loss)` before other work, `start()` after it.
  """

  def __init__(self, round_steps: int, tokens_per_step: int):
    self.round_steps, self.tokens_per_step = round_steps, tokens_per_step
    self.rates: list[float] = []  # tokens/s of each steady-state round
    self.seconds = 0.0            # all training time (warm-up and the last partial round too)
    self._steps, self._elapsed, self._since = 0, 0.0, None

  def start(self) -> None:
    self._since = time.perf_counter()

  def stop(self, ready: Any) -> None:
    if self._since is None:
      return
    jax.block_until_ready(ready)
    elapsed = time.perf_counter() - self._since
    self._elapsed += elapsed
    self.seconds += elapsed
    self._since = None

  def step_done(self, ready: Any) -> bool:
    self._steps += 1
    if self._steps % self.round_steps:
      return False
    self.stop(ready)
    if self._steps > self.round_steps:  # the first round is the warm-up
      self.rates.append(round(self.round_steps * self.tokens_per_step / self._elapsed, 1))
    self._elapsed = 0.0
    return True


def rate_summary(rates: Sequence[float], round_steps: int) -> dict[str, Any]:
  """Median and spread ((max - min) / median, %) of per-round tokens/s."""
  median = statistics.median(rates) if rates else None
  return {"rounds": list(rates), "round_steps": round_steps, "warmup_steps": round_steps,
          "median": median,
          "spread_percent": round(100 * (max(rates) - min(rates)) / median, 1) if rates else None}


def describe_rates(summary: dict[str, Any]) -> str:
  if not summary["rounds"]:
    return "not measured"
  count = len(summary["rounds"])
  return (f"{summary['median']:,.0f} tok/s (median of {count} round{'s' * (count != 1)} of "
          f"{summary['round_steps']} steps, spread {summary['spread_percent']:.0f}%)")


def throughput_rounds(runs: dict[str, tuple[Stepper, tuple[Params, Any]]], corpus: Corpus,
                      positions: jax.Array, microbatches: int, rounds: int, round_steps: int
                      ) -> dict[str, list[float]]:
  """Tokens/s of each run's step, timed as the training loop times itself: `round_steps`
  untimed steps each (warm-up), then `rounds` rounds of `round_steps` steps between device
  syncs, alternating (in order in even rounds, reversed in odd ones). Each run continues from
  its own (params, opt_state), which it consumes; batches are made inside the timed loop, as
  in training."""
  tokens_per_step = microbatches * corpus.batch * corpus.context
  states = {name: state for name, (_, state) in runs.items()}
  done = dict.fromkeys(runs, 0)

  def advance(name: str) -> None:
    stepper, (params, opt_state) = runs[name][0], states[name]
    for _ in range(round_steps):
      done[name] += 1
      params, opt_state, loss = stepper.step(
          params, opt_state, step_batches(corpus, done[name], microbatches), positions)
    states[name] = params, opt_state
    jax.block_until_ready(loss)

  for name in runs:
    advance(name)  # warm-up, not timed
  rates: dict[str, list[float]] = {name: [] for name in runs}
  for index in range(rounds):
    for name in (list(runs) if index % 2 == 0 else list(runs)[::-1]):
      begin = time.perf_counter()
      advance(name)
      rates[name].append(round(round_steps * tokens_per_step / (time.perf_counter() - begin), 1))
  return rates


def report_check(found: dict[str, Any], loop: dict[str, Any], compute_dtype: Any,
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
  graphed, whole = (rate_summary(rates[k], found["round_steps"]) for k in ("graphed", "whole_step"))
  print(f"tokens/s, steady state ({len(rates['graphed'])} alternating rounds of "
        f"{found['round_steps']} steps each, after {found['round_steps']} untimed warm-up "
        f"steps; median, spread): graphed {graphed['median']:,.0f} "
        f"({graphed['spread_percent']:.0f}%), whole-step jax.jit {whole['median']:,.0f} "
        f"({whole['spread_percent']:.0f}%), graphed/whole-step "
        f"{graphed['median'] / whole['median']:.3f}; the training loop above: "
        f"{describe_rates(loop)}, graphed")


# --------------------------------------------------------------------------------- memory


def peak_bytes() -> int | None:
  """The largest `peak_bytes_in_use` over this process's devices; None where devices keep no
  memory statistics (CPU)."""
  peaks = [stats.get("peak_bytes_in_use") for device in jax.local_devices()
           if (stats := device.memory_stats())]
  return max((peak for peak in peaks if peak is not None), default=None)


def state_bytes(count: int) -> int:
  """Device bytes of the training state of `count` float32 params: the params, AdamW's two
  moments, the summed grads and one microbatch's grads (5 x 4 bytes a param)."""
  return 5 * 4 * count


def memory_estimate(preset: Preset, vocab: int) -> dict[str, int]:
  """What a training step of `preset` needs on the device, estimated on any machine.

  The params are counted on the abstract model (`nnx.eval_shape`: nothing allocated). The
  residuals are those `jax.vjp` of one block keeps for its backward, traced abstractly for
  one microbatch, times the depth; with cuDNN attention without the (batch, heads, length,
  length) arrays of XLA's attention, which flash attention does not keep (it keeps
  (batch, heads, length) softmax statistics). jaxgraph's own count after capture is
  `Stats.residual_bytes` (printed by `main`).
  """
  config = model_config(dataclasses.replace(preset, attention="xla"), vocab)
  model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
  count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  fn, params = jg.flax.nnx_layer(model.blocks[0], rngs_argument="rngs")
  x = jax.ShapeDtypeStruct((preset.batch, preset.context, config.width), config.compute_dtype)
  positions = jax.ShapeDtypeStruct((preset.context,), jnp.int32)

  def residuals(params: Any, x: jax.Array, positions: jax.Array) -> Any:
    return jax.vjp(lambda p, x: fn(p, x, positions, key=jax.random.key(0)), params, x)[1]

  flash = preset.attention == "cudnn"
  leaves = jax.tree.leaves(jax.eval_shape(residuals, params, x, positions))
  block = sum(math.prod(s.shape) * s.dtype.itemsize for s in leaves
              if not (flash and len(s.shape) >= 4
                      and s.shape[-2:] == (preset.context, preset.context)))
  if flash:
    block += preset.batch * preset.heads * preset.context * 4
  return {"params": count, "state_bytes": state_bytes(count),
          "residual_bytes": block * preset.depth}


# -------------------------------------------------------------------------------- offload


class OffloadSpec(NamedTuple):
  """--offload: "none", "all" (every kept buffer of every block), or a goal for
  `jaxgraph.offload.plan`: "slowdown" (`value` a fraction of the step) or "memory" (`value`
  the bytes of the blocks' residuals that may stay on the device, per microbatch)."""

  kind: Literal["none", "all", "slowdown", "memory"]
  value: float = 0.0

  def __str__(self) -> str:
    if self.kind == "slowdown":
      return f"slowdown={self.value:.1%}"
    return f"memory={self.value / 2**30:.2f}GiB" if self.kind == "memory" else self.kind


SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10,
              "mib": 2**20, "gib": 2**30}


def offload_spec(text: str) -> OffloadSpec:
  """Parses --offload: none | all | slowdown=P% (or a fraction) | memory=SIZE (bytes, or with
  a unit: GiB, MiB, GB, ...)."""
  usage = ("--offload takes none, all, slowdown=P% (e.g. slowdown=5%: the blocks' copies may "
           "add 5% to the step) or memory=SIZE (e.g. memory=4GiB: at most that much of the "
           f"blocks' residuals stays on the device); got {text!r}")
  if text in ("none", "all"):
    return OffloadSpec(text)
  goal, _, value = text.partition("=")
  number = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*(%|[a-zA-Z]*)\s*", value)
  try:
    amount, unit = float(number.group(1)), number.group(2).lower()
  except (AttributeError, ValueError):
    raise argparse.ArgumentTypeError(usage) from None
  if goal == "slowdown" and unit in ("", "%"):
    return OffloadSpec("slowdown", amount / 100 if unit == "%" else amount)
  if goal == "memory" and unit in SIZE_UNITS:
    return OffloadSpec("memory", amount * SIZE_UNITS[unit])
  raise argparse.ArgumentTypeError(usage)


@dataclasses.dataclass(frozen=True)
class OffloadChoice:
  """What --offload measured of the blocks (no offload) and what the planner chose.

  Attributes:
    spec: the --offload goal.
    names: the blocks' names.
    forward_seconds, backward_seconds: per block, its forward's and backward's time.
    buffers: per block, the sizes of the buffers its forward keeps (`kept_buffers`).
    link: the measured copy speeds (`jaxgraph.offload.measure_link`).
    plan: the planner's choice (`jaxgraph.offload.plan`).
  """

  spec: OffloadSpec
  names: tuple[str, ...]
  forward_seconds: tuple[float, ...]
  backward_seconds: tuple[float, ...]
  buffers: tuple[tuple[int, ...], ...]
  link: jg.offload.Link
  plan: jg.offload.Plan

  def options(self, graph_ends: bool) -> dict[str, Any]:
    """`make_graphed` options of the training layers (the embedding and head, when graphed in
    the same call, never offload: the head's backward runs first)."""
    if not any(self.plan.flags):
      return {}
    flags = [False, *self.plan.flags, False] if graph_ends else list(self.plan.flags)
    return {"offload_residuals": flags, "offload_min_bytes": self.plan.min_bytes}

  def table(self) -> str:
    """Per block: compute times, kept bytes, what the link moves in those times, the plan."""
    mib = 2**20
    lines = [f"{'block':<10} {'fwd ms':>7} {'bwd ms':>7} {'kept MiB':>9} {'buffers':>7} "
             f"{'link MiB in fwd':>15} {'in bwd':>8} {'moves MiB':>9}"]
    for name, fwd, bwd, sizes, moved in zip(self.names, self.forward_seconds,
                                            self.backward_seconds, self.buffers,
                                            self.plan.moved_bytes):
      lines.append(f"{name:<10} {fwd * 1e3:>7.2f} {bwd * 1e3:>7.2f} {sum(sizes) / mib:>9.1f} "
                   f"{len(sizes):>7} {fwd * self.link.to_host / mib:>15.1f} "
                   f"{bwd * self.link.to_device / mib:>8.1f} {moved / mib:>9.1f}")
    return "\n".join(lines)

  def summary(self) -> dict[str, Any]:
    """For metrics.json."""
    return {"spec": str(self.spec), "link_bytes_per_s": self.link._asdict(),
            "blocks": [{"name": name, "forward_s": fwd, "backward_s": bwd,
                        "kept_buffer_bytes": list(sizes), "moved_bytes": moved}
                       for name, fwd, bwd, sizes, moved in zip(
                           self.names, self.forward_seconds, self.backward_seconds,
                           self.buffers, self.plan.moved_bytes)],
            "flags": list(self.plan.flags), "min_bytes": self.plan.min_bytes,
            "offloaded_bytes": self.plan.offloaded_bytes,
            "resident_bytes": self.plan.resident_bytes,
            "compute_seconds": self.plan.compute_seconds,
            "predicted_seconds": self.plan.predicted_seconds, "report": str(self.plan)}


def block_seconds(layers: Sequence[jg.GraphedCallable], params: Params, x: jax.Array,
                  positions: jax.Array, repeats: int = 3) -> tuple[list[float], list[float]]:
  """Per block, the median over `repeats` rounds of its forward's and its backward's time on
  `x`, each run alone (waited for before and after: device time and one call's dispatch),
  after one untimed round. Each backward runs right after its forward, so one block's
  residuals are alive at a time: a setting that needs offload to train can be measured."""
  forward: list[list[float]] = [[] for _ in layers]
  backward: list[list[float]] = [[] for _ in layers]
  x = jax.block_until_ready(x)
  cotangent = jax.block_until_ready(jnp.ones_like(x))
  for _ in range(repeats + 1):
    for i, (layer, layer_params) in enumerate(zip(layers, params)):
      begin = time.perf_counter()
      y, pullback = layer.vjp(layer_params, x, positions)
      jax.block_until_ready(y)
      middle = time.perf_counter()
      jax.block_until_ready(pullback(cotangent))
      forward[i].append(middle - begin)
      backward[i].append(time.perf_counter() - middle)
      del y, pullback
  return ([statistics.median(t[1:]) for t in forward],
          [statistics.median(t[1:]) for t in backward])


def plan_offload(spec: OffloadSpec, fns: Sequence[Callable[..., Any]], params: Params,
                 x: jax.ShapeDtypeStruct, positions: jax.Array, *,
                 remat_policy: Callable[..., bool] | None, seed: int) -> OffloadChoice:
  """--offload: measures the blocks without offload (a capture of their own, discarded: the
  training layers' key streams are untouched; one block's residuals alive at a time), the
  link, and plans.

  `all` is the plan for a budget of 0 bytes (every kept buffer of every block moves).
  """
  layers = jg.make_graphed(list(fns), sample_args=[(p, x, positions) for p in params],
                           rng=jax.random.key(seed), remat_policy=remat_policy,
                           num_warmup_iters=1)
  inputs = jax.random.normal(jax.random.key(seed), x.shape, x.dtype)
  forward, backward = block_seconds(layers, params, inputs, positions)
  buffers = tuple(tuple(b.nbytes for b in layer.kept_buffers) for layer in layers)
  names = tuple(layer.name for layer in layers)
  del layers, inputs
  # The copies the plan times: one block's residuals (at least 1 MiB, at most 1 GiB).
  link = jg.offload.measure_link(min(max(max(map(sum, buffers)), 1 << 20), 1 << 30) // 2 * 2)
  if spec.kind == "slowdown":
    goal: dict[str, Any] = {"max_slowdown": spec.value}
  else:
    goal = {"budget_bytes": int(spec.value) if spec.kind == "memory" else 0}
  plan = jg.offload.plan(buffers, forward, backward, link, **goal)
  return OffloadChoice(spec, names, tuple(forward), tuple(backward), buffers, link, plan)


# ---------------------------------------------------------------------------------- FSDP

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce")


def shard_threshold(params: Params) -> int:
  """`Placement.min_size` for `params` (FlatTrees): above every "no_decay" buffer, so that
  the norm scales stay whole on every device (a few KB a layer; split, they would cost each
  layer one more all-gather in its forward and backward: the gpu presets' 1,536 and 4,096
  scales of a block are above jg.fsdp's default of 1,024), and at least that default."""
  scales = [spec.size for p in params for spec in p.layout.buffers if spec.group == "no_decay"]
  return max([fsdp.MIN_SHARD_SIZE, *(size + 1 for size in scales)])


def fsdp_mesh(devices: int | None) -> Mesh | None:
  """--fsdp N: a one-axis mesh ("fsdp") over this process's first N devices, or, with
  several processes, over all of them (`parse` checked N); None without --fsdp."""
  if devices is None:
    return None
  return fsdp.make_mesh(devices=jax.devices()[:devices])


def collectives(compiled: Any) -> dict[str, int]:
  """The collectives in the compiled HLO of `compiled`, by op (an asynchronous pair,
  `-start` and `-done`, counts once). On CPU a reduce-scatter compiles to an all-reduce and
  a dynamic-slice (docs/fsdp.md)."""
  hlo = compiled.as_text()
  return {op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo)) for op in COLLECTIVES}


def layer_executables(layer: jg.GraphedCallable) -> tuple[Any, Any]:
  """The training forward and the backward `layer` replays (its one captured signature)."""
  # jaxgraph keeps its executables private; examples/fsdp_train.py reads them the same way.
  (entry,) = layer._entries.values()
  forward = next(c for (_, residuals), c in entry.forward.items() if residuals)
  return forward, entry.backward["full"][0]


def placements(tree: Any) -> list[dict[str, Any]]:
  """Per array of `tree`: its path, its elements, the devices it spans, one shard's elements."""
  return [{"path": jax.tree_util.keystr(path), "size": int(x.size),
           "devices": len(x.sharding.device_set),
           "shard": int(x.addressable_shards[0].data.size)}
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def device_bytes(tree: Any) -> int:
  """The bytes `tree` holds on one device (the shards of an array are all one size)."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def fsdp_report(placement: Placement, trainer: Stepper, params: Params, opt_state: Any,
                corpus: Corpus, positions: jax.Array, count: int) -> dict[str, Any]:
  """--fsdp: where the training state lives and which collectives a step runs; printed, and
  returned for metrics.json.

  Per array of the params, of one microbatch's grads (as the graphed layers' pullbacks
  return them; the key streams are rewound after) and of the optimizer state: the devices it
  spans and one shard's size. The state's bytes per device against `state_bytes(count)`.
  Per executable of a step, the collectives of its compiled HLO, and their sum over a step.
  """
  arrays = {"params": placements(params), "opt_state": placements(opt_state)}
  per_step = dict.fromkeys(COLLECTIVES, 0)
  found: dict[str, dict[str, int]] = {}

  def add(name: str, compiled: Any, times: int) -> None:
    counts = found.setdefault(name, collectives(compiled))
    for op, n in counts.items():
      per_step[op] += n * times

  microbatches = trainer.microbatches
  if isinstance(trainer, Trainer):
    streams = trainer.streams()
    _, grads, _ = trainer.microbatch(params, *corpus.batch_at(0), positions)
    trainer.seed(streams)
    arrays["grads"] = placements(grads)
    names: dict[int, str] = {}  # identical blocks replay one entry: name it after the first
    for layer in graphed(trainer.layers):
      forward, backward = layer_executables(layer)
      name = names.setdefault(id(forward), layer.name)
      add(f"{name} forward", forward, microbatches)
      add(f"{name} backward", backward, microbatches)
    add("accumulate", trainer.accumulate, microbatches)
    add("update", trainer.apply, 1)
  else:
    add("whole step", trainer.compiled, 1)
  params_bytes = device_bytes(params)
  # params, AdamW moments, summed grads, one microbatch's grads: as `state_bytes`
  per_device = 3 * params_bytes + device_bytes(opt_state)
  unsharded = state_bytes(count)
  buffers = arrays["params"]
  split = [b for b in buffers if b["shard"] < b["size"]]
  print(f"--fsdp {placement.devices}: training state per device {per_device / 1e6:.3f} MB of "
        f"{unsharded / 1e6:.3f} MB unsharded (1/{unsharded / per_device:.2f}; float32 params, "
        f"AdamW moments, summed grads, one microbatch's grads); {len(split)} of "
        f"{len(buffers)} param buffers split {placement.devices} ways, the others (under "
        f"{placement.min_size:,} elements: norm scales) replicated")
  print("collectives in the compiled HLO, per executable: " + "; ".join(
      f"{name} {counts}" for name, counts in found.items())
        + f"; per step ({microbatches} microbatches): {per_step}")
  return {"devices": placement.devices, "processes": jax.process_count(),
          "state_bytes_per_device": per_device, "state_bytes_unsharded": unsharded,
          "arrays": arrays, "collectives": found, "collectives_per_step": per_step}


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


# ----------------------------------------------------------------------------------- main


OFFLOAD_CONFLICTS = {
    "--whole-step": "trains through one jax.jit, with no graphed blocks",
    "--fuse": "replays the blocks as one executable, whose copies cannot start before its end",
    "--fsdp": "shards the blocks over devices (this example plans for one device)"}


def vocab_size(text: str) -> int:
  """--vocab: a number of BPE tokens, or 'chars' (0)."""
  if text == "chars":
    return 0
  try:
    size = int(text)
  except ValueError:
    size = 0
  if size <= 257:
    raise argparse.ArgumentTypeError(
        f"--vocab takes a number of tokens above 257 (a byte-level BPE starts from 256 byte "
        f"tokens and an end-of-text token), or 'chars'; got {text!r}")
  return size


def resolve(args: argparse.Namespace) -> Preset:
  """The preset with the flags that override it."""
  return dataclasses.replace(PRESETS[args.preset], **{
      name: value for name, value in (("steps", args.steps),
                                       ("dropout", args.dropout),
                                       ("microbatches", args.microbatches),
                                       ("batch", args.batch),
                                       ("attention", args.attention),
                                       ("rounds", args.rounds),
                                       ("round_steps", args.round_steps),
                                       ("context", args.context),
                                       ("text", args.text)) if value is not None},
      # --vocab 0 (chars): characters, the preset's vocab None
      **({} if args.vocab is None else {"vocab": args.vocab or None}))


def run_config(args: argparse.Namespace, preset: Preset) -> dict[str, Any]:
  """What makes two runs the same run, by flag name: saved with every checkpoint, and
  compared by --resume (how tokens/s is measured, --check, --offload and generation are left
  out: they change no result). `fsdp`, `batch`, `context`, `text` and `vocab` are None where
  not given (or given as the preset's), as in checkpoints written before those flags, which
  therefore still resume. The vocabulary itself is compared by its digest
  (`check_vocabulary`)."""
  return {"preset": args.preset, "steps": preset.steps, "seed": args.seed,
          "dropout": preset.dropout, "microbatches": preset.microbatches,
          "attention": preset.attention, "dtype": args.dtype, "untied": args.untied,
          "plain_ends": args.plain_ends, "flat": args.flat, "residuals": args.residuals,
          "whole_step": args.whole_step, "fsdp": args.fsdp, "batch": args.batch,
          "fuse": True if args.fuse else None,  # None when off, as before the flag
          "context": args.context, "text": args.text, "vocab": args.vocab}


def shown_config(config: dict[str, Any]) -> dict[str, Any]:
  """What a `run_config` stands for, as --resume's refusal shows it: the preset's batch
  where none was given, "off" for --fsdp and --fuse not given."""
  preset = PRESETS.get(config.get("preset"))
  return {**config, "batch": config.get("batch") or (preset.batch if preset else None),
          "fsdp": config.get("fsdp") or "off", "fuse": config.get("fuse") or "off"}


def check_fsdp(parser: argparse.ArgumentParser, args: argparse.Namespace,
               preset: Preset) -> None:
  """--fsdp and the multi-process flags (argparse errors); starts `jax.distributed` when
  --coordinator is given, then checks N against the devices of every process."""
  n = args.fsdp
  if n is not None:
    if n < 1:
      parser.error(f"--fsdp takes a number of devices >= 1, got {n}")
    if not args.flat:
      parser.error("--fsdp shards the flat buffers (one all-gather per buffer and layer): "
                   "drop --no-flat")
    if preset.batch % n:
      parser.error(f"--fsdp {n} splits each microbatch of {preset.batch} sequences over {n} "
                   f"devices: pass an N that divides {preset.batch}")
  distributed = (args.coordinator, args.num_processes, args.process_id)
  if any(value is not None for value in distributed):
    if any(value is None for value in distributed):
      parser.error("--coordinator, --num-processes and --process-id start one process of a "
                   "multi-process run together: pass all three")
    if n is None:
      parser.error("several processes train one sharded run: pass --fsdp N, N the number of "
                   "devices of all processes together")
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
      parser.error(f"--process-id takes 0 to --num-processes - 1 ({args.num_processes - 1}), "
                   f"got {args.process_id}")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  if n is None:
    return
  devices = jax.devices()
  if jax.process_count() > 1 and n != len(devices):
    parser.error(f"--fsdp {n} with {jax.process_count()} processes: the mesh holds the "
                 f"devices of every process, {len(devices)} in all: pass --fsdp {len(devices)}")
  if n > len(devices):
    parser.error(f"--fsdp {n} needs {n} devices, found {len(devices)} "
                 f"({devices[0].platform}); on CPU XLA_FLAGS="
                 f"--xla_force_host_platform_device_count={n} makes {n}")


def parse(argv: list[str] | None) -> argparse.Namespace:
  """The flags, checked before anything is built or removed (argparse errors), and with
  --resume against the checkpoint's step and config."""
  parser = run_parser(__doc__.split("\n\n")[0], PRESETS)
  parser.add_argument("--check", action=argparse.BooleanOptionalAction,
                      help="also run the steps under one whole-step jax.jit, compare, and time "
                           "both in alternating rounds (default: on for the gpu presets)")
  parser.add_argument("--whole-step", action="store_true",
                      help="train through one whole-step jax.jit of the same layer functions "
                           "instead of the graphed layers: the same loop, keys, checkpoints "
                           "and tokens/s measurement, to compare with a graphed run")
  parser.add_argument("--rounds", type=int,
                      help="--check: timed rounds of each step (default: the preset's)")
  parser.add_argument("--round-steps", type=int,
                      help="steps per timed round, and untimed warm-up steps before the first "
                           "(default: the preset's)")
  parser.add_argument("--plain-ends", action="store_true",
                      help="embedding and head under plain jax.jit instead of graphed")
  parser.add_argument("--untied", action="store_true", help="a head matrix of its own")
  parser.add_argument("--dropout", type=float,
                      help="residual dropout rate in [0, 1) (default: the preset's)")
  parser.add_argument("--microbatches", type=int, help="per step (default: the preset's)")
  parser.add_argument("--batch", type=int,
                      help="sequences per microbatch (default: the preset's); with --fsdp N "
                           "split N ways, so N times a batch per device keeps that fixed")
  parser.add_argument("--flat", action=argparse.BooleanOptionalAction, default=True,
                      help="each part's params as flat buffers (jg.flat.ravel), one per "
                           "(decay group, dtype): fewer leaves per executable call (default; "
                           "--no-flat: pytrees)")
  parser.add_argument("--fuse", action="store_true",
                      help="replay the blocks as one forward and one backward executable per "
                           "microbatch (sequential_vjp(..., fuse=True)): fewer host calls, the "
                           "same kernels; the fused pair compiles on the first step")
  parser.add_argument("--residuals", choices=sorted(RESIDUAL_POLICIES), default="recompute",
                      help="what a graphed forward keeps for its backward: 'recompute' (default: "
                           "jaxgraph.residuals.recompute_elementwise, the whole step's device "
                           "time and a quarter of the memory), 'all' (every jax.vjp residual)")
  parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                      help="compute dtype (params are float32 either way)")
  parser.add_argument("--attention", choices=("xla", "cudnn"),
                      help="dot_product_attention implementation (default: the preset's)")
  parser.add_argument("--context", type=int,
                      help="tokens per sequence (default: the preset's); e.g. --preset gpu-1b "
                           "--context 8192 --batch 2")
  parser.add_argument("--text", choices=sorted(vocab_lib.TEXTS),
                      help="the training text: 'fables' (examples/data/corpus.txt) or 'stdlib' "
                           "(this Python's standard library sources); default: the preset's")
  parser.add_argument("--vocab", type=vocab_size, metavar="N|chars",
                      help="a byte-level BPE of N tokens trained on the text (once, cached in "
                           "--cache), or 'chars' for its characters (default: the preset's)")
  parser.add_argument("--cache", type=pathlib.Path, default=pathlib.Path("runs/cache"),
                      help="trained tokenizers and encoded texts, keyed by a digest of the "
                           "text and the vocabulary size (default: runs/cache)")
  parser.add_argument("--offload", type=offload_spec, default=OffloadSpec("none"),
                      metavar="none|all|slowdown=P%%|memory=SIZE",
                      help="keep the blocks' residuals in pinned host memory between forward "
                           "and backward (async copies), as jaxgraph.offload.plan picks from "
                           "the blocks' measured times and the measured link: 'all' moves "
                           "every kept buffer, 'slowdown=5%%' the most bytes predicted to cost "
                           "at most 5%% of the step, 'memory=4GiB' the fastest choice leaving "
                           "at most that much on the device per microbatch; prints the "
                           "measurement per block and the plan (default: none)")
  parser.add_argument("--generate", type=int, default=48,
                      help="tokens to generate at the end (at most half the context; 0: none)")
  parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/llama"))
  parser.add_argument("--seed", type=int, default=0, help="params, batches and dropout keys")
  parser.add_argument("--fsdp", type=int, metavar="N",
                      help="shard the params, grads and optimizer state over N devices "
                           "(jg.fsdp: every flat buffer split N ways, gathered once per "
                           "layer inside its executables) and split each batch over them; N "
                           "divides the batch; the first N devices of this process, or with "
                           "--coordinator every device of every process")
  parser.add_argument("--coordinator", metavar="HOST:PORT",
                      help="one process of a multi-process --fsdp run: "
                           "jax.distributed.initialize(HOST:PORT, --num-processes, "
                           "--process-id); every process runs the same command but its id")
  parser.add_argument("--num-processes", type=int, help="with --coordinator")
  parser.add_argument("--process-id", type=int, help="with --coordinator: 0, 1, ...")
  args = parser.parse_args(argv)
  for name in ("steps", "stop_after", "microbatches", "batch", "rounds", "round_steps",
               "context"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} takes a number >= 1, got {getattr(args, name)}")
  for name in ("seed", "generate"):
    if getattr(args, name) < 0:
      parser.error(f"--{name} takes a number >= 0, got {getattr(args, name)}")
  if not args.temperature >= 0:
    parser.error(f"--temperature takes a number >= 0 (0: greedy), got {args.temperature}")
  if args.dropout is not None and not 0 <= args.dropout < 1:
    parser.error(f"--dropout takes a rate in [0, 1), got {args.dropout}")
  if args.whole_step and args.check:
    parser.error("--check compares the graphed step with the whole-step jax.jit; with "
                 "--whole-step there is no graphed step: drop one of them")
  if args.whole_step and args.fuse:
    parser.error("--fuse replays the graphed blocks fused; with --whole-step there are no "
                 "graphed blocks: drop one of them")
  if args.offload.kind != "none":
    for flag, given in (("--whole-step", args.whole_step), ("--fuse", args.fuse),
                        ("--fsdp", args.fsdp is not None)):
      if given:
        parser.error(f"--offload plans the copies of each graphed block beside the next "
                     f"blocks' compute; {flag} {OFFLOAD_CONFLICTS[flag]}: drop one of them")
  if args.offload.kind == "slowdown" and not 0 <= args.offload.value < 10:
    parser.error(f"--offload slowdown= takes a fraction of the step in [0, 10) (e.g. 5%), got "
                 f"{args.offload.value}")
  preset_fields = PRESETS[args.preset]
  # The preset's value: the same run as without the flag (--resume compares).
  if args.batch == preset_fields.batch:
    args.batch = None
  if args.context == preset_fields.context:
    args.context = None
  if args.text == preset_fields.text:
    args.text = None
  if args.vocab is not None and (args.vocab or None) == preset_fields.vocab:
    args.vocab = None
  preset = resolve(args)
  if preset.attention == "cudnn" and args.dtype != "bfloat16":
    parser.error("cuDNN attention computes in bf16 or fp16: with --dtype float32 pass "
                 "--attention xla")
  check_out(parser, args.out, resume=args.resume, fresh=args.fresh)
  check_fsdp(parser, args, preset)
  if args.resume:
    check_resume(parser, args.out, run_config(args, preset), preset.steps,
                 min(preset.steps, args.stop_after or preset.steps), shown=shown_config)
    check_vocabulary(parser, args.out, preset, args.cache)
  return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse(argv)
  command = resume_command(__file__, sys.argv[1:] if argv is None else argv)
  preset = resolve(args)
  check = (preset.check and not args.whole_step) if args.check is None else args.check
  total = preset.steps
  stop = min(total, args.stop_after or total)
  graph_ends = not args.plain_ends
  mode = "whole-step jax.jit" if args.whole_step else "graphed"
  mesh = fsdp_mesh(args.fsdp)
  writer = jax.process_index() == 0  # metrics.json and loss.png: one process writes them
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; preset {args.preset}: {preset}")
  if mesh is not None:
    print(f"--fsdp {args.fsdp}: params, grads and optimizer state sharded over "
          f"{mesh.size} {jax.devices()[0].platform} devices of {jax.process_count()} "
          f"process(es), each batch split over them ({preset.batch // mesh.size} "
          "sequences per device and microbatch)")

  text, corpus = make_corpus(preset, args.seed, args.cache,
                             sharding=None if mesh is None else fsdp.batch_sharding(mesh))
  vocabulary = vocabulary_record(text, corpus.vocabulary)
  print(f"vocabulary: {corpus.vocabulary} of the {text.name}"
        + (", trained now" if getattr(corpus.vocabulary, "trained", False) else ""))
  config = model_config(preset, corpus.vocabulary.size, untied=args.untied, dtype=args.dtype)
  model = Llama(config, rngs=nnx.Rngs(params=args.seed))

  fns, params = split(model)
  count = sum(x.size for x in jax.tree.leaves(params))
  print(f"{count:,} params ({len(params)} parts), vocab {config.vocab}, {len(corpus.ids):,} "
        f"training and {len(corpus.held_out_ids):,} held-out tokens; training state "
        f"{state_bytes(count) / 1e9:.2f} GB (float32 params, AdamW moments, summed grads, one "
        "microbatch's grads)")
  policy = RESIDUAL_POLICIES[args.residuals]
  if args.flat:  # from here on params, grads and the optimizer state are FlatTrees
    params = [jg.flat.ravel(p, group=flat_group) for p in params]
    print(f"params held flat: {len(jax.tree.leaves(params))} buffers for "
          f"{sum(len(p.layout.slots) for p in params)} leaves")
  # The blocks cast their matrices to the compute dtype: gathered in it, half the bytes.
  placement = (Placement() if mesh is None else
               Placement(mesh, shard_threshold(params), config.compute_dtype))
  params = placement.shard(params)

  # Capture. Training: forward + backward, dropout keys from each layer's stream (not with
  # --whole-step, which trains through one jax.jit). Eval: a forward-only copy of the same
  # functions without keys (dropout off), for the same shapes.
  tokens = jax.ShapeDtypeStruct((preset.batch, preset.context), jnp.int32,
                                sharding=placement.batch)
  x = jax.ShapeDtypeStruct((preset.batch, preset.context, config.width), config.compute_dtype,
                           sharding=placement.batch)
  positions = placement.replicate(jnp.arange(preset.context))
  table = tied_inputs(params, config)
  sample_args = ([(params[0], tokens)] + [(p, x, positions) for p in params[1:-1]]
                 + [(params[-1], x, tokens, *table)])
  offload = None
  if args.offload.kind != "none":
    offload = plan_offload(args.offload, fns[1:-1], params[1:-1], x, positions,
                           remat_policy=policy, seed=args.seed)
    print(f"--offload {offload.spec}: the blocks measured without offload (times: median of 3, "
          f"each run alone), the link {offload.link.to_host / 1e9:.1f} GB/s to host, "
          f"{offload.link.to_device / 1e9:.1f} GB/s back\n{offload.table()}\n{offload.plan}")
  begin = time.perf_counter()
  train_layers = (None if args.whole_step else
                  build_layers(fns, sample_args, graph_ends=graph_ends,
                               rng=jax.random.key(args.seed), remat_policy=policy,
                               **placement.hooks(),
                               **({} if offload is None else offload.options(graph_ends))))
  eval_layers = build_layers(fns, sample_args, graph_ends=graph_ends, inference_only=True,
                             **placement.hooks())
  capture_seconds = time.perf_counter() - begin
  print(f"captured {'eval' if args.whole_step else 'training and eval'} layers in "
        f"{capture_seconds:.1f} s (incl. warmup)"
        + ("" if graph_ends else "; embedding and head run under plain jax.jit"))
  kinds = [("eval", eval_layers)] + ([] if train_layers is None else [("train", train_layers)])
  for kind, layers in kinds[::-1]:
    for layer in graphed(layers):
      s = layer.stats
      print(f"  {kind:<5} {layer.name:<12} captures {s.captures}  cache hits {s.cache_hits}  "
            f"compiles {s.compiles}  compile {s.compile_seconds:.2f} s")
  if train_layers is not None:
    kept = sum(layer.stats.residual_bytes for layer in graphed(train_layers))
    moved = sum(layer.stats.offload_bytes for layer in graphed(train_layers))
    print(f"  one microbatch's graphed forwards keep {kept / 1e9:.3f} GB of residuals for their "
          "backwards (Stats.residual_bytes)"
          + (f", {moved / 1e9:.3f} GB of them in host memory (Stats.offload_bytes)"
             if offload is not None else ""))

  tx = optimizer(preset, total)
  if placement.mesh is None:
    opt_state = tx.init(params)
  else:  # made sharded, never whole on one device
    opt_state = placement.jit(tx.init, out_shardings=placement.shardings(
        jax.eval_shape(tx.init, params)))(params)
  streams = initial_streams(args.seed, config.depth + 2 if graph_ends else config.depth)
  trainer: Stepper
  if args.whole_step:
    trainer = WholeStep(fns, config, tx, preset.microbatches, streams, graph_ends, params,
                        opt_state, step_batches(corpus, 0, preset.microbatches), positions,
                        policy, placement)
    print(f"--whole-step: training through one whole-step jax.jit (compiled in "
          f"{trainer.compile_seconds:.1f} s)")
  else:
    trainer = Trainer(train_layers, config, tx, preset.microbatches, params, opt_state,
                      placement, fuse=args.fuse)
  if placement.mesh is not None:
    sharded = fsdp_report(placement, trainer, params, opt_state, corpus, positions, count)

  checkpoints = Checkpoints.for_run(args.out, fresh=args.fresh, command=command,
                                    host=placement.host)
  metrics_path = args.out / "metrics.json"
  first, losses, eval_losses = 0, [], []
  if args.resume:
    restored = checkpoints.resume(params, opt_state, trainer.streams())
    if restored is not None:
      first, params, opt_state = restored.step, restored.params, restored.opt_state
      trainer.seed(restored.streams)
      losses = list(restored.meta["losses"])
      eval_losses = [(step, loss) for step, loss in restored.meta["eval_losses"]]
      assert len(losses) == first, f"step {first} holds {len(losses)} losses"
      print(f"resumed from step {first} ({checkpoints.directory}, digests verified)")
  if check:
    check_start = Start(placement.host(params), placement.host(opt_state), trainer.streams())
    first_grads = placement.host(first_step_grads(trainer, params, corpus, first + 1,
                                                  positions))

  # Training. Losses stay on the device until a round ends or an eval or checkpoint reads
  # them; tokens/s is measured per round of steps, without eval and checkpoint time.
  tokens_per_step = preset.microbatches * preset.batch * preset.context
  timer = RoundTimer(preset.round_steps, tokens_per_step)
  pending: list[jax.Array] = []
  bar = progress_bar(range(first + 1, stop + 1), total=total)
  timer.start()
  for step in bar:
    params, opt_state, loss = trainer.step(params, opt_state,
                                           step_batches(corpus, step, preset.microbatches),
                                           positions)
    pending.append(loss)
    round_ended = timer.step_done(loss)
    evaluate_now = step % preset.eval_every == 0 or step == total
    save = step % preset.checkpoint_every == 0 or step == stop
    if not (round_ended or evaluate_now or save):
      continue
    timer.stop(loss)  # eval, checkpoints and log lines are not training time
    losses.extend(float(l) for l in pending)
    pending.clear()
    bar.set_postfix(loss=f"{losses[-1]:.4f}",
                    tok_s=f"{timer.rates[-1]:,.0f}" if timer.rates else "(warm-up)")
    if evaluate_now:
      eval_losses.append((step, evaluate(eval_layers, params, config, corpus,
                                         preset.eval_batches, positions)))
      bar.write(f"step {step:>5}: train loss {losses[-1]:.4f}, held-out loss "
                f"{eval_losses[-1][1]:.4f}")
    if save:
      history = {"losses": losses, "eval_losses": eval_losses}
      checkpoints.save(step, params, opt_state, trainer.streams(),
                       {"config": run_config(args, preset), "vocabulary": vocabulary,
                        **history})
      if writer:
        with checkpoints.writing(metrics_path):  # for reading; resume needs it not
          write_json(metrics_path, {"step": step, **history})
    timer.start()
  bar.close()

  run_steps = stop - first
  loop = rate_summary(timer.rates, preset.round_steps)
  result: dict[str, Any] = {
      "preset": args.preset, "mode": "whole_step" if args.whole_step else "graphed",
      "config": run_config(args, preset), "params": count, "step": stop, "losses": losses,
      "eval_losses": eval_losses, "final_loss": losses[-1] if losses else None,
      "train_seconds": round(timer.seconds, 3), "capture_seconds": round(capture_seconds, 3),
      "tokens_per_second": loop["median"], "throughput": {"loop": loop},
      "params_sha256": params_digest(placement.host(params)), "vocabulary": vocabulary,
      "offload": None if offload is None else offload.summary(),
      "stats": {f"{kind} {layer.name}": layer.stats._asdict()
                for kind, layers in kinds for layer in graphed(layers)},
  }
  if run_steps:
    held_out = f", held-out {eval_losses[-1][1]:.4f}" if eval_losses else ""
    rate = (f"{describe_rates(loop)} {mode}, after {preset.round_steps} untimed warm-up "
            "steps; evaluation and checkpoints not counted" if loop["rounds"] else
            f"tok/s not measured: {run_steps} steps, fewer than a warm-up round and a timed "
            f"round of --round-steps {preset.round_steps}")
    print(f"trained steps {first + 1}-{stop} ({timer.seconds:.1f} s of training): final loss "
          f"{losses[-1]:.4f}{held_out}; {rate}")
  else:
    print(f"the checkpoint is at step {stop}, the run's last: nothing left to train")
  peak = peak_bytes()
  if peak is not None:  # GPUs; CPU devices keep no memory statistics
    result["peak_bytes"] = peak
    print(f"peak device memory so far (capture, training; before --check): {peak / 2**30:.2f} "
          "GiB, the largest over this process's devices")

  if check and run_steps:
    whole = WholeStep(fns, config, tx, preset.microbatches, check_start.streams, graph_ends,
                      *placement.abstract((check_start.params, check_start.opt_state)),
                      step_batches(corpus, 0, preset.microbatches), positions, policy,
                      placement)
    if placement.mesh is not None:
      sharded["collectives"]["whole_step"] = collectives(whole.compiled)
    found, whole_state = compare_with_whole_step(whole, check_start, corpus,
                                                 range(first + 1, stop + 1), positions,
                                                 losses[first:], first_grads, params)
    del check_start, first_grads
    # Both continue from their final states (the run's optimizer state is consumed: the
    # checkpoint is written; generation needs the params only).
    found["throughput"] = throughput_rounds(
        {"graphed": (trainer, (params, opt_state)), "whole_step": (whole, whole_state)},
        corpus, positions, preset.microbatches, preset.rounds, preset.round_steps)
    found["round_steps"] = preset.round_steps
    del opt_state, whole_state
    result["check"] = found
    result["throughput"]["check"] = {k: rate_summary(v, preset.round_steps)
                                     for k, v in found["throughput"].items()}
    report_check(found, loop, config.compute_dtype, run_steps)

  if placement.mesh is not None:
    result["fsdp"] = sharded
  if losses and writer:
    with checkpoints.writing(args.out / "loss.png"):
      plot(losses, args.out / "loss.png", f"Llama ({args.preset}), "
           f"{'whole-step jax.jit' if args.whole_step else 'blocks graphed'}", eval_losses)
  if writer:
    with checkpoints.writing(metrics_path):
      write_json(metrics_path, result, indent=1)

  if args.generate:
    # One sequence: generated on one device (per process), from the params gathered whole.
    result["generation"] = write_sample(model, fns, placement.local(params), corpus,
                                        graph_ends, min(args.generate, preset.context // 2),
                                        args.temperature, args.seed)
    if writer:
      with checkpoints.writing(metrics_path):
        write_json(metrics_path, result, indent=1)
  print(f"wrote {args.out / 'loss.png'}, {metrics_path}, {checkpoints.directory}")
  if stop < total:
    print(f"stopped after step {stop} of {total} (--stop-after); continue with: {command}")
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
