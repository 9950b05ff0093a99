"""--fsdp's report: where every array of the training state lives, its bytes per device, and
the collectives in the compiled HLO of every executable of a step (printed, and in
metrics.json). docs/fsdp.md."""

from __future__ import annotations

import re
from typing import Any

import jax

import jaxgraph as jg
from common import Corpus

from .layers import Params, graphed
from .memory import state_bytes
from .placement import Placement
from .trainer import Stepper, Trainer


COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce")


def collectives(compiled: Any) -> dict[str, int]:
  """The collectives in the compiled HLO of `compiled`, by op (an asynchronous pair,
  `-start` and `-done`, counts once). On CPU a reduce-scatter compiles to an all-reduce and
  a dynamic-slice (docs/fsdp.md)."""
  hlo = compiled.as_text()
  return {op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo)) for op in COLLECTIVES}


def layer_executables(layer: jg.GraphedCallable) -> tuple[Any, Any]:
  """The training forward and the backward `layer` replays (its one captured signature)."""
  # jaxgraph keeps its executables private; examples/fsdp_train.py reads them the same way.
  (entry,) = layer._entries.values()
  forward = next(c for (_, residuals), c in entry.forward.items() if residuals)
  return forward, entry.backward["full"][0]


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
  per_step = dict.fromkeys(COLLECTIVES, 0)
  found: dict[str, dict[str, int]] = {}

  def add(name: str, compiled: Any, times: int) -> None:
    counts = found.setdefault(name, collectives(compiled))
    for op, n in counts.items():
      per_step[op] += n * times

  microbatches = trainer.microbatches
  if isinstance(trainer, Trainer):
    streams = trainer.streams()
    _, grads, _ = trainer.microbatch(params, *corpus.batch_at(0), positions)
    trainer.seed(streams)
    arrays["grads"] = placements(grads)
    names: dict[int, str] = {}  # identical blocks replay one entry: name it after the first
    for layer in graphed(trainer.layers):
      forward, backward = layer_executables(layer)
      name = names.setdefault(id(forward), layer.name)
      add(f"{name} forward", forward, microbatches)
      add(f"{name} backward", backward, microbatches)
    add("accumulate", trainer.accumulate, microbatches)
    add("update", trainer.apply, 1)
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

