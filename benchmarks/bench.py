"""jaxgraph against whole-step `jax.jit` and `torch.cuda.make_graphed_callables`.

One 12-layer GPT block stack (`gpt.py`; bf16, dropout, forward + backward + SGD), run side by
side in one process per framework, timings interleaved across variants (`--reps` rounds of
`--iters` steps each; median and spread). Then, in fresh processes, each variant is built
once more alone for its cold capture time and peak device memory, and the capture of 1 layer,
12 layers, and 12 layers again from a warm persistent compilation cache. Prints a table,
writes `bench.json` and `bench.png` to `--out`.

  python3 -m benchmarks.bench --sizes small medium --out /tmp/bench
  python3 -m benchmarks.bench --tiny --out /tmp/bench   # tiny sizes, any backend

Variants (step = forward + loss gradient + backward + SGD update). A name is a base and any
of the modifiers after it, in any order (`jaxgraph-fuse-flat-recompute`):
  jaxgraph            make_graphed([block] * L, rng=True) + sequential_vjp; keys from each
                      layer's own stream (folded in inside the forward executables)
  jaxgraph-keys       the same, with explicit keys (one executable splits them per step)
  jaxgraph-raw        jaxgraph's own executables called from a bare loop, no jaxgraph Python
                      (a diagnostic: the floor of per-layer replay; jaxgraph minus this is its
                      Python overhead)
  jaxgraph-raw-own    the same, with a loaded copy of the executables per layer (a diagnostic:
                      does it pay that each copy sees stable parameter addresses, for XLA's
                      command buffers, where 12 layers share one executable otherwise?)
  jit-unrolled        one jax.jit of the whole step, layers unrolled
  jit-scan            one jax.jit of the whole step, layers in lax.scan
  torch-eager, torch-graphed (torch.cuda.make_graphed_callables), when torch sees a GPU
Modifiers:
  -nodropout          rng=False, no dropout (compared with jit-unrolled-nodropout)
  -xla                XLA's own attention instead of cuDNN's (compared with jit-unrolled-xla)
  -hooks              (jaxgraph) a no-op pre_forward and backward replay hook on every layer
  -fuse               (jaxgraph) sequential_vjp(..., fuse=True): boundary fusion replays the
                      hook-free stack as one forward and one backward executable
  -flat               (jaxgraph) each layer's params raveled (jg.flat.ravel): one buffer per
                      dtype in, one gradient buffer per dtype out
  -recompute          (jaxgraph) remat_policy=jaxgraph.residuals.recompute_elementwise:
                      elementwise intermediates recomputed in the backward, not saved
  -unpacked           (jaxgraph, a diagnostic) every kept residual travels as its own array
                      (what packing small residuals saves)
  -shared             (jaxgraph) make_graphed(..., per_layer_executables=False): the layers
                      replay one loaded executable, not a copy each (the default on GPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

# Every process of the benchmark shares one GPU: no process may reserve most of its memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxgraph as jg  # noqa: E402
from benchmarks import gpt, harness  # noqa: E402
from jaxgraph import _capture as capture_lib  # noqa: E402
from jaxgraph import residuals  # noqa: E402

JAX_VARIANTS = ("jaxgraph", "jaxgraph-keys", "jaxgraph-hooks", "jaxgraph-nodropout",
                "jaxgraph-recompute", "jaxgraph-recompute-nodropout", "jaxgraph-fuse",
                "jaxgraph-fuse-recompute", "jaxgraph-flat", "jaxgraph-fuse-flat",
                "jaxgraph-raw", "jaxgraph-raw-own", "jaxgraph-unpacked",
                "jaxgraph-fuse-unpacked", "jit-unrolled", "jit-unrolled-nodropout", "jit-scan")
TORCH_VARIANTS = ("torch-eager", "torch-graphed")
BASES = ("jaxgraph", "jaxgraph-keys", "jaxgraph-raw", "jaxgraph-raw-own", "jit-unrolled",
         "jit-scan")
# The modifiers each base takes.
MODIFIERS = {"jaxgraph": {"nodropout", "xla", "hooks", "fuse", "flat", "recompute", "unpacked",
                          "shared"},
             "jaxgraph-keys": {"xla"}, "jaxgraph-raw": {"xla"}, "jaxgraph-raw-own": {"xla"},
             "jit-unrolled": {"nodropout", "xla"}, "jit-scan": {"nodropout", "xla"}}
HERE = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a variant's name asks for: its base and modifiers."""

  base: str
  modifiers: frozenset[str]

  @property
  def diagnostic(self) -> bool:
    """What jaxgraph does with one piece changed: no probe of its own."""
    return self.base.startswith("jaxgraph-raw") or "unpacked" in self.modifiers

  @property
  def reference(self) -> str:
    """The whole-step jit it is compared with: the same dropout and attention."""
    return "-".join(["jit-unrolled", *sorted(self.modifiers & {"nodropout", "xla"})])


def parse_variant(name: str) -> Spec:
  """`jaxgraph-fuse-flat` -> Spec("jaxgraph", {"fuse", "flat"}); ValueError if unknown."""
  for base in sorted(BASES, key=len, reverse=True):
    if name == base or name.startswith(base + "-"):
      modifiers = frozenset(name[len(base) + 1:].split("-")) - {""}
      unknown = modifiers - MODIFIERS[base]
      if unknown:
        raise ValueError(f"{name}: {base} takes the modifiers {sorted(MODIFIERS[base])}, "
                         f"not {sorted(unknown)}")
      return Spec(base, modifiers)
  raise ValueError(f"{name}: a JAX variant starts with one of {BASES}")


@dataclasses.dataclass
class Variant:
  """A training step ready to run: `state = step(state)`."""

  name: str
  step: Callable[[Any], Any]
  state: Any
  capture_s: float
  executables: int  # executables replayed per step
  layers: Any = None  # the GraphedCallables, for their stats

  def advance(self) -> Any:
    """Enqueues one step; returns the new state."""
    self.state = self.step(self.state)
    return self.state


def _compile(fn: Callable[..., Any], *args: Any, donate: tuple[int, ...] = ()) -> Any:
  return jax.jit(fn, donate_argnums=donate).lower(*args).compile()


def _noop(event: jg.HookEvent) -> None:
  del event


def build(name: str, size: gpt.Size, attention: str | None, layers: int | None = None
          ) -> Variant:
  """Builds one variant from nothing (parameters, capture or compile, first step)."""
  spec = parse_variant(name)
  count = layers or size.layers
  block = gpt.make_block(size.heads, "xla" if "xla" in spec.modifiers else attention)
  params = gpt.init_params(dataclasses.replace(size, layers=count))
  if "flat" in spec.modifiers:
    params = [jg.flat.ravel(p) for p in params]
  x0 = gpt.init_input(size)
  jax.block_until_ready((params, x0))
  start = time.perf_counter()
  if spec.base.startswith("jit-"):
    variant = _build_jit(spec, block, params, x0, count)
  elif "unpacked" in spec.modifiers:
    pack_max_bytes, capture_lib.PACK_MAX_BYTES = capture_lib.PACK_MAX_BYTES, 0
    try:
      variant = _build_jaxgraph(spec, block, params, x0, count)
    finally:
      capture_lib.PACK_MAX_BYTES = pack_max_bytes
  else:
    variant = _build_jaxgraph(spec, block, params, x0, count)
  variant.name = name
  jax.block_until_ready(variant.advance())
  variant.capture_s = time.perf_counter() - start
  return variant


def _build_jaxgraph(spec: Spec, block: Callable[..., Any], params: list[Any], x0: jax.Array,
                    count: int) -> Variant:
  head = _compile(jax.grad(gpt.loss), x0)
  update = _compile(gpt.sgd, params, params, donate=(0,))
  hooks = jg.Hooks(pre_forward=[_noop], backward=[_noop]) if "hooks" in spec.modifiers else None
  policy = residuals.recompute_elementwise if "recompute" in spec.modifiers else None
  layers = jg.make_graphed([block] * count, hooks, sample_args=[(p, x0) for p in params],
                           rng="nodropout" not in spec.modifiers, remat_policy=policy,
                           per_layer_executables=False if "shared" in spec.modifiers else None)
  if spec.base.startswith("jaxgraph-raw"):
    return _raw(spec, layers, params, x0, head, update)
  if spec.base == "jaxgraph-keys":
    base = jax.random.key(2)
    split = _compile(lambda s: (tuple(jax.random.split(jax.random.fold_in(base, s), count)),
                                s + 1), jnp.int32(0))

    def keys_step(state: tuple[list[Any], jax.Array]) -> tuple[list[Any], jax.Array]:
      ps, s = state
      keys, s = split(s)
      y, pullback = jg.sequential_vjp(layers, ps, x0, keys=keys)
      grads, _ = pullback(head(y))
      return update(ps, grads), s

    return Variant(spec.base, keys_step, (params, jnp.int32(0)), 0.0,
                   executables=2 * count + 3, layers=layers)

  fuse = "fuse" in spec.modifiers

  def step(ps: list[Any]) -> list[Any]:
    y, pullback = jg.sequential_vjp(layers, ps, x0, fuse=fuse)
    grads, _ = pullback(head(y))
    return update(ps, grads)

  return Variant(spec.base, step, params, 0.0, executables=4 if fuse else 2 * count + 2,
                 layers=layers)


def _raw(spec: Spec, layers: tuple[jg.GraphedCallable, ...], params: list[Any], x0: jax.Array,
         head: Any, update: Any) -> Variant:
  """Replays the executables `layers` captured with no jaxgraph code in the loop."""
  [entry] = layers[0].executables.entries.values()  # one signature, shared by every layer
  layout = entry.layout
  backward, select = entry.backward["full"]
  assert select == tuple(range(layout.n_args)), "every argument leaf takes a gradient"
  forwards = [entry.forward["stream", True]] * len(layers)
  backwards = [backward] * len(layers)
  if spec.base == "jaxgraph-raw-own":
    forwards = [capture_lib.loaded_copy(entry.forward["stream", True]) for _ in layers]
    backwards = [capture_lib.loaded_copy(backward) for _ in layers]
  base = jax.random.key(0)
  indices = [jnp.uint32(i) for i in range(len(layers))]
  treedef = jax.tree.structure(params[0])

  def step(state: tuple[list[Any], jax.Array]) -> tuple[list[Any], jax.Array]:
    ps, counter = state
    x, saved = x0, []
    for p, index, forward in zip(ps, indices, forwards):
      leaves = [*jax.tree.leaves(p), x]
      *values, key, next_counter = forward(base, index, counter, *leaves)
      outs, inputs = values[:layout.n_out], leaves + [key]
      saved.append([*(inputs[i] for i in layout.needed_inputs),
                    *(outs[i] for i in layout.needed_outputs), *values[layout.n_out:]])
      [x] = outs
    g, grads = head(x), [None] * len(ps)
    for i in reversed(range(len(ps))):
      *leaves, g = backwards[i](*saved[i], g)
      grads[i] = jax.tree.unflatten(treedef, leaves)
    return update(ps, grads), next_counter

  return Variant(spec.base, step, (params, jnp.uint32(0)), 0.0,
                 executables=2 * len(layers) + 2, layers=layers)


def _build_jit(spec: Spec, block: Callable[..., Any], params: list[Any], x0: jax.Array,
               count: int) -> Variant:
  base = jax.random.key(2)
  dropout = "nodropout" not in spec.modifiers
  if spec.base == "jit-scan":
    params = jax.tree.map(lambda *a: jnp.stack(a), *params)

    def forward(ps: Any, keys: jax.Array) -> jax.Array:
      y, _ = jax.lax.scan(lambda x, pk: (block(pk[0], x, key=pk[1]), None), x0, (ps, keys))
      return gpt.loss(y)
  else:
    def forward(ps: Any, keys: jax.Array) -> jax.Array:
      x = x0
      for i in range(count):
        x = block(ps[i], x, key=keys[i] if dropout else None)
      return gpt.loss(x)

  def train(ps: Any, s: jax.Array) -> tuple[Any, jax.Array]:
    keys = jax.random.split(jax.random.fold_in(base, s), count)
    return gpt.sgd(ps, jax.grad(forward)(ps, keys)), s + 1

  compiled = _compile(train, params, jnp.int32(0), donate=(0,))
  return Variant(spec.base, lambda state: compiled(*state), (params, jnp.int32(0)), 0.0,
                 executables=1)


def run_steps(variant: Variant, iters: int) -> float:
  """Milliseconds per step over `iters` steps, the device drained before and after."""
  jax.block_until_ready(variant.state)
  start = time.perf_counter()
  for _ in range(iters):
    variant.advance()
  jax.block_until_ready(variant.state)
  return 1e3 * (time.perf_counter() - start) / iters


def _host_us(variant: Variant, samples: int) -> float:
  """Median host time (µs) of enqueueing one step onto an idle device."""
  times = []
  for _ in range(samples):
    jax.block_until_ready(variant.state)
    start = time.perf_counter()
    variant.advance()
    times.append(time.perf_counter() - start)
  jax.block_until_ready(variant.state)
  return 1e6 * statistics.median(times)


def time_interleaved(variants: list[Variant], iters: int, reps: int) -> dict[str, list[float]]:
  """Milliseconds per step of each variant in `reps` interleaved rounds of `iters` steps."""
  for v in variants:
    run_steps(v, 3)
  return harness.interleaved(reps, {v.name: lambda v=v: run_steps(v, iters) for v in variants})


def warm_libraries(attention: str | None) -> None:
  """Initialises cuBLAS / cuDNN handles once, so the first variant built does not pay it."""
  q = jnp.ones((1, 8, 1, 16), gpt.DTYPE)
  jax.block_until_ready((q[0, :, 0] @ q[0, :, 0].T,
                         jax.nn.dot_product_attention(q, q, q, implementation=attention)))


def run_jax(size: gpt.Size, names: list[str], attention: str | None, iters: int, reps: int
            ) -> list[dict[str, Any]]:
  """Builds the JAX variants in this process and times them interleaved."""
  variants = [build(name, size, attention) for name in names]
  times = time_interleaved(variants, iters, reps)
  records = []
  for v in variants:
    host_us = _host_us(v, max(reps, 5))
    stats = [layer.stats for layer in v.layers] if v.layers else []
    records.append(dict(
        framework="jax", variant=v.name, size=size.name, step_ms=times[v.name],
        capture_s_in_process=v.capture_s, host_us_per_step=host_us,
        host_us_per_executable=host_us / v.executables, executables_per_step=v.executables,
        compiles=sum(s.compiles for s in stats) if stats else None))
  return records


def timing(config: dict[str, Any]) -> None:
  """The JAX variants of every size, timed in this process; prints JSON lines."""
  attention = harness.attention(config["attention"])
  print(json.dumps(dict(meta=dict(harness.machine(), attention=attention))), flush=True)
  warm_libraries(attention)
  for size_name in config["sizes"]:
    for record in run_jax(gpt.SIZES[size_name], config["variants"], attention, config["iters"],
                          config["reps"]):
      print(json.dumps(dict(record=record)), flush=True)


def probe(config: dict[str, Any]) -> dict[str, Any]:
  """One variant built alone in this (fresh) process: cold capture time, peak memory."""
  if config.get("cache_dir"):
    jax.config.update("jax_compilation_cache_dir", config["cache_dir"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  size = gpt.SIZES[config["size"]]
  warm_libraries(config["attention"])
  variant = build(config["variant"], size, config["attention"], config.get("layers"))
  for _ in range(2):
    variant.advance()
  jax.block_until_ready(variant.state)
  peak = (harness.device_memory() or {}).get("peak_bytes_in_use")
  return dict(capture_s=variant.capture_s, peak_bytes=peak,
              compile_s=sum(layer.stats.compile_seconds for layer in variant.layers)
              if variant.layers else None)


def _subprocess(args: list[str], env: dict[str, str] | None = None) -> list[dict[str, Any]]:
  out = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, check=False)
  if out.returncode != 0:
    raise RuntimeError(f"{' '.join(args[:2])} failed:\n{out.stderr[-4000:]}")
  return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def run_probe(config: dict[str, Any]) -> dict[str, Any]:
  [result] = _subprocess(["-m", "benchmarks.bench", "--probe", json.dumps(config)])
  return result


def torch_available() -> str | None:
  """None when the torch peers can run, else why not (without importing torch here)."""
  if importlib.util.find_spec("torch") is None:
    return "torch is not installed"
  check = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                         capture_output=True, text=True, check=False)
  return None if check.stdout.strip() == "True" else "torch sees no CUDA device"


def print_table(records: list[dict[str, Any]], capture: dict[str, Any]) -> None:
  header = (f"{'size':7} {'variant':28} {'step ms':>8} {'spread':>7} {'x unrolled':>10} "
            f"{'capture s':>9} {'peak MiB':>9} {'host µs/exe':>11} {'exe/step':>8}")
  print("x unrolled: over the whole-step jit with the same dropout and attention")
  print(header)
  print("-" * len(header))
  for r in records:
    peak = f"{r['peak_bytes'] / 2**20:9.0f}" if r.get("peak_bytes") else f"{'-':>9}"
    host = (f"{r['host_us_per_executable']:11.1f}" if r.get("host_us_per_executable")
            else f"{'-':>11}")
    ratio = f"{r['x_unrolled']:10.3f}" if r.get("x_unrolled") else f"{'-':>10}"
    print(f"{r['size']:7} {r['variant']:28} {r['step']['median']:8.3f} "
          f"{r['step']['spread_pct']:6.1f}% {ratio} {r['capture_s']:9.2f} {peak} {host} "
          f"{r.get('executables_per_step') or '-':>8}")
  for size, c in capture.items():
    print(f"capture {size}: 1 layer {c['layers_1_s']:.2f} s, {c['layers_n']} layers "
          f"{c['layers_n_s']:.2f} s (x{c['depth_ratio']:.2f}); persistent cache cold "
          f"{c['cache_cold_s']:.2f} s, warm {c['cache_warm_s']:.2f} s "
          f"({100 * c['warm_over_cold']:.0f}%)")


def plot(records: list[dict[str, Any]], path: str) -> bool:
  try:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
  except ImportError:
    return False
  sizes = list(dict.fromkeys(r["size"] for r in records))
  fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
  for ax, size in zip(axes[0], sizes):
    rows = [r for r in records if r["size"] == size]
    names = [r["variant"] for r in rows]
    medians = [r["step"]["median"] for r in rows]
    errors = [[m - r["step"]["min"] for m, r in zip(medians, rows)],
              [r["step"]["max"] - m for m, r in zip(medians, rows)]]
    colors = ["tab:blue" if n.startswith("jaxgraph") else "tab:orange" if n.startswith("jit")
              else "tab:green" for n in names]
    ax.barh(names, medians, xerr=errors, color=colors)
    for i, r in enumerate(rows):
      if r.get("x_unrolled"):
        ax.text(r["step"]["max"], i, f" {r['x_unrolled']:.2f}x", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("step time (ms), median and min-max")
    ax.set_title(f"{size}")
  fig.suptitle("GPT block stack, fwd + bwd + SGD (x: over whole-step jit, unrolled)",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return True


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", nargs="+", default=["small", "medium"], choices=list(gpt.SIZES))
  parser.add_argument("--tiny", action="store_true", help="tiny sizes on any backend (CI)")
  parser.add_argument("--variants", nargs="+", default=list(JAX_VARIANTS + TORCH_VARIANTS))
  harness.add_timing_flags(parser, iters=20, reps=5)
  parser.add_argument("--no-probes", action="store_true",
                      help="skip the fresh-process capture / memory / cache measurements")
  parser.add_argument("--capture-sizes", nargs="*", default=None,
                      help="sizes for the 1-layer and persistent-cache capture probes "
                      "(default: all of --sizes)")
  parser.add_argument("--out", default=".", help="folder for bench.json and bench.png")
  parser.add_argument("--probe", help=argparse.SUPPRESS)
  parser.add_argument("--timing", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.probe:
    print(json.dumps(probe(json.loads(args.probe))), flush=True)
    return
  if args.timing:
    timing(json.loads(args.timing))
    return
  if args.tiny:
    args.sizes, args.iters, args.reps = ["tiny"], min(args.iters, 3), min(args.reps, 3)
  jax_names = [v for v in args.variants if v not in TORCH_VARIANTS]
  torch_names = [v for v in args.variants if v in TORCH_VARIANTS]
  for name in jax_names:
    try:
      parse_variant(name)
    except ValueError as e:
      parser.error(str(e))
  # This process never touches the device: each measurement runs in a process of its own,
  # so that none of them finds the GPU's memory held by another.
  lines = _subprocess(["-m", "benchmarks.bench", "--timing", json.dumps(dict(
      sizes=args.sizes, variants=jax_names, attention=args.attention, iters=args.iters,
      reps=args.reps))])
  meta = dict(lines[0]["meta"], command=" ".join(sys.argv), iters=args.iters, reps=args.reps,
              skipped={})
  attention = meta["attention"]
  records = [line["record"] for line in lines[1:]]
  torch_missing = torch_available() if torch_names else "not asked for"
  if torch_missing is None:
    sizes = [dataclasses.asdict(gpt.SIZES[s]) for s in args.sizes]
    lines = _subprocess([os.path.join(HERE, "torch_peer.py"),
                         json.dumps(dict(sizes=sizes, iters=args.iters, reps=args.reps))])
    meta.update(lines[0]["meta"])
    records += [line["record"] for line in lines[1:]]
  else:
    meta["skipped"].update({name: torch_missing for name in torch_names})
  capture = {}
  if not args.no_probes:
    for r in records:
      if r["framework"] == "jax" and not parse_variant(r["variant"]).diagnostic:
        # A fresh process per variant: no in-process compile caches, a clean memory peak.
        result = run_probe(dict(size=r["size"], variant=r["variant"], attention=attention))
        r["capture_s"] = result["capture_s"]
        r["peak_bytes"] = result["peak_bytes"]
        r["probe_compile_s"] = result["compile_s"]
    for size_name in (args.sizes if args.capture_sizes is None else args.capture_sizes):
      full = [r for r in records if r["size"] == size_name and r["variant"] == "jaxgraph"]
      capture[size_name] = capture_probes(gpt.SIZES[size_name], attention,
                                          full[0]["capture_s"] if full else None)
  for r in records:
    r.setdefault("capture_s", r.get("capture_s_in_process", 0.0))
    r["step"] = harness.summary(r["step_ms"])
  for r in records:
    reference = (parse_variant(r["variant"]).reference if r["framework"] == "jax"
                 else "jit-unrolled")
    base = [b for b in records if b["size"] == r["size"] and b["variant"] == reference]
    if base:
      r["x_unrolled"] = r["step"]["median"] / base[0]["step"]["median"]
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "bench.json"), "w") as f:
    json.dump(dict(meta=meta, records=records, capture=capture), f, indent=1)
  print(json.dumps(meta))
  print_table(records, capture)
  if not plot(records, os.path.join(args.out, "bench.png")):
    print("matplotlib is not installed: no plot")


def capture_probes(size: gpt.Size, attention: str | None, full_s: float | None
                   ) -> dict[str, Any]:
  """Capture of 1 layer vs all layers (fresh processes), and cold vs warm persistent cache.

  `full_s` is the capture time of all layers if a fresh process measured it already.
  """
  one = run_probe(dict(size=size.name, variant="jaxgraph", layers=1, attention=attention))
  if full_s is None:
    full_s = run_probe(dict(size=size.name, variant="jaxgraph", attention=attention))["capture_s"]
  with tempfile.TemporaryDirectory(prefix="jaxgraph-cache-") as cache_dir:
    config = dict(size=size.name, variant="jaxgraph", attention=attention, cache_dir=cache_dir)
    cold = run_probe(config)
    warm = run_probe(config)
  return dict(layers_1_s=one["capture_s"], layers_n=size.layers, layers_n_s=full_s,
              depth_ratio=full_s / one["capture_s"], cache_cold_s=cold["capture_s"],
              cache_warm_s=warm["capture_s"], warm_over_cold=warm["capture_s"] / cold["capture_s"])


if __name__ == "__main__":
  main()
