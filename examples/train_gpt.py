"""Train a small character-level GPT (Flax NNX, Optax AdamW) with every layer graphed.

  python -m examples.train_gpt                        # CPU default: a few minutes on 2 cores
  python -m examples.train_gpt --preset gpu --out runs/gpt-gpu   # a larger model on one GPU
  python -m examples.train_gpt --preset tiny --steps 20 --out /tmp/gpt    # seconds
  python -m examples.train_gpt --stop-after 300 --out runs/gpt-300   # "interrupted" ...
  python -m examples.train_gpt --out runs/gpt-300 --resume  # ... continues bitwise identically
  python -m examples.train_gpt --check --fresh        # a new run in runs/gpt, + one jax.jit

The model is split into layers (embedding, N transformer blocks, head + loss), each turned
into a pure function by `jaxgraph.flax.nnx_layer` and captured by one `jaxgraph.make_graphed`
call: identical blocks compile once, dropout draws from each layer's own key stream, and a
replay-time hook times every layer's forward and backward on the logged steps. Checkpoints
(Orbax, examples/checkpoints.py) hold the params, the optimizer state, each layer's key stream
position, the loss history and a digest of every array, so a resumed run continues exactly
where the interrupted one stopped, from the newest checkpoint that is intact. Progress: a
tqdm bar (log lines without tqdm). Outputs in `--out`: `loss.png`, `metrics.json`,
`checkpoints/`. An `--out` that holds an earlier run is refused unless `--resume` continues
it or `--fresh` moves it to `--out`/earlier-N/ (nothing is deleted).

The text is examples/data/corpus.txt (self-written fables, see make_corpus.py).

Bitwise resume holds on CPU as is. On GPU, XLA's default kernels are not run-to-run
deterministic (atomics, e.g. in the embedding gradient's scatter-add): two identical runs
differ in the last bits. Set XLA_FLAGS=--xla_gpu_deterministic_ops=true for bitwise reruns
and resumes (measured on an H100: bitwise, at ~18% lower throughput).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import pathlib
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxgraph as jg
import jaxgraph.flax as jgf
from examples import interrupt
from examples import vocabulary as vocab_lib
from examples.checkpoints import Checkpoints, Streams, stream_keys, stream_positions
from examples.corpus import Corpus
from examples.options import (check_out, check_resume, check_steps, given_command,
                               resume_command, run_parser)
from examples.plotting import plot
from examples.progress import progress_bar
from examples.records import arrays_sha256, write_json
Params = list[nnx.State]  # one state per layer: embedding, blocks, head


@dataclasses.dataclass(frozen=True)
class Preset:
  context: int
  width: int
  heads: int
  depth: int
  batch: int
  steps: int
  learning_rate: float
  dropout: float
  log_every: int
  checkpoint_every: int


PRESETS = {
    "tiny": Preset(context=32, width=32, heads=2, depth=2, batch=8, steps=30,
                   learning_rate=3e-3, dropout=0.1, log_every=5, checkpoint_every=10),
    "cpu": Preset(context=64, width=128, heads=4, depth=4, batch=16, steps=600,
                  learning_rate=2e-3, dropout=0.1, log_every=50, checkpoint_every=200),
    "gpu": Preset(context=256, width=512, heads=8, depth=8, batch=64, steps=3000,
                  learning_rate=6e-4, dropout=0.1, log_every=100, checkpoint_every=1000),
}


# ----------------------------------------------------------------------------------- model


class Embedding(nnx.Module):
  """Token and learned position embeddings, then dropout."""

  def __init__(self, vocab: int, preset: Preset, *, rngs: nnx.Rngs):
    self.tokens = nnx.Embed(vocab, preset.width, rngs=rngs)
    self.positions = nnx.Param(
        0.02 * jax.random.normal(rngs.params(), (preset.context, preset.width)))
    self.drop = nnx.Dropout(preset.dropout, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return self.drop(self.tokens(tokens) + self.positions[:tokens.shape[-1]])


class Block(nnx.Module):
  """A pre-norm transformer block: causal self-attention and an MLP, dropout on both."""

  def __init__(self, preset: Preset, *, rngs: nnx.Rngs):
    width = preset.width
    self.heads = preset.heads
    self.norm1 = nnx.LayerNorm(width, rngs=rngs)
    self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
    self.proj = nnx.Linear(width, width, rngs=rngs)
    self.norm2 = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)
    self.drop_attention = nnx.Dropout(preset.dropout, rngs=rngs)
    self.drop_mlp = nnx.Dropout(preset.dropout, rngs=rngs)

  def attention(self, x: jax.Array) -> jax.Array:
    batch, length, width = x.shape
    shape = (batch, length, self.heads, width // self.heads)
    q, k, v = (part.reshape(shape) for part in jnp.split(self.qkv(x), 3, axis=-1))
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return self.proj(out.reshape(batch, length, width))

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.drop_attention(self.attention(self.norm1(x)))
    return x + self.drop_mlp(self.down(jax.nn.gelu(self.up(self.norm2(x)))))


class Head(nnx.Module):
  """Final norm, output projection and the mean next-character cross-entropy."""

  def __init__(self, vocab: int, preset: Preset, *, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(preset.width, rngs=rngs)
    self.out = nnx.Linear(preset.width, vocab, use_bias=False, rngs=rngs)

  def logits(self, x: jax.Array) -> jax.Array:
    return self.out(self.norm(x))

  def __call__(self, x: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(self.logits(x), targets).mean()


class GPT(nnx.Module):

  def __init__(self, vocab: int, preset: Preset, *, rngs: nnx.Rngs):
    self.embed = Embedding(vocab, preset, rngs=rngs)
    self.blocks = nnx.List([Block(preset, rngs=rngs) for _ in range(preset.depth)])
    self.head = Head(vocab, preset, rngs=rngs)

  def layers(self) -> list[nnx.Module]:
    """The parts graphed one by one, in order."""
    return [self.embed, *self.blocks, self.head]

  def logits(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head.logits(x)


# ----------------------------------------------------------------------------------- hooks


class LayerTimer:
  """Replay-time hooks timing each layer's forward and backward on the steps it is armed.

  Armed steps wait for the device before and after every layer (hooks run on the host
  between executables), so they measure device time per layer at the cost of overlap;
  other steps pay one Python call per hook.
  """

  def __init__(self) -> None:
    self.armed = False
    self._start: dict[tuple[str, int], float] = {}
    self.seconds: dict[tuple[str, int], list[float]] = collections.defaultdict(list)

  def hooks(self) -> jg.Hooks:
    return jg.Hooks(pre_forward=[self._pre_forward], forward=[self._forward],
                    pre_backward=[self._pre_backward], backward=[self._backward])

  def _begin(self, kind: str, event: jg.HookEvent, ready: Any) -> None:
    if self.armed and event.phase == "replay":
      jax.block_until_ready(ready)
      self._start[kind, event.index] = time.perf_counter()

  def _end(self, kind: str, event: jg.HookEvent, ready: Any) -> None:
    if self.armed and event.phase == "replay":
      jax.block_until_ready(ready)
      self.seconds[kind, event.index].append(time.perf_counter() - self._start[kind, event.index])

  def _pre_forward(self, event: jg.HookEvent) -> None:
    self._begin("forward", event, event.args)

  def _forward(self, event: jg.HookEvent) -> None:
    self._end("forward", event, event.outputs)

  def _pre_backward(self, event: jg.HookEvent) -> None:
    self._begin("backward", event, event.cotangents)

  def _backward(self, event: jg.HookEvent) -> None:
    self._end("backward", event, event.grads)

  def table(self, names: list[str]) -> dict[str, dict[str, float]]:
    """Median milliseconds per layer and direction."""
    return {name: {kind: round(1e3 * float(np.median(self.seconds[kind, i])), 3)
                   for kind in ("forward", "backward") if self.seconds[kind, i]}
            for i, name in enumerate(names)}


# ------------------------------------------------------------------------------- training


def make_update(tx: optax.GradientTransformation) -> Any:
  @functools.partial(jax.jit, donate_argnums=(1, 2))
  def update(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return update


def graphed_step(layers: Sequence[jg.GraphedCallable], update: Any, params: Params,
                 opt_state: Any, tokens: jax.Array, targets: jax.Array
                 ) -> tuple[Params, Any, jax.Array]:
  """One training step: graphed forwards, graphed backwards in reverse, one AdamW update."""
  embed, blocks, head = layers[0], layers[1:-1], layers[-1]
  x, embed_pullback = embed.vjp(params[0], tokens)
  x, blocks_pullback = jg.sequential_vjp(blocks, params[1:-1], x)
  loss, head_pullback = head.vjp(params[-1], x, targets)
  head_grads, x_grads, _ = head_pullback(jnp.ones_like(loss))
  block_grads, x_grads = blocks_pullback(x_grads)
  embed_grads, _ = embed_pullback(x_grads)
  params, opt_state = update([embed_grads, *block_grads, head_grads], opt_state, params)
  return params, opt_state, loss


def make_whole_step(layers: Sequence[jg.GraphedCallable], tx: optax.GradientTransformation
                    ) -> Any:
  """The same step as one `jax.jit`: graphed layers called with tracers run their function."""

  def loss_fn(params, tokens, targets, keys):
    x = layers[0](params[0], tokens, key=keys[0])
    for layer, p, key in zip(layers[1:-1], params[1:-1], keys[1:-1]):
      x = layer(p, x, key=key)
    return layers[-1](params[-1], x, targets, key=keys[-1])

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, tokens, targets, keys):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, keys)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def compare_with_whole_step(layers: Sequence[jg.GraphedCallable], tx: optax.GradientTransformation,
                            start: tuple[Params, Any, Streams], corpus: Corpus,
                            steps: range, losses: list[float], params: Params) -> dict[str, Any]:
  """Reruns `steps` from `start` under one whole-step `jax.jit` with the same keys.

  Returns the differences to the graphed run's `losses` (one per step) and final `params`,
  and the whole step's compile time and throughput.
  """
  check_params, check_state, streams = start
  tokens, targets = corpus.batch_at(steps[0])
  begin = time.perf_counter()
  whole_step = make_whole_step(layers, tx).lower(
      check_params, check_state, tokens, targets, stream_keys(streams, 0)).compile()
  compile_seconds = time.perf_counter() - begin
  begin, check_losses = time.perf_counter(), []
  for offset, step in enumerate(steps):
    tokens, targets = corpus.batch_at(step)
    check_params, check_state, loss = whole_step(check_params, check_state, tokens, targets,
                                                 stream_keys(streams, offset))
    check_losses.append(loss)
  check_losses = [float(loss) for loss in check_losses]
  seconds = time.perf_counter() - begin
  return {
      "max_loss_diff": max(abs(a - b) for a, b in zip(losses, check_losses)),
      "first_loss_diff": abs(losses[0] - check_losses[0]),
      "last_loss_diff": abs(losses[-1] - check_losses[-1]),
      "max_param_diff": max(float(jnp.max(jnp.abs(a - b))) for a, b in
                            zip(jax.tree.leaves(params), jax.tree.leaves(check_params))),
      "whole_step_compile_seconds": round(compile_seconds, 3),
      "whole_step_tokens_per_second": round(
          len(steps) * corpus.batch * corpus.context / seconds, 1),
  }


def sample(model: GPT, params: Params, corpus: Corpus, chars: int, seed: int) -> str:
  """Writes trained params back into the NNX model and samples text from it (eval mode)."""
  nnx.update(model, jgf.join_states(model, model.layers(), params))
  model.eval()
  next_logits = nnx.jit(lambda model, window: model.logits(window[None])[0, -1])
  window = jnp.asarray(corpus.ids[-corpus.context:])  # prompt: the end of the last fable
  key, out = jax.random.key(seed), []
  for i in range(chars):
    logits = next_logits(model, window)
    token = jax.random.categorical(jax.random.fold_in(key, i), logits / 0.8)
    out.append(int(token))
    window = jnp.concatenate([window[1:], token[None].astype(jnp.int32)])
  return corpus.decode(out)


def run_config(args: argparse.Namespace) -> dict[str, Any]:
  """What makes two runs the same run, by flag name (saved with each checkpoint)."""
  return {"preset": args.preset, "steps": args.steps or PRESETS[args.preset].steps,
          "seed": args.seed}


def parse(argv: list[str] | None) -> argparse.Namespace:
  parser = run_parser(__doc__.split("\n\n")[0], PRESETS)
  parser.add_argument("--check", action="store_true",
                      help="also run the same steps with one whole-step jax.jit and compare")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/gpt"))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--sample", type=int, default=200, help="characters to sample at the end")
  args = parser.parse_args(argv)
  if (args.steps is not None and args.steps < 1) or (
      args.stop_after is not None and args.stop_after < 1):
    parser.error("--steps and --stop-after take a number of steps >= 1")
  for name in ("seed", "sample"):
    if getattr(args, name) < 0:
      parser.error(f"--{name} takes a number >= 0, got {getattr(args, name)}")
  total = args.steps or PRESETS[args.preset].steps
  check_steps(parser, args, total)
  check_out(parser, args.out, resume=args.resume, fresh=args.fresh)
  if args.resume:
    check_resume(parser, args.out, run_config(args), total, min(total, args.stop_after or total),
                 legacy_metadata=args.legacy_metadata)
  return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse(argv)
  command = resume_command("examples.train_gpt", sys.argv[1:] if argv is None else argv)
  interrupt.starting(args.out / "checkpoints", fresh=args.fresh)
  preset = PRESETS[args.preset]
  total = args.steps or preset.steps
  stop = min(total, args.stop_after or total)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}: {len(jax.devices())} device(s); "
        f"preset {args.preset}: {dataclasses.replace(preset, steps=total)}")

  text = vocab_lib.fables()
  chars = vocab_lib.Characters(text)
  corpus = Corpus(chars.encode(text.documents), chars, preset.context, preset.batch, args.seed)
  model = GPT(chars.size, preset, rngs=nnx.Rngs(params=args.seed, dropout=args.seed))
  fns, params = zip(*(jgf.nnx_layer(part) for part in model.layers()))
  params = list(params)
  names = [f"{fn.__name__}[{i}]" for i, fn in enumerate(fns)]
  print(f"{sum(x.size for x in jax.tree.leaves(params)):,} params, vocab {chars.size}, "
        f"{len(corpus.ids):,} characters")

  # Capture: one make_graphed call for every layer; identical blocks share executables.
  tokens, targets = corpus.batch_at(0)
  x = jax.ShapeDtypeStruct((preset.batch, preset.context, preset.width), jnp.float32)
  sample_args = ([(params[0], tokens)] + [(p, x) for p in params[1:-1]]
                 + [(params[-1], x, targets)])
  timer = LayerTimer()
  begin = time.perf_counter()
  interrupt.point("capture")
  layers = jg.make_graphed(list(fns), timer.hooks(), sample_args=sample_args,
                           rng=jax.random.key(args.seed))
  capture_seconds = time.perf_counter() - begin
  print(f"captured {len(layers)} layers in {capture_seconds:.1f} s (incl. warmup):")
  for name, layer in zip(names, layers):
    s = layer.stats
    print(f"  {name:<14} captures {s.captures}  cache hits {s.cache_hits}  "
          f"compiles {s.compiles}  compile {s.compile_seconds:.2f} s")

  schedule = optax.warmup_cosine_decay_schedule(
      0.0, preset.learning_rate, max(1, total // 20), total, preset.learning_rate / 10)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=0.1))
  opt_state = tx.init(params)
  # Compiled ahead like the layers, so the first steps do not pay for it (grads are shaped
  # like params).
  update = make_update(tx).lower(params, opt_state, params).compile()

  checkpoints = Checkpoints.for_run(args.out, fresh=args.fresh, command=command,
                                    keep=args.keep_checkpoints,
                                    legacy_metadata=args.legacy_metadata)
  interrupt.watch(checkpoints, command=command, last_step=total)
  metrics_path = args.out / "metrics.json"
  first, losses = 0, []
  if args.resume:
    interrupt.point("restore")
    restored = checkpoints.resume(params, opt_state, stream_positions(layers))
    if restored is not None:
      first, params, opt_state = restored.step, restored.params, restored.opt_state
      for layer, (base, counter) in zip(layers, restored.streams):
        layer.seed(base, counter=counter)
      losses = list(restored.meta["losses"])
      print(f"resumed from step {first} ({checkpoints.directory}, digests verified)")
  if args.check:
    check_start = (jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt_state),
                   stream_positions(layers))

  # Training. Losses stay on the device until a log line or a checkpoint needs them.
  pending: list[jax.Array] = []
  seconds = 0.0
  tokens_per_step = preset.batch * preset.context
  mark, mark_step = time.perf_counter(), first
  bar = progress_bar(range(first + 1, stop + 1), total=total)
  for step in bar:
    interrupt.point("training", step)
    tokens, targets = corpus.batch_at(step)
    timer.armed = step % preset.log_every == 0
    params, opt_state, loss = graphed_step(layers, update, params, opt_state, tokens, targets)
    pending.append(loss)
    log = step % preset.log_every == 0 or step == stop
    save = step % preset.checkpoint_every == 0 or step == stop
    if log or save:
      losses.extend(float(l) for l in pending)
      pending.clear()
    if log:
      elapsed = time.perf_counter() - mark
      seconds += elapsed
      done = step - mark_step
      rate, ms = done * tokens_per_step / elapsed, 1e3 * elapsed / done
      bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{rate:,.0f}")
      bar.write(f"step {step:>5}/{total}: loss {losses[-1]:.4f} | {rate:>9,.0f} tok/s | "
                f"{ms:6.1f} ms/step")
    if save:
      checkpoints.save(step, params, opt_state, stream_positions(layers),
                       {"config": run_config(args), "losses": losses})
      with checkpoints.writing(metrics_path):
        write_json(metrics_path, {"step": step, "losses": losses})
    if log:
      mark, mark_step = time.perf_counter(), step  # checkpoint time is not training time
  bar.close()
  timer.armed = False

  run_steps = stop - first
  result: dict[str, Any] = {
      "preset": args.preset, "step": stop, "losses": losses, "final_loss": losses[-1],
      "train_seconds": round(seconds, 3), "capture_seconds": round(capture_seconds, 3),
      "tokens_per_second": round(run_steps * tokens_per_step / seconds, 1) if seconds else None,
      "params_sha256": arrays_sha256(params),
      "layer_ms": timer.table(names),
      "stats": {name: layer.stats._asdict() for name, layer in zip(names, layers)},
  }
  print("per-layer median ms (forward / backward, device-synchronised on logged steps):")
  for name, row in result["layer_ms"].items():
    print(f"  {name:<14} {row.get('forward', float('nan')):8.3f} "
          f"{row.get('backward', float('nan')):8.3f}")

  if args.check and run_steps:
    interrupt.point("check")
    check = compare_with_whole_step(layers, tx, check_start, corpus, range(first + 1, stop + 1),
                                    losses[first:], params)
    result["check"] = check
    print(f"--check: one whole-step jax.jit (compiled in {check['whole_step_compile_seconds']:.1f}"
          f" s, {check['whole_step_tokens_per_second']:,.0f} tok/s without hooks or "
          f"checkpoints) vs graphed over {run_steps} steps: max |loss diff| "
          f"{check['max_loss_diff']:.3g} (first step {check['first_loss_diff']:.3g}, last step "
          f"{check['last_loss_diff']:.3g}), max |param diff| {check['max_param_diff']:.3g}.")
    if check["max_loss_diff"] or check["max_param_diff"]:
      print("  Not bitwise: the whole step is one fused executable, where XLA may fuse and "
            "round a reduction differently across layer boundaries (and on GPU pick other "
            "GEMM algorithms); training then amplifies the last-bit differences. Per layer "
            "the math is bitwise the same (tests/test_flax.py).")

  interrupt.point("outputs")
  with checkpoints.writing(args.out / "loss.png"):
    plot(losses, args.out / "loss.png", f"char GPT ({args.preset}), graphed per layer")
  with checkpoints.writing(metrics_path):
    write_json(metrics_path, result, indent=1)
  print(f"final loss {result['final_loss']:.4f} after step {stop}; "
        f"{result['tokens_per_second'] or 0:,.0f} tok/s; wrote {args.out / 'loss.png'}, "
        f"{metrics_path}, {checkpoints.directory} ({checkpoints.kept()})")
  if args.sample:
    interrupt.point("generation")
    print("sample:\n" + sample(model, params, corpus, args.sample, args.seed))
  if stop < total:
    print(f"stopped after step {stop} of {total} (--stop-after); continue with: {command}")
  return result


if __name__ == "__main__":
  interrupt.run(main, sys.argv[1:], command=resume_command("examples.train_gpt", sys.argv[1:]),
                rerun=given_command("examples.train_gpt", sys.argv[1:]))
