"""What the benchmark scripts share: the machine and its device memory, rounds and their
medians, the command line, and one process per measurement with the driver of the
memory-and-time benchmarks (fsdp, offload). Traces and profiles: `profiling.py`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Mapping, Sequence, TypeVar

import jax

from benchmarks import gpt

T = TypeVar("T")


def machine() -> dict[str, Any]:
  """jax and Python versions, the device, and the GPU driver where nvidia-smi answers."""
  info = dict(jax=jax.__version__, python=platform.python_version(),
              device=jax.devices()[0].device_kind, platform=jax.devices()[0].platform)
  try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True, timeout=30)
    info["nvidia_smi"] = smi.stdout.strip()
  except (OSError, subprocess.SubprocessError):
    pass
  return info


def device_memory() -> dict[str, int] | None:
  """`bytes_in_use` and `peak_bytes_in_use`, the largest over the local devices (on one
  device, its own); None on backends without memory stats (CPU)."""
  stats = [d.memory_stats() for d in jax.local_devices()]
  if not all(stats):
    return None
  return {k: max(int(s[k]) for s in stats) for k in ("bytes_in_use", "peak_bytes_in_use")}


def memory_record(before: dict[str, int] | None, after_steps: dict[str, int] | None, *,
                  after_capture: dict[str, int] | None = None) -> dict[str, int]:
  """A result's memory fields from `device_memory` read before a variant is built, after its
  capture (optional) and after its steps: `bytes_in_use_before`, `peak_after_capture`,
  `peak_after_steps` and `activation_peak` (the steps' peak above what was in use before);
  empty on backends without memory stats."""
  if before is None or after_steps is None:
    return {}
  record = {"bytes_in_use_before": before["bytes_in_use"]}
  if after_capture is not None:
    record["peak_after_capture"] = after_capture["peak_bytes_in_use"]
  record["peak_after_steps"] = after_steps["peak_bytes_in_use"]
  record["activation_peak"] = after_steps["peak_bytes_in_use"] - before["bytes_in_use"]
  return record


def interleaved(rounds: int, runs: Mapping[str, Callable[[], T]]) -> dict[str, list[T]]:
  """Calls every run once a round for `rounds` rounds, the order reversed every other round
  (no run always goes first); each run's results in round order."""
  names = list(runs)
  results: dict[str, list[T]] = {name: [] for name in names}
  for index in range(rounds):
    for name in (names if index % 2 == 0 else names[::-1]):
      results[name].append(runs[name]())
  return results


def seconds_per_step(step: Callable[[int], Any], iters: int) -> float:
  """Seconds per call of `step(i)` over `iters` calls, after an untimed `step(0)` that the
  device finishes first."""
  jax.block_until_ready(step(0))
  start = time.perf_counter()
  for i in range(iters):
    out = step(i)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / iters


def summary(values: Sequence[float]) -> dict[str, float]:
  """Median, min, max, and the spread (max - min) in percent of the median."""
  median = statistics.median(values)
  spread = 100 * (max(values) - min(values)) / median if median else 0.0
  return dict(median=median, min=min(values), max=max(values), spread_pct=spread)


def mib(value: float | None, places: int) -> str:
  """Bytes as MiB with `places` decimals, `-` for none."""
  return "-" if value is None else f"{value / 2 ** 20:,.{places}f}"


def add_attention_flag(parser: argparse.ArgumentParser) -> None:
  """Adds `--attention`, which `attention` reads."""
  parser.add_argument("--attention", default=None,
                      help="dot_product_attention's implementation: 'cudnn', 'xla' or 'default' "
                      "(jax's choice); unset, cudnn on a GPU and jax's choice elsewhere")


def add_timing_flags(parser: argparse.ArgumentParser, *, iters: int, reps: int) -> None:
  """Adds `--iters` and `--reps` (the rounds) and `--attention`."""
  parser.add_argument("--iters", type=int, default=iters, help="steps per timed round")
  parser.add_argument("--reps", type=int, default=reps, help="timed rounds per variant")
  add_attention_flag(parser)


# Where an unset --attention means cuDNN's attention (it does not compile for XLA:CPU).
CUDNN_PLATFORMS = frozenset({"gpu"})


def attention(flag: str | None) -> str | None:
  """The `implementation=` of `jax.nn.dot_product_attention` that `--attention` names:
  unset, cuDNN's where the default backend is one of `CUDNN_PLATFORMS`, else jax's choice;
  "default", jax's choice."""
  if flag is None:
    return "cudnn" if jax.default_backend() in CUDNN_PLATFORMS else None
  return None if flag == "default" else flag


def argument_parser(description: str, variants: Sequence[str], json_name: str, *,
                    reps: int = 5, children: Sequence[str] = ("memory", "time")
                    ) -> argparse.ArgumentParser:
  """The flags every memory-and-time benchmark takes; a benchmark adds its own to it."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--size", default="medium", choices=sorted(gpt.SIZES))
  parser.add_argument("--tiny", action="store_true", help="CPU smoke run (size tiny)")
  parser.add_argument("--variants", nargs="+", default=list(variants))
  add_timing_flags(parser, iters=3, reps=reps)
  parser.add_argument("--out", default=None, help=f"folder for {json_name}")
  parser.add_argument("--child", choices=tuple(children), help=argparse.SUPPRESS)
  return parser


def parsed(parser: argparse.ArgumentParser) -> argparse.Namespace:
  """The parsed command line, `--attention` named (children are passed it); `--tiny` means
  size tiny with jax's choice of attention."""
  args = parser.parse_args()
  if args.tiny:
    args.size, args.attention = "tiny", "default"
  args.attention = args.attention or ("cudnn" if jax.default_backend() == "gpu" else "default")
  return args


def parse_args(description: str, variants: Sequence[str], json_name: str) -> argparse.Namespace:
  """The command line of a memory-and-time benchmark with no flags of its own."""
  return parsed(argument_parser(description, variants, json_name))


def run_checked(command: Sequence[str], cwd: str | os.PathLike[str]) -> float:
  """Runs `command` in `cwd` (its output captured); its wall seconds.

  Raises:
    RuntimeError: it failed (the message ends with its output's tails).
  """
  begin = time.perf_counter()
  done = subprocess.run(list(command), cwd=cwd, capture_output=True, text=True, check=False)
  if done.returncode:
    raise RuntimeError(f"{shlex.join(command[1:])} exited {done.returncode}:\n"
                       f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
  return round(time.perf_counter() - begin, 1)


def run_child(module: str, args: list[str], timeout: float) -> dict[str, Any]:
  """Runs `python -m module` with `args` in a fresh process (fresh peak memory) where this
  one runs (the repository root); returns the last JSON line it printed, or the error."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                       text=True, env=env, timeout=timeout)
  lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
  if out.returncode != 0 or not lines:
    return dict(args=args, error=out.stderr[-4000:], returncode=out.returncode)
  return json.loads(lines[-1])


def drive(module: str, args: argparse.Namespace, size: Any,
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
        run_child(module, ["--child", "memory", "--variants", v, *common], 600))
    print(show(results["memory"][-1]), flush=True)
  results["time"] = run_child(
      module, ["--child", "time", "--variants", *args.variants, "--iters", str(args.iters),
               "--reps", str(args.reps), *common], 900)
  print(show(results["time"]), flush=True)
  return results
