"""Where a replayed step spends its time: host profile, and device busy time from a trace.

For each variant of `bench.py` named: a `jax.profiler` trace of `--steps` steps, reduced to
the step's wall time, the time the GPU streams are busy (union of their kernel intervals)
and the number of device ops; and for `jaxgraph`, a cProfile of the host side (top entries).
Writes `profile.json` and `host_profile.txt` to `--out`.

  PYTHONPATH=. python3 benchmarks/profile_replay.py --size small --out /tmp/profile

The profiler turns XLA command buffers off (unless `xla_enable_command_buffers_during_profiling`
is set), so the traced steps show the executables' thunks one by one.
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import gzip
import io
import json
import os
import pstats
import shutil
import subprocess
import tempfile
import time
from typing import Any

import bench  # sets the allocator environment before jax starts
import gpt
import jax


def _busy(trace: dict[str, Any]) -> tuple[float, int, float]:
  """(busy µs on GPU rows, device ops, span µs of those ops) from a Chrome-format trace."""
  names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu = {pid for pid, name in names.items() if "gpu" in name.lower() and "host" not in name.lower()}
  spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
                 if e.get("ph") == "X" and e.get("pid") in gpu and e.get("dur"))
  return union_us(spans), len(spans), (spans[-1][1] - spans[0][0]) if spans else 0.0


def union_us(spans: list[tuple[float, float]]) -> float:
  """The length of the union of sorted `(start, stop)` intervals."""
  busy, end = 0.0, float("-inf")
  for start, stop in spans:
    if stop > end:
      busy += stop - max(start, end)
      end = stop
  return busy


def record_trace(variant: bench.Variant, steps: int) -> tuple[dict[str, Any], float]:
  """A Chrome-format `jax.profiler` trace of `steps` steps of `variant`, and their wall
  seconds (the device drained before and after)."""
  with tempfile.TemporaryDirectory() as folder:
    jax.block_until_ready(variant.state)
    jax.profiler.start_trace(folder, create_perfetto_trace=True)
    start = time.perf_counter()
    for _ in range(steps):
      variant.state = variant.step(variant.state)
    jax.block_until_ready(variant.state)
    wall = time.perf_counter() - start
    jax.profiler.stop_trace()
    [path] = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
    with gzip.open(path) as f:
      return json.load(f), wall


def trace_variant(variant: bench.Variant, steps: int) -> dict[str, Any]:
  trace, wall = record_trace(variant, steps)
  busy, ops, span = _busy(trace)
  return dict(variant=variant.name, traced_step_ms=1e3 * wall / steps,
              gpu_busy_ms_per_step=busy / 1e3 / steps, device_ops_per_step=ops / steps,
              gpu_span_ms_per_step=span / 1e3 / steps,
              host_events_us_per_step=_host_events(trace, steps))


def _host_events(trace: dict[str, Any], steps: int, top: int = 25) -> dict[str, float]:
  """Total µs per step of each host event name (the runtime's TraceMe spans: nested spans
  are counted in their parents too), largest first."""
  names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  host = {pid for pid, name in names.items() if "gpu" not in name.lower() or "host" in name.lower()}
  totals: dict[str, float] = {}
  for e in trace["traceEvents"]:
    if e.get("ph") == "X" and e.get("pid") in host and e.get("dur"):
      totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"] / steps
  return dict(sorted(totals.items(), key=lambda kv: -kv[1])[:top])


def sample_native(variant: bench.Variant, seconds: float, path: str) -> None:
  """Replays `variant` for `seconds` under py-spy's sampling profiler with native frames
  (the runtime's C++ under `Compiled.__call__`), written as collapsed stacks to `path`, and
  the steps and executable calls that ran to `path` with `.json` (`native_breakdown.py`)."""
  spy = shutil.which("py-spy")
  if spy is None:
    print("py-spy not found: no native sampling profile")
    return
  sampler = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--native", "--rate",
                              "1000", "--format", "raw", "--duration", str(int(seconds)),
                              "--output", path], stdout=subprocess.DEVNULL)
  time.sleep(1.0)  # py-spy attaches
  start = time.perf_counter()
  steps = 0
  while time.perf_counter() < start + seconds and sampler.poll() is None:
    variant.state = variant.step(variant.state)
    steps += 1
  jax.block_until_ready(variant.state)
  elapsed = time.perf_counter() - start
  sampler.wait()
  with open(os.path.splitext(path)[0] + ".json", "w") as f:
    json.dump(dict(variant=variant.name, seconds=elapsed, steps=steps,
                   calls=steps * variant.executables), f)


def host_profile(variant: bench.Variant, steps: int) -> str:
  profile = cProfile.Profile()
  profile.enable()
  for _ in range(steps):
    variant.state = variant.step(variant.state)
  profile.disable()
  jax.block_until_ready(variant.state)
  text = io.StringIO()
  pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
  return text.getvalue()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size", default="small", choices=list(gpt.SIZES))
  parser.add_argument("--variants", nargs="+", default=["jaxgraph", "jaxgraph-fuse",
                                                        "jit-unrolled"])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--attention", default=None)
  parser.add_argument("--out", default=".")
  parser.add_argument("--sample-seconds", type=float, default=0.0,
                      help="then replay each jaxgraph variant this long under py-spy --native")
  args = parser.parse_args()
  attention = gpt.default_attention(args.attention)
  size = gpt.SIZES[args.size]
  variants = [bench.build(name, size, attention) for name in args.variants]
  for v in variants:
    bench._run_steps(v, 3)
  results = [trace_variant(v, args.steps) for v in variants]
  os.makedirs(args.out, exist_ok=True)
  host = [v for v in variants if v.name == "jaxgraph"]
  if host:
    with open(os.path.join(args.out, "host_profile.txt"), "w") as f:
      f.write(host_profile(host[0], 20 * args.steps))
  for v in variants:
    if args.sample_seconds and v.name.startswith("jaxgraph"):
      sample_native(v, args.sample_seconds, os.path.join(args.out, f"native_{v.name}.txt"))
  with open(os.path.join(args.out, "profile.json"), "w") as f:
    json.dump(dict(size=args.size, results=results), f, indent=1)
  for r in results:
    print(json.dumps(r))


if __name__ == "__main__":
  main()
