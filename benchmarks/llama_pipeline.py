"""The Llama example by stages against its bubble's bound and FSDP: tokens/s of `--pipeline N`.

  python3 -m benchmarks.llama_pipeline --preset gpu-1b --stages 4 --microbatches 16 \\
      --schedules 1f1b interleaved zero-bubble --record docs/results/pipeline-gpu.txt \\
      --out /tmp/pp                                                               # 4 GPUs
  python3 -m benchmarks.llama_pipeline --preset gpu-1b --stages 4 --microbatches 16 \\
      --schedules 1f1b zero-bubble --fuse --out /tmp/pp        # each chunk's layers fused
  python3 -m benchmarks.llama_pipeline --preset gpu-1b --stages 4 --microbatches 16 \\
      --schedules zero-bubble 1f1b --fuse --threads --out /tmp/pp     # a thread per stage
  JAX_PLATFORMS=cpu python3 -m benchmarks.llama_pipeline --preset tiny --stages 2 \\
      --microbatches 4 --steps 4 --round-steps 1 --out /tmp/pp      # CPU smoke: virtual devices

Builds the preset's vocabulary and encoded text into --cache first (once: every run reads
them from there), then runs the example (`python -m examples.llama.train`) in fresh
processes, each into its own `--out` under this one's: on one device (no `--pipeline`: the
baseline), with `--fsdp N` on the same N devices, then once per schedule with
`--pipeline N`; every run with the same preset, `--microbatches M`, steps and `--fuse [K]`
(the example's: each chunk's layers, or the one device's or FSDP's, replayed as fused
segments; in a pipeline `jg.schedule.Pipeline(..., fuse=...)`), so the same tokens a
step (M microbatches of the preset's batch: `--fsdp` splits each over its devices,
each pipeline stage runs it whole), without `--check` or generation. With `--threads` the
pipeline runs dispatch each stage from a thread of its own (the example's
`--pipeline-threads`: `jg.schedule.Pipeline(..., threads=True)`). Each run's wall time is
printed as it ends; its checkpoint (the example saves the last step) is removed once its
metrics.json is read.

A run's tokens/s is the training loop's own (metrics.json `tokens_per_second`: the median of
its rounds of `--round-steps` steps after a warm-up round; evaluation and checkpoints not
counted), so `--steps` must hold at least two rounds; its host time is the loop's too
(`throughput.loop`: the driving thread's CPU time a step, `host_seconds_per_step`, against
the step's wall time, `step_seconds`; with `--threads` also each stage's dispatch thread's,
`thread_seconds_per_step`, in the row as `thread_ms`).

The bound of a schedule is what N stages give when a stage computes as fast as the
one-device run and idles only in the order's bubble: N x the baseline's tokens/s x
(1 - bubble), the bubble being the idle fraction of a stage under the order the run recorded
(metrics.json `pipeline.order`, simulated by `jaxgraph.schedule.bubble_fraction`:
(N - 1) / (M + N - 1) for 1F1B). With --busy (GPUs), each schedule also runs in a process of this script that builds
the example's pipeline step and records a profiler trace of `--busy-steps` steps after a
warm-up round: per stage, the union of its GPU's kernels but copies, against the steps' wall
time.

Prints a line per run; writes llama_pipeline.json to --out and, with --record, the rows as
`key value` facts (commit, device, jax, xla_flags, date, command) and one `row key=value ...`
line per schedule.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shlex
import shutil
import sys
import time
from typing import Any, Sequence

import jax

from benchmarks import harness
from examples import vocabulary as vocab_lib
from examples.records import write_json
from examples.llama.cli import fuse_length
from examples.llama.data import load_vocabulary
from examples.llama.presets import PRESETS
from jaxgraph import schedule

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCHEDULES = ("1f1b", "interleaved", "zero-bubble")


def build_cache(preset: str, cache: pathlib.Path) -> None:
  """The preset's vocabulary and its text's ids in `cache`, as the example reads them
  (`make_corpus`): trained and encoded here once, not in the first run's clock."""
  text, vocabulary = load_vocabulary(PRESETS[preset], cache)
  vocab_lib.encoded(vocabulary, text, cache)


def example_flags(args: argparse.Namespace, out: pathlib.Path, *flags: str) -> list[str]:
  """The example's flags of a run into `out`: the benchmark's preset, microbatches, steps
  and --fuse [K], then the run's own `flags`."""
  fuse = [] if not args.fuse else ["--fuse"] if args.fuse is True else ["--fuse", str(args.fuse)]
  return ["--preset", args.preset, "--microbatches", str(args.microbatches), "--no-check",
          "--generate", "0", "--cache", str(args.cache), "--out", str(out), "--fresh",
          "--steps", str(args.steps), "--round-steps", str(args.round_steps), *fuse, *flags]


def train(args: argparse.Namespace, name: str, *flags: str) -> dict[str, Any]:
  """One run of the example into --out/`name`: its metrics.json, with the command and wall
  time (printed); its checkpoint removed."""
  out = args.out / name
  command = [sys.executable, "-m", "examples.llama.train", *example_flags(args, out, *flags)]
  wall = harness.run_checked(command, ROOT)
  metrics = json.loads((out / "metrics.json").read_text())
  shutil.rmtree(out / "checkpoints")  # the last step's state: GBs at gpu-1b, not read here
  loop = metrics["throughput"]["loop"]
  print(f"{name}: {metrics['tokens_per_second']:,.0f} tok/s, host/step "
        f"{_ms(loop['host_seconds_per_step'])}/{_ms(loop['step_seconds'])} ms ({wall} s)",
        flush=True)
  return {**metrics, "command": shlex.join(["python3", *command[1:]]), "wall_seconds": wall}


def pipeline_flags(args: argparse.Namespace, name: str) -> list[str]:
  """The example's flags of schedule `name`'s runs: its stages, its order and with
  --threads a dispatch thread per stage."""
  return ["--pipeline", str(args.stages), "--schedule", name,
          *(["--pipeline-threads"] if args.threads else [])]


def busy(args: argparse.Namespace, name: str) -> dict[str, Any]:
  """Schedule `name`'s stages' busy time from a profiler trace (`busy_run`, in a fresh
  process of this script), with the process's wall time (printed)."""
  result = args.out / name / "busy.json"
  command = [sys.executable, "-m", "benchmarks.llama_pipeline", "--busy-child", str(result),
             "--busy-steps", str(args.busy_steps), "--",
             *example_flags(args, args.out / name / "busy-run",
                            *pipeline_flags(args, name))]
  wall = harness.run_checked(command, ROOT)
  found = json.loads(result.read_text())
  print(f"{name} --busy: stages busy {_percents(found['busy_percent'])}% of "
        f"{found['step_ms']} ms steps ({wall} s)", flush=True)
  return {**found, "wall_seconds": wall}


def busy_run(argv: list[str], steps: int) -> dict[str, Any]:
  """In this process, the example's pipeline step for `argv` (`build`, as its `main`
  builds it), a warm-up round of steps, then `steps` steps under the
  profiler: per stage, the union of its GPU's kernels but copies (`trace_summary`'s busy
  time) against the steps' wall time. CPU devices leave no kernels in a trace: no stages."""
  from benchmarks import profiling
  from benchmarks.llama_fsdp import trace_summary
  from examples.llama import train as example
  from examples.llama.data import step_batches

  built = example.build(example.parse(argv))
  preset, corpus, captured, stages = built.preset, built.corpus, built.captured, built.stages
  state, step = [built.params, built.opt_state], 0

  def run(count: int) -> Any:
    nonlocal step
    loss = None
    for _ in range(count):
      step += 1
      state[0], state[1], loss = built.trainer.step(
          *state, step_batches(corpus, step, preset.microbatches), captured.positions)
    return loss

  jax.block_until_ready(run(preset.round_steps))
  trace = trace_summary(profiling.record_trace(lambda: run(steps)), steps)
  by_id = {int(found.group(1)): gpu for name, gpu in trace["gpus"].items()
           if (found := re.search(r"GPU:(\d+)", name))}  # rows named /device:GPU:<id>
  gpus = [by_id.get(device.id) for device in stages.devices]
  return {"step_ms": trace["step_ms"], "busy_ms": [g and g["busy_ms"] for g in gpus],
          "busy_percent": [g and round(100 * g["busy_ms"] / trace["step_ms"], 1)
                           for g in gpus]}


def _ms(seconds: float | None) -> float | str:
  return "-" if seconds is None else round(1e3 * seconds, 2)


def _percents(values: Sequence[float | None]) -> str:
  return "/".join("-" if v is None else str(v) for v in values)


def _peak_gib(peaks: Sequence[int | None]) -> float | str:
  found = [p for p in peaks if p]
  return round(max(found) / 2**30, 2) if found else "-"


def row(args: argparse.Namespace, run: dict[str, Any], base: dict[str, Any],
        fsdp: dict[str, Any]) -> dict[str, Any]:
  """One schedule's row: its tokens/s against its bound and FSDP's, memory, spread, host
  time."""
  pipeline, loop = run["pipeline"], run["throughput"]["loop"]
  tok_s = run["tokens_per_second"]
  bubble = schedule.bubble_fraction(pipeline["order"], stages=args.stages)
  bound = args.stages * base["tokens_per_second"] * (1 - bubble)
  host, step = loop["host_seconds_per_step"], loop["step_seconds"]
  threads = loop.get("thread_seconds_per_step")
  return {"preset": args.preset, "n": args.stages, "schedule": pipeline["schedule"],
          "fuse": args.fuse or False, "threads": pipeline.get("threads", False),
          "microbatches": args.microbatches,
          "tok_s": round(tok_s), "bubble": bubble,
          "bound": round(bound), "ratio": round(tok_s / bound, 3),
          "fsdp_tok_s": round(fsdp["tokens_per_second"]),
          "peak_gib": _peak_gib([s["peak_bytes"] for s in pipeline["per_stage"]]),
          "spread": round(100 * (max(loop["rounds"]) - min(loop["rounds"])) / tok_s, 1),
          "host_ms": _ms(host), "step_ms": _ms(step), "host_step": round(host / step, 3),
          "thread_ms": None if threads is None else "/".join(str(_ms(t)) for t in threads),
          "fsdp_peak_gib": _peak_gib([fsdp.get("peak_bytes")]),
          "fsdp_host_ms": _ms(fsdp["throughput"]["loop"]["host_seconds_per_step"]),
          "fsdp_step_ms": _ms(fsdp["throughput"]["loop"]["step_seconds"]),
          "one_device_tok_s": round(base["tokens_per_second"]),
          "per_stage": pipeline["per_stage"], "command": run["command"],
          "wall_seconds": run["wall_seconds"]}


RECORD_KEYS = ("preset", "n", "schedule", "fuse", "threads", "microbatches", "tok_s", "bound",
               "ratio",
               "fsdp_tok_s", "peak_gib", "spread", "host_ms", "step_ms", "fsdp_peak_gib")


def record_lines(rows: list[dict[str, Any]], device: str, command: str, commit: str
                 ) -> list[str]:
  """docs/results/pipeline-gpu.txt's lines: the run's facts, then a `row` line per row
  (with --threads, `thread_ms=` each stage's dispatch thread's CPU ms a step; with --busy,
  `busy=` each stage's busy percent; stage 0 first)."""
  lines = [f"commit {commit}", f"device {device}", f"jax {jax.__version__}",
           f"xla_flags {os.environ.get('XLA_FLAGS') or '(none)'}",
           f"date {datetime.date.today().isoformat()}", f"command {command}"]
  for r in rows:
    fields = [f"{k}={r[k]}{'%' if k == 'spread' else ''}" for k in RECORD_KEYS]
    if r["thread_ms"] is not None:
      fields.append(f"thread_ms={r['thread_ms']}")
    if "busy" in r:
      fields.append(f"busy={_percents(r['busy']['busy_percent'])}%")
    lines.append("row " + " ".join(fields))
  return lines


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="gpu-1b")
  parser.add_argument("--stages", type=int, default=4)
  parser.add_argument("--microbatches", type=int, default=16)
  parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=["1f1b"])
  parser.add_argument("--fuse", nargs="?", const=True, type=fuse_length, metavar="K",
                      help="every run with the example's --fuse [K]: the layers of each chunk "
                           "(or of the one device, or FSDP's) as one fused forward and backward "
                           "(or segments of at most K layers)")
  parser.add_argument("--threads", action="store_true",
                      help="the pipeline runs with the example's --pipeline-threads: each "
                           "stage dispatched from a thread of its own")
  parser.add_argument("--steps", type=int, help="per run (default: 3 rounds)")
  parser.add_argument("--round-steps", type=int, default=4)
  parser.add_argument("--busy", action="store_true",
                      help="also profile each schedule's steps in a process of its own: each "
                           "stage's GPU busy time against the step (GPUs)")
  parser.add_argument("--busy-steps", type=int, default=2, help="steps profiled for --busy")
  parser.add_argument("--cache", type=pathlib.Path, default=ROOT / "runs" / "cache")
  parser.add_argument("--out", type=pathlib.Path)
  parser.add_argument("--record", type=pathlib.Path)
  parser.add_argument("--commit", default="(unknown)")
  parser.add_argument("--busy-child", type=pathlib.Path, help=argparse.SUPPRESS)
  args, rest = parser.parse_known_args(argv)
  if args.busy_child is not None:  # --busy's process: the example's flags after "--"
    write_json(args.busy_child, busy_run(rest[rest.index("--") + 1:], args.busy_steps))
    return
  if rest:
    parser.error(f"unrecognized arguments: {' '.join(rest)}")
  if args.out is None:
    parser.error("--out is required: the runs' folders and llama_pipeline.json go there")
  args.steps = args.steps or 3 * args.round_steps
  command = shlex.join(["python3", "-m", "benchmarks.llama_pipeline", *(argv or sys.argv[1:])])
  begin = time.perf_counter()
  build_cache(args.preset, args.cache)
  print(f"vocabulary and ids in {args.cache} ({time.perf_counter() - begin:.1f} s)", flush=True)
  base = train(args, "one-device")
  fsdp = train(args, f"fsdp-{args.stages}", "--fsdp", str(args.stages))
  # the parent starts no backend (on GPUs it would take the runs' memory): the runs name it
  device = f"{base['device_kind']}, {args.stages} of them"
  found: dict[str, Any] = {"command": command, "one_device": base, "fsdp": fsdp, "rows": []}
  for name in args.schedules:
    run = train(args, name, *pipeline_flags(args, name))
    r = row(args, run, base, fsdp)
    if args.busy:
      r["busy"] = busy(args, name)
    found["rows"].append(r)
    print(f"{name} (fuse={r['fuse']}, threads={r['threads']}): {r['tok_s']:,} tok/s, "
          f"bound {r['bound']:,} "
          f"(bubble {r['bubble']:.3f}), ratio {r['ratio']}, FSDP {r['fsdp_tok_s']:,} tok/s, "
          f"peak {r['peak_gib']} GiB (FSDP {r['fsdp_peak_gib']}), spread {r['spread']}%, "
          f"host/step {r['host_ms']}/{r['step_ms']} ms ({r['host_step']})"
          + ("" if r["thread_ms"] is None else f", threads {r['thread_ms']} ms"), flush=True)
    write_json(args.out / "llama_pipeline.json", found)
    if args.record:  # after every row: a run cut short keeps what is done
      args.record.write_text("\n".join(record_lines(found["rows"], device, command,
                                                    args.commit)) + "\n")
  print(f"all runs: {time.perf_counter() - begin:.1f} s", flush=True)


if __name__ == "__main__":
  main()
