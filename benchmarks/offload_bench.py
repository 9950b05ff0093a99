"""Residual offload: step time, peak device memory and copy/compute overlap of a GPT stack.

The 12-layer GPT block stack of `gpt.py` (bf16, dropout with explicit keys), with
`remat_policy=jaxgraph.residuals.recompute_elementwise` (`--no-remat`: every residual). A step
is the forward, the loss gradient and the backward (no update). Variants:

  none            no offload
  exe-all         offload_mode="executable", every layer (copies inside the executables)
  async-all       offload_mode="async", every layer (host-issued copies, one-layer prefetch)
  async-but-K     async, all but the last K layers
  async-first-N   async, the first N layers
  async-plan      async, the layers `jaxgraph.offload.plan` picks (`--max-slowdown`) from
                  the link speed and per-layer times measured in a first child process
  async-minM      async, every layer, only kept buffers of at least M MiB
  async-names     async, every layer, only residuals named "matmul_input" (the block names
                  its matmul inputs, so the policy keeps them)
  xla-plain, xla-offload, xla-remat
                  the XLA anchor: the same step (same dropout keys) under one whole-step
                  jax.jit, blocks under jax.checkpoint saving the named matmul inputs on
                  device (remat) or offloading them to pinned_host (XLA host offload,
                  scheduled by XLA), or no checkpoint (plain); as ../shared/bench/
                  xla_offload_anchor.py, without its SGD update

Time first, alone on the device: one process builds the jaxgraph variants and alternates
them, `--reps` rounds of `--iters` steps, median and range per step; then the anchors time
themselves, one process each, one after the other. Memory last: each variant alone in a
fresh process (`peak_bytes_in_use` only grows; `--parallel` of them at once, each with its
own allocator); the activation peak is the peak minus the bytes in use before capture. The time process also records a
`jax.profiler` trace of two steps of `--trace-variant` and reports how much of each copy
direction ran while a kernel ran on another stream. Gradients of the first step are compared
bitwise across the jaxgraph variants (needs XLA_FLAGS=--xla_gpu_deterministic_ops=true for
this model). A variant that fails is reported and skipped; `--deadline` seconds after the
start, the parent skips the steps left.

  python3 -m benchmarks.offload_bench --out /tmp/offload          # one GPU
  python3 -m benchmarks.offload_bench --tiny --out /tmp/offload   # CPU smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import statistics
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # several memory children

import jax
import pathlib
import jax.numpy as jnp

import jaxgraph as jg
from benchmarks import gpt, harness, profiling
from examples.records import arrays_sha256, write_json
from jaxgraph import offload as offload_lib

VARIANTS = ("none", "exe-all", "async-all", "async-but-2", "async-plan", "async-names",
            "xla-plain", "xla-offload", "xla-remat")
NAME = "matmul_input"


# ------------------------------------------------------------------------------- variants


@dataclasses.dataclass(frozen=True)
class Variant:
  """How one jaxgraph variant builds its layers."""

  flags: tuple[bool, ...]
  mode: str = "async"
  min_bytes: int = 0
  names: tuple[str, ...] | None = None


def parse_variant(name: str, layers: int) -> Variant:
  """The build of a jaxgraph variant name (see the module docstring)."""
  if name == "none":
    return Variant((False,) * layers)
  if name == "exe-all":
    return Variant((True,) * layers, mode="executable")
  if name == "async-all":
    return Variant((True,) * layers)
  if name == "async-names":
    return Variant((True,) * layers, names=(NAME,))
  match = re.fullmatch(r"async-(but|first|min)-?(\d+)", name)
  if match is None:
    raise ValueError(f"unknown variant {name!r}; see the docstring of offload_bench.py.")
  kind, n = match.group(1), int(match.group(2))
  if kind == "min":
    return Variant((True,) * layers, min_bytes=n << 20)
  first = layers - n if kind == "but" else n
  return Variant((True,) * first + (False,) * (layers - first))


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
  split = jax.jit(lambda s: tuple(jax.random.split(jax.random.fold_in(jax.random.key(2), s),
                                                   size.layers)))
  split = split.lower(jnp.uint32(0)).compile()
  head = jax.jit(jax.grad(gpt.loss)).lower(x0).compile()
  jax.block_until_ready((params, x0))
  return params, x0, split, head


def build(args: argparse.Namespace, size: gpt.Size, name: str, prepared: tuple[Any, ...],
          warmup: int) -> Setup:
  params, x0, split, head = prepared
  variant = parse_variant(name, size.layers)
  block = gpt.make_block(size.heads, harness.attention(args.attention),
                         name_matmul_inputs=variant.names is not None)
  layers = jg.make_graphed(
      [block] * size.layers, sample_args=[(p, x0) for p in params], rng=True,
      num_warmup_iters=warmup, offload_residuals=list(variant.flags),
      offload_mode=variant.mode if any(variant.flags) else "async",
      offload_min_bytes=variant.min_bytes, offload_names=variant.names,
      remat_policy=None if args.no_remat else jg.residuals.recompute_elementwise)
  return Setup(layers, params, x0, split, head)


# ---------------------------------------------------------------------------- child: plan


def measure_plan(args: argparse.Namespace, size: gpt.Size) -> dict[str, Any]:
  """Link speed, per-layer forward and backward time (no offload), the bytes each layer
  would offload, and the plan for `--max-slowdown`."""
  prepared = prepare(size)
  setup = build(args, size, "none", prepared, warmup=1)
  offloadable = build(args, size, "async-all", prepared, warmup=0)
  residual_bytes = [layer.stats.offload_bytes for layer in offloadable.layers]
  del offloadable
  keys = list(setup.split(jnp.uint32(0)))

  def forwards():
    y, pullback = jg.sequential_vjp(setup.layers, setup.params, setup.x0, keys=keys)
    jax.block_until_ready(y)
    return y, pullback

  def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result

  forward_s, backward_s = [], []
  for _ in range(args.reps):
    jax.block_until_ready(setup.step(0))
    seconds, (y, pullback) = timed(forwards)
    forward_s.append(seconds)
    ct = jax.block_until_ready(setup.head(y))
    seconds, grads = timed(lambda: jax.block_until_ready(pullback(ct)))
    backward_s.append(seconds)
    del grads, pullback
  link = offload_lib.measure_link(args.link_mib << 20)
  forward, backward = statistics.median(forward_s), statistics.median(backward_s)
  per_fwd, per_bwd = [forward / size.layers] * size.layers, [backward / size.layers] * size.layers
  plan = offload_lib.plan(residual_bytes, per_fwd, per_bwd, link,
                          max_slowdown=args.max_slowdown)
  return dict(kind="plan", link_bytes_per_s=link._asdict(), forward_s=forward,
              backward_s=backward, residual_bytes=residual_bytes, flags=list(plan.flags),
              first=sum(plan.flags), predicted_s=plan.predicted_seconds,
              report=str(plan))


# -------------------------------------------------------------------------- child: memory


def measure_memory(args: argparse.Namespace, size: gpt.Size, name: str) -> dict[str, Any]:
  """One variant alone in this process: bytes in use and peaks around capture and steps."""
  if name.startswith("xla-"):
    return anchor(args, size, name, memory_only=True)
  prepared = prepare(size)
  before = harness.device_memory()
  setup = build(args, size, name, prepared, warmup=0)
  after_capture = harness.device_memory()
  grads = setup.step(0)
  digest = arrays_sha256(grads)
  del grads
  jax.block_until_ready(setup.step(1))
  after_steps = harness.device_memory()
  result: dict[str, Any] = dict(
      kind="memory", variant=name, grads_sha256=digest,
      residual_bytes=setup.layers[0].stats.residual_bytes,
      offload_bytes=[layer.stats.offload_bytes for layer in setup.layers])
  result.update(harness.memory_record(before, after_steps, after_capture=after_capture))
  return result


# ---------------------------------------------------------------------------- child: time


def measure_time(args: argparse.Namespace, size: gpt.Size, names: list[str]) -> dict[str, Any]:
  """The jaxgraph variants in this process, alternated; bitwise gradients; a trace."""
  prepared = prepare(size)
  setups, errors = {}, {}
  for name in names:
    try:
      setups[name] = build(args, size, name, prepared, warmup=1)
    except Exception:  # reported, the others still run
      errors[name] = traceback.format_exc()[-2000:]
  digests = {}
  for name in list(setups):
    try:
      digests[name] = arrays_sha256(setups[name].step(0))
    except Exception:
      errors[name] = traceback.format_exc()[-2000:]
      del setups[name]
  repeat = arrays_sha256(setups[names[0]].step(0)) if names[0] in setups else None
  times = harness.interleaved(args.reps, {
      name: lambda s=setup: harness.seconds_per_step(s.step, args.iters)
      for name, setup in setups.items()})
  result = dict(kind="time", iters=args.iters, reps=args.reps, errors=errors,
                grads_sha256=digests, first_variant_repeat_equal=repeat == digests.get(names[0]),
                step_s={n: statistics.median(t) for n, t in times.items()},
                step_s_all=times)
  traced = args.trace_variant if args.trace_variant in setups else None
  if traced:
    try:
      result["trace"] = dict(variant=traced, **trace_overlap(setups[traced], args.out))
    except Exception:
      result["trace"] = dict(variant=traced, error=traceback.format_exc()[-2000:])
  return result


def trace_overlap(setup: Setup, out: str | None) -> dict[str, Any]:
  """Two steps under `jax.profiler` (the trace kept in `out/trace` where `out` is given); per
  copy direction on the device, the time it ran and the part of it a kernel on another stream
  ran too."""
  jax.block_until_ready(setup.step(0))
  trace = profiling.record_trace(lambda: [jax.block_until_ready(setup.step(i)) for i in range(2)],
                                 os.path.join(out, "trace") if out else None)
  return dict(path=trace.path, **overlap_summary(trace.events))


_COPY = re.compile(r"memcpy|dtoh|htod|d2h|h2d", re.IGNORECASE)


def _direction(name: str) -> str:
  low = name.lower()
  if "dtoh" in low or "d2h" in low:
    return "to_host"
  if "htod" in low or "h2d" in low:
    return "to_device"
  return "other_copy"


def overlap_summary(events: list[dict[str, Any]]) -> dict[str, Any]:
  """Copies and kernels of the GPU streams in a Chrome/Perfetto trace, and their overlap."""
  thread = profiling.thread_names(events)
  device = {pid for pid, name in profiling.process_names(events).items() if "/device:" in name}
  lines: dict[str, int] = {}
  kernels, copies = [], []
  for e in events:
    if e.get("ph") != "X" or e.get("pid") not in device:
      continue
    line = thread.get((e["pid"], e.get("tid")), "")
    lines[line] = lines.get(line, 0) + 1
    if not line.lower().startswith("stream"):
      continue  # module / op summary lines repeat what the streams ran
    interval = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), (e["pid"], e.get("tid")))
    if _COPY.search(e.get("name", "")):
      copies.append((_direction(e["name"]), *interval))
    else:
      kernels.append(interval)
  summary: dict[str, Any] = dict(device_lines=lines, kernels=len(kernels))
  for direction in ("to_host", "to_device", "other_copy"):
    chosen = [c for c in copies if c[0] == direction]
    total = sum(end - start for _, start, end, _ in chosen)
    hidden = sum(_covered(start, end, [(s, e) for s, e, line in kernels if line != own])
                 for _, start, end, own in chosen)
    summary[direction] = dict(count=len(chosen), ms=total / 1e3,
                              overlapped_ms=hidden / 1e3,
                              overlap_fraction=hidden / total if total else None,
                              streams=sorted({thread.get(c[3], str(c[3])) for c in chosen}))
  return summary


def _covered(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
  """How much of [start, end) the union of `intervals` covers."""
  return profiling.union_us(
      sorted((max(s, start), min(e, end)) for s, e in intervals if s < end and e > start))


# -------------------------------------------------------------------------- child: anchor


def anchor(args: argparse.Namespace, size: gpt.Size, name: str, *,
           memory_only: bool = False) -> dict[str, Any]:
  """The same step under one whole-step jax.jit; `xla-offload` lets XLA offload the named
  matmul inputs to pinned_host (`save_and_offload_only_these_names`)."""
  block = gpt.make_block(size.heads, harness.attention(args.attention), name_matmul_inputs=True)
  policies = jax.checkpoint_policies
  if name == "xla-plain":
    blocks = [block] * size.layers
  elif name == "xla-remat":
    blocks = [jax.checkpoint(block, policy=policies.save_only_these_names(NAME))] * size.layers
  elif name == "xla-offload":
    policy = policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[NAME],
        offload_src="device", offload_dst="pinned_host")
    blocks = [jax.checkpoint(block, policy=policy)] * size.layers
  else:
    raise ValueError(f"unknown anchor variant {name!r}")
  params, x0, split, _ = prepare(size)
  before = harness.device_memory()

  def loss(ps, x, keys):  # x an argument: a closed-over array becomes a constant argument
    for b, p, k in zip(blocks, ps, keys):
      x = b(p, x, key=k)
    return gpt.loss(x)

  # Called through jax.jit with x0 as an argument: on one H100 (jax 0.11.2) the AOT-compiled
  # step closing over x0 failed in execute_sharded (IndexError raw_hash_map::at).
  grad = jax.jit(jax.grad(loss))
  step = lambda ps, keys: grad(ps, x0, keys)
  start = time.perf_counter()
  digest = arrays_sha256(step(params, split(jnp.uint32(0))))  # compiles
  compile_s = time.perf_counter() - start
  rounds = [harness.seconds_per_step(lambda i: step(params, split(jnp.uint32(i))), args.iters)
            for _ in range(1 if memory_only else args.reps)]
  after = harness.device_memory()
  result: dict[str, Any] = dict(kind="anchor", variant=name, compile_s=compile_s,
                                grads_sha256=digest)
  if not memory_only:
    result.update(step_s=statistics.median(rounds), step_s_all=rounds)
  result.update(harness.memory_record(before, after))
  return result


# ---------------------------------------------------------------------------------- parent


def parse_args() -> argparse.Namespace:
  parser = harness.argument_parser(__doc__.splitlines()[0], VARIANTS,
                                   "offload_bench.json and the trace", reps=3,
                                   children=("plan", "memory", "time", "anchor"))
  parser.add_argument("--no-remat", action="store_true", help="keep every residual")
  parser.add_argument("--max-slowdown", type=float, default=0.10, help="for async-plan")
  parser.add_argument("--link-mib", type=int, default=512, help="copy size timed for the plan")
  parser.add_argument("--trace-variant", default="async-all")
  parser.add_argument("--parallel", type=int, default=3, help="memory children at once")
  parser.add_argument("--deadline", type=float, default=340.0,
                      help="seconds after which the parent skips the steps left")
  return harness.parsed(parser)


def child_args(args: argparse.Namespace, child: str, variants: list[str]) -> list[str]:
  flags = ["--child", child, "--variants", *variants, "--size", args.size, "--attention",
           args.attention, "--iters", str(args.iters), "--reps", str(args.reps),
           "--max-slowdown", str(args.max_slowdown), "--link-mib", str(args.link_mib),
           "--trace-variant", args.trace_variant]
  return flags + (["--no-remat"] if args.no_remat else []) + (
      ["--out", args.out] if args.out else [])


def run_child(args: argparse.Namespace, child: str, variants: list[str],
              start: float) -> dict[str, Any]:
  left = args.deadline - (time.perf_counter() - start)
  if left < 20:
    return dict(args=[child, *variants], error="skipped: past --deadline", returncode=None)
  try:
    return harness.run_child("benchmarks.offload_bench", child_args(args, child, variants),
                             timeout=left)
  except Exception as e:  # a timeout: reported, the parent goes on
    return dict(args=[child, *variants], error=repr(e)[-2000:], returncode=None)


def _ms(seconds: float | None) -> str:
  return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def report(results: dict[str, Any]) -> str:
  memory = {r["variant"]: r for r in results["memory"] if "variant" in r}
  timing = results.get("time", {})
  step_s = dict(timing.get("step_s", {}))
  spread = {n: (min(t), max(t)) for n, t in timing.get("step_s_all", {}).items() if t}
  for r in results.get("anchors", []):
    if "step_s" in r:
      step_s[r["variant"]], spread[r["variant"]] = r["step_s"], (min(r["step_s_all"]),
                                                                 max(r["step_s_all"]))
  base_time, base_act = step_s.get("none"), memory.get("none", {}).get("activation_peak")
  lines = ["variant              act. MiB  vs none  step ms (range)         vs none  grads==none",
           "-------------------  --------  -------  ----------------------  -------  -----------"]
  digests = timing.get("grads_sha256", {})
  for v in results["variants"]:
    shown = results["resolved"].get(v, v)
    act, t = memory.get(shown, {}).get("activation_peak"), step_s.get(shown)
    act_rel = f"{act / base_act - 1:+.0%}" if act is not None and base_act else "-"
    t_rel = f"{t / base_time - 1:+.1%}" if t is not None and base_time else "-"
    lo, hi = spread.get(shown, (None, None))
    same = (digests[shown] == digests["none"]) if shown in digests and "none" in digests else "-"
    label = v if shown == v else f"{v}={shown.removeprefix('async-')}"
    timed = f"{_ms(t):>7} ({_ms(lo)}-{_ms(hi)})"
    lines.append(f"{label:<19}  {harness.mib(act, 0):>8}  {act_rel:>7}  {timed:<22}  "
                 f"{t_rel:>7}  {str(same):>11}")
  return "\n".join(lines)


def main() -> None:
  args = parse_args()
  size = gpt.SIZES[args.size]
  if args.child:
    runners = {"plan": lambda: measure_plan(args, size),
               "memory": lambda: measure_memory(args, size, args.variants[0]),
               "time": lambda: measure_time(args, size, args.variants),
               "anchor": lambda: anchor(args, size, args.variants[0])}
    print(json.dumps(runners[args.child]()))
    return
  start = time.perf_counter()
  results: dict[str, Any] = dict(
      size=dataclasses.asdict(size), attention=args.attention, variants=args.variants,
      remat=not args.no_remat, jax=jax.__version__, device=jax.devices()[0].device_kind,
      command=" ".join(sys.argv), xla_flags=os.environ.get("XLA_FLAGS", ""), resolved={},
      memory=[], anchors=[])
  if "async-plan" in args.variants:
    results["plan"] = run_child(args, "plan", ["none"], start)
    print("plan:", results["plan"].get("report", results["plan"]), flush=True)
    first = results["plan"].get("first")
    if first is not None:
      results["resolved"]["async-plan"] = f"async-first-{first}"
  variants = [results["resolved"].get(v, v) for v in args.variants
              if v != "async-plan" or "async-plan" in results["resolved"]]
  # Timings first, alone on the device; the memory children (no timing) last, in parallel.
  graphed = [v for v in dict.fromkeys(variants) if not v.startswith("xla-")]
  if graphed:
    results["time"] = run_child(args, "time", graphed, start)
    print("time:", json.dumps(results["time"])[:3000], flush=True)
  for v in variants:
    if v.startswith("xla-"):
      results["anchors"].append(run_child(args, "anchor", [v], start))
      print("anchor:", json.dumps(results["anchors"][-1])[:600], flush=True)
  with concurrent.futures.ThreadPoolExecutor(max(1, args.parallel)) as pool:
    futures = [pool.submit(run_child, args, "memory", [v], start) for v in variants]
    for future in futures:
      results["memory"].append(future.result())
      print("memory:", json.dumps(results["memory"][-1])[:600], flush=True)
  results["table"] = report(results)
  results["seconds"] = time.perf_counter() - start
  if args.out:
    write_json(pathlib.Path(args.out) / "offload_bench.json", results, indent=1)
  print(f"{results['device']}, jax {results['jax']}, size {size}, "
        f"remat={results['remat']}, {results['seconds']:.0f} s")
  print(results["table"])
  trace = results.get("time", {}).get("trace")
  if trace:
    print("copy/compute overlap in the trace of", trace.get("variant"), ":",
          json.dumps({k: trace.get(k) for k in ("to_host", "to_device", "error")}))


if __name__ == "__main__":
  main()
