"""Residual offload: peak device memory and step time of a GPT stack, with and without it.

The 12-layer GPT block stack of `gpt.py` (bf16, dropout with explicit keys). A step is the
forward, the loss gradient and the backward (no update: every step computes the same
gradients from the same keys). Three variants:

  none        make_graphed(..., offload_residuals=False)
  all         offload_residuals=True
  all-but-2   offload_residuals=[True] * (L - 2) + [False] * 2 (the last two layers' residuals
              are read first by the backward, so they stay on device)

Memory: each variant runs in its own process (`peak_bytes_in_use` only grows), built with
num_warmup_iters=0 so the peak after capture (compilation, autotuning) and the peak after
the first steps are told apart; activation memory is the peak minus the bytes in use before
capture (parameters and input), so it includes the gradients the backward returns.
Time: one process builds all variants and alternates them, `--reps` rounds of `--iters`
steps; median per step. Gradients of the first step are compared bitwise across variants,
and the first variant's step is repeated to show whether the GPU computes the same bits
twice at all (for this model it needs XLA_FLAGS=--xla_gpu_deterministic_ops=true). The same
process times a 1 GiB device -> pinned_host copy and back: the transfer floor per byte.

  PYTHONPATH=. python3 benchmarks/offload_bench.py --out /tmp/offload          # one GPU
  PYTHONPATH=. python3 benchmarks/offload_bench.py --tiny --out /tmp/offload   # CPU smoke run
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import gpt
import harness
import jaxgraph as jg
from jaxgraph import capture as capture_lib
from jaxgraph import offload as offload_lib

VARIANTS = ("none", "all", "all-but-2")


def offload_flags(variant: str, layers: int) -> list[bool]:
  if variant == "none":
    return [False] * layers
  if variant == "all":
    return [True] * layers
  keep = int(variant.rsplit("-", 1)[1])
  return [True] * (layers - keep) + [False] * keep


@dataclasses.dataclass
class Setup:
  """Everything one step needs: graphed layers, data, compiled key split and loss gradient."""

  layers: tuple[jg.GraphedCallable, ...]
  params: list[Any]
  x0: jax.Array
  split: Any
  head: Any

  def step(self, index: int) -> list[Any]:
    keys = self.split(jnp.uint32(index))
    y, pullback = jg.sequential_vjp(self.layers, self.params, self.x0, keys=list(keys))
    grads, _ = pullback(self.head(y))
    return grads


def prepare(size: gpt.Size) -> tuple[list[Any], jax.Array, Any, Any]:
  params, x0 = gpt.init_params(size), gpt.init_input(size)
  base = jax.random.key(2)
  split = jax.jit(lambda s: tuple(jax.random.split(jax.random.fold_in(base, s), size.layers)))
  split = split.lower(jnp.uint32(0)).compile()
  head = jax.jit(jax.grad(gpt.loss)).lower(x0).compile()
  jax.block_until_ready((params, x0))
  return params, x0, split, head


def build(size: gpt.Size, variant: str, attention: str | None, prepared: tuple[Any, ...],
          warmup: int) -> Setup:
  params, x0, split, head = prepared
  block = gpt.make_block(size.heads, attention)
  layers = jg.make_graphed([block] * size.layers, sample_args=[(p, x0) for p in params],
                           rng=True, num_warmup_iters=warmup,
                           offload_residuals=offload_flags(variant, size.layers))
  return Setup(layers, params, x0, split, head)


def residual_bytes(layer: jg.GraphedCallable) -> dict[str, int]:
  """Bytes of the residuals one forward keeps, by memory kind (from the compiled forward)."""
  (entry,) = layer._entries.values()
  out: dict[str, int] = {}
  forward, _ = capture_lib.forward_executable(entry, "explicit", residuals=True)
  for o in forward.out_info[entry.layout.n_out:]:
    kind = o.sharding.memory_kind
    out[kind] = out.get(kind, 0) + int(np.prod(o.shape)) * np.dtype(o.dtype).itemsize
  return out


def grads_digest(grads: list[Any]) -> str:
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(grads):
    digest.update(np.asarray(leaf).tobytes())
  return digest.hexdigest()


def measure_memory(size: gpt.Size, variant: str, attention: str | None) -> dict[str, Any]:
  """One variant, alone in this process: bytes in use and peaks around capture and steps."""
  prepared = prepare(size)
  before = harness.device_memory()
  setup = build(size, variant, attention, prepared, warmup=0)
  after_capture = harness.device_memory()
  grads = setup.step(0)
  jax.block_until_ready(grads)
  digest = grads_digest(grads)
  del grads
  setup.step(1)
  after_steps = harness.device_memory()
  result: dict[str, Any] = dict(kind="memory", variant=variant,
                                residual_bytes=[residual_bytes(l) for l in setup.layers],
                                grads_sha256=digest)
  if before is not None:
    result.update(
        bytes_in_use_before=before["bytes_in_use"],
        peak_after_capture=after_capture["peak_bytes_in_use"],
        peak_after_steps=after_steps["peak_bytes_in_use"],
        activation_peak=after_steps["peak_bytes_in_use"] - before["bytes_in_use"])
  return result


def measure_time(size: gpt.Size, variants: list[str], attention: str | None, iters: int,
                 reps: int) -> dict[str, Any]:
  """All variants in this process, alternated: median seconds per step; bitwise gradients."""
  prepared = prepare(size)
  setups = {v: build(size, v, attention, prepared, warmup=1) for v in variants}
  first = {v: setups[v].step(0) for v in variants}
  reference = jax.tree.leaves(first[variants[0]])
  equal = {v: all(np.array_equal(np.asarray(a), np.asarray(b))
                  for a, b in zip(reference, jax.tree.leaves(first[v]))) for v in variants}
  repeat = jax.tree.leaves(setups[variants[0]].step(0))
  repeat_equal = all(np.array_equal(np.asarray(a), np.asarray(b))
                     for a, b in zip(reference, repeat))
  del first, reference, repeat
  times: dict[str, list[float]] = {v: [] for v in variants}
  for rep in range(reps):
    order = variants if rep % 2 == 0 else variants[::-1]
    for v in order:
      jax.block_until_ready(setups[v].step(0))
      start = time.perf_counter()
      for i in range(iters):
        grads = setups[v].step(i)
      jax.block_until_ready(grads)
      times[v].append((time.perf_counter() - start) / iters)
      del grads
  return dict(kind="time", iters=iters, reps=reps, grads_bitwise_equal_to_first=equal,
              first_variant_repeat_bitwise_equal=repeat_equal,
              transfer_s_per_gib=transfer_seconds(2 ** 30),
              step_s={v: statistics.median(t) for v, t in times.items()},
              step_s_all=times)


def transfer_seconds(nbytes: int, repeats: int = 5) -> dict[str, float]:
  """Median seconds of one device -> pinned_host and one pinned_host -> device copy of nbytes,
  each as its own executable (the raw transfer floor the offloaded step pays per byte)."""
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  to_host = jax.jit(offload_lib.to_host).lower(x).compile()
  on_host = to_host(x)
  to_device = jax.jit(offload_lib.to_device).lower(on_host).compile()
  out = {}
  for name, fn, arg in (("to_host", to_host, x), ("to_device", to_device, on_host)):
    jax.block_until_ready(fn(arg))
    seconds = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(arg))
      seconds.append(time.perf_counter() - start)
    out[name] = statistics.median(seconds)
  return out


def _summary(result: dict[str, Any]) -> str:
  """One result for the log: the end of an error, the start of anything else."""
  if "error" in result:
    return f"{result['args']} failed ({result['returncode']}): ...{result['error'][-1500:]}"
  return json.dumps(result)[:2000]


def _mib(value: float | None) -> str:
  return "-" if value is None else f"{value / 2 ** 20:,.0f}"


def report(results: dict[str, Any]) -> str:
  memory = {r["variant"]: r for r in results["memory"] if "variant" in r}
  timing = results.get("time", {})
  step_s = timing.get("step_s", {})
  base_act = memory.get("none", {}).get("activation_peak")
  base_time = step_s.get("none")
  lines = ["variant     peak MiB  act. MiB  act. vs none  step ms  time vs none  grads==none",
           "----------  --------  --------  ------------  -------  ------------  -----------"]
  for v in results["variants"]:
    m, t = memory.get(v, {}), step_s.get(v)
    act = m.get("activation_peak")
    act_rel = f"{act / base_act - 1:+.1%}" if act is not None and base_act else "-"
    t_rel = f"{t / base_time - 1:+.1%}" if t is not None and base_time else "-"
    same = timing.get("grads_bitwise_equal_to_first", {}).get(v, "-")
    lines.append(f"{v:<10}  {_mib(m.get('peak_after_steps')):>8}  {_mib(act):>8}  "
                 f"{act_rel:>12}  {t * 1e3 if t else float('nan'):>7.1f}  {t_rel:>12}  "
                 f"{str(same):>11}")
  return "\n".join(lines)


def main() -> None:
  args = harness.parse_args(__doc__.splitlines()[0], VARIANTS, "offload_bench.json")
  size = gpt.SIZES[args.size]
  attention = None if args.attention == "default" else args.attention
  results = harness.drive(
      __file__, args, size, lambda v: measure_memory(size, v, attention),
      lambda: measure_time(size, args.variants, attention, args.iters, args.reps),
      show=_summary)
  if results is None:
    return
  digests = {r.get("grads_sha256") for r in results["memory"]}
  results["memory_grads_identical"] = len(digests) == 1 and None not in digests
  results["table"] = report(results)
  harness.write_json(args.out, "offload_bench.json", results)
  print(f"{results['device']}, jax {results['jax']}, size {size}")
  print(results["table"])
  print("gradients identical across memory processes:", results["memory_grads_identical"])
  print("first variant's gradients identical when repeated:",
        results["time"].get("first_variant_repeat_bitwise_equal"))
  print("seconds per GiB:", results["time"].get("transfer_s_per_gib"))


if __name__ == "__main__":
  main()
