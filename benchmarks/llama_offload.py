"""Residual offload in the Llama example's training step: activation memory and tokens/s.

  python3 -m benchmarks.llama_offload --preset gpu-1b --context 8192 --batch 2 \
      --out /tmp/llama-offload                                   # one GPU
  python3 -m benchmarks.llama_offload --preset tiny --out /tmp/lo   # CPU smoke run

Each variant (an `--offload` of examples/llama/train.py: by default none, slowdown=5% and
all) runs alone in a fresh process, as peak_bytes_in_use only grows. It builds the
example's vocabulary, model (flat params, `--residuals recompute`) and graphed training
step as `train.py --offload ...` does: for an offloading variant, `plan_offload`
first measures the blocks without offload (one block's residuals alive at a time) and the
link, and plans; then the training layers are captured with the plan's flags and
`offload_min_bytes`. Then `--warmup` untimed steps and `--rounds` rounds of `--round-steps`
optimizer steps, each round timed between device syncs (tokens/s: the median round).

Activation memory: the peak of device bytes in use (over the whole process) minus the bytes
in use before the first step (params, optimizer state, executables): the residuals, the
summed and one microbatch's gradients, and temporaries. The planner's measurement runs
before that, and its peak (one block's residuals) is below a step's.

Writes llama_offload.json to --out after every variant (a run cut short keeps the variants
done): per variant its rounds, median tokens/s, step seconds, memory, the blocks' kept and
host-held residual bytes, and for offloading variants the per-block measurement and the plan;
`table` lists each beside none. A variant that fails is recorded with its error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jaxgraph as jg
from benchmarks import harness
from examples.llama.data import make_corpus, step_batches, vocabulary_record
from examples.llama.layers import RESIDUAL_POLICIES, build_layers, split, tied_inputs
from examples.llama.model import Llama
from examples.llama.offload import offload_spec, plan_offload
from examples.llama.presets import PRESETS, Preset, model_config
from examples.llama.trainer import Trainer, flat_group, optimizer
from examples.records import write_json

VARIANTS = ("none", "slowdown=5%", "all")


def preset_of(args: argparse.Namespace) -> Preset:
  """The example's preset with --context and --batch."""
  changes = {"context": args.context, "batch": args.batch}
  return dataclasses.replace(PRESETS[args.preset],
                             **{k: v for k, v in changes.items() if v is not None})


def run_variant(args: argparse.Namespace, variant: str) -> dict[str, Any]:
  """One variant in this process: the example's step built with `--offload variant`, timed."""
  spec = offload_spec(variant)
  preset = preset_of(args)
  if jax.default_backend() != "gpu":
    preset = dataclasses.replace(preset, attention=None)  # cuDNN attention: GPUs only
  text, corpus = make_corpus(preset, 0, args.cache)
  config = model_config(preset, corpus.vocabulary.size)
  fns, params = split(Llama(config, rngs=nnx.Rngs(params=0)))
  params = [jg.flat.ravel(p, group=flat_group) for p in params]
  tokens = jax.ShapeDtypeStruct((preset.batch, preset.context), jnp.int32)
  x = jax.ShapeDtypeStruct((preset.batch, preset.context, config.width), config.compute_dtype)
  positions = jnp.arange(preset.context)
  sample_args = ([(params[0], tokens)] + [(p, x, positions) for p in params[1:-1]]
                 + [(params[-1], x, tokens, *tied_inputs(params, config))])
  policy = RESIDUAL_POLICIES["recompute"]
  begin = time.perf_counter()
  choice = None
  if spec.kind != "none":
    choice = plan_offload(spec, fns[1:-1], params[1:-1], x, positions,
                                remat_policy=policy, seed=0)
    print(f"[{variant}]\n{choice.table()}\n{choice.plan}", flush=True)
  plan_seconds = time.perf_counter() - begin
  layers = build_layers(fns, sample_args, graph_ends=True, rng=jax.random.key(0),
                              remat_policy=policy,
                              **({} if choice is None else choice.options(graph_ends=True)))
  tx = optimizer(preset, 1000)
  state = (params, tx.init(params))
  trainer = Trainer(layers, config, tx, preset.microbatches, *state)
  capture_seconds = time.perf_counter() - begin - plan_seconds
  blocks = layers[1:-1]
  before = harness.device_memory()
  done = 0

  def steps(count: int) -> None:
    nonlocal state, done
    for _ in range(count):
      done += 1
      *state, _ = trainer.step(*state, step_batches(corpus, done, preset.microbatches),
                               positions)
    jax.block_until_ready(state)

  steps(args.warmup)
  tokens_per_step = preset.microbatches * preset.batch * preset.context
  rates = []
  for _ in range(args.rounds):
    start = time.perf_counter()
    steps(args.round_steps)
    rates.append(args.round_steps * tokens_per_step / (time.perf_counter() - start))
  after = harness.device_memory()
  result: dict[str, Any] = {
      "variant": variant, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
      "preset": args.preset, "context": preset.context,
      "batch": preset.batch, "microbatches": preset.microbatches,
      "attention": preset.attention, "vocabulary": vocabulary_record(text,
                                                                            corpus.vocabulary),
      "params": sum(x.size for x in jax.tree.leaves(params)),
      "tokens_per_step": tokens_per_step, "rounds_tok_s": [round(r, 1) for r in rates],
      "tok_s": round(statistics.median(rates), 1),
      "step_s": tokens_per_step / statistics.median(rates),
      "plan_seconds": round(plan_seconds, 2), "capture_seconds": round(capture_seconds, 2),
      "residual_bytes": sum(b.stats.residual_bytes for b in blocks),
      "offload_bytes": sum(b.stats.offload_bytes for b in blocks),
      "offload": None if choice is None else choice.summary()}
  result.update(harness.memory_record(before, after))
  return result


def table(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
  """Each variant beside none: activation peak and tokens/s, and their change."""
  base = results.get("none", {})
  rows = []
  for variant, r in results.items():
    if "error" in r:
      rows.append({"variant": variant, "error": r["error"].splitlines()[-1]})
      continue
    row = {"variant": variant, "tok_s": r["tok_s"],
           "offload_GiB": round(r["offload_bytes"] / 2**30, 3),
           "residual_GiB": round(r["residual_bytes"] / 2**30, 3)}
    if base.get("tok_s"):
      row["tok_s_vs_none"] = round(r["tok_s"] / base["tok_s"] - 1, 4)
    if "activation_peak" in r:
      row["activation_peak_GiB"] = round(r["activation_peak"] / 2**30, 3)
      if base.get("activation_peak"):
        row["activation_vs_none"] = round(r["activation_peak"] / base["activation_peak"] - 1, 4)
    if r["offload"]:
      row["plan"] = r["offload"]["report"]
    rows.append(row)
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="gpu-1b", choices=sorted(PRESETS))
  parser.add_argument("--context", type=int, help="tokens per sequence (default: the preset's)")
  parser.add_argument("--batch", type=int, help="sequences per microbatch (default: preset's)")
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS),
                      help="--offload values of the example (none, all, slowdown=P%%, "
                           "memory=SIZE)")
  parser.add_argument("--warmup", type=int, default=3, help="untimed steps")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--round-steps", type=int, default=5)
  parser.add_argument("--cache", type=pathlib.Path, default=pathlib.Path("runs/cache"),
                      help="the example's tokenizers and encoded texts (its --cache)")
  parser.add_argument("--deadline", type=float, default=float("inf"),
                      help="seconds after the start past which no further variant starts")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/llama-offload"))
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args()
  for variant in args.variants:
    try:
      offload_spec(variant)
    except argparse.ArgumentTypeError as e:
      parser.error(str(e))
  if args.child is not None:
    try:
      result = run_variant(args, args.child)
    except Exception:  # one line for the parent: the traceback went to stderr
      traceback.print_exc()
      result = {"variant": args.child, "error": traceback.format_exc()}
    print("RESULT " + json.dumps(result), flush=True)
    return

  args.out.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  # No device use in this process: it would hold device memory while the children run.
  found: dict[str, Any] = {"argv": sys.argv[1:], "xla_flags": os.environ.get("XLA_FLAGS", ""),
                           "variants": {}}
  for variant in args.variants:
    if time.perf_counter() - start > args.deadline:
      found["variants"][variant] = {"variant": variant, "error": "skipped: past --deadline"}
      continue
    command = [sys.executable, "-m", "benchmarks.llama_offload", *sys.argv[1:], "--child", variant]
    run = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = run.stdout.splitlines()
    print("\n".join(line for line in lines if not line.startswith("RESULT ")), flush=True)
    lines = [line for line in lines if line.startswith("RESULT ")]
    found["variants"][variant] = (json.loads(lines[-1][len("RESULT "):]) if lines else
                                  {"variant": variant, "error": f"exit {run.returncode}: "
                                   + run.stderr[-4000:]})
    found["table"] = table(found["variants"])
    found["seconds"] = round(time.perf_counter() - start, 1)
    write_json(args.out / "llama_offload.json", found, indent=1)
    print(json.dumps(found["table"][-1]), flush=True)
  print(f"wrote {args.out / 'llama_offload.json'} in {found['seconds']:.0f} s")


if __name__ == "__main__":
  main()
