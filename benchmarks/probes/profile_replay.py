"""Where a replayed step spends its time: host profile, and device busy time from a trace.

For each variant of `bench.py` named: a `jax.profiler` trace of `--steps` steps, reduced to
the step's wall time, the time the GPU streams are busy (union of their kernel intervals)
and the number of device ops; and for `jaxgraph`, a cProfile of the host side (top entries).
Writes `profile.json` and `host_profile.txt` to `--out`; with `--sample-seconds N`, also
replays each jaxgraph variant N seconds under py-spy's native sampler, its collapsed stacks in
`native_<variant>.txt` and the steps and calls that ran in `native_<variant>.json`
(`native_breakdown.py` reads them).

  python3 -m benchmarks.probes.profile_replay --size small --out /tmp/profile
  python3 -m benchmarks.probes.profile_replay --size tiny --steps 1 \
      --variants jaxgraph --out /tmp/profile     # CPU smoke run

The profiler turns XLA command buffers off (unless `xla_enable_command_buffers_during_profiling`
is set), so the traced steps show the executables' thunks one by one.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
from typing import Any

from benchmarks import bench  # sets the allocator environment before jax starts
from benchmarks import gpt, harness, profiling
import jax


def _busy(events: list[profiling.Event]) -> tuple[float, int, float]:
  """(busy µs on GPU rows, device ops, span µs of those ops) from a Chrome-format trace."""
  gpu = profiling.gpu_processes(events)
  spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                 if e.get("ph") == "X" and e.get("pid") in gpu and e.get("dur"))
  return profiling.union_us(spans), len(spans), (spans[-1][1] - spans[0][0]) if spans else 0.0


def trace_variant(variant: bench.Variant, steps: int) -> dict[str, Any]:
  trace = profiling.record_trace(lambda: bench.run_steps(variant, steps))
  busy, ops, span = _busy(trace.events)
  return dict(variant=variant.name, traced_step_ms=1e3 * trace.seconds / steps,
              gpu_busy_ms_per_step=busy / 1e3 / steps, device_ops_per_step=ops / steps,
              gpu_span_ms_per_step=span / 1e3 / steps,
              host_events_us_per_step=_host_events(trace.events, steps))


def _host_events(events: list[profiling.Event], steps: int, top: int = 25) -> dict[str, float]:
  """Total µs per step of each host event name (the runtime's TraceMe spans: nested spans
  are counted in their parents too), largest first."""
  host = set(profiling.process_names(events)) - profiling.gpu_processes(events)
  totals: dict[str, float] = {}
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in host and e.get("dur"):
      totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"] / steps
  return dict(sorted(totals.items(), key=lambda kv: -kv[1])[:top])


def sample_native(variant: bench.Variant, seconds: float, path: str) -> None:
  """Replays `variant` for `seconds` under py-spy (`profiling.sample_native`), the steps and
  executable calls that ran written to `path` with `.json`."""
  ran = profiling.sample_native(variant.advance, seconds, path)
  if ran is not None:
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
      json.dump(dict(variant=variant.name, seconds=ran[0], steps=ran[1],
                     calls=ran[1] * variant.executables), f)


def host_profile(variant: bench.Variant, steps: int) -> str:
  profile = cProfile.Profile()
  profile.enable()
  for _ in range(steps):
    variant.advance()
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
  harness.add_attention_flag(parser)
  parser.add_argument("--out", default=".")
  parser.add_argument("--sample-seconds", type=float, default=0.0,
                      help="then replay each jaxgraph variant this long under py-spy --native")
  args = parser.parse_args()
  attention = harness.attention(args.attention)
  size = gpt.SIZES[args.size]
  variants = [bench.build(name, size, attention) for name in args.variants]
  for v in variants:
    bench.run_steps(v, 3)
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
