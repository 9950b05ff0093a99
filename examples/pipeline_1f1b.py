"""A 2-stage 1F1B pipeline of graphed layers, one stage per device, from one Python process.

On CPU it asks XLA for 2 host devices, so it runs anywhere in a few seconds:

  python -m examples.pipeline_1f1b [--zero-bubble] [--compare]

Each stage is a chunk of identical layers; they compile once per device (a signature
includes the device). The order is the two ranks' 1F1B orders merged into one for a single
controller; `--zero-bubble` splits every backward into dgrad and a deferred wgrad.
`--compare` trains again with both stages on the first device and checks that the weights
are bitwise the same. `--width`, `--layers`, `--microbatches`, `--steps` size it for a GPU.
Ctrl-C ends it in one line: what it finished and the command that runs it again
(`examples/interrupt.py`; it saves nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxgraph as jg  # noqa: E402
from jaxgraph import schedule  # noqa: E402
from examples import interrupt  # noqa: E402
from examples.options import given_command  # noqa: E402

STAGES = 2


def layer(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  return x + jnp.tanh(x @ params["w"] + params["b"])


def loss_fn(y: jax.Array, target: jax.Array) -> jax.Array:
  return jnp.mean((y - target) ** 2)


def train(args: argparse.Namespace, devices: list[jax.Device], order: list[float], *,
          phase: str = "training"
          ) -> tuple[list[list[dict[str, jax.Array]]], list[float], list[jg.GraphedCallable]]:
  """Trains `args.steps` SGD steps; returns the weights, the step times and the layers
  (`phase`: the run's `interrupt.point` while it trains)."""
  per_stage = args.layers // STAGES
  keys = jax.random.split(jax.random.key(0), args.layers + 2)
  params = [[jax.device_put({"w": jax.random.normal(keys[s * per_stage + l],
                                                    (args.width, args.width)) / np.sqrt(args.width),
                             "b": jnp.zeros(args.width)}, devices[s])
             for l in range(per_stage)] for s in range(STAGES)]
  data = jax.random.normal(keys[-2], (args.microbatches, args.batch, args.width))
  inputs = list(data)
  targets = list(jnp.sin(data) + 0.1 * jax.random.normal(keys[-1], data.shape))

  # One sample per layer, on its stage's device.
  samples = [(p, jax.device_put(inputs[0], devices[s]))
             for s, stage in enumerate(params) for p in stage]
  interrupt.point("capture" if phase == "training" else phase)  # --compare's: part of it
  layers = jg.make_graphed([layer] * args.layers, sample_args=samples, order=order,
                           delay_wgrad=args.zero_bubble, num_warmup_iters=1)
  chunks = [list(layers[s * per_stage:(s + 1) * per_stage]) for s in range(STAGES)]
  pipeline = schedule.Pipeline(chunks, order, loss_fn=loss_fn, devices=devices)
  sgd = jax.jit(lambda p, g: jax.tree.map(lambda w, d: w - 0.05 * d, p, g))
  times = []
  for step in range(args.steps):
    interrupt.point(phase, step)
    start = time.perf_counter()
    result = pipeline(params, inputs, targets)
    params = [sgd(p, g) for p, g in zip(params, result.grads)]
    jax.block_until_ready(params)
    times.append(time.perf_counter() - start)
    print(f"step {step}: mean loss {float(jnp.mean(jnp.stack(result.losses))):.5f}")
  return params, times, list(layers)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--zero-bubble", action="store_true")
  parser.add_argument("--compare", action="store_true")
  parser.add_argument("--width", type=int, default=32)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--microbatches", type=int, default=6)
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args(argv)
  devices = jax.devices()[:STAGES]
  if len(devices) < STAGES:
    raise SystemExit(f"needs {STAGES} devices, found {len(jax.devices())}")
  build = schedule.zero_bubble if args.zero_bubble else schedule.one_f_one_b
  order = schedule.merge_ranks([build(args.microbatches, pipeline_parallel_size=STAGES, rank=r)
                                for r in range(STAGES)])
  print("order:", order)
  params, times, layers = train(args, devices, order)
  interrupt.finished(f"the {args.steps} training steps over {STAGES} devices")
  interrupt.point("summary")
  print("captures per layer:", [g.stats.captures for g in layers],
        "compiles:", sum(g.stats.compiles for g in layers))
  print("stage devices:", [str(next(iter(stage[0]["w"].devices()))) for stage in params])
  if len(times) > 1:
    print(f"step time over 2 devices: median {statistics.median(times[1:]) * 1e3:.2f} ms")
  if args.compare:
    single, single_times, _ = train(args, [devices[0]] * STAGES, order, phase="compare")
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params),
                                                      jax.tree.leaves(single)))
    print("weights bitwise equal to one device:", same)
    if len(single_times) > 1:
      print(f"step time on 1 device: median {statistics.median(single_times[1:]) * 1e3:.2f} ms")


if __name__ == "__main__":
  interrupt.run(main, sys.argv[1:], rerun=given_command("examples.pipeline_1f1b", sys.argv[1:]))
