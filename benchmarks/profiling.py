"""Where the benchmarks read device and host time from: `jax.profiler` traces (recorded,
then read by process, thread and kernel) and py-spy's samples of the host with native frames."""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any, Callable, NamedTuple

import jax

Event = dict[str, Any]  # one Chrome-format trace event


class Trace(NamedTuple):
  """A `jax.profiler` trace of one run."""

  events: list[Event]  # the Chrome-format trace's `traceEvents`
  seconds: float       # wall time of the run, until the device had run what it returned
  path: str | None     # the trace file, where its folder is kept


def record_trace(run: Callable[[], Any], folder: str | None = None) -> Trace:
  """Runs `run()` under `jax.profiler` and reads back the trace it recorded.

  `run` starts on an idle device (the caller drains it first). The trace files stay in
  `folder` where one is given (a subfolder per recording), else in a temporary folder that is
  removed after.
  """
  with contextlib.ExitStack() as stack:
    kept = folder is not None
    if folder is None:
      folder = stack.enter_context(tempfile.TemporaryDirectory())
    jax.profiler.start_trace(folder, create_perfetto_trace=True)
    try:
      start = time.perf_counter()
      jax.block_until_ready(run())
      seconds = time.perf_counter() - start
    finally:
      jax.profiler.stop_trace()
    # The newest recording: the profiler names each recording's subfolder by its time.
    path = sorted(glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"),
                            recursive=True))[-1]
    with gzip.open(path) as f:
      events = json.load(f)["traceEvents"]
  return Trace(events, seconds, path if kept else None)


def process_names(events: list[Event]) -> dict[int, str]:
  """Each process row's name (`/device:GPU:0`, `/host:CPU`, ...) by its pid."""
  return {e["pid"]: e["args"]["name"] for e in events
          if e.get("ph") == "M" and e.get("name") == "process_name"}


def thread_names(events: list[Event]) -> dict[tuple[int, int | None], str]:
  """Each thread row's name (`Stream #1(Compute)`, `XLA Ops`, ...) by its (pid, tid)."""
  return {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
          if e.get("ph") == "M" and e.get("name") == "thread_name"}


def gpu_processes(events: list[Event]) -> set[int]:
  """The pids of the trace's GPU rows, not the host's."""
  return {pid for pid, name in process_names(events).items()
          if "gpu" in name.lower() and "host" not in name.lower()}


def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
  """Sorted `(start, stop)` intervals, those that overlap or touch merged into one."""
  out: list[tuple[float, float]] = []
  for start, stop in spans:
    if out and start <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], stop))
    else:
      out.append((start, stop))
  return out


def union_us(spans: list[tuple[float, float]]) -> float:
  """The length of the union of sorted `(start, stop)` intervals."""
  return sum(stop - start for start, stop in merged(spans))


def kernel_kind(name: str) -> str:
  """A GPU kernel's kind from its name: gemm, attention, copy, reduce, rng, fusion, other."""
  lowered = name.lower()
  for kind, marks in (("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
                      ("attention", ("cudnn", "fmha", "flash", "attn")),
                      ("copy", ("memcpy", "memset", "copy")),
                      ("reduce", ("reduce", "reduction")),
                      ("rng", ("threefry", "random", "rng")),
                      ("fusion", ("fusion", "loop_", "input_", "triton"))):
    if any(m in lowered for m in marks):
      return kind
  return "other"


def sample_native(advance: Callable[[], Any], seconds: float, path: str
                  ) -> tuple[float, int] | None:
  """Calls `advance()` for `seconds` under py-spy's sampling profiler with native frames (the
  runtime's C++ under `Compiled.__call__`), the collapsed stacks written to `path`
  (`probes/native_breakdown.py` reads them, the samples of `_sampled` only).

  Returns the seconds and the calls that ran, the device drained after the last one; None,
  saying so, where py-spy is not on the PATH.
  """
  spy = shutil.which("py-spy")
  if spy is None:
    print("py-spy not found: no native sampling profile", flush=True)
    return None
  # --idle: the main thread's waits are sampled too, so the samples add up to the wall time
  sampler = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--native", "--idle",
                              "--rate", "1000", "--format", "raw", "--duration",
                              str(int(seconds) + 30), "--output", path],
                             stdout=subprocess.DEVNULL)
  time.sleep(1.0)  # py-spy attaches
  ran = _sampled(advance, seconds, sampler)
  sampler.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
  sampler.wait()
  return ran


def _sampled(advance: Callable[[], Any], seconds: float, sampler: subprocess.Popen
             ) -> tuple[float, int]:
  """The calls `sample_native` times, in a frame of their own (`native_breakdown.SAMPLED`)."""
  start, calls, out = time.perf_counter(), 0, None
  while time.perf_counter() < start + seconds and sampler.poll() is None:
    out = advance()
    calls += 1
  jax.block_until_ready(out)
  return time.perf_counter() - start, calls
