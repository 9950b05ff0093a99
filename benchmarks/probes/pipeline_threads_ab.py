"""A thread per stage against one driving thread, in one process: the Llama example's
pipeline step (`examples.llama.train.build` with `--pipeline-threads`) timed in alternating
rounds with its `jg.schedule.Pipeline`'s `threads` on and off: one build, one compile, the
same executables, so only the dispatch differs.

  python3 -m benchmarks.probes.pipeline_threads_ab --out $OUT/ab-zb.json -- --preset gpu-1b \\
      --pipeline 4 --schedule zero-bubble --fuse --microbatches 16           # 4 GPUs
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
    python3 -m benchmarks.probes.pipeline_threads_ab --rounds 2 --round-steps 1 \\
      --out /tmp/ab.json -- --preset tiny --pipeline 2 --microbatches 2   # CPU smoke run

Each variant trains from its own copy of the state: an untimed round each, then `--rounds`
rounds of `--round-steps` steps between device syncs, alternating (in order in even rounds,
reversed in odd ones, as the example's `--check` alternates). Per variant: tokens/s of each
round (median and spread), and per step the calling thread's CPU time and, threaded, each
stage's dispatch thread's (`Pipeline.thread_seconds`). The example's flags go after `--`
(its --out is a scratch folder here; nothing is written there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--round-steps", type=int, default=3)
  parser.add_argument("--out", help="also write the result JSON here")
  argv = sys.argv[1:] if argv is None else argv
  if "--" not in argv:
    parser.error("the example's flags go after --, e.g. -- --preset tiny --pipeline 2")
  split = argv.index("--")
  args = parser.parse_args(argv[:split])

  from examples.llama import train as example
  from examples.llama.data import step_batches

  flags = [*argv[split + 1:], "--pipeline-threads", "--generate", "0", "--no-check",
           "--out", tempfile.mkdtemp(prefix="pipeline_threads_ab-")]
  built = example.build(example.parse(flags))
  trainer, pipeline = built.trainer, built.trainer.pipeline
  preset, corpus, positions = built.preset, built.corpus, built.captured.positions
  tokens_per_step = preset.microbatches * preset.batch * preset.context
  copy = lambda tree: jax.tree.map(jnp.copy, tree)
  variants = {"threads": True, "one thread": False}
  states = {name: copy((built.params, built.opt_state)) for name in variants}
  found: dict[str, dict[str, list[float]]] = {
      name: {"tok_s": [], "host_ms": [], "thread_ms": []} for name in variants}
  step = 0

  def run(name: str) -> tuple[float, float, list[float]]:
    nonlocal step
    pipeline.threads = variants[name]
    params, opt_state = states[name]
    threads_before = list(pipeline.thread_seconds)
    begin, cpu = time.perf_counter(), time.thread_time()
    for _ in range(args.round_steps):
      step += 1
      params, opt_state, loss = trainer.step(
          params, opt_state, step_batches(corpus, step, preset.microbatches), positions)
    cpu = time.thread_time() - cpu
    jax.block_until_ready(loss)
    seconds = time.perf_counter() - begin
    states[name] = params, opt_state
    threads = [after - before for after, before in zip(pipeline.thread_seconds, threads_before)]
    return seconds, cpu, threads

  for name in variants:
    run(name)  # warm-up, not timed
  for index in range(args.rounds):
    for name in (list(variants) if index % 2 == 0 else list(variants)[::-1]):
      seconds, cpu, threads = run(name)
      found[name]["tok_s"].append(round(args.round_steps * tokens_per_step / seconds, 1))
      found[name]["host_ms"].append(round(1e3 * cpu / args.round_steps, 2))
      found[name]["thread_ms"].append(max((round(1e3 * t / args.round_steps, 2)
                                           for t in threads), default=0.0))
  result: dict[str, Any] = {"example_flags": argv[split + 1:], "rounds": args.rounds,
                            "round_steps": args.round_steps, "device_kind":
                            jax.devices()[0].device_kind, "jax": jax.__version__}
  for name, values in found.items():
    median = statistics.median(values["tok_s"])
    result[name] = {**values, "median_tok_s": median,
                    "spread_pct": round(100 * (max(values["tok_s"]) - min(values["tok_s"]))
                                        / median, 1)}
    print(f"{name:>10}: {median:,.0f} tok/s (rounds {values['tok_s']}), calling thread "
          f"{statistics.median(values['host_ms']):.1f} ms a step, busiest dispatch thread "
          f"{statistics.median(values['thread_ms']):.1f} ms", flush=True)
  result["threads_over_one"] = round(result["threads"]["median_tok_s"]
                                     / result["one thread"]["median_tok_s"], 3)
  print(f"threads / one thread: {result['threads_over_one']}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
