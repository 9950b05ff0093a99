"""FSDP prefetch across executables (`sequential_vjp(..., prefetch=True)`) on 8 devices.

The 8 devices are the default backend's when it has 8, else the CPU backend's 8 virtual ones
(`@pytest.mark.devices(8)`). On the CPU, XLA compiles a reduce-scatter as all-reduce + slice,
so the HLO checks below count all-reduces of a buffer's length.
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxgraph as jg
from jaxgraph import _fusion as fusion_lib
from jaxgraph import fsdp
from jaxgraph import prefetch as prefetch_lib
from models import devices_for

LAYERS, D, H, BATCH = 4, 16, 64, 16


def block(p, x, *, key):
  """An MLP block with a residual, a norm scale, dropout and a batch mean (a batch-mixing
  op: under prefetch it stays a mean over the whole global batch)."""
  h = jnp.tanh(x @ p["w1"].astype(x.dtype) + p["b1"])
  keep = jax.random.bernoulli(key, 0.9, h.shape)
  h = jnp.where(keep, h / 0.9, 0.0)
  y = x + (h @ p["w2"].astype(x.dtype)) * p["scale"]
  return y - 0.5 * jnp.mean(y, axis=0)


def init(seed: int = 0, n: int = LAYERS) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(seed)
  return [dict(w1=(rng.standard_normal((D, H)) / D ** 0.5).astype(np.float32),
               b1=(rng.standard_normal((H,)) * 0.1).astype(np.float32),
               w2=(rng.standard_normal((H, D)) / H ** 0.5).astype(np.float32),
               scale=np.ones((D,), np.float32))
          for _ in range(n)]


@pytest.fixture(scope="module")
def mesh():
  devices = devices_for(8)[:8]
  with jax.default_device(devices[0]):
    yield fsdp.make_mesh(devices=devices)


def _setup(mesh, gather_dtype=None, fn=block, n=LAYERS):
  """`n` graphed layers over flat FSDP buffers and a batch-sharded input."""
  flat = fsdp.shard([jg.flat.ravel(p) for p in init(n=n)], mesh, gather_dtype=gather_dtype)
  x = jax.device_put(np.random.default_rng(1).standard_normal((BATCH, D)).astype(np.float32),
                     fsdp.batch_sharding(mesh))
  layers = jg.make_graphed([fn] * n, sample_args=[(p, x) for p in flat], rng=True,
                           num_warmup_iters=0)
  return layers, flat, x


def _train(layers, flat, x, mesh, *, prefetch, steps=2, fuse=False, after_step=None):
  """SGD steps over the stack; returns the losses, each step's grads and the final input
  gradient (the keys are the same in every run: fresh masks each step). `after_step()` runs
  after each step."""
  tx = optax.sgd(0.1)
  state = tx.init(flat)
  update = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)), out_shardings=(fsdp.shardings(flat, mesh), None))
  losses, all_grads = [], []
  for step in range(steps):
    keys = list(jax.random.split(jax.random.key(step), len(layers)))
    y, pullback = jg.sequential_vjp(layers, flat, x, keys=keys, prefetch=prefetch, fuse=fuse)
    loss, ct = jax.value_and_grad(lambda y: jnp.mean(y ** 2))(y)
    grads, g_x = pullback(ct)
    flat, state = update(grads, state, flat)
    losses.append(np.asarray(loss))
    all_grads.append(grads)
    if after_step is not None:
      after_step()
  return np.array(losses), all_grads, g_x, flat


def _prefetch_default(monkeypatch, mesh, on: bool) -> None:
  """`prefetch=None` forced on or off for `mesh`'s platform (the `platform_gate` fixture
  forces the default backend's: the 8 devices may be the CPU's beside fewer GPUs)."""
  platforms, here = prefetch_lib.PREFETCH_PLATFORMS, mesh.devices.flat[0].platform
  monkeypatch.setattr(prefetch_lib, "PREFETCH_PLATFORMS",
                      platforms | {here} if on else platforms - {here})


def _unsharded_grads(step: int = 0):
  """`jax.grad` of the same stack, unsharded, on one device (the reference math)."""
  params = [jax.tree.map(jnp.asarray, p) for p in init()]
  x = jnp.asarray(np.random.default_rng(1).standard_normal((BATCH, D)).astype(np.float32))
  keys = list(jax.random.split(jax.random.key(step), LAYERS))

  def loss(params):
    h = x
    for p, k in zip(params, keys):
      h = block(p, h, key=k)
    return jnp.mean(h ** 2)

  return jax.grad(loss)(params)


def _buffers(tree):
  return [np.asarray(b) for b in tree.buffers]


@pytest.mark.devices(8)
def test_prefetch_is_the_unprefetched_math(mesh, monkeypatch):
  """Losses, every layer's gradients and the input's gradient over two SGD steps with
  dropout: bitwise those of the same stack unprefetched (the weights gathered as stored),
  and, to rounding, `jax.grad` of the unsharded model (another program: its sums add in
  another order). Unset, prefetch is on where `PREFETCH_PLATFORMS` names the mesh's
  platform. Each collective goes to the executable beside it: the first step gathers and
  reduces its own buffer and the next layer's; a middle step the next layer's, not its own
  (its gradient returned unreduced); the last step none."""
  layers, flat, x = _setup(mesh)
  _prefetch_default(monkeypatch, mesh, False)
  plain = _train(layers, flat, x, mesh, prefetch=None)
  assert not any(prefetch_lib.steps_of(layer) for layer in layers)
  _prefetch_default(monkeypatch, mesh, True)
  prefetched = _train(layers, flat, x, mesh, prefetch=None)
  np.testing.assert_array_equal(plain[0], prefetched[0])
  for step_plain, step_pre in zip(plain[1], prefetched[1]):
    for a, b in zip(step_plain, step_pre):
      assert b.layout == a.layout
      assert all(np.array_equal(u, v) for u, v in zip(_buffers(a), _buffers(b)))
      assert all(u.sharding == v.sharding for u, v in zip(a.buffers, b.buffers))
  np.testing.assert_array_equal(plain[2], prefetched[2])
  assert prefetched[2].sharding == x.sharding
  reference = _unsharded_grads()
  for grads, ref in zip(prefetched[1][0], reference):
    got = jax.tree.map(np.asarray, jg.flat.unravel(jg.flat.with_gather(grads, None)))
    for k in ref:
      np.testing.assert_allclose(got[k], ref[k], rtol=2e-5, atol=2e-6)
  # Three captures for the chain (its first, middle and last step), none on replay.
  steps = [s for key, s in layers[0].config.segments.items()
           if isinstance(s, prefetch_lib.PrefetchStep)]
  assert [len(s.executables.entries) for s in steps] == [1] * LAYERS
  assert sum(s.counts.captures for s in steps) == 3
  assert [layer.stats.replays for layer in layers] == [4] * LAYERS  # 2 steps of each path
  assert _handed_collectives(layers, flat) == {
      (True, True): (2, 2), (False, True): (1, 1), (False, False): (0, 0)}


def _collectives(hlo: str, length: int) -> int:
  """How many buffers of `length` elements the collectives of `hlo` move (XLA:CPU: all-gather
  and all-reduce; XLA combines several into one of a tuple)."""
  found = 0
  for line in hlo.splitlines():
    op = re.search(r"= (.*?) (all-gather|all-reduce|reduce-scatter)(-start)?\(", line)
    if op:  # the result's shape, or tuple of shapes
      found += len(re.findall(rf"\[{length}\]", op.group(1)))
  return found


def _handed_collectives(layers, flat) -> dict[tuple[bool, bool], tuple[int, int]]:
  """Per prefetching step replayed, by (gathers its own first layer's buffer, gathers the next
  step's): how many buffers its forward's and its backward's collectives move (for a fused
  segment, its other layers' too). Checks that every placed input and output of a step's
  executables is on the Explicit twin: jax 0.11 refuses to lower a program whose shardings
  are on two meshes, even twins."""
  (length,) = {spec.length for spec in flat[0].layout.buffers}
  found = {}
  for step in layers[0].config.segments.values():
    if isinstance(step, prefetch_lib.PrefetchStep) and step.executables.entries:
      (entry,) = step.executables.entries.values()
      forward, backward = entry.forward["explicit", True], entry.backward["full"][0]
      for exe in (forward, backward):
        placed = [sh for sh in jax.tree.leaves((exe.input_shardings, exe.output_shardings))
                  if isinstance(sh, jax.sharding.NamedSharding)]
        assert placed and {sh.mesh.axis_types for sh in placed} == {
            (jax.sharding.AxisType.Explicit,)}
      found[step.fn.own, len(entry.layout.out_specs) > 1] = (
          _collectives(forward.as_text(), length), _collectives(backward.as_text(), length))
  return found


@pytest.mark.devices(8)
def test_prefetch_with_bf16_gather_reduces_in_bf16(mesh):
  """With `gather_dtype=bfloat16` the handed-over gradient is reduced in bfloat16 (as XLA
  reduces it on GPUs in the unprefetched step too, and FSDP2's default reduce dtype); on the
  CPU the unprefetched step reduces it in float32, so the two differ by bf16 rounding of
  the sum, and the losses agree to it."""
  layers, flat, x = _setup(mesh, gather_dtype=jnp.bfloat16)
  plain = _train(layers, flat, x, mesh, prefetch=False, steps=1)
  prefetched = _train(layers, flat, x, mesh, prefetch=True, steps=1)
  np.testing.assert_array_equal(plain[0], prefetched[0])  # same forward, bitwise
  for a, b in zip(plain[1][0], prefetched[1][0]):
    for u, v in zip(_buffers(a), _buffers(b)):
      assert u.dtype == v.dtype == np.float32
      np.testing.assert_allclose(v, u, rtol=2 ** -7, atol=1e-3 * np.abs(u).max())


def elementwise_weight_block(p, x, *, key):
  """Multiplies a 2-D weight into the batch-sharded activations elementwise: a reduced
  operand JAX refuses there, so this layer cannot prefetch."""
  del key
  return x * p["w1"][:, :D].T[0] + x @ p["w2"][:D].T


@pytest.mark.devices(8)
def test_a_layer_that_cannot_prefetch_runs_as_before_and_says_so(mesh, caplog):
  layers, flat, x = _setup(mesh, fn=elementwise_weight_block)
  keys = list(jax.random.split(jax.random.key(0), LAYERS))
  with caplog.at_level(logging.WARNING, logger="jaxgraph"):
    y, pullback = jg.sequential_vjp(layers, flat, x, keys=keys, prefetch=True)
    grads, _ = pullback(jnp.ones_like(y))
  (record,) = [r for r in caplog.records if "Explicit twin" in r.getMessage()]
  assert "elementwise_weight_block[0]" in record.getMessage()
  y2, pullback2 = jg.sequential_vjp(layers, flat, x, keys=keys, prefetch=False)
  grads2, _ = pullback2(jnp.ones_like(y2))
  np.testing.assert_array_equal(y, y2)
  for a, b in zip(grads, grads2):
    assert all(np.array_equal(u, v) for u, v in zip(_buffers(a), _buffers(b)))
  with caplog.at_level(logging.WARNING, logger="jaxgraph"):  # said once
    jg.sequential_vjp(layers, flat, x, keys=keys, prefetch=True)[1](jnp.ones_like(y))
  assert len([r for r in caplog.records if "Explicit twin" in r.getMessage()]) == 1


@pytest.mark.devices(8)
def test_prefetch_composes_with_fuse(mesh, monkeypatch):
  """`fuse=2` over 7 layers: segments of 2 and a remainder of one, each a step of the
  prefetching chain, by default (`prefetch=None`) where `PREFETCH_PLATFORMS` names the
  platform, as without `fuse`. Losses, every layer's gradients and the input's gradient over
  two SGD steps with dropout: bitwise those of the same segments unprefetched (the same
  math: the weights gathered as stored, each gradient reduced over the same devices). One
  capture per position (first, middle, last: the remainder), the middle ones shared, none on
  replay, counted by the layers' `stats`; which layers fuse and prefetch is read on the first
  step, and kept for the second. The middle segment's forward gathers its second layer's
  buffer and the next segment's first, not its own first layer's (the segment below
  gathered it); its backward reduces the same two gradients (the next segment's first
  layer's handed down), not its first layer's (returned unreduced: the segment below reduces
  it, or the gradients above would not be bitwise)."""
  n = 7
  layers, flat, x = _setup(mesh, n=n)
  _prefetch_default(monkeypatch, mesh, False)
  plain = _train(layers, flat, x, mesh, prefetch=None, fuse=2)
  assert not any(prefetch_lib.steps_of(layer) for layer in layers)
  _prefetch_default(monkeypatch, mesh, True)
  planned = []  # which layers fuse and prefetch: read on the first step, kept for the next
  for module in (prefetch_lib, fusion_lib):
    monkeypatch.setattr(module, "runs", lambda *args, runs=module.runs, name=module.__name__: (
        planned.append(name), runs(*args))[1])

  def counts():  # per layer: captures, cache hits, compiles
    return np.array([s[:3] for s in (layer.stats for layer in layers)])

  after = [counts()]
  prefetched = _train(layers, flat, x, mesh, prefetch=None, fuse=2,
                      after_step=lambda: after.append(counts()))
  assert planned == ["jaxgraph.prefetch", "jaxgraph._fusion"]
  np.testing.assert_array_equal(plain[0], prefetched[0])
  for step_plain, step_pre in zip(plain[1], prefetched[1]):
    assert len(step_pre) == n
    for a, b in zip(step_plain, step_pre):
      assert b.layout == a.layout
      assert all(np.array_equal(u, v) for u, v in zip(_buffers(a), _buffers(b)))
      assert all(u.sharding == v.sharding for u, v in zip(a.buffers, b.buffers))
  np.testing.assert_array_equal(plain[2], prefetched[2])
  steps = {i: [s for s in prefetch_lib.steps_of(layer) if s.executables.entries]
           for i, layer in enumerate(layers)}
  assert {i: [len(s.layers) for s in found] for i, found in steps.items() if found} == {
      0: [2], 2: [2], 4: [2], 6: [1]}
  # The first step captured the first, middle and last segment (counted on the layer that
  # leads each); the other middle hit the middle's capture; the second step, nothing.
  added = after[1] - after[0]
  assert list(added[:, 0]) == [1, 0, 1, 0, 0, 0, 1]
  assert list(added[:, 1]) == [0, 0, 0, 0, 1, 0, 0]
  np.testing.assert_array_equal(after[2], after[1])
  # first (its own first layer's buffer, its second's, the next segment's first), middle
  # (its second's and the next's, not its first's), last (the remainder of one: none)
  assert _handed_collectives(layers, flat) == {
      (True, True): (3, 3), (False, True): (2, 2), (False, False): (0, 0)}


@pytest.mark.devices(8)
def test_prefetch_follows_the_grad_mask(mesh):
  """A `grad_mask` freezing a group of each layer (LoRA's frozen base): the frozen buffer
  gets a float0 gradient, the trainable one bitwise the unprefetched one's."""
  params = [jg.flat.ravel(p, group=lambda path, leaf: "frozen" if "w1" in str(path) else None)
            for p in init()]
  flat = fsdp.shard(params, mesh)
  x = jax.device_put(np.ones((BATCH, D), np.float32), fsdp.batch_sharding(mesh))
  mask = [jg.flat.mask(p, lambda group: group != "frozen") for p in flat]
  layers = jg.make_graphed([block] * LAYERS, sample_args=[(p, x) for p in flat], rng=True,
                           grad_mask=lambda p, x: (jg.flat.mask(p, lambda g: g != "frozen"),
                                                   True),
                           num_warmup_iters=0)
  del mask
  keys = list(jax.random.split(jax.random.key(0), LAYERS))
  results = []
  for prefetch in (False, True):
    y, pullback = jg.sequential_vjp(layers, flat, x, keys=keys, prefetch=prefetch)
    results.append(pullback(jnp.ones_like(y)))
  (plain, g_plain), (pre, g_pre) = results
  np.testing.assert_array_equal(g_plain, g_pre)
  for a, b in zip(plain, pre):
    for spec, u, v in zip(a.layout.buffers, a.buffers, b.buffers):
      assert u.dtype == v.dtype
      assert (spec.group == "frozen") == (v.dtype == jax.dtypes.float0)
      assert np.array_equal(u, v)
