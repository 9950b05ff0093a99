"""Where a prefetching FSDP chain's executables do more device work than the plain ones.

Builds the Llama example's step as `benchmarks/llama_fsdp.py` builds a row `PRESET:N`
(the preset's batch times N, `--fsdp N`), twice: with `--prefetch` and with `--no-prefetch`,
and the sharded whole-step `jax.jit` they are timed against (`WholeStep`); dropout off, as
`gpu-1b` has it. Runs one microbatch of each graphed step (that captures its executables;
nothing is timed), then per compiled executable prints:

  flops, bytes accessed      `compiled.cost_analysis()` (XLA's own count, per device);
  args/out/temp MB           `compiled.memory_analysis()`, per device;
  ops                        instructions of the optimized HLO (`compiled.as_text()`, all
                             computations) by kind, for the kinds that move bytes without
                             compute: copy, convert, transpose, concatenate, slices, dynamic
                             (update) slices, bitcast-convert, the collectives; each with
                             the MB its results write (per device, shapes as XLA types them);
  fusion kinds               fusions by kind (loop, input, output, custom: a GEMM epilogue),
                             and the MB that the fusion roots write;

and a per-step sum: each block executable times its calls a step (one forward and one
backward per block and microbatch), against the whole step's executable (which also holds
the ends, the accumulation and the optimizer update: compare the differences between the
graphed variants first, then against the whole step).

and each prefetching block executable against the plain block's of the same direction
(flops, bytes accessed, and the ops whose count or MB differ).

The HLO is the backend's: on a CPU XLA:CPU's (collectives run in float32, a reduce-scatter
is an all-reduce and a dynamic-slice, bfloat16 dots run in float32), on GPUs XLA:GPU's, the
one the timings come from. The platform-independent program is the HLO right after SPMD
partitioning; XLA dumps it with
`XLA_FLAGS="... --xla_dump_to=DIR --xla_dump_hlo_module_re=forward|backward
--xla_dump_hlo_pass_re=spmd-partitioning"` (`*.after_spmd-partitioning.*.txt`).

  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu PYTHONPATH=. \\
      python3 -m benchmarks.probes.prefetch_hlo --preset cpu --fsdp 4          # seconds
  PYTHONPATH=. python3 -m benchmarks.probes.prefetch_hlo --preset gpu-1b --fsdp 4 \\
      --out /tmp/prefetch_hlo                                                  # 4 GPUs

With --out DIR it writes prefetch_hlo.json and each executable's optimized HLO there.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import tempfile
from typing import Any

import jax

from examples.llama import train
from examples.llama.data import step_batches
from examples.llama.fsdp_report import named_executables
from examples.llama.presets import PRESETS
from examples.llama.whole_step import WholeStep

# the instructions that move bytes without compute, and the collectives
KINDS = ("copy", "convert", "transpose", "concatenate", "slice", "dynamic-slice",
         "dynamic-update-slice", "bitcast-convert", "pad", "broadcast",
         "all-gather", "all-gather-start", "reduce-scatter", "all-reduce", "all-reduce-start",
         "collective-permute", "async-start", "copy-start")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+([a-z][a-z\-]*)\((.*)$")
SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([\d,]*)\]")
BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
         "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
FUSION_KIND = re.compile(r"kind=k(\w+)")


def shape_bytes(text: str) -> int:
  """The bytes of every array shape written in `text` (a result type, maybe a tuple)."""
  total = 0
  for dtype, dims in SHAPE.findall(text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * BYTES[dtype]
  return total


def hlo_ops(text: str) -> dict[str, Any]:
  """Per instruction kind of KINDS (and fusions by kind): count, MB of results, dtypes.
  Instructions inside fusion computations are counted under `in fusions`: they write no
  memory of their own."""
  top: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
  inner: dict[str, int] = collections.Counter()
  fusions: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
  dtypes: dict[str, set[str]] = collections.defaultdict(set)
  in_fusion = False
  for line in text.splitlines():
    if line and not line[0].isspace():  # a computation's header
      in_fusion = "fused" in line.split("(")[0] or "fusion" in line.split("(")[0]
      continue
    found = INSTRUCTION.match(line)
    if found is None:
      continue
    result, op = found.group(1), found.group(2)
    if in_fusion:
      if op in KINDS:
        inner[op] += 1
      continue
    if op == "fusion":
      kind = FUSION_KIND.search(line)
      entry = fusions[kind.group(1) if kind else "?"]
      entry[0] += 1
      entry[1] += shape_bytes(result) / 1e6
    elif op in KINDS:
      top[op][0] += 1
      top[op][1] += shape_bytes(result) / 1e6
      dtypes[op].update(d for d, _ in SHAPE.findall(result))
  return {"ops": {k: {"n": v[0], "mb": round(v[1], 3), "dtypes": sorted(dtypes[k])}
                  for k, v in sorted(top.items())},
          "fusions": {k: {"n": v[0], "mb": round(v[1], 3)} for k, v in sorted(fusions.items())},
          "in_fusions": dict(sorted(inner.items()))}


def summary(compiled: Any) -> dict[str, Any]:
  """cost_analysis, memory_analysis and the HLO op counts of one executable."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  memory = compiled.memory_analysis()
  return {"flops": float(cost.get("flops", 0.0)),
          "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
          "args_mb": memory.argument_size_in_bytes / 1e6,
          "out_mb": memory.output_size_in_bytes / 1e6,
          "alias_mb": memory.alias_size_in_bytes / 1e6,
          "temp_mb": memory.temp_size_in_bytes / 1e6,
          **hlo_ops(compiled.as_text())}


def build_row(preset: str, n: int, prefetch: bool, whole: bool, out: pathlib.Path
              ) -> dict[str, Any]:
  """One variant of the row: its graphed step's executables captured by one microbatch
  (and with `whole`, the whole step's), summarized."""
  argv = ["--preset", preset, "--batch", str(PRESETS[preset].batch * n), "--out", str(out),
          "--generate", "0", "--dropout", "0",
          "--prefetch" if prefetch else "--no-prefetch"]
  args = train.parse(argv + (["--fsdp", str(n)] if n > 1 else []))
  built = train.build(args)
  trainer, params, positions = built.trainer, built.params, built.captured.positions
  tokens, targets = built.corpus.batch_at(0)
  jax.block_until_ready(trainer.microbatch(params, tokens, targets, positions))
  found: dict[str, dict[str, Any]] = {}
  texts: dict[str, str] = {}
  for name, compiled in named_executables(trainer.layers):  # a shared one once per layer
    if name not in found:
      found[name] = {"calls": 0, **summary(compiled)}
      texts[name] = compiled.as_text()
    found[name]["calls"] += 1  # per microbatch
  result = {"microbatches": built.preset.microbatches, "executables": found}
  if whole:
    placement = built.placement
    whole_step = WholeStep(built.fns, built.model.config, built.tx, built.preset.microbatches,
                           trainer.streams(), not args.plain_ends,
                           *placement.abstract((params, built.opt_state)),
                           step_batches(built.corpus, 0, built.preset.microbatches),
                           positions, built.policy, placement)
    result["whole step"] = summary(whole_step.compiled)
    texts["whole step"] = whole_step.compiled.as_text()
  result["texts"] = texts
  return result


def per_step(row: dict[str, Any]) -> dict[str, float]:
  """Flops and bytes accessed of the graphed executables over a step: every executable
  `named_executables` lists runs once per microbatch (a shared one comes once per layer)."""
  total: dict[str, float] = collections.Counter()
  for name, s in row["executables"].items():
    calls = s["calls"] * row["microbatches"]
    for part in ("all", "blocks") if "Block" in name else ("all",):
      total[f"{part} flops"] += s["flops"] * calls
      total[f"{part} bytes"] += s["bytes_accessed"] * calls
  return dict(total)


def table(rows: dict[str, dict[str, Any]]) -> None:
  """Prints each variant's executables, then the per-step sums."""
  for variant, row in rows.items():
    print(f"\n== {variant}")
    items = list(row["executables"].items())
    if "whole step" in row:
      items.append(("whole step", row["whole step"]))
    for name, s in items:
      ops = ", ".join(f"{k} {v['n']} ({v['mb']:.3f} MB {'/'.join(v['dtypes'])})"
                      for k, v in s["ops"].items())
      fusions = ", ".join(f"{k} {v['n']} ({v['mb']:.3f} MB)" for k, v in s["fusions"].items())
      calls = f" (x{s['calls']} a microbatch)" if "calls" in s else ""
      print(f"{name}{calls}: {s['flops'] / 1e9:.4f} GFLOP, {s['bytes_accessed'] / 1e6:.3f} MB "
            f"accessed; args {s['args_mb']:.3f} out {s['out_mb']:.3f} alias "
            f"{s['alias_mb']:.3f} temp {s['temp_mb']:.3f} MB\n    ops: {ops}\n"
            f"    fusions: {fusions}\n    inside fusions: {s['in_fusions']}")
  print("\n== per step (graphed: the executables above times the microbatches)")
  for variant, row in rows.items():
    step = per_step(row)
    print(f"{variant}: {step['all flops'] / 1e9:.4f} GFLOP, {step['all bytes'] / 1e6:.3f} MB "
          f"accessed; the blocks' {step['blocks flops'] / 1e9:.4f} GFLOP, "
          f"{step['blocks bytes'] / 1e6:.3f} MB")
    if "whole step" in row:
      w = row["whole step"]
      print(f"whole step: {w['flops'] / 1e9:.4f} GFLOP, {w['bytes_accessed'] / 1e6:.3f} MB "
            "accessed (with the ends, accumulation and update)")


def differences(rows: dict[str, dict[str, Any]]) -> None:
  """Prints each prefetching block executable minus the plain block's of its direction."""
  plain = {name.rsplit(" ", 1)[1]: s for name, s in rows["no-prefetch"]["executables"].items()
           if name.startswith("Block")}
  print("\n== prefetch minus no-prefetch, per block executable")
  for name, s in rows["prefetch"]["executables"].items():
    if not name.startswith("prefetch("):
      continue
    base = plain[name.rsplit(" ", 1)[1]]
    ops = []
    for kind in sorted(set(s["ops"]) | set(base["ops"])):
      a = s["ops"].get(kind, {"n": 0, "mb": 0.0})
      b = base["ops"].get(kind, {"n": 0, "mb": 0.0})
      if a["n"] != b["n"] or abs(a["mb"] - b["mb"]) > 1e-3:
        ops.append(f"{kind} {a['n'] - b['n']:+d} ({a['mb'] - b['mb']:+.3f} MB)")
    print(f"{name}: {(s['flops'] - base['flops']) / 1e9:+.4f} GFLOP, "
          f"{(s['bytes_accessed'] - base['bytes_accessed']) / 1e6:+.3f} MB accessed, out "
          f"{s['out_mb'] - base['out_mb']:+.3f} MB, temp {s['temp_mb'] - base['temp_mb']:+.3f} "
          f"MB; ops: {', '.join(ops) or 'the same'}")


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
  parser.add_argument("--fsdp", type=int, default=4, help="devices (the row's N)")
  parser.add_argument("--out", type=pathlib.Path, help="prefetch_hlo.json and the HLO texts")
  options = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as scratch:
    rows = {"prefetch": build_row(options.preset, options.fsdp, True, True,
                                  pathlib.Path(scratch) / "on"),
            "no-prefetch": build_row(options.preset, options.fsdp, False, False,
                                     pathlib.Path(scratch) / "off")}
  texts = {variant: row.pop("texts") for variant, row in rows.items()}
  table(rows)
  differences(rows)
  if options.out is not None:
    options.out.mkdir(parents=True, exist_ok=True)
    for variant, found in texts.items():
      for name, text in found.items():
        slug = re.sub(r"[^\w.]+", "_", f"{variant} {name}").strip("_")
        (options.out / f"{slug}.hlo.txt").write_text(text)
    (options.out / "prefetch_hlo.json").write_text(json.dumps(
        {"preset": options.preset, "fsdp": options.fsdp, "platform": jax.devices()[0].platform,
         "jax": jax.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
  main()
