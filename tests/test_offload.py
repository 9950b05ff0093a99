"""Residual offload: memory kinds of kept residuals, numerics, rng, delay_wgrad, errors, hooks.

On CPU the backend reports `pinned_host` but compiles no real transfer (docs/offload.md, "CPU
and GPU"; memory kinds: https://docs.jax.dev/en/latest/notebooks/host-offloading.html): these
tests check the plumbing and the numerics. The `gpu` tests check the compiled HLO.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxgraph as jg
from jaxgraph import offload as offload_lib
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
  (entry,) = layer._entries.values()
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


def _train(layers, params, x, steps=2, keys=None):
  """A few SGD steps through `sequential_vjp`; returns every step's (y, grads, g_x)."""
  history = []
  for step in range(steps):
    step_keys = None if keys is None else [jax.random.fold_in(k, step) for k in keys]
    y, pullback = jg.sequential_vjp(layers, params, x, keys=step_keys)
    grads, g_x = pullback((y / y.size).astype(y.dtype))
    history.append((y, grads, g_x))
    params = [jax.tree.map(lambda p, g: (p - 0.01 * g).astype(p.dtype), p, g)
              for p, g in zip(params, grads)]
  return history


# ------------------------------------------------------------------------------- placement


def test_kept_residuals_live_in_pinned_host():
  fns, params, x = _stack()
  layers = jg.make_graphed(fns, sample_args=[(p, x) for p in params], offload_residuals=True)
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


def test_without_offload_residuals_stay_on_device():
  fns, params, x = _stack()
  layers = jg.make_graphed(fns, sample_args=[(p, x) for p in params])
  assert all(set(_kept_kinds(layer)) == {"device"} for layer in layers)


def test_backward_takes_host_residuals_and_returns_device_grads():
  fns, params, x = _stack()
  layer = jg.make_graphed(fns[0], sample_args=(params[0], x), offload_residuals=True)
  entry = _entry(layer)
  layout = entry.layout
  compiled, _ = entry.backward["full"]
  in_kinds = _in_kinds(compiled)
  first_kept = len(layout.needed_inputs) + len(layout.needed_outputs)
  assert set(in_kinds[:first_kept]) <= {"device", None}
  assert set(in_kinds[first_kept:first_kept + layout.n_kept]) == {"pinned_host"}
  assert {s.memory_kind for s in compiled.output_shardings} == {"device"}
  # Host residuals are not donated: XLA would alias them to device outputs.
  assert "input_output_alias" not in compiled.as_text().splitlines()[0]
  _, pullback = layer.vjp(params[0], x)
  grads = pullback(jnp.ones((T, D)))
  assert all(g.sharding.memory_kind == "device" for g in jax.tree.leaves(grads))


def test_weights_are_never_offloaded():
  """The backward reads weight matrices from the forward's arguments, which stay on device."""
  fns, params, x = _stack()
  layers = jg.make_graphed(fns, sample_args=[(p, x) for p in params], offload_residuals=True)
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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_offload_numerics_bitwise_equal_to_no_offload(dtype):
  fns, params, x = _stack(dtype)
  samples = [(p, x) for p in params]
  plain = jg.make_graphed(fns, sample_args=samples)
  offloaded = jg.make_graphed(fns, sample_args=samples, offload_residuals=True)
  got, want = _train(offloaded, params, x), _train(plain, params, x)
  assert trees_equal(got, want)
  y, grads, g_x = got[0]
  y_ref, grads_ref, g_x_ref = reference_stack(fns, params, x, (y / y.size).astype(dtype))
  assert trees_equal((y, grads, g_x), (y_ref, grads_ref, g_x_ref))


@pytest.mark.parametrize("explicit_keys", [True, False], ids=["explicit", "stream"])
def test_offload_with_rng(explicit_keys):
  fns, params, x = _stack(fns=[dropout_mlp] * 3)
  samples = [(p, x) for p in params]
  seed = jax.random.key(7)
  plain = jg.make_graphed(fns, sample_args=samples, rng=seed)
  offloaded = jg.make_graphed(fns, sample_args=samples, rng=seed, offload_residuals=True)
  assert any(k == "pinned_host" for k in _kept_kinds(offloaded[0]))
  keys = list(jax.random.split(jax.random.key(3), 3)) if explicit_keys else None
  got, want = _train(offloaded, params, x, keys=keys), _train(plain, params, x, keys=keys)
  assert trees_equal(got, want)
  if not explicit_keys:
    assert [g.rng_counter for g in offloaded] == [g.rng_counter for g in plain] == [2, 2, 2]


def test_offload_rng_backward_order_does_not_matter():
  fns, params, x = _stack(fns=[dropout_mlp] * 2)
  layers = jg.make_graphed(fns, sample_args=[(p, x) for p in params], rng=True,
                           offload_residuals=True)
  k0, k1 = jax.random.split(jax.random.key(5))
  _, pb_a = layers[0].vjp(params[0], x, key=k0)
  _, pb_b = layers[1].vjp(params[1], x, key=k1)
  ct = jnp.ones((T, D))
  g_b, g_a = pb_b(ct), pb_a(ct)
  _, pb_a2 = layers[0].vjp(params[0], x, key=k0)
  _, pb_b2 = layers[1].vjp(params[1], x, key=k1)
  assert trees_equal((g_a, g_b), (pb_a2(ct), pb_b2(ct)))


def test_offload_with_delay_wgrad():
  fns, params, x = _stack()
  samples = [(p, x) for p in params]
  plain = jg.make_graphed(fns, sample_args=samples)
  offloaded = jg.make_graphed(fns, sample_args=samples, delay_wgrad=True,
                              offload_residuals=True)
  entry = _entry(offloaded[0])
  for kind in ("dgrad", "wgrad"):
    compiled, _ = entry.backward[kind]
    first_kept = len(entry.layout.needed_inputs) + len(entry.layout.needed_outputs)
    kept_kinds = _in_kinds(compiled)[first_kept:first_kept + entry.layout.n_kept]
    assert "pinned_host" in kept_kinds and set(kept_kinds) <= {"pinned_host", None}
  y, pullback = jg.sequential_vjp(offloaded, params, x)
  ct = y / y.size
  _, g_x = pullback(ct)
  wgrads = pullback.wgrad()
  y_ref, pullback_ref = jg.sequential_vjp(plain, params, x)
  grads_ref, g_x_ref = pullback_ref(ct)
  assert trees_equal((y, g_x, wgrads), (y_ref, g_x_ref, grads_ref))


def test_per_callable_offload_all_but_last_k():
  depth, last_k = 6, 2
  fns, params, x = _stack(depth=depth)
  flags = [True] * (depth - last_k) + [False] * last_k
  samples = [(p, x) for p in params]
  layers = jg.make_graphed(fns, sample_args=samples, offload_residuals=flags)
  for layer, flag in zip(layers, flags):
    assert set(_kept_kinds(layer)) == {"pinned_host" if flag else "device"}
  # One function, two placements: the offloaded and the resident layers compile separately.
  mlp_layers = [layer for layer, f in zip(layers, fns) if f is mlp]
  assert [layer.stats.captures for layer in mlp_layers] == [1, 0, 1]
  plain = jg.make_graphed(fns, sample_args=samples)
  assert trees_equal(_train(layers, params, x), _train(plain, params, x))


def test_offload_with_fsdp():
  mesh = jg.fsdp.make_mesh()
  layer = jg.fsdp.remat(lambda p, x: mlp(jg.fsdp.gather(p, mesh), x))
  params = [jg.fsdp.shard(init_mlp(k, D, H), mesh, min_size=1)
            for k in jax.random.split(jax.random.key(0), 2)]
  x = jax.device_put(jnp.ones((T, D)), NamedSharding(mesh, P()))
  samples = [(p, x) for p in params]
  offloaded = jg.make_graphed([layer] * 2, sample_args=samples, offload_residuals=True)
  plain = jg.make_graphed([layer] * 2, sample_args=samples)
  assert set(_kept_kinds(offloaded[0])) == {"pinned_host"}
  got, want = _train(offloaded, params, x), _train(plain, params, x)
  assert trees_equal(got, want)
  grads = got[0][1]
  assert grads[0]["w1"].sharding == params[0]["w1"].sharding


def test_inference_call_keeps_no_residuals():
  fns, params, x = _stack()
  layer = jg.make_graphed(fns[0], sample_args=(params[0], x), offload_residuals=True)
  y = layer(params[0], x)
  entry = _entry(layer)
  inference = entry.forward["explicit", False]
  assert len(inference.out_info) == entry.layout.n_out
  assert y.sharding.memory_kind == "device"


# ------------------------------------------------------------------------------- errors


def test_per_callable_flags_of_wrong_length_raise():
  fns, params, x = _stack()
  with pytest.raises(ValueError, match="one bool per callable"):
    jg.make_graphed(fns, sample_args=[(p, x) for p in params], offload_residuals=[True])


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



# ------------------------------------------------------------------------------- warmup hooks


def _docs_example(name: str) -> str:
  """The python block after `<!-- example: name -->` in docs/offload.md."""
  path = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "offload.md")
  with open(path) as f:
    text = f.read()
  start = text.index("```python\n", text.index(f"<!-- example: {name} -->")) + len("```python\n")
  return text[start:text.index("```", start)]


def test_docs_warmup_hooks_example():
  namespace: dict = {}
  exec(compile(_docs_example("warmup-hooks"), "docs/offload.md", "exec"), namespace)
  ledger, layers = namespace["ledger"], namespace["layers"]
  assert namespace["on_host_before_backward"] == [0, 1]
  assert ledger.on_host == set()
  phases = {phase for _, phase, _ in ledger.log}
  assert phases == {"capture", "replay"}  # the warmup hooks paused it for the warmup
  assert [kind for kind, phase, _ in ledger.log if phase == "replay"] == [
      "offload", "offload", "reload", "reload"]
  assert [set(_kept_kinds(layer)) for layer in layers] == [
      {"pinned_host"}, {"pinned_host"}, {"device"}, {"device"}]


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
  assert all(set(_kept_kinds(layer)) == {"pinned_host"} for layer in layers)


# ------------------------------------------------------------------------------- GPU


def _gpu_stack():
  fns, params, x = _stack(jnp.bfloat16, fns=[mlp] * 4)
  x = jnp.ones((1024, D), jnp.bfloat16)
  return fns, params, x


@pytest.mark.gpu
def test_gpu_compiled_executables_copy_residuals_through_host_memory():
  fns, params, x = _gpu_stack()
  layers = jg.make_graphed(fns, sample_args=[(p, x) for p in params], offload_residuals=True)
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
