"""Can threads dispatch executables to several devices in parallel: one Python thread per
device against the one thread `jg.schedule.Pipeline` dispatches every stage from.

A pipeline over N devices is host-bound when one thread launches every stage's executables
(docs/results/pipeline.md). A dispatch thread per device pays only if the runtime lets the
threads launch at once: `jax.stages.Compiled.__call__` releasing the GIL while PjRt
launches, and no process-wide lock in the launch per device. This probe asks that of plain
JAX executables, and (`--jaxgraph`) of the same blocks replayed through jaxgraph.

Per device d of the first `--devices` N local devices: a chain of `--layers` L blocks
`tanh(x @ w)` (`--width` square weights, `--batch` rows, float32), each block's forward and
its backward (`jax.vjp`, recomputing the forward) compiled ahead of time for device d, the
weights and inputs committed to d: each device its own stream of work, no collectives. A
step of a chain is its L forwards, then its L backwards in reverse (2 L calls); a round
dispatches `--calls` calls per device (rounded up to whole steps) in each mode:

  one-thread   one thread dispatches the N chains round-robin, a call of each in turn (how
               `Pipeline` drives its stages today)
  threads      N threads, one per device, each its own chain (started by one barrier)
  one-device   one thread, device 0's chain alone: the floor of a call

The modes alternate over `--rounds` rounds (the order reversed every other round). A round
waits for the devices only at its end (`jax.block_until_ready` of every step's last
gradient); its wall time runs from the start of dispatch until that wait returns. Per mode:
`us/call`, the wall time over the calls of all devices (median of the rounds, and their
spread); `dispatch`, the same until the last thread finished dispatching; `wait ms`, the
final wait; `cpu/call`, each dispatching thread's CPU time (`time.thread_time`, waits for
the GIL excluded) over its own calls. `speedup` is one-thread's us/call over threads'
(N if the threads dispatch fully in parallel, 1 if something serializes them); `busy`, the
threads' CPU time over the dispatch's wall time (above 1: host work ran on several cores at
once, which the GIL allows only outside Python, in the runtime's own code). When the
wait is a large part of the wall time the devices, not the host, set the pace: the host
numbers are then moot (the default `--width 256` keeps the kernels tiny; a larger width
makes them heavy on purpose).

`--jaxgraph` adds the same three modes through `jaxgraph.make_graphed` replays (one
`make_graphed` call over every device's layers, as the Llama example's pipeline makes one
over its blocks): each layer's `vjp(w, h)`, then the pullbacks in reverse, to include
jaxgraph's own Python per call. jaxgraph's replay path takes no blocking lock: each
GraphedCallable holds its own non-blocking `_busy` lock for a call (a second thread calling
the same layer at once gets a RuntimeError, it never waits), and the `make_graphed` call's
`config.lock` is taken only to capture, to drop executables (`reset`) and to look up a
fused segment or prefetch step. Its Python runs under the GIL, so across threads only the
runtime's work outside Python can overlap (docs/pipeline.md, "Dispatch from several
threads").

  python3 -m benchmarks.probes.threaded_dispatch --devices 4 --jaxgraph --out $OUT/td.json
  python3 -m benchmarks.probes.threaded_dispatch --devices 4 --width 1024 --batch 1024 \\
      --calls 256 --out $OUT/td-heavy.json    # 4 GPUs; kernels longer than a launch
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
      python3 -m benchmarks.probes.threaded_dispatch --devices 4 --jaxgraph \\
      --calls 64 --rounds 2 --layers 2        # a CPU dry run of the plumbing

On the CPU the virtual devices' work runs on the same cores as the dispatching threads, so
its numbers say nothing about a GPU host. `--switch-interval S` sets Python's
`sys.setswitchinterval` (how long a thread waiting for the GIL waits before it asks the
holder to drop it; 0.005 by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from benchmarks import harness

Chain = Callable[[list[jax.Array], int], Iterator[None]]  # (done, steps)


def block(w: jax.Array, x: jax.Array) -> jax.Array:
  return jnp.tanh(x @ w)


def block_backward(w: jax.Array, x: jax.Array, ct: jax.Array) -> tuple[jax.Array, jax.Array]:
  _, pullback = jax.vjp(block, w, x)
  return pullback(ct)


def device_inputs(device: Any, *, layers: int, width: int, batch: int, seed: int
                  ) -> tuple[list[jax.Array], jax.Array, jax.Array]:
  """A chain's weights (scaled so activations keep their size), input and cotangent,
  committed to `device`."""
  keys = jax.random.split(jax.random.key(seed), layers + 1)
  weights = [jax.random.normal(k, (width, width)) / width ** 0.5 for k in keys[:layers]]
  x = jax.random.normal(keys[-1], (batch, width))
  ct = jnp.ones((batch, width))
  return jax.device_put((weights, x, ct), device)


def bare_chain(weights: list[jax.Array], x: jax.Array, ct: jax.Array) -> Chain:
  """The chain of one device as compiled executables called directly: runs `steps` steps,
  yields after each call, appends each step's last gradient to `done`."""
  forward = jax.jit(block).lower(weights[0], x).compile()
  backward = jax.jit(block_backward).lower(weights[0], x, ct).compile()

  def run(done: list[jax.Array], steps: int) -> Iterator[None]:
    for _ in range(steps):
      h, inputs = x, []
      for w in weights:
        inputs.append(h)
        h = forward(w, h)
        yield
      g = ct
      for w, h_in in zip(reversed(weights), reversed(inputs)):
        _, g = backward(w, h_in, g)
        yield
      done.append(g)

  return run


def graphed_chains(inputs: list[tuple[list[jax.Array], jax.Array, jax.Array]]
                   ) -> tuple[list[Chain], list[Any]]:
  """Every device's chain as jaxgraph layers, from one `make_graphed` call: each layer's
  `vjp`, then the pullbacks in reverse. Also returns the layers."""
  import jaxgraph as jg  # only with --jaxgraph

  fns = [block for weights, _, _ in inputs for _ in weights]
  sample_args = [(w, x) for weights, x, _ in inputs for w in weights]
  layers = jg.make_graphed(fns, sample_args=sample_args, num_warmup_iters=1)
  chains, start = [], 0
  for weights, x, ct in inputs:
    own = layers[start:start + len(weights)]
    start += len(weights)

    def run(done: list[jax.Array], steps: int, own=own, weights=weights, x=x, ct=ct
            ) -> Iterator[None]:
      for _ in range(steps):
        h, pullbacks = x, []
        for layer, w in zip(own, weights):
          h, pullback = layer.vjp(w, h)
          pullbacks.append(pullback)
          yield
        g = ct
        for pullback in reversed(pullbacks):
          _, g = pullback(g)
          yield
        done.append(g)

    chains.append(run)
  return chains, layers


def one_thread(chains: list[Chain], steps: int) -> dict[str, Any]:
  """The chains' calls dispatched round-robin from the calling thread."""
  done: list[jax.Array] = []
  runs = [chain(done, steps) for chain in chains]
  begin, begin_cpu = time.perf_counter(), time.thread_time()
  while runs:
    for run in list(runs):
      if next(run, StopIteration) is StopIteration:
        runs.remove(run)
  dispatched, cpu = time.perf_counter(), time.thread_time() - begin_cpu
  jax.block_until_ready(done)
  end = time.perf_counter()
  return {"seconds": end - begin, "dispatch_seconds": dispatched - begin,
          "wait_seconds": end - dispatched, "cpu_seconds": [cpu]}


def threaded(chains: list[Chain], steps: int) -> dict[str, Any]:
  """Each chain dispatched by a thread of its own, the threads started by one barrier."""
  barrier = threading.Barrier(len(chains))
  spans: list[tuple[float, float, float] | None] = [None] * len(chains)
  errors: list[BaseException] = []
  done: list[list[jax.Array]] = [[] for _ in chains]

  def work(index: int) -> None:
    try:
      run = chains[index](done[index], steps)
      barrier.wait()
      begin, begin_cpu = time.perf_counter(), time.thread_time()
      for _ in run:
        pass
      spans[index] = (begin, time.perf_counter(), time.thread_time() - begin_cpu)
    except BaseException as e:  # re-raised by the main thread; the others then stop
      errors.append(e)
      barrier.abort()

  threads = [threading.Thread(target=work, args=(i,), name=f"dispatch-{i}")
             for i in range(len(chains))]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  if errors:
    raise errors[0]
  dispatched = max(s[1] for s in spans)
  jax.block_until_ready(done)
  end = time.perf_counter()
  begin = min(s[0] for s in spans)
  return {"seconds": end - begin, "dispatch_seconds": dispatched - begin,
          "wait_seconds": end - dispatched, "cpu_seconds": [s[2] for s in spans]}


def summarize(rounds: list[dict[str, Any]], calls: int) -> dict[str, Any]:
  """A mode's rounds of `calls` calls: µs per call (wall, summary of the rounds), dispatch
  µs per call, the final wait in ms and each thread's CPU µs per call of its own (medians of
  the rounds; the threads share the calls evenly)."""
  threads = len(rounds[0]["cpu_seconds"])
  calls_per_thread = calls // threads
  return {"us_per_call": harness.summary([r["seconds"] / calls * 1e6 for r in rounds]),
          "dispatch_us_per_call": statistics.median(
              r["dispatch_seconds"] / calls * 1e6 for r in rounds),
          "wait_ms": statistics.median(r["wait_seconds"] * 1e3 for r in rounds),
          "cpu_us_per_call": [statistics.median(r["cpu_seconds"][t] / calls_per_thread * 1e6
                                                for r in rounds) for t in range(threads)],
          "busy_threads": statistics.median(sum(r["cpu_seconds"]) / r["dispatch_seconds"]
                                            for r in rounds),
          "calls": calls, "threads": threads}


def modes_of(chains: list[Chain], steps: int, prefix: str
             ) -> dict[str, Callable[[], dict[str, Any]]]:
  """The three modes of `chains` as runs for `harness.interleaved`."""
  return {f"{prefix}one-thread": lambda: one_thread(chains, steps),
          f"{prefix}threads": lambda: threaded(chains, steps),
          f"{prefix}one-device": lambda: one_thread(chains[:1], steps)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--devices", type=int, default=None,
                      help="the first N local devices, one chain each (default: all)")
  parser.add_argument("--layers", type=int, default=8, help="blocks per device's chain")
  parser.add_argument("--width", type=int, default=256, help="the blocks' square weights")
  parser.add_argument("--batch", type=int, default=8, help="rows of a block's input")
  parser.add_argument("--calls", type=int, default=2048,
                      help="calls per device a round (rounded up to whole steps of 2 L)")
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--jaxgraph", action="store_true",
                      help="also the same modes through jaxgraph.make_graphed replays")
  parser.add_argument("--switch-interval", type=float, default=None,
                      help="sys.setswitchinterval in seconds (Python's default: 0.005)")
  parser.add_argument("--max-held-gib", type=float, default=4.0,
                      help="refuse settings whose outputs in flight could pass this")
  parser.add_argument("--out", default=None, help="also write the result JSON to this file")
  args = parser.parse_args()
  available = jax.local_devices()
  count = len(available) if args.devices is None else args.devices
  if not 1 <= count <= len(available):
    parser.error(f"--devices {args.devices}: this process has {len(available)} local "
                 "devices; pass at most that many (on the CPU, more virtual ones with "
                 "XLA_FLAGS=--xla_force_host_platform_device_count=N)")
  if min(args.layers, args.width, args.batch, args.calls, args.rounds) < 1:
    parser.error("--layers, --width, --batch, --calls and --rounds must be positive")
  steps = -(-args.calls // (2 * args.layers))
  per_device = steps * 2 * args.layers
  # A round may dispatch every call before the device runs one: each call's outputs
  # (a weight gradient, an activation) can be held until then.
  held = per_device * (args.width + args.batch) * args.width * 4
  if held > args.max_held_gib * 2 ** 30:
    parser.error(f"a round may hold {held / 2 ** 30:.1f} GiB of outputs per device "
                 f"(--calls x (width + batch) x width x 4 bytes), over --max-held-gib "
                 f"{args.max_held_gib}; lower --calls for a large --width or --batch")
  if args.switch_interval is not None:
    sys.setswitchinterval(args.switch_interval)
  devices = available[:count]
  inputs = [device_inputs(d, layers=args.layers, width=args.width, batch=args.batch, seed=i)
            for i, d in enumerate(devices)]
  chains = {"": [bare_chain(*chain_inputs) for chain_inputs in inputs]}
  layers = []
  if args.jaxgraph:
    chains["jaxgraph "], layers = graphed_chains(inputs)
  runs = {}
  for prefix, found in chains.items():
    one_thread(found, 1)  # an untimed step of each chain: first calls out of the rounds
    threaded(found, 1)
    runs |= modes_of(found, steps, prefix)
  modes = {name: summarize(rounds, per_device * (1 if name.endswith("one-device") else count))
           for name, rounds in harness.interleaved(args.rounds, runs).items()}
  speedups = {prefix.strip() or "bare": modes[f"{prefix}one-thread"]["us_per_call"]["median"]
              / modes[f"{prefix}threads"]["us_per_call"]["median"] for prefix in chains}
  gil = getattr(sys, "_is_gil_enabled", lambda: True)()
  result = {"probe": "threaded_dispatch", "backend": jax.default_backend(),
            "device_kind": devices[0].device_kind, "jax": jax.__version__,
            "python": sys.version.split()[0], "gil_enabled": gil,
            "switch_interval": sys.getswitchinterval(), "devices": count,
            "layers": args.layers, "width": args.width, "batch": args.batch,
            "calls_per_device": per_device, "rounds": args.rounds, "modes": modes,
            "speedup_threads_over_one_thread": speedups}
  if layers:  # fallbacks would time jax.jit, not replays
    stats = [layer.stats for layer in layers]
    result["jaxgraph_layers"] = {
        "captures": sum(s.captures for s in stats), "fallbacks": sum(s.fallbacks for s in stats),
        "per_layer_executables": layers[0].config.per_layer_executables}
  print(f"{count} devices ({devices[0].device_kind}), {args.layers} layers of width "
        f"{args.width}, {per_device} calls per device a round, {args.rounds} rounds; "
        f"GIL {'on' if gil else 'off'}, switch interval {sys.getswitchinterval()} s")
  print(f"{'mode':<22} {'us/call':>8} {'spread':>7} {'dispatch':>9} {'wait ms':>8} "
        f"{'busy':>5}  cpu/call per thread")
  for name, mode in modes.items():
    cpu = " ".join(f"{c:.1f}" for c in mode["cpu_us_per_call"])
    print(f"{name:<22} {mode['us_per_call']['median']:>8.1f} "
          f"{mode['us_per_call']['spread_pct']:>6.0f}% {mode['dispatch_us_per_call']:>9.1f} "
          f"{mode['wait_ms']:>8.1f} {mode['busy_threads']:>5.2f}  {cpu}")
  for name, speedup in speedups.items():
    print(f"speedup of threads over one thread ({name}): {speedup:.2f} (ideal {count})")
  if layers:
    print("jaxgraph layers: " + ", ".join(f"{k} {v}" for k, v in result["jaxgraph_layers"].items()))
  print(json.dumps(result), flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
