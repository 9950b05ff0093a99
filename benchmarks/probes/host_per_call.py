"""jaxgraph's host path per replayed call: small layers, so the host cost is what is timed.

Four identical layers (4 matmuls of 8 × 16 by 16 × 16, pytree params of 8 leaves)
replayed through `vjp` and their pullbacks; the median of `--rounds` rounds of `--steps`
steps, in µs per executable call. Compare two trees by alternating the package on the path
(the tree to measure first, this one after it for `benchmarks`; `-P`: the working directory
not put before them, as `-m` does otherwise):

  for t in .old . .old .; do PYTHONPATH=$t:. python3 -P -m benchmarks.probes.host_per_call; done
  python3 -m benchmarks.probes.host_per_call --rounds 2 --steps 2   # smoke run

`--devices N` (N > 1): FSDP over a mesh of the first N devices, as the Llama example runs
it: each layer's params raveled (`jg.flat.ravel`) and sharded (`jg.fsdp.shard`: one buffer
split N ways, gathered inside the forward and reduce-scattered by the backward), x and its
cotangent batch-sharded (`jg.fsdp.batch_sharding`). N = 1: the flat params on one device,
no mesh (as the example's N = 1). On the CPU, N virtual devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
    python3 -m benchmarks.probes.host_per_call --devices 4

Every run also times `bare`: the same compiled executables (the forward with residuals and
the backward jaxgraph captured) called directly, `Compiled.__call__` with the arguments
jaxgraph passes, and no Python of jaxgraph's around them; `jaxgraph - bare` is jaxgraph's
own host cost per call. On the CPU the bare call also runs the devices' work (their threads
share the cores with Python), so the difference is noisy; `own` times jaxgraph's Python
alone: the jaxgraph step again, its executables replaced by functions that return outputs
recorded from one real call. `--replicated` places params and batch whole on every device
of the mesh: executables over N devices without collectives (on a GPU this separates the
runtime's cost per device from that of the collectives). `cpu` is the main thread's CPU
time per call (`time.thread_time`): host work without the waits.

Where the executables come from is jaxgraph's default (`--per-layer-executables auto`: a
loaded copy per layer on a GPU, `_capture.loaded_copy`; `on` forces the copies, as the CPU
smoke test does); `bare` calls the same executables each layer replays. `--compiler-option
NAME=VALUE` (repeatable) compiles every executable with that XLA option
(`make_graphed(..., compiler_options=...)`; `true`/`false` are bools, numbers numbers,
anything else a string, e.g. `xla_gpu_enable_command_buffer=FUSION,CUBLAS,COLLECTIVES`).
One process per device: the same command in each process with `--coordinator HOST:PORT
--num-processes N --process-id I` (`jax.distributed`), `--devices N` over every process's
devices; each process reports its own times. `--profile PREFIX` then samples the jaxgraph
step and the bare step `--profile-seconds` each under py-spy `--native`
(`PREFIX.jaxgraph.txt`, `PREFIX.bare.txt`, each with its `.json` of steps and calls;
`probes/native_breakdown.py` splits them by part of the runtime). `--json PATH` writes the
result line to PATH too. benchmarks/probes/host_cost_gpu.sh runs the GPU rows.

Measured (jaxgraph at a690231; 2 shared vCPUs, XLA:CPU with 8 virtual devices, jax 0.10.2;
`--rounds 10 --steps 10`, two runs each, µs per call):

  devices          jaxgraph    bare   own   jaxgraph cpu   bare cpu
  0 (pytrees)      81, 107   65, 62  40, 39      80, 106     63, 60
  1 (flat)          82, 81   56, 68  29, 26       81, 80     29, 45
  4 FSDP          523, 580 449, 496  24, 26     151, 171     83, 94
  8 FSDP          988, 686 905, 723  26, 16     202, 112    117, 72
  4 replicated    364, 406 262, 300  27, 28     127, 174     77, 92
  8 replicated    457, 348 408, 406  28, 17     153, 114    127, 111

* What grows with the devices is the bare call: the runtime's dispatch of one executable
  over N devices, and on the CPU also their work, which shares the 2 cores with Python
  (wall 56-68 µs at N = 1, 449-496 at 4, 723-905 at 8). On the main thread the bare call
  costs 29-45, 83-94 and 72-117 µs: py-spy --native puts it in PjRt's
  `CommonPjRtLoadedExecutable::Execute` -> `LaunchOnDevice` once per device (a thread-pool
  `Schedule`, mostly `pthread_cond_signal`), and freeing the N-shard arrays costs more per
  array (`PjRtBuffer` releases).
* jaxgraph's own Python does not grow with N: 24-29 µs a call at N = 1 and 4, 16-26 at 8
  (`own`), and no frame of it works per device (no per-shard loop, no sharding compared
  beyond a dict lookup of the signature's interned shardings). Between real calls it costs
  more (`jaxgraph cpu - bare cpu`: 35-52 µs at N = 1, 68-77 at 4, 40-85 at 8; the spread is
  the machine's; caches cold after each runtime call, we think), spread thin over
  `_replay_forward`, `signature_of`, `Pullback.__call__`, `assemble` (cProfile, py-spy): no
  hot spot to cut.
* A mesh of one device (not measured above: `--devices 1` has none, as
  benchmarks/llama_fsdp.py's N = 1) respells each gradient's sharding (`_pullback.placed_as`,
  `P("fsdp")` is `P()` there): ~16 µs a gradient, 19% of the main thread there; it is
  already cheaper than `jax.device_put` to the equal sharding (~46 µs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import jaxgraph as jg
from benchmarks import harness, profiling

FORWARD = ("explicit", True)  # the forward a `vjp` without keys replays


def layer(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  for i in range(4):
    x = jnp.tanh(x @ params[f"w{i}"] + params[f"b{i}"])
  return x


def layer_executables(layers: list[Any], entry: Any) -> list[tuple[Any, Any]]:
  """(forward, backward) each layer replays: `entry`'s own, or with per-layer executables
  the layer's loaded copy of them (made in warmup)."""
  forward, backward = entry.forward[FORWARD], entry.backward["full"][0]
  return [(graphed.executables.local(entry, forward), graphed.executables.local(entry, backward))
          for graphed in layers]


def bare_step(layers: list[Any], entry: Any, params: list[Any], x: jax.Array,
              ct: jax.Array) -> Callable[[], jax.Array]:
  """A step of the executables the layers replay, called directly: forwards, then backwards
  in reverse."""
  layout = entry.layout
  executables = layer_executables(layers, entry)
  leaves = [jax.tree.leaves(p) for p in params]

  def step() -> jax.Array:
    h, saved = x, []
    for p, (forward, _) in zip(leaves, executables):
      inputs = [*p, h]
      values = forward(*inputs)
      outs = values[:layout.n_out]
      saved.append(([inputs[i] for i in layout.needed_inputs],
                    [outs[i] for i in layout.needed_outputs], values[layout.n_out:]))
      h = outs[0]
    g = ct
    for (ins, outs, kept), (_, backward) in zip(reversed(saved), reversed(executables)):
      g = backward(*ins, *outs, *kept, g)[-1]  # x is the last differentiated leaf
    return g

  return step


def replace_executables(layers: list[Any], entry: Any, params: Any, x: jax.Array,
                        ct: jax.Array) -> None:
  """Has every layer replay, instead of its executables, functions that return outputs
  recorded from one real call each: a jaxgraph step then costs its own Python alone (the
  layers are spoiled, so this comes last). What a layer replays for `entry`'s executable
  is looked up in its `_replayed` (its loaded copy, or the executable itself): the stand-ins
  go there, and `entry` keeps its executables."""
  layout = entry.layout
  forward, backward = entry.forward[FORWARD], entry.backward["full"][0]
  inputs = [*jax.tree.leaves(params), x]
  values = list(forward(*inputs))
  grads = list(backward(*[inputs[i] for i in layout.needed_inputs],
                        *[values[i] for i in layout.needed_outputs], *values[layout.n_out:], ct))
  for graphed in layers:
    graphed.executables.replayed[forward] = lambda *_: list(values)
    graphed.executables.replayed[backward] = lambda *_: list(grads)


def per_call(step: Callable[[], jax.Array], calls: int, rounds: int, steps: int, *,
             wait: bool) -> dict[str, float]:
  """µs per executable call, wall clock (`harness.summary` of the rounds) and the main
  thread's CPU time (`cpu`, the median round): what Python and the runtime's dispatch cost
  the host, without the waits. `wait`: waits for every step's result (see `main`)."""
  jax.block_until_ready(step())
  samples, cpu = [], []
  for _ in range(rounds):
    begin, begin_cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
      g = step()
      if wait:
        jax.block_until_ready(g)
    jax.block_until_ready(g)
    samples.append((time.perf_counter() - begin) / calls * 1e6)
    cpu.append((time.thread_time() - begin_cpu) / calls * 1e6)
  return harness.summary(samples) | {"cpu": statistics.median(cpu)}


def option(text: str) -> tuple[str, Any]:
  """`NAME=VALUE` of `--compiler-option`: `true`/`false` as bools, numbers as numbers."""
  name, sep, value = text.partition("=")
  if not sep or not name:
    raise argparse.ArgumentTypeError(f"--compiler-option takes NAME=VALUE, got {text!r}")
  if value.lower() in ("true", "false"):
    return name, value.lower() == "true"
  for kind in (int, float):
    try:
      return name, kind(value)
    except ValueError:
      pass
  return name, value


def profile(step: Callable[[], jax.Array], seconds: float, path: str, calls_per_step: int
            ) -> None:
  """`step` for `seconds` under py-spy --native (`profiling.sample_native`) into `path`,
  the steps and executable calls that ran into its `.json` (`native_breakdown.py`)."""
  ran = profiling.sample_native(step, seconds, path)
  if ran is not None:
    elapsed, steps = ran
    with open(path.removesuffix(".txt") + ".json", "w") as f:
      json.dump({"seconds": elapsed, "steps": steps, "calls": steps * calls_per_step}, f)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=30)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--devices", type=int, default=0,
                      help="flat params, FSDP over this many devices (sharded params and "
                           "batch); 1: one device, no mesh; 0: pytree params, one device")
  parser.add_argument("--replicated", action="store_true",
                      help="with --devices N > 1: params and batch replicated over the mesh "
                           "instead, so every device runs the whole layer, no collective")
  parser.add_argument("--per-layer-executables", choices=("auto", "on", "off"),
                      default="auto", help="make_graphed's per_layer_executables: None, "
                                           "True, False")
  parser.add_argument("--compiler-option", type=option, action="append", default=[],
                      metavar="NAME=VALUE", help="an XLA option of every executable "
                                                 "(make_graphed's compiler_options); repeatable")
  parser.add_argument("--coordinator", metavar="HOST:PORT",
                      help="jax.distributed: one process of --num-processes")
  parser.add_argument("--num-processes", type=int)
  parser.add_argument("--process-id", type=int)
  parser.add_argument("--profile", metavar="PREFIX",
                      help="py-spy --native samples of the jaxgraph and the bare step: "
                           "PREFIX.jaxgraph.txt, PREFIX.bare.txt (and their .json)")
  parser.add_argument("--profile-seconds", type=float, default=5.0)
  parser.add_argument("--json", metavar="PATH", help="also write the result line here")
  args = parser.parse_args()
  if args.replicated and args.devices < 2:
    parser.error("--replicated needs --devices N with N > 1")
  if args.coordinator is not None:
    if args.num_processes is None or args.process_id is None or args.devices < 2:
      parser.error("--coordinator needs --num-processes, --process-id and --devices N > 1")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  params = ({f"w{i}": jnp.full((16, 16), 0.01) for i in range(4)}
            | {f"b{i}": jnp.zeros(16) for i in range(4)})
  x, ct = jnp.ones((8, 16)), jnp.ones((8, 16))
  if not args.devices:
    stack = [params] * args.layers
  else:
    stack = [jg.flat.ravel(params) for _ in range(args.layers)]
  if args.devices > 1:
    mesh = jg.fsdp.make_mesh(devices=jax.devices()[:args.devices])
    if args.replicated:
      stack, x, ct = jax.tree.map(
          lambda v: jg.fsdp.place(v, NamedSharding(mesh, PartitionSpec())), (stack, x, ct))
    else:
      stack = jg.fsdp.shard(stack, mesh)
      x, ct = (jg.fsdp.place(v, jg.fsdp.batch_sharding(mesh)) for v in (x, ct))
  per_layer = {"auto": None, "on": True, "off": False}[args.per_layer_executables]
  layers = jg.make_graphed([layer] * args.layers, sample_args=[(p, x) for p in stack],
                           num_warmup_iters=1, per_layer_executables=per_layer,
                           compiler_options=dict(args.compiler_option) or None)

  def step() -> jax.Array:
    h, pullbacks = x, []
    for graphed, p in zip(layers, stack):
      h, pullback = graphed.vjp(p, h)
      pullbacks.append(pullback)
    g = ct
    for pullback in reversed(pullbacks):
      _, g = pullback(g)
    return g

  entry = next(iter(layers[0].executables.entries.values()))
  bare = bare_step(layers, entry, stack, x, ct)
  copies = len({id(f) for f, _ in layer_executables(layers, entry)})
  calls, rounds = 2 * args.layers * args.steps, args.rounds // 2 or 1
  # With collectives, XLA:CPU hangs when executions pile up on machines of few cores
  # (probes/cpu_collective_deadlock.py): there every step waits for its result.
  wait = args.devices > 1 and not args.replicated and jax.default_backend() == "cpu"
  found = harness.interleaved(2, {
      "jaxgraph": lambda: per_call(step, calls, rounds, args.steps, wait=wait),
      "bare": lambda: per_call(bare, calls, rounds, args.steps, wait=wait)})
  best = {name: min(runs, key=lambda r: r["median"]) for name, runs in found.items()}
  if args.profile:
    for name, run in (("jaxgraph", step), ("bare", bare)):
      profile(run, args.profile_seconds, f"{args.profile}.{name}.txt", 2 * args.layers)
  # What the step computes, to compare runtimes bit for bit (the input's gradient).
  digest = hashlib.sha256(np.asarray(step()).tobytes()).hexdigest()[:16]
  replace_executables(layers, entry, stack[0], x, ct)
  own = per_call(step, calls, args.rounds, args.steps, wait=False)
  result = {"jaxgraph": jg.__file__, "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
            "devices": args.devices, "replicated": args.replicated,
            "processes": jax.process_count(), "process": jax.process_index(),
            "per_layer_executables": layers[0].config.per_layer_executables,
            "per_layer_copies": copies, "compiler_options": dict(args.compiler_option),
            "us_per_call": best["jaxgraph"]["median"],
            "bare_us_per_call": best["bare"]["median"], "own_us_per_call": own["median"],
            "cpu_us_per_call": best["jaxgraph"]["cpu"], "bare_cpu_us_per_call": best["bare"]["cpu"],
            "spread_pct": max(r["spread_pct"] for r in found["jaxgraph"]),
            "result_sha256": digest}
  columns = ("us_per_call", "bare_us_per_call", "own_us_per_call", "cpu_us_per_call",
             "bare_cpu_us_per_call")
  print(f"{'jaxgraph':<40} {'devices':>7} {'µs/call':>8} {'bare':>8} {'own':>8} {'cpu':>8} "
        f"{'bare cpu':>8} {'spread':>7}")
  print(f"{result['jaxgraph']:<40} {args.devices:>7} "
        + " ".join(f"{result[c]:>8.1f}" for c in columns) + f" {result['spread_pct']:>6.0f}%")
  print(json.dumps(result), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f)


if __name__ == "__main__":
  main()
