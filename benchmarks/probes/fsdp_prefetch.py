"""Prefetch across executables: does XLA overlap the next layer's FSDP all-gather (and the
layer above's reduce-scatter) with this layer's compute when both are in one executable?

Per-layer FSDP executables each start with their layer's all-gather and end with its
reduce-scatter, with nothing of their own to run beside them: on 4 H100s the Llama example's
1B step spends 50 ms a step in NCCL kernels, 40 of them exposed, against a whole-step
`jax.jit`'s 34 ms with 4 exposed (docs/fsdp.md, "Where the time goes"). A collective started
in one XLA executable cannot finish in the next, so the lever left is to hand the next
layer's collectives to this layer's executable (docs/fsdp.md, "What each lever gave"). This
probe builds that schedule in plain JAX (no jaxgraph) and times it against the whole step
and plain per-layer executables on the same model, with the same shardings and gradients.

Model: `--layers` blocks with the 1B Llama's weight sizes (width 2048; q and o 2048 x 2048,
k and v 2048 x 1024; SwiGLU gate and up 2048 x 5632, down 5632 x 2048; 47.2M weights, 94 MB
in bfloat16), RMSnorm without scales. A block is `x + o(q * tile(sigmoid(k) * v))` then
`x + down(silu(gate(h)) * up(h))`, each branch on the RMS-normalized stream: every weight
matmul of the real block, attention's own FLOPs (QK^T, PV: about 8% of a 1B block's at
context 2048) left out, so there is less compute to hide the collectives under than in the
real model (a conservative test). Activations are [tokens, width] bfloat16, `--tokens` per
device a step (weak scaling: the global batch is tokens x devices, sharded along it), run as
`--microbatches` M microbatches of tokens / M each (default 1; the example's step runs its
8,192 tokens per GPU as 2 microbatches: `--microbatches 2`). A microbatch's loss: the sum of
its output's squares over the step's global token count, so that the step's loss is the sum
of its microbatches' (the mean over the step's tokens) and its gradients the sum of theirs,
summed in microbatch order as the example's accumulation does. A step is the forward and
backward of the stack for each microbatch in turn: the loss, each layer's sharded float32
gradient and each microbatch's input gradient; no optimizer.

Parameters: per layer ONE flat float32 buffer (all weights concatenated, zero-padded to a
multiple of the device count), sharded along a 1-D mesh "fsdp" over all devices. A gather
casts the shard to bfloat16, then all-gathers it (FSDP2's `param_dtype`); the gradient of
the gathered bfloat16 buffer is reduce-scattered in bfloat16, then cast to float32 (what
autodiff of the gather gives). Everything runs in `jax.shard_map`.

Variants (each compiled ahead of time; the per-layer ones driven by a Python loop):
  whole           one `jax.jit` of the step: each microbatch's `jax.value_and_grad` in turn
                  (a Python loop inside the jit, as the example's step), summed; XLA schedules
                  everything and keeps what it likes for the backward (on the CPU and on 4
                  H100s: each gathered layer from the forward, one gather per layer, `layers`
                  a step). With M microbatches XLA merges the microbatches' gathers of a layer
                  (CSE): still `layers` gathers a step, each gathered layer kept for the whole
                  step, and it reduce-scatters each microbatch's gradient, `layers x M` a step
                  (on the CPU). The reference of the ratios and the gradients.
  whole-regather  one executable again, with the split variants' residuals: the backward of
                  each layer gathers its weights again, as the split variants do (2 gathers
                  a layer). XLA merges a re-gather of the same shard with the forward's, even
                  under `jax.checkpoint`'s CSE barrier, so the step takes the shards twice
                  (the same buffers) and the backward gathers from the second
                  (`regathering`). The bound on what prefetching can reach. With M
                  microbatches, still 2 gathers a layer a step (merged across microbatches).
  per-layer       one forward executable `fwd(shard, x) -> (y, residuals)` (gather inside)
                  and one backward `bwd(shard, x, residuals, ct) -> (ct_x, grad_shard)`
                  (gather again, reduce-scatter the gradient inside), shared by every layer.
  per-layer-2     the same with two layers per executable (an even --layers only): fewer
                  calls and one layer's collectives beside the other's compute, to separate
                  that from prefetching.
  prefetch        layer i's forward takes layer i+1's shard and returns it gathered:
                  `fwd(gathered_i, shard_i+1, x) -> (y, residuals, gathered_i+1)`; layer i's
                  backward takes layer i-1's shard and returns it gathered, and
                  reduce-scatters the gradient of layer i+1 that the previous backward
                  returned unreduced: `bwd(gathered_i, shard_i-1, x, residuals, ct,
                  full_grad_i+1) -> (ct_x, full_grad_i, gathered_i-1, grad_shard_i+1)`.
                  The chain's ends have executables of their own: a gather of layer 0 before
                  the first forward (exposed); the top layer's forward prefetches nothing, and
                  its gathered weights stay alive through the loss for the first backward (no
                  re-gather: the backward starts where the forward ended); the top layer's
                  backward reduces nothing (no gradient above yet); layer 0's backward
                  prefetches nothing and reduce-scatters both its own gradient (exposed) and
                  layer 1's. 2 x layers - 1 gathers a step. Alive besides the residuals: 2
                  gathered layers during a forward call, 1 between calls; during a backward
                  call 2 gathered and 2 unreduced gradients (one being reduced, one produced),
                  1 of each between calls. An unreduced gradient is each device's whole bfloat16
                  layer, passed as [devices, padded] split along the first axis.
  prefetch-keep   prefetch's forward, but every layer's gathered weights are kept for its
                  backward (the Python driver holds what the forward calls return), which
                  gathers nothing: one gather per layer, `layers` a step, what the whole step
                  does on GPU (and on the CPU). Layer i's backward takes its kept gathered
                  weights, its residuals, the cotangent and the unreduced gradient of layer
                  i+1 that the previous backward returned, and reduce-scatters the latter
                  beside its compute: `bwd(gathered_i, x, residuals, ct, full_grad_i+1) ->
                  (ct_x, full_grad_i, grad_shard_i+1)` ("backward_reduce"). The ends as
                  prefetch's, less the backward's gathers (one traced backward, what it gathers
                  and reduces passed as parameters): the top layer's backward reduces nothing,
                  layer 0's reduce-scatters both its own gradient and layer 1's. The cost is
                  memory: each layer's gathered bfloat16 weights stay alive from its forward to
                  its backward, one more gathered layer alive per layer (94 MB a layer per
                  device at the 1B sizes): at the turn from forward to backward all 22 layers'
                  (2.1 GB) against prefetch's 1. XLA's whole step keeps the same on GPU. With
                  prefetch (2 x layers - 1 gathers) it separates the cost of the re-gathers
                  from that of splitting the step into executables (the numbers on 4 H100s:
                  docs/fsdp.md, "What each lever gave").
With M microbatches the split variants above run each microbatch's forward and backward in
turn, as with one: per-layer, prefetch and prefetch-keep gather M times what they gather with
one (prefetch M x (2 x layers - 1), prefetch-keep M x layers), where the whole step gathers
once. Microbatches 2..M call `_acc` copies of the executables that reduce-scatter (the backward,
`backward_prefetch`/`backward_reduce`, `backward_bottom`), which add the reduced gradients to
the earlier microbatches' sums, and `loss_acc`, which adds the loss to theirs. Two variants keep
the gathered weights across microbatches (with --microbatches 2 or more only):
  prefetch-step   prefetch-keep's first microbatch, but every layer's gathered weights are kept
                  for the whole step: microbatches 2..M gather nothing (every layer's forward
                  is the top's executable, `forward`, on the kept weights), and each
                  microbatch's backward still reduce-scatters that microbatch's gradients (the
                  handed-over one of the layer above, and in layer 0's backward its own, into
                  the `_acc` sums): the whole step's math and collectives, `layers` gathers
                  and `layers x M` reduce-scatters a step. On the CPU its gradients are
                  bitwise the whole step's (with 3 microbatches the loss differs in its last
                  bit: XLA sums the whole step's three losses otherwise). Keeps every layer's
                  gathered weights from the first forward to the last backward, as the whole
                  step does.
  prefetch-step-sum  the weights kept as in prefetch-step, but the microbatches' unreduced
                  gradients are summed in float32 (`backward_sum_first`, `backward_sum`: no
                  collectives) and the sum, cast to bfloat16, reduce-scattered once a step in the
                  last microbatch's backward as prefetch hands them over: `layers` gathers and
                  `layers` reduce-scatters a step, M times fewer reduce-scatters of the same
                  size. Not the whole step's math (one bfloat16 rounding of the sum instead of
                  M of the parts: 0.3% from whole on the CPU), so checked within --tolerance.
                  The cost is memory: every layer's float32 unreduced sum alive besides the
                  kept weights (3 x a gathered layer's bytes a layer; 189 MB a layer per
                  device at the 1B sizes).

Residuals (every split variant): `jax.vjp` of the layer under `jax.checkpoint` with
`dots_with_no_batch_dims_saveable` (the matmul outputs are kept: q, k, v, the attention
branch's output, gate and up, 285 MB a layer per device at 8,192 tokens; elementwise work is
recomputed), its pullback's leaves returned by the forward executable and the pullback
rebuilt from them in the backward one (as jaxgraph does). Weights are never matmul outputs,
so the residuals never hold gathered weights: per-layer re-gathers from the shard, prefetch
and prefetch-keep recompute the weight slices from the gathered buffer their backward is
given (re-gathered or kept). Residuals that
are the executable's inputs (the shard or gathered buffer, x) are passed again, not copied.

Correctness: every run compares each variant's loss, layer gradients and input gradient
with `whole`'s, array by array: the max abs difference, the relative difference (the norm
of the difference over the reference's norm; the largest over the arrays is the criterion)
and whether every bit is equal. It exits nonzero, before timing, when a variant's relative
difference passes `--tolerance` (0.1). The variants run the same ops on the same values
(prefetch-step-sum excepted: above), but XLA may round a bfloat16 intermediate at other
points in another executable (it keeps values in float32 inside a fusion:
`--xla_allow_excess_precision`, on by default), and on a GPU each executable autotunes its
own matmul kernels. On the CPU (4 tiny layers) whole-regather, per-layer, prefetch and
prefetch-keep come out bitwise equal to whole and per-layer-2 differs by 1% (bitwise too with
`--xla_allow_excess_precision=false`); 22 tiny layers, 2%. With 2 microbatches the same, and
prefetch-step bitwise too, prefetch-step-sum 0.3% off.
A variant wired wrong differs by far more (prefetch with layers 0 and 1's gradients
swapped: 150%). The output projections are initialized scaled by
1/sqrt(2 x layers) (GPT-2's init), so rounding differences are not amplified from layer to
layer.

Reports: per variant the step's median ms over `--rounds` rounds of `--steps` steps (the
variants alternate, the order reversed every other round, after `--warmup` steps each),
the spread ((max - min) / median), the ratio to `whole` (its step time over the variant's:
tokens/s over whole's, as docs/fsdp.md gives them), the executable calls per step (`calls`;
`runs`: per executable, counted in the first step), the collectives a step by op
(`collectives_per_step`: each executable's below times its calls a step) and `peak_alive`:
the most gathered layers alive at once per device besides the residuals and their bytes (a
layer's padded bfloat16 buffer each; from the step's structure: per-layer 1, per-layer-2 2,
prefetch 2, the others every layer; the whole step's `layers` when it gathers once a layer
a step, else null: XLA's choice), with prefetch-step-sum its float32 sums' too;
per compiled executable its collectives from `as_text()`: count by op and element type, how
many are asynchronous (`all-gather-start`, or an `async-start` wrapping the collective),
how many of those XLA marked `is_sync` (run in line after all) and, for each asynchronous
one, the compute ops (fusions, custom calls, calls of command buffers) XLA scheduled between
its start and its done: zero means nothing overlaps it however async it is. With
`--trace DIR`, a `jax.profiler` trace of `--trace-steps` steps per variant in `DIR/<variant>`,
reduced per GPU to NCCL time, its part under compute kernels and the exposed rest (as
`llama_fsdp.py` does). Prints a table and writes `fsdp_prefetch.json` to `--out`, with the
XLA_FLAGS in effect.

XLA flags: XLA's GPU scheduler decides whether an async collective overlaps compute, so the
latency-hiding scheduler (`--xla_gpu_enable_latency_hiding_scheduler=true`) may matter
most. The probe passes no flags of its own: set XLA_FLAGS to compare (the JSON records the
flags in effect). 4 GPUs, default flags, then the latency-hiding scheduler on; the CPU
smoke run (seconds):

  python3 -m benchmarks.probes.fsdp_prefetch --trace /tmp/prefetch/trace \\
      --out /tmp/prefetch
  XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true PYTHONPATH=. \\
      python3 -m benchmarks.probes.fsdp_prefetch --trace /tmp/prefetch-lhs/trace \\
      --out /tmp/prefetch-lhs
  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu PYTHONPATH=. \\
      python3 -m benchmarks.probes.fsdp_prefetch --tiny --out /tmp/prefetch

and with the example's 2 microbatches a step (adds prefetch-step and prefetch-step-sum):

  python3 -m benchmarks.probes.fsdp_prefetch --microbatches 2 --out /tmp/prefetch-m2
  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu PYTHONPATH=. \\
      python3 -m benchmarks.probes.fsdp_prefetch --tiny --microbatches 2 --out /tmp/prefetch-m2

The GPU commands use every GPU JAX sees (4 in the measurement docs/fsdp.md compares with;
CUDA_VISIBLE_DEVICES picks them).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import math
import os
import re
import pathlib
import sys
import time
from typing import Any, Callable, Sequence

from benchmarks import harness, profiling
from examples.records import write_json
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

AXIS = "fsdp"
COMPUTE = jnp.bfloat16
POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
VARIANTS = ("whole", "whole-regather", "per-layer", "per-layer-2", "prefetch", "prefetch-keep")
STEP_VARIANTS = ("prefetch-step", "prefetch-step-sum")  # with --microbatches 2 or more only


@dataclasses.dataclass(frozen=True)
class Size:
  """The stack's shape; `tokens` per device a step, run as `microbatches` microbatches."""

  width: int
  kv_width: int
  hidden: int
  layers: int
  tokens: int
  microbatches: int = 1

  @property
  def microbatch_tokens(self) -> int:
    """Tokens per device a microbatch."""
    return self.tokens // self.microbatches


LLAMA_1B = Size(width=2048, kv_width=1024, hidden=5632, layers=22, tokens=8192)
TINY = Size(width=64, kv_width=32, hidden=176, layers=4, tokens=32)


# --------------------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class Model:
  """The stack's weights on a 1-D "fsdp" mesh, and its functions on one device's values
  (inside `jax.shard_map`)."""

  size: Size
  mesh: jax.sharding.Mesh

  @property
  def n(self) -> int:
    return self.mesh.size

  @property
  def shapes(self) -> list[tuple[str, tuple[int, int]]]:
    d, kv, f = self.size.width, self.size.kv_width, self.size.hidden
    return [("wq", (d, d)), ("wk", (d, kv)), ("wv", (d, kv)), ("wo", (d, d)),
            ("wg", (d, f)), ("wu", (d, f)), ("wd", (f, d))]

  @property
  def weights(self) -> int:
    return sum(math.prod(shape) for _, shape in self.shapes)

  @property
  def padded(self) -> int:
    return -(-self.weights // self.n) * self.n

  def spec(self, shape: Sequence[int], dtype: Any) -> jax.ShapeDtypeStruct:
    """A global array split along its first axis over the mesh."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=self.sharding)

  @property
  def sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(AXIS))

  @property
  def shard_spec(self) -> jax.ShapeDtypeStruct:
    """A layer's float32 master weights: the flat buffer, split."""
    return self.spec((self.padded,), jnp.float32)

  @property
  def gathered_spec(self) -> jax.ShapeDtypeStruct:
    """A layer's gathered bfloat16 weights (or their unreduced gradient): one whole copy per
    device, as [devices, padded] split along the first axis."""
    return self.spec((self.n, self.padded), COMPUTE)

  @property
  def x_spec(self) -> jax.ShapeDtypeStruct:
    """A microbatch's input (or activations)."""
    return self.spec((self.n * self.size.microbatch_tokens, self.size.width), COMPUTE)

  @property
  def full_sum_spec(self) -> jax.ShapeDtypeStruct:
    """A layer's unreduced gradient summed over microbatches in float32, as `gathered_spec`."""
    return self.spec((self.n, self.padded), jnp.float32)

  def loss(self, y: jax.Array) -> jax.Array:
    """A microbatch's loss: the sum of its output's squares over the step's global token
    count. A step's loss is the sum over its microbatches (the mean over its tokens), and
    its gradient the sum of theirs."""
    return jnp.sum(jnp.square(y.astype(jnp.float32))) / (y.shape[0] * self.size.microbatches)

  def unflatten(self, flat: jax.Array) -> dict[str, jax.Array]:
    out, offset = {}, 0
    for name, shape in self.shapes:
      out[name] = flat[offset:offset + math.prod(shape)].reshape(shape)
      offset += math.prod(shape)
    return out

  def block(self, w: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    h = rms_norm(x)
    q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
    # a per-token stand-in for attention: each query head mixed with its KV group's values
    mixed = q * jnp.tile(jax.nn.sigmoid(k) * v, (1, self.size.width // self.size.kv_width))
    x = x + mixed @ w["wo"]
    h = rms_norm(x)
    return x + (jax.nn.silu(h @ w["wg"]) * (h @ w["wu"])) @ w["wd"]

  def layer_from_gathered(self, gathered: jax.Array, x: jax.Array) -> jax.Array:
    return self.block(self.unflatten(gathered), x)

  def layer_from_shard(self, shard: jax.Array, x: jax.Array) -> jax.Array:
    return self.layer_from_gathered(gather(shard), x)

  def init(self, seed: int) -> tuple[list[jax.Array], list[jax.Array]]:
    """The layers' float32 shards and each microbatch's input, made on the devices."""
    # the branches' output projections scaled by 1/sqrt(2 x layers) (GPT-2's init): the
    # residual stream stays near the input, and bfloat16 rounding differences between the
    # variants are not amplified from layer to layer
    depth = (2 * self.size.layers) ** -0.5

    def shard(key: jax.Array) -> jax.Array:
      keys = jax.random.split(key, len(self.shapes))
      parts = [jax.random.normal(k, (math.prod(shape),), jnp.float32) * shape[0] ** -0.5
               * (depth if name in ("wo", "wd") else 1.0)
               for k, (name, shape) in zip(keys, self.shapes)]
      return jnp.concatenate([*parts, jnp.zeros(self.padded - self.weights, jnp.float32)])

    microbatches = self.size.microbatches
    keys = jax.random.split(jax.random.key(seed), self.size.layers + microbatches)
    make = jax.jit(shard, out_shardings=self.sharding)
    shards = [make(k) for k in keys[microbatches:]]
    make_x = jax.jit(lambda k: jax.random.normal(k, self.x_spec.shape, COMPUTE),
                     out_shardings=self.sharding)
    return shards, [make_x(k) for k in keys[:microbatches]]


def rms_norm(x: jax.Array) -> jax.Array:
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
          ).astype(x.dtype)


def gather(shard: jax.Array) -> jax.Array:
  """One device's float32 shard -> the whole layer in bfloat16 (cast, then all-gather)."""
  return jax.lax.all_gather(shard.astype(COMPUTE), AXIS, tiled=True)


def reduce(full: jax.Array) -> jax.Array:
  """One device's unreduced bfloat16 gradient of the whole layer -> its float32 shard of the
  sum over devices (what autodiff of `gather` does: reduce-scatter, then cast)."""
  return jax.lax.psum_scatter(full, AXIS, scatter_dimension=0, tiled=True).astype(jnp.float32)


def remat(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """`fn` keeping only its matmul outputs for the backward (no CSE barrier: its forward and
  backward run in executables of their own, as jaxgraph's)."""
  return jax.checkpoint(fn, policy=POLICY, prevent_cse=False)


# --------------------------------------------------------------------------- residuals


@dataclasses.dataclass
class Residuals:
  """A `jax.vjp` pullback carried from one executable to another as its leaves: `split`
  (inside the forward's trace) records where each leaf comes from, the primal inputs or the
  kept arrays the forward returns; `pullback` (inside the backward's) rebuilds it."""

  treedef: Any = None
  sources: tuple[tuple[str, int], ...] = ()
  kept: tuple[jax.ShapeDtypeStruct, ...] = ()  # one device's

  def split(self, fn: Callable[..., jax.Array], primals: Sequence[jax.Array]
            ) -> tuple[jax.Array, list[jax.Array]]:
    y, pullback = jax.vjp(fn, *primals)
    leaves, treedef = jax.tree.flatten(pullback)
    position = {id(p): i for i, p in enumerate(primals)}
    sources, kept = [], []
    for leaf in leaves:
      if id(leaf) in position:
        sources.append(("in", position[id(leaf)]))
      else:
        sources.append(("kept", len(kept)))
        kept.append(leaf)
    specs = tuple(jax.ShapeDtypeStruct(k.shape, k.dtype) for k in kept)
    if self.treedef is None:
      self.treedef, self.sources, self.kept = treedef, tuple(sources), specs
    elif (self.sources, self.kept) != (tuple(sources), specs):
      raise AssertionError("two forwards of one backward keep different residuals")
    return y, kept

  def pullback(self, primals: Sequence[jax.Array], kept: Sequence[jax.Array],
               ct: jax.Array) -> Any:
    table = {"in": primals, "kept": kept}
    fn = jax.tree.unflatten(self.treedef, [table[kind][i] for kind, i in self.sources])
    return fn(ct)

  def specs(self, model: Model) -> list[jax.ShapeDtypeStruct]:
    """The kept residuals as the forward returns them: each device's with a leading axis."""
    return [model.spec((model.n, *k.shape), k.dtype) for k in self.kept]


def stacked(values: Sequence[jax.Array]) -> list[jax.Array]:
  """One device's arrays, each with a leading axis of 1: split over the mesh along it."""
  return [v[None] for v in values]


def unstacked(values: Sequence[jax.Array]) -> list[jax.Array]:
  return [v[0] for v in values]


def compile_mapped(model: Model, body: Callable[..., Any], *args: Any) -> Any:
  """`body` on every device's part of `args` (each split along its first axis), compiled."""
  mapped = jax.shard_map(body, mesh=model.mesh, in_specs=P(AXIS), out_specs=P(AXIS))
  return jax.jit(mapped).lower(*args).compile()


# --------------------------------------------------------------------------- variants


Step = tuple[jax.Array, list[jax.Array], list[jax.Array]]


@dataclasses.dataclass
class Variant:
  """A step that returns (loss, each layer's gradient shard, each microbatch's input
  gradient), calling its executables through `call` (which counts the calls in `runs`:
  clear it before a step to count that step's). `alive`: the most arrays of a layer's size
  alive at once per device besides the residuals, by kind: "gathered" (bfloat16 weights;
  None where XLA decides), "grad_sums" (float32 unreduced gradients summed over
  microbatches)."""

  name: str
  step: Callable[[], Step]
  executables: dict[str, Any]
  runs: collections.Counter[str]
  alive: dict[str, int | None]

  def call(self, executable: str, *args: Any) -> Any:
    self.runs[executable] += 1
    return self.executables[executable](*args)


def accumulated(total: Any, new: Any) -> Any:
  """`total + new` leaf by leaf, `new` where there is no total yet (the first microbatch):
  the sums in microbatch order, as the Llama example's accumulation."""
  return new if total is None else jax.tree.map(jnp.add, total, new)


def loss_executable(model: Model, summed: bool) -> Any:
  """`(y, total) -> (total + the microbatch's loss, its cotangent)`; `summed` False: no total
  (the first microbatch), None in its place."""
  def value_and_ct(y: jax.Array, total: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    value, ct = jax.value_and_grad(model.loss)(y)
    return accumulated(total, value), ct

  replicated = NamedSharding(model.mesh, P())
  total = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated) if summed else None
  return jax.jit(value_and_ct, out_shardings=(replicated, model.sharding)).lower(
      model.x_spec, total).compile()


def loss_executables(model: Model) -> dict[str, Any]:
  """"loss" for the first microbatch, "loss_acc" (adding to the earlier ones') for the rest."""
  found = {"loss": loss_executable(model, summed=False)}
  if model.size.microbatches > 1:
    found["loss_acc"] = loss_executable(model, summed=True)
  return found


def loss_name(microbatch: int) -> str:
  return "loss_acc" if microbatch else "loss"


def regathering(model: Model) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
  """`layer(shard, spare, x)`: the layer of `shard`, whose backward gathers the weights again
  from `spare` (the same values, another argument of the step) with the split variants'
  residuals. From `shard` itself, XLA would merge that gather with the forward's (it does so
  even through `jax.checkpoint`'s CSE barrier), keeping the gathered weights alive."""
  res = Residuals()

  @jax.custom_vjp
  def layer(shard: jax.Array, spare: jax.Array, x: jax.Array) -> jax.Array:
    return model.layer_from_shard(shard, x)

  def forward(shard: jax.Array, spare: jax.Array, x: jax.Array) -> Any:
    y, kept = res.split(remat(model.layer_from_shard), (shard, x))
    return y, (spare, x, kept)

  def backward(saved: Any, ct: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    spare, x, kept = saved
    d_shard, dx = res.pullback((spare, x), kept, ct)
    return d_shard, jnp.zeros_like(d_shard), dx  # no gradient asked of `spare`

  layer.defvjp(forward, backward)
  return layer


def whole(model: Model, shards: list[jax.Array], xs: list[jax.Array], regather: bool
          ) -> Variant:
  """One executable for the step, the shards passed twice (`regathering`'s spare): each
  microbatch's `jax.value_and_grad` in turn, summed (as the Llama example's step)."""
  def plain(shard: jax.Array, spare: jax.Array, x: jax.Array) -> jax.Array:
    return model.layer_from_shard(shard, x)

  mapped = jax.shard_map(regathering(model) if regather else plain, mesh=model.mesh,
                         in_specs=P(AXIS), out_specs=P(AXIS))

  def loss_of(shards: list[jax.Array], spares: list[jax.Array], x: jax.Array) -> jax.Array:
    for shard, spare in zip(shards, spares):
      x = mapped(shard, spare, x)
    return model.loss(x)

  def step_of(shards: list[jax.Array], spares: list[jax.Array], xs: list[jax.Array]) -> Step:
    total, dxs = None, []
    for x in xs:
      value, (grads, dx) = jax.value_and_grad(loss_of, argnums=(0, 2))(shards, spares, x)
      total = accumulated(total, (value, grads))
      dxs.append(dx)
    return *total, dxs

  replicated = NamedSharding(model.mesh, P())
  out = (replicated, [model.sharding] * len(shards), [model.sharding] * len(xs))
  specs = [model.shard_spec] * len(shards)
  compiled = jax.jit(step_of, out_shardings=out).lower(
      specs, specs, [model.x_spec] * len(xs)).compile()
  gathers = sum(v["count"] for k, v in collectives(compiled).items()
                if k.split()[0] == "all-gather")
  # one gather a layer a step: each gathered layer alive from the first microbatch's
  # forward to the last one's backward, every layer's at the last turn
  alive = {"gathered": len(shards) if gathers == len(shards) else None}
  variant = Variant("whole-regather" if regather else "whole", lambda: variant.call(
      "step", shards, shards, xs), {"step": compiled}, collections.Counter(), alive)
  return variant


def per_layer(model: Model, shards: list[jax.Array], xs: list[jax.Array], group: int
              ) -> Variant:
  """Forward and backward executables of `group` consecutive layers, shared by all groups;
  each microbatch's forward and backward in turn, the backward of microbatches 2.. adding
  the gradients to the earlier ones' ("backward_acc")."""
  if len(shards) % group:
    raise ValueError(f"{len(shards)} layers do not split into groups of {group}")
  res = Residuals()

  def chain(*primals: jax.Array) -> jax.Array:
    *group_shards, h = primals
    for shard in group_shards:
      h = remat(model.layer_from_shard)(shard, h)
    return h

  def forward(group_shards: list[jax.Array], x: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
    y, kept = res.split(chain, (*group_shards, x))
    return y, stacked(kept)

  def backward(group_shards: list[jax.Array], x: jax.Array, kept: list[jax.Array],
               ct: jax.Array, totals: list[jax.Array] | None) -> Any:
    *grads, dx = res.pullback((*group_shards, x), unstacked(kept), ct)
    return dx, accumulated(totals, grads)

  m, group_specs = model, [model.shard_spec] * group
  exe = {"forward": compile_mapped(m, forward, group_specs, m.x_spec)}
  exe["backward"] = compile_mapped(m, backward, group_specs, m.x_spec, res.specs(m), m.x_spec,
                                   None)
  if m.size.microbatches > 1:
    exe["backward_acc"] = compile_mapped(m, backward, group_specs, m.x_spec, res.specs(m),
                                         m.x_spec, group_specs)
  exe |= loss_executables(m)
  starts = range(0, len(shards), group)

  def step() -> Step:
    value, grads, dxs = None, [None] * len(shards), []
    for j, x in enumerate(xs):
      acts, kept = [x], []
      for i in starts:
        y, k = variant.call("forward", shards[i:i + group], acts[-1])
        acts.append(y)
        kept.append(k)
      value, ct = variant.call(loss_name(j), acts.pop(), value)
      for i in reversed(starts):
        ct, grads[i:i + group] = variant.call(
            "backward_acc" if j else "backward", shards[i:i + group], acts.pop(), kept.pop(),
            ct, grads[i:i + group] if j else None)
      dxs.append(ct)
    return value, grads, dxs

  name = "per-layer" if group == 1 else f"per-layer-{group}"
  variant = Variant(name, step, exe, collections.Counter(), {"gathered": group})
  return variant


def prefetch(model: Model, shards: list[jax.Array], xs: list[jax.Array], name: str
             ) -> Variant:
  """Each forward executable also runs the next layer's gather, each backward one the
  previous backward's reduce-scatter: `name` prefetch (the backward gathers the layer below
  again), prefetch-keep (the forward's gathered weights kept for the backward), prefetch-step
  (kept for the step's later microbatches too, whose forwards gather nothing) or
  prefetch-step-sum (as prefetch-step, the unreduced gradients summed over the microbatches
  and reduce-scattered in the last one's backward). The module docstring has the ends."""
  if len(shards) < 2:
    raise ValueError("prefetch needs 2 layers or more")
  regather, for_step, summed = (name == "prefetch", name in STEP_VARIANTS,
                                name == "prefetch-step-sum")
  res = Residuals()
  layer = remat(model.layer_from_gathered)

  def forward(gathered: jax.Array, x: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
    y, kept = res.split(layer, (gathered[0], x))
    return y, stacked(kept)

  def first_gather(shard: jax.Array) -> jax.Array:
    return gather(shard)[None]

  def forward_prefetch(gathered: jax.Array, shard_next: jax.Array, x: jax.Array) -> Any:
    following = gather(shard_next)
    return (*forward(gathered, x), following[None])

  def backward(gathered: jax.Array, shard_below: jax.Array | None, x: jax.Array,
               kept: list[jax.Array], ct: jax.Array, full_above: jax.Array | None,
               total_above: jax.Array | None, sum_own: jax.Array | None,
               total_own: jax.Array | None, own: str) -> Any:
    """-> (ct_x, this layer's gradient, the layer below gathered, the layer above's gradient
    shard). None for an argument: nothing to gather (not `regather`, or the bottom), to
    reduce (the top), to add to; None in its place out. `own`: "hand" the gradient
    unreduced in bfloat16 to the next call (which reduces it as `full_above`), "reduce" it
    here (the bottom), or "sum" it unreduced in float32 for the next microbatch. `sum_own`:
    the unreduced float32 sum of the earlier microbatches', added before (prefetch-step-sum;
    its last microbatch hands or reduces the sum in bfloat16); `total_own`, `total_above`:
    the reduced sums of the earlier microbatches', added after."""
    below = None if shard_below is None else gather(shard_below)[None]
    grad_above = None if full_above is None else accumulated(total_above, reduce(full_above[0]))
    d_gathered, dx = res.pullback((gathered[0], x), unstacked(kept), ct)
    if sum_own is not None or own == "sum":
      d_gathered = accumulated(None if sum_own is None else sum_own[0],
                               d_gathered.astype(jnp.float32))
      if own != "sum":  # the step's sum, reduce-scattered in bfloat16 as each microbatch's is
        d_gathered = d_gathered.astype(COMPUTE)
    if own == "reduce":
      return dx, accumulated(total_own, reduce(d_gathered)), below, grad_above
    return dx, d_gathered[None], below, grad_above

  m, g = model, model.gathered_spec

  def compile_backward(below: bool = False, above: bool = False, total_above: bool = False,
                       sum_own: bool = False, total_own: bool = False, own: str = "hand"
                       ) -> Any:
    """`backward` compiled for the arguments named True (the others None)."""
    def spec(given: bool, spec: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct | None:
      return spec if given else None
    return compile_mapped(
        m, functools.partial(backward, own=own), g, spec(below, m.shard_spec), m.x_spec,
        res.specs(m), m.x_spec, spec(above, g),
        spec(total_above, m.shard_spec), spec(sum_own, m.full_sum_spec),
        spec(total_own, m.shard_spec))

  exe = {"gather": compile_mapped(m, first_gather, m.shard_spec),
         "forward_prefetch": compile_mapped(m, forward_prefetch, g, m.shard_spec, m.x_spec),
         # the top layer's, and with `for_step` every layer's in microbatches 2..
         "forward" if for_step else "forward_top": compile_mapped(m, forward, g, m.x_spec)}
  middle = "backward_prefetch" if regather else "backward_reduce"
  if summed:
    exe["backward_sum_first"] = compile_backward(own="sum")
    if m.size.microbatches > 2:
      exe["backward_sum"] = compile_backward(sum_own=True, own="sum")
    exe |= {"backward_top": compile_backward(sum_own=True),
            middle: compile_backward(above=True, sum_own=True),
            "backward_bottom": compile_backward(above=True, sum_own=True, own="reduce")}
  else:
    exe |= {"backward_top": compile_backward(below=regather),
            middle: compile_backward(below=regather, above=True),
            "backward_bottom": compile_backward(above=True, own="reduce")}
    if m.size.microbatches > 1:
      exe |= {middle + "_acc": compile_backward(below=regather, above=True, total_above=True),
              "backward_bottom_acc": compile_backward(above=True, total_above=True,
                                                      total_own=True, own="reduce")}
  exe |= loss_executables(m)
  n = len(shards)

  def step() -> Step:
    value, grads, dxs = None, [None] * n, []
    sums: list[jax.Array | None] = [None] * n  # prefetch-step-sum's unreduced sums
    # the gathered layers alive: with `regather` the last one, else every layer's from its
    # forward (kept for its backward; with `for_step` for the step's later microbatches)
    weights: list[jax.Array] = []
    for j, x in enumerate(xs):
      acts, kept = [x], []
      if for_step and j:  # every layer's gathered weights kept from the first microbatch
        for i in range(n):
          y, k = variant.call("forward", weights[i], acts[-1])
          acts.append(y)
          kept.append(k)
      else:
        weights = [variant.call("gather", shards[0])]
        for i in range(n - 1):
          y, k, following = variant.call("forward_prefetch", weights[-1], shards[i + 1],
                                         acts[-1])
          acts.append(y)
          kept.append(k)
          if regather:
            weights.pop()
          weights.append(following)
        # the top's weights stay for its backward
        y, k = variant.call("forward" if for_step else "forward_top", weights[-1], acts[-1])
        acts.append(y)
        kept.append(k)
      value, ct = variant.call(loss_name(j), acts.pop(), value)

      def backward_call(executable: str, i: int, gathered: jax.Array, ct: jax.Array,
                        full_above: jax.Array | None = None,
                        own: jax.Array | None = None) -> Any:
        """Layer i's backward: the layer below's shard given with `regather`, the earlier
        microbatches' sums of its and the above's gradients where there are some."""
        below = shards[i - 1] if regather and i else None
        above = None if full_above is None else grads[i + 1]
        return variant.call(executable, gathered, below, acts.pop(), kept.pop(), ct,
                            full_above, above, sums[i], own)

      if summed and j < len(xs) - 1:  # no reduce-scatter before the step's last microbatch
        for i in reversed(range(n)):
          ct, sums[i], _, _ = backward_call(
              "backward_sum" if j else "backward_sum_first", i, weights[i], ct)
      else:
        def take(i: int) -> jax.Array:  # layer i's gathered weights: kept, or gathered again
          return weights[i] if for_step else weights.pop()

        acc = "_acc" if j and not summed else ""
        ct, full, gathered, _ = backward_call("backward_top", n - 1, take(n - 1), ct)
        for i in range(n - 2, 0, -1):  # layer i: reduce i + 1, gather i - 1 with `regather`
          ct, full, gathered, grads[i + 1] = backward_call(
              middle + acc, i, gathered if regather else take(i), ct, full)
        ct, grads[0], _, grads[1] = backward_call(
            "backward_bottom" + acc, 0, gathered if regather else take(0), ct, full, grads[0])
      dxs.append(ct)
    return value, grads, dxs

  alive = {"gathered": 2 if regather else n} | ({"grad_sums": n} if summed else {})
  variant = Variant(name, step, exe, collections.Counter(), alive)
  return variant


def build(name: str, model: Model, shards: list[jax.Array], xs: list[jax.Array]) -> Variant:
  if name in ("whole", "whole-regather"):
    return whole(model, shards, xs, regather=name == "whole-regather")
  if name == "per-layer":
    return per_layer(model, shards, xs, 1)
  if name == "per-layer-2":
    return per_layer(model, shards, xs, 2)
  if name in ("prefetch", "prefetch-keep", *STEP_VARIANTS):
    return prefetch(model, shards, xs, name)
  raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS + STEP_VARIANTS)}")


# --------------------------------------------------------------------------- collectives

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
# Ops that run compute kernels (a `call`: a command buffer of them, on GPUs).
COMPUTE_OPS = frozenset({"fusion", "custom-call", "dot", "convolution", "call", "while",
                         "conditional"})
HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
OPCODE = re.compile(r"(?<![\w.%\-])(?P<op>[a-z][a-z0-9\-]*)\(")
ELEMENT = re.compile(r"\b(bf16|f16|f32|f64|s32|u32|pred)\[")
CALLS = re.compile(r"calls=%?(?P<name>[\w.\-]+)")
SYNC = re.compile(r'"is_sync"\s*:\s*true')

Instruction = tuple[str, str, str]  # name, opcode, the rest of the line after "name = "


def _computations(hlo: str) -> dict[str, list[Instruction]]:
  """Each computation's instructions in the module's order (a scheduled module's: the
  order they run in)."""
  found: dict[str, list[Instruction]] = {}
  current: list[Instruction] | None = None
  for line in hlo.splitlines():
    if current is None:
      header = HEADER.match(line)
      if header and " = " not in line and not line.startswith("HloModule"):
        current = found.setdefault(header.group("name"), [])
    elif line.startswith("}"):
      current = None
    elif (instruction := INSTRUCTION.match(line)) and (op := OPCODE.search(
        instruction.group("rest"))):
      current.append((instruction.group("name"), op.group("op"), instruction.group("rest")))
  return found


def _uses(rest: str, names: set[str]) -> bool:
  """Whether an instruction's operands name one of `names`."""
  return any(re.search(rf"(?<![\w.\-%])%?{re.escape(n)}(?![\w.\-])", rest) for n in names)


def _between(instructions: list[Instruction], start: str) -> int:
  """The compute ops scheduled after the async op `start` and before its done (which may
  take an `-update` of it)."""
  chain, count, seen = {start}, 0, False
  for name, op, rest in instructions:
    if name == start:
      seen = True
    elif not seen:
      continue
    elif op.endswith("-update") and _uses(rest, chain):
      chain.add(name)
    elif op.endswith("-done") and _uses(rest, chain):
      return count
    elif op in COMPUTE_OPS:
      count += 1
  return count


def hlo_collectives(hlo: str) -> dict[str, dict[str, Any]]:
  """The collectives of an optimized HLO module, by op and element type (`all-gather bf16`):
  `count`; `async`, how many run as a start/done pair (`all-gather-start`, or an
  `async-start` calling a computation that holds the collective); `sync_marked`, how many
  of those XLA marked `is_sync` (run in line after all); and `compute_between`, for each
  async one, the compute ops scheduled between its start and its done (0: nothing to
  overlap)."""
  computations = _computations(hlo)
  # the computation an async-start calls -> (the caller, the start, the start's line)
  wrapped: dict[str, tuple[str, str, str]] = {}
  for comp, instructions in computations.items():
    for name, op, rest in instructions:
      if op == "async-start" and (called := CALLS.search(rest)):
        wrapped[called.group("name")] = (comp, name, rest)
  found: dict[str, dict[str, Any]] = {}
  for comp, instructions in computations.items():
    for name, op, rest in instructions:
      base = op.removesuffix("-start")
      if base not in COLLECTIVES:
        continue
      types = "/".join(sorted(set(ELEMENT.findall(rest[:rest.find(op + "(")]))))
      entry = found.setdefault(f"{base} {types}", dict(count=0, sync_marked=0, compute_between=[]))
      entry["count"] += 1
      if op.endswith("-start") or comp in wrapped:
        where, start, line = (comp, name, rest) if op.endswith("-start") else wrapped[comp]
        entry["compute_between"].append(_between(computations[where], start))
        entry["sync_marked"] += bool(SYNC.search(line))
  for entry in found.values():
    entry["async"] = len(entry["compute_between"])
  return found


def collectives(compiled: Any) -> dict[str, dict[str, Any]]:
  return hlo_collectives(compiled.as_text())


# --------------------------------------------------------------------------- checks and timing


def _bits(a: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(a, {2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize])


@jax.jit
def _compare(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
  norm = jnp.linalg.norm(b32.ravel())
  relative = jnp.linalg.norm((a32 - b32).ravel()) / jnp.where(norm > 0, norm, 1.0)
  return jnp.max(jnp.abs(a32 - b32)), relative, jnp.all(_bits(a) == _bits(b))


def compare(found: Any, reference: Any, tolerance: float) -> dict[str, Any]:
  """Against the reference, over the loss, every layer's gradient and each microbatch's
  input's: the max abs difference, the largest relative difference of one array (the norm
  of the difference over the reference's norm; the pass criterion, within `tolerance`) and
  which array it was, and whether every bit is equal."""
  value, grads, dxs = found
  ref_value, ref_grads, ref_dxs = reference
  inputs = ["input"] if len(dxs) == 1 else [f"input {j}" for j in range(len(dxs))]
  names = ["loss", *(f"layer {i}" for i in range(len(grads))), *inputs]
  worst_abs, worst_rel, worst, bitwise = 0.0, 0.0, "loss", True
  for name, a, b in zip(names, [value, *grads, *dxs], [ref_value, *ref_grads, *ref_dxs]):
    diff, rel, same = _compare(a, b)
    worst_abs = max(worst_abs, float(diff))
    if float(rel) > worst_rel:
      worst_rel, worst = float(rel), name
    bitwise &= bool(same)
  return {"max_abs_diff": worst_abs, "max_rel_diff": worst_rel, "worst": worst,
          "bitwise": bitwise, "ok": worst_rel <= tolerance}


def timed_round(variant: Variant, steps: int) -> float:
  """Milliseconds per step over `steps` steps, from an idle device to the last one's end."""
  begin = time.perf_counter()
  for _ in range(steps):
    out = variant.step()
  jax.block_until_ready(out)
  return 1e3 * (time.perf_counter() - begin) / steps


def trace(variant: Variant, steps: int, folder: str) -> dict[str, Any]:
  """A profiler trace of `steps` steps in `folder`, reduced to NCCL time per GPU."""
  from benchmarks.llama_fsdp import trace_summary  # imports the Llama example

  def run() -> Any:
    out = None
    for _ in range(steps):
      out = variant.step()
    return out

  recorded = profiling.record_trace(run, folder)
  return {"folder": folder, **trace_summary(recorded, steps)}


# --------------------------------------------------------------------------- main


def table(records: dict[str, dict[str, Any]]) -> str:
  lines = [f"{'variant':<18} {'calls':>5} {'AG':>4} {'RS':>4} {'kept':>4} {'step ms':>10} "
           f"{'spread':>7} {'/ whole':>8}  grads vs whole (max rel diff)"]
  for name, r in records.items():
    c = r["correct"]
    agreement = ("reference" if name == "whole" else
                 f"{'bitwise' if c['bitwise'] else 'near'} {c['max_rel_diff']:.2e}"
                 f"{'' if c['ok'] else ' FAILED'}")
    step = r.get("step_ms")
    timing = (f"{step['median']:>10.2f} {step['spread_pct']:>6.1f}% {r['vs_whole']:>8.3f}"
              if step else f"{'-':>10} {'-':>7} {'-':>8}")
    per_step, kept = r["collectives_per_step"], r["peak_alive"]["gathered_layers"]
    lines.append(f"{name:<18} {r['calls']:>5} {per_step.get('all-gather', 0):>4} "
                 f"{per_step.get('reduce-scatter', 0):>4} {'-' if kept is None else kept:>4} "
                 f"{timing}  {agreement}")
  lines += ["calls, all-gathers (AG) and reduce-scatters (RS) a step; kept: the most gathered "
            "layers alive at once (-: XLA's choice)",
            "", f"{'executable':<40} collectives: count (async; of those marked is_sync; "
            "compute ops between each start and done)"]
  for name, r in records.items():
    for exe, found in r["collectives"].items():
      text = "; ".join(
          f"{k} x{v['count']} (async {v['async']}"
          + (f"; sync {v['sync_marked']}; between {v['compute_between']}" if v["async"] else "")
          + ")" for k, v in sorted(found.items())) or "none"
      lines.append(f"{name + ' ' + exe:<40} {text}")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--variants", nargs="+", default=None, choices=VARIANTS + STEP_VARIANTS,
                      help=f"default: all ({', '.join(STEP_VARIANTS)} with --microbatches 2 "
                           "or more only)")
  parser.add_argument("--layers", type=int, default=None)
  parser.add_argument("--tokens", type=int, default=None, help="tokens per device a step")
  parser.add_argument("--microbatches", type=int, default=1,
                      help="a step's forward and backward passes, each over --tokens / M "
                           "tokens per device, their gradients summed")
  parser.add_argument("--tiny", action="store_true",
                      help="CPU smoke run: width 64, 4 layers, 1 round of 1 step")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
  parser.add_argument("--tolerance", type=float, default=0.1,
                      help="largest relative difference from whole of one array (loss, a layer's "
                           "gradient, the input's): the difference's norm over whole's")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--trace", default=None, metavar="DIR",
                      help="write a profiler trace of --trace-steps steps per variant here")
  parser.add_argument("--trace-steps", type=int, default=2)
  parser.add_argument("--out", default=None, help="folder for fsdp_prefetch.json")
  args = parser.parse_args()
  size = TINY if args.tiny else LLAMA_1B
  if args.tiny:
    args.rounds, args.steps, args.warmup = 1, 1, 1
  size = dataclasses.replace(size, layers=args.layers or size.layers,
                             tokens=args.tokens or size.tokens, microbatches=args.microbatches)
  if size.microbatches < 1 or size.tokens % size.microbatches:
    parser.error(f"--microbatches {size.microbatches} does not split {size.tokens} tokens per "
                 "device into equal microbatches: pick a divisor of --tokens")
  offered = VARIANTS + (STEP_VARIANTS if size.microbatches > 1 else ())
  if unknown := [v for v in args.variants or () if v not in offered]:
    parser.error(f"{', '.join(unknown)} keep weights across microbatches: pass --microbatches 2 "
                 "or more")
  names = ["whole", *(v for v in dict.fromkeys(args.variants or offered) if v != "whole")]
  if "per-layer-2" in names and size.layers % 2:
    print(f"per-layer-2 skipped: {size.layers} layers is odd", flush=True)
    names.remove("per-layer-2")

  mesh = jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
  model = Model(size, mesh)
  meta = dict(harness.machine(), devices=jax.device_count(), command=" ".join(sys.argv),
              xla_flags=os.environ.get("XLA_FLAGS", ""), size=dataclasses.asdict(size),
              weights_per_layer=model.weights, padded_per_layer=model.padded,
              args=vars(args))
  print(json.dumps(dict(meta=meta)), flush=True)
  shards, xs = model.init(args.seed)
  gathered_bytes = model.padded * jnp.dtype(COMPUTE).itemsize  # a layer's, per device

  begin = time.perf_counter()
  variants: dict[str, Variant] = {}
  records: dict[str, dict[str, Any]] = {}
  reference = None
  for name in names:
    start = time.perf_counter()
    variant = variants[name] = build(name, model, shards, xs)
    compiled_s = time.perf_counter() - start
    variant.runs.clear()
    out = jax.block_until_ready(variant.step())
    runs = dict(variant.runs)  # calls a step of each executable
    reference = reference or out
    found = {exe: collectives(c) for exe, c in variant.executables.items()}
    per_step = collections.Counter()
    for exe, by_type in found.items():
      for kind, entry in by_type.items():
        per_step[kind.split()[0]] += runs.get(exe, 0) * entry["count"]
    alive = variant.alive
    records[name] = {
        "calls": sum(runs.values()), "compile_s": round(compiled_s, 2),
        "first_step_s": round(time.perf_counter() - start - compiled_s, 2),
        "correct": compare(out, reference, args.tolerance),
        "runs": runs, "collectives_per_step": dict(sorted(per_step.items())),
        "peak_alive": {
            "gathered_layers": alive["gathered"], "gathered_bytes": (
                None if alive["gathered"] is None else alive["gathered"] * gathered_bytes),
            **({"grad_sum_layers": alive["grad_sums"],
                "grad_sum_bytes": alive["grad_sums"] * model.padded
                * model.full_sum_spec.dtype.itemsize}
               if "grad_sums" in alive else {})},
        "collectives": found}
    print(f"[{name}] built in {compiled_s:.1f} s; vs whole: {records[name]['correct']}",
          flush=True)
  correct = all(r["correct"]["ok"] for r in records.values())
  result: dict[str, Any] = dict(meta=meta, correct=correct, variants=records)

  if correct:
    for variant in variants.values():
      for _ in range(args.warmup):
        jax.block_until_ready(variant.step())
    rounds = harness.interleaved(args.rounds, {
        name: lambda v=variant: timed_round(v, args.steps) for name, variant in variants.items()})
    for name, ms in rounds.items():
      records[name]["rounds_ms"] = ms
      records[name]["step_ms"] = harness.summary(ms)
    for name in records:
      records[name]["vs_whole"] = (records["whole"]["step_ms"]["median"]
                                   / records[name]["step_ms"]["median"])
    if args.trace:
      for name, variant in variants.items():
        records[name]["trace"] = trace(variant, args.trace_steps, os.path.join(args.trace, name))
  result["seconds"] = round(time.perf_counter() - begin, 1)
  print(table(records))
  if args.out:
    write_json(pathlib.Path(args.out) / "fsdp_prefetch.json", result, indent=1)
  if not correct:
    failed = [n for n, r in records.items() if not r["correct"]["ok"]]
    raise SystemExit(f"FAILED: {', '.join(failed)} differ from whole by more than "
                     f"{args.tolerance} of its scale: the variants compute different things")
  print(f"correctness: every variant within {args.tolerance} of whole "
        f"({'bitwise' if all(r['correct']['bitwise'] for r in records.values()) else 'near'})")


if __name__ == "__main__":
  main()
