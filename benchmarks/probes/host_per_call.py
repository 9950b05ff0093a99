"""jaxgraph's host path per replayed call: small layers, so the host cost is what is timed.

Four identical layers (4 matmuls of 16 × 16, pytree params of 8 leaves) replayed through
`vjp` and their pullbacks; the median of `--rounds` rounds of `--steps` steps, in µs per
executable call. Compare two trees by alternating the package on the path (the tree to
measure first, this one after it for `benchmarks`):

  for t in .old . .old .; do PYTHONPATH=$t:. python3 benchmarks/probes/host_per_call.py; done
  PYTHONPATH=. python3 benchmarks/probes/host_per_call.py --rounds 2 --steps 2   # smoke run
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

import jaxgraph as jg
from benchmarks import harness


def layer(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  for i in range(4):
    x = jnp.tanh(x @ params[f"w{i}"] + params[f"b{i}"])
  return x


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=30)
  parser.add_argument("--steps", type=int, default=20)
  args = parser.parse_args()
  params = ({f"w{i}": jnp.full((16, 16), 0.01) for i in range(4)}
            | {f"b{i}": jnp.zeros(16) for i in range(4)})
  x, ct = jnp.ones((4, 16)), jnp.ones((4, 16))
  layers = jg.make_graphed([layer] * args.layers, sample_args=[(params, x)] * args.layers,
                           num_warmup_iters=1)

  def step() -> jax.Array:
    h, pullbacks = x, []
    for graphed in layers:
      h, pullback = graphed.vjp(params, h)
      pullbacks.append(pullback)
    g = ct
    for pullback in reversed(pullbacks):
      _, g = pullback(g)
    return g

  jax.block_until_ready(step())
  calls = 2 * args.layers * args.steps
  samples = []
  for _ in range(args.rounds):
    begin = time.perf_counter()
    for _ in range(args.steps):
      g = step()
    jax.block_until_ready(g)
    samples.append((time.perf_counter() - begin) / calls * 1e6)
  found = harness.summary(samples)
  result = {"jaxgraph": jg.__file__, "backend": jax.default_backend(),
            "us_per_call": found["median"], "spread_pct": found["spread_pct"]}
  print(f"{'jaxgraph':<40} {'µs/call':>8} {'spread':>7}")
  print(f"{result['jaxgraph']:<40} {result['us_per_call']:>8.1f} {result['spread_pct']:>6.0f}%")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
