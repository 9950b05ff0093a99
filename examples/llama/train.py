"""Train the Llama-style model of model.py with every decoder block graphed, then generate.

  python -m examples.llama.train --preset cpu    # 1.5 min of CPU time, 2 cores
  python -m examples.llama.train --preset tiny   # 12 steps, mostly compiling (CI)
  python -m examples.llama.train --preset gpu    # one GPU; also times one
                                                              # whole-step jax.jit of the model
  python -m examples.llama.train --preset gpu-1b # ~1B params on one 80 GB GPU
  ... --stop-after 40, then the same command with --resume    # bitwise the uninterrupted run
  ... --fresh           # a new run in an --out that holds one (moved to OUT/earlier-N/)
  Ctrl-C, anywhere      # one line: the checkpoint step kept and the command that continues
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
  ... --pipeline 2 --schedule 1f1b|interleaved|zero-bubble --microbatches 8
                        # 2 stages on 2 devices, driven by jg.schedule.Pipeline
                        # (--pipeline-threads: from a thread per stage)
  ... --context 8192 --batch 2 --vocab 8192 --text stdlib   # tokens per sequence, vocabulary
  ... --offload slowdown=5%   # the blocks' residuals in host memory as jaxgraph.offload.plan
                              # picks them (also: all, memory=4GiB); docs/llama.md
  ... --init-from runs/llama --lora 8 --out runs/llama-lora   # LoRA fine-tuning of a trained
                              # run: rank-8 adapters, the base frozen (without --lora: all
                              # of its params trained on)

Training: fp32 master params and bf16 compute inside each layer; Optax AdamW without decay on
the norms, global-norm clipping, a warmup-cosine schedule; gradient accumulation over
microbatches; a held-out loss every `eval_every` steps through a forward-only
(`inference_only=True`) capture of the layers; Orbax checkpoints holding each layer's key-stream
position, the run's config, the loss history and a digest of every array, verified on resume;
a tqdm bar; tokens/s measured in steady-state rounds; `loss.png` (train and held-out) and
`metrics.json` in `--out`. Then generation with a KV cache: a prefill and a one-token decode,
two signatures, each captured once, the blocks donating their cache (updated in place, not
copied), and the decode loop asserted not to compile. docs/llama.md walks through it.

This file is the run, step by step (`main`); each part of it is a module of this folder, a
package (`__init__.py` says which file holds what).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from typing import Any, Callable, NamedTuple, Sequence

# Before jax starts a GPU: it reserves 75% of the GPU's memory by default, and gpu-1b's
# --check (on by default) peaks at about 64 GB, over the 60 GB that leaves of 80
# (docs/llama.md#gpu-1b-a-1b-parameter-preset). A value set in the environment is kept.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jaxgraph as jg  # noqa: E402
from jaxgraph import fsdp  # noqa: E402
from examples import interrupt  # noqa: E402
from examples.checkpoints import Checkpoints  # noqa: E402
from examples.corpus import Corpus  # noqa: E402
from examples.options import given_command, resume_command  # noqa: E402
from examples.plotting import plot  # noqa: E402
from examples.progress import progress_bar  # noqa: E402
from examples.records import arrays_sha256, write_json  # noqa: E402
from examples.llama import check as check_lib  # noqa: E402
from examples.llama import lora  # noqa: E402
from examples.llama.checkpoints import metadata, resume, run_config  # noqa: E402
from examples.llama.cli import parse  # noqa: E402
from examples.llama.data import make_corpus, step_batches, vocabulary_record  # noqa: E402
from examples.llama.fsdp_report import fsdp_report  # noqa: E402
from examples.llama.generation import write_sample  # noqa: E402
from examples.llama.layers import (RESIDUAL_POLICIES, Layer, Params, build_layers,  # noqa: E402
                                   graphed, split, tied_inputs)
from examples.llama.memory import peak_bytes, state_bytes  # noqa: E402
from examples.llama.model import Config, Llama  # noqa: E402
from examples.llama.offload import OffloadChoice, plan_offload  # noqa: E402
from examples.llama.pipeline import (PipelineTrainer, Stages, build_stage_layers,  # noqa: E402
                                     plan, stage_report)
from examples.llama.placement import Placement, fsdp_mesh, shard_threshold  # noqa: E402
from examples.llama.presets import Preset, model_config, resolve  # noqa: E402
from examples.llama.throughput import RoundTimer, describe_rates, rate_summary  # noqa: E402
from examples.llama.trainer import (Stepper, Trainer, adamw, evaluate, flat_group,  # noqa: E402
                                    optimizer)
from examples.llama.whole_step import WholeStep, initial_streams  # noqa: E402


def announce(args: argparse.Namespace, preset: Preset, mesh: Mesh | None,
             stages: Stages | None) -> None:
  """The run's first lines: jax, the platform, the preset; with --fsdp, the mesh; with
  --pipeline, the stages and their order."""
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; preset {args.preset}: {preset}")
  if stages is not None:
    print(f"--pipeline {args.pipeline} --schedule {args.schedule or '1f1b'}: {len(stages.sizes)} "
          f"chunks of {list(stages.sizes)} parts (embedding, blocks, head) on devices "
          f"{[d.id for d in stages.chunk_devices]}, {preset.microbatches} microbatches"
          f"{', a dispatch thread per stage' if args.pipeline_threads else ''}; "
          f"order {stages.order}")
  if mesh is not None:
    print(f"--fsdp {args.fsdp}: params, grads and optimizer state sharded over "
          f"{mesh.size} {jax.devices()[0].platform} devices of {jax.process_count()} "
          f"process(es), each batch split over them ({preset.batch // mesh.size} "
          "sequences per device and microbatch)")


def load_text(args: argparse.Namespace, preset: Preset, mesh: Mesh | None
              ) -> tuple[Corpus, dict[str, Any]]:
  """The corpus (each batch split over the mesh with --fsdp) and its vocabulary's record."""
  text, corpus = make_corpus(preset, args.seed, args.cache,
                             sharding=None if mesh is None else fsdp.batch_sharding(mesh))
  vocabulary = vocabulary_record(text, corpus.vocabulary)
  print(f"vocabulary: {corpus.vocabulary} of the {text.name}"
        + (", trained now" if getattr(corpus.vocabulary, "trained", False) else ""))
  return corpus, vocabulary


def build_model(args: argparse.Namespace, preset: Preset, corpus: Corpus
                ) -> tuple[Llama, list[Callable[..., Any]], Params, int]:
  """The model (model.py) for the preset and flags; its parts as layer functions and
  params (`split`), and how many params."""
  config = model_config(preset, corpus.vocabulary.size, untied=args.untied, dtype=args.dtype)
  model = Llama(config, rngs=nnx.Rngs(params=args.seed))
  fns, params = split(model)
  count = sum(x.size for x in jax.tree.leaves(params))
  print(f"{count:,} params ({len(params)} parts), vocab {config.vocab}, {len(corpus.ids):,} "
        f"training and {len(corpus.held_out_ids):,} held-out tokens; training state "
        f"{state_bytes(count) / 1e9:.2f} GB (float32 params, AdamW moments, summed grads, one "
        "microbatch's grads)")
  return model, fns, params, count


def place(params: Params, flat: bool, mesh: Mesh | None, compute_dtype: Any
          ) -> tuple[Params, Placement]:
  """The params held flat (--flat) and placed: on one device, or sharded over the mesh
  (gathered in `compute_dtype`: the blocks cast their matrices to it, so half the bytes)."""
  if flat:  # from here on params, grads and the optimizer state are FlatTrees
    params = [jg.flat.ravel(p, group=flat_group) for p in params]
    print(f"params held flat: {len(jax.tree.leaves(params))} buffers for "
          f"{sum(len(p.layout.slots) for p in params)} leaves")
  placement = (Placement() if mesh is None else
               Placement(mesh, shard_threshold(params), compute_dtype))
  return placement.shard(params), placement


class Captured(NamedTuple):
  """The captured layers: for training (None with --whole-step) and for the held-out loss."""

  train: list[Layer] | None
  eval: list[Layer]
  positions: jax.Array
  offload: OffloadChoice | None
  seconds: float  # capture time, warmup included

  def kinds(self) -> list[tuple[str, list[Layer]]]:
    return [("eval", self.eval)] + ([] if self.train is None else [("train", self.train)])


def capture(args: argparse.Namespace, preset: Preset, config: Config,
            fns: Sequence[Callable[..., Any]], params: Params, placement: Placement,
            policy: Callable[..., bool] | None, tuning: lora.FineTuning, *,
            stages: Stages | None = None) -> Captured:
  """Training: forward + backward, dropout keys from each layer's stream (not with
  --whole-step, which trains through one jax.jit); with --lora, no gradients for the frozen
  params (`grad_mask`). Eval: a forward-only copy of the same functions without keys
  (dropout off), for the same shapes. With --offload, the blocks measured and the plan made
  first. With --pipeline, the training layers are captured for the stages, along their
  order; eval stays on the first device (the params gathered there to evaluate)."""
  graph_ends = not args.plain_ends
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
                  build_stage_layers(fns, params, stages, config, preset.batch, preset.context,
                                     positions, rng=jax.random.key(args.seed),
                                     remat_policy=policy)
                  if stages is not None else
                  build_layers(fns, sample_args, graph_ends=graph_ends,
                               rng=jax.random.key(args.seed), remat_policy=policy,
                               grad_mask=tuning.grad_mask, **placement.hooks(),
                               **({} if offload is None else offload.options(graph_ends))))
  eval_layers = build_layers(fns, sample_args, graph_ends=graph_ends, inference_only=True,
                             **placement.hooks())
  capture_seconds = time.perf_counter() - begin
  print(f"captured {'eval' if args.whole_step else 'training and eval'} layers in "
        f"{capture_seconds:.1f} s (incl. warmup)"
        + ("" if graph_ends else "; embedding and head run under plain jax.jit"))
  captured = Captured(train_layers, eval_layers, positions, offload, capture_seconds)
  for kind, layers in captured.kinds()[::-1]:
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
  return captured


def make_step(args: argparse.Namespace, preset: Preset, config: Config,
              fns: Sequence[Callable[..., Any]], params: Params, placement: Placement,
              corpus: Corpus, captured: Captured, policy: Callable[..., bool] | None,
              tuning: lora.FineTuning, *, stages: Stages | None = None
              ) -> tuple[Any, Any, Stepper]:
  """The optimizer, its state (of the params that train; sharded like the params with
  --fsdp) and the training step: the graphed `Trainer`, with --pipeline the
  `PipelineTrainer`, or with --whole-step the `WholeStep`."""
  graph_ends = not args.plain_ends
  tx = optimizer(preset, preset.steps)
  if placement.mesh is None:
    opt_state = tx.init(tuning.trainable(params))
  else:  # made sharded, never whole on one device
    opt_state = placement.jit(tx.init, out_shardings=placement.shardings(
        jax.eval_shape(tx.init, params)))(params)
  streams = initial_streams(args.seed, config.depth + 2 if graph_ends else config.depth)
  trainer: Stepper
  if args.whole_step:
    trainer = WholeStep(fns, config, tx, preset.microbatches, streams, graph_ends, params,
                        opt_state, step_batches(corpus, 0, preset.microbatches),
                        captured.positions, policy, placement)
    print(f"--whole-step: training through one whole-step jax.jit (compiled in "
          f"{trainer.compile_seconds:.1f} s)")
  elif stages is not None:
    trainer = PipelineTrainer(captured.train, config, adamw(preset, preset.steps),
                              preset.microbatches, stages, captured.positions,
                              fuse=args.fuse or False, threads=args.pipeline_threads)
  else:
    trainer = Trainer(captured.train, config, tx, preset.microbatches, params, opt_state,
                      placement, fuse=args.fuse or False, prefetch=args.prefetch,
                      masks=tuning.masks)
  return tx, opt_state, trainer


def train_steps(trainer: Stepper, params: Params, opt_state: Any, losses: list[float],
                eval_losses: list[tuple[int, float]], *, first: int, stop: int,
                preset: Preset, config: Config, corpus: Corpus, captured: Captured,
                checkpoints: Checkpoints, meta: dict[str, Any], out: pathlib.Path,
                stages: Stages | None = None) -> tuple[Params, Any, RoundTimer]:
  """Steps `first + 1` to `stop`: a held-out loss every `eval_every` steps, a checkpoint
  every `checkpoint_every` and at `stop` (with metrics.json of the history so far).

  Losses stay on the device until a round ends or an eval or checkpoint reads them;
  tokens/s is measured per round of steps, without eval and checkpoint time (the timer).
  `losses` and `eval_losses` (step, held-out loss) grow in place; a fine-tuning run's start
  gets a held-out loss too (step 0: the loaded model's). With --pipeline (`stages`) the
  eval layers run on the first device, the params gathered there.
  """
  total, positions = preset.steps, captured.positions

  def held_out(params: Params) -> float:
    gathered = params if stages is None else stages.gather(params)
    return evaluate(captured.eval, gathered, config, corpus, preset.eval_batches, positions)

  if first == 0 and "fine_tuning" in meta:
    interrupt.point("evaluation", 0)
    eval_losses.append((0, held_out(params)))
  metrics_path = out / "metrics.json"
  writer = jax.process_index() == 0  # metrics.json and loss.png: one process writes them
  tokens_per_step = preset.microbatches * preset.batch * preset.context
  # --pipeline-threads: each stage's dispatch thread's CPU time, timed beside this thread's
  threaded = (trainer.pipeline if isinstance(trainer, PipelineTrainer)
              and trainer.pipeline.threads else None)
  timer = RoundTimer(preset.round_steps, tokens_per_step,
                     threads=None if threaded is None else lambda: threaded.thread_seconds)
  pending: list[jax.Array] = []
  bar = progress_bar(range(first + 1, stop + 1), total=total)
  timer.start()
  for step in bar:
    interrupt.point("training", step)
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
      interrupt.point("evaluation", step)
      eval_losses.append((step, held_out(params)))
      bar.write(f"step {step:>5}: train loss {losses[-1]:.4f}, held-out loss "
                f"{eval_losses[-1][1]:.4f}")
    if save:
      history = {"losses": losses, "eval_losses": eval_losses}
      checkpoints.save(step, params, opt_state, trainer.streams(), {**meta, **history})
      if writer:
        with checkpoints.writing(metrics_path):  # for reading; resume needs it not
          write_json(metrics_path, {"step": step, **history})
    timer.start()
  bar.close()
  return params, opt_state, timer


def summarize(args: argparse.Namespace, preset: Preset, params: Params, losses: list[float],
              eval_losses: list[tuple[int, float]], *, first: int, stop: int, count: int,
              timer: RoundTimer, captured: Captured, placement: Placement,
              vocabulary: dict[str, Any], tuning: lora.FineTuning) -> dict[str, Any]:
  """metrics.json's record of the run (--check, --fsdp and generation add to it); prints the
  trained steps' losses and tokens/s, and the peak device memory where devices keep it; a
  LoRA run's frozen params' digest, then and now."""
  mode = "whole-step jax.jit" if args.whole_step else "graphed"
  offload = captured.offload
  run_steps = stop - first
  loop = {**rate_summary(timer.rates, preset.round_steps), **timer.host_summary()}
  result: dict[str, Any] = {
      "preset": args.preset, "mode": "whole_step" if args.whole_step else "graphed",
      "device_kind": jax.devices()[0].device_kind,
      "config": run_config(args, preset), "params": count, "step": stop, "losses": losses,
      "eval_losses": eval_losses, "final_loss": losses[-1] if losses else None,
      "train_seconds": round(timer.seconds, 3), "capture_seconds": round(captured.seconds, 3),
      "tokens_per_second": loop["median"], "throughput": {"loop": loop},
      "params_sha256": arrays_sha256(placement.host(params)), "vocabulary": vocabulary,
      "offload": None if offload is None else offload.summary(),
      "stats": {f"{kind} {layer.name}": layer.stats._asdict()
                for kind, layers in captured.kinds() for layer in graphed(layers)},
      **tuning.report(params, placement),
  }
  tuned = result.get("fine_tuning", {})
  if "base_params_sha256_after" in tuned:
    same = tuned["base_params_sha256_after"] == tuned["base_params_sha256"]
    print(f"--lora: the frozen params' sha256 {tuned['base_params_sha256_after'][:12]}, "
          + ("bitwise as loaded" if same else "CHANGED since they were loaded"))
  if run_steps:
    held_out = f", held-out {eval_losses[-1][1]:.4f}" if eval_losses else ""
    rate = (f"{describe_rates(loop)} {mode}, after {preset.round_steps} untimed warm-up "
            "steps; evaluation and checkpoints not counted; the driving thread's CPU time "
            f"{1e3 * loop['host_seconds_per_step']:.1f} ms of a "
            f"{1e3 * loop['step_seconds']:.1f} ms step"
            + ("" if loop.get("thread_seconds_per_step") is None else
               ", the stages' dispatch threads' " + "/".join(
                   f"{1e3 * s:.1f}" for s in loop["thread_seconds_per_step"]) + " ms")
            if loop["rounds"] else
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
  return result


def plot_losses(args: argparse.Namespace, losses: list[float],
                eval_losses: list[tuple[int, float]], checkpoints: Checkpoints) -> None:
  """loss.png in --out (train and held-out loss), by process 0."""
  if losses and jax.process_index() == 0:
    with checkpoints.writing(args.out / "loss.png"):
      plot(losses, args.out / "loss.png", f"Llama ({args.preset}), "
           f"{'whole-step jax.jit' if args.whole_step else 'blocks graphed'}", eval_losses)


def write_metrics(out: pathlib.Path, result: dict[str, Any], checkpoints: Checkpoints) -> None:
  """metrics.json in `out`, by process 0."""
  if jax.process_index() == 0:
    with checkpoints.writing(out / "metrics.json"):
      write_json(out / "metrics.json", result, indent=1)


class Built(NamedTuple):
  """What a run trains, as `build` makes it from the run's flags."""

  preset: Preset
  stages: Stages | None
  corpus: Corpus
  vocabulary: Any
  model: Llama
  fns: Sequence[Callable[..., Any]]
  params: Params
  count: int  # params
  policy: Callable[..., bool] | None  # the residual policy
  placement: Placement
  tuning: lora.FineTuning
  captured: Captured
  tx: Any  # the optimizer
  opt_state: Any
  trainer: Stepper


def build(args: argparse.Namespace) -> Built:
  """The text, the model as layers (model.py knows nothing of them), the params placed,
  capture, then the optimizer and the step; with --fsdp, where everything lives; with
  --pipeline, each part on its stage. `main` trains it; benchmarks build it the same way."""
  preset = resolve(args)
  mesh = fsdp_mesh(args.fsdp)
  stages = (None if args.pipeline is None else
            plan(args.pipeline, args.schedule or "1f1b", preset.depth, preset.microbatches))
  announce(args, preset, mesh, stages)
  corpus, vocabulary = load_text(args, preset, mesh)
  model, fns, params, count = build_model(args, preset, corpus)
  policy = RESIDUAL_POLICIES[args.residuals]
  params, placement = place(params, args.flat, mesh, model.config.compute_dtype)
  # --init-from: the params of a trained run; --lora: adapters over them, the rest frozen.
  fns, params, tuning = lora.start(args, preset, model, fns, params, placement)
  policy = tuning.residual_policy(policy)
  interrupt.point("capture")
  captured = capture(args, preset, model.config, fns, params, placement, policy, tuning,
                     stages=stages)
  if stages is not None:  # each part on its stage, the eval layers captured on the first
    params = stages.place(params)
  tx, opt_state, trainer = make_step(args, preset, model.config, fns, params, placement,
                                     corpus, captured, policy, tuning, stages=stages)
  return Built(preset, stages, corpus, vocabulary, model, fns, params, count, policy,
               placement, tuning, captured, tx, opt_state, trainer)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  """One run of the command (`argv`: its flags); returns what metrics.json holds."""
  args = parse(argv)
  command = resume_command("examples.llama.train", sys.argv[1:] if argv is None else argv)
  interrupt.starting(args.out / "checkpoints", fresh=args.fresh)
  (preset, stages, corpus, vocabulary, model, fns, params, count, policy, placement, tuning,
   captured, tx, opt_state, trainer) = build(args)
  check = (preset.check and not args.whole_step) if args.check is None else args.check
  stop = min(preset.steps, args.stop_after or preset.steps)
  graph_ends = not args.plain_ends
  positions = captured.positions
  sharded = (None if placement.mesh is None else
             fsdp_report(placement, trainer, params, opt_state, corpus, positions, count))

  # Checkpoints: --resume continues from the newest intact one.
  checkpoints = Checkpoints.for_run(args.out, fresh=args.fresh, command=command,
                                    host=placement.host, keep=args.keep_checkpoints,
                                    legacy_metadata=args.legacy_metadata)
  interrupt.watch(checkpoints, command=command, last_step=preset.steps)
  first, losses, eval_losses = 0, [], []
  if args.resume:
    interrupt.point("restore")
    first, params, opt_state, losses, eval_losses = resume(checkpoints, trainer, params,
                                                           opt_state)
  if check:  # --check reruns the steps from here under one whole-step jax.jit
    start, first_grads = check_lib.starting_point(placement, trainer, params, opt_state,
                                                  corpus, first + 1, positions)

  params, opt_state, timer = train_steps(
      trainer, params, opt_state, losses, eval_losses, first=first, stop=stop, preset=preset,
      config=model.config, corpus=corpus, captured=captured, checkpoints=checkpoints,
      meta=metadata(args, preset, vocabulary, tuning.meta), out=args.out, stages=stages)
  result = summarize(args, preset, params, losses, eval_losses, first=first, stop=stop,
                     count=count, timer=timer, captured=captured, placement=placement,
                     vocabulary=vocabulary, tuning=tuning)
  if stages is not None:
    result["pipeline"] = {"stages": args.pipeline, "schedule": args.schedule or "1f1b",
                          "threads": args.pipeline_threads, "order": stages.order,
                          "per_stage": stage_report(stages, captured.train, params)}
    for stage in result["pipeline"]["per_stage"]:
      peak = stage["peak_bytes"]
      print(f"  stage {stage['stage']} on {stage['device']}: {stage['params']:,} params "
            f"({', '.join(stage['parts'])}), one microbatch's residuals "
            f"{stage['residual_bytes'] / 1e9:.3f} GB"
            + ("" if peak is None else f", peak device memory {peak / 2**30:.2f} GiB"))

  if check and stop > first:
    interrupt.point("check")
    whole, found, whole_state = check_lib.rerun(
        fns, model.config, tx, preset, start, first_grads, graph_ends=graph_ends,
        policy=policy, placement=placement, corpus=corpus, steps=range(first + 1, stop + 1),
        positions=positions, losses=losses[first:], params=params, sharded=sharded)
    del start, first_grads
    # Both continue from their final states (the run's optimizer state is consumed: the
    # checkpoint is written; generation needs the params only).
    result["check"] = check_lib.time_both(found, trainer, (params, opt_state), whole,
                                          whole_state, corpus, positions, preset)
    del opt_state, whole_state
    result["throughput"]["check"] = {k: rate_summary(v, preset.round_steps)
                                     for k, v in found["throughput"].items()}
    check_lib.report_check(found, result["throughput"]["loop"], model.config.compute_dtype,
                           stop - first)

  if sharded is not None:
    result["fsdp"] = sharded
  interrupt.point("outputs")
  plot_losses(args, losses, eval_losses, checkpoints)
  write_metrics(args.out, result, checkpoints)
  if args.generate:
    interrupt.point("generation")
    # One sequence: generated on one device (per process), from the params gathered whole.
    local = placement.local(params) if stages is None else stages.gather(params)
    result["generation"] = write_sample(model, fns, local, corpus,
                                        graph_ends, min(args.generate, preset.context // 2),
                                        args.temperature, args.seed)
    write_metrics(args.out, result, checkpoints)
  if jax.process_index() == 0:
    print(f"wrote {args.out / 'loss.png'}, {args.out / 'metrics.json'}, "
          f"{checkpoints.directory} ({checkpoints.kept()})")
  else:  # loss.png and metrics.json are process 0's
    print(f"process {jax.process_index()} wrote its shards of {checkpoints.directory} "
          f"({checkpoints.kept()}); process 0 wrote loss.png and metrics.json")
  if stop < preset.steps:
    print(f"stopped after step {stop} of {preset.steps} (--stop-after); continue with: "
          f"{command}")
  return result


if __name__ == "__main__":
  interrupt.run(main, sys.argv[1:], command=resume_command("examples.llama.train", sys.argv[1:]),
                rerun=given_command("examples.llama.train", sys.argv[1:]))
