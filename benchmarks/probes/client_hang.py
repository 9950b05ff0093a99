"""The smallest sharded program that hangs or crashes under each of jax's GPU dispatch settings.

jax 0.11's CUDA plugin reads its GPU client's settings from the environment when the backend
starts, process-wide: `default` (neither variable set: the StreamExecutor client launches on
the caller's thread), `tfrt` (`XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1`) or `async`
(`PJRT_GPU_ENABLE_ASYNC_DISPATCH=1`). XLA's TFRT GPU client is gone: by XLA's code at the
commit jax 0.11.1 pins, both variables turn on the StreamExecutor client's async dispatch (a
`py_xla_dispatch` thread per device), which each child's `threads` (its native threads by
name) shows for the jax it runs. On 4 H200 the Llama example's graphed FSDP step trained with
the first variable, its whole-step `jax.jit` hung at its first step in the NCCL clique's
rendezvous, and with the second the example segfaulted (docs/results/fsdp.md, "The Llama
example under each dispatch"). This probe takes that apart:
plain-JAX cases from small to large over every visible device (a 1-D mesh "fsdp"), each run in
a fresh process under each client in `--clients`, the first that fails being the program for
a bug report:

  all-gather         one `jax.jit`: a P("fsdp")-sharded array made whole (replicated) by
                     `with_sharding_constraint` and `out_shardings`, called `--steps` times
  reduce-scatter     one `jax.lax.psum_scatter` under `jax.shard_map`, the same
  all-reduce         one `jax.lax.psum` under `jax.shard_map`, the same
  fsdp-step-donated  an FSDP train step of a 2-matmul MLP as one `jax.jit`, as the Llama
                     example's whole step (and `jg.fsdp.gather`) makes it: params sharded
                     P("fsdp"), gathered inside by `with_sharding_constraint`, gradients
                     reduce-scattered back to P("fsdp") (on the CPU XLA keeps an all-reduce
                     and slices it), an SGD-with-momentum update, params and momentum
                     donated; `--steps` steps
  fsdp-step          the same step, nothing donated
  two-executables    a per-layer FSDP step as jaxgraph runs one: a layer's forward (params
                     gathered inside) and its backward-and-update (gathered again, gradient
                     reduce-scattered), two compiled executables called as jaxgraph calls
                     them (`Compiled.__call__`), forward, forward, backward, backward over
                     2 layers (the loss's cotangent between, elementwise), `--steps` steps,
                     no wait between calls
  llama-whole        (`--llama PRESET`) the example itself, `python -m examples.llama.train
                     --preset PRESET --fsdp N --batch B --steps STEPS --no-check
                     --generate 0 --whole-step` (N: `--devices`, B: `--llama-batch`)
  llama-graphed      (`--llama PRESET`) the same without `--whole-step`

A case past `--timeout` seconds (`--llama-timeout` for the example's) is killed and recorded
as `hang`, with the last stage it reached (each plain case prints `stage: ...` lines:
`backend`, `setup`, `call 1` (a `jax.jit`'s compile with it), `done 1`, ...) and whether XLA
logged that not every device joined a collective's rendezvous (`rendezvous_stuck`); a nonzero
exit as `crash` with its exit code or signal; a case that ran and computed what numpy computes
(the first loss of a train case) as `ok` with its seconds (the case's own, after the backend
started; the example's: its process's), `wrong` where the numbers differ. Every row keeps
the last lines of the child's output and the command that reproduces it (the client's
variable in front). `--collectives` also counts each executable's collectives from
`Compiled.as_text()` after the case ran (off by default: `as_text()` itself segfaults under
async dispatch; a crash at stage `collectives` is that). `--devices N`: a mesh of the first N
devices (default: all; the example's cases count them in a child first), the example's batch
its preset's times N unless `--llama-batch`.

The children inherit this process's environment (`NCCL_NVLS_ENABLE=0` unless it says
otherwise) without either client variable, then get their client's. This process never starts
a backend (it would take the GPUs' memory from the children). Writes every row to
`--out DIR/client_hang.json` as each finishes; prints a table, case x client.

  NCCL_NVLS_ENABLE=0 python3 -m benchmarks.probes.client_hang --clients default tfrt async \\
      --llama gpu --out /tmp/hang                                          # 4 GPUs
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
      python3 -m benchmarks.probes.client_hang --clients default tfrt --timeout 30 \\
      --out /tmp/hang     # CPU smoke run: the variables are harmless there, every case ok
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Nothing above starts a backend, and the parent never does: it would take the GPUs' memory
# from its children (and fix its own client, not theirs).

ROOT = pathlib.Path(__file__).resolve().parents[2]
AXIS = "fsdp"

# what each client sets in a fresh process's environment; every other client variable unset
TFRT_VARIABLE = "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT"
ASYNC_VARIABLE = "PJRT_GPU_ENABLE_ASYNC_DISPATCH"
CLIENTS = {"default": {}, "tfrt": {TFRT_VARIABLE: "1"}, "async": {ASYNC_VARIABLE: "1"}}

SYNTHETIC = ("all-gather", "reduce-scatter", "all-reduce", "fsdp-step-donated", "fsdp-step",
             "two-executables")
LLAMA = ("llama-whole", "llama-graphed")

# XLA's log line when a collective's participants do not all arrive (the hang's signature)
RENDEZVOUS_STUCK = "not all of them arrived on time"
TAIL_LINES = 30


# ----------------------------------------------------------------------------------------
# One case, in its child process


def stage(name: str) -> None:
  """Marks how far the case got: the parent records the last mark of a killed child."""
  print(f"stage: {name}", flush=True)


def specs_of(*args: Any) -> Any:
  """`args` as shapes, dtypes and shardings: what lowering needs, still there once the
  arrays are donated."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                      args)


def later_compile(jitted: Any, *args: Any) -> Callable[[], Any]:
  """A thunk compiling `jitted` for `args`' shapes (for `--collectives` after the run)."""
  specs = specs_of(*args)
  return lambda: jitted.lower(*specs).compile()


# what a case returns: its results (`correct` among them), and its executables by name, each
# as a thunk giving it compiled (`--collectives`)
Ran = tuple[dict[str, Any], dict[str, Callable[[], Any]]]


def call_times(fn: Callable[[Any], Any], x: Any, steps: int) -> Any:
  """`fn(x)` `steps` times, each waited for; the last result."""
  for i in range(1, steps + 1):
    stage(f"call {i}")
    y = fn(x)
    y.block_until_ready()
    stage(f"done {i}")
  return y


def all_gather(mesh: Mesh, steps: int) -> Ran:
  """A sharded array made whole on every device."""
  whole = NamedSharding(mesh, P())
  x = jax.device_put(jnp.arange(8 * mesh.size, dtype=jnp.float32), NamedSharding(mesh, P(AXIS)))
  gather = jax.jit(lambda x: jax.lax.with_sharding_constraint(x, whole) + 1,
                   out_shardings=whole)
  y = call_times(gather, x, steps)
  correct = bool(y.sharding.is_fully_replicated
                 and np.array_equal(np.asarray(y), np.arange(x.size) + 1))
  return {"correct": correct}, {"gather": later_compile(gather, x)}


def _mapped(mesh: Mesh, body: Callable[[Any], Any], out_spec: Any) -> Any:
  """`body` jitted over each device's P("fsdp") block (`jax.shard_map`)."""
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=out_spec))


def _blocks(mesh: Mesh) -> Any:
  """A P("fsdp")-sharded vector of `mesh.size` blocks of 8 * `mesh.size` elements."""
  n = mesh.size
  x = jnp.arange(n * 8 * n, dtype=jnp.float32) % 7
  return jax.device_put(x, NamedSharding(mesh, P(AXIS)))


def reduce_scatter(mesh: Mesh, steps: int) -> Ran:
  """Each device's block summed over the devices, the sum split among them."""
  x = _blocks(mesh)
  scatter = _mapped(mesh, lambda b: jax.lax.psum_scatter(b, AXIS, scatter_dimension=0,
                                                         tiled=True), P(AXIS))
  y = call_times(scatter, x, steps)
  expected = np.asarray(x).reshape(mesh.size, -1).sum(0)
  return ({"correct": bool(np.array_equal(np.asarray(y), expected))},
          {"reduce-scatter": later_compile(scatter, x)})


def all_reduce(mesh: Mesh, steps: int) -> Ran:
  """Each device's block summed over the devices, the sum on every device."""
  x = _blocks(mesh)
  reduce = _mapped(mesh, lambda b: jax.lax.psum(b, AXIS), P())
  y = call_times(reduce, x, steps)
  expected = np.asarray(x).reshape(mesh.size, -1).sum(0)
  return ({"correct": bool(np.array_equal(np.asarray(y), expected))},
          {"all-reduce": later_compile(reduce, x)})


# the MLP of the train-step cases: both dimensions split by any device count up to 64
WIDTH, HIDDEN, LEARNING_RATE, MOMENTUM = 64, 128, 0.05, 0.9


def mlp_problem(mesh: Mesh, layers: int) -> tuple[list[dict[str, Any]], Any, Any]:
  """`layers` MLPs' params sharded P("fsdp") along their first dimension, and a regression
  batch (8 rows a device) sharded along its rows."""
  split = NamedSharding(mesh, P(AXIS))
  keys = jax.random.split(jax.random.key(0), 2 * layers + 2)
  params = [{"w1": jax.random.normal(keys[2 * i], (WIDTH, HIDDEN)) / WIDTH**0.5,
             "w2": jax.random.normal(keys[2 * i + 1], (HIDDEN, WIDTH)) / HIDDEN**0.5}
            for i in range(layers)]
  params = [jax.device_put(p, split) for p in params]
  rows = 8 * mesh.size
  x = jax.device_put(jax.random.normal(keys[-2], (rows, WIDTH)), split)
  y = jax.device_put(jnp.tanh(jax.random.normal(keys[-1], (rows, WIDTH))), split)
  return params, x, y


def mlp(params: dict[str, Any], x: Any, numpy: Any = jnp) -> Any:
  """The layer, in jax or (`numpy=np`, params and x on the host) in numpy."""
  return numpy.tanh(x @ params["w1"]) @ params["w2"]


def host_loss(params: list[dict[str, Any]], x: Any, y: Any) -> float:
  """The mean squared error of the `params` layers in turn, computed by numpy."""
  h = np.asarray(x)
  for p in params:
    h = mlp(jax.tree.map(np.asarray, p), h, numpy=np)
  return float(np.mean((h - np.asarray(y)) ** 2))


def trained(losses: list[float], expected_first: float) -> bool:
  """Whether a train case's losses are finite and its first is numpy's."""
  return bool(np.all(np.isfinite(losses)) and np.isclose(losses[0], expected_first, rtol=1e-4))


def fsdp_step(mesh: Mesh, steps: int, donate: bool) -> Ran:
  """`steps` whole FSDP train steps, each one `jax.jit` (params and momentum donated with
  `donate`)."""
  whole, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))

  def loss(params: dict[str, Any], x: Any, y: Any) -> Any:
    gathered = jax.lax.with_sharding_constraint(params, whole)  # the all-gathers
    return jnp.mean((mlp(gathered, x) - y) ** 2)

  def step(params: dict[str, Any], momentum: dict[str, Any], x: Any, y: Any) -> Any:
    value, grads = jax.value_and_grad(loss)(params, x, y)
    grads = jax.lax.with_sharding_constraint(grads, split)  # the reduce-scatters
    momentum = jax.tree.map(lambda m, g: MOMENTUM * m + g, momentum, grads)
    params = jax.tree.map(lambda p, m: p - LEARNING_RATE * m, params, momentum)
    return params, momentum, value

  jitted = jax.jit(step, out_shardings=(split, split, whole),
                   donate_argnums=(0, 1) if donate else ())
  [params], x, y = mlp_problem(mesh, 1)
  expected_first = host_loss([params], x, y)
  momentum = jax.tree.map(jnp.zeros_like, params)
  compile_later = later_compile(jitted, params, momentum, x, y)
  losses = []
  for i in range(1, steps + 1):
    stage(f"call {i}")
    params, momentum, value = jitted(params, momentum, x, y)
    value.block_until_ready()
    stage(f"done {i}")
    losses.append(float(value))
  return {"correct": trained(losses, expected_first), "losses": losses}, {"step": compile_later}


def two_executables(mesh: Mesh, steps: int) -> Ran:
  """`steps` per-layer FSDP steps over 2 layers: a forward and a backward-and-update
  executable, compiled once and called per layer without waiting between calls."""
  whole, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))

  def forward(params: dict[str, Any], x: Any) -> Any:
    return mlp(jax.lax.with_sharding_constraint(params, whole), x)

  def backward(params: dict[str, Any], x: Any, cotangent: Any) -> Any:
    _, pullback = jax.vjp(forward, params, x)
    grads, x_cotangent = pullback(cotangent)
    grads = jax.lax.with_sharding_constraint(grads, split)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), x_cotangent

  params, x, y = mlp_problem(mesh, 2)
  expected_first = host_loss(params, x, y)
  stage("compile")
  forward_exe = jax.jit(forward, out_shardings=split).lower(params[0], x).compile()
  backward_exe = jax.jit(backward, out_shardings=(split, split)).lower(
      params[0], x, x).compile()
  losses = []
  for i in range(1, steps + 1):
    stage(f"call {i}")
    inputs = [x]
    for p in params:
      inputs.append(forward_exe(p, inputs[-1]))
    out = inputs[-1]
    # the mean squared error's cotangent: elementwise on the rows' shards, no collective
    cotangent = (out - y) * (2 / out.size)
    for layer in reversed(range(len(params))):
      params[layer], cotangent = backward_exe(params[layer], inputs[layer], cotangent)
    jax.block_until_ready(params)
    stage(f"done {i}")
    losses.append(float(np.mean((np.asarray(out) - np.asarray(y)) ** 2)))
  return ({"correct": trained(losses, expected_first), "losses": losses},
          {"forward": lambda: forward_exe, "backward": lambda: backward_exe})


CASE_FUNCTIONS = {
    "all-gather": all_gather,
    "reduce-scatter": reduce_scatter,
    "all-reduce": all_reduce,
    "fsdp-step-donated": lambda mesh, steps: fsdp_step(mesh, steps, donate=True),
    "fsdp-step": lambda mesh, steps: fsdp_step(mesh, steps, donate=False),
    "two-executables": two_executables,
}

COLLECTIVE_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                  "collective-permute")


def collectives_of(hlo: str) -> dict[str, int]:
  """The collectives of a compiled module's text by op (an async pair counted once, by its
  start)."""
  found = {}
  for op in COLLECTIVE_OPS:
    count = len(re.findall(rf"\s{op}(?:-start)?\(", hlo))
    if count:
      found[op] = count
  return found


def native_threads() -> dict[str, int]:
  """This process's threads by name (Linux: /proc/self/task/*/comm; {} elsewhere), numbered
  suffixes dropped: the runtime's own threads say which dispatch it runs (the StreamExecutor
  client's async dispatch has a `py_xla_dispatch` thread per device)."""
  names: dict[str, int] = {}
  for comm in pathlib.Path("/proc/self/task").glob("*/comm"):
    try:
      name = re.sub(r"[/_-]-?\d+$", "", comm.read_text().strip())
    except OSError:  # the thread ended meanwhile
      continue
    names[name] = names.get(name, 0) + 1
  return dict(sorted(names.items()))


def run_case(case: str, steps: int, devices: int | None, collectives: bool) -> dict[str, Any]:
  """Runs one synthetic case over a mesh of the first `devices` devices (None: all) and
  returns what the child prints."""
  begin = time.perf_counter()
  stage("backend")
  found = jax.devices()[:devices]
  backend_s = time.perf_counter() - begin
  stage("setup")
  mesh = jax.make_mesh((len(found),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=found)
  begin = time.perf_counter()
  result, executables = CASE_FUNCTIONS[case](mesh, steps)
  seconds = time.perf_counter() - begin
  if collectives:
    stage("collectives")
    result["collectives"] = {name: collectives_of(compile_now().as_text())
                             for name, compile_now in executables.items()}
  return {"case": case, "seconds": seconds, "backend_s": backend_s, **result,
          "devices": len(found), "platform": found[0].platform,
          "device_kind": found[0].device_kind, "jax": jax.__version__,
          "environment": {v: os.environ.get(v) for v in (TFRT_VARIABLE, ASYNC_VARIABLE)},
          "threads": native_threads()}


# ----------------------------------------------------------------------------------------
# The parent: a fresh process per case and client


def client_environment(client: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
  """`base` (default: this process's environment) without either client variable, with
  `client`'s, and NVLink multicast off unless `base` says otherwise."""
  env = {k: v for k, v in (os.environ if base is None else base).items()
         if k not in (TFRT_VARIABLE, ASYNC_VARIABLE)}
  env.setdefault("NCCL_NVLS_ENABLE", "0")
  return {**env, **CLIENTS[client], "PYTHONUNBUFFERED": "1"}


def run_child(command: Sequence[str], env: Mapping[str, str], timeout: float
              ) -> dict[str, Any]:
  """Runs `command` in a fresh process (its own session, output to a file: nothing blocks on
  a pipe) for at most `timeout` seconds. Returns its `status` (`ok`: exit 0; `crash`: another
  exit, with `returncode` and `signal`; `hang`: killed at the timeout), `wall_s`, the last
  JSON line it printed (`result`), its last `stage:` mark, whether XLA logged a stuck
  rendezvous, and the last lines of its output (`tail`)."""
  with tempfile.TemporaryFile("w+") as log:
    begin = time.perf_counter()
    child = subprocess.Popen(list(command), cwd=ROOT, env=dict(env), stdout=log,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
      child.wait(timeout=timeout)
      hung = False
    except subprocess.TimeoutExpired:
      os.killpg(child.pid, signal.SIGKILL)  # the child's session: it and anything it started
      child.wait()
      hung = True
    wall = time.perf_counter() - begin
    log.seek(0)
    output = log.read()
  lines = output.splitlines()
  results = [line for line in lines if line.startswith("{")]
  stages = [line.removeprefix("stage: ") for line in lines if line.startswith("stage: ")]
  code = child.returncode
  row: dict[str, Any] = {
      "status": "hang" if hung else "ok" if code == 0 else "crash", "wall_s": wall,
      "returncode": None if hung else code,
      "signal": signal.Signals(-code).name if not hung and code < 0 else None,
      "stage": stages[-1] if stages else None,
      "rendezvous_stuck": RENDEZVOUS_STUCK in output,
      "tail": lines[-TAIL_LINES:]}
  if results:
    try:
      row["result"] = json.loads(results[-1])
    except json.JSONDecodeError:
      pass  # a line of the child's log that only looks like JSON
  return row


def device_count(timeout: float) -> int:
  """How many devices a fresh process sees under the default client (this one starts no
  backend)."""
  found = run_child([sys.executable, "-c", "import jax; print(jax.device_count())"],
                    client_environment("default"), timeout)
  if found["status"] != "ok":
    sys.exit(f"could not count the devices in a child process ({found['status']}): "
             + "\n".join(found["tail"]) + "\npass --devices N to skip the count")
  return int(found["tail"][-1])


def llama_command(case: str, preset: str, devices: int, batch: int | None, steps: int,
                  out: str) -> list[str]:
  """The example's command of a Llama case, weak-scaled: the preset's batch a device."""
  from examples.llama.presets import PRESETS  # here: the children need not import flax
  batch = PRESETS[preset].batch * devices if batch is None else batch
  return [sys.executable, "-m", "examples.llama.train", "--preset", preset, "--fsdp",
          str(devices), "--batch", str(batch), "--steps", str(steps), "--no-check",
          "--generate", "0", "--out", out, *(["--whole-step"] if case == "llama-whole" else [])]


def child_command(case: str, options: argparse.Namespace) -> list[str]:
  """The probe's own command for one synthetic case, in a child."""
  return [sys.executable, *(["-P"] if sys.flags.safe_path else []), "-m",
          "benchmarks.probes.client_hang", "--child", case, "--steps", str(options.steps),
          *(["--devices", str(options.devices)] if options.devices else []),
          *(["--collectives"] if options.collectives else [])]


def reproducer(command: Sequence[str], client: str) -> str:
  """`command` as a shell line under `client`, from the repository root."""
  variables = [f"{k}={v}" for k, v in CLIENTS[client].items()]
  return " ".join([*variables, shlex.join(["python3", *command[1:]])])


def run_row(case: str, client: str, options: argparse.Namespace) -> dict[str, Any]:
  """One case under one client, in a fresh process; the row for the table and the JSON."""
  env = client_environment(client)
  if case in LLAMA:
    with tempfile.TemporaryDirectory(prefix="client-hang-llama-") as out:
      command = llama_command(case, options.llama, options.devices, options.llama_batch,
                              options.steps, out)
      found = run_child(command, env, options.llama_timeout)
    # the example prints no JSON line of ours: its time is the process's
    found["seconds"] = found["wall_s"] if found["status"] == "ok" else None
  else:
    command = child_command(case, options)
    found = run_child(command, env, options.timeout)
    result = found.get("result", {})
    if found["status"] == "ok" and not result.get("correct", False):
      found["status"] = "wrong"
    found["seconds"] = result.get("seconds")
  return {"case": case, "client": client, "client_environment": CLIENTS[client],
          "command": reproducer(command, client), **found}


def cell(row: dict[str, Any]) -> str:
  """A row's outcome in a few characters."""
  if row["status"] in ("ok", "wrong"):
    return f"{row['status']} {row['seconds']:.1f}s"
  if row["status"] == "hang":
    return f"hang@{row['stage'] or '?'}" + (" rdv" if row["rendezvous_stuck"] else "")
  return f"crash {row['signal'] or row['returncode']}"


def table(rows: Sequence[dict[str, Any]], clients: Sequence[str]) -> str:
  """Case x client: each case's outcome under each client, and the first case each client
  fails."""
  cases = list(dict.fromkeys(row["case"] for row in rows))
  found = {(row["case"], row["client"]): row for row in rows}
  lines = [f"{'case':<20}" + "".join(f"{c:>22}" for c in clients)]
  for case in cases:
    lines.append(f"{case:<20}" + "".join(
        f"{cell(found[case, c]) if (case, c) in found else '-':>22}" for c in clients))
  for client, first in first_failures(rows, clients).items():
    lines.append(f"{client}: " + ("every case ran" if first is None else
                                  f"smallest case that fails: {first}"))
  return "\n".join(lines)


def first_failures(rows: Sequence[dict[str, Any]], clients: Sequence[str]
                   ) -> dict[str, str | None]:
  """The first case (smallest first) that did not run `ok` under each client."""
  return {client: next((row["case"] for row in rows
                        if row["client"] == client and row["status"] != "ok"), None)
          for client in clients}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--clients", nargs="+", choices=list(CLIENTS), default=list(CLIENTS),
                      help="run each case under each of these GPU clients, a fresh process "
                           "each")
  parser.add_argument("--cases", nargs="+", choices=SYNTHETIC + LLAMA,
                      help="the cases to run, in this order (default: the plain-JAX ones, "
                           "and with --llama the example's two)")
  parser.add_argument("--timeout", type=float, default=60,
                      help="seconds before a plain-JAX case's process is killed as hung")
  parser.add_argument("--steps", type=int, default=3, help="train steps of the step cases")
  parser.add_argument("--devices", type=int,
                      help="the mesh's devices, the first N (default: every visible one)")
  parser.add_argument("--collectives", action="store_true",
                      help="count each executable's collectives (Compiled.as_text()) after "
                           "the case ran; as_text segfaults under async dispatch")
  parser.add_argument("--llama", metavar="PRESET",
                      help="also run the Llama example at this preset, whole step and graphed")
  parser.add_argument("--llama-batch", type=int,
                      help="the example's --batch (default: its preset's times the devices)")
  parser.add_argument("--llama-timeout", type=float, default=300,
                      help="seconds before the example's process is killed as hung (it "
                           "compiles for longer than a plain-JAX case)")
  parser.add_argument("--out", type=pathlib.Path, help="writes DIR/client_hang.json")
  parser.add_argument("--child", choices=SYNTHETIC, help=argparse.SUPPRESS)
  options = parser.parse_args()
  if options.child is not None:
    print(json.dumps(run_case(options.child, options.steps, options.devices,
                              options.collectives)), flush=True)
    return
  cases = options.cases or [*SYNTHETIC, *(LLAMA if options.llama else ())]
  if any(case in LLAMA for case in cases):
    if options.llama is None:
      parser.error("the llama cases run the example at a preset: pass --llama PRESET")
    if options.devices is None:
      options.devices = device_count(options.timeout)
  meta = {"jax": jax.__version__,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "command": "python3 -m benchmarks.probes.client_hang " + shlex.join(sys.argv[1:]),
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "nccl_nvls_enable": client_environment("default")["NCCL_NVLS_ENABLE"],
          "jax_platforms": os.environ.get("JAX_PLATFORMS"), "timeout": options.timeout,
          "llama_timeout": options.llama_timeout, "steps": options.steps}
  rows = []
  for case in cases:
    for client in options.clients:
      rows.append(run_row(case, client, options))
      row = rows[-1]
      print(f"{case} under {client}: {cell(row)}", flush=True)
      if row["status"] != "ok":
        print("  " + "\n  ".join(row["tail"][-8:]), flush=True)
      if options.out is not None:  # after every row: a run cut short keeps what it found
        options.out.mkdir(parents=True, exist_ok=True)
        (options.out / "client_hang.json").write_text(json.dumps(
            {"meta": meta, "first_failure": first_failures(rows, options.clients),
             "rows": rows}, indent=1))
  print(table(rows, options.clients))


if __name__ == "__main__":
  main()
