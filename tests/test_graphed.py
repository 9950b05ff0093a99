"""Core capture and replay: numerics, compile counts, signatures, pullbacks, tracers."""

from __future__ import annotations

import glob
import gzip
import json
import logging
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgraph as jg
from jaxgraph import rng as rng_lib
from models import (assert_equal_or_close, attention, counting, devices_for, dropout_mlp,
                    init_attention, init_mlp, mlp, reference_stack, trees_equal)

D, H, T = 16, 32, 8


def _stack(dtype, depth=4):
  keys = jax.random.split(jax.random.key(0), depth)
  fns = [mlp if i % 2 == 0 else attention for i in range(depth)]
  params = [init_mlp(k, D, H, dtype) if f is mlp else init_attention(k, D, dtype)
            for f, k in zip(fns, keys)]
  x = jax.random.normal(jax.random.key(1), (T, D)).astype(dtype)
  return fns, params, x


def _sgd(params, grads, lr=0.01):
  return jax.tree.map(lambda p, g: (p - lr * g).astype(p.dtype), params, grads)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_training_matches_jit_vjp_bitwise(dtype):
  fns, params, x = _stack(dtype)
  layers = jg.make_graphed(fns, sample_args=[(p, x) for p in params])
  ref_params = params
  for _ in range(3):
    y, pullback = jg.sequential_vjp(layers, params, x)
    ct = (y / y.size).astype(dtype)
    grads, g_x = pullback(ct)
    y_ref, grads_ref, g_x_ref = reference_stack(fns, ref_params, x, ct)
    assert trees_equal(y, y_ref)
    assert trees_equal(g_x, g_x_ref)
    assert trees_equal(grads, grads_ref)
    params = [_sgd(p, g) for p, g in zip(params, grads)]
    ref_params = [_sgd(p, g) for p, g in zip(ref_params, grads_ref)]
  assert trees_equal(params, ref_params)


def test_identical_layers_compile_once():
  layer, traces = counting(mlp)

  params = [init_mlp(k, D, H) for k in jax.random.split(jax.random.key(0), 12)]
  x = jnp.ones((T, D))
  layers = jg.make_graphed([layer] * 12, sample_args=[(p, x) for p in params],
                           num_warmup_iters=2)
  assert traces() == 1
  assert sum(l.stats.captures for l in layers) == 1
  assert sum(l.stats.cache_hits for l in layers) == 11
  compiles = sum(l.stats.compiles for l in layers)
  assert compiles == 2  # one forward, one backward
  for _ in range(3):
    y, pullback = jg.sequential_vjp(layers, params, x)
    pullback(jnp.ones_like(y))
  assert traces() == 1, "replay must not retrace"
  assert sum(l.stats.compiles for l in layers) == compiles, "replay must not recompile"
  assert [l.stats.replays for l in layers] == [3] * 12
  assert [l.stats.backward_replays for l in layers] == [3] * 12


def test_call_replays_forward_only():
  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  g = jg.make_graphed(mlp, sample_args=(params, x), num_warmup_iters=0)
  assert isinstance(g, jg.GraphedCallable)
  assert trees_equal(g(params, x), jax.jit(mlp)(params, x))
  assert g.stats.replays == 1


def test_residuals_do_not_reemit_inputs():
  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  g = jg.make_graphed(mlp, sample_args=(params, x), num_warmup_iters=0)
  (entry,) = g.executables.entries.values()
  layout = entry.layout
  kinds = {kind for kind, _ in layout.sources}
  assert "in" in kinds  # the weights and x are read from the inputs...
  n_outputs = len(entry.forward["explicit", True].out_info)
  assert n_outputs == layout.n_out + layout.n_kept  # ...and never returned again
  input_shapes = {s.shape for s in entry.signature.leaves}
  kept_shapes = [o.shape for o in entry.forward["explicit", True].out_info[layout.n_out:]]
  assert all(shape not in input_shapes or shape == (T, D) for shape in kept_shapes)


def test_grads_for_every_positional_arg_and_float0_for_ints():
  def f(p, x, n):
    return p["w"] * x * n.astype(jnp.float32)

  p, x, n = {"w": jnp.float32(2.0)}, jnp.arange(3.0), jnp.arange(3)
  g = jg.make_graphed(f, sample_args=(p, x, n), num_warmup_iters=1)
  y, pullback = g.vjp(p, x, n)
  grads = pullback(jnp.ones(3))
  y_ref, vjp_ref = jax.vjp(f, p, x, n)
  grads_ref = vjp_ref(jnp.ones(3))
  assert trees_equal(y, y_ref)
  assert trees_equal(grads[:2], grads_ref[:2])
  assert grads[2].dtype == jax.dtypes.float0 and grads[2].shape == (3,)


def test_pullback_is_one_shot():
  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  g = jg.make_graphed(mlp, sample_args=(params, x), num_warmup_iters=0)
  y, pullback = g.vjp(params, x)
  pullback(jnp.ones_like(y))
  with pytest.raises(RuntimeError, match=r"mlp\[0\].*already called"):
    pullback(jnp.ones_like(y))


@pytest.mark.parametrize("bad_ct, match", [
    (lambda y: jnp.ones((T + 1, D)), r"cotangents: expected float32\[8, 16\], got float32\[9, 16\]"),
    (lambda y: jnp.ones_like(y, jnp.bfloat16), r"expected float32\[8, 16\], got bfloat16"),
    (lambda y: (y, y), r"structure"),
])
def test_foreign_cotangent_is_rejected(bad_ct, match):
  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  g = jg.make_graphed(mlp, sample_args=(params, x), num_warmup_iters=0)
  y, pullback = g.vjp(params, x)
  with pytest.raises(TypeError, match=match):
    pullback(bad_ct(y))
  # A rejected cotangent does not consume the pullback.
  grads = pullback(jnp.ones_like(y))
  assert grads[1].shape == x.shape


def _error_callable():
  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  g = jg.make_graphed(mlp, sample_args=(params, x), num_warmup_iters=0,
                      on_new_signature="error")
  return g, params, x


@pytest.mark.parametrize("change, match", [
    (lambda p, x: (p, jnp.ones((T, D + 1))),
     r"mlp\[0\].*\n.*args\[1\]: expected float32\[8,16\], got float32\[8,17\]"),
    (lambda p, x: (p, x.astype(jnp.bfloat16)),
     r"args\[1\]: expected float32\[8,16\], got bfloat16\[8,16\]"),
    (lambda p, x: ({**p, "extra": x}, x), r"different pytree structure"),
    (lambda p, x: (dict(p, b1=1.0), x), r"args\[0\]\['b1'\]: expected float32\[32\], got "
                                        r"float32\[\] \(weakly typed"),
])
def test_new_signature_error_names_path(change, match):
  g, params, x = _error_callable()
  with pytest.raises(TypeError, match=match):
    g.vjp(*change(params, x))
  assert g.stats.captures == 1


@pytest.mark.devices(2)
def test_new_sharding_is_a_new_signature():
  devices = devices_for(2)
  g, params, x = _error_callable()
  moved = jax.device_put(x, devices[1])
  with pytest.raises(TypeError, match=r"args\[1\]: .*with sharding SingleDeviceSharding"):
    g(params, moved)


def test_new_signature_captured_then_fallback_with_one_warning():
  params = init_mlp(jax.random.key(0), D, H)
  g = jg.make_graphed(mlp, sample_args=(params, jnp.ones((T, D))), num_warmup_iters=0,
                      max_captures=2)
  g(params, jnp.ones((T + 1, D)))
  assert g.stats.captures == 2
  with pytest.warns(UserWarning, match="max_captures=2"):
    y = g(params, jnp.ones((T + 2, D)))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    y, pullback = g.vjp(params, jnp.ones((T + 3, D)))  # no second warning
    grads = pullback(jnp.ones_like(y))
  y_ref, vjp_ref = jax.vjp(jax.jit(mlp), params, jnp.ones((T + 3, D)))
  assert trees_equal(y, y_ref) and trees_equal(grads, vjp_ref(jnp.ones_like(y_ref)))
  assert g.stats.fallbacks == 2 and g.stats.captures == 2


def _logged(caplog: pytest.LogCaptureFixture) -> list[str]:
  """The messages of the records on the `jaxgraph` logger."""
  return [r.getMessage() for r in caplog.records if r.name == "jaxgraph"]


def test_a_capture_after_the_first_logs_what_changed(caplog):
  """A new batch size: one WARNING on the `jaxgraph` logger naming the callable and the leaf
  that changed against the closest signature captured before. The first capture, replays
  and an identical callable's cache hit log nothing."""
  caplog.set_level(logging.WARNING, logger="jaxgraph")
  params = init_mlp(jax.random.key(0), D, H)
  layers = jg.make_graphed([mlp] * 2, sample_args=[(params, jnp.ones((T, D)))] * 2)
  layers[0](params, jnp.ones((T, D)))
  assert _logged(caplog) == []
  half = jnp.ones((T // 2, D))
  layers[0](params, half)
  layers[0](params, half)     # replayed
  layers[1](params, half)     # served by layer 0's capture: nothing compiles
  assert [layer.stats.captures for layer in layers] == [2, 0]
  message, = _logged(caplog)
  assert [r.levelno for r in caplog.records if r.name == "jaxgraph"] == [logging.WARNING]
  assert re.match(r"mlp\[0\] captured a new input signature \(2 of max_captures=8; compiled "
                  r"in \d+\.\d\d s\)\. It differs from the closest one captured before:\n"
                  r"args\[1\]: expected float32\[8,16\], got float32\[4,16\]\n", message), message
  assert "on_new_signature='error'" in message and "setLevel(logging.ERROR)" in message
  layers[0](params, half.astype(jnp.bfloat16))   # closest: the batch of 4, not of 8
  assert "\nargs[1]: expected float32[4,16], got bfloat16[4,16]\n" in _logged(caplog)[-1]


def test_the_recapture_log_is_silenced_by_the_loggers_level(caplog):
  caplog.set_level(logging.ERROR, logger="jaxgraph")   # what a program that means it does
  params = init_mlp(jax.random.key(0), D, H)
  g = jg.make_graphed(mlp, sample_args=(params, jnp.ones((T, D))), num_warmup_iters=0)
  g(params, jnp.ones((T // 2, D)))
  assert g.stats.captures == 2 and _logged(caplog) == []


def test_sample_args_of_several_signatures_neither_log_nor_raise(caplog):
  """With `order`, sample_args may give each microbatch its own signature: make_graphed
  captures them all, also with on_new_signature="error", and says nothing."""
  caplog.set_level(logging.WARNING, logger="jaxgraph")
  params = init_mlp(jax.random.key(0), D, H)
  samples = [(params, jnp.ones((T, D))), (params, jnp.ones((T // 2, D)))]  # microbatch 0, 1
  layer, = jg.make_graphed([mlp], sample_args=samples, order=[1, 1, -1, -1],
                           on_new_signature="error")
  assert layer.stats.captures == 2 and _logged(caplog) == []
  assert trees_equal(layer(params, jnp.ones((T // 2, D))), jax.jit(mlp)(*samples[1]))
  with pytest.raises(TypeError, match=r"expected float32\[4,16\], got bfloat16\[4,16\]"):
    layer(params, jnp.ones((T // 2, D), jnp.bfloat16))   # against the closest one captured


def test_shape_dtype_struct_sample_args():
  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x))
  g = jg.make_graphed(mlp, sample_args=abstract, on_new_signature="error")
  y, pullback = g.vjp(params, x)
  y_ref, vjp_ref = jax.jit(lambda p, x: jax.vjp(mlp, p, x))(params, x)
  assert trees_equal(y, y_ref)
  assert trees_equal(pullback(jnp.ones_like(y)), jax.jit(lambda v, g: v(g))(vjp_ref, jnp.ones_like(y)))


def test_jax_grad_through_graphed_layers_matches_pullback():
  fns, params, x = _stack(jnp.float32)
  layers = jg.make_graphed(fns, sample_args=[(p, x) for p in params], num_warmup_iters=0)

  def loss(params):
    h = x
    for layer, p in zip(layers, params):
      h = layer(p, h)
    return jnp.sum(h ** 2)

  grads_traced = jax.jit(jax.grad(loss))(params)
  y, pullback = jg.sequential_vjp(layers, params, x)
  grads, _ = pullback(2 * y)
  assert_equal_or_close(grads, grads_traced, gpu_rtol=1e-3, gpu_atol=1e-5,
                        why="one whole-step executable (jax.jit of jax.grad) vs per-layer "
                        "executables: XLA fuses across layer boundaries in the whole step")
  assert [l.stats.replays for l in layers] == [1] * 4  # traced calls are not replays
  batched = jax.vmap(layers[0], in_axes=(None, 0))(params[0], jnp.stack([x, x]))
  assert trees_equal(batched[0], layers[0](params[0], x))


def test_reset_drops_executables_and_recaptures():
  layer, traces = counting(mlp)

  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  g = jg.make_graphed(layer, sample_args=(params, x), num_warmup_iters=0)
  g.reset()
  assert g.executables.entries == {} and g.config.cache == {}
  y = g(params, x)
  assert traces() == 2 and g.stats.captures == 2
  assert trees_equal(y, jax.jit(mlp)(params, x))


def test_keyword_arguments_are_rejected():
  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  g = jg.make_graphed(mlp, sample_args=(params, x), num_warmup_iters=0)
  with pytest.raises(TypeError, match="keyword arguments.*positionally"):
    g(params, x=x)
  with pytest.raises(TypeError, match="rng=False"):
    g(params, x, key=jax.random.key(0))


@pytest.mark.devices(8)
def test_equivalent_partition_specs_are_one_signature():
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=devices_for(8)[:8])
  long = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", None))
  short = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  params = init_mlp(jax.random.key(0), D, H)
  g = jg.make_graphed(mlp, sample_args=(params, jax.device_put(jnp.ones((T, D)), long)),
                      num_warmup_iters=0, on_new_signature="error")
  y = g(params, jax.device_put(jnp.ones((T, D)), short))
  assert trees_equal(y, g(params, jax.device_put(jnp.ones((T, D)), long)))
  assert g.stats.captures == 1


def test_replays_are_named_in_a_profiler_trace(tmp_path):
  """Each replayed layer's forward and backward shows up by name in a jax.profiler trace."""
  params = [init_mlp(k, 4, 8) for k in jax.random.split(jax.random.key(0), 2)]
  x = jnp.ones((3, 4))
  layers = jg.make_graphed([mlp, mlp], sample_args=[(p, x) for p in params])
  with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
    y, pullback = jg.sequential_vjp(layers, params, x)
    jax.block_until_ready(pullback(jnp.ones_like(y)))
  [path] = glob.glob(str(tmp_path / "**" / "perfetto_trace.json.gz"), recursive=True)
  with gzip.open(path) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e.get("name") for e in events}
  for i in range(2):
    assert f"jaxgraph mlp[{i}] forward" in names
    assert f"jaxgraph mlp[{i}] backward" in names


def test_inference_only_compiles_one_forward_at_capture_and_never_again():
  layer, traces = counting(mlp)
  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  g = jg.make_graphed(layer, sample_args=(params, x), inference_only=True)
  assert (traces(), g.stats.compiles) == (1, 1)  # warmup replayed the one executable
  (entry,) = g.executables.entries.values()
  assert set(entry.forward) == {("explicit", False)} and entry.backward == {}
  for step in range(20):
    x = jax.random.normal(jax.random.key(step), (T, D))
    assert trees_equal(g(params, x), jax.jit(mlp)(params, x))
  assert (traces(), g.stats.compiles, g.stats.replays) == (1, 1, 20)
  longer = jnp.ones((2 * T, D))  # a longer prompt: a new signature, forward-only as well
  assert trees_equal(g(params, longer), jax.jit(mlp)(params, longer))
  assert (g.stats.captures, g.stats.compiles) == (2, 2)
  assert all(e.backward == {} for e in g.executables.entries.values())


def test_inference_only_rng_stream_and_explicit_key():
  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  g = jg.make_graphed(dropout_mlp, sample_args=(params, x), rng=jax.random.key(7),
                      inference_only=True)
  assert g.stats.compiles == 1 and g.rng_counter == 0  # the stream forward; warmup drew none
  reference = jax.jit(dropout_mlp)
  for n in range(2):
    key = rng_lib.stream_key(0, n, g.rng_base_key)
    assert trees_equal(g(params, x), reference(params, x, key=key))
  assert g.rng_counter == 2 and g.stats.compiles == 1
  key = jax.random.key(3)  # an explicit key: its forward compiles on its first use only
  for _ in range(2):
    assert trees_equal(g(params, x, key=key), reference(params, x, key=key))
  assert g.stats.compiles == 2 and g.rng_counter == 2


def test_inference_only_warmup_fires_forward_hooks_only():
  fired = []
  record = lambda kind: (lambda event: fired.append((kind, event.phase)))
  hooks = jg.Hooks(**{kind: [record(kind)] for kind in
                      ("pre_forward", "forward", "pre_backward", "backward")})
  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  g = jg.make_graphed(mlp, hooks, sample_args=(params, x), num_warmup_iters=2,
                      inference_only=True)
  g(params, x)
  assert fired == [(kind, phase) for phase in ("capture", "warmup", "warmup", "replay")
                   for kind in ("pre_forward", "forward")]


def test_inference_only_captures_what_jax_vjp_cannot_differentiate():
  def decode(p, x):  # a dynamic-length loop: no reverse mode, so no training capture
    steps = jnp.sum(x > 0)
    return jax.lax.while_loop(lambda c: c[1] < steps, lambda c: (mlp(p, c[0]), c[1] + 1),
                              (x, 0))[0]

  params = init_mlp(jax.random.key(0), D, H)
  x = jax.random.normal(jax.random.key(1), (T, D))
  with pytest.raises(ValueError, match="Reverse-mode differentiation"):
    jg.make_graphed(decode, sample_args=(params, x))
  g = jg.make_graphed(decode, sample_args=(params, x), inference_only=True)
  assert trees_equal(g(params, x), jax.jit(decode)(params, x))


def test_inference_only_refuses_backward_uses():
  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  g = jg.make_graphed(mlp, sample_args=(params, x), num_warmup_iters=0, inference_only=True)
  with pytest.raises(TypeError, match=r"vjp: mlp\[0\] was built with .*inference_only=True.*"
                                      r"without inference_only"):
    g.vjp(params, x)
  with pytest.raises(TypeError, match=r"sequential_vjp \(layers\[0\]\).*inference_only"):
    jg.sequential_vjp([g], [params], x)
  for conflict in (dict(delay_wgrad=True), dict(offload_residuals=[True]),
                   dict(order=[1, -1])):
    name = next(iter(conflict))
    with pytest.raises(ValueError, match=f"inference_only=True together with {name}.*Drop "
                                         f"{name}"):
      jg.make_graphed([mlp], sample_args=[(params, x)], inference_only=True, **conflict)
  with pytest.raises(TypeError, match="inference_only must be a bool"):
    jg.make_graphed(mlp, sample_args=(params, x), inference_only="yes")


@pytest.mark.devices(8)
def test_arrays_on_the_default_device_are_unplaced_under_jax_default_device():
  """Params made under `jax.default_device(d)` sit on d like unplaced arrays: next to inputs
  sharded over a mesh holding d they are one signature, and the capture compiles (on a GPU
  machine the CPU-device tests run this way; it failed there before)."""
  devices = devices_for(8)[:8]
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=devices)
  sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  with jax.default_device(devices[3]):
    params = init_mlp(jax.random.key(0), D, H)
    x = jax.device_put(jnp.ones((T, D)), sharded)
    g = jg.make_graphed(mlp, sample_args=(params, x), num_warmup_iters=0,
                        on_new_signature="error")
    assert trees_equal(g(params, x), jax.jit(mlp)(params, x))
  assert g.stats.captures == 1


@pytest.mark.devices(2)
def test_a_capture_under_one_default_device_is_not_replayed_on_another():
  """Unplaced arrays live on the default device: a signature taken under
  `jax.default_device(d1)` does not serve arrays on d0 (they are captured anew, for d0)."""
  d0, d1 = devices_for(2)[:2]
  with jax.default_device(d1):
    params = init_mlp(jax.random.key(0), D, H)
    g = jg.make_graphed(mlp, sample_args=(params, jnp.ones((T, D))))
  params0 = jax.device_put(params, d0)
  y = g(params0, jax.device_put(jnp.ones((T, D)), d0))
  assert y.devices() == {d0}
  assert g.stats.captures == 2
  with jax.default_device(d1):
    assert g(params, jnp.ones((T, D))).devices() == {d1}
  assert g.stats.captures == 2
