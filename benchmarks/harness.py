"""What the benchmark scripts share: device memory readings and one-process-per-measurement,
and the command line and driver of the memory-and-time benchmarks (fsdp, offload)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
from typing import Any, Callable, Sequence

import jax

import gpt


def device_memory() -> dict[str, int] | None:
  """`bytes_in_use` and `peak_bytes_in_use`, the largest over the local devices; None on
  backends without memory stats (CPU)."""
  stats = [d.memory_stats() for d in jax.local_devices()]
  if not all(stats):
    return None
  return {k: max(int(s[k]) for s in stats) for k in ("bytes_in_use", "peak_bytes_in_use")}


def run_child(script: str, args: list[str], timeout: float) -> dict[str, Any]:
  """Runs `script` with `args` in a fresh process (fresh peak memory); returns the last JSON
  line it printed, or the error."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  out = subprocess.run([sys.executable, os.path.abspath(script), *args], capture_output=True,
                       text=True, env=env, timeout=timeout)
  lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
  if out.returncode != 0 or not lines:
    return dict(args=args, error=out.stderr[-4000:], returncode=out.returncode)
  return json.loads(lines[-1])


def argument_parser(description: str, variants: Sequence[str], json_name: str, *,
                    reps: int = 5, children: Sequence[str] = ("memory", "time")
                    ) -> argparse.ArgumentParser:
  """The flags every memory-and-time benchmark takes; a benchmark adds its own to it."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--size", default="medium", choices=sorted(gpt.SIZES))
  parser.add_argument("--tiny", action="store_true", help="CPU smoke run (size tiny)")
  parser.add_argument("--attention", default="cudnn", help="'cudnn', 'xla' or 'default'")
  parser.add_argument("--variants", nargs="+", default=list(variants))
  parser.add_argument("--iters", type=int, default=3)
  parser.add_argument("--reps", type=int, default=reps)
  parser.add_argument("--out", default=None, help=f"folder for {json_name}")
  parser.add_argument("--child", choices=tuple(children), help=argparse.SUPPRESS)
  return parser


def parsed(parser: argparse.ArgumentParser) -> argparse.Namespace:
  """The parsed command line; `--tiny` means size tiny with the default attention."""
  args = parser.parse_args()
  if args.tiny:
    args.size, args.attention = "tiny", "default"
  return args


def parse_args(description: str, variants: Sequence[str], json_name: str) -> argparse.Namespace:
  """The command line of a memory-and-time benchmark with no flags of its own."""
  return parsed(argument_parser(description, variants, json_name))


def drive(script: str, args: argparse.Namespace, size: Any,
          measure_memory: Callable[[str], dict[str, Any]],
          measure_time: Callable[[], dict[str, Any]],
          show: Callable[[dict[str, Any]], str]) -> dict[str, Any] | None:
  """Runs a memory-and-time benchmark. In a child process (`--child`): the measurement asked
  for, printed as JSON; returns None. In the parent: one memory child per variant (each
  starts with a fresh peak), then one timing child for all variants; returns the results
  with the machine and command, each child's result printed with `show` as it arrives."""
  if args.child == "memory":
    print(json.dumps(measure_memory(args.variants[0])))
    return None
  if args.child == "time":
    print(json.dumps(measure_time()))
    return None
  common = ["--size", size.name, "--attention", args.attention]
  results: dict[str, Any] = dict(
      size=dataclasses.asdict(size), attention=args.attention, variants=args.variants,
      jax=jax.__version__, device=jax.devices()[0].device_kind, devices=jax.device_count(),
      platform=platform.platform(), command=" ".join(sys.argv),
      xla_flags=os.environ.get("XLA_FLAGS", ""), memory=[])
  for v in args.variants:
    results["memory"].append(
        run_child(script, ["--child", "memory", "--variants", v, *common], 600))
    print(show(results["memory"][-1]), flush=True)
  results["time"] = run_child(
      script, ["--child", "time", "--variants", *args.variants, "--iters", str(args.iters),
               "--reps", str(args.reps), *common], 900)
  print(show(results["time"]), flush=True)
  return results


def write_json(folder: str | None, name: str, results: dict[str, Any]) -> None:
  """Writes `results` to `folder/name` when a folder was given."""
  if folder:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w") as f:
      json.dump(results, f, indent=1)
