"""Where the graphed Llama step's time goes, beside its whole-step jit: host or device.

  python3 -m benchmarks.probes.llama_breakdown --preset gpu --flat --out runs/breakdown
  python3 -m benchmarks.probes.llama_breakdown --preset tiny --rounds 2   # CPU smoke

Per variant (residual policy, packing threshold) it measures:
  - calls: one block's arrays per `vjp`, and host microseconds per call taken in bursts of a
    few calls after a sync (below the runtime's limit of in-flight executions, past which the
    host waits for the device and "host time" is device time), beside the device-paced time
    of many calls in a row;
  - step: graphed vs whole-step `jax.jit` tokens/s in alternating rounds, the host time to
    enqueue one microbatch after a sync, and each step part's host enqueue;
  - trace: a profiler trace of a few graphed and whole steps, reduced to GPU busy time per
    step, idle gaps, and kernel time by kind (GPU only).
A long graphed run with the GPU's clocks, power and throttle reasons logged beside it shows
whether the rate changes over the first hundreds of steps, and why. Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import itertools
import json
import os
import pathlib
import statistics
import subprocess
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks import harness, profiling

import jaxgraph as jg
from jaxgraph import _capture as capture_lib
from examples.corpus import Corpus
from examples.llama.data import make_corpus, step_batches
from examples.llama.layers import build_layers, split, tied_inputs
from examples.llama.model import Config, Llama
from examples.llama.presets import PRESETS
from examples.llama.trainer import Trainer, flat_group, optimizer
from examples.llama.whole_step import WholeStep, initial_streams

RECOMPUTE = jg.residuals.recompute_elementwise
VARIANTS = {
    # name: (remat policy, PACK_MAX_BYTES, sequential_vjp(fuse=...))
    "default": (None, None, False),
    "recompute": (RECOMPUTE, None, False),
    "pack-all": (None, 1 << 40, False),
    "recompute-pack-all": (RECOMPUTE, 1 << 40, False),
    "recompute-fuse": (RECOMPUTE, None, True),
}


@dataclasses.dataclass
class Setup:
  preset: Any
  config: Config
  corpus: Corpus
  fns: list[Any]
  params: list[Any]
  positions: jax.Array


def setup(preset_name: str, flat: bool, cache: pathlib.Path = pathlib.Path("runs/cache")
          ) -> Setup:
  """The preset's model, params and corpus (its vocabulary: the example's, cached in `cache`
  as the example's --cache)."""
  preset = PRESETS[preset_name]
  _, corpus = make_corpus(preset, 0, cache)
  config = Config(vocab=corpus.vocabulary.size, width=preset.width, depth=preset.depth,
                  heads=preset.heads, kv_heads=preset.kv_heads, hidden=preset.hidden,
                  dropout=preset.dropout, attention=preset.attention
                  if harness.attention(None) == "cudnn" else None)
  fns, params = split(Llama(config, rngs=nnx.Rngs(params=0)))
  if flat:
    params = [jg.flat.ravel(p, group=flat_group) for p in params]
  return Setup(preset, config, corpus, fns, params, jnp.arange(preset.context))


def build(s: Setup, variant: str) -> Trainer:
  policy, pack, fuse = VARIANTS[variant]
  if pack is not None:
    capture_lib.PACK_MAX_BYTES = pack
  tokens = jax.ShapeDtypeStruct((s.preset.batch, s.preset.context), jnp.int32)
  x = jax.ShapeDtypeStruct((s.preset.batch, s.preset.context, s.config.width),
                           s.config.compute_dtype)
  table = tied_inputs(s.params, s.config)
  sample_args = ([(s.params[0], tokens)] + [(p, x, s.positions) for p in s.params[1:-1]]
                 + [(s.params[-1], x, tokens, *table)])
  begin = time.perf_counter()
  layers = build_layers(s.fns, sample_args, graph_ends=True, rng=jax.random.key(0),
                              remat_policy=policy)
  capture_lib.PACK_MAX_BYTES = DEFAULT_PACK
  tx = optimizer(s.preset, 1000)
  trainer = Trainer(layers, s.config, tx, s.preset.microbatches, s.params, tx.init(s.params),
                    fuse=fuse)
  trainer.capture_seconds = time.perf_counter() - begin
  return trainer


def call_costs(s: Setup, trainer: Trainer, burst: int = 8, long: int = 40
               ) -> dict[str, Any]:
  """One block: arrays per vjp, host us per call in short bursts, device-paced us per call."""
  params = s.params
  tokens, _ = s.corpus.batch_at(0)
  embed, block = trainer.layers[0], trainer.layers[1]
  x = jax.block_until_ready(embed(params[0], tokens))
  p = params[1]
  before = len(jax.live_arrays())
  y, pullback = block.vjp(p, x, s.positions)
  jax.block_until_ready(y)
  arrays_per_vjp = len(jax.live_arrays()) - before
  ct = jnp.ones_like(y)
  jax.block_until_ready(pullback(ct))
  del pullback

  def host_burst(make: Any, run: Any) -> float:
    """Median host us of `run(item)` over `burst` items made (and synced) beforehand."""
    samples = []
    for _ in range(5):
      items = jax.block_until_ready(make())
      begin = time.perf_counter()
      outs = [run(item) for item in items]
      samples.append((time.perf_counter() - begin) / len(items) * 1e6)
      jax.block_until_ready(outs)
      del outs, items
    return statistics.median(samples)

  def paced(run: Any) -> float:
    jax.block_until_ready(run())
    begin = time.perf_counter()
    outs = [run() for _ in range(long)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - begin) / long * 1e6

  result = {"arrays_per_vjp": arrays_per_vjp,
            "inputs_per_call": len(jax.tree.leaves((p, x, s.positions)))}
  result["forward_host_us"] = host_burst(lambda: [None] * burst,
                                         lambda _: block(p, x, s.positions))
  result["vjp_host_us"] = host_burst(lambda: [None] * burst,
                                     lambda _: block.vjp(p, x, s.positions))
  pending: list[Any] = []

  def make_pullbacks():
    pending[:] = [block.vjp(p, x, s.positions)[1] for _ in range(burst)]
    return [None] * burst

  def run_backward(_):
    return pending.pop()(ct)

  result["backward_host_us"] = host_burst(make_pullbacks, run_backward)
  result["forward_paced_us"] = paced(lambda: block(p, x, s.positions))
  result["vjp_paced_us"] = paced(lambda: block.vjp(p, x, s.positions)[0])
  result["fwd_bwd_paced_us"] = paced(lambda: block.vjp(p, x, s.positions)[1](ct))
  result["residual_bytes"] = block.stats.residual_bytes
  return result


def whole_step(s: Setup, trainer: Trainer) -> WholeStep:
  """The whole-step jit, compiled; it draws its keys from the same streams on the device."""
  begin = time.perf_counter()
  whole = WholeStep(s.fns, s.config, trainer.tx, trainer.microbatches,
                          initial_streams(0, len(s.fns)), True, s.params,
                          trainer.tx.init(s.params),
                          step_batches(s.corpus, 0, trainer.microbatches), s.positions)
  print(f"whole step compiled in {time.perf_counter() - begin:.1f} s", flush=True)
  return whole


def step_rates(s: Setup, trainer: Trainer, whole: WholeStep, rounds: int,
               steps: int) -> dict[str, Any]:
  """Alternating rounds: tokens/s of graphed and whole step, and graphed host enqueue."""
  microbatches = trainer.microbatches
  tokens_per_step = microbatches * s.preset.batch * s.preset.context
  batches = [step_batches(s.corpus, i, microbatches) for i in range(8)]

  def run_graphed(state, i):
    return trainer.step(*state, batches[i % 8], s.positions)[:2]

  def run_whole(state, i):
    return whole.step(*state, batches[i % 8], s.positions)[:2]

  opt_state = trainer.tx.init(s.params)

  def timed_round(run: Any) -> tuple[float, float]:
    """Tokens/s over `steps` steps from a fresh state, and host ms to enqueue a step."""
    state = (jax.tree.map(jnp.copy, s.params), jax.tree.map(jnp.copy, opt_state))
    for i in range(3):  # settle, untimed
      state = run(state, i)
    jax.block_until_ready(state)
    begin = time.perf_counter()
    spent = 0.0
    for i in range(steps):
      mark = time.perf_counter()
      state = run(state, i)
      spent += time.perf_counter() - mark
    jax.block_until_ready(state)
    return steps * tokens_per_step / (time.perf_counter() - begin), spent / steps * 1e3

  found = harness.interleaved(rounds, {"graphed": lambda: timed_round(run_graphed),
                                       "whole_step": lambda: timed_round(run_whole)})
  rates = {name: [rate for rate, _ in found[name]] for name in found}
  graphed, whole_rate = harness.summary(rates["graphed"]), harness.summary(rates["whole_step"])
  return {"graphed_tok_s": graphed["median"], "graphed_spread_pct": graphed["spread_pct"],
          "whole_tok_s": whole_rate["median"], "whole_spread_pct": whole_rate["spread_pct"],
          "ratio": graphed["median"] / whole_rate["median"], "rounds": rates,
          "graphed_enqueue_ms_per_step": statistics.median([ms for _, ms in found["graphed"]])}


def microbatch_host(s: Setup, trainer: Trainer) -> dict[str, float]:
  """Host ms to enqueue one microbatch (26 calls, under the in-flight limit) after a sync."""
  tokens, targets = s.corpus.batch_at(1)
  samples = []
  for _ in range(5):
    jax.block_until_ready(s.params)
    begin = time.perf_counter()
    out = trainer.microbatch(s.params, tokens, targets, s.positions)
    samples.append((time.perf_counter() - begin) * 1e3)
    begin = time.perf_counter()
    jax.block_until_ready(out)
    samples_wait = (time.perf_counter() - begin) * 1e3
  return {"microbatch_enqueue_ms": statistics.median(samples),
          "microbatch_wait_after_ms": samples_wait}


# ------------------------------------------------------------------------------------ trace


def trace_steps(s: Setup, trainer: Trainer, whole: WholeStep,
                directory: pathlib.Path, steps: int = 3) -> dict[str, Any]:
  """GPU busy time per step of graphed and whole step, from a profiler trace of each."""
  found = {}
  batches = step_batches(s.corpus, 0, trainer.microbatches)
  opt_state = trainer.tx.init(s.params)
  for name in ("graphed", "whole_step"):
    state = (jax.tree.map(jnp.copy, s.params), jax.tree.map(jnp.copy, opt_state))
    run = ((lambda st: trainer.step(*st, batches, s.positions)[:2]) if name == "graphed" else
           (lambda st: whole.step(*st, batches, s.positions)[:2]))
    state = jax.block_until_ready(run(run(state)))
    trace = profiling.record_trace(functools.partial(_repeat, run, state, steps),
                                   str(directory / f"trace-{name}"))
    found[name] = dict(reduce_trace(trace.events), wall_ms_per_step=trace.seconds / steps * 1e3,
                       steps=steps)
  return found


def _repeat(run: Any, state: Any, steps: int) -> Any:
  for _ in range(steps):
    state = run(state)
  return state


def reduce_trace(events: list[profiling.Event]) -> dict[str, Any]:
  """GPU kernel time, busy (union) time and the largest idle gaps, from a trace's events."""
  gpu = profiling.gpu_processes(events)
  kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]
  if not kernels:
    processes = sorted(set(profiling.process_names(events).values()))
    return {"note": f"no GPU events among processes {processes}"}
  busy = profiling.merged(sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]))
                                 for e in kernels))
  gaps = sorted((lo - hi for (_, hi), (lo, _) in zip(busy, busy[1:])), reverse=True)
  by_kind: collections.Counter[str] = collections.Counter()
  for e in kernels:
    by_kind[profiling.kernel_kind(e.get("name", ""))] += float(e["dur"])
  return {"gpu_busy_ms": sum(hi - lo for lo, hi in busy) / 1e3,
          "gpu_span_ms": (busy[-1][1] - busy[0][0]) / 1e3,
          "kernel_ms": sum(by_kind.values()) / 1e3, "kernels": len(kernels),
          "idle_ms": sum(gaps) / 1e3, "gaps_over_20us": sum(g > 20 for g in gaps),
          "idle_in_gaps_over_20us_ms": sum(g for g in gaps if g > 20) / 1e3,
          "kernel_ms_by_kind": {k: round(v / 1e3, 3) for k, v in by_kind.most_common(12)}}


# ----------------------------------------------------------------------------- long run


def clock_log(path: pathlib.Path, stop: threading.Event) -> threading.Thread:
  """Samples the GPU's SM clock, power, temperature and throttle reasons twice a second."""

  def sample():
    query = ("timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,"
             "clocks_throttle_reasons.active")
    with path.open("w") as out:
      while not stop.is_set():
        line = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()
        out.write(f"{time.time():.2f},{line}\n")
        out.flush()
        stop.wait(0.5)

  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  return thread


def native_profile(s: Setup, trainer: Trainer, seconds: float, path: pathlib.Path) -> None:
  """Graphed steps for `seconds` under py-spy (`profiling.sample_native`), the steps and
  executable calls that ran written to `path` with `.json`."""
  state = (jax.tree.map(jnp.copy, s.params), trainer.tx.init(s.params))
  indices = itertools.count()

  def advance() -> Any:
    nonlocal state
    batches = step_batches(s.corpus, next(indices), trainer.microbatches)
    state = trainer.step(*state, batches, s.positions)[:2]
    return state

  ran = profiling.sample_native(advance, seconds, str(path))
  if ran is None:
    return
  seconds_run, steps = ran
  calls_per_step = (trainer.microbatches * 2 * len(trainer.layers) + len(trainer.plan.calls)
                    + 1)  # the sums of the grads, the update
  path.with_suffix(".json").write_text(json.dumps(
      {"seconds": seconds_run, "steps": steps, "blocks": len(trainer.layers) - 2,
       "calls": steps * calls_per_step}))


def spin_ms() -> float:
  """Milliseconds of a fixed pure-Python loop on an otherwise idle host: it grows when the
  host's CPU clock drops (a turbo budget spent under sustained load)."""
  begin = time.perf_counter()
  total = 0
  for i in range(300_000):
    total += i & 7
  return (time.perf_counter() - begin) * 1e3


def cpu_mhz() -> float | None:
  """The mean `cpu MHz` of /proc/cpuinfo (None where there is none)."""
  try:
    values = [float(line.split(":")[1]) for line in open("/proc/cpuinfo")
              if line.startswith("cpu MHz")]
  except OSError:
    return None
  return statistics.mean(values) if values else None


def long_run(s: Setup, trainer: Trainer, steps: int, every: int) -> list[dict[str, Any]]:
  """Graphed steps from a fresh state; tokens/s and host enqueue per `every` steps, and the
  host's pure-Python speed (`spin_ms`) measured between them with the device idle."""
  microbatches = trainer.microbatches
  tokens_per_step = microbatches * s.preset.batch * s.preset.context
  state = (jax.tree.map(jnp.copy, s.params), trainer.tx.init(s.params))
  rows = []
  for start in range(0, steps, every):
    begin, spent = time.perf_counter(), 0.0
    for i in range(start, start + every):
      mark = time.perf_counter()
      state = trainer.step(*state, step_batches(s.corpus, i, microbatches),
                           s.positions)[:2]
      spent += time.perf_counter() - mark
    jax.block_until_ready(state)
    dt = time.perf_counter() - begin
    rows.append({"first_step": start, "time": time.time(), "spin_ms": spin_ms(),
                 "cpu_mhz": cpu_mhz(),
                 "tok_s": every * tokens_per_step / dt, "enqueue_ms": spent / every * 1e3,
                 "bytes_in_use": (jax.devices()[0].memory_stats() or {}).get("bytes_in_use")})
    print(f"  steps {start:>4}-{start + every - 1}: {rows[-1]['tok_s']:,.0f} tok/s, "
          f"enqueue {rows[-1]['enqueue_ms']:.1f} ms/step, spin {rows[-1]['spin_ms']:.1f} ms, "
          f"cpu {rows[-1]['cpu_mhz']} MHz", flush=True)
  return rows


DEFAULT_PACK = capture_lib.PACK_MAX_BYTES


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="gpu", choices=sorted(PRESETS))
  parser.add_argument("--flat", action="store_true")
  parser.add_argument("--variants", nargs="+", default=["default"], choices=sorted(VARIANTS))
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--trace", action="store_true", help="profile a few steps (GPU)")
  parser.add_argument("--native", type=float, default=0,
                      help="seconds of graphed steps under py-spy --native (first variant)")
  parser.add_argument("--long", type=int, default=0, help="graphed steps of the long run")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/breakdown"))
  parser.add_argument("--cache", type=pathlib.Path, default=pathlib.Path("runs/cache"),
                      help="the example's tokenizers and encoded texts (its --cache)")
  parser.add_argument("--label", default="", help="names this run in its JSON (e.g. the "
                      "XLA_FLAGS it ran under)")
  args = parser.parse_args()
  args.out.mkdir(parents=True, exist_ok=True)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; preset {args.preset}, "
        f"flat {args.flat}", flush=True)
  s = setup(args.preset, args.flat, args.cache)
  results: dict[str, Any] = {"label": args.label, "preset": args.preset, "flat": args.flat,
                             "xla_flags": os.environ.get("XLA_FLAGS", ""),
                             "device": jax.devices()[0].device_kind,
                             "jax": jax.__version__, "variants": {}}
  whole = None
  for variant in args.variants:
    trainer = build(s, variant)
    print(f"[{variant}] captured in {trainer.capture_seconds:.1f} s", flush=True)
    if whole is None:
      whole = whole_step(s, trainer)
    found: dict[str, Any] = {"capture_seconds": trainer.capture_seconds}
    found["call"] = call_costs(s, trainer)
    found["microbatch"] = microbatch_host(s, trainer)
    found["step"] = step_rates(s, trainer, whole, args.rounds, args.steps)
    if args.trace and jax.default_backend() == "gpu":
      found["trace"] = trace_steps(s, trainer, whole, args.out / variant)
    print(f"[{variant}] {json.dumps(found, default=float)}", flush=True)
    results["variants"][variant] = found
    if args.native and variant == args.variants[0]:
      native_profile(s, trainer, args.native, args.out / f"native{args.label}.txt")
    if args.long and variant == args.variants[0]:
      stop = threading.Event()
      log = args.out / "clocks.csv"
      thread = clock_log(log, stop) if jax.default_backend() == "gpu" else None
      results["long_run"] = long_run(s, trainer, args.long, 20)
      stop.set()
      if thread:
        thread.join()
    del trainer
  print(f"\n{'variant':<20} {'graphed tok/s':>14} {'whole tok/s':>12} {'ratio':>6} "
        f"{'arrays/vjp':>10} {'fwd host':>9} {'vjp host':>9} {'bwd host':>9} "
        f"{'fwd+bwd dev':>11} {'mb enqueue':>10}")
  for variant, f in results["variants"].items():
    c, st = f["call"], f["step"]
    print(f"{variant:<20} {st['graphed_tok_s']:>14,.0f} {st['whole_tok_s']:>12,.0f} "
          f"{st['ratio']:>6.3f} {c['arrays_per_vjp']:>10} {c['forward_host_us']:>8.0f}u "
          f"{c['vjp_host_us']:>8.0f}u {c['backward_host_us']:>8.0f}u "
          f"{c['fwd_bwd_paced_us']:>10.0f}u {f['microbatch']['microbatch_enqueue_ms']:>9.1f}m")
  (args.out / f"breakdown{args.label}.json").write_text(json.dumps(results, indent=1, default=float))
  print(json.dumps(results, default=float))


if __name__ == "__main__":
  main()
