"""--offload: its spellings (`offload_spec`), the blocks measured without offload and the
link, and `jaxgraph.offload.plan`'s choice of what the training layers move to host memory
(`plan_offload`, `OffloadChoice`). docs/llama.md."""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import time
from typing import Any, Callable, Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp

import jaxgraph as jg

from .layers import Params


class OffloadSpec(NamedTuple):
  """--offload: "none", "all" (every kept buffer of every block), or a goal for
  `jaxgraph.offload.plan`: "slowdown" (`value` a fraction of the step) or "memory" (`value`
  the bytes of the blocks' residuals that may stay on the device, per microbatch)."""

  kind: Literal["none", "all", "slowdown", "memory"]
  value: float = 0.0

  def __str__(self) -> str:
    if self.kind == "slowdown":
      return f"slowdown={self.value:.1%}"
    return f"memory={self.value / 2**30:.2f}GiB" if self.kind == "memory" else self.kind


SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10,
              "mib": 2**20, "gib": 2**30}


def offload_spec(text: str) -> OffloadSpec:
  """Parses --offload: none | all | slowdown=P% (or a fraction) | memory=SIZE (bytes, or with
  a unit: GiB, MiB, GB, ...)."""
  usage = ("--offload takes none, all, slowdown=P% (e.g. slowdown=5%: the blocks' copies may "
           "add 5% to the step) or memory=SIZE (e.g. memory=4GiB: at most that much of the "
           f"blocks' residuals stays on the device); got {text!r}")
  if text in ("none", "all"):
    return OffloadSpec(text)
  goal, _, value = text.partition("=")
  number = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*(%|[a-zA-Z]*)\s*", value)
  try:
    amount, unit = float(number.group(1)), number.group(2).lower()
  except (AttributeError, ValueError):
    raise argparse.ArgumentTypeError(usage) from None
  if goal == "slowdown" and unit in ("", "%"):
    return OffloadSpec("slowdown", amount / 100 if unit == "%" else amount)
  if goal == "memory" and unit in SIZE_UNITS:
    return OffloadSpec("memory", amount * SIZE_UNITS[unit])
  raise argparse.ArgumentTypeError(usage)


OFFLOAD_CONFLICTS = {
    "--whole-step": "trains through one jax.jit, with no graphed blocks",
    "--fuse": "replays the blocks as one executable, whose copies cannot start before its end",
    "--fsdp": "shards the blocks over devices (this example plans for one device)"}


@dataclasses.dataclass(frozen=True)
class OffloadChoice:
  """What --offload measured of the blocks (no offload) and what the planner chose.

  Attributes:
    spec: the --offload goal.
    names: the blocks' names.
    forward_seconds, backward_seconds: per block, its forward's and backward's time.
    buffers: per block, the sizes of the buffers its forward keeps (`kept_buffers`).
    link: the measured copy speeds (`jaxgraph.offload.measure_link`).
    plan: the planner's choice (`jaxgraph.offload.plan`).
  """

  spec: OffloadSpec
  names: tuple[str, ...]
  forward_seconds: tuple[float, ...]
  backward_seconds: tuple[float, ...]
  buffers: tuple[tuple[int, ...], ...]
  link: jg.offload.Link
  plan: jg.offload.Plan

  def options(self, graph_ends: bool) -> dict[str, Any]:
    """`make_graphed` options of the training layers (the embedding and head, when graphed in
    the same call, never offload: the head's backward runs first)."""
    if not any(self.plan.flags):
      return {}
    flags = [False, *self.plan.flags, False] if graph_ends else list(self.plan.flags)
    return {"offload_residuals": flags, "offload_min_bytes": self.plan.min_bytes}

  def table(self) -> str:
    """Per block: compute times, kept bytes, what the link moves in those times, the plan."""
    mib = 2**20
    lines = [f"{'block':<10} {'fwd ms':>7} {'bwd ms':>7} {'kept MiB':>9} {'buffers':>7} "
             f"{'link MiB in fwd':>15} {'in bwd':>8} {'moves MiB':>9}"]
    for name, fwd, bwd, sizes, moved in zip(self.names, self.forward_seconds,
                                            self.backward_seconds, self.buffers,
                                            self.plan.moved_bytes):
      lines.append(f"{name:<10} {fwd * 1e3:>7.2f} {bwd * 1e3:>7.2f} {sum(sizes) / mib:>9.1f} "
                   f"{len(sizes):>7} {fwd * self.link.to_host / mib:>15.1f} "
                   f"{bwd * self.link.to_device / mib:>8.1f} {moved / mib:>9.1f}")
    return "\n".join(lines)

  def summary(self) -> dict[str, Any]:
    """For metrics.json."""
    return {"spec": str(self.spec), "link_bytes_per_s": self.link._asdict(),
            "blocks": [{"name": name, "forward_s": fwd, "backward_s": bwd,
                        "kept_buffer_bytes": list(sizes), "moved_bytes": moved}
                       for name, fwd, bwd, sizes, moved in zip(
                           self.names, self.forward_seconds, self.backward_seconds,
                           self.buffers, self.plan.moved_bytes)],
            "flags": list(self.plan.flags), "min_bytes": self.plan.min_bytes,
            "offloaded_bytes": self.plan.offloaded_bytes,
            "resident_bytes": self.plan.resident_bytes,
            "compute_seconds": self.plan.compute_seconds,
            "predicted_seconds": self.plan.predicted_seconds, "report": str(self.plan)}


def block_seconds(layers: Sequence[jg.GraphedCallable], params: Params, x: jax.Array,
                  positions: jax.Array, repeats: int = 3) -> tuple[list[float], list[float]]:
  """Per block, the median over `repeats` rounds of its forward's and its backward's time on
  `x`, each run alone (waited for before and after: device time and one call's dispatch),
  after one untimed round. Each backward runs right after its forward, so one block's
  residuals are alive at a time: a setting that needs offload to train can be measured."""
  forward: list[list[float]] = [[] for _ in layers]
  backward: list[list[float]] = [[] for _ in layers]
  x = jax.block_until_ready(x)
  cotangent = jax.block_until_ready(jnp.ones_like(x))
  for _ in range(repeats + 1):
    for i, (layer, layer_params) in enumerate(zip(layers, params)):
      begin = time.perf_counter()
      y, pullback = layer.vjp(layer_params, x, positions)
      jax.block_until_ready(y)
      middle = time.perf_counter()
      jax.block_until_ready(pullback(cotangent))
      forward[i].append(middle - begin)
      backward[i].append(time.perf_counter() - middle)
      del y, pullback
  return ([statistics.median(t[1:]) for t in forward],
          [statistics.median(t[1:]) for t in backward])


def plan_offload(spec: OffloadSpec, fns: Sequence[Callable[..., Any]], params: Params,
                 x: jax.ShapeDtypeStruct, positions: jax.Array, *,
                 remat_policy: Callable[..., bool] | None, seed: int) -> OffloadChoice:
  """--offload: measures the blocks without offload (a capture of their own, discarded: the
  training layers' key streams are untouched; one block's residuals alive at a time), the
  link, and plans.

  `all` is the plan for a budget of 0 bytes (every kept buffer of every block moves).
  """
  layers = jg.make_graphed(list(fns), sample_args=[(p, x, positions) for p in params],
                           rng=jax.random.key(seed), remat_policy=remat_policy,
                           num_warmup_iters=1)
  inputs = jax.random.normal(jax.random.key(seed), x.shape, x.dtype)
  forward, backward = block_seconds(layers, params, inputs, positions)
  buffers = tuple(tuple(b.nbytes for b in layer.kept_buffers) for layer in layers)
  names = tuple(layer.name for layer in layers)
  del layers, inputs
  # The copies the plan times: one block's residuals (at least 1 MiB, at most 1 GiB).
  link = jg.offload.measure_link(min(max(max(map(sum, buffers)), 1 << 20), 1 << 30) // 2 * 2)
  if spec.kind == "slowdown":
    goal: dict[str, Any] = {"max_slowdown": spec.value}
  else:
    goal = {"budget_bytes": int(spec.value) if spec.kind == "memory" else 0}
  plan = jg.offload.plan(buffers, forward, backward, link, **goal)
  return OffloadChoice(spec, names, tuple(forward), tuple(backward), buffers, link, plan)

