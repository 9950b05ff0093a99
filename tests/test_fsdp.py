"""jg.fsdp on 8 devices: placement rule, gather, training, HLO, shardings, memory.

The 8 devices are the default backend's when it has 8, else the CPU backend's 8 virtual ones
(`@pytest.mark.devices(8)`, tests/conftest.py): next to one GPU these tests run on CPU.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fsdp_worker
import jaxgraph as jg
from jaxgraph import fsdp
from models import assert_equal_or_close, devices_for, trees_equal


@pytest.fixture(scope="module")
def mesh():
  """A mesh over 8 devices; the fixtures built on it run with its first device as JAX's
  default device, as the `devices`-marked tests themselves do (tests/conftest.py)."""
  devices = devices_for(8)[:8]
  with jax.default_device(devices[0]):
    yield fsdp.make_mesh(devices=devices)


@pytest.fixture(scope="module")
def one_layer(mesh):
  """One sharded layer's params and batch-sharded input."""
  host_params, x, _ = fsdp_worker.host_data(1)
  return fsdp.shard(host_params[0], mesh), jax.device_put(x, fsdp.batch_sharding(mesh))


@pytest.fixture(scope="module")
def graphed_layer(mesh, one_layer):
  return jg.make_graphed(fsdp_worker.fsdp_block(mesh), sample_args=one_layer,
                         num_warmup_iters=0)


def _count(hlo: str, op: str) -> int:
  return len(re.findall(rf"\b{op}(-start)?\(", hlo))


@pytest.mark.devices(8)
def test_make_mesh_has_one_auto_axis(mesh):
  assert mesh.axis_names == ("fsdp",)
  assert mesh.axis_types == (AxisType.Auto,)
  assert mesh.devices.size == 8
  assert list(fsdp.make_mesh().devices.flat) == jax.devices()   # the default: every device
  assert fsdp.make_mesh("data", list(mesh.devices.flat)[:4]).shape == {"data": 4}
  with pytest.raises(ValueError, match="no devices"):
    fsdp.make_mesh(devices=[])


def test_partition_spec_shards_the_largest_divisible_dim():
  assert fsdp.partition_spec((64, 256), 8) == P(None, "fsdp")
  assert fsdp.partition_spec((256, 64), 8) == P("fsdp")        # no trailing None
  assert fsdp.partition_spec((100, 64), 8) == P(None, "fsdp")    # 100 is not divisible
  assert fsdp.partition_spec((64, 64), 8, "x") == P("x")       # ties: the first dim
  assert fsdp.partition_spec((3, 4, 1024), 8) == P(None, None, "fsdp")


def test_partition_spec_replicates_small_and_indivisible_leaves():
  assert fsdp.partition_spec((256,), 8) == P()             # a bias: below min_size
  assert fsdp.partition_spec((256,), 8, min_size=1) == P("fsdp")
  assert fsdp.partition_spec((), 8) == P()
  assert fsdp.partition_spec((100, 99), 8) == P()          # no dim divisible by 8
  assert fsdp.partition_spec((4, 4096), 8) == P(None, "fsdp")


@pytest.mark.devices(8)
def test_shard_places_every_leaf(mesh, one_layer):
  params, _ = one_layer
  specs = fsdp.shardings(params, mesh)
  assert {k: v.spec for k, v in specs.items()} == {
      "w1": P(None, "fsdp"), "w2": P("fsdp"), "b1": P()}
  for k, v in params.items():
    assert v.sharding == specs[k], k
  assert params["w1"].addressable_shards[0].data.shape == (fsdp_worker.D, fsdp_worker.H // 8)
  with pytest.raises(ValueError, match="not 'model'"):
    fsdp.shard(params, mesh, "model")


@pytest.mark.devices(8)
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_place_puts_typed_keys_as_their_data(mesh, impl):
  """A typed PRNG key array is placed as its key data and wrapped again with its impl
  (across processes the data goes through NumPy, which holds no typed keys:
  tests/test_multiprocess.py places one so)."""
  key = jax.random.key(3, impl=impl)
  for keys, spec in [(key, P()), (jax.random.split(key, 8), P("fsdp"))]:
    sharding = NamedSharding(mesh, spec)
    placed = fsdp.place(keys, sharding)
    assert placed.dtype == keys.dtype and placed.sharding == sharding
    np.testing.assert_array_equal(jax.random.key_data(placed), jax.random.key_data(keys))


@pytest.mark.devices(8)
def test_gather_uses_the_mesh_set_by_set_mesh(mesh, one_layer):
  params, _ = one_layer
  with pytest.raises(ValueError, match="jax.set_mesh"):
    jax.jit(fsdp.gather).lower(params)
  with jax.set_mesh(mesh):
    compiled = jax.jit(fsdp.gather).lower(params).compile()
    gathered = compiled(params)
  assert _count(compiled.as_text(), "all-gather") == 2       # w1, w2 (b1 is replicated)
  for k, v in gathered.items():
    assert v.sharding.is_fully_replicated, k
    assert np.array_equal(v, params[k]), k


@pytest.mark.devices(8)
def test_graphed_fsdp_training_matches_unsharded_and_whole_step_jit(mesh):
  losses, params, graphed = fsdp_worker.train_graphed(mesh)
  plain_losses, plain_params, _ = fsdp_worker.train_graphed(None)
  jit_losses, jit_params = fsdp_worker.train_jit(mesh)
  assert losses[-1] < losses[0]
  # One device vs 8: the unsharded batch sum is one reduction, the sharded one adds 8
  # partial sums (all-reduce; reduce-scatter on GPU) in another order: float32 rounding.
  np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
  for p, q in zip(params, plain_params):
    for k in p:
      np.testing.assert_allclose(p[k], q[k], rtol=1e-5, atol=1e-6, err_msg=k)
  # The whole-step jit runs the same sharded ops and collectives per layer: bitwise equal
  # on CPU. On GPUs one whole-step executable may fuse across layers and round differently.
  assert_equal_or_close((losses, params), (jit_losses, jit_params), gpu_rtol=1e-4,
                        gpu_atol=1e-6, why="whole-step jax.jit vs per-layer executables, "
                        "3 Adam steps: XLA fuses across layer boundaries in the whole step")
  assert [g.stats.captures for g in graphed] == [1, 0, 0]     # no recapture across steps


@pytest.mark.devices(8)
def test_identical_fsdp_layers_compile_once(mesh):
  host_params, x, _ = fsdp_worker.host_data(4)
  params = fsdp.shard(host_params, mesh)
  x = jax.device_put(x, fsdp.batch_sharding(mesh))
  layers = jg.make_graphed([fsdp_worker.fsdp_block(mesh)] * 4,
                           sample_args=[(p, x) for p in params], num_warmup_iters=0)
  stats = [g.stats for g in layers]
  assert [s.captures for s in stats] == [1, 0, 0, 0]
  assert [s.cache_hits for s in stats] == [0, 1, 1, 1]
  assert stats[0].compiles == 2                                # forward + backward
  assert sum(s.compiles for s in stats) == 2


@pytest.mark.devices(8)
def test_layer_hlo_gathers_weights_and_reduces_grads(graphed_layer):
  (entry,) = graphed_layer.executables.entries.values()
  forward = entry.forward["explicit", True].as_text()
  backward = entry.backward["full"][0].as_text()
  assert _count(forward, "all-gather") == 2                   # w1 and w2
  assert _count(backward, "all-gather") == 2                  # re-gathered, not saved
  # GPU: reduce-scatter. CPU has no ReduceScatterCreator pass: all-reduce + dynamic-slice.
  assert (_count(backward, "reduce-scatter") >= 1
          or (_count(backward, "all-reduce") >= 1 and _count(backward, "dynamic-slice") >= 1))


@pytest.mark.devices(8)
def test_grads_come_back_with_the_weights_sharding(graphed_layer, one_layer):
  params, x = one_layer
  y, pullback = graphed_layer.vjp(params, x)
  grads, g_x = pullback(jnp.ones_like(y))
  for k, g in grads.items():
    assert g.sharding == params[k].sharding, k
  assert g_x.sharding == x.sharding
  ref_grads, ref_gx = jax.vjp(fsdp_worker.block, jax.device_get(params), jax.device_get(x)
                              )[1](np.ones(y.shape, np.float32))
  # Batch sum over 8 shards + all-reduce vs one local sum: float32 rounding only.
  for k, g in grads.items():
    np.testing.assert_allclose(g, ref_grads[k], rtol=1e-5, atol=1e-6, err_msg=k)
  np.testing.assert_allclose(g_x, ref_gx, rtol=1e-5, atol=1e-6)


@pytest.mark.devices(8)
def test_delayed_wgrad_keeps_the_weights_sharding(mesh, one_layer, graphed_layer):
  params, x = one_layer
  split = jg.make_graphed(fsdp_worker.fsdp_block(mesh), sample_args=one_layer,
                          num_warmup_iters=0, delay_wgrad=True)
  (entry,) = split.executables.entries.values()
  # The dgrad gathers the weights for the input gradients and keeps the hidden cotangent for
  # the wgrad, which then reads no weight: it gathers nothing.
  assert _count(entry.backward["dgrad"][0].as_text(), "all-gather") >= 1
  assert _count(entry.backward["wgrad"][0].as_text(), "all-gather") == 0
  y, pullback = split.vjp(params, x)
  ct = jnp.ones_like(y)
  (none, g_x), (grads, _) = pullback(ct), pullback.wgrad()
  assert none is None and g_x.sharding == x.sharding
  y_full, pullback_full = graphed_layer.vjp(params, x)
  full_grads, full_gx = pullback_full(ct)
  assert np.array_equal(y, y_full) and np.array_equal(g_x, full_gx)
  for k, g in grads.items():
    assert g.sharding == params[k].sharding, k
    assert np.array_equal(g, full_grads[k]), k


@pytest.mark.devices(8)
def test_residuals_hold_no_gathered_weights(mesh, one_layer, graphed_layer):
  params, x = one_layer
  batch = fsdp.batch_sharding(mesh)

  def no_policy(p, x):
    return jax.lax.with_sharding_constraint(fsdp_worker.block(fsdp.gather(p, mesh), x), batch)

  holding = jg.make_graphed(no_policy, sample_args=one_layer, num_warmup_iters=0)
  weight_shapes = {params["w1"].shape, params["w2"].shape}
  gathered_bytes = sum(params[k].nbytes for k in ("w1", "w2"))   # one device, unsharded
  (lean,), (fat,) = graphed_layer.executables.entries.values(), holding.executables.entries.values()
  lean_fwd, fat_fwd = lean.forward["explicit", True], fat.forward["explicit", True]
  lean_bwd, fat_bwd = lean.backward["full"][0], fat.backward["full"][0]
  gathered = lambda e: [o for o in e.forward["explicit", True].out_info[e.layout.n_out:]
                        if o.shape in weight_shapes and o.sharding.is_fully_replicated]
  # Without the policy the forward returns both gathered weights for the backward.
  assert len(gathered(fat)) == 2
  assert fat_fwd.memory_analysis().output_size_in_bytes >= gathered_bytes
  assert fat_bwd.memory_analysis().argument_size_in_bytes >= gathered_bytes
  # With it the residuals are the sharded inputs (not returned again) and one activation.
  assert not gathered(lean)
  assert lean_fwd.memory_analysis().output_size_in_bytes < params["w1"].nbytes // 2
  assert lean_bwd.memory_analysis().argument_size_in_bytes < params["w1"].nbytes // 2
  # The gathered weights are transient: in the temp buffers of this layer only.
  assert lean_fwd.memory_analysis().temp_size_in_bytes < 2 * gathered_bytes
  y, pullback = graphed_layer.vjp(params, x)
  y_fat, pullback_fat = holding.vjp(params, x)
  assert np.array_equal(y, y_fat)
  ct = jnp.ones_like(y)
  for a, b in zip(jax.tree.leaves(pullback(ct)), jax.tree.leaves(pullback_fat(ct))):
    assert np.array_equal(a, b)


@pytest.mark.devices(8)
@pytest.mark.parametrize("on_new_signature", ["error", "capture"])
def test_replay_with_another_sharding(mesh, one_layer, on_new_signature, caplog):
  """Params that lost their FSDP sharding: the error, or the recapture's log, shows both
  shardings and says what the new one costs."""
  caplog.set_level(logging.WARNING, logger="jaxgraph")
  params, x = one_layer
  layer = jg.make_graphed(fsdp_worker.fsdp_block(mesh), sample_args=one_layer,
                          num_warmup_iters=0, on_new_signature=on_new_signature)
  replicated = jax.device_put(params, NamedSharding(mesh, P()))
  changed = (r"args\[0\]\['w1'\]: expected float32\[\d+,\d+\] with sharding NamedSharding\("
             r".*spec=(P|PartitionSpec)\([^)]*'fsdp'[^)]*\).*, got float32\[\d+,\d+\] with sharding "
             r"NamedSharding\(.*spec=(P|PartitionSpec)\(\).*\n[\s\S]*replicated gradients")
  if on_new_signature == "error":
    with pytest.raises(TypeError, match=changed):
      layer(replicated, x)
    with pytest.raises(TypeError, match=r"got float32\[\d+,\d+\] with no sharding \(on the "
                                        r"default device\)"):
      layer(jax.device_get(params), x)   # fetched to the host
    assert [r for r in caplog.records if r.name == "jaxgraph"] == []
    return
  y = layer(replicated, x)
  assert layer.stats.captures == 2
  message, = [r.getMessage() for r in caplog.records if r.name == "jaxgraph"]
  assert re.search(changed, message), message
  assert np.array_equal(y, layer(params, x))
  y, pullback = layer.vjp(replicated, x)
  grads, _ = pullback(jnp.ones_like(y))
  assert grads["w1"].sharding.is_fully_replicated


@pytest.mark.cpu_only
@pytest.mark.slow
def test_benchmark_runs_on_cpu(tmp_path):
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(root),
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  run = subprocess.run([sys.executable, str(root / "benchmarks" / "fsdp_bench.py"), "--tiny",
                        "--iters", "1", "--reps", "1", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr
  result = json.loads((tmp_path / "fsdp_bench.json").read_text())
  memory = {r["variant"]: r for r in result["memory"]}
  assert set(memory) == {"graphed", "jit"} and result["devices"] == 2
  graphed = memory["graphed"]
  # Residuals per layer are far below one gathered layer (no gathered weight among them).
  assert graphed["analysis"]["forward"]["output"] < graphed["gathered_layer_bytes"] // 2
  assert set(result["time"]["step_s"]) == {"graphed", "jit"}


def test_a_one_device_mesh_axis_is_no_new_signature():
  # On a one-device mesh P("fsdp") and P() place an array alike; XLA reports the layer's
  # output as P(), which passed to the next layer must replay the same executable.
  mesh = fsdp.make_mesh(devices=devices_for(1)[:1])
  x = jax.device_put(np.ones((8, 4), np.float32), fsdp.batch_sharding(mesh))
  layer = jg.make_graphed(lambda x: jnp.tanh(x) @ jnp.ones((4, 4)), sample_args=(x,),
                          num_warmup_iters=0, on_new_signature="error")
  y = layer(x)
  assert y.sharding.spec != x.sharding.spec and y.sharding.is_equivalent_to(x.sharding, 2)
  y, pullback = layer.vjp(y)
  pullback(jnp.ones_like(y))
  assert layer.stats.captures == 1


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("delay_wgrad", [False, True])
def test_grads_are_placed_like_their_arguments_on_a_one_device_mesh(offload, delay_wgrad):
  # P(None, "fsdp") on a one-device mesh signs as P() (one capture for both spellings), and
  # XLA returns P(); the gradient still comes back spelled like its argument.
  mesh = fsdp.make_mesh(devices=devices_for(1)[:1])
  host_params, x, _ = fsdp_worker.host_data(2)
  params = [fsdp.shard(p, mesh, min_size=1) for p in host_params]
  x = jax.device_put(x, fsdp.batch_sharding(mesh))
  assert {params[0][k].sharding.spec for k in params[0]} != {P()}
  layer_fn = fsdp_worker.fsdp_block(mesh)
  layers = jg.make_graphed([layer_fn] * 2, num_warmup_iters=1,
                           sample_args=[(p, x) for p in params], offload_residuals=offload,
                           delay_wgrad=delay_wgrad)
  reference = jax.jit(lambda p, x, ct: jax.vjp(layer_fn, p, x)[1](ct))
  for layer, p in zip(layers, params):
    y, pullback = layer.vjp(p, x)
    ct = jnp.cos(y)
    grads, g_x = pullback(ct)
    if delay_wgrad:
      grads = pullback.wgrad()[0]
    for k in p:
      assert grads[k].sharding == p[k].sharding, k
    assert g_x.sharding == x.sharding
    # Only the spelling differs from the executable's output: the values are jax.vjp's.
    assert trees_equal((grads, g_x), reference(p, x, ct))
  assert layers[0].stats.captures == 1 and layers[1].stats.captures == 0


@pytest.mark.devices(8)
def test_grads_keep_a_spec_spelled_with_trailing_nones(mesh):
  host_params, x, _ = fsdp_worker.host_data(1)
  short = fsdp.shard(host_params[0], mesh)
  params = {k: jax.device_put(v, NamedSharding(mesh, P(*short[k].sharding.spec, *[None] * (
      v.ndim - len(short[k].sharding.spec))))) for k, v in host_params[0].items()}
  assert any(params[k].sharding != short[k].sharding for k in params)
  x = jax.device_put(x, fsdp.batch_sharding(mesh))
  layer = jg.make_graphed(fsdp_worker.fsdp_block(mesh), sample_args=(params, x),
                          num_warmup_iters=0)
  y, pullback = layer.vjp(params, x)
  grads, _ = pullback(jnp.ones_like(y))
  for k, g in grads.items():
    assert g.sharding == params[k].sharding, k
