"""Residual offload: memory kinds of kept residuals, prefetch, numerics (rng, delay_wgrad,
FSDP, pipeline orders), per-residual selection, the planner, errors, hooks.

On CPU the backend reports `pinned_host` but moves nothing off a real device (docs/offload.md,
"CPU and GPU"; memory kinds: https://docs.jax.dev/en/latest/notebooks/host-offloading.html):
these tests check the plumbing and the numerics. The `gpu` tests check the compiled HLO.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxgraph as jg
from jax.ad_checkpoint import checkpoint_name

from jaxgraph import offload as offload_lib
from jaxgraph import schedule
from models import (attention, dropout_mlp, init_attention, init_mlp, mlp, reference_stack,
                    trees_equal)

D, H, T = 16, 32, 8


def _stack(dtype=jnp.float32, depth=4, fns=None):
  fns = fns or [mlp if i % 2 == 0 else attention for i in range(depth)]
  keys = jax.random.split(jax.random.key(0), len(fns))
  params = [init_attention(k, D, dtype) if f is attention else init_mlp(k, D, H, dtype)
            for f, k in zip(fns, keys)]
  x = jax.random.normal(jax.random.key(1), (T, D)).astype(dtype)
  return fns, params, x


def _entry(layer: jg.GraphedCallable):
  (entry,) = layer.executables.entries.values()
  return entry


def _forward_info(layer: jg.GraphedCallable) -> tuple[list, list]:
  """Output and kept-residual infos of the forward executable capture compiled."""
  entry = _entry(layer)
  ((_, compiled),) = [(kind, c) for (kind, residuals), c in entry.forward.items() if residuals]
  layout = entry.layout
  info = compiled.out_info
  return info[:layout.n_out], info[layout.n_out:layout.n_out + layout.n_kept]


def _kept_kinds(layer: jg.GraphedCallable) -> list[str]:
  """Memory kinds of the kept residuals the forward executable returns."""
  return [o.sharding.memory_kind for o in _forward_info(layer)[1]]


def _output_kinds(layer: jg.GraphedCallable) -> list[str]:
  return [o.sharding.memory_kind for o in _forward_info(layer)[0]]


def _in_kinds(compiled) -> list[str | None]:
  """Memory kinds of a compiled executable's inputs; None for an input it does not read."""
  return [None if s is None else s.memory_kind for s in compiled.input_shardings[0]]


def _held_kinds(pullback) -> list[str]:
  """Memory kinds of the kept residuals a pullback holds now."""
  return [a.sharding.memory_kind for a in pullback._backward.kept]


def _make(fns, samples, mode, **kwargs):
  return jg.make_graphed(fns, sample_args=samples, offload_mode=mode, **kwargs)


MODES = pytest.mark.parametrize("mode", offload_lib.MODES)


def _train(layers, params, x, steps=2, keys=None):
  """A few SGD steps through `sequential_vjp`; returns every step's (y, grads, g_x)."""
  history = []
  for step in range(steps):
    step_keys = None if keys is None else [jax.random.fold_in(k, step) for k in keys]
    y, pullback = jg.sequential_vjp(layers, params, x, keys=step_keys)
    grads, g_x = pullback((y / y.size).astype(y.dtype))
    history.append((y, grads, g_x))
    # One step in flight: XLA:CPU's collectives can hang under more (reliability.md).
    params = jax.block_until_ready([jax.tree.map(lambda p, g: (p - 0.01 * g).astype(p.dtype),
                                                 p, g) for p, g in zip(params, grads)])
  return history


# ------------------------------------------------------------------------------- placement


def test_executable_mode_kept_residuals_live_in_pinned_host():
  fns, params, x = _stack()
  layers = _make(fns, [(p, x) for p in params], "executable", offload_residuals=True)
  for layer in layers:
    kinds = _kept_kinds(layer)
    assert kinds and set(kinds) == {"pinned_host"}
    assert set(_output_kinds(layer)) == {"device"}
  # The arrays the forward executable returns (what a pullback holds) report it too.
  entry = _entry(layers[0])
  leaves = jax.tree.leaves((params[0], x))
  values = entry.forward["explicit", True](*leaves)
  kept = values[entry.layout.n_out:]
  assert [v.sharding.memory_kind for v in kept] == ["pinned_host"] * entry.layout.n_kept
  assert values[0].sharding.memory_kind == "device"


@MODES
def test_without_offload_residuals_stay_on_device(mode):
  fns, params, x = _stack()
  layers = _make(fns, [(p, x) for p in params], mode)
  assert all(set(_kept_kinds(layer)) == {"device"} for layer in layers)
  _, pullback = layers[0].vjp(params[0], x)
  assert set(_held_kinds(pullback)) == {"device"}
  assert layers[0].stats.offload_bytes == 0 < layers[0].stats.residual_bytes


def test_async_mode_executables_are_those_without_offload():
  """The forward returns its residuals on device and the host copies them to pinned_host:
  one compile serves offloaded and resident layers, and the backward donates them."""
  fns, params, x = _stack(fns=[mlp] * 3)
  layers = _make(fns, [(p, x) for p in params], "async",
                 offload_residuals=[True, True, False])
  assert [layer.stats.captures for layer in layers] == [1, 0, 0]
  assert set(_kept_kinds(layers[0])) == {"device"}
  entry = _entry(layers[0])
  compiled, _ = entry.backward["full"]
  assert set(_in_kinds(compiled)) <= {"device", None}
  donated = [info.donated for info in jax.tree.leaves(
      compiled.args_info, is_leaf=lambda info: hasattr(info, "donated"))]
  first_kept = len(entry.layout.needed_inputs) + len(entry.layout.needed_outputs)
  assert donated[first_kept:first_kept + entry.layout.n_kept] == [True] * entry.layout.n_kept
  _, pullback = layers[0].vjp(params[0], x)
  assert _held_kinds(pullback) == ["pinned_host"] * entry.layout.n_kept
  assert layers[0].stats.offload_bytes == layers[0].stats.residual_bytes > 0
  _, resident = layers[2].vjp(params[2], x)
  assert set(_held_kinds(resident)) == {"device"} and layers[2].stats.offload_bytes == 0
  grads = pullback(jnp.ones((T, D)))
  assert all(g.sharding.memory_kind == "device" for g in jax.tree.leaves(grads))


def test_prefetch_brings_residuals_back_before_the_backward():
  fns, params, x = _stack(fns=[mlp])
  layer = _make(fns[0], (params[0], x), "async", offload_residuals=True)
  _, pullback = layer.vjp(params[0], x)
  assert set(_held_kinds(pullback)) == {"pinned_host"}
  pullback.prefetch()
  assert set(_held_kinds(pullback)) == {"device"}
  pullback.prefetch()  # once is enough: a no-op now
  grads = pullback(jnp.ones((T, D)))
  pullback.prefetch()  # and after the backward
  _, again = layer.vjp(params[0], x)
  assert trees_equal(grads, again(jnp.ones((T, D))))  # the pullback prefetches itself


def test_sequential_vjp_prefetches_one_layer_ahead():
  """When layer i's backward starts, layer i-1's residuals are on their way back (device
  arrays) and layer i-2's are still in host memory: a prefetch distance of one layer."""
  depth = 4
  fns, params, x = _stack(fns=[mlp] * depth)
  seen = []
  steps = []

  def pre_backward(event):
    if event.phase != "replay":
      return
    seen.append((event.index, [set(_held_kinds(steps[i][2])) if i >= 0 else None
                               for i in (event.index - 1, event.index - 2)]))

  layers = _make(fns, [(p, x) for p in params], "async", offload_residuals=True,
                 hooks=jg.Hooks(pre_backward=[pre_backward]), num_warmup_iters=0)
  y, pullback = jg.sequential_vjp(layers, params, x)
  steps.extend(pullback._steps)
  assert all(set(_held_kinds(p)) == {"pinned_host"} for _, _, p in steps)
  pullback(jnp.ones_like(y))
  device, host = {"device"}, {"pinned_host"}
  assert seen == [(3, [device, host]), (2, [device, host]), (1, [device, None]),
                  (0, [None, None])]


@MODES
def test_backward_takes_residuals_and_returns_device_grads(mode):
  fns, params, x = _stack()
  layer = _make(fns[0], (params[0], x), mode, offload_residuals=True)
  entry = _entry(layer)
  layout = entry.layout
  compiled, _ = entry.backward["full"]
  in_kinds = _in_kinds(compiled)
  first_kept = len(layout.needed_inputs) + len(layout.needed_outputs)
  assert set(in_kinds[:first_kept]) <= {"device", None}
  kept_kind = "pinned_host" if mode == "executable" else "device"
  assert set(in_kinds[first_kept:first_kept + layout.n_kept]) == {kept_kind}
  assert {s.memory_kind for s in compiled.output_shardings} == {"device"}
  if mode == "executable":
    # Host residuals are not donated: XLA would alias them to device outputs.
    assert "input_output_alias" not in compiled.as_text().splitlines()[0]
  _, pullback = layer.vjp(params[0], x)
  assert set(_held_kinds(pullback)) == {"pinned_host"}
  grads = pullback(jnp.ones((T, D)))
  assert all(g.sharding.memory_kind == "device" for g in jax.tree.leaves(grads))


def test_weights_are_never_offloaded():
  """The backward reads weight matrices from the forward's arguments, which stay on device."""
  fns, params, x = _stack()
  layers = _make(fns, [(p, x) for p in params], "executable", offload_residuals=True)
  for layer, p in zip(layers, params):
    entry = _entry(layer)
    layout = entry.layout
    matrices = {i for i, leaf in enumerate(jax.tree.leaves(p)) if leaf.ndim == 2}
    assert matrices and matrices <= set(layout.needed_inputs)
    assert {i for kind, i in layout.sources if kind == "in"} == set(layout.needed_inputs)
    compiled, _ = entry.backward["full"]
    weight_kinds = [_in_kinds(compiled)[layout.needed_inputs.index(i)] for i in matrices]
    assert set(weight_kinds) == {"device"}


# ------------------------------------------------------------------------------- numerics


@MODES
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_offload_numerics_bitwise_equal_to_no_offload(dtype, mode):
  fns, params, x = _stack(dtype)
  samples = [(p, x) for p in params]
  plain = jg.make_graphed(fns, sample_args=samples)
  offloaded = _make(fns, samples, mode, offload_residuals=True)
  got, want = _train(offloaded, params, x, steps=3), _train(plain, params, x, steps=3)
  assert trees_equal(got, want)
  y, grads, g_x = got[0]
  y_ref, grads_ref, g_x_ref = reference_stack(fns, params, x, (y / y.size).astype(dtype))
  assert trees_equal((y, grads, g_x), (y_ref, grads_ref, g_x_ref))


@MODES
@pytest.mark.parametrize("explicit_keys", [True, False], ids=["explicit", "stream"])
def test_offload_with_rng(explicit_keys, mode):
  fns, params, x = _stack(fns=[dropout_mlp] * 3)
  samples = [(p, x) for p in params]
  seed = jax.random.key(7)
  plain = jg.make_graphed(fns, sample_args=samples, rng=seed)
  offloaded = _make(fns, samples, mode, rng=seed, offload_residuals=True)
  keys = list(jax.random.split(jax.random.key(3), 3)) if explicit_keys else None
  _, pullback = offloaded[0].vjp(params[0], x, key=keys[0] if keys else None)
  assert set(_held_kinds(pullback)) == {"pinned_host"}
  del pullback
  if not explicit_keys:
    offloaded[0].seed(seed)  # the vjp above drew a key: start the stream again
  got, want = _train(offloaded, params, x, keys=keys, steps=3), _train(plain, params, x,
                                                                       keys=keys, steps=3)
  assert trees_equal(got, want)
  if not explicit_keys:
    assert [g.rng_counter for g in offloaded] == [g.rng_counter for g in plain] == [3, 3, 3]


@MODES
def test_offload_rng_backward_order_does_not_matter(mode):
  fns, params, x = _stack(fns=[dropout_mlp] * 2)
  layers = _make(fns, [(p, x) for p in params], mode, rng=True, offload_residuals=True)
  k0, k1 = jax.random.split(jax.random.key(5))
  _, pb_a = layers[0].vjp(params[0], x, key=k0)
  _, pb_b = layers[1].vjp(params[1], x, key=k1)
  ct = jnp.ones((T, D))
  pb_a.prefetch()  # out of order too
  g_b, g_a = pb_b(ct), pb_a(ct)
  _, pb_a2 = layers[0].vjp(params[0], x, key=k0)
  _, pb_b2 = layers[1].vjp(params[1], x, key=k1)
  assert trees_equal((g_a, g_b), (pb_a2(ct), pb_b2(ct)))


@MODES
def test_offload_with_delay_wgrad(mode):
  fns, params, x = _stack()
  samples = [(p, x) for p in params]
  plain = jg.make_graphed(fns, sample_args=samples)
  offloaded = _make(fns, samples, mode, delay_wgrad=True, offload_residuals=True)
  entry = _entry(offloaded[0])
  first_kept = len(entry.layout.needed_inputs) + len(entry.layout.needed_outputs)
  kept = range(first_kept, first_kept + entry.layout.n_kept)
  for kind in ("dgrad", "wgrad"):
    compiled, _ = entry.backward[kind]
    # the wgrad takes the kept buffers it reads (and the dgrad's stash)
    inputs = entry.split.reads if kind == "wgrad" else range(len(_in_kinds(compiled)))
    kept_kinds = [k for i, k in zip(inputs, _in_kinds(compiled)) if i in kept]
    kept_kind = "pinned_host" if mode == "executable" else "device"
    assert kept_kind in kept_kinds and set(kept_kinds) <= {kept_kind, None}
  for _ in range(2):
    y, pullback = jg.sequential_vjp(offloaded, params, x)
    ct = y / y.size
    _, g_x = pullback(ct)
    wgrads = pullback.wgrad()
    y_ref, pullback_ref = jg.sequential_vjp(plain, params, x)
    grads_ref, g_x_ref = pullback_ref(ct)
    assert trees_equal((y, g_x, wgrads), (y_ref, g_x_ref, grads_ref))
    params = [jax.tree.map(lambda p, g: p - 0.01 * g, p, g) for p, g in zip(params, wgrads)]


@MODES
def test_per_callable_offload_all_but_last_k(mode):
  depth, last_k = 6, 2
  fns, params, x = _stack(depth=depth)
  flags = [True] * (depth - last_k) + [False] * last_k
  samples = [(p, x) for p in params]
  layers = _make(fns, samples, mode, offload_residuals=flags)
  for layer, flag, p in zip(layers, flags, params):
    _, pullback = layer.vjp(p, x)
    assert set(_held_kinds(pullback)) == {"pinned_host" if flag else "device"}
    assert (layer.stats.offload_bytes > 0) == flag
  # One function, two placements: inside the executables they compile separately.
  mlp_layers = [layer for layer, f in zip(layers, fns) if f is mlp]
  captures = [1, 0, 1] if mode == "executable" else [1, 0, 0]
  assert [layer.stats.captures for layer in mlp_layers] == captures
  plain = jg.make_graphed(fns, sample_args=samples)
  assert trees_equal(_train(layers, params, x, steps=3), _train(plain, params, x, steps=3))


@MODES
def test_offload_with_fsdp(mode):
  mesh = jg.fsdp.make_mesh()
  layer = jg.fsdp.remat(lambda p, x: mlp(jg.fsdp.gather(p, mesh), x))
  params = [jg.fsdp.shard(init_mlp(k, D, H), mesh, min_size=1)
            for k in jax.random.split(jax.random.key(0), 2)]
  x = jax.device_put(jnp.ones((T, D)), NamedSharding(mesh, P()))
  samples = [(p, x) for p in params]
  offloaded = _make([layer] * 2, samples, mode, offload_residuals=True)
  plain = jg.make_graphed([layer] * 2, sample_args=samples)
  _, pullback = offloaded[0].vjp(params[0], x)
  assert set(_held_kinds(pullback)) == {"pinned_host"}
  assert all(len(a.sharding.device_set) == len(mesh.devices.flat)
             for a in pullback._backward.kept)
  pullback.prefetch()  # async: copies back now; executable: the backward copies them
  assert set(_held_kinds(pullback)) == {"device" if mode == "async" else "pinned_host"}
  got, want = _train(offloaded, params, x, steps=3), _train(plain, params, x, steps=3)
  assert trees_equal(got, want)
  grads = got[0][1]
  assert grads[0]["w1"].sharding == params[0]["w1"].sharding


@MODES
def test_offload_with_pipeline_order(mode):
  """An interleaved order over 2 chunks of 2 layers and 3 microbatches, with delay_wgrad:
  bitwise equal to the same order without offload."""
  microbatches = 3
  fns, params, x = _stack(fns=[mlp] * 4)
  inputs = [x + i for i in range(microbatches)]
  order = schedule.interleaved_1f1b(microbatches, 2)
  samples = [(p, x) for p in params]
  loss_fn = lambda y, t: jnp.mean((y - t) ** 2)
  results = []
  for offload in (False, True):
    layers = _make(fns, samples, mode, order=order, delay_wgrad=True,
                   offload_residuals=offload, num_warmup_iters=1)
    pipeline = schedule.Pipeline([layers[:2], layers[2:]], order, loss_fn=loss_fn)
    results.append(pipeline([params[:2], params[2:]], inputs, inputs))
  assert trees_equal((results[0].outputs, results[0].grads, results[0].input_grads),
                     (results[1].outputs, results[1].grads, results[1].input_grads))


@MODES
def test_inference_call_keeps_no_residuals(mode):
  fns, params, x = _stack()
  layer = _make(fns[0], (params[0], x), mode, offload_residuals=True)
  y = layer(params[0], x)
  entry = _entry(layer)
  inference = entry.forward["explicit", False]
  assert len(inference.out_info) == entry.layout.n_out
  assert y.sharding.memory_kind == "device"


# ------------------------------------------------------------------------ which residuals


def named_mlp(p, x):
  """An MLP whose hidden activation is named, under a policy that saves names and matmuls."""
  h = checkpoint_name(jnp.tanh(x @ p["w1"] + p["b1"]), "hidden")
  return x + h @ p["w2"]


def _save_named(prim, *avals, **params):
  del avals
  return prim.name == "name" or (prim.name == "dot_general")


@MODES
def test_offload_by_checkpoint_name(mode, packing):
  fns, params, x = _stack(fns=[named_mlp] * 2)
  samples = [(p, x) for p in params]
  layers = _make(fns, samples, mode, offload_residuals=True, offload_names=["hidden"],
                 remat_policy=_save_named)
  buffers = _entry(layers[0]).layout.buffers
  named = [i for i, b in enumerate(buffers) if b.name == "hidden"]
  assert len(named) == 1 and len(buffers) > 1
  assert layers[0].stats.offload_bytes == buffers[named[0]].nbytes == T * H * 4
  _, pullback = layers[0].vjp(params[0], x)
  assert [k == "pinned_host" for k in _held_kinds(pullback)] == [
      i in named for i in range(len(buffers))]
  plain = jg.make_graphed(fns, sample_args=samples, remat_policy=_save_named)
  assert trees_equal(_train(layers, params, x), _train(plain, params, x))


def test_checkpoint_names_are_found_without_a_policy(packing):
  """Without a remat_policy (what `jax.vjp` saves) a named residual is found and offloaded
  alone, whether the residuals travel packed or not (tests/test_capture.py: without
  offload_names it packs like the others)."""
  fns, params, x = _stack(fns=[named_mlp])
  layer = jg.make_graphed(fns[0], sample_args=(params[0], x), offload_residuals=True,
                          offload_names=["hidden"])
  buffers = _entry(layer).layout.buffers
  named = [b.name == "hidden" for b in buffers]
  assert named.count(True) == 1 and len(buffers) > 1
  # The others (float32 alike) travel as one buffer where packing is on: packed, or the one
  # residual left beside `hidden` (XLA:GPU's jax.vjp keeps one; XLA:CPU's more). Where it is
  # off, each is a buffer of its own.
  if packing:
    assert named.count(False) == 1
  else:
    assert len(buffers) == len(_entry(layer).layout.packing.shapes)
  _, pullback = layer.vjp(params[0], x)
  assert [k == "pinned_host" for k in _held_kinds(pullback)] == named
  assert layer.stats.offload_bytes == T * H * 4


def wide_and_narrow(p, x):
  """Keeps wide residuals (the hidden activation) and a narrow one (the sine's cosine)."""
  return jnp.sin(mlp(p, x))


@MODES
def test_offload_by_size(mode):
  """The hidden activation's residuals (2048 x 640 float32, 5 MiB) travel alone and move;
  the narrow one (2048 x 16) stays."""
  rows, hidden = 2048, 640
  keys = jax.random.split(jax.random.key(0), 2)
  fns, params = [wide_and_narrow] * 2, [init_mlp(k, D, hidden) for k in keys]
  x = jax.random.normal(jax.random.key(1), (rows, D))
  samples = [(p, x) for p in params]
  threshold = rows * hidden * 4
  layers = _make(fns, samples, mode, offload_residuals=True, offload_min_bytes=threshold)
  plain = jg.make_graphed(fns, sample_args=samples)
  for layer, p in zip(layers, params):
    buffers = _entry(layer).layout.buffers
    big = [b.nbytes >= threshold for b in buffers]
    assert any(big) and not all(big)
    _, pullback = layer.vjp(p, x)
    assert [k == "pinned_host" for k in _held_kinds(pullback)] == big
    assert layer.stats.offload_bytes == sum(b.nbytes for b in buffers if b.nbytes >= threshold)
  assert trees_equal(_train(layers, params, x), _train(plain, params, x))


# ------------------------------------------------------------------------------- errors


def test_per_callable_flags_of_wrong_length_raise():
  fns, params, x = _stack()
  with pytest.raises(ValueError, match="one bool per callable"):
    jg.make_graphed(fns, sample_args=[(p, x) for p in params], offload_residuals=[True])


@pytest.mark.parametrize("kwargs, error, match", [
    pytest.param(dict(offload_mode="later"), ValueError,
                 r"offload_mode must be one of \('async', 'executable'\)", id="mode"),
    pytest.param(dict(offload_min_bytes=-1), ValueError, r"offload_min_bytes must be an int >= 0",
                 id="negative_min_bytes"),
    pytest.param(dict(offload_min_bytes=1.5), TypeError, r"offload_min_bytes must be an int",
                 id="float_min_bytes"),
    pytest.param(dict(offload_names="hidden"), TypeError,
                 r"offload_names takes a sequence of checkpoint_name strings", id="str_names"),
    pytest.param(dict(offload_names=()), ValueError, r"offload_names=\(\) selects no residual",
                 id="empty_names"),
    pytest.param(dict(offload_residuals=False, offload_names=["hidden"]), ValueError,
                 r"offload_residuals offloads none; pass offload_residuals=True",
                 id="names_without_offload"),
    pytest.param(dict(offload_residuals=False, offload_min_bytes=1), ValueError,
                 r"offload_residuals offloads none", id="min_bytes_without_offload"),
])
def test_offload_argument_errors(kwargs, error, match):
  fns, params, x = _stack()
  kwargs = dict(offload_residuals=True) | kwargs
  with pytest.raises(error, match=match):
    jg.make_graphed(fns[0], sample_args=(params[0], x), **kwargs)


class _DeviceWithoutHost:
  platform = "fake"

  def addressable_memories(self):
    return [type("Memory", (), {"kind": "device"})()]

  def __str__(self):
    return "FakeDevice(id=0)"


def test_backend_without_pinned_host_raises(monkeypatch):
  fns, params, x = _stack()
  monkeypatch.setattr(offload_lib.jax, "devices", lambda *a: [_DeviceWithoutHost()])
  with pytest.raises(ValueError, match="pinned_host.*offload_residuals=False"):
    jg.make_graphed(fns[0], sample_args=(params[0], x), offload_residuals=True)



# ------------------------------------------------------------------------------- planning

GIB = 2 ** 30
LINK = offload_lib.Link(to_host=50 * GIB, to_device=25 * GIB)


def test_predict_seconds_without_offload_is_compute():
  assert offload_lib.predict_seconds([False] * 3, [GIB] * 3, [1.0] * 3, [2.0] * 3, LINK) == 9.0


def test_predict_seconds_hides_copies_that_fit_behind_compute():
  """Layer 0's copy out (1/50 s) runs during layer 1's forward; its copy back (1/25 s) is
  issued when layer 1's backward starts and is done before it ends: no stall."""
  flags, sizes = [True, False], [GIB, GIB]
  assert offload_lib.predict_seconds(flags, sizes, [0.1] * 2, [0.2] * 2, LINK) == pytest.approx(
      0.6)
  # A copy back longer than the backward it hides behind stalls by the difference.
  slow = offload_lib.Link(to_host=50 * GIB, to_device=2.5 * GIB)  # 0.4 s
  assert offload_lib.predict_seconds(flags, sizes, [0.1] * 2, [0.2] * 2, slow) == pytest.approx(
      0.8)
  # The last layer's residuals are needed first: offloading it stalls at once.
  assert offload_lib.predict_seconds([False, True], sizes, [0.1] * 2, [0.2] * 2,
                                     LINK) > 0.6 + 1 / 50


def test_plan_for_a_budget_offloads_the_fewest_first_layers():
  layers = 12
  plan = offload_lib.plan([GIB] * layers, [0.002] * layers, [0.004] * layers, LINK,
                          budget_bytes=5 * GIB)
  assert plan.flags == (True,) * 7 + (False,) * 5 and plan.min_bytes == 0  # layers move whole
  assert plan.offloaded_bytes == 7 * GIB and plan.resident_bytes == 5 * GIB
  assert plan.compute_seconds == pytest.approx(0.072)
  assert plan.predicted_seconds > plan.compute_seconds  # 1 GiB copies do not hide in 6 ms
  report = str(plan)
  assert "offload 7 of 12 layers" in report and "at most 5.00 GiB" in report


def test_plan_for_a_zero_budget_offloads_every_layer():
  plan = offload_lib.plan([GIB] * 2, [0.1] * 2, [0.2] * 2, LINK, budget_bytes=0)
  assert plan.flags == (True, True) and plan.resident_bytes == 0


def test_plan_for_a_slowdown_offloads_the_most_layers_that_hide():
  """Copies of 1 GiB (20 ms out, 40 ms back) behind 100 ms forwards and 200 ms backwards
  hide for all layers but the last; the last one's copy back would stall."""
  layers = 4
  plan = offload_lib.plan([GIB] * layers, [0.1] * layers, [0.2] * layers, LINK,
                          max_slowdown=0.01)
  assert plan.flags == (True, True, True, False)
  assert plan.predicted_seconds == pytest.approx(plan.compute_seconds)
  assert "within 1%" in str(plan)
  none = offload_lib.plan([GIB] * layers, [1e-4] * layers, [2e-4] * layers, LINK,
                          max_slowdown=0.01)
  assert none.flags == (False,) * layers and none.offloaded_bytes == 0


MIB = 2 ** 20
# Per layer a 1 GiB buffer and two smaller ones on LINK: the 1 GiB buffer alone (20 ms out
# beside 25 ms forwards, 40 ms back beside 50 ms backwards) hides; with the 512 MiB one
# (60 ms back) or the whole layer it does not.
BUFFERS, FORWARD, BACKWARD = [GIB, 512 * MIB, 128 * MIB], 0.025, 0.05


def test_plan_for_a_slowdown_moves_part_of_each_layer_where_whole_layers_stall():
  layers = 4
  whole = offload_lib.plan([sum(BUFFERS)] * layers, [FORWARD] * layers, [BACKWARD] * layers,
                           LINK, max_slowdown=0.01)
  parts = offload_lib.plan([BUFFERS] * layers, [FORWARD] * layers, [BACKWARD] * layers, LINK,
                           max_slowdown=0.01)
  assert whole.offloaded_bytes == 0 and whole.min_bytes == 0
  assert parts.flags == (True, True, True, False)  # the last layer's copy back would stall
  assert parts.min_bytes == GIB and parts.moved_bytes == (GIB,) * 3 + (0,)
  assert parts.offloaded_bytes == 3 * GIB and parts.resident_bytes == 4 * sum(BUFFERS) - 3 * GIB
  assert parts.predicted_seconds <= 1.01 * parts.compute_seconds
  report = str(parts)
  assert ("offload 3 of 4 layers (the first 3), of each its kept buffers of at least 1.00 GiB: "
          "3.00 GiB to host, 3.50 GiB stay") in report
  assert "layer 0 moves 1.00 GiB, 20.00 ms to host beside a 25.00 ms forward" in report


def test_plan_for_a_budget_picks_the_fastest_split_that_meets_it():
  """Moving 3 GiB as the 1 GiB buffers of 3 layers hides; as 2 whole layers it stalls."""
  layers, budget = 4, 4 * sum(BUFFERS) - 3 * GIB
  args = ([FORWARD] * layers, [BACKWARD] * layers, LINK)
  whole = offload_lib.plan([sum(BUFFERS)] * layers, *args, budget_bytes=budget)
  parts = offload_lib.plan([BUFFERS] * layers, *args, budget_bytes=budget)
  assert whole.flags == (True, True, False, False)
  assert parts.flags == (True, True, True, False) and parts.min_bytes == GIB
  assert parts.resident_bytes == budget
  assert parts.predicted_seconds == pytest.approx(parts.compute_seconds)
  assert whole.predicted_seconds > parts.predicted_seconds
  # Nothing may stay: every buffer of every layer moves (min_bytes 0), however slow.
  everything = offload_lib.plan([BUFFERS] * layers, *args, budget_bytes=0)
  assert everything.flags == (True,) * layers and everything.min_bytes == 0
  assert everything.moved_bytes == (sum(BUFFERS),) * layers


def test_plan_of_kept_buffers_moves_what_make_graphed_moves():
  """The plan's min_bytes, passed to make_graphed, offloads exactly its moved_bytes."""
  rows, hidden = 2048, 640
  keys = jax.random.split(jax.random.key(0), 2)
  fns, params = [wide_and_narrow] * 2, [init_mlp(k, D, hidden) for k in keys]
  x = jax.random.normal(jax.random.key(1), (rows, D))
  samples = [(p, x) for p in params]
  plain = jg.make_graphed(fns, sample_args=samples)
  buffers = [[b.nbytes for b in layer.kept_buffers] for layer in plain]
  assert [sum(b) for b in buffers] == [layer.stats.residual_bytes for layer in plain]
  assert len(set(buffers[0])) > 1  # wide and narrow buffers: a partial plan exists
  # A link that moves the widest buffers of layer 0 out behind layer 1's forward and back
  # behind its backward (10 ms each), and not the whole layer.
  widest = max(buffers[0])
  moved = sum(b for b in buffers[0] if b >= widest)
  link = offload_lib.Link(to_host=moved / 0.01, to_device=moved / 0.01)
  plan = offload_lib.plan(buffers, [0.01] * 2, [0.01] * 2, link, max_slowdown=0.001)
  assert plan.flags == (True, False) and plan.min_bytes == widest
  layers = jg.make_graphed(fns, sample_args=samples, offload_residuals=list(plan.flags),
                           offload_min_bytes=plan.min_bytes)
  assert tuple(layer.stats.offload_bytes for layer in layers) == plan.moved_bytes
  assert trees_equal(_train(layers, params, x), _train(plain, params, x))


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(), "exactly one goal", id="no_goal"),
    pytest.param(dict(budget_bytes=1, max_slowdown=0.1), "exactly one goal", id="two_goals"),
    pytest.param(dict(budget_bytes=-1), "budget_bytes=-1; it must be >= 0", id="negative"),
])
def test_plan_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    offload_lib.plan([GIB], [0.1], [0.2], LINK, **kwargs)
  with pytest.raises(ValueError, match="one of each per layer"):
    offload_lib.plan([GIB, GIB], [0.1], [0.2], LINK, budget_bytes=0)


def test_measure_link_reports_positive_speeds():
  link = offload_lib.measure_link(1 << 20, repeats=2)
  assert link.to_host > 0 and link.to_device > 0


# ------------------------------------------------------------------------------- warmup hooks


def test_trace_time_flag_flipped_by_warmup_hooks_does_not_reach_executables():
  """Capture traces before the warmup: a flag the function reads while tracing is fixed then."""
  state = {"offload": True, "seen": []}

  def layer(p, x):
    state["seen"].append(state["offload"])
    return mlp(p, x)

  fns, params, x = _stack(fns=[mlp] * 2)
  layers = jg.make_graphed(
      [layer] * 2, sample_args=[(p, x) for p in params], offload_residuals=True,
      pre_warmup_hook=lambda: state.update(offload=False),
      post_warmup_hook=lambda: state.update(offload=True))
  assert state["seen"] == [True]  # one trace, at capture, before pre_warmup_hook ran
  state["offload"] = False
  _train(layers, params, x)
  assert state["seen"] == [True]  # replays never trace again
  _, pullback = layers[0].vjp(params[0], x)
  assert set(_held_kinds(pullback)) == {"pinned_host"}


# ------------------------------------------------------------------------------- GPU


def _gpu_stack():
  fns, params, x = _stack(jnp.bfloat16, fns=[mlp] * 4)
  x = jnp.ones((1024, D), jnp.bfloat16)
  return fns, params, x


@pytest.mark.gpu
def test_gpu_compiled_executables_copy_residuals_through_host_memory():
  fns, params, x = _gpu_stack()
  layers = jg.make_graphed(fns, sample_args=[(p, x) for p in params], offload_residuals=True,
                           offload_mode="executable")
  entry = _entry(layers[0])
  forward = entry.forward["explicit", True].as_text()
  backward = entry.backward["full"][0].as_text()
  # S(5) is XLA's host memory space: the forward's kept outputs and the backward's inputs.
  forward_layout = forward[forward.index("entry_computation_layout"):].splitlines()[0]
  backward_layout = backward[backward.index("entry_computation_layout"):].splitlines()[0]
  outputs = forward_layout.split("->")[1]
  inputs = backward_layout.split("->")[0]
  assert outputs.count("S(5)") == entry.layout.n_kept
  assert inputs.count("S(5)") == entry.layout.n_kept
  assert "S(5)" not in backward_layout.split("->")[1]
  # The backward copies them to device itself (no host compute).
  assert "copy-start" in backward or "copy(" in backward
  assert set(_kept_kinds(layers[0])) == {"pinned_host"}


@pytest.mark.gpu
def test_gpu_offload_numerics_bitwise_equal():
  fns, params, x = _gpu_stack()
  samples = [(p, x) for p in params]
  plain = jg.make_graphed(fns, sample_args=samples)
  flags = [True, True, False, False]
  offloaded = jg.make_graphed(fns, sample_args=samples, offload_residuals=flags)
  assert trees_equal(_train(offloaded, params, x), _train(plain, params, x))


# ------------------------------------------------------------------------------- review fixes


def test_async_delay_wgrad_keeps_the_residuals_on_host_until_the_wgrad():
  # As in executable mode: between the dgrad and the deferred wgrad the residuals wait in
  # host memory (the dgrad's device copies go with it); the wgrad copies them back again.
  fns, params, x = _stack(fns=[mlp])
  ct = jnp.ones((T, D))
  layer = _make(fns[0], (params[0], x), "async", offload_residuals=True, delay_wgrad=True)
  plain = jg.make_graphed(fns[0], sample_args=(params[0], x), delay_wgrad=True)
  _, pullback = layer.vjp(params[0], x)
  backward = pullback._backward
  dgrads = pullback(ct)
  # those the wgrad reads; the dgrad was the last use of the others
  assert {a.sharding.memory_kind for a in backward.kept if a is not None} == {"pinned_host"}
  wgrads = pullback.wgrad()
  _, plain_pullback = plain.vjp(params[0], x)
  assert trees_equal((dgrads, wgrads), (plain_pullback(ct), plain_pullback.wgrad()))


def test_the_top_layer_copies_back_before_the_layer_below():
  fns, params, x = _stack(fns=[mlp] * 3)
  layers = _make(fns, [(p, x) for p in params], "async", offload_residuals=True,
                 num_warmup_iters=0)
  y, pullback = jg.sequential_vjp(layers, params, x)
  copied = []  # layers in the order their copies back start
  for i, (_, _, layer_pullback) in enumerate(pullback._steps):
    backward = layer_pullback._backward

    def prefetch(i=i, backward=backward, start=backward.prefetch):
      if backward.on_host:
        copied.append(i)
      start()

    backward.prefetch = prefetch
  pullback(jnp.ones_like(y))
  assert copied == [2, 1, 0]


def test_a_failed_prefetch_fails_the_sequential_pullback_part_way(monkeypatch):
  fns, params, x = _stack(fns=[mlp] * 3)
  layers = _make(fns, [(p, x) for p in params], "async", offload_residuals=True,
                 num_warmup_iters=0)
  y, pullback = jg.sequential_vjp(layers, params, x)
  calls = []

  def failing(arrays):
    calls.append(1)
    if len(calls) == 3:
      raise RuntimeError("out of memory (injected)")
    return [jax.device_put(a, a.sharding.with_memory_kind("device")) for a in arrays]

  monkeypatch.setattr(offload_lib, "start_to_device", failing)
  with pytest.raises(RuntimeError, match="injected"):
    pullback(jnp.ones_like(y))
  with pytest.raises(RuntimeError, match="failed part-way"):
    pullback(jnp.ones_like(y))


def test_a_failed_copy_to_host_spends_no_key(monkeypatch):
  fns, params, x = _stack(fns=[dropout_mlp])
  layer = _make(fns[0], (params[0], x), "async", offload_residuals=True, rng=True)

  def failing(arrays):
    raise RuntimeError("pinned host memory exhausted (injected)")

  monkeypatch.setattr(offload_lib, "start_to_host", failing)
  before = (layer.rng_counter, layer.stats.replays)
  with pytest.raises(RuntimeError, match="injected"):
    layer.vjp(params[0], x)
  assert (layer.rng_counter, layer.stats.replays) == before


def test_a_bad_cotangent_copies_nothing_back():
  fns, params, x = _stack(fns=[mlp])
  layer = _make(fns[0], (params[0], x), "async", offload_residuals=True)
  _, pullback = layer.vjp(params[0], x)
  with pytest.raises(TypeError, match="does not match its outputs"):
    pullback(jnp.ones((T + 1, D)))
  assert set(_held_kinds(pullback)) == {"pinned_host"}
  assert pullback(jnp.ones((T, D)))  # and it still runs


def test_offload_names_that_name_nothing_warn():
  fns, params, x = _stack(fns=[mlp])
  with pytest.warns(UserWarning, match="names no residual"):
    layer = _make(fns[0], (params[0], x), "async", offload_residuals=True,
                  offload_names=["nope"])
  assert layer.stats.offload_bytes == 0
