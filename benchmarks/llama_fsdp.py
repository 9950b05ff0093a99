"""FSDP on several GPUs: the Llama example's graphed step against its sharded whole-step jit.

  python3 -m benchmarks.llama_fsdp --rows gpu-1b:1 gpu-1b:2 gpu-1b:4 gpu:1 gpu:4 \\
      'gpu-1b:4:--fuse 4' --per-process --trace --record docs/results/fsdp-gpu.txt \\
      --out /tmp/fsdp                                                              # 4 GPUs
  JAX_PLATFORMS=cpu python3 -m benchmarks.llama_fsdp --rows tiny:1 tiny:2 \\
      --per-process --rounds 1 --round-steps 1 --out /tmp/fsdp     # CPU smoke: N virtual devices
  PYTHONPATH=other:. python3 -P -m benchmarks.llama_fsdp --rows gpu:4 --gpus 4   # other/jaxgraph

Another tree's jaxgraph runs only with `-P`: `python -m` puts the working directory ahead of
PYTHONPATH, so without it the working tree's jaxgraph runs whatever PYTHONPATH says. The
rows start with the parent's `-P`, and each records the `jaxgraph` it imported.

A row `PRESET:N[:FLAGS]` is the example's preset weak-scaled to N devices: its batch times N,
sharded over N devices with `--fsdp N` (N = 1: one device, no mesh), so every device has the
one-device run's work, with the example's extra FLAGS (`--fuse 4`: on GPUs with prefetch
across the segments, the example's default; `--fuse 4 --no-prefetch` without; each row records
which ran as `prefetch=on|off`). Each row runs in a fresh
process driving its N devices (with --gpus G, rows that fit in G GPUs together run at once,
each on GPUs of its own), and with --per-process also as N processes of one device each (`jax.distributed` on 127.0.0.1, one GPU visible to
each). In a row's process the example's own parts build the graphed step (`Trainer`) and the
sharded whole-step `jax.jit` that `--check` compares it with (`WholeStep`, the same layer
functions and shardings), from the same params; then:

  memory: the graphed step's peak (`peak_bytes_in_use` after its warm-up steps, before the
    whole step exists) and the whole step's planned peak (its executable's
    `memory_analysis()`: arguments + outputs - aliased + temporaries), per device;
  rate: `--rounds` rounds of `--round-steps` steps each, graphed and whole step alternating
    after an untimed round each (the example's `throughput_rounds`, as `--check` times
    them): tokens/s, median and spread ((max - min) / median);
  collectives: per executable, the collectives of its compiled HLO by op and element type;
  calls (GPU): host microseconds per call of a block's forward and of its pullback, in bursts
    of 8 after a sync (fewer calls than the runtime lets in flight, so the host is not waiting
    for the device);
  trace (--trace, GPU): a profiler trace of `--trace-steps` steps of each, reduced per GPU to
    step time, busy time, collective (NCCL) kernel time, the part of it under compute kernels
    and the exposed rest, the idle gaps between kernels (the longest with what each host
    thread did meanwhile), and kernel time by kind and for the heaviest kernels by name
    (where a step computes longer than the other, which kernels).

--clients runs each row under each of jax's GPU dispatch settings, a fresh process each:
`default` (the GPU client launches on the caller's thread) and `tfrt`
(`XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1` in the row's environment, which in jax 0.11 turns on
async dispatch, a thread per device launching; XLA's TFRT client is gone); with --repeat K
the rows run K times over, the clients' order reversed each time, so a row's clients
alternate. Each row records the client it asked for.

Prints a table and writes llama_fsdp.json to --out; --record writes the rows as
docs/results/fsdp-gpu.txt's lines: the run's facts, one `key value` line each (commit,
device, jax, xla_flags, date, command), then one `row key=value key=value ...` line per row
and process layout, no value holding a space (`read_record` reads them back). A row whose
processes failed is recorded as `row ... error=...`, its processes' output printed to
stderr, and the script exits with status 1 after the other rows. With --row-timeout S a row
still running after S seconds is killed and recorded so (`error=killed_after_S_s_...`): jax's
whole step under async dispatch hung on 4 GPUs at its first step, and would hold up every
row after.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from typing import Any, Sequence

import jax

import jaxgraph as jg
from benchmarks import profiling
from examples.llama import train
from examples.llama.data import step_batches
from examples.llama.fsdp_report import collectives, named_executables
from examples.llama.memory import peak_bytes
from examples.llama.presets import PRESETS
from examples.llama.throughput import rate_summary, throughput_rounds
from examples.llama.whole_step import WholeStep

ROOT = pathlib.Path(__file__).resolve().parents[1]

def planned_peak(compiled: Any) -> int:
  """Bytes per device an executable holds while it runs, as XLA planned them."""
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


def call_microseconds(trainer: Any, params: Any, corpus: Any, positions: Any) -> dict[str, float]:
  """Host microseconds per call of the first block's forward (`vjp`) and of its pullback,
  median over bursts of 8 calls, each burst after a sync."""
  embed, block = trainer.layers[0], trainer.layers[1]
  x, _ = embed.vjp(params[0], corpus.batch_at(0)[0])
  forward, backward = [], []
  for _ in range(3):
    jax.block_until_ready(x)
    begin = time.perf_counter()
    outs = [block.vjp(params[1], x, positions) for _ in range(8)]
    forward.append((time.perf_counter() - begin) / 8)
    jax.block_until_ready([y for y, _ in outs])
    begin = time.perf_counter()
    grads = [pullback(y) for y, pullback in outs]
    backward.append((time.perf_counter() - begin) / 8)
    jax.block_until_ready(grads)
  return {"block_forward_us": round(1e6 * statistics.median(forward), 1),
          "block_backward_us": round(1e6 * statistics.median(backward), 1)}


# idle gaps between a GPU's kernels, by length (microseconds): a launch's own gap, a host
# that was behind for a while, a host that was away
GAP_BUCKETS = ((0, 50), (50, 1000), (1000, float("inf")))


Span = tuple[float, float, str]  # a trace event's (start, stop) microseconds and its name


def _gaps(kernels: list[Span]) -> list[tuple[float, float, str, str]]:
  """The idle gaps between sorted kernels: `(microseconds, start, the name of the kernel that
  ended last before it, the name of the one after)`, names cut to 60."""
  gaps, end, last = [], None, ""
  for start, stop, name in kernels:
    if end is not None and start > end:
      gaps.append((round(start - end, 1), end, last[:60], name[:60]))
    if end is None or stop > end:
      end, last = stop, name
  return gaps


def _host_during(host: dict[str, list[Span]], start: float, stop: float
                 ) -> dict[str, str]:
  """What each host thread did over at least half of `[start, stop)`: its innermost (shortest)
  event that long, by thread (threads busy for less of it left out), names cut to 60."""
  found = {}
  for thread, events in host.items():
    inside = [(b - a, name) for a, b, name in events
              if min(b, stop) - max(a, start) >= (stop - start) / 2]
    if inside:
      found[thread] = min(inside)[1][:60]
  return found


def _host_threads(events: list[profiling.Event]) -> dict[str, list[Span]]:
  """The trace's host events (every row but the GPUs'), by thread name."""
  gpus, threads = profiling.gpu_processes(events), profiling.thread_names(events)
  host: dict[str, list[Span]] = {}
  for e in events:
    if e.get("ph") == "X" and "dur" in e and e.get("pid") not in gpus:
      thread = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
      host.setdefault(thread, []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
  return host


def _gap_buckets(gaps: list[float], steps: int) -> dict[str, dict[str, float]]:
  """Per bucket of `GAP_BUCKETS`: the gaps a step and their milliseconds a step."""
  out = {}
  for lo, hi in GAP_BUCKETS:
    inside = [gap for gap in gaps if lo <= gap < hi]
    out[f"{lo:g}-{hi:g}us"] = {"per_step": round(len(inside) / steps, 1),
                               "ms": round(sum(inside) / steps / 1e3, 3)}
  return out


def trace_summary(trace: profiling.Trace, steps: int) -> dict[str, Any]:
  """Per GPU and step (milliseconds): busy, NCCL kernels, their part under compute kernels,
  the exposed rest, the idle gaps between kernels by length (`GAP_BUCKETS`) and the longest
  of them with the kernels either side and what each host thread did meanwhile; kernel
  time by kind and name (`_kernel_time`); and the step's wall time."""
  names = profiling.process_names(trace.events)
  host = _host_threads(trace.events)
  per_gpu: dict[str, dict[str, Any]] = {}
  for pid in sorted(profiling.gpu_processes(trace.events)):
    kernels = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace.events
               if e.get("pid") == pid and e.get("ph") == "X" and "dur" in e]
    comm = sorted((a, b) for a, b, name in kernels if _kernel_class(name) == "nccl")
    compute = sorted((a, b) for a, b, name in kernels
                     if _kernel_class(name) not in ("nccl", "copy"))
    comm_us, compute_us = profiling.union_us(comm), profiling.union_us(compute)
    busy_us = profiling.union_us(sorted(comm + compute))
    hidden = comm_us + compute_us - busy_us
    gaps = _gaps(sorted(k for k in kernels if profiling.kernel_kind(k[2]) != "copy"))
    longest = sorted(gaps, reverse=True)[:8]
    per_gpu[names.get(pid, str(pid))] = {
        "idle_gaps": _gap_buckets([gap[0] for gap in gaps], steps),
        "longest_gaps": [{"us": us, "after": previous, "before": following,
                          "host": _host_during(host, start, start + us)}
                         for us, start, previous, following in longest],
        "busy_ms": round(busy_us / steps / 1e3, 3), "compute_ms": round(compute_us / steps / 1e3, 3),
        "nccl_ms": round(comm_us / steps / 1e3, 3), "nccl_hidden_ms": round(hidden / steps / 1e3, 3),
        "nccl_exposed_ms": round((comm_us - hidden) / steps / 1e3, 3),
        **_kernel_time(kernels, steps)}
  return {"step_ms": round(1e3 * trace.seconds / steps, 3), "gpus": per_gpu}


def _kernel_class(name: str) -> str:
  """A GPU kernel's class: "nccl" for a collective, else its `profiling.kernel_kind`."""
  return "nccl" if "nccl" in name.lower() else profiling.kernel_kind(name)


def _kernel_time(kernels: list[tuple[float, float, str]], steps: int,
                 top: int = 15) -> dict[str, Any]:
  """Kernel time per step (ms, summed, overlaps counted twice) by class (`_kernel_class`)
  and for the `top` heaviest kernel names (XLA's numeric suffixes dropped, so
  `loop_add_fusion_12` and `loop_add_fusion_3` are one), with their calls per step: what
  two steps computing the same model spend their GPU time on, side by side."""
  by_kind: dict[str, float] = collections.defaultdict(float)
  by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
  for start, end, name in kernels:
    by_kind[_kernel_class(name)] += end - start
    entry = by_name[re.sub(r"(_\d+)+$", "", name)]
    entry[0] += end - start
    entry[1] += 1
  heaviest = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
  return {"kernel_ms_by_kind": {kind: round(us / steps / 1e3, 3)
                                for kind, us in sorted(by_kind.items())},
          "top_kernels": [{"name": name, "ms": round(us / steps / 1e3, 3),
                           "calls": round(count / steps, 1)}
                          for name, (us, count) in heaviest]}


def run_row(argv: list[str], options: argparse.Namespace) -> dict[str, Any]:
  """One row in this process (or this process's part of it): builds both steps as the
  example does and measures them."""
  args = train.parse(argv)
  built = train.build(args)
  preset, corpus, placement, policy = built.preset, built.corpus, built.placement, built.policy
  fns, model, tx, trainer = built.fns, built.model, built.tx, built.trainer
  params, opt_state, positions = built.params, built.opt_state, built.captured.positions
  whole_start = placement.host((params, opt_state))
  for step in range(preset.round_steps):  # the graphed step alone: its peak
    params, opt_state, loss = trainer.step(params, opt_state,
                                           step_batches(corpus, step, preset.microbatches),
                                           positions)
  jax.block_until_ready(loss)
  result: dict[str, Any] = {"graphed_peak_bytes": peak_bytes()}
  whole = WholeStep(fns, model.config, tx, preset.microbatches, trainer.streams(),
                    not args.plain_ends, *placement.abstract(whole_start),
                    step_batches(corpus, 0, preset.microbatches), positions, policy, placement)
  whole_state = placement.put(whole_start)
  del whole_start
  result["whole_planned_peak_bytes"] = planned_peak(whole.compiled)
  found = {name: collectives(compiled)
           for name, compiled in named_executables(trainer.layers)}
  found["whole step"] = collectives(whole.compiled)
  result["collectives"] = found
  # whether the blocks replayed prefetching steps (`--prefetch`, or its default on GPUs):
  # named_executables names their executables after the steps
  result["prefetch"] = any(name.startswith("prefetch(") for name in found)
  runs = {"graphed": [trainer, (params, opt_state)], "whole_step": [whole, whole_state]}
  on_gpu = jax.devices()[0].platform == "gpu"
  if on_gpu:
    result["calls"] = call_microseconds(trainer, params, corpus, positions)
  if options.trace and on_gpu:
    result["trace"] = {}
    for name, run in runs.items():
      def steps(run: list[Any] = run) -> Any:
        (params, opt_state), loss = run[1], None
        for step in range(options.trace_steps):
          params, opt_state, loss = run[0].step(
              params, opt_state, step_batches(corpus, step, preset.microbatches), positions)
        run[1] = params, opt_state  # the steps donate the state they are given
        return loss
      folder = (None if options.out is None else
                str(options.out / "traces" / f"{name}-process{jax.process_index()}"))
      jax.block_until_ready(run[1])
      result["trace"][name] = trace_summary(profiling.record_trace(steps, folder),
                                            options.trace_steps)
  # last: the rounds consume both states
  rates = throughput_rounds({name: tuple(run) for name, run in runs.items()}, corpus,
                            positions, preset.microbatches, preset.rounds, preset.round_steps)
  result["rates"] = {k: rate_summary(v, preset.round_steps) for k, v in rates.items()}
  result["tokens_per_step"] = preset.microbatches * preset.batch * preset.context
  device = jax.devices()[0]
  result["device_kind"] = getattr(device, "device_kind", device.platform)
  # what the CUDA plugin was told: the runtime reports the same `platform_version` either way
  result["client_variable"] = os.environ.get(CLIENT_VARIABLE)
  result["jaxgraph"] = jg.__file__  # which tree ran: a comparison of two trees says so
  return result


def row_argv(preset: str, n: int, flags: str, out: pathlib.Path, options: argparse.Namespace
             ) -> list[str]:
  """The example's flags for row `preset:n` (weak scaling: the preset's batch times n) and
  the variant's `flags`."""
  argv = ["--preset", preset, "--batch", str(PRESETS[preset].batch * n), "--out", str(out),
          "--generate", "0", "--rounds", str(options.rounds),
          "--round-steps", str(options.round_steps), *shlex.split(flags)]
  return argv + (["--fsdp", str(n)] if n > 1 else [])


# the environment variable the CUDA plugin reads when the backend starts (in jax 0.11: async
# dispatch, a thread per device launching), and its value for each `--clients` name
CLIENT_VARIABLE = "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT"
CLIENTS = {"default": "0", "tfrt": "1"}


def launch(preset: str, n: int, flags: str, processes: int, options: argparse.Namespace,
           gpus: Sequence[int] | None = None, client: str = "default") -> dict[str, Any]:
  """Runs a row in fresh processes (`processes` = 1: one driving the n devices; n: one per
  device, each seeing one GPU) under jax's GPU `client` (`CLIENTS`) and returns process 0's
  result. `gpus`: the GPUs it may see (None: all, from the first)."""
  with tempfile.TemporaryDirectory() as scratch:
    scratch = pathlib.Path(scratch)
    result_path = scratch / "result.json"
    # `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH: a
    # parent started with `-P` (to import another tree's jaxgraph from PYTHONPATH) starts
    # its rows so too
    base = [sys.executable, *(["-P"] if sys.flags.safe_path else []), "-m",
            "benchmarks.llama_fsdp", "--child", str(result_path),
            *(["--trace", "--trace-steps", str(options.trace_steps)] if options.trace else []),
            *(["--out", str(options.out / f"{preset}-{n}x{processes}{_slug(flags)}")]
              if options.out else []),
            "--"]
    argv = row_argv(preset, n, flags, scratch / "run", options)
    # JAX_PLATFORMS=cpu: each process gets as many virtual CPU devices as it drives
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", "")).strip()
    cpu = os.environ.get("JAX_PLATFORMS") == "cpu"

    def env(visible: Sequence[int]) -> dict[str, str]:
      base = dict(os.environ, **{CLIENT_VARIABLE: CLIENTS[client]})
      if cpu:
        count = f" --xla_force_host_platform_device_count={len(visible)}"
        return dict(base, XLA_FLAGS=(flags + count).strip())
      if gpus is None and len(visible) == n:
        return base
      return dict(base, CUDA_VISIBLE_DEVICES=",".join(map(str, visible)))

    visible = list(range(n)) if gpus is None else list(gpus)
    if processes == 1:
      commands, envs = [base + argv], [env(visible)]
    else:
      port = _free_port()
      commands = [base + argv + ["--coordinator", f"127.0.0.1:{port}", "--num-processes",
                                 str(processes), "--process-id", str(i)]
                  for i in range(processes)]
      envs = [env([gpu]) for gpu in visible]  # one GPU each
    procs = [subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for c, e in zip(commands, envs)]
    logs, hung = finish(procs, options.row_timeout)
    if hung or any(p.returncode for p in procs) or not result_path.exists():
      tail = "\n".join(log[-3000:] for log in logs)
      codes = ",".join(str(p.returncode) for p in procs)
      error = (f"killed after {options.row_timeout:g} s (a hang?), exit codes {codes}" if hung
               else f"exit codes {codes}")
      return {"error": error, "log": tail}
    return json.loads(result_path.read_text())


def finish(procs: Sequence[subprocess.Popen], timeout: float | None
           ) -> tuple[list[str], bool]:
  """Each process's output, and whether `timeout` seconds passed before all had ended: then
  every one still running was killed (a collective that never completes waits forever)."""
  deadline = None if timeout is None else time.monotonic() + timeout
  logs, hung = [], False
  for proc in procs:
    try:
      left = None if deadline is None or hung else max(0.0, deadline - time.monotonic())
      logs.append(proc.communicate(timeout=left)[0])
    except subprocess.TimeoutExpired:
      hung = True
      for other in procs:
        other.kill()
      logs.append(proc.communicate()[0])
  return logs, hung


def _slug(flags: str) -> str:
  return re.sub(r"[^A-Za-z0-9]+", "-", flags).rstrip("-")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# preset, devices, the example's extra flags, processes, client
Run = tuple[str, int, str, int, str]


def planned_runs(rows: Sequence[str], *, per_process: bool, clients: Sequence[str],
                 repeat: int) -> list[Run]:
  """The runs of `rows` (`PRESET:N[:FLAGS]`), in order: each row in one process (and with
  `per_process`, N > 1, in N), under each client; all of it `repeat` times over, the
  clients' order reversed each time, so that two clients of a row alternate."""
  runs: list[Run] = []
  for time_over in range(repeat):
    order = list(clients)[::-1] if time_over % 2 else list(clients)
    for spec in rows:
      preset, n, *flags = spec.split(":", 2)
      for processes in [1] + ([int(n)] if per_process and int(n) > 1 else []):
        runs.extend((preset, int(n), flags[0] if flags else "", processes, client)
                    for client in order)
  return runs


def waves(runs: list[Run], gpus: int | None) -> list[list[tuple[Run, list[int] | None]]]:
  """The runs in order, packed into waves that fit `gpus` GPUs together (each run with its
  GPUs); without `gpus`, one run a wave on every GPU."""
  if gpus is None:
    return [[(run, None)] for run in runs]
  out: list[list[tuple[Run, list[int] | None]]] = []
  free = 0
  for run in runs:
    n = run[1]
    if not out or free + n > gpus:
      out.append([])
      free = 0
    out[-1].append((run, list(range(free, free + n))))
    free += n
  return out


def measure(run: Run, gpus: list[int] | None, beside: int, options: argparse.Namespace
            ) -> dict[str, Any]:
  """One run of a row: its result, named, with its wall seconds."""
  preset, n, flags, processes, client = run
  print(f"row {preset}:{n} {flags}, {processes} process(es), {client} client, "
        f"GPUs {gpus or 'all'} ...", flush=True)
  begin = time.perf_counter()
  row = {"preset": preset, "n": n, "flags": flags, "processes": processes, "client": client,
         "concurrent": beside, **launch(preset, n, flags, processes, options, gpus, client)}
  row["seconds"] = round(time.perf_counter() - begin, 1)
  return row


def _spread(row: dict[str, Any]) -> float:
  """The larger spread of a row's two rates, in percent."""
  return max(row["rates"][k]["spread_percent"] or 0 for k in ("graphed", "whole_step"))


def _field(text: str) -> str:
  """`text` as one value of a row line, which splits at spaces: each run of whitespace an
  underscore (`--fuse 4`: `--fuse_4`), "-" for none."""
  return re.sub(r"\s+", "_", text.strip()) or "-"


def record_lines(rows: list[dict[str, Any]], command: str, commit: str | None) -> list[str]:
  """docs/results/fsdp-gpu.txt: the run's facts (`key value`, the value free text), then one
  `row key=value ...` line per row, its values without spaces (`_field`)."""
  if commit is None:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
  # from the rows' processes: the parent never starts a backend (on GPUs it would take their
  # memory from the rows' processes)
  kinds = sorted({row["device_kind"] for row in rows if "device_kind" in row})
  lines = [f"commit {commit}",
           f"device {', '.join(kinds) or 'unknown'}, rows on up to "
           f"{max((row['n'] for row in rows), default=0)} of them",
           f"jax {jax.__version__}",
           f"xla_flags {os.environ.get('XLA_FLAGS', '(none)')}",
           f"date {datetime.date.today().isoformat()}",
           f"command {command}"]
  for row in rows:
    if "error" in row:
      lines.append(f"row preset={row['preset']} n={row['n']} processes={row['processes']} "
                   f"flags={_field(row['flags'])} client={row['client']} "
                   f"error={_field(row['error'])}")
      continue
    graphed, whole = (row["rates"][k] for k in ("graphed", "whole_step"))
    peaks = (f" graphed_peak_gib={row['graphed_peak_bytes'] / 2**30:.2f}"
             if row.get("graphed_peak_bytes") else "")
    calls = "".join(f" {key}={value}" for key, value in row.get("calls", {}).items())
    lines.append(
        f"row preset={row['preset']} n={row['n']} graphed={graphed['median']:.0f} "
        f"whole={whole['median']:.0f} ratio={graphed['median'] / whole['median']:.3f} "
        f"spread={_spread(row):.1f}% processes={row['processes']} "
        f"flags={_field(row['flags'])} prefetch={'on' if row.get('prefetch') else 'off'} "
        f"client={row['client']} "
        f"concurrent={row['concurrent']} "
        f"rounds={len(graphed['rounds'])}"
        f"{peaks} whole_planned_gib={row['whole_planned_peak_bytes'] / 2**30:.2f}{calls}")
  return lines


def read_record(text: str) -> tuple[dict[str, str], list[dict[str, str]]]:
  """A record's facts (by key) and its rows (each a dict of its `key=value` fields).

  Raises:
    ValueError: a row field without `=` (the record was written by a version that let a
      value hold a space: rewrite it with this one).
  """
  facts, rows = {}, []
  for line in text.splitlines():
    key, _, value = line.partition(" ")
    if key != "row":
      facts[key] = value
      continue
    fields = value.split()
    if bad := [field for field in fields if "=" not in field]:
      raise ValueError(f"row fields without '=' {bad} in {line!r}: every row field is "
                       "key=value without spaces (record_lines)")
    rows.append(dict(field.split("=", 1) for field in fields))
  return facts, rows


def table(rows: list[dict[str, Any]]) -> str:
  out = [f"{'row':<22}{'procs':>6}{'client':>8}{'graphed tok/s':>15}{'whole tok/s':>13}"
         f"{'ratio':>7}{'spread':>8}  trace graphed / whole: step, exposed NCCL (ms, GPU 0)"]
  for row in rows:
    name = f"{row['preset']}:{row['n']} {row['flags']}".strip()
    if "error" in row:
      out.append(f"{name:<22}{row['processes']:>6}{row['client']:>8}  {row['error']}")
      continue
    g, w = row["rates"]["graphed"], row["rates"]["whole_step"]
    trace = ""
    if "trace" in row:
      first = {k: next(iter(v["gpus"].values()), {}) for k, v in row["trace"].items()}
      trace = "  " + " / ".join(f"{row['trace'][k]['step_ms']:.1f}, "
                                f"{first[k].get('nccl_exposed_ms', 0):.2f}"
                                for k in ("graphed", "whole_step"))
    out.append(f"{name:<22}{row['processes']:>6}{row['client']:>8}{g['median']:>15,.0f}"
               f"{w['median']:>13,.0f}{g['median'] / w['median']:>7.3f}{_spread(row):>7.1f}%"
               f"{trace}")
  return "\n".join(out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", nargs="+", default=["gpu-1b:1", "gpu-1b:4"],
                      help="PRESET:N[:FLAGS], the preset weak-scaled to N devices, with the "
                           "example's extra FLAGS (e.g. 'gpu-1b:4:--fuse 4')")
  parser.add_argument("--per-process", action="store_true",
                      help="also run each row with N > 1 as N processes of one GPU each")
  parser.add_argument("--gpus", type=int,
                      help="run rows at once where their GPUs fit in this many (each row on "
                           "GPUs of its own; the record says how many ran together)")
  parser.add_argument("--clients", nargs="+", choices=sorted(CLIENTS), default=["default"],
                      help="run each row under each of jax's GPU clients, a fresh process "
                           "each (tfrt: XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1, async "
                           "dispatch in jax 0.11)")
  parser.add_argument("--repeat", type=int, default=1,
                      help="run the rows this many times over, the clients' order reversed "
                           "each time")
  parser.add_argument("--row-timeout", type=float,
                      help="kill a row's processes after this many seconds and record it as "
                           "an error (a hang), then go on with the other rows")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--round-steps", type=int, default=10)
  parser.add_argument("--trace", action="store_true", help="profile steps of both (GPU)")
  parser.add_argument("--trace-steps", type=int, default=3)
  parser.add_argument("--record", type=pathlib.Path, help="write the rows here (fsdp-gpu.txt)")
  parser.add_argument("--commit", help="the commit measured, for the record (default: the "
                      "checkout's HEAD; a copied tree's .git may be stale)")
  parser.add_argument("--out", type=pathlib.Path, help="llama_fsdp.json and the traces")
  parser.add_argument("--child", type=pathlib.Path, help=argparse.SUPPRESS)
  options, rest = parser.parse_known_args()
  if options.child is not None:  # one row's process: the example's flags after "--"
    result = run_row(rest[rest.index("--") + 1:] if "--" in rest else rest, options)
    if jax.process_index() == 0:
      options.child.write_text(json.dumps(result))
    return
  rows = []
  runs = planned_runs(options.rows, per_process=options.per_process, clients=options.clients,
                      repeat=options.repeat)
  for wave in waves(runs, options.gpus):
    # a wave's runs at once, each on GPUs of its own
    with futures.ThreadPoolExecutor(len(wave)) as pool:
      done = list(pool.map(lambda run: measure(*run, len(wave), options), wave))
    rows.extend(done)
    for row in done:
      if "error" in row:
        print(row["log"], file=sys.stderr, flush=True)
    # after every wave: a run cut short keeps the rows done
    if options.out is not None:
      options.out.mkdir(parents=True, exist_ok=True)
      (options.out / "llama_fsdp.json").write_text(json.dumps(rows, indent=1))
    if options.record is not None:
      command = "python -m benchmarks.llama_fsdp " + shlex.join(sys.argv[1:])
      options.record.write_text("\n".join(record_lines(rows, command, options.commit)) + "\n")
  print(table(rows))
  print(json.dumps(rows))
  if options.record is not None:
    print(f"wrote {options.record}")
  if failed := [row for row in rows if "error" in row]:
    sys.exit(f"{len(failed)} of {len(rows)} runs failed (their output is above): "
             + "; ".join(f"{row['preset']}:{row['n']} {row['flags']} in {row['processes']} "
                         f"process(es), {row['client']} client: {row['error']}"
                         for row in failed))


if __name__ == "__main__":
  main()
