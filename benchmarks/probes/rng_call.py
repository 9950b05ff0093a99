"""The host cost of a replayed call of a layer with a key stream (`rng=True`) over a mesh.

A small dropout layer graphed with `rng=True`, its params replicated and its batch split
over the first `--devices` devices; the median of `--rounds` bursts of `--calls` `vjp` calls
(each after a sync), µs per call. Its key stream's inputs (base key, index, counter) are
what differs from a layer without one: placed otherwise than the stream forward takes them,
each call copies them to every device first. Compare two trees by alternating the package
on the path (`-P`: the working directory not put before it):

  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
    PYTHONPATH=.old:. python3 -P -m benchmarks.probes.rng_call --devices 4

Prints one line and, with `--json PATH`, writes it there as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxgraph as jg


def layer(params: dict[str, jax.Array], x: jax.Array, *, key: jax.Array) -> jax.Array:
  y = jnp.tanh(x @ params["w"])
  return jnp.where(jax.random.bernoulli(key, 0.9, y.shape), y / 0.9, 0)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=30)
  parser.add_argument("--calls", type=int, default=50)
  parser.add_argument("--json", metavar="PATH")
  args = parser.parse_args()
  mesh = Mesh(np.array(jax.devices()[:args.devices]), ("d",))
  params = jax.device_put({"w": jnp.ones((8, 8)) / 8}, NamedSharding(mesh, PartitionSpec()))
  x = jax.device_put(jnp.ones((8 * args.devices, 8)), NamedSharding(mesh, PartitionSpec("d")))
  (graphed,) = jg.make_graphed([layer], sample_args=[(params, x)], rng=True, num_warmup_iters=1)
  for _ in range(args.calls):  # the first replays place what they may place once
    y, pullback = graphed.vjp(params, x)
    pullback(y)
  jax.block_until_ready(y)
  per_call = []
  for _ in range(args.rounds):
    begin = time.perf_counter()
    for _ in range(args.calls):
      y, _ = graphed.vjp(params, x)
    jax.block_until_ready(y)
    per_call.append((time.perf_counter() - begin) / args.calls * 1e6)
  result = {"devices": args.devices, "platform": jax.devices()[0].platform,
            "jaxgraph": jg.__file__, "median_us": round(statistics.median(per_call), 1),
            "min_us": round(min(per_call), 1)}
  print(f"rng layer vjp over {args.devices} {result['platform']} device(s): "
        f"{result['median_us']} µs a call (min {result['min_us']}); jaxgraph {jg.__file__}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f)


if __name__ == "__main__":
  main()
