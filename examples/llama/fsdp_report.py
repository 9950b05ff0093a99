"""--fsdp's report: where every array of the training state lives, its bytes per device, and
the collectives in the compiled HLO of every executable of a step (printed, and in
metrics.json). docs/fsdp.md."""

from __future__ import annotations

import re
from typing import Any, Iterator, Sequence

import jax

import jaxgraph as jg
from examples.corpus import Corpus

from .layers import Layer, Params, graphed
from .memory import state_bytes
from .placement import Placement
from .trainer import Stepper, Trainer


COLLECTIVE = re.compile(r"\b(all-gather|reduce-scatter|all-reduce)(?:-start)?\(")
ELEMENT_TYPE = re.compile(r"\b(bf16|f16|f32|f64|s32|u32|pred)\[")


def collectives(compiled: Any) -> dict[str, int]:
  """The collectives in the compiled HLO of `compiled`, by op and element type (`all-gather
  bf16`; one that combines arrays of several types, `all-reduce bf16/f32`); an asynchronous
  pair, `-start` and `-done`, counts once. On CPU a reduce-scatter compiles to an all-reduce
  and a dynamic-slice, and XLA runs bfloat16 collectives in float32 (docs/fsdp.md)."""
  counts: dict[str, int] = {}
  for line in compiled.as_text().splitlines():
    found = COLLECTIVE.search(line)
    if found is None or "=" not in line[:found.start()]:
      continue  # not an instruction that defines a collective
    types = sorted(set(ELEMENT_TYPE.findall(line[line.index("=") + 1:found.start()])))
    key = f"{found.group(1)} {'/'.join(types)}"
    counts[key] = counts.get(key, 0) + 1
  return counts


def layer_executables(layer: jg.GraphedCallable) -> tuple[Any, Any]:
  """The training forward and the backward `layer` replays (its one captured signature)."""
  # jaxgraph keeps its executables private; examples/fsdp_train.py reads them the same way.
  (entry,) = layer.executables.entries.values()
  forward = next(c for (_, residuals), c in entry.forward.items() if residuals)
  return forward, entry.backward["full"][0]


def named_executables(layers: Sequence[Layer]) -> Iterator[tuple[str, Any]]:
  """Per graphed layer of `layers`, the training forward and backward it replays, named
  `"Block[1] forward"`: identical blocks replay one entry, named after the first, so a
  shared executable comes once per layer under one name. A block of a prefetching chain
  replays its step's (`"prefetch(Block[2]) forward"`: the first, middle and last block of
  the chain each replay their own); with --fuse K a segment's step comes once, under its
  first block, named after its blocks (`"prefetch(Block[1]..Block[4]) forward"`)."""
  names: dict[int, str] = {}
  inside: set[jg.GraphedCallable] = set()  # blocks a segment's step led by another replays
  for layer in graphed(layers):
    if layer in inside:
      continue
    steps = [step for step in jg.prefetch.steps_of(layer) if step.executables.entries]
    for step in steps:
      inside.update(step.layers[1:])
    for owner in steps or [layer]:
      forward, backward = layer_executables(owner)
      name = names.setdefault(id(forward), owner.name)
      yield f"{name} forward", forward
      yield f"{name} backward", backward


def placements(tree: Any) -> list[dict[str, Any]]:
  """Per array of `tree`: its path, its elements, the devices it spans, one shard's elements."""
  return [{"path": jax.tree_util.keystr(path), "size": int(x.size),
           "devices": len(x.sharding.device_set),
           "shard": int(x.addressable_shards[0].data.size)}
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def device_bytes(tree: Any) -> int:
  """The bytes `tree` holds on one device (the shards of an array are all one size)."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def fsdp_report(placement: Placement, trainer: Stepper, params: Params, opt_state: Any,
                corpus: Corpus, positions: jax.Array, count: int) -> dict[str, Any]:
  """--fsdp: where the training state lives and which collectives a step runs; printed, and
  returned for metrics.json.

  Per array of the params, of one microbatch's grads (as the graphed layers' pullbacks
  return them; the key streams are rewound after) and of the optimizer state: the devices it
  spans and one shard's size. The state's bytes per device against `state_bytes(count)`.
  Per executable of a step, the collectives of its compiled HLO, and their sum over a step.
  """
  arrays = {"params": placements(params), "opt_state": placements(opt_state)}
  per_step: dict[str, int] = {}
  found: dict[str, dict[str, int]] = {}

  def add(name: str, compiled: Any, times: int) -> None:
    counts = found.setdefault(name, collectives(compiled))
    for kind, n in counts.items():
      per_step[kind] = per_step.get(kind, 0) + n * times

  microbatches = trainer.microbatches
  if isinstance(trainer, Trainer):
    streams = trainer.streams()
    _, grads, _ = trainer.microbatch(params, *corpus.batch_at(0), positions)
    trainer.seed(streams)
    arrays["grads"] = placements(grads)
    for name, compiled in named_executables(trainer.layers):
      add(name, compiled, microbatches)
    for name, compiled, calls in trainer.bookkeeping():
      add(name, compiled, calls)
  else:
    add("whole step", trainer.compiled, 1)
  params_bytes = device_bytes(params)
  # params, AdamW moments, summed grads, one microbatch's grads: as `state_bytes`
  per_device = 3 * params_bytes + device_bytes(opt_state)
  unsharded = state_bytes(count)
  buffers = arrays["params"]
  split = [b for b in buffers if b["shard"] < b["size"]]
  print(f"--fsdp {placement.devices}: training state per device {per_device / 1e6:.3f} MB of "
        f"{unsharded / 1e6:.3f} MB unsharded (1/{unsharded / per_device:.2f}; float32 params, "
        f"AdamW moments, summed grads, one microbatch's grads); {len(split)} of "
        f"{len(buffers)} param buffers split {placement.devices} ways, the others (under "
        f"{placement.min_size:,} elements: norm scales) replicated")
  print("collectives in the compiled HLO, per executable: " + "; ".join(
      f"{name} {counts}" for name, counts in found.items())
        + f"; per step ({microbatches} microbatches): {per_step}")
  return {"devices": placement.devices, "processes": jax.process_count(),
          "state_bytes_per_device": per_device, "state_bytes_unsharded": unsharded,
          "arrays": arrays, "collectives": found, "collectives_per_step": per_step}

