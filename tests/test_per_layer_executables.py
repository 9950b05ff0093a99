"""make_graphed(..., per_layer_executables=True): one compile, a loaded copy per layer."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compilation_cache

import jaxgraph as jg
from jaxgraph import _checks as checks_lib
from jaxgraph import _capture as capture_lib
from jaxgraph import rng as rng_lib
from models import counting, devices_for, dropout_mlp, init_mlp, reference_stack, trees_equal

D, H, T, DEPTH = 8, 32, 4, 4


@contextlib.contextmanager
def _persistent_cache(directory):
  """XLA's persistent compilation cache in `directory` (every compile stored), or off for
  None; the settings before are restored after. jax decides once whether a cache is used:
  `reset_cache` makes it decide again."""
  names = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
           "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  saved = {name: getattr(jax.config, name) for name in names}
  jax.config.update("jax_enable_compilation_cache", directory is not None)
  if directory is not None:
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    for name, value in saved.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()


@pytest.fixture(autouse=True)
def _compiled_here():
  """These tests compile for real: the suite's persistent compilation cache (conftest.py) is
  off for them, as a loaded copy of an executable read from it fails on CPU (below)."""
  with _persistent_cache(None):
    yield


def test_loaded_copy_of_an_executable_from_the_persistent_cache(tmp_path):
  """With a persistent compilation cache, a capture served from it (an identical function
  compiled before) still replays: on the CPU, whose serialized copy of a cached executable
  fails ('Function ... not found', jax 0.10.2), the executable itself is replayed."""
  x = jnp.ones((T, D))
  with _persistent_cache(tmp_path):
    copies = []
    for _ in range(2):  # two function objects: the second compile is read from the cache
      compiled = jax.jit(lambda v: jnp.tanh(v) * 2).lower(x).compile()
      copies.append((compiled, capture_lib.loaded_copy(compiled)))
    for compiled, copy in copies:
      assert jnp.array_equal(copy(x), jnp.tanh(x) * 2)
      if jax.default_backend() == "cpu":
        assert copy is compiled


def _stack(per_layer_executables, **kwargs):
  layer, traces = counting(dropout_mlp)
  params = [init_mlp(k, D, H) for k in jax.random.split(jax.random.key(0), DEPTH)]
  x = jnp.ones((T, D))
  layers = jg.make_graphed([layer] * DEPTH, sample_args=[(p, x) for p in params], rng=True,
                           num_warmup_iters=1, per_layer_executables=per_layer_executables,
                           **kwargs)
  return layers, params, x, traces


def _replayed(layers):
  """The executables each layer has replayed, one list per layer."""
  return [list(layer.executables.replayed.values()) for layer in layers]


@pytest.mark.parametrize("delay_wgrad", [False, True])
def test_each_layer_replays_its_own_copy_of_one_compile_bitwise(delay_wgrad):
  layers, params, x, traces = _stack(True, delay_wgrad=delay_wgrad)
  shared, _, _, _ = _stack(False, delay_wgrad=delay_wgrad)
  compiles = [layer.stats.compiles for layer in layers]
  for step in range(3):
    counters = [layer.rng_counter for layer in layers]
    y, pullback = jg.sequential_vjp(layers, params, x)
    y_shared, pullback_shared = jg.sequential_vjp(shared, params, x)
    ct = y / y.size
    grads, g_x = pullback(ct)
    grads_shared, g_x_shared = pullback_shared(ct)
    if delay_wgrad:
      grads, grads_shared = pullback.wgrad(), pullback_shared.wgrad()
    keys = [rng_lib.stream_key(i, c, layer.rng_base_key)
            for i, (layer, c) in enumerate(zip(layers, counters))]
    y_ref, grads_ref, g_x_ref = reference_stack([dropout_mlp] * DEPTH, params, x, ct, keys)
    assert trees_equal((y, grads, g_x), (y_ref, grads_ref, g_x_ref)), step
    assert trees_equal((y, grads, g_x), (y_shared, grads_shared, g_x_shared)), step
    params = [jax.tree.map(lambda p, g: p - 0.01 * g, p, g) for p, g in zip(params, grads)]
  # One trace and one set of compiles, for the first layer; no compile on replay.
  assert traces() == 1
  assert compiles[0] > 0 and compiles[1:] == [0] * (DEPTH - 1)
  assert [layer.stats.compiles for layer in layers] == compiles
  # Every layer runs executables of its own: the compiled ones are run by the layer that
  # captured them, loaded copies by the others.
  replayed = _replayed(layers)
  assert len({id(exe) for exes in replayed for exe in exes}) == sum(map(len, replayed))
  (entry,) = layers[0].executables.entries.values()
  originals = {id(exe) for exe, _ in entry.backward.values()} | {
      id(exe) for exe in entry.forward.values()}
  assert {id(exe) for exe in replayed[0]} <= originals
  assert not {id(exe) for exes in replayed[1:] for exe in exes} & originals
  # Shared: every layer runs the same executables.
  assert all(exes == _replayed(shared)[0] for exes in _replayed(shared))


def test_default_is_on_for_gpu_only():
  assert checks_lib.PER_LAYER_PLATFORMS == {"gpu"}


@pytest.mark.parametrize("per_layer", [False, True], ids=["shared", "per_layer"])
def test_default_follows_the_backend(platform_gate, per_layer):
  """Both sides of the gate, forced on the backend the tests run on (conftest.py)."""
  platform_gate(checks_lib, "PER_LAYER_PLATFORMS", per_layer)
  layers, params, x, _ = _stack(None)
  jg.sequential_vjp(layers, params, x)
  copies = len({id(exe) for exes in _replayed(layers) for exe in exes})
  assert copies == (sum(map(len, _replayed(layers))) if per_layer else len(_replayed(layers)[0]))


def test_reset_then_replay_captures_and_copies_again():
  layers, params, x, traces = _stack(True)
  for layer in layers:
    layer.reset()
  y, pullback = jg.sequential_vjp(layers, params, x)
  pullback(jnp.ones_like(y))
  assert traces() == 2
  replayed = _replayed(layers)
  assert len({id(exe) for exes in replayed for exe in exes}) == sum(map(len, replayed))


@pytest.mark.devices(2)
def test_an_executable_on_several_devices_is_copied_on_them_in_its_order():
  """An FSDP layer's executable spans the mesh: its copy runs on the same devices, in the
  order the mesh gave them (here not the devices' own), with the same shardings."""
  devices = devices_for(4)[:4]
  mesh = jax.sharding.Mesh(np.array([devices[2], devices[0], devices[3], devices[1]]), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  x = jax.device_put(jnp.arange(4 * D, dtype=jnp.float32).reshape(4, D), sharding)
  # a cumulative sum over the sharded axis: a device order mixed up would show in the values
  compiled = jax.jit(lambda v: v * 2 + jnp.cumsum(v, axis=0)).lower(x).compile()
  copy = capture_lib.loaded_copy(compiled)
  assert copy is not compiled
  assert copy.input_shardings == compiled.input_shardings
  assert copy.output_shardings == compiled.output_shardings
  out, expected = copy(x), compiled(x)
  assert out.sharding == expected.sharding
  assert trees_equal(out, expected)
  assert trees_equal(out, jnp.asarray(x) * 2 + jnp.cumsum(jnp.asarray(x), axis=0))


@pytest.mark.parametrize("error", [AttributeError("Can't pickle local object"),
                                   TypeError("cannot pickle"), ValueError("not serializable")])
def test_an_executable_that_cannot_be_serialized_is_replayed_itself(monkeypatch, error):
  """A compiled executable holding Python objects pickle cannot take (a custom_partitioning
  rule's closure: cuDNN attention over a mesh, on GPUs) is replayed as it is."""
  compiled = jax.jit(lambda v: v * 2).lower(jnp.ones((4, D))).compile()

  def refuse(_):
    raise error

  monkeypatch.setattr(capture_lib.serialize_executable, "serialize", refuse)
  assert capture_lib.loaded_copy(compiled) is compiled
