"""What one training step of the Llama example asks of the host: its executable calls by
kind, its transfers, and whether it waits for the devices.

Runs `examples/llama/train.py` with the flags given (after `--`) and counts, inside
`Trainer.step` and the making of its batches (`step_batches`), from the third step on (the
first ones compile what they use first): every `Compiled.__call__` (jaxgraph's executables
named by layer, `embedding`, `block`, `head` or `fused blocks` and `forward` or `backward`;
the others by their module: the step's zeros, `accumulate`, `apply_update`), every
`jax.device_put` and `jax.make_array_from_callback`, and every wait
(`jax.block_until_ready`, `jax.device_get`). Prints a table and a JSON line; the run stops
after `--steps` counted steps.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
      python3 -m benchmarks.probes.llama_step_calls -- --preset tiny --fsdp 4 --no-check
  python3 -m benchmarks.probes.llama_step_calls -- --preset gpu --fsdp 4 \
      --batch 64 --no-check      # 4 GPUs; also with --fuse 12

The counts are the host's work, not its time: on the CPU the example also waits for every
step (`Placement.wait`, CPU only), which the table shows as a wait.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from typing import Any, Callable

import jax
from jax import stages

import jaxgraph as jg
from examples.llama import train as train_lib
from examples.llama import trainer as trainer_lib


class _Done(Exception):
  """Raised once the steps asked for are counted: the run stops there."""


class Counter:
  """Counts what `patch` intercepts into `current` (None: nothing is counted), per step
  (`steps`: each step's counts, the making of its batches first)."""

  def __init__(self) -> None:
    self.current: collections.Counter | None = None
    self.batches = collections.Counter()  # of the batches made last: the next step's
    self.steps: list[collections.Counter] = []
    self.labels: dict[int, str] = {}  # id of a jaxgraph executable -> its kind

  @property
  def active(self) -> bool:
    return self.current is not None

  def add(self, what: str) -> None:
    if self.current is not None:
      self.current[what] += 1

  def label(self, layers: list[Any]) -> None:
    """Names every executable the graphed layers (and their fused segments) replay."""
    def name(graphed: Any, kind: str) -> None:
      for entry in graphed.executables.entries.values():
        for exe in entry.forward.values():
          self.labels[id(exe)] = f"{kind} forward"
        for exe, _ in entry.backward.values():
          self.labels[id(exe)] = f"{kind} backward"
      for exe, local in graphed.executables.replayed.items():
        self.labels[id(local)] = self.labels.get(id(exe), f"{kind} ?")

    graphed = [layer for layer in layers if isinstance(layer, jg.GraphedCallable)]
    for i, layer in enumerate(layers):
      if isinstance(layer, jg.GraphedCallable):
        name(layer, "embedding" if i == 0 else "head" if i == len(layers) - 1 else "block")
    for layer in graphed[:1]:
      for segment in layer.config.segments.values():
        name(segment, "fused blocks")


def _module_name(compiled: Any) -> str:
  text = compiled.as_text()
  first = text.split("\n", 1)[0].split()
  return first[1].rstrip(",") if len(first) > 1 and first[0] == "HloModule" else "?"


def patch(counter: Counter, steps: int) -> None:
  """Wraps what a step calls (see the module's docstring) to count into `counter`."""
  names: dict[int, str] = {}
  call = stages.Compiled.__call__

  def counted_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    if counter.active:
      label = counter.labels.get(id(self))
      if label is None:
        label = names.get(id(self)) or names.setdefault(id(self), _module_name(self))
      counter.add(f"call: {label}")
    return call(self, *args, **kwargs)

  stages.Compiled.__call__ = counted_call
  for module, name in ((jax, "device_put"), (jax, "make_array_from_callback"),
                       (jax, "block_until_ready"), (jax, "device_get")):
    original = getattr(module, name)
    kind = "wait" if name in ("block_until_ready", "device_get") else "transfer"
    setattr(module, name, _counting(original, counter, f"{kind}: jax.{name}"))

  step = trainer_lib.Trainer.step
  batches = train_lib.step_batches

  def counted_step(self: Any, *args: Any, **kwargs: Any) -> Any:
    if not counter.labels:
      counter.label(list(self.layers))
    counter.current, counter.batches = counter.batches, collections.Counter()
    counter.steps.append(counter.current)
    try:
      return step(self, *args, **kwargs)
    finally:
      counter.current = None
      if len(counter.steps) >= steps + 2:
        raise _Done

  def counted_batches(*args: Any, **kwargs: Any) -> Any:
    counter.current = counter.batches = collections.Counter()
    try:
      return batches(*args, **kwargs)
    finally:
      counter.current = None

  trainer_lib.Trainer.step = counted_step
  train_lib.step_batches = counted_batches


def _counting(fn: Callable[..., Any], counter: Counter, what: str) -> Callable[..., Any]:
  def counted(*args: Any, **kwargs: Any) -> Any:
    counter.add(what)
    return fn(*args, **kwargs)
  return counted


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=2, help="steps counted (after two)")
  parser.add_argument("train_args", nargs="*", help="after --: examples/llama/train.py's flags")
  args = parser.parse_args()
  counter = Counter()
  patch(counter, args.steps)
  with tempfile.TemporaryDirectory() as out:
    try:
      train_lib.main([*args.train_args, "--out", out, "--fresh"])
    except _Done:
      pass
  counted = counter.steps[2:2 + args.steps]
  if len(counted) < args.steps:
    raise SystemExit(f"the run made {len(counter.steps)} steps; count fewer (--steps) or "
                     "let it run longer")
  per_step = {k: sum(c[k] for c in counted) / len(counted)
              for k in sorted(set().union(*counted))}
  calls = sum(v for k, v in per_step.items() if k.startswith("call: "))
  for kind, n in per_step.items():
    print(f"{kind:48s} {n:8.1f}")
  print(f"{'executable calls a step':48s} {calls:8.1f}")
  print(json.dumps({"train_args": args.train_args, "per_step": per_step, "calls": calls,
                    "devices": jax.device_count(), "backend": jax.default_backend()}))


if __name__ == "__main__":
  main()
