"""Backward time of a LoRA block stack with and without `make_graphed(..., grad_mask=...)`.

A stack of `--layers` blocks, each `x + lora(down, gelu(lora(up, norm(x))))` with
`lora(p, h) = h @ w + (h @ a) @ b` (base weights `w` of d x 4d and 4d x d, adapters of rank
`--rank`), graphed twice: "full" differentiates every float leaf, "lora" masks the base
weights out (`grad_mask`), as a fine-tuning run that trains only the adapters would. Both
replay the same forward; the masked backward has no weight-gradient matmul for `w`.

Per round, each variant (in alternating order) runs `--iters` backward passes of the whole
stack: the forward replayed first (`sequential_vjp`), the device drained, then the timer
covers `pullback(ct)` until its gradients are ready. The round's value is the median of its
passes; the table gives, per variant, the median over rounds and the spread (max - min over
rounds, in % of that median), and the matmuls of one layer's compiled backward (`dot`s and
cuBLAS calls).
The host enqueues one backward executable per layer (tens of microseconds each) while the
device runs them, so at the default sizes the time measured is the device's.

  python -m benchmarks.lora_bench --out /tmp/lora   # d=2048, rank 16, 12 layers, bf16
  python -m benchmarks.lora_bench --tiny            # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from typing import Any

import jax
import pathlib
import jax.numpy as jnp

import jaxgraph as jg
from benchmarks import harness
from examples.records import write_json

VARIANTS = ("full", "lora")


def lora(p: dict[str, jax.Array], h: jax.Array) -> jax.Array:
  return h @ p["w"] + (h @ p["a"]) @ p["b"]


def block(p: dict[str, Any], x: jax.Array) -> jax.Array:
  h = x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True)
                        + 1e-6).astype(x.dtype)
  return x + lora(p["down"], jax.nn.gelu(lora(p["up"], h)))


def init(key: jax.Array, d: int, rank: int, dtype: Any) -> dict[str, Any]:
  k = jax.random.split(key, 6)

  def linear(kw, ka, kb, d_in, d_out):
    return {"w": (jax.random.normal(kw, (d_in, d_out)) / d_in ** 0.5).astype(dtype),
            "a": (jax.random.normal(ka, (d_in, rank)) / d_in ** 0.5).astype(dtype),
            "b": (jax.random.normal(kb, (rank, d_out)) / rank ** 0.5 / 16).astype(dtype)}

  return {"up": linear(*k[:3], d, 4 * d), "down": linear(*k[3:], 4 * d, d)}


# The base weights get no gradient; the adapters and the activation do.
FROZEN = {"w": False, "a": True, "b": True}
MASK = ({"up": FROZEN, "down": FROZEN}, True)


def build(variant: str, params: list[Any], x: jax.Array) -> tuple[jg.GraphedCallable, ...]:
  return jg.make_graphed([block] * len(params), sample_args=[(p, x) for p in params],
                         grad_mask=MASK if variant == "lora" else None)


def backward_matmuls(layer: jg.GraphedCallable) -> int:
  """The matmuls of a layer's compiled backward: `dot`s (also inside fusions, as a Triton
  GEMM's) and cuBLAS calls (which replace a `dot` on the GPU)."""
  (entry,) = layer.executables.entries.values()
  return len(re.findall(r'\bdot\(|custom_call_target="__cublas',
                        entry.backward["full"][0].as_text()))


def time_backward(layers: tuple[jg.GraphedCallable, ...], params: list[Any], x: jax.Array,
                  ct: jax.Array, iters: int) -> float:
  """The median over `iters` of one backward of the stack, in ms (drained to drained)."""
  times = []
  for _ in range(iters):
    y, pullback = jg.sequential_vjp(layers, params, x)
    jax.block_until_ready(y)
    start = time.perf_counter()
    jax.block_until_ready(pullback(ct))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
  dtype = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.key(0), args.layers + 2)
  params = [init(k, args.d, args.rank, dtype) for k in keys[:args.layers]]
  x = jax.random.normal(keys[-2], (args.tokens, args.d)).astype(dtype)
  ct = jax.random.normal(keys[-1], (args.tokens, args.d)).astype(dtype)
  stacks: dict[str, tuple[jg.GraphedCallable, ...]] = {}
  for variant in VARIANTS:
    stacks[variant] = build(variant, params, x)
    time_backward(stacks[variant], params, x, ct, 1)  # load and autotune before timing
  rounds = harness.interleaved(args.rounds, {
      v: (lambda v=v: time_backward(stacks[v], params, x, ct, args.iters)) for v in VARIANTS})
  results: dict[str, Any] = {}
  for variant in VARIANTS:
    spread = harness.summary(rounds[variant])
    results[variant] = dict(backward_ms=spread["median"], spread_pct=spread["spread_pct"],
                            rounds_ms=rounds[variant],
                            backward_matmuls_per_layer=backward_matmuls(stacks[variant][0]),
                            residual_bytes_per_layer=stacks[variant][0].stats.residual_bytes)
  return dict(
      config=dict(d=args.d, rank=args.rank, layers=args.layers, tokens=args.tokens,
                  dtype=args.dtype, rounds=args.rounds, iters=args.iters),
      variants=results, lora_over_full=results["lora"]["backward_ms"] / results["full"][
          "backward_ms"],
      device=jax.devices()[0].device_kind, jax=jax.__version__, platform=platform.platform(),
      command=" ".join(sys.argv))


def table(result: dict[str, Any]) -> str:
  rows = ["| variant | backward ms (median) | spread | matmuls in a layer's backward | "
          "residual bytes per layer |", "| --- | --- | --- | --- | --- |"]
  for variant, r in result["variants"].items():
    rows.append(f"| {variant} | {r['backward_ms']:.3f} | {r['spread_pct']:.1f}% | "
                f"{r['backward_matmuls_per_layer']} | {r['residual_bytes_per_layer']} |")
  c = result["config"]
  rows.append(f"\nlora / full: {result['lora_over_full']:.3f} ({c['layers']} layers, d={c['d']}, "
              f"rank {c['rank']}, {c['tokens']} tokens, {c['dtype']}, {result['device']}; "
              f"{c['rounds']} rounds of {c['iters']})")
  return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tiny", action="store_true", help="CPU smoke run: small sizes, float32")
  parser.add_argument("--d", type=int, default=2048)
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--tokens", type=int, default=8192, help="batch x sequence")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--iters", type=int, default=5, help="backward passes per round")
  parser.add_argument("--out", default=None, help="folder for lora_bench.json")
  args = parser.parse_args(argv)
  if args.tiny:
    args.d, args.rank, args.layers, args.tokens, args.dtype = 64, 4, 2, 32, "float32"
    args.rounds, args.iters = 3, 1
  result = run(args)
  print(table(result))
  print(json.dumps(result))
  if args.out:
    write_json(pathlib.Path(args.out) / "lora_bench.json", result, indent=1)


if __name__ == "__main__":
  main()
