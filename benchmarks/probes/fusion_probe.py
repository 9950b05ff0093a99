"""Boundary fusion beside the same layers per layer: where a fused step's time goes.

For GPT block stacks (`gpt.py`) and, with `--llama`, the Llama example's blocks, builds the
layers replayed per layer and fused (`sequential_vjp(..., fuse=True)`), and reports per variant:
  - step ms, in alternating rounds (median and spread);
  - device time per step from a `jax.profiler` trace: the sum of GPU kernel durations on the
    stream rows, the kernel count, the busy (union) time, time by kernel kind, and the
    kernels whose time differs most from the per-layer variant's (names without their
    numeric suffixes: fusion numbers differ between executables);
  - host µs to enqueue the blocks' forward calls, then their backward calls, each timed
    after a sync (below the runtime's 32 in-flight executions: past them the host waits for
    the device), per step and per call;
  - buffers in and out of one forward and one backward call, residual bytes per step, and
    op counts of their optimized HLO (ENTRY ops by kind, GEMM and attention calls);
  - capture seconds of the variant (parameters, capture, compile and its first step).
Prints a table, one JSON line per variant, and writes `fusion_probe.json` to `--out`.

  python3 -m benchmarks.probes.fusion_probe --sizes small medium --llama gpu \
      --out /tmp/fp
  python3 -m benchmarks.probes.fusion_probe --tiny   # CPU smoke run, seconds

Variants are `bench.py` names (`jaxgraph-recompute`, `jaxgraph-fuse-flat-recompute`, ...) or,
with `--llama`, `llama-` and a `llama_breakdown.py` variant (`llama-recompute-fuse`). A fused
one takes a diagnostic after `+`, which rebuilds its fused segments another way:
  +chainremat   remat_policy around the whole chain and no barriers between layers (how
                fused segments ran before f8d3dbe)
  +nobarrier    remat_policy per layer, no optimization barrier between layers (XLA free to
                fuse across layer boundaries)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import re
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Iterator, Sequence

from benchmarks import bench  # sets the allocator environment before jax starts
from benchmarks import gpt, harness, profiling
from benchmarks.probes import llama_breakdown
import jax
import jax.numpy as jnp
from examples.llama.data import step_batches

import jaxgraph as jg
from jaxgraph import _fusion as fusion

GPT_VARIANTS = ("jaxgraph-recompute", "jaxgraph-fuse-recompute",
                "jaxgraph-fuse-recompute+chainremat")
LLAMA_VARIANTS = ("llama-recompute", "llama-recompute-fuse", "llama-recompute-fuse+chainremat")


# --------------------------------------------------------------------------- diagnostics


class _NoBarriers(fusion.FusedSegment):
  """A fused segment whose chain has no optimization barrier between layers."""

  def __init__(self, layers: Sequence[jg.GraphedCallable]):
    super().__init__(layers)
    self.fn = dataclasses.replace(self.fn, barriers=False)


class _WholeChainRemat(fusion.FusedSegment):
  """A fused segment as before f8d3dbe: remat_policy around the chain, no barriers."""

  def __init__(self, layers: Sequence[jg.GraphedCallable]):
    super().__init__(layers)
    self.fn = fusion.Composed(self.fn.fns, barriers=False)

  @property
  def remat_policy(self) -> Any:
    return self.config.remat_policy


DIAGNOSTICS = {"chainremat": _WholeChainRemat, "nobarrier": _NoBarriers}


@contextlib.contextmanager
def fused_as(diagnostic: str | None) -> Iterator[None]:
  """Fused segments made meanwhile (on a first fused call) are of the diagnostic's class."""
  if diagnostic is None:
    yield
    return
  original = fusion.FusedSegment
  fusion.FusedSegment = DIAGNOSTICS[diagnostic]  # what fusion.segment() constructs
  try:
    yield
  finally:
    fusion.FusedSegment = original


# --------------------------------------------------------------------------------- cases


@dataclasses.dataclass
class Case:
  """A variant with what the probe reads besides its steps."""

  variant: bench.Variant
  model: str                                      # "small", "llama-gpu", ...
  fused: bool
  blocks: Sequence[jg.GraphedCallable]            # the layers that fuse, in order
  forward: Callable[[], tuple[Any, Any]]          # the blocks' sequential_vjp: (y, pullback)


def gpt_case(name: str, size: gpt.Size, attention: str | None) -> Case:
  base, _, diagnostic = name.partition("+")
  fused = "fuse" in bench.parse_variant(base).modifiers
  with fused_as(diagnostic or None):
    variant = bench.build(base, size, attention)  # runs the first step: fused segments exist
  variant.name = name
  x0 = gpt.init_input(size)  # the input bench.build made (same key)
  layers = variant.layers
  return Case(variant, size.name, fused, layers,
              lambda: jg.sequential_vjp(layers, variant.state, x0, fuse=fused))


def llama_case(name: str, setup: llama_breakdown.Setup, preset: str) -> Case:
  base, _, diagnostic = name.partition("+")
  kind = base.removeprefix("llama-")
  begin = time.perf_counter()
  trainer = llama_breakdown.build(setup, kind)
  batches = step_batches(setup.corpus, 0, trainer.microbatches)

  def step(state: tuple[Any, Any]) -> tuple[Any, Any]:
    return trainer.step(*state, batches, setup.positions)[:2]

  fused = llama_breakdown.VARIANTS[kind][2]
  calls = 2 * (1 if fused else setup.config.depth) + 5  # blocks, embed, head, accumulate
  variant = bench.Variant(name, step, (setup.params, trainer.tx.init(setup.params)), 0.0,
                          executables=trainer.microbatches * calls + 2, layers=trainer.layers)
  with fused_as(diagnostic or None):
    variant.state = jax.block_until_ready(variant.step(variant.state))
  variant.capture_s = time.perf_counter() - begin
  blocks = trainer.layers[1:-1]
  params = setup.params[1:-1]
  tokens, _ = setup.corpus.batch_at(0)
  x = jax.block_until_ready(trainer.layers[0](setup.params[0], tokens))
  return Case(variant, f"llama-{preset}", fused, blocks,
              lambda: jg.sequential_vjp(blocks, params, x, consts=(setup.positions,),
                                        fuse=fused))


# ----------------------------------------------------------------------------- measures


def host_us(case: Case, samples: int = 7) -> dict[str, float]:
  """Host µs to enqueue the blocks' forward calls, and then their backward calls, each
  started on an idle device."""
  forward, backward = [], []
  for _ in range(samples):
    jax.block_until_ready(case.variant.state)
    start = time.perf_counter()
    y, pullback = case.forward()
    forward.append(time.perf_counter() - start)
    ct = jax.block_until_ready(jax.tree.map(jnp.ones_like, y))
    start = time.perf_counter()
    out = pullback(ct)
    backward.append(time.perf_counter() - start)
    jax.block_until_ready(out)
  calls = len(fusion.runs(case.blocks)) if case.fused else len(case.blocks)
  fwd, bwd = 1e6 * statistics.median(forward), 1e6 * statistics.median(backward)
  return dict(calls=calls, forward_us=fwd, backward_us=bwd, forward_us_per_call=fwd / calls,
              backward_us_per_call=bwd / calls)


_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = .*? ([a-z][a-z0-9\-]*)\(")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_KIND = re.compile(r"kind=(k\w+)")


def hlo_counts(text: str) -> dict[str, int]:
  """ENTRY ops of an optimized HLO module by opcode, custom calls by target, fusions by kind,
  and all ops (fused computations included) as `all`."""
  counts: collections.Counter[str] = collections.Counter()
  in_entry = False
  for line in text.splitlines():
    if line.startswith("ENTRY"):
      in_entry = True
    elif line.startswith("}"):
      in_entry = False
    match = _OP.match(line)
    if not match:
      continue
    counts["all"] += 1
    if in_entry:
      op = match.group(1)
      counts[op] += 1
      target, kind = _TARGET.search(line), _KIND.search(line)
      if op == "custom-call" and target:
        counts[f"custom-call:{target.group(1)}"] += 1
      if op == "fusion" and kind:
        counts[f"fusion:{kind.group(1)}"] += 1
  return dict(counts)


def executables(case: Case) -> dict[str, Any]:
  """Buffers in and out of one forward and one backward call of the blocks, residual bytes
  of one step's blocks, and their HLO op counts per step (per-layer counts times depth)."""
  if case.fused:
    [(lo, hi)] = fusion.runs(case.blocks)
    owner, times = fusion.segment(case.blocks[lo:hi]), 1
  else:
    owner, times = case.blocks[0], len(case.blocks)
  entry = next(reversed(owner.executables.entries.values()))
  forward = entry.forward.get(("stream", True)) or entry.forward[("explicit", True)]
  backward = entry.backward["full"][0]
  found: dict[str, Any] = dict(
      forward_in=forward.in_tree.num_leaves, forward_out=len(jax.tree.leaves(forward.out_info)),
      backward_in=backward.in_tree.num_leaves,
      backward_out=len(jax.tree.leaves(backward.out_info)),
      residual_bytes=entry.residual_bytes * times, compile_s=entry.compile_seconds)
  for name, exe in (("forward_hlo", forward), ("backward_hlo", backward)):
    found[name] = {k: v * times for k, v in sorted(hlo_counts(exe.as_text()).items())}
  return found


def _base_name(name: str) -> str:
  """A kernel's name without numeric suffixes (`loop_add_fusion_12` -> `loop_add_fusion`)."""
  return re.sub(r"(?:[._]\d+)+$", "", name)


def device_time(events: list[profiling.Event], steps: int) -> dict[str, Any]:
  """Per step: kernel time and count on the GPU's stream rows, busy time, time by kernel
  kind and by kernel name, and device time by XLA module where the trace has that row."""
  gpu = profiling.gpu_processes(events)
  threads = {key: name for key, name in profiling.thread_names(events).items() if key[0] in gpu}
  streams = {key for key, name in threads.items() if "stream" in name.lower()}
  spans = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and e.get("dur")]
  # Without stream rows: every row but the derived ones (XLA Modules/Ops, TensorFlow ...),
  # which repeat the kernels' time.
  derived = {key for key, name in threads.items()
             if name.lower().startswith(("xla", "tensorflow", "source", "launch"))}
  kernels = [e for e in spans if ((e["pid"], e["tid"]) in streams if streams
                                  else (e["pid"], e["tid"]) not in derived)]
  modules = [e for e in spans if "module" in threads.get((e["pid"], e["tid"]), "").lower()]
  if not kernels:
    processes = sorted(set(profiling.process_names(events).values()))
    return dict(note=f"no GPU events among processes {processes}")
  by_name: collections.Counter[str] = collections.Counter()
  counts: collections.Counter[str] = collections.Counter()
  by_kind: collections.Counter[str] = collections.Counter()
  for e in kernels:
    by_name[_base_name(e["name"])] += e["dur"] / steps
    counts[_base_name(e["name"])] += 1
    by_kind[profiling.kernel_kind(e["name"])] += e["dur"] / steps
  by_module: collections.Counter[str] = collections.Counter()
  for e in modules:
    by_module[_base_name(e["name"])] += e["dur"] / steps
  busy = profiling.union_us(sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels))
  return dict(kernel_us=sum(by_name.values()), kernels=len(kernels) / steps,
              busy_us=busy / steps, rows=sorted({threads.get((e["pid"], e["tid"]), "?")
                                                 for e in kernels}),
              by_kind={k: round(v, 1) for k, v in by_kind.most_common()},
              by_name={k: [round(v, 1), counts[k] / steps] for k, v in by_name.most_common()},
              by_module={k: round(v, 1) for k, v in by_module.most_common(12)})


def kernel_diff(fused: dict[str, Any], per_layer: dict[str, Any], top: int = 10
                ) -> list[dict[str, Any]]:
  """The `top` kernel names whose time per step differs most between two variants."""
  a, b = fused.get("by_name", {}), per_layer.get("by_name", {})
  rows = [dict(kernel=k, fused_us=a.get(k, [0, 0])[0], per_layer_us=b.get(k, [0, 0])[0],
               fused_n=a.get(k, [0, 0])[1], per_layer_n=b.get(k, [0, 0])[1])
          for k in set(a) | set(b)]
  for r in rows:
    r["diff_us"] = round(r["fused_us"] - r["per_layer_us"], 1)
  return sorted(rows, key=lambda r: -abs(r["diff_us"]))[:top]


# ---------------------------------------------------------------------------------- run


def probe(cases: list[Case], iters: int, reps: int, trace_steps: int) -> list[dict[str, Any]]:
  """Times `cases` (one model) in alternating rounds, then traces each; one record each."""
  times = bench.time_interleaved([c.variant for c in cases], iters, reps)
  records = []
  for case in cases:
    v = case.variant
    record: dict[str, Any] = dict(model=case.model, variant=v.name, fused=case.fused,
                                  capture_s=v.capture_s, step_ms=harness.summary(times[v.name]),
                                  step_ms_rounds=times[v.name])
    for key, measure in (("host", lambda: host_us(case)),
                         ("executables", lambda: executables(case)),
                         ("device", lambda: device_time(profiling.record_trace(
                             lambda: bench.run_steps(v, trace_steps)).events, trace_steps))):
      try:
        record[key] = measure()
      except Exception as e:  # one measurement failing leaves the others
        record[key] = dict(error=f"{type(e).__name__}: {e}")
        traceback.print_exc()
    records.append(record)
  reference = next((r for r in records if not r["fused"]), None)
  for r in records:
    if reference is not None and r is not reference:
      r["vs_per_layer"] = dict(
          step=r["step_ms"]["median"] / reference["step_ms"]["median"],
          kernel_us=(r["device"].get("kernel_us", 0) - reference["device"].get("kernel_us", 0)),
          top_kernel_diff=kernel_diff(r["device"], reference["device"]))
    print(json.dumps(dict(record=r), default=float), flush=True)
  return records


def build_all(names: Sequence[str], make: Callable[[str], Case]) -> list[Case]:
  cases = []
  for name in names:
    try:
      cases.append(make(name))
      print(f"[{name}] built in {cases[-1].variant.capture_s:.1f} s", flush=True)
    except Exception:  # a variant failing leaves the others
      print(f"[{name}] FAILED to build:", flush=True)
      traceback.print_exc()
  return cases


def print_table(records: list[dict[str, Any]]) -> None:
  header = (f"{'model':10} {'variant':38} {'step ms':>8} {'spread':>6} {'x per layer':>11} "
            f"{'kernel ms':>9} {'kernels':>7} {'host fwd+bwd µs':>15} {'µs/call':>7} "
            f"{'bufs in/out fwd':>15} {'capture s':>9}")
  print(header)
  print("-" * len(header))
  for r in records:
    device, host, exe = r.get("device", {}), r.get("host", {}), r.get("executables", {})
    ratio = r.get("vs_per_layer", {}).get("step")
    kernel = device.get("kernel_us")
    per_call = ((host["forward_us_per_call"] + host["backward_us_per_call"]) / 2
                if "calls" in host else None)
    print(f"{r['model']:10} {r['variant']:38} {r['step_ms']['median']:8.3f} "
          f"{r['step_ms']['spread_pct']:5.1f}% {ratio if ratio else 1.0:11.3f} "
          f"{kernel / 1e3 if kernel is not None else float('nan'):9.3f} "
          f"{device.get('kernels', float('nan')):7.0f} "
          f"{host.get('forward_us', 0) + host.get('backward_us', 0):15.0f} "
          f"{per_call or float('nan'):7.0f} "
          f"{str(exe.get('forward_in', '-')) + '/' + str(exe.get('forward_out', '-')):>15} "
          f"{r['capture_s']:9.1f}")
  for r in records:
    for row in r.get("vs_per_layer", {}).get("top_kernel_diff", []):
      print(f"  {r['model']} {r['variant']}: {row['diff_us']:+9.1f} µs/step {row['kernel']} "
            f"(fused {row['fused_us']:.1f} µs x{row['fused_n']:g}, per layer "
            f"{row['per_layer_us']:.1f} µs x{row['per_layer_n']:g})")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", nargs="*", default=["small", "medium"], choices=list(gpt.SIZES))
  parser.add_argument("--variants", nargs="+", default=list(GPT_VARIANTS))
  parser.add_argument("--llama", default=None, help="the Llama example's preset (e.g. gpu)")
  parser.add_argument("--llama-variants", nargs="+", default=list(LLAMA_VARIANTS))
  harness.add_timing_flags(parser, iters=10, reps=3)
  parser.add_argument("--trace-steps", type=int, default=3)
  parser.add_argument("--tiny", action="store_true", help="tiny sizes on any backend (CI)")
  parser.add_argument("--out", default=None, help="folder for fusion_probe.json")
  args = parser.parse_args()
  if args.tiny:
    args.sizes, args.llama, args.iters, args.reps, args.trace_steps = ["tiny"], "tiny", 1, 3, 1
  attention = harness.attention(args.attention)
  meta = dict(harness.machine(), attention=attention, command=" ".join(sys.argv),
              xla_flags=os.environ.get("XLA_FLAGS", ""))
  print(json.dumps(dict(meta=meta)), flush=True)
  bench.warm_libraries(attention)
  records: list[dict[str, Any]] = []
  begin = time.perf_counter()
  for size_name in args.sizes:
    size = gpt.SIZES[size_name]
    cases = build_all(args.variants, lambda name: gpt_case(name, size, attention))
    records += probe(cases, args.iters, args.reps, args.trace_steps)
    del cases
    print(f"[{size_name}] done at {time.perf_counter() - begin:.0f} s", flush=True)
  if args.llama:
    try:
      setup = llama_breakdown.setup(args.llama, flat=True)
      cases = build_all(args.llama_variants, lambda name: llama_case(name, setup, args.llama))
      records += probe(cases, max(1, args.iters // 2), args.reps, max(1, args.trace_steps - 1))
    except Exception:
      print("[llama] FAILED:", flush=True)
      traceback.print_exc()
    print(f"[llama] done at {time.perf_counter() - begin:.0f} s", flush=True)
  print_table(records)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fusion_probe.json"), "w") as f:
      json.dump(dict(meta=meta, records=records), f, indent=1, default=float)


if __name__ == "__main__":
  main()
