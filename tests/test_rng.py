"""PRNG keys: explicit keys, per-callable streams, remat vs residual masks, warmup isolation."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgraph as jg
from jaxgraph import rng as rng_lib
from models import devices_for, dropout_mlp, init_mlp, reference_stack, trees_equal

D, H, T = 8, 32, 4


def remat_dropout_mlp(p, x, *, key):
  body = lambda p, x, k: dropout_mlp(p, x, key=k)
  return jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)(p, x, key)


def _layers(fn=dropout_mlp, depth=2, **kwargs):
  params = [init_mlp(k, D, H) for k in jax.random.split(jax.random.key(0), depth)]
  x = jnp.ones((T, D))
  kwargs.setdefault("num_warmup_iters", 1)
  layers = jg.make_graphed([fn] * depth, sample_args=[(p, x) for p in params], rng=True,
                           **kwargs)
  return layers, params, x


def test_stream_gives_a_fresh_mask_every_replay():
  layers, params, x = _layers(depth=1)
  outs = [layers[0](params[0], x) for _ in range(3)]
  assert not np.array_equal(outs[0], outs[1])
  assert not np.array_equal(outs[1], outs[2])
  assert layers[0].rng_counter == 3


def test_stream_keys_are_folded_in_per_callable_and_call():
  # Call n of callable i equals an explicit call with fold_in(fold_in(base, i), n).
  layers, params, x = _layers()
  base = layers[0].rng_base_key
  for i, layer in enumerate(layers):
    for step in range(2):
      assert trees_equal(layer(params[i], x),
                         layer(params[i], x, key=rng_lib.stream_key(i, step, base)))
  assert [layer.rng_counter for layer in layers] == [2, 2]  # explicit keys draw nothing


@pytest.mark.parametrize("fn", [dropout_mlp, remat_dropout_mlp], ids=["residual", "remat"])
def test_grads_match_vjp_reference_with_the_same_keys(fn):
  layers, params, x = _layers(fn=fn)
  for step in range(3):
    keys = list(jax.random.split(jax.random.key(step), len(layers)))
    y, pullback = jg.sequential_vjp(layers, params, x, keys=keys)
    ct = y / y.size
    grads, g_x = pullback(ct)
    y_ref, grads_ref, g_x_ref = reference_stack([fn] * len(layers), params, x, ct, keys)
    assert trees_equal(y, y_ref) and trees_equal(grads, grads_ref) and trees_equal(g_x, g_x_ref)
    # The stream mode, checked against explicit keys derived the same way.
    counters = [layer.rng_counter for layer in layers]
    y, pullback = jg.sequential_vjp(layers, params, x)
    stream_keys = [rng_lib.stream_key(i, c, layer.rng_base_key)
                   for i, (layer, c) in enumerate(zip(layers, counters))]
    y_ref, grads_ref, _ = reference_stack([fn] * len(layers), params, x, ct, stream_keys)
    assert trees_equal(y, y_ref) and trees_equal(pullback(ct)[0], grads_ref)
    params = [jax.tree.map(lambda p, g: p - 0.01 * g, p, g) for p, g in zip(params, grads)]


def test_residual_mode_keeps_the_mask_remat_mode_keeps_the_key():
  residual, _, _ = _layers(depth=1)
  remat, _, _ = _layers(fn=remat_dropout_mlp, depth=1)
  (res_entry,) = residual[0].executables.entries.values()
  (remat_entry,) = remat[0].executables.entries.values()
  key_input = res_entry.layout.n_args
  kept_dtypes = lambda e: [o.dtype for o in e.forward["stream", True].out_info[
      e.layout.n_out:e.layout.n_out + e.layout.n_kept]]
  assert jnp.bool_ in kept_dtypes(res_entry)  # the dropout mask itself
  assert ("in", key_input) not in res_entry.layout.sources
  assert ("in", remat_entry.layout.n_args) in remat_entry.layout.sources  # only the key
  assert jnp.bool_ not in kept_dtypes(remat_entry)


@pytest.mark.parametrize("fn", [dropout_mlp, remat_dropout_mlp], ids=["residual", "remat"])
def test_out_of_order_backward(fn):
  def run(order):
    layers, params, x = _layers(fn=fn, depth=1)
    (layer,), (p,) = layers, params
    inputs = [x, 2 * x]
    results, pullbacks = {}, {}
    for op, mb in order:
      if op == "f":
        y, pullbacks[mb] = layer.vjp(p, inputs[mb])
        results[("y", mb)] = y
      else:
        results[("g", mb)] = pullbacks[mb](jnp.ones((T, D)))
    return results

  natural = run([("f", 0), ("b", 0), ("f", 1), ("b", 1)])
  swapped = run([("f", 0), ("f", 1), ("b", 1), ("b", 0)])
  assert natural.keys() == swapped.keys()
  for k in natural:
    assert trees_equal(natural[k], swapped[k]), k


def _keyed_layer_over_two_devices() -> tuple[Any, Any, jax.Array]:
  """A dropout layer with a key stream, its params replicated and its input split over a
  mesh of 2 devices: (layer, params, x)."""
  mesh = jax.sharding.Mesh(np.array(devices_for(2)[:2]), ("d",))
  params = jax.device_put(init_mlp(jax.random.key(0), D, H),
                          jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  x = jax.device_put(jnp.ones((T, D)),
                     jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
  (layer,) = jg.make_graphed([dropout_mlp], sample_args=[(params, x)], rng=True,
                             num_warmup_iters=1)
  return layer, params, x


@pytest.mark.devices(2)
def test_stream_inputs_are_placed_as_the_forward_takes_them():
  """Over a mesh the stream's base key and index are placed where the stream forward takes
  them, once (placed otherwise, every call copies them to every device first); the draws
  stay the stream's, and the user's base key is the one given."""
  layer, params, x = _keyed_layer_over_two_devices()
  base = layer.rng_base_key
  for step in range(3):
    y, _ = layer.vjp(params, x)
    assert trees_equal(y, layer(params, x, key=rng_lib.stream_key(0, step, base)))
  (entry,) = layer.executables.entries.values()
  taken = [tuple(jax.tree.leaves(entry.forward["stream", True].input_shardings)[:3])]
  given = layer.stream_inputs(None, taken)
  assert [leaf.sharding for leaf in given] == list(taken[0])
  # base and index placed once: the same arrays on every call
  assert all(a is b for a, b in zip(given[:2], layer.stream_inputs(None, taken)[:2]))
  assert layer.rng_base_key is base and layer.rng_counter == 3


@pytest.mark.devices(2)
def test_a_stream_replayed_by_the_same_forward_checks_no_placement(monkeypatch):
  """Once its stream's inputs are placed for a forward, a replay of that forward given the
  counter it returned compares no shardings (it costs the driving thread every call)."""
  layer, params, x = _keyed_layer_over_two_devices()
  base = layer.rng_base_key
  layer.vjp(params, x)
  layer.vjp(params, x)  # the first replay given a counter a replay returned
  compared = []
  same = rng_lib._same
  monkeypatch.setattr(rng_lib, "_same", lambda *a: compared.append(a) or same(*a))
  for step in range(2, 5):
    y, _ = layer.vjp(params, x)
    assert trees_equal(y, layer(params, x, key=rng_lib.stream_key(0, step, base)))
  assert compared == [] and layer.rng_counter == 5


@pytest.mark.devices(2)
def test_a_stream_replayed_on_the_default_device_moves_on_to_another():
  """A replay on the default device returns its counter uncommitted, so nothing is placed
  behind it: the layer then replays on another device, drawing the stream's next keys."""
  layers, params, x = _layers(depth=1)
  (layer,), other = layers, devices_for(2)[1]
  base = layer.rng_base_key
  first = layer(params[0], x)
  assert trees_equal(first, layer(params[0], x, key=rng_lib.stream_key(0, 0, base)))
  params_there, x_there = jax.device_put((params[0], x), other)
  for step in (1, 2):
    y = layer(params_there, x_there)
    assert y.devices() == {other}
    assert trees_equal(y, layer(params_there, x_there, key=rng_lib.stream_key(0, step, base)))
  assert layer.rng_counter == 3


@pytest.mark.devices(4)
@pytest.mark.parametrize("max_captures", [3, 1])
def test_a_stream_replays_on_one_mesh_then_another_and_back(max_captures):
  """A layer replayed over one mesh, then another (other devices), then one device and back:
  every draw is the stream's next key (its inputs follow the forward each call takes). With
  `max_captures=1` the other placements run through the fallback's jit, which derives the
  key beside its arguments."""
  devices = devices_for(4)[:4]
  meshes = [jax.sharding.Mesh(np.array(devices[:2]), ("d",)),
            jax.sharding.Mesh(np.array(devices[2:]), ("d",))]
  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  placed = [jax.device_put((params, x), (jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec()),
                                         jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec("d"))))
            for m in meshes] + [jax.device_put((params, x), devices[3])]
  (layer,) = jg.make_graphed([dropout_mlp], sample_args=[placed[0]], rng=True,
                             num_warmup_iters=1, max_captures=max_captures)
  base = layer.rng_base_key
  order = [0, 1, 0, 2, 1, 2]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # max_captures=1: the fallback's warning
    for step, where in enumerate(order):
      y, _ = layer.vjp(*placed[where])
      assert trees_equal(y, dropout_mlp(*placed[where], key=rng_lib.stream_key(0, step, base)))
  assert layer.rng_counter == 6
  assert layer.stats.fallbacks == (0 if max_captures == 3 else sum(w != 0 for w in order))


def test_warmup_does_not_advance_the_stream():
  cold, params, x = _layers(num_warmup_iters=0)
  warm, _, _ = _layers(num_warmup_iters=3)
  assert [l.rng_counter for l in warm] == [0, 0]
  y_cold, pb_cold = jg.sequential_vjp(cold, params, x)
  y_warm, pb_warm = jg.sequential_vjp(warm, params, x)
  assert trees_equal(y_cold, y_warm)
  assert trees_equal(pb_cold(y_cold), pb_warm(y_warm))


def test_seed_and_counter_resume_the_stream():
  layers, params, x = _layers(depth=1)
  (layer,), (p,) = layers, params
  layer(p, x)
  saved = (layer.rng_base_key, layer.rng_counter)
  expected = [layer(p, x) for _ in range(2)]
  layer.seed(saved[0], counter=saved[1])
  assert all(trees_equal(layer(p, x), e) for e in expected)
  seeded = jg.make_graphed(dropout_mlp, sample_args=(p, x), rng=jax.random.key(7),
                           num_warmup_iters=0)
  assert trees_equal(seeded(p, x, key=rng_lib.stream_key(0, 0, jax.random.key(7))),
                     jg.make_graphed(dropout_mlp, sample_args=(p, x), rng=jax.random.key(7),
                                     num_warmup_iters=0)(p, x))


def test_raw_uint32_key_is_rejected_with_the_fix():
  layers, params, x = _layers(depth=1)
  with pytest.raises(TypeError, match="wrap_key_data"):
    layers[0](params[0], x, key=jax.random.PRNGKey(0))
  with pytest.raises(TypeError, match="wrap_key_data"):
    layers[0].seed(jax.random.PRNGKey(0))


def test_warns_when_a_key_is_frozen_into_the_executable():
  frozen = jax.random.key(3)
  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  with pytest.warns(UserWarning, match="closed-over key constant"):
    jg.make_graphed(lambda p, x: dropout_mlp(p, x, key=frozen), sample_args=(params, x),
                    num_warmup_iters=0)
  with pytest.warns(UserWarning, match="random_seed of a constant"):
    jg.make_graphed(lambda p, x: dropout_mlp(p, x, key=jax.random.key(0)),
                    sample_args=(params, x), num_warmup_iters=0)


def test_traced_call_needs_an_explicit_key():
  layers, params, x = _layers(depth=1)
  with pytest.raises(TypeError, match="pass key= explicitly"):
    jax.jit(lambda p, x: layers[0](p, x))(params[0], x)
  k = jax.random.key(5)
  inside = jax.jit(lambda p, x, k: layers[0](p, x, key=k))(params[0], x, k)
  assert trees_equal(inside, jax.jit(lambda p, x, k: dropout_mlp(p, x, key=k))(params[0], x, k))
