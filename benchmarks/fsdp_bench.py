"""FSDP: peak device memory and step time of graphed FSDP vs. a whole-step `jax.jit` FSDP step.

The GPT block stack of `gpt.py` (bf16, dropout with explicit keys), weights sharded over all
devices with `jg.fsdp` (data parallel over the same axis). A step is the forward, the loss
gradient, the backward and an SGD update (params donated). Two variants:

  graphed   make_graphed([remat(gather + block)] * L): one layer's weights gathered at a time
  jit       one jax.jit of the whole step, the same layer function (XLA schedules the gathers)

Memory: each variant runs in its own process (`peak_bytes_in_use` only grows); the peak is
the largest over the local devices. Also reported for both, from the compiled executables'
`memory_analysis()` (per device, available on CPU too): the graphed per-layer forward and
backward bytes and the jit step's. What to look for: a graphed peak at most sharded weights
+ 2 gathered layers + activations, and below the jit step's peak.
Time: one process builds both and alternates them, `--reps` rounds of `--iters` steps;
median per step.

  python3 -m benchmarks.fsdp_bench --out /tmp/fsdp                 # 2 GPUs
  XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
      python3 -m benchmarks.fsdp_bench --tiny --out /tmp/fsdp        # CPU smoke run
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
from typing import Any, Callable

import jax
import pathlib
import jax.numpy as jnp

import jaxgraph as jg
from benchmarks import gpt, harness
from examples.records import write_json
from jaxgraph import _capture as capture_lib
from jaxgraph import fsdp

VARIANTS = ("graphed", "jit")


@dataclasses.dataclass
class Setup:
  """One variant, ready to step: `params = step(params, index)`."""

  params: list[Any]
  step: Callable[[list[Any], int], list[Any]]
  analysis: dict[str, Any]


def _analysis(compiled: Any) -> dict[str, int]:
  m = compiled.memory_analysis()
  return dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes,
              temp=m.temp_size_in_bytes, alias=m.alias_size_in_bytes)


def _nbytes(tree: Any, per_device: bool) -> int:
  """Bytes of a tree's leaves: one device's shards, or the full (gathered) arrays."""
  return sum(leaf.addressable_shards[0].data.nbytes if per_device else leaf.nbytes
             for leaf in jax.tree.leaves(tree))


def build(size: gpt.Size, variant: str, attention: str | None, warmup: int) -> Setup:
  mesh = fsdp.make_mesh()
  batch = fsdp.batch_sharding(mesh)
  host_params = gpt.init_params(size)
  specs = fsdp.shardings(host_params, mesh)
  params = fsdp.shard(host_params, mesh)
  x0 = jax.device_put(gpt.init_input(size), batch)
  base = jax.random.key(2)
  split = jax.jit(lambda s: tuple(jax.random.split(jax.random.fold_in(base, s), size.layers)))
  block = gpt.make_block(size.heads, attention)

  def layer(p: Any, x: jax.Array, *, key: jax.Array) -> jax.Array:
    return jax.lax.with_sharding_constraint(block(fsdp.gather(p, mesh), x, key=key), batch)

  layer = fsdp.remat(layer)
  update = jax.jit(gpt.sgd, donate_argnums=0, out_shardings=specs)
  if variant == "graphed":
    layers = jg.make_graphed([layer] * size.layers, sample_args=[(p, x0) for p in params],
                             rng=True, num_warmup_iters=warmup)
    head = jax.jit(jax.grad(gpt.loss))

    def step(params: list[Any], index: int) -> list[Any]:
      keys = split(jnp.uint32(index))
      y, pullback = jg.sequential_vjp(layers, params, x0, keys=list(keys))
      grads, _ = pullback(head(y))
      return update(params, grads)

    (entry,) = layers[0].executables.entries.values()
    forward, _ = capture_lib.forward_executable(entry, "explicit", residuals=True)
    analysis = dict(forward=_analysis(forward),
                    backward=_analysis(entry.backward["full"][0]))
    return Setup(params, step, analysis)

  def loss(params: list[Any], keys: tuple[jax.Array, ...]) -> jax.Array:
    x = x0
    for p, k in zip(params, keys):
      x = layer(p, x, key=k)
    return gpt.loss(x)

  def whole(params: list[Any], keys: tuple[jax.Array, ...]) -> list[Any]:
    return gpt.sgd(params, jax.grad(loss)(params, keys))

  compiled = jax.jit(whole, donate_argnums=0, out_shardings=specs).lower(
      params, split(jnp.uint32(0))).compile()
  return Setup(params, lambda params, index: compiled(params, split(jnp.uint32(index))),
               dict(step=_analysis(compiled)))


def measure_memory(size: gpt.Size, variant: str, attention: str | None) -> dict[str, Any]:
  """One variant, alone in this process: bytes in use and peaks around capture and steps."""
  before = harness.device_memory()
  setup = build(size, variant, attention, warmup=0)
  after_capture = harness.device_memory()
  params = setup.step(setup.params, 0)
  params = setup.step(params, 1)
  jax.block_until_ready(params)
  after_steps = harness.device_memory()
  one_layer = params[0]
  result: dict[str, Any] = dict(
      kind="memory", variant=variant, devices=jax.device_count(), analysis=setup.analysis,
      sharded_weight_bytes=_nbytes(params, per_device=True),
      gathered_layer_bytes=_nbytes(one_layer, per_device=False))
  result.update(harness.memory_record(before, after_steps, after_capture=after_capture))
  return result


def measure_time(size: gpt.Size, variants: list[str], attention: str | None, iters: int,
                 reps: int) -> dict[str, Any]:
  """Both variants in this process, alternated: median seconds per step."""
  setups = {v: build(size, v, attention, warmup=1) for v in variants}
  params = {v: setups[v].step(setups[v].params, 0) for v in variants}

  def step(v: str, index: int) -> list[Any]:
    params[v] = setups[v].step(params[v], index)
    return params[v]

  times = harness.interleaved(reps, {
      v: lambda v=v: harness.seconds_per_step(functools.partial(step, v), iters)
      for v in variants})
  return dict(kind="time", iters=iters, reps=reps,
              step_s={v: statistics.median(t) for v, t in times.items()}, step_s_all=times)


def report(results: dict[str, Any]) -> str:
  mib = functools.partial(harness.mib, places=2)
  memory = {r["variant"]: r for r in results["memory"] if "variant" in r}
  step_s = results.get("time", {}).get("step_s", {})
  lines = ["variant   peak MiB  compiled temp MiB (per device)   step ms",
           "--------  --------  -----------------------------   -------"]
  for v in results["variants"]:
    m, t = memory.get(v, {}), step_s.get(v)
    a = m.get("analysis", {})
    temp = (f"fwd {mib(a['forward']['temp'])} / bwd {mib(a['backward']['temp'])} per layer"
            if "forward" in a else f"step {mib(a['step']['temp'])}" if "step" in a else "-")
    lines.append(f"{v:<8}  {mib(m.get('peak_after_steps')):>8}  {temp:<29}   "
                 f"{t * 1e3 if t else float('nan'):>7.1f}")
  g = memory.get("graphed", {})
  if "analysis" in g:
    lines.append(f"sharded weights {mib(g['sharded_weight_bytes'])} MiB per device, one "
                 f"gathered layer {mib(g['gathered_layer_bytes'])} MiB, residuals per layer "
                 f"{mib(g['analysis']['forward']['output'])} MiB per device")
  return "\n".join(lines)


def main() -> None:
  args = harness.parse_args(__doc__.splitlines()[0], VARIANTS, "fsdp_bench.json")
  size = gpt.SIZES[args.size]
  attention = harness.attention(args.attention)
  results = harness.drive(
      "benchmarks.fsdp_bench", args, size, lambda v: measure_memory(size, v, attention),
      lambda: measure_time(size, args.variants, attention, args.iters, args.reps),
      show=lambda result: json.dumps(result)[:2000])
  if results is None:
    return
  results["table"] = report(results)
  if args.out:
    write_json(pathlib.Path(args.out) / "fsdp_bench.json", results, indent=1)
  print(f"{results['devices']} x {results['device']}, jax {results['jax']}, size {size}")
  print(results["table"])


if __name__ == "__main__":
  main()
