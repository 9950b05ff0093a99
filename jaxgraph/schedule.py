"""Pipeline schedules: Transformer Engine's `_order`, order builders, and a pipeline driver.

An order is a list of 1-based chunk ids (Transformer Engine's `_order`, Megatron's
`convert_schedule_table_to_order`):

* `+c` runs the forwards of every layer of chunk `c`, for the next microbatch of that chunk;
* `-c` runs their backwards (layers reversed), for the chunk's oldest microbatch still
  waiting for its backward;
* `-c - 0.5` (the chunk's backward entry minus 0.5: `-1.5` for chunk 1) runs their deferred
  weight gradients (`delay_wgrad=True`), for the chunk's oldest microbatch still waiting.

`parse_order` validates an order and expands it into `Step`s; `interleaved_1f1b`,
`one_f_one_b`, `zero_bubble` and `merge_ranks` build orders; `Pipeline` runs one over
microbatches for a model split into chunks, each chunk optionally on its own device, from
the calling thread or from a thread per device.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import numbers
import threading
import time
from typing import Any, Callable, Iterator, Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxgraph import _fusion as fusion_lib
from jaxgraph import _graphed as graphed_lib
from jaxgraph import _pullback as pullback_lib

__all__ = [
    "Pipeline",
    "ParsedOrder",
    "Step",
    "StepResult",
    "bubble_fraction",
    "interleaved_1f1b",
    "layers_per_chunk",
    "merge_ranks",
    "one_f_one_b",
    "parse_order",
    "schedule_table",
    "table_to_order",
    "zero_bubble",
]

StepKind = Literal["forward", "backward", "wgrad"]


class Step(NamedTuple):
  """One entry of an order: what runs, for which chunk and microbatch (both 0-based)."""

  kind: StepKind
  chunk: int
  microbatch: int


class ParsedOrder(NamedTuple):
  """A validated order (`parse_order`).

  Attributes:
    steps: one `Step` per entry of the order, in order.
    num_chunks: the number of model chunks (the largest chunk id).
    num_microbatches: forwards (and backwards) per chunk.
    has_wgrad: whether the order places the deferred weight gradients itself; without wgrad
      entries, a `delay_wgrad` wgrad runs right after its backward.
  """

  steps: tuple[Step, ...]
  num_chunks: int
  num_microbatches: int
  has_wgrad: bool


def _parse_entry(value: Any, position: int) -> Step:
  """The kind and 0-based chunk of `order[position]` (microbatch filled in later)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"order[{position}] is {value!r}; an order holds chunk ids: c (forward), "
                    "-c (backward), -c - 0.5 (deferred wgrad), with chunks numbered from 1.")
  if value > 0:
    if not isinstance(value, numbers.Integral):
      raise TypeError(
          f"order[{position}] is {value!r}, a {type(value).__name__}: forward entries must be "
          f"ints (Transformer Engine: 'Forward order value must be an integer'). Write "
          f"{int(value) if float(value).is_integer() else 'an int chunk id'}.")
    return Step("forward", int(value) - 1, -1)
  if value == 0:
    raise ValueError(f"order[{position}] is 0; chunk ids start at 1 (+c forward, -c backward).")
  if float(value).is_integer():
    return Step("backward", int(-value) - 1, -1)
  chunk = -float(value) - 0.5
  if not chunk.is_integer():
    raise ValueError(
        f"order[{position}] is {value!r}; a wgrad entry is the chunk's backward entry minus 0.5 "
        f"(-1.5 for chunk 1), so the order diff of wgrad and dgrad must be 0.5 "
        f"(Transformer Engine's rule).")
  if chunk < 1:
    raise ValueError(f"order[{position}] is {value!r}, the wgrad entry of a chunk 0; chunk ids "
                     "start at 1, so the wgrad entry of chunk 1 is -1.5.")
  return Step("wgrad", int(chunk) - 1, -1)


def parse_order(order: Sequence[float], *, delay_wgrad: bool = False) -> ParsedOrder:
  """Validates a Transformer Engine `_order` and assigns microbatches to its entries.

  The k-th `+c` is microbatch k of chunk c; backwards and wgrads of a chunk run in the order
  of its forwards (first in, first out).

  Args:
    order: chunk ids: `c` forward, `-c` backward, `-c - 0.5` deferred wgrad (1-based).
    delay_wgrad: whether the layers split their backward (`make_graphed(delay_wgrad=True)`);
      wgrad entries need it.

  Returns:
    The `ParsedOrder`.

  Raises:
    TypeError: an entry is not a number, or a forward entry is not an int.
    ValueError: a malformed entry (0, a wgrad entry not at -c - 0.5), wgrad entries without
      `delay_wgrad`, forward/backward counts that do not give every chunk the same number of
      microbatches, wgrad counts that do not match the backward counts, or an entry that runs
      before what it needs (a forward before the previous chunk's forward of that microbatch,
      a backward before its forward or before the next chunk's backward, a wgrad before its
      backward).
  """
  if isinstance(order, (str, bytes)) or not isinstance(order, Sequence):
    raise TypeError(f"order must be a sequence of chunk ids, got {type(order).__name__}.")
  if not order:
    raise ValueError("order is empty; give at least one forward and one backward per chunk, "
                     "e.g. order=[1, -1].")
  entries = [_parse_entry(value, i) for i, value in enumerate(order)]
  wgrads = [i for i, e in enumerate(entries) if e.kind == "wgrad"]
  if wgrads and not delay_wgrad:
    raise ValueError(
        f"order[{wgrads[0]}] = {order[wgrads[0]]!r} is a deferred-wgrad entry, but the layers "
        "do not split their backward (Transformer Engine: 'No module needs wgrad computation "
        "but get float in order'). Build them with make_graphed(..., delay_wgrad=True), or "
        "drop the wgrad entries.")
  counts = collections.Counter((e.kind, e.chunk) for e in entries)
  without_wgrad = len(entries) - len(wgrads)
  num_chunks = 1 + max((e.chunk for e in entries if e.kind != "wgrad"), default=-1)
  if num_chunks == 0:
    raise ValueError("order has no forward or backward entries.")
  num_microbatches = without_wgrad // num_chunks // 2
  uneven = [c for c in range(num_chunks)
            if (counts["forward", c], counts["backward", c]) != (num_microbatches,) * 2]
  if num_microbatches == 0 or uneven:
    per_chunk = ", ".join(f"chunk {c + 1}: {counts['forward', c]} forwards, "
                          f"{counts['backward', c]} backwards" for c in range(num_chunks))
    raise ValueError(
        f"Pipeline-parallel order dimension mismatch: num_model_chunks ({num_chunks}) * "
        f"num_microbatches ({num_microbatches}) * 2 = {num_chunks * num_microbatches * 2}, but "
        f"the order has {without_wgrad} forward/backward entries. Every chunk 1..{num_chunks} "
        f"needs the same number of forwards and backwards ({per_chunk}).")
  if wgrads:
    for c in range(num_chunks):
      if counts["wgrad", c] != num_microbatches:
        raise ValueError(
            f"Number of wgrad entries ({counts['wgrad', c]}) doesn't match number of dgrad "
            f"entries ({num_microbatches}) for chunk {c + 1}: when the order places wgrads, "
            f"every backward -{c + 1} needs one later {-(c + 1) - 0.5} entry.")
  done: dict[StepKind, list[int]] = {kind: [0] * num_chunks
                                     for kind in ("forward", "backward", "wgrad")}
  steps = []
  for i, entry in enumerate(entries):
    c = entry.chunk
    m = done[entry.kind][c]
    where = f"order[{i}] = {order[i]!r} ({entry.kind} of chunk {c + 1}, microbatch {m})"
    if entry.kind == "forward" and c > 0 and done["forward"][c - 1] <= m:
      raise ValueError(f"{where} runs before the forward of chunk {c} for that microbatch, "
                       "which makes its input. Move it after that forward.")
    if entry.kind == "backward":
      if done["forward"][c] <= m:
        raise ValueError(f"{where} runs before its forward. Move it after the forward.")
      if c + 1 < num_chunks and done["backward"][c + 1] <= m:
        raise ValueError(f"{where} runs before the backward of chunk {c + 2} for that "
                         "microbatch, which makes its cotangent. Move it after that backward.")
    if entry.kind == "wgrad" and done["backward"][c] <= m:
      raise ValueError(f"{where} runs before its backward (dgrad). Move it after the backward.")
    done[entry.kind][c] += 1
    steps.append(Step(entry.kind, c, m))
  return ParsedOrder(tuple(steps), num_chunks, num_microbatches, bool(wgrads))


def layers_per_chunk(num_layers_per_chunk: int | Sequence[int] | None, num_chunks: int,
                     num_layers: int) -> tuple[int, ...]:
  """The number of layers of each chunk (Transformer Engine's `_num_layers_per_chunk`).

  Args:
    num_layers_per_chunk: None (split the layers evenly), an int (the same for every chunk),
      or one int per chunk (uneven pipelines).
    num_chunks: chunks in the order.
    num_layers: callables given to `make_graphed`; chunk 1 is the first layers, and so on.

  Raises:
    TypeError: `num_layers_per_chunk` is not an int or a sequence of ints.
    ValueError: the layers do not split as asked.
  """
  if num_layers < num_chunks:
    raise ValueError(f"the order has {num_chunks} chunks but there are only {num_layers} "
                     "callables; every chunk needs at least one layer (callable).")
  if num_layers_per_chunk is None:
    if num_layers % num_chunks:
      raise ValueError(
          f"the order has {num_chunks} chunks but there are {num_layers} callables, which do "
          "not split evenly; pass num_layers_per_chunk=[...] (one int per chunk) for an uneven "
          "pipeline.")
    return (num_layers // num_chunks,) * num_chunks
  if isinstance(num_layers_per_chunk, Sequence) and not isinstance(num_layers_per_chunk, str):
    sizes = tuple(num_layers_per_chunk)
  else:
    sizes = (num_layers_per_chunk,) * num_chunks
  if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in sizes):
    raise TypeError(f"num_layers_per_chunk must be an int or a list of {num_chunks} ints (one "
                    f"per chunk of the order), got {num_layers_per_chunk!r}.")
  if len(sizes) != num_chunks:
    raise ValueError(f"num_layers_per_chunk must be an int or a list of {num_chunks} ints "
                     f"(one per chunk of the order), got {num_layers_per_chunk!r}.")
  if not all(n >= 1 for n in sizes):
    raise ValueError(f"num_layers_per_chunk must hold ints >= 1, got {num_layers_per_chunk!r}.")
  if sum(sizes) != num_layers:
    raise ValueError(f"num_layers_per_chunk={num_layers_per_chunk!r} gives {sum(sizes)} layers "
                     f"but there are {num_layers} callables; the callables are the layers of "
                     "chunk 1, then chunk 2, and so on.")
  return tuple(int(n) for n in sizes)


def chunk_ranges(sizes: Sequence[int]) -> list[range]:
  """The callable indices of each chunk, from the layers per chunk."""
  ranges, start = [], 0
  for size in sizes:
    ranges.append(range(start, start + size))
    start += size
  return ranges


def layer_steps(parsed: ParsedOrder, sizes: Sequence[int]) -> Iterator[tuple[StepKind, int, int]]:
  """`(kind, callable index, microbatch)` per layer: forwards in layer order, backwards and
  wgrads reversed."""
  ranges = chunk_ranges(sizes)
  for step in parsed.steps:
    layers = ranges[step.chunk] if step.kind == "forward" else reversed(ranges[step.chunk])
    for index in layers:
      yield step.kind, index, step.microbatch


# ------------------------------------------------------------------------------- builders


def schedule_table(num_microbatches: int, num_model_chunks: int,
                   microbatch_group_size: int) -> list[tuple[int, int]]:
  """Megatron's interleaved schedule table: `(microbatch, chunk)` (0-based) per virtual
  microbatch. Groups of `microbatch_group_size` microbatches go through every chunk in turn.
  """
  table = []
  for first in range(0, num_microbatches, microbatch_group_size):
    last = first + microbatch_group_size
    if last >= num_microbatches:
      last = num_microbatches
    table.extend((m, c) for c in range(num_model_chunks) for m in range(first, last))
  return table


def table_to_order(table: Sequence[tuple[int, int]], num_warmup: int,
                   num_model_chunks: int) -> list[int]:
  """Megatron's `convert_schedule_table_to_order`: `num_warmup` forwards, then one forward
  and one backward alternating, then the remaining backwards."""
  forward = [c + 1 for _, c in table]
  backward = [c - num_model_chunks for _, c in table]
  order = forward[:num_warmup]
  for i in range(num_warmup, len(forward)):
    order += [forward[i], backward[i - num_warmup]]
  if num_warmup > 0:
    order += backward[-num_warmup:]
  return order


def _check_ints(**values: int) -> None:
  for name, value in values.items():
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
      raise ValueError(f"{name} must be an int >= 1, got {value!r}.")


def _check_rank(rank: int, pipeline_parallel_size: int) -> None:
  if not isinstance(rank, numbers.Integral) or not 0 <= rank < pipeline_parallel_size:
    raise ValueError(f"rank must be an int in [0, {pipeline_parallel_size}), got {rank!r}.")


def interleaved_1f1b(num_microbatches: int, num_model_chunks: int, *,
                     pipeline_parallel_size: int = 1, rank: int = 0,
                     microbatch_group_size: int | None = None) -> list[int]:
  """The interleaved-1F1B order of one pipeline rank, as Megatron builds it for TE.

  Warmup forwards: `2 * (pipeline_parallel_size - rank - 1) + (num_model_chunks - 1) *
  microbatch_group_size`, at most all of them (Megatron's rule).

  Args:
    num_microbatches: microbatches per step.
    num_model_chunks: chunks (virtual stages) on this rank.
    pipeline_parallel_size: pipeline ranks.
    rank: this rank.
    microbatch_group_size: microbatches per chunk before switching chunk (Megatron's
      `microbatch_group_size_per_vp_stage`); defaults to `pipeline_parallel_size`.

  Returns:
    The order (ints), e.g. for 5 microbatches, 2 chunks, 2 ranks, group size 3 on rank 0:
    `[1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1]`.
  """
  group = pipeline_parallel_size if microbatch_group_size is None else microbatch_group_size
  _check_ints(num_microbatches=num_microbatches, num_model_chunks=num_model_chunks,
              pipeline_parallel_size=pipeline_parallel_size, microbatch_group_size=group)
  _check_rank(rank, pipeline_parallel_size)
  table = schedule_table(num_microbatches, num_model_chunks, group)
  warmup = 2 * (pipeline_parallel_size - rank - 1) + (num_model_chunks - 1) * group
  if num_model_chunks == 1:
    warmup = pipeline_parallel_size - rank - 1
  return table_to_order(table, min(warmup, len(table)), num_model_chunks)


def one_f_one_b(num_microbatches: int, *, pipeline_parallel_size: int = 1,
                rank: int = 0) -> list[int]:
  """The 1F1B order of one pipeline rank (one chunk): `pipeline_parallel_size - rank - 1`
  warmup forwards, then one forward and one backward alternating, then the backwards."""
  return interleaved_1f1b(num_microbatches, 1, pipeline_parallel_size=pipeline_parallel_size,
                          rank=rank)


def zero_bubble(num_microbatches: int, *, pipeline_parallel_size: int = 1,
                rank: int = 0) -> list[float]:
  """The zero-bubble order of one pipeline rank (one chunk), ZB-H1 of Qi et al. (2023).

  Every backward is split into dgrad (`-1`) and a deferred wgrad (`-1.5`), and the ranks are
  list-scheduled together with a unit cost for each forward, dgrad and wgrad: a free rank
  runs a forward where it may (at most `pipeline_parallel_size - rank` microbatches between
  forward and dgrad, as in 1F1B), else a dgrad, else its oldest pending wgrad, and a wgrad
  first once `rank + 1` are pending. A rank then holds at most `pipeline_parallel_size`
  microbatches' state (activations, or a wgrad's inputs): 1F1B's first rank's peak on every
  rank. The wgrads fill what 1F1B leaves idle: at those unit costs a step takes
  `3 * num_microbatches + pipeline_parallel_size - 1` units against 1F1B's
  `3 * (num_microbatches + pipeline_parallel_size - 1)` (`bubble_fraction` of their
  `merge_ranks` simulates both).
  """
  _check_ints(num_microbatches=num_microbatches, pipeline_parallel_size=pipeline_parallel_size)
  _check_rank(rank, pipeline_parallel_size)
  return list(_zero_bubble_orders(num_microbatches, pipeline_parallel_size)[rank])


@functools.lru_cache(maxsize=None)
def _zero_bubble_orders(microbatches: int, ranks: int) -> tuple[tuple[float, ...], ...]:
  """Every rank's `zero_bubble` order, from the unit-cost list schedule its docstring says."""
  finished: set[tuple[str, int, int]] = set()  # (kind, rank, microbatch) done by now
  forwarded, dgraded = [0] * ranks, [0] * ranks
  pending = [0] * ranks  # dgrads whose wgrad has not run
  orders: list[list[float]] = [[] for _ in range(ranks)]
  while any(dgraded[r] < microbatches or pending[r] for r in range(ranks)):
    done_now = []
    for r in range(ranks):
      m_f, m_d = forwarded[r], dgraded[r]
      can = {
          "forward": (m_f < microbatches and m_f - m_d < ranks - r
                      and (r == 0 or ("forward", r - 1, m_f) in finished)),
          "dgrad": (m_d < m_f and (r == ranks - 1 or ("dgrad", r + 1, m_d) in finished)),
          "wgrad": pending[r] > 0,
      }
      choice = ("wgrad" if pending[r] > r and can["wgrad"] else
                next((kind for kind in ("forward", "dgrad", "wgrad") if can[kind]), None))
      if choice == "forward":
        forwarded[r] += 1
        orders[r].append(1)
        done_now.append(("forward", r, m_f))
      elif choice == "dgrad":
        dgraded[r] += 1
        pending[r] += 1
        orders[r].append(-1)
        done_now.append(("dgrad", r, m_d))
      elif choice == "wgrad":
        pending[r] -= 1
        orders[r].append(-1.5)
    finished.update(done_now)  # one unit later: what ran this tick is there for the next
  return tuple(map(tuple, orders))


def _needs(step: Step, last: int) -> tuple[Step, ...]:
  """The entries whose outputs `step` takes, in an order of chunks 0..`last`: a forward the
  chunk before's forward, a backward its own forward and the chunk after's backward, a
  wgrad its backward."""
  kind, c, m = step
  if kind == "forward":
    return (Step("forward", c - 1, m),) if c else ()
  if kind == "backward":
    return (Step("forward", c, m),) + ((Step("backward", c + 1, m),) if c < last else ())
  return (Step("backward", c, m),)


def bubble_fraction(order: Sequence[float], *, stages: int, forward: float = 1.0,
                    backward: float = 2.0, dgrad: float = 1.0, wgrad: float = 1.0) -> float:
  """The idle fraction of a step of `order` run by stages, simulated with a cost per entry.

  Chunk `c` (0-based) runs on stage `c % stages` (the layout of `merge_ranks`' orders); each
  stage runs its entries in the order's order, each starting once its stage is free and its
  input is done: a forward's the chunk before's forward, a backward's the chunk after's
  backward (the last chunk: its own forward), a wgrad its backward. A forward costs
  `forward`, a backward `backward`, or `dgrad` where the order has wgrad entries, which cost
  `wgrad`. Returns `1 - busy / (stages x makespan)`: for 1F1B at the default costs
  `(p - 1) / (M + p - 1)`, for `zero_bubble` `(p - 1) / (3M + p - 1)`.

  Args:
    order: a valid order (`parse_order` with `delay_wgrad=True`), e.g. `merge_ranks` of
      per-rank orders.
    stages: the stages (devices) the chunks are dealt to.
    forward, backward, dgrad, wgrad: each entry kind's cost.
  """
  _check_ints(stages=stages)
  parsed = parse_order(list(order), delay_wgrad=True)
  last = parsed.num_chunks - 1
  costs = {"forward": forward, "backward": dgrad if parsed.has_wgrad else backward,
           "wgrad": wgrad}
  done: dict[Step, float] = {}
  free, busy = [0.0] * stages, 0.0
  for step in parsed.steps:  # a valid order lists each entry after the ones it needs
    stage = step.chunk % stages
    start = max([free[stage], *(done[needed] for needed in _needs(step, last))])
    free[stage] = done[step] = start + costs[step.kind]
    busy += costs[step.kind]
  return 1 - busy / (stages * max(free))


def merge_ranks(rank_orders: Sequence[Sequence[float]]) -> list[float]:
  """One order for a single controller from the orders of every pipeline rank.

  Chunk `v` of rank `r` becomes global chunk `(v - 1) * len(rank_orders) + r + 1` (stage
  order of an interleaved pipeline). The ranks advance in lockstep ticks: in each tick every
  rank whose next entry has its inputs runs it; entries are listed tick by tick, rank by
  rank. With chunks on different devices, asynchronous dispatch then overlaps the ranks.

  Raises:
    ValueError: the rank orders deadlock (an entry waits forever).
  """
  ranks = len(rank_orders)
  parsed_orders = [parse_order(list(order), delay_wgrad=True) for order in rank_orders]
  queues = [collections.deque(parsed.steps) for parsed in parsed_orders]
  finished: set[Step] = set()
  last = max(parsed.num_chunks for parsed in parsed_orders) * ranks - 1
  merged: list[float] = []
  while any(queues):
    tick = []
    for r, queue in enumerate(queues):
      if not queue:
        continue
      local = queue[0]
      step = Step(local.kind, local.chunk * ranks + r, local.microbatch)
      if finished.issuperset(_needs(step, last)):
        queue.popleft()
        tick.append(step)
    if not tick:
      stuck = [f"rank {r}: {queue[0].kind} of chunk {queue[0].chunk + 1}, microbatch "
               f"{queue[0].microbatch}" for r, queue in enumerate(queues) if queue]
      raise ValueError("the rank orders deadlock; waiting: " + "; ".join(stuck) + ".")
    for step in tick:
      finished.add(step)
      code = step.chunk + 1
      merged.append(code if step.kind == "forward" else
                    -code if step.kind == "backward" else -code - 0.5)
  return merged


# ------------------------------------------------------------------------------- driver


@dataclasses.dataclass
class StepResult:
  """What one `Pipeline` call returns.

  Attributes:
    outputs: the last chunk's outputs, one per microbatch.
    losses: the loss of each microbatch.
    grads: `grads[c][l]`: the gradient of the params of layer `l` of chunk `c`, summed over
      microbatches in microbatch order, on the chunk's device.
    input_grads: the gradient of each microbatch's input.
  """

  outputs: list[Any]
  losses: list[jax.Array]
  grads: list[list[Any]]
  input_grads: list[Any]


def _vjp(layer: graphed_lib.GraphedCallable, args: tuple[Any, ...], microbatch: int) -> Any:
  """`layer.vjp(*args)`, with hooks told the microbatch."""
  leaves, treedef = layer.flatten(args, None, {})
  with layer.exclusive():
    return layer.forward(args, leaves, treedef, None, phase="replay",
                         iteration=layer.counts.replays, microbatch=microbatch,
                         with_pullback=True)


def _chunk_vjp(layers: Sequence[graphed_lib.GraphedCallable], params: Sequence[Any], x: Any,
               consts: tuple[Any, ...], microbatch: int,
               runs: Sequence[tuple[int, int, fusion_lib.FusedSegment | None]]
               ) -> tuple[Any, list[tuple[int, int, graphed_lib.Pullback]]]:
  """A chunk's forward: each run with a segment as one fused replay (one by one where it
  cannot replay fused), each other layer on its own; `(y, [(lo, hi, pullback), ...])`."""
  steps = []
  for lo, hi, segment in runs:
    replayed = None if segment is None else segment.vjp_chain(params[lo:hi], x, consts, None)
    if replayed is not None:
      x, pullback = replayed
      steps.append((lo, hi, pullback))
      continue
    for i in range(lo, hi):
      x, pullback = _vjp(layers[i], (params[i], x, *consts), microbatch)
      steps.append((i, i + 1, pullback))
  return x, steps


def _add_leaves(total: list[jax.Array], grad: list[jax.Array]) -> list[jax.Array]:
  return [jnp.add(t, g) for t, g in zip(total, grad)]


# A chunk's gradients accumulate in one call a backward (leaf by leaf, eager adds cost the
# driving thread a dispatch each); into its own running sum once there is one.
_sum = jax.jit(_add_leaves)
_sum_into = jax.jit(_add_leaves, donate_argnums=0)


def _tree_add(total: Any, grad: Any, *, donate: bool) -> Any:
  """`total + grad`, leaf by leaf, in one call (`total`'s buffers donated with `donate`).

  A float0 gradient (an integer leaf's, or one `grad_mask` leaves out) stays float0 and out
  of the call: a NumPy float0 argument or result sends every call of a jitted function down
  jax's Python dispatch path, past its C++ one (about a millisecond of the driving thread
  a call on the CPU).
  """
  leaves, treedef = jax.tree.flatten(total)
  grads = treedef.flatten_up_to(grad)
  floats = [i for i, leaf in enumerate(leaves) if leaf.dtype != jax.dtypes.float0]
  if not floats:  # nothing to sum: every leaf frozen or an integer's
    return total
  summed = (_sum_into if donate else _sum)([leaves[i] for i in floats],
                                           [grads[i] for i in floats])
  for i, leaf in zip(floats, summed):
    leaves[i] = leaf
  return jax.tree.unflatten(treedef, leaves)


class Pipeline:
  """Runs an order over microbatches for a model split into chunks (single controller).

  Every chunk is a list of GraphedCallables taking `(params, x)` (with `consts`,
  `(params, x, *consts)`) and returning the next `x`; the last chunk's output goes to
  `loss_fn(output, target) -> scalar`, whose gradient (from `jax.value_and_grad`, jitted
  once) starts the backward. With `devices`, chunk `c` runs on
  `devices[c]`: its params are placed there, and activations and cotangents move between
  chunks with `jax.device_put`. Dispatch is asynchronous, so chunks on different devices
  overlap as the order allows. Capture the layers of chunk `c` with sample_args on
  `devices[c]`, or their first call captures again for the new sharding.

  Args:
    chunks: one list of GraphedCallables per chunk (`order` chunk c is `chunks[c - 1]`).
    order: the order (see `parse_order`); wgrad entries need layers built with
      `delay_wgrad=True`. Without them, such layers run each wgrad right after its backward.
    loss_fn: `loss_fn(output, target) -> scalar loss` of one microbatch.
    devices: None (no placement), or one device per chunk.
    fuse: boundary fusion inside each chunk (`sequential_vjp`'s `fuse`): a chunk's forward
      replays each run of its adjacent layers without replay-time hooks (from one
      `make_graphed` call, with the same offload setting) as one executable, and its
      backward as one, compiled on the first step (identical runs share them): a chunk of
      hook-free layers is one forward and one backward call a microbatch, not one a layer.
      The same keys, counters and math as unfused. An int `k` cuts each run into segments
      of at most `k` layers; `fuse=1` is unfused. Layers with a replay-time hook run one by
      one, their hooks told the microbatch. With `delay_wgrad=True` layers a fused run
      splits its backward as each layer does: one dgrad executable a microbatch (the input
      cotangent and what the weight gradients need), and one wgrad executable (every weight
      gradient of the run) where the order places the chunk's wgrad.
    threads: dispatch from one worker thread per device (needs `devices`), each walking
      the steps of its device's chunks in the order's relative order and waiting for the
      activations and cotangents the other threads hand on; False: every step from the
      calling thread. The same steps per chunk, so the same results, bits and key counters.
      A layer's hooks then run on its device's thread: in the order's order for each
      layer, in any interleaving across devices. An exception in a worker stops them all and
      is raised in the caller. The workers run under JAX's global configuration: a
      thread-local setting (`with jax.default_matmul_precision(...)`, `with
      jax.default_device(...)`) around the call does not reach them.

  Attributes:
    thread_seconds: with `threads=True`, per distinct device of `devices` (in their order),
      the CPU time (`time.thread_time`) its dispatch thread has taken over every call so
      far, for a measure of how busy each thread keeps (the calling thread's CPU time is
      not in it).
  """

  def __init__(self, chunks: Sequence[Sequence[graphed_lib.GraphedCallable]],
               order: Sequence[float], *, loss_fn: Callable[[Any, Any], jax.Array],
               devices: Sequence[jax.Device] | None = None, fuse: bool | int = False,
               threads: bool = False):
    self.chunks = [list(chunk) for chunk in chunks]
    layers = [layer for chunk in self.chunks for layer in chunk]
    if not layers or any(not chunk for chunk in self.chunks):
      raise ValueError("Pipeline needs at least one chunk, each with at least one layer.")
    for layer in layers:
      if not isinstance(layer, graphed_lib.GraphedCallable):
        raise TypeError(f"Pipeline chunks hold GraphedCallables (from make_graphed), got "
                        f"{type(layer).__name__}.")
    delay = {layer.config.delay_wgrad for layer in layers}
    if len(delay) > 1:
      raise ValueError("some layers were built with delay_wgrad=True and some without; build "
                       "every layer of a pipeline the same way.")
    self.delay_wgrad = delay.pop()
    longest = fusion_lib.longest_run(fuse, "Pipeline")
    self.parsed = parse_order(order, delay_wgrad=self.delay_wgrad)
    if self.parsed.num_chunks != len(self.chunks):
      raise ValueError(f"the order has {self.parsed.num_chunks} chunks but Pipeline got "
                       f"{len(self.chunks)}; chunk c of the order is chunks[c - 1].")
    if devices is not None and len(devices) != len(self.chunks):
      raise ValueError(f"Pipeline got {len(devices)} devices for {len(self.chunks)} chunks; "
                       "pass one device per chunk, or None.")
    if threads and devices is None:
      raise ValueError("Pipeline(..., threads=True) dispatches from one thread per device, "
                       "so it needs devices=: pass one device per chunk, or threads=False.")
    if threads:
      _check_one_device_each(self.chunks, devices)
    self.threads = bool(threads)
    self.devices = None if devices is None else list(devices)
    self.thread_seconds = [0.0] * len(set(self.devices)) if threads else []
    self._shardings = ([] if devices is None else
                       [jax.sharding.SingleDeviceSharding(device) for device in devices])
    self.loss_fn = loss_fn
    self._loss_grad = jax.jit(jax.value_and_grad(loss_fn))
    # With threads, each device's steps: the order's, filtered to its chunks.
    self._device_steps: dict[jax.Device, list[Step]] = {device: [] for device in devices or ()}
    for step in self.parsed.steps if threads else ():
      self._device_steps[devices[step.chunk]].append(step)
    # Per chunk, its runs and their fused segments (hook-free runs; the hooks are the
    # layers' own since make_graphed), found once: every step replays the same.
    self._runs = [[(lo, hi, fusion_lib.segment(chunk[lo:hi]) if hi - lo > 1 else None)
                   for lo, hi in fusion_lib.runs(chunk, longest)] for chunk in self.chunks]

  def _place(self, tree: Any, chunk: int) -> Any:
    """`tree` on chunk `chunk`'s device; as it is where it is there already (a device_put
    costs the driving thread a dispatch a leaf even then: the params, every step)."""
    if self.devices is None:
      return tree
    target = self._shardings[chunk]
    if all(isinstance(leaf, jax.Array) and leaf.sharding == target
           for leaf in jax.tree.leaves(tree)):
      return tree
    return jax.device_put(tree, target)

  def __call__(self, params: Sequence[Sequence[Any]], inputs: Sequence[Any],
               targets: Sequence[Any], *, consts: Sequence[tuple[Any, ...]] | None = None
               ) -> StepResult:
    """Runs the order once: every microbatch forward and backward through every chunk.

    Args:
      params: `params[c][l]`: the params of layer `l` of chunk `c`.
      inputs: the input of each microbatch (to chunk 1).
      targets: the target of each microbatch (to `loss_fn`).
      consts: None, or one tuple per microbatch: the inputs besides the activation that
        every layer takes after it, `layer(params, x, *consts[m])` (`sequential_vjp`'s
        `consts=`, per microbatch), placed on each chunk's device: e.g. the targets of a
        last layer that returns the loss itself, which then need not ride through every
        layer in `x`. They get no gradient (a layer's backward still computes the gradient
        of a float const, and `Pipeline` drops it).

    Returns:
      The `StepResult`.
    """
    parsed, chunks = self.parsed, self.chunks
    count = parsed.num_microbatches
    if len(inputs) != count or len(targets) != count:
      raise ValueError(f"the order runs {count} microbatches but Pipeline got "
                       f"{len(inputs)} inputs and {len(targets)} targets.")
    if consts is not None and (len(consts) != count
                               or not all(isinstance(c, tuple) for c in consts)):
      kinds = sorted({type(c).__name__ for c in consts})
      raise ValueError(f"Pipeline takes consts= one tuple per microbatch ({count}): the extra "
                       "positional arguments of every layer for that microbatch, e.g. "
                       f"consts=[(mask,) for mask in masks]; got {len(consts)} of {kinds}.")
    if len(params) != len(chunks) or any(len(p) != len(c) for p, c in zip(params, chunks)):
      raise ValueError("params must hold one list per chunk with one params pytree per layer "
                       f"(layers per chunk: {[len(c) for c in chunks]}).")
    layers = [layer for chunk in chunks for layer in chunk]
    pullback_lib.check_carry(layers, [p for chunk in params for p in chunk], inputs[0],
                             *(() if consts is None else consts[0]), where="Pipeline")
    run = _Run(self, params, inputs, targets, consts, threaded=self.threads)
    if self.threads:
      self._dispatch_threads(run)
    else:
      run.params = [self._place(p, c) for c, p in enumerate(run.params)]
      for step in parsed.steps:
        run.step(step)
    return run.result

  def _dispatch_threads(self, run: _Run) -> None:
    """`threads=True`: one worker thread per device walks the steps of that device's chunks
    in the order's relative order, each waiting (`_Handoff.take`) for the activations and
    cotangents that other devices' threads hand on.

    This cannot deadlock: the order is a topological order of the steps (`parse_order`
    refuses an entry before what it needs), and each thread's steps are a subsequence of
    it. Were every unfinished thread waiting, take the waiting step `s` that comes first in
    the order: what it waits for, `d`, comes before `s` in the order; the thread owning `d`
    has not run it, so waits at a step no later than `d` in its own steps, hence in the
    order, so before `s`: a contradiction. A failing worker sets the handoff's error, which
    wakes and stops every waiting worker; the others stop before their next step.
    """
    steps = self._device_steps
    handoff = run.handoff
    spent = [0.0] * len(steps)  # each worker's CPU seconds, written by that worker

    def work(index: int, device: jax.Device) -> None:
      begin = time.thread_time()
      try:
        for c, chunk_device in enumerate(self.devices):
          if chunk_device == device:
            run.params[c] = self._place(run.params[c], c)
        for step in steps[device]:
          handoff.check()
          run.step(step)
      except _Stopped:
        pass
      except BaseException as error:  # noqa: BLE001 - re-raised in the caller
        error.add_note(f"raised in Pipeline's dispatch thread for {device} "
                       "(Pipeline(..., threads=True))")
        handoff.fail(error)
      finally:
        spent[index] = time.thread_time() - begin

    workers = [threading.Thread(target=work, args=(i, device), daemon=True,
                                name=f"jaxgraph Pipeline {device}")
               for i, device in enumerate(steps)]
    started: list[threading.Thread] = []
    try:
      for worker in workers:
        worker.start()
        started.append(worker)
      for worker in started:
        worker.join()
    except BaseException as error:  # an interrupt in the caller: stop the workers first
      handoff.fail(error)
      for worker in started:
        worker.join()
      raise
    finally:
      self.thread_seconds = [total + s for total, s in zip(self.thread_seconds, spent)]
    if handoff.error is not None:
      raise handoff.error


def _check_one_device_each(chunks: Sequence[Sequence[graphed_lib.GraphedCallable]],
                           devices: Sequence[jax.Device]) -> None:
  """With a dispatch thread per device, a layer in chunks on two devices would be called
  by two threads at once, which a GraphedCallable refuses mid-step: refuse it here."""
  found: dict[graphed_lib.GraphedCallable, tuple[int, jax.Device]] = {}
  for c, (chunk, device) in enumerate(zip(chunks, devices)):
    for layer in chunk:
      first = found.setdefault(layer, (c, device))
      if first[1] != device:
        raise ValueError(
            f"Pipeline(..., threads=True): {layer.name} is in chunk {first[0] + 1} on "
            f"{first[1]} and in chunk {c + 1} on {device}, so two dispatch threads would "
            "call it at once, and a GraphedCallable runs in one thread at a time. Give each "
            "chunk its own layers (make_graphed for each), or pass threads=False.")


class _Stopped(Exception):
  """A worker stops: another one failed (`_Handoff.fail`)."""


class _Handoff:
  """What a `Pipeline` call's steps hand each other across chunks: activations
  (`("act", chunk, microbatch)`, a chunk's output) and cotangents (`("ct", chunk,
  microbatch)`, of a chunk's output). With threads, `take` waits until another thread puts
  the value, or until a worker fails."""

  def __init__(self, *, threaded: bool):
    self._values: dict[tuple[str, int, int], Any] = {}
    self._ready = threading.Condition() if threaded else None
    self.error: BaseException | None = None  # the first worker's that failed

  def put(self, key: tuple[str, int, int], value: Any) -> None:
    if self._ready is None:
      self._values[key] = value
      return
    with self._ready:
      self._values[key] = value
      self._ready.notify_all()

  def take(self, key: tuple[str, int, int]) -> Any:
    if self._ready is None:
      return self._values.pop(key)
    with self._ready:
      while key not in self._values and self.error is None:
        self._ready.wait()
      self.check()
      return self._values.pop(key)

  def check(self) -> None:
    """Raises `_Stopped` once a worker has failed."""
    if self.error is not None:
      raise _Stopped

  def fail(self, error: BaseException) -> None:
    """Keeps the first error and wakes every waiting worker to stop."""
    with self._ready:
      if self.error is None:
        self.error = error
      self._ready.notify_all()


class _Run:
  """One `Pipeline` call: its placed params, what its steps keep for later steps, and its
  result. Each chunk's state (its pullbacks, its gradient sums) is touched only by the steps
  of that chunk, so with threads by one thread; activations and cotangents cross chunks
  through the `_Handoff`."""

  def __init__(self, pipeline: Pipeline, params: Sequence[Sequence[Any]],
               inputs: Sequence[Any], targets: Sequence[Any],
               consts: Sequence[tuple[Any, ...]] | None, *, threaded: bool):
    count, n = pipeline.parsed.num_microbatches, len(pipeline.chunks)
    self.pipeline = pipeline
    self.params = [list(p) for p in params]  # each chunk's placed before its first step
    self.inputs, self.targets, self.consts = inputs, targets, consts
    self.handoff = _Handoff(threaded=threaded)
    # (chunk, microbatch) -> (first layer, end layer, pullback) per replayed run of the chunk
    self.pullbacks: dict[tuple[int, int], list[tuple[int, int, graphed_lib.Pullback]]] = {}
    self.waiting: dict[tuple[int, int], list[tuple[int, int, graphed_lib.Pullback]]] = {}
    self.grads: list[Any] = [None] * n  # per chunk, its layers' running sums
    self.owned = [False] * n  # whether grads[c] came from _sum (so may be donated)
    self.result = StepResult([None] * count, [None] * count, self.grads, [None] * count)

  def accumulate(self, c: int, new: list[Any]) -> None:
    if self.grads[c] is None:
      self.grads[c] = new
      return
    self.grads[c] = _tree_add(self.grads[c], new, donate=self.owned[c])
    self.owned[c] = True

  def step(self, step: Step) -> None:
    """Runs one entry of the order."""
    kind, c, m = step
    pipeline, result, handoff = self.pipeline, self.result, self.handoff
    chunk, last = pipeline.chunks[c], len(pipeline.chunks) - 1
    if kind == "forward":
      x = pipeline._place(self.inputs[m] if c == 0 else handoff.take(("act", c - 1, m)), c)
      side = () if self.consts is None else pipeline._place(self.consts[m], c)
      x, self.pullbacks[c, m] = _chunk_vjp(chunk, self.params[c], x, side, m, pipeline._runs[c])
      if c == last:
        result.outputs[m] = x
        result.losses[m], ct = pipeline._loss_grad(x, pipeline._place(self.targets[m], c))
        handoff.put(("ct", c, m), ct)
      else:
        handoff.put(("act", c, m), x)
    elif kind == "backward":
      ct = pipeline._place(handoff.take(("ct", c, m)), c)
      chunk_pullbacks = self.pullbacks.pop((c, m))
      new = [None] * len(chunk)
      deferred = pipeline.parsed.has_wgrad
      for position in reversed(range(len(chunk_pullbacks))):
        lo, hi, pullback = chunk_pullbacks[position]
        # Async offload: this run's residuals first (the chunk's top run), then the next
        # run's, which come back during this backward.
        pullback.prefetch()
        if position:
          chunk_pullbacks[position - 1][2].prefetch()
        g_params, ct = pullback(ct)[:2]  # the consts' gradients dropped
        if pipeline.delay_wgrad and not deferred:
          g_params = pullback.wgrad()[0]
        new[lo:hi] = fusion_lib.per_layer(g_params, lo, hi)
      if deferred:
        self.waiting[c, m] = chunk_pullbacks
      else:
        self.accumulate(c, new)
      if c == 0:
        result.input_grads[m] = ct
      else:
        handoff.put(("ct", c - 1, m), ct)
    else:
      self.accumulate(c, [grad for lo, hi, pullback in self.waiting.pop((c, m))
                          for grad in fusion_lib.per_layer(pullback.wgrad()[0], lo, hi)])
