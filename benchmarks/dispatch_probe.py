"""Host cost of one replayed executable, and what it depends on.

Enqueues `--calls` calls of an executable onto an idle device (fewer than the 32 executions
PjRt keeps in flight, so the host never waits) and reports host µs per call, median of
`--reps`. Cases, on the forward executable jaxgraph captured for one GPT block:
  trivial        a jitted `x + 1` on 16 floats (the fixed dispatch cost)
  leaves         13 inputs, 39 outputs of 16 floats (the per-leaf cost, no real work)
  layer-same     the layer forward, the same arguments every call (stable buffer addresses)
  layer-rotate   the layer forward over the 12 layers' parameters (as a step calls it)
  layer-own      the same, one loaded copy of the executable per layer
  layer-rotate with compiler options: command buffers off, FUSION only
  backward-same, backward-rotate, backward-own
                 the same three for the layer's backward executable (residuals from one
                 forward per layer)

  PYTHONPATH=.:benchmarks python3 benchmarks/dispatch_probe.py --size small --out /tmp/probe
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable

import bench  # sets the allocator environment before jax starts
import gpt
import jax
import jax.numpy as jnp

from jaxgraph import capture as capture_lib


def host_us(call: Callable[[int], Any], calls: int, reps: int) -> float:
  times = []
  for _ in range(reps):
    jax.block_until_ready(call(0))
    start = time.perf_counter()
    results = [call(i) for i in range(calls)]
    times.append(time.perf_counter() - start)
    jax.block_until_ready(results)
  return 1e6 * statistics.median(times) / calls


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size", default="small", choices=list(gpt.SIZES))
  parser.add_argument("--calls", type=int, default=24)
  parser.add_argument("--reps", type=int, default=9)
  parser.add_argument("--out", default=".")
  args = parser.parse_args()
  size = gpt.SIZES[args.size]
  attention = gpt.default_attention()
  variant = bench.build("jaxgraph", size, attention)
  layers, params = variant.layers, variant.state
  x = gpt.init_input(size)
  [entry] = layers[0]._entries.values()
  forward = entry.forward["stream", True]
  base, counter = jax.random.key(0), jnp.uint32(0)
  indices = [jnp.uint32(i) for i in range(len(layers))]
  leaves = [[*jax.tree.leaves(p), x] for p in params]
  results: dict[str, float] = {}

  def rotate(exes: list[Any]) -> Callable[[int], Any]:
    n = len(leaves)
    return lambda i: exes[i % n](base, indices[i % n], counter, *leaves[i % n])

  trivial = jax.jit(lambda v: v + 1).lower(jnp.zeros(16)).compile()
  small = jnp.zeros(16)
  results["trivial"] = host_us(lambda i: trivial(small), args.calls, args.reps)
  many = jax.jit(lambda *a: [a[i % 13] + i for i in range(39)]).lower(*[small] * 13).compile()
  results["leaves"] = host_us(lambda i: many(*[small] * 13), args.calls, args.reps)
  results["layer-same"] = host_us(lambda i: forward(base, indices[0], counter, *leaves[0]),
                                  args.calls, args.reps)
  results["layer-rotate"] = host_us(rotate([forward] * len(leaves)), args.calls, args.reps)
  results["layer-own"] = host_us(rotate([capture_lib.loaded_copy(forward) for _ in leaves]),
                                 args.calls, args.reps)
  layout = entry.layout
  backward, _ = entry.backward["full"]
  saved = []
  for i, layer_leaves in enumerate(leaves):  # what a step's pullback of layer i passes
    *values, key, _ = forward(base, indices[i], counter, *layer_leaves)
    outs, inputs = values[:layout.n_out], layer_leaves + [key]
    saved.append([*(inputs[j] for j in layout.needed_inputs),
                  *(outs[j] for j in layout.needed_outputs), *values[layout.n_out:], x])
  n = len(saved)
  results["backward-same"] = host_us(lambda i: backward(*saved[0]), args.calls, args.reps)
  results["backward-rotate"] = host_us(lambda i: backward(*saved[i % n]), args.calls, args.reps)
  own = [capture_lib.loaded_copy(backward) for _ in saved]
  results["backward-own"] = host_us(lambda i: own[i % n](*saved[i % n]), args.calls, args.reps)
  fwd = capture_lib._forward_fn(entry.closed_jaxpr, entry.layout, "stream", outputs_only=False,
                                moved=())
  lowered = jax.jit(fwd).trace(
      *capture_lib._forward_specs(entry.signature, entry.layout, "stream")).lower()
  for label, options in (("cmdbuf-off", {"xla_gpu_enable_command_buffer": ""}),
                         ("cmdbuf-fusion", {"xla_gpu_enable_command_buffer": "FUSION"})):
    try:
      exe = lowered.compile(compiler_options=options)
    except Exception as e:  # an option this backend does not know
      results[f"layer-rotate-{label}"] = None
      print(f"{label}: {type(e).__name__}: {e}")
      continue
    results[f"layer-rotate-{label}"] = host_us(rotate([exe] * len(leaves)), args.calls,
                                               args.reps)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "dispatch.json"), "w") as f:
    json.dump(dict(size=args.size, calls=args.calls, host_us_per_call=results), f, indent=1)
  for name, us in results.items():
    print(f"{name:28} {us if us is None else round(us, 1)}")


if __name__ == "__main__":
  main()
