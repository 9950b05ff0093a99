"""Where the forward/backward split costs device time, and what each lead takes back.

One process, one model size: the whole-step jit and jaxgraph variants (with and without
dropout, with each residual policy), timed interleaved (`--reps` rounds of `--iters` steps,
the order reversed every round), residual bytes per layer, and a `jax.profiler` device trace
of one step of each variant named in `--profile`, kernels grouped by name.

  PYTHONPATH=.:benchmarks python3 benchmarks/split_probe.py --size medium --out /tmp/probe

Variants: jit[-nodrop] (one jax.jit of the unrolled step, SGD inside), jaxgraph[-nodrop]
(per-layer replay, separate loss-gradient and SGD executables), jaxgraph-elementwise[-nodrop]
(`remat_policy=jaxgraph.residuals.recompute_elementwise`), jaxgraph-elementwise-named[-nodrop]
(the same, with the block's matmul inputs named by `checkpoint_name`, so saved),
jaxgraph-dots[-nodrop]
(`jax.checkpoint_policies.dots_saveable`).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time
from typing import Any, Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import gpt  # noqa: E402
import jaxgraph as jg  # noqa: E402
from jaxgraph import residuals  # noqa: E402

POLICIES: dict[str, Callable[..., bool] | None] = {
    "": None,
    "-elementwise": residuals.recompute_elementwise,
    "-elementwise-named": residuals.recompute_elementwise,  # block names its matmul inputs
    "-dots": jax.checkpoint_policies.dots_saveable,
}


def _compile(fn: Callable[..., Any], *args: Any, donate: tuple[int, ...] = ()) -> Any:
  return jax.jit(fn, donate_argnums=donate).lower(*args).compile()


def build(name: str, size: gpt.Size, attention: str | None) -> tuple[Callable, Any, dict]:
  """`(step, state, info)` for one variant."""
  dropout = not name.endswith("-nodrop")
  base_name = name.removesuffix("-nodrop")
  block = gpt.make_block(size.heads, attention, name_matmul_inputs="-named" in name)
  params = gpt.init_params(size)
  x0 = gpt.init_input(size)
  count = size.layers
  if base_name == "jit":
    seed = jax.random.key(2)

    def train(ps: Any, s: jax.Array) -> tuple[Any, jax.Array]:
      keys = jax.random.split(jax.random.fold_in(seed, s), count)

      def forward(ps: Any) -> jax.Array:
        x = x0
        for i in range(count):
          x = block(ps[i], x, key=keys[i] if dropout else None)
        return gpt.loss(x)

      return gpt.sgd(ps, jax.grad(forward)(ps)), s + 1

    compiled = _compile(train, params, jnp.int32(0), donate=(0,))
    return (lambda state: compiled(*state)), (params, jnp.int32(0)), {}
  policy = POLICIES[base_name.removeprefix("jaxgraph")]
  head = _compile(jax.grad(gpt.loss), x0)
  update = _compile(gpt.sgd, params, params, donate=(0,))
  layers = jg.make_graphed([block] * count, sample_args=[(p, x0) for p in params],
                           rng=dropout, remat_policy=policy)

  def step(ps: list[Any]) -> list[Any]:
    y, pullback = jg.sequential_vjp(layers, ps, x0)
    grads, _ = pullback(head(y))
    return update(ps, grads)

  stats = layers[0].stats
  return step, params, {"residual_mib": stats.residual_bytes / 2**20,
                        "compile_s": stats.compile_seconds}


def run_steps(step: Callable, state: Any, iters: int) -> tuple[float, Any]:
  jax.block_until_ready(state)
  start = time.perf_counter()
  for _ in range(iters):
    state = step(state)
  jax.block_until_ready(state)
  return 1e3 * (time.perf_counter() - start) / iters, state


def device_groups(step: Callable, state: Any, steps: int = 3) -> tuple[dict, float, Any]:
  """GPU busy ms per step, by kernel name (numeric suffixes stripped)."""
  folder = tempfile.mkdtemp()
  with jax.profiler.trace(folder, create_perfetto_trace=True):
    for _ in range(steps):
      state = step(state)
    jax.block_until_ready(state)
  path = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)[0]
  trace = json.load(gzip.open(path))
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  processes = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu = {pid for pid, n in processes.items() if "gpu" in n.lower() and "host" not in n.lower()}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  streams = {k for k, n in threads.items()
             if k[0] in gpu and "stream" in n.lower() and "op" not in n.lower()} or {
                 k for k in threads if k[0] in gpu}
  groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
  total = 0.0
  for e in events:
    if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams and "dur" in e:
      key = re.sub(r"[._]\d+.*$", "", e["name"])[:48]
      groups[key][0] += e["dur"] / steps / 1e3
      groups[key][1] += 1 / steps
      total += e["dur"] / steps / 1e3
  return dict(groups), total, state


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="medium", choices=sorted(gpt.SIZES))
  parser.add_argument("--variants", nargs="+", default=[
      "jit-nodrop", "jaxgraph-nodrop", "jaxgraph-elementwise-nodrop", "jaxgraph-dots-nodrop",
      "jit", "jaxgraph", "jaxgraph-elementwise"])
  parser.add_argument("--profile", nargs="*", default=["jit-nodrop",
                                                       "jaxgraph-elementwise-nodrop"])
  parser.add_argument("--iters", type=int, default=8)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  size = gpt.SIZES[args.size]
  attention = gpt.default_attention()
  built = {}
  for name in args.variants:
    start = time.perf_counter()
    step, state, info = build(name, size, attention)
    _, state = run_steps(step, state, 3)
    info["build_s"] = time.perf_counter() - start
    built[name] = [step, state, info]
    print(f"built {name} in {info['build_s']:.1f} s {info}", flush=True)
  times: dict[str, list[float]] = {name: [] for name in built}
  for rep in range(args.reps):
    for name in (list(built) if rep % 2 == 0 else list(built)[::-1]):
      ms, built[name][1] = run_steps(built[name][0], built[name][1], args.iters)
      times[name].append(ms)
  profiles = {}
  for name in args.profile:
    if name in built:
      groups, total, built[name][1] = device_groups(built[name][0], built[name][1])
      profiles[name] = {"busy_ms": total, "groups": groups}
  reference = {True: "jit", False: "jit-nodrop"}
  print(f"\n{'variant':32s} {'step ms':>24s} {'x jit':>7s} {'resid MiB':>10s}")
  rows = {}
  for name, ts in times.items():
    ref = reference[not name.endswith("-nodrop")]
    ratio = statistics.median(ts) / statistics.median(times[ref]) if ref in times else float("nan")
    rows[name] = {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts),
                  "x_jit": ratio, **built[name][2]}
    print(f"{name:32s} {statistics.median(ts):8.2f} ({min(ts):6.2f}-{max(ts):6.2f}) "
          f"{ratio:7.3f} {built[name][2].get('residual_mib', float('nan')):10.1f}")
  if len(profiles) == 2:
    (na, a), (nb, b) = profiles.items()
    print(f"\nGPU busy ms/step: {na} {a['busy_ms']:.2f}  {nb} {b['busy_ms']:.2f}")
    ga, gb = a["groups"], b["groups"]
    keys = sorted(set(ga) | set(gb), key=lambda k: -abs(gb.get(k, [0, 0])[0]
                                                        - ga.get(k, [0, 0])[0]))
    print(f"{'kernel group':48s} {na[:9]:>9s} {'n':>5s} {nb[:9]:>9s} {'n':>5s} {'diff':>7s}")
    for k in keys[:22]:
      (ma, ca), (mb, cb) = ga.get(k, [0, 0]), gb.get(k, [0, 0])
      print(f"{k:48s} {ma:9.2f} {ca:5.0f} {mb:9.2f} {cb:5.0f} {mb - ma:7.2f}")
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"split_probe_{args.size}.json"), "w") as f:
      json.dump({"size": args.size, "device": str(jax.devices()[0]),
                 "jax": jax.__version__, "rows": rows, "times": times,
                 "profiles": profiles}, f, indent=1)


if __name__ == "__main__":
  main()
