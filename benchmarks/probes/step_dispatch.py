"""What a Llama training step makes jax do on the host besides launching its executables.

Two things cost the driving thread per call and are invisible in a profile of the layers:
an argument placed otherwise than the executable takes it (jax moves it first: a copy to
every device of a mesh, on every call), and a call that takes jax's Python dispatch path
instead of its C++ one (a NumPy argument or result, a function jax cannot cache). This probe
builds the example's step as `examples/llama/train.py` does (`train.build`, the example's
flags after `--`), runs `--warmup` steps, then counts both over `--steps` steps: per step,
by what was moved (shape, dtype, from, to: devices, spec, axis types, memory kind if not
the device's) and by function. jax moves an array the same way for `jax.device_put`, so the
copies a step asks for are counted too: what a pipeline hands between its stages
(activations, cotangents, targets), what offload copies to host memory and back. A sharded
step without them moves nothing.

  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
    python3 -m benchmarks.probes.step_dispatch -- --preset tiny --fsdp 2 --prefetch
  python3 -m benchmarks.probes.step_dispatch -- --preset gpu --fsdp 4       # 4 GPUs

It reads two of jax's internals, `pxla.shard_arg_handlers` (where a jax.Array argument is
moved) and `pjit._run_python_pjit` (the Python path), as jax 0.10.2 and 0.11.1 name them.
Prints a table and, with `--json PATH`, writes the counts there.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from typing import Any, Iterator

import jax
from jax._src import array as array_lib
from jax._src import pjit
from jax._src.interpreters import pxla

from examples.llama import train
from examples.llama.data import step_batches


class Counts:
  """The arguments moved before calls and the calls on jax's Python path, while counting."""

  def __init__(self):
    self.moved: collections.Counter[str] = collections.Counter()
    self.python: collections.Counter[str] = collections.Counter()
    self.counting = False

  def install(self) -> None:
    """Wraps jax's argument handler for jax.Arrays and its Python dispatch path."""
    shard = pxla.shard_arg_handlers[array_lib.ArrayImpl]
    run_python = pjit._run_python_pjit

    def counted_shard(xs: Any, shardings: Any, *args: Any) -> Any:
      if self.counting:
        for x, sharding in zip(xs, shardings):
          # jax copies only what is placed otherwise (an equivalent sharding is no move)
          if x.sharding != sharding and not x.sharding.is_equivalent_to(sharding, x.ndim):
            self.moved[f"{x.dtype}{list(x.shape)} {_short(x.sharding)} -> "
                       f"{_short(sharding)}"] += 1
      return shard(xs, shardings, *args)

    def counted_python(p: Any, args_flat: Any, fun: Any, *args: Any, **kwargs: Any) -> Any:
      if self.counting:
        self.python[re.sub(r" at 0x[0-9a-f]+", "", getattr(fun, "__name__", repr(fun)))] += 1
      return run_python(p, args_flat, fun, *args, **kwargs)

    pxla.shard_arg_handlers[array_lib.ArrayImpl] = counted_shard
    pjit._run_python_pjit = counted_python


def _short(sharding: Any) -> str:
  """A sharding in a few words: its devices' ids, its spec and its mesh's axis types."""
  ids = ",".join(str(d.id) for d in sorted(sharding.device_set, key=lambda d: d.id))
  spec = getattr(sharding, "spec", None)
  mesh = getattr(sharding, "mesh", None)
  kinds = "" if mesh is None else "/" + ",".join(str(t).split(".")[-1] for t in mesh.axis_types)
  memory = "" if sharding.memory_kind in (None, "device") else f" {sharding.memory_kind}"
  return f"[{ids}]{'' if spec is None else spec}{kinds}{memory}"


def _steps(built: Any, first: int, count: int) -> Iterator[None]:
  params, opt_state = built.params, built.opt_state
  positions, microbatches = built.captured.positions, built.preset.microbatches
  loss = None
  for step in range(first, first + count):
    params, opt_state, loss = built.trainer.step(
        params, opt_state, step_batches(built.corpus, step, microbatches), positions)
    yield
  jax.block_until_ready(loss)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--json", metavar="PATH")
  parser.add_argument("example", nargs=argparse.REMAINDER,
                      help="the example's flags, after --")
  args = parser.parse_args()
  example = args.example[1:] if args.example[:1] == ["--"] else args.example
  counts = Counts()
  counts.install()
  built = train.build(train.parse(example))
  # one generator: the steps continue from the warm-up's state (the steps donate it)
  steps = _steps(built, 0, args.warmup + args.steps)
  for _ in range(args.warmup):
    next(steps)
  counts.counting = True
  for _ in steps:
    pass
  per_step = {kind: {name: n / args.steps for name, n in found.most_common()}
              for kind, found in (("moved", counts.moved), ("python_path", counts.python))}
  print(f"per step, over {args.steps} steps after {args.warmup} ({' '.join(example)}):")
  for kind, found in per_step.items():
    print(f"  {kind}: {sum(found.values()):g}")
    for name, n in found.items():
      print(f"    {n:8.2f}  {name}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"example": example, "steps": args.steps, "warmup": args.warmup,
                 "platform": jax.devices()[0].platform, **per_step}, f, indent=1)


if __name__ == "__main__":
  main()
