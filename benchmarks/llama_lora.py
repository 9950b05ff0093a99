"""LoRA against full fine-tuning in the Llama example: tokens/s and peak memory from one start.

  python3 -m benchmarks.llama_lora --preset gpu --out /tmp/llama-lora   # one GPU
  python3 -m benchmarks.llama_lora --preset tiny --base-steps 10 --steps 9 \\
      --repeats 1 --out /tmp/ll                                                # CPU smoke run

First a base run (`examples/llama/train.py --preset P --steps BASE`), then `--repeats` pairs
of fine-tuning runs from its last checkpoint (`--init-from`), each in a fresh process and
its own `--out`: "full" trains every param, "lora" rank-`--rank` adapters only (`--lora`),
the pair's order alternated from one repeat to the next (`--variants lora`: LoRA runs only,
for their memory). Each run's tokens/s is the
training loop's own (metrics.json `tokens_per_second`: the median of its rounds of the
preset's `round_steps` steps after a warm-up round; evaluation and checkpoints not
counted), so `--steps` must hold at least two rounds. No `--check`, no generation.

The table gives, per variant, the median over repeats of the runs' tokens/s and its spread
(max - min, in % of the median), the peak device memory (GPUs), the capture seconds, the
trained params and the held-out loss at the end, and the lora / full ratio of each repeat's
pair. Writes llama_lora.json to --out after every run (a run cut short keeps what is done).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from typing import Any

from benchmarks import harness
from examples.llama.presets import PRESETS

ROOT = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = ("full", "lora")


def train(args: argparse.Namespace, out: pathlib.Path, *flags: str) -> dict[str, Any]:
  """One run of the example into `out`; its metrics.json, with the command and wall time."""
  command = [sys.executable, "-m", "examples.llama.train", "--preset", args.preset, "--no-check",
             "--generate", "0", "--cache", str(args.cache), "--out", str(out), *flags]
  wall = harness.run_checked(command, ROOT)
  metrics = json.loads((out / "metrics.json").read_text())
  return {**metrics, "command": " ".join(["python3", *command[1:]]), "wall_seconds": wall}


def record(variant: str, repeat: int, metrics: dict[str, Any]) -> dict[str, Any]:
  """What the table needs of one fine-tuning run."""
  tuned = metrics.get("fine_tuning", {})
  return {"variant": variant, "repeat": repeat, "tok_s": metrics["tokens_per_second"],
          "rounds_tok_s": metrics["throughput"]["loop"]["rounds"],
          "peak_bytes": metrics.get("peak_bytes"), "capture_seconds": metrics["capture_seconds"],
          "trained_params": tuned.get("trained_params", metrics["params"]),
          "params": metrics["params"], "final_eval_loss": metrics["eval_losses"][-1][1],
          "base_unchanged": (tuned["base_params_sha256_after"] == tuned["base_params_sha256"]
                             if "base_params_sha256_after" in tuned else None),
          "command": metrics["command"], "wall_seconds": metrics["wall_seconds"]}


def table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per variant: the median over repeats and its spread; the lora / full ratio per repeat."""
  rows = []
  for variant in VARIANTS:
    mine = [r for r in runs if r["variant"] == variant and r["tok_s"]]
    if not mine:
      continue
    rates = [r["tok_s"] for r in mine]
    median = statistics.median(rates)
    peaks = [r["peak_bytes"] for r in mine if r["peak_bytes"] is not None]
    rows.append({"variant": variant, "tok_s": round(median, 1),
                 "spread_percent": round(100 * (max(rates) - min(rates)) / median, 1),
                 "repeats": len(rates),
                 "peak_GiB": round(max(peaks) / 2**30, 2) if peaks else None,
                 "capture_s": round(statistics.median(r["capture_seconds"] for r in mine), 1),
                 "trained_params": mine[0]["trained_params"],
                 "final_eval_loss": round(statistics.median(r["final_eval_loss"] for r in mine),
                                          4)})
  pairs = {}
  for r in runs:
    pairs.setdefault(r["repeat"], {})[r["variant"]] = r["tok_s"]
  ratios = [p["lora"] / p["full"] for p in pairs.values()
            if p.get("lora") and p.get("full")]
  if ratios and len(rows) == 2:
    rows[1]["vs_full"] = round(statistics.median(ratios), 3)
    rows[1]["vs_full_each"] = [round(x, 3) for x in ratios]
  return rows


def print_table(rows: list[dict[str, Any]]) -> None:
  print(f"{'variant':8} {'tok/s':>12} {'spread':>7} {'vs full':>8} {'peak GiB':>9} "
        f"{'capture s':>10} {'trained params':>15} {'held-out':>9}")
  for row in rows:
    ratio = f"{row['vs_full']:.3f}" if "vs_full" in row else ""
    peak = "" if row["peak_GiB"] is None else f"{row['peak_GiB']:.2f}"
    print(f"{row['variant']:8} {row['tok_s']:>12,.0f} {row['spread_percent']:>6.1f}% "
          f"{ratio:>8} {peak:>9} {row['capture_s']:>10.1f} {row['trained_params']:>15,} "
          f"{row['final_eval_loss']:>9.4f}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="gpu", choices=sorted(PRESETS),
                      help="the example's --preset")
  parser.add_argument("--base-steps", type=int, default=50,
                      help="steps of the base run (it checkpoints at its last)")
  parser.add_argument("--steps", type=int, default=200, help="steps of each fine-tuning run")
  parser.add_argument("--rank", type=int, default=16, help="the lora runs' --lora")
  parser.add_argument("--repeats", type=int, default=3, help="pairs of full and lora runs")
  parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                      help="the fine-tuning runs of each repeat (default: both)")
  parser.add_argument("--cache", type=pathlib.Path, default=ROOT / "runs" / "cache",
                      help="the example's tokenizers and encoded texts (its --cache)")
  parser.add_argument("--out", type=pathlib.Path, default=ROOT / "runs" / "llama-lora")
  args = parser.parse_args()
  round_steps = PRESETS[args.preset].round_steps
  if args.steps < 2 * round_steps:
    parser.error(f"--steps {args.steps} times no round: the preset's tokens/s needs a warm-up "
                 f"round and a timed one of {round_steps} steps, at least {2 * round_steps}")
  args.out.mkdir(parents=True, exist_ok=True)
  if any(args.out.iterdir()):
    parser.error(f"--out {args.out} is not empty: every run writes a folder there; give a new "
                 "or empty one")

  result: dict[str, Any] = {"preset": args.preset, "rank": args.rank,
                            "base_steps": args.base_steps, "steps": args.steps, "runs": []}
  base = args.out / "base"
  metrics = train(args, base, "--steps", str(args.base_steps))
  result["base"] = {"command": metrics["command"], "params_sha256": metrics["params_sha256"],
                    "final_eval_loss": metrics["eval_losses"][-1][1]}
  flags = {"full": (), "lora": ("--lora", str(args.rank))}
  for repeat in range(args.repeats):
    order = [v for v in VARIANTS if v in args.variants]
    order = order if repeat % 2 == 0 else order[::-1]
    for variant in order:
      metrics = train(args, args.out / f"{variant}-{repeat}", "--steps", str(args.steps),
                      "--init-from", str(base), *flags[variant])
      result["runs"].append(record(variant, repeat, metrics))
      result["table"] = table(result["runs"])
      (args.out / "llama_lora.json").write_text(json.dumps(result, indent=1))
      print(f"[{variant} {repeat}] {metrics['tokens_per_second']:,.0f} tok/s", flush=True)
  print_table(result["table"])
  print(json.dumps(result["table"]))


if __name__ == "__main__":
  main()
