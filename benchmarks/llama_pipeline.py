"""The Llama example by stages against its bubble's bound: tokens/s of `--pipeline N`.

  python3 -m benchmarks.llama_pipeline --preset gpu-1b --stages 4 --microbatches 16 \\
      --schedules 1f1b zero-bubble --record docs/results/pipeline-gpu.txt --out /tmp/pp
  JAX_PLATFORMS=cpu python3 -m benchmarks.llama_pipeline --preset tiny --stages 2 \\
      --microbatches 4 --steps 4 --round-steps 1 --out /tmp/pp      # CPU smoke: virtual devices

Runs the example (`python -m examples.llama.train`) in fresh processes, each into its own
`--out` under this one's: first on one device (no `--pipeline`: the baseline), then once per
schedule with `--pipeline N`, every run with the same preset, `--microbatches M` and steps,
without `--check` or generation. A run's tokens/s is the training loop's own (metrics.json
`tokens_per_second`: the median of its rounds of `--round-steps` steps after a warm-up round;
evaluation and checkpoints not counted), so `--steps` must hold at least two rounds.

The bound of a schedule is what N stages give when a stage computes as fast as the one-device
run and idles only in the order's bubble: N x the baseline's tokens/s x (1 - bubble), the
bubble being the orders' idle fraction of a stage (`bubble_fraction`, simulated: (N - 1) /
(M + N - 1) for 1F1B). Prints a table; writes llama_pipeline.json to --out and, with
--record, the rows as `key value` facts (commit, device, jax, xla_flags, date, command) and
one `row key=value ...` line per schedule.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time
from typing import Any

import jax

from examples.records import write_json
from jaxgraph import schedule

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCHEDULES = ("1f1b", "interleaved", "zero-bubble")


def rank_orders(name: str, stages: int, microbatches: int) -> list[list[float]]:
  """Each rank's order under `--schedule name`, as the example builds them."""
  if name == "1f1b":
    return [schedule.one_f_one_b(microbatches, pipeline_parallel_size=stages, rank=r)
            for r in range(stages)]
  if name == "zero-bubble":
    return [schedule.zero_bubble(microbatches, pipeline_parallel_size=stages, rank=r)
            for r in range(stages)]
  return [schedule.interleaved_1f1b(microbatches, 2, pipeline_parallel_size=stages, rank=r)
          for r in range(stages)]


def bubble_fraction(name: str, stages: int, microbatches: int) -> float:
  """The idle fraction of a stage under the schedule's orders, simulated: each rank runs its
  order's entries in turn, a forward of a chunk costing 1, its backward 2 (a zero-bubble
  dgrad 1 and its wgrad 1), an entry starting once its rank is free and its input is done
  (the chunk before's forward; the chunk after's backward, the last chunk's own forward; a
  wgrad its dgrad). 1F1B gives the textbook (N - 1) / (M + N - 1)."""
  orders = rank_orders(name, stages, microbatches)
  chunks = max(abs(int(e)) for order in orders for e in order) * stages
  done: dict[tuple[str, int, int], float] = {}
  seen: list[dict[tuple[str, int], int]] = [{} for _ in orders]
  pending_w: list[list[tuple[int, int]]] = [[] for _ in orders]
  free, position, busy = [0.0] * stages, [0] * stages, [0.0] * stages
  while any(position[r] < len(orders[r]) for r in range(stages)):
    progressed = False
    for r, order in enumerate(orders):
      if position[r] == len(order):
        continue
      entry = order[position[r]]
      if entry == -1.5:  # the oldest dgrad's weight gradient
        g, m = pending_w[r][0]
        kind, cost, needs = "w", 1.0, ("b", g, m)
      else:
        v = abs(int(entry))
        g = (v - 1) * stages + r
        kind = "f" if entry > 0 else "b"
        m = seen[r].get((kind, v), 0)
        cost = 1.0 if kind == "f" else (1.0 if name == "zero-bubble" else 2.0)
        needs = (("f", g - 1, m) if g else None) if kind == "f" else (
            ("b", g + 1, m) if g + 1 < chunks else ("f", g, m))
      if needs is not None and needs not in done:
        continue
      start = max(free[r], done[needs] if needs else 0.0)
      free[r] = done[(kind, g, m)] = start + cost
      busy[r] += cost
      if kind == "w":
        pending_w[r].pop(0)
      else:
        seen[r][(kind, v)] = m + 1
        if kind == "b" and name == "zero-bubble":
          pending_w[r].append((g, m))
      position[r] += 1
      progressed = True
    if not progressed:
      raise ValueError(f"the {name} orders deadlock in the simulation")
  return 1 - busy[0] / max(free)


def train(args: argparse.Namespace, out: pathlib.Path, *flags: str) -> dict[str, Any]:
  """One run of the example into `out`; its metrics.json, with the command and wall time."""
  command = [sys.executable, "-m", "examples.llama.train", "--preset", args.preset,
             "--microbatches", str(args.microbatches), "--no-check", "--generate", "0",
             "--cache", str(args.cache), "--out", str(out), "--fresh", *flags]
  if args.steps:
    command += ["--steps", str(args.steps)]
  if args.round_steps:
    command += ["--round-steps", str(args.round_steps)]
  begin = time.perf_counter()
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
  wall = round(time.perf_counter() - begin, 1)
  if done.returncode:
    raise RuntimeError(f"{shlex.join(command[1:])} exited {done.returncode}:\n"
                       f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
  metrics = json.loads((out / "metrics.json").read_text())
  return {**metrics, "command": shlex.join(["python3", *command[1:]]), "wall_seconds": wall}


def row(args: argparse.Namespace, name: str, run: dict[str, Any], base: dict[str, Any]
        ) -> dict[str, Any]:
  """One schedule's row: its tokens/s against its bound, memory, spread."""
  rounds = run["throughput"]["loop"]["rounds"]
  tok_s = run["tokens_per_second"]
  bubble = bubble_fraction(name, args.stages, args.microbatches)
  bound = args.stages * base["tokens_per_second"] * (1 - bubble)
  peaks = [s["peak_bytes"] for s in run["pipeline"]["per_stage"] if s["peak_bytes"]]
  return {"preset": args.preset, "n": args.stages, "schedule": name,
          "microbatches": args.microbatches, "tok_s": round(tok_s), "bubble": bubble,
          "bound": round(bound),
          "ratio": round(tok_s / bound, 3), "fsdp_tok_s": "-",
          "peak_gib": round(max(peaks) / 2**30, 2) if peaks else "-",
          "spread": round(100 * (max(rounds) - min(rounds)) / tok_s, 1),
          "one_device_tok_s": round(base["tokens_per_second"]),
          "per_stage": run["pipeline"]["per_stage"], "command": run["command"],
          "wall_seconds": run["wall_seconds"]}


def record_lines(rows: list[dict[str, Any]], command: str, commit: str) -> list[str]:
  """docs/results/pipeline-gpu.txt's lines: the run's facts, then a `row` line per row."""
  device = jax.devices()[0].device_kind
  lines = [f"commit {commit}", f"device {device}, {jax.device_count()} of them",
           f"jax {jax.__version__}", f"xla_flags {os.environ.get('XLA_FLAGS') or '(none)'}",
           f"date {datetime.date.today().isoformat()}", f"command {command}"]
  keys = ("preset", "n", "schedule", "microbatches", "tok_s", "bound", "ratio", "fsdp_tok_s",
          "peak_gib", "spread")
  for r in rows:
    lines.append("row " + " ".join(f"{k}={r[k]}{'%' if k == 'spread' else ''}" for k in keys))
  return lines


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="gpu-1b")
  parser.add_argument("--stages", type=int, default=4)
  parser.add_argument("--microbatches", type=int, default=16)
  parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=["1f1b"])
  parser.add_argument("--steps", type=int, help="per run (default: 3 rounds)")
  parser.add_argument("--round-steps", type=int, default=4)
  parser.add_argument("--cache", type=pathlib.Path, default=ROOT / "runs" / "cache")
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--record", type=pathlib.Path)
  parser.add_argument("--commit", default="(unknown)")
  args = parser.parse_args(argv)
  args.steps = args.steps or 3 * args.round_steps
  command = shlex.join(["python3", "-m", "benchmarks.llama_pipeline", *(argv or sys.argv[1:])])
  base = train(args, args.out / "one-device")
  print(f"one device: {base['tokens_per_second']:,.0f} tok/s", flush=True)
  rows = []
  for name in args.schedules:
    run = train(args, args.out / name, "--pipeline", str(args.stages), "--schedule", name)
    rows.append(row(args, name, run, base))
    r = rows[-1]
    print(f"{name}: {r['tok_s']:,} tok/s, bound {r['bound']:,} (bubble {r['bubble']:.3f}), "
          f"ratio {r['ratio']}, peak {r['peak_gib']} GiB, spread {r['spread']}%", flush=True)
    write_json(args.out / "llama_pipeline.json",
               {"command": command, "one_device": base, "rows": rows})
    if args.record:  # after every row: a run cut short keeps what is done
      args.record.write_text("\n".join(record_lines(rows, command, args.commit)) + "\n")


if __name__ == "__main__":
  main()
