"""Whether XLA's CPU runtime hangs on in-process collectives when executions pile up.

Plain JAX, no jaxgraph: a 2-layer FSDP MLP on 8 virtual CPU devices, each layer's forward
and backward its own `jax.jit` (weights all-gathered inside), trained with SGD from Python
the way a per-layer runner dispatches (about 30 executions a step). `--processes` copies
run at once to load the cores. Each copy runs `--steps` steps, waiting for the results
every `--wait-every` steps (0: never until the end), and reports whether it finished or
XLA aborted it in a collective that not every device joined within `--timeout` seconds
(`--xla_cpu_collective_call_terminate_timeout_seconds`; the hang itself outlasts 400 s on
an idle machine, docs/reliability.md), or it ran past `--deadline` (killed: stuck elsewhere).

Found behind a worker abort in the CPU suite (docs/reliability.md, "CPU collectives"):
with more executions in flight on a device than its limit (32), the thread launching the
next one blocks on that device's semaphore inside the runtime's thread pool, which has one
thread per device on a machine with fewer cores; the devices already in an all-gather wait
for one that no free thread can start.

  python3 -m benchmarks.probes.cpu_collective_deadlock --processes 4 \\
      --steps 1500 --wait-every 0 1 0 1                  # 2 cores: some abort, then none
  python3 -m benchmarks.probes.cpu_collective_deadlock --processes 1 \\
      --steps 3 --wait-every 0 1                         # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

DEVICES = 8


def child(steps: int, wait_every: int) -> None:
  """One copy: trains and prints each step it dispatched (or, waiting, finished)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((DEVICES,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  whole = NamedSharding(mesh, P())
  # Each weight split along its largest dimension (as `jg.fsdp.shard` places them).
  split = {"w1": NamedSharding(mesh, P(None, "fsdp")), "b1": NamedSharding(mesh, P("fsdp")),
           "w2": NamedSharding(mesh, P("fsdp", None))}

  def layer(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    p = jax.lax.with_sharding_constraint(p, {k: whole for k in p})  # the all-gathers
    return x + jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]

  keys = jax.random.split(jax.random.key(0), 4)
  params = [jax.device_put({"w1": 0.25 * jax.random.normal(keys[2 * i], (16, 32)),
                            "b1": jnp.zeros(32),
                            "w2": 0.18 * jax.random.normal(keys[2 * i + 1], (32, 16))}, split)
            for i in range(2)]
  x = jax.device_put(jnp.ones((8, 16)), whole)
  forward = jax.jit(layer)
  backward = jax.jit(lambda p, x, g: jax.vjp(layer, p, x)[1](g))
  for step in range(steps):
    inputs = [x]
    for p in params:
      inputs.append(forward(p, inputs[-1]))
    g = (inputs[-1] / inputs[-1].size).astype(x.dtype)
    grads = [None] * len(params)
    for i in reversed(range(len(params))):
      grads[i], g = backward(params[i], inputs[i], g)
    params = [jax.tree.map(lambda w, d: (w - 0.01 * d).astype(w.dtype), p, d)
              for p, d in zip(params, grads)]
    if wait_every and (step + 1) % wait_every == 0:
      jax.block_until_ready(params)
    print(step, flush=True)
  jax.block_until_ready(params)


def run(processes: int, steps: int, wait_every: int, timeout: int, deadline: int
        ) -> dict[str, object]:
  """`processes` copies at once: how many finished, XLA aborted, or had to be killed."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
      f"--xla_force_host_platform_device_count={DEVICES} "
      f"--xla_cpu_collective_call_terminate_timeout_seconds={timeout}"))
  command = [sys.executable, __file__, "--child", str(steps), str(wait_every)]
  begin = time.perf_counter()
  with tempfile.TemporaryDirectory() as folder:
    # Output to files, not pipes: a copy never blocks on a full pipe nobody reads yet.
    logs = [(open(os.path.join(folder, f"{i}.out"), "w+"),
             open(os.path.join(folder, f"{i}.err"), "w+")) for i in range(processes)]
    copies = [subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True)
              for out, err in logs]
    outcomes = []
    for copy, (out, err) in zip(copies, logs):
      try:
        copy.wait(timeout=max(1.0, deadline - (time.perf_counter() - begin)))
        killed = False
      except subprocess.TimeoutExpired:
        copy.kill()
        copy.wait()
        killed = True
      out.seek(0)
      err.seek(0)
      stdout, stderr = out.read(), err.read()
      aborted = "Termination timeout" in stderr
      outcomes.append(dict(
          returncode=copy.returncode, steps_dispatched=len(stdout.split()), aborted=aborted,
          killed=killed, error=None if copy.returncode == 0 or aborted or killed
          else stderr[-500:]))
    for out, err in logs:
      out.close()
      err.close()
  finished = sum(o["returncode"] == 0 for o in outcomes)
  aborted = sum(o["aborted"] for o in outcomes)
  killed = sum(o["killed"] for o in outcomes)
  return dict(processes=processes, steps=steps, wait_every=wait_every, finished=finished,
              aborted=aborted, killed=killed, other=processes - finished - aborted - killed,
              seconds=time.perf_counter() - begin, copies=outcomes)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--processes", type=int, default=4)
  parser.add_argument("--steps", type=int, default=1500)
  parser.add_argument("--wait-every", type=int, nargs="+", default=[0, 1],
                      help="wait for the results every N steps (0: only at the end)")
  parser.add_argument("--timeout", type=int, default=20,
                      help="seconds before XLA aborts an all-gather not every device joined")
  parser.add_argument("--deadline", type=int, default=900,
                      help="seconds before the copies still running are killed")
  parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    child(*args.child)
    return
  results = [run(args.processes, args.steps, n, args.timeout, args.deadline)
             for n in args.wait_every]
  print(f"{'wait every':>10} {'copies':>6} {'finished':>8} {'aborted':>7} {'killed':>6} "
        f"{'other':>5} {'seconds':>8}")
  for r in results:
    print(f"{r['wait_every'] or 'never':>10} {r['processes']:>6} {r['finished']:>8} "
          f"{r['aborted']:>7} {r['killed']:>6} {r['other']:>5} {r['seconds']:>8.1f}")
  print(json.dumps(dict(cores=os.cpu_count(), results=results)))


if __name__ == "__main__":
  main()
