"""Pipeline orders (`make_graphed(order=...)`, `jg.schedule`): TE's interleaved test ported,
warmup/capture/hook order, validation errors, builders, the driver on one and two devices,
and property tests over random valid and invalid orders."""

from __future__ import annotations

import functools
import threading
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxgraph as jg
from jaxgraph import schedule
from models import devices_for, dropout_mlp, init_mlp

WIDTH, BATCH = 8, 4
TE_ORDER = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]


def block(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  return jnp.tanh(x @ params["w"] + params["b"])


def mlp(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  return jax.nn.gelu(x @ params["w"]) @ params["w"].T + params["b"]


def loss_fn(y: jax.Array, target: jax.Array) -> jax.Array:
  return jnp.mean((y - target) ** 2)


def make_params(count: int, seed: int = 0) -> list[dict[str, jax.Array]]:
  keys = jax.random.split(jax.random.key(seed), count)
  return [{"w": jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH),
           "b": jnp.full((WIDTH,), 0.01 * (i + 1))} for i, k in enumerate(keys)]


def make_batches(count: int, seed: int = 1) -> tuple[list[jax.Array], list[jax.Array]]:
  keys = jax.random.split(jax.random.key(seed), 2 * count)
  inputs = [jax.random.normal(k, (BATCH, WIDTH)) for k in keys[:count]]
  targets = [jax.random.normal(k, (BATCH, WIDTH)) for k in keys[count:]]
  return inputs, targets


def add(total: Any, grad: Any) -> Any:
  return grad if total is None else jax.tree.map(jnp.add, total, grad)


def sgd(params: Any, grads: Any, lr: float = 0.1) -> Any:
  return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def reference_step(layers: Sequence[jg.GraphedCallable], params: list[Any],
                   inputs: list[jax.Array], targets: list[jax.Array]):
  """No schedule: microbatch by microbatch, all forwards then all backwards."""
  loss_grad = _loss_grad()
  grads: list[Any] = [None] * len(layers)
  outputs = []
  for x, t in zip(inputs, targets):
    y, pullback = jg.sequential_vjp(layers, params, x)
    outputs.append(y)
    _, ct = loss_grad(y, t)
    layer_grads, _ = pullback(ct)
    grads = [add(total, g) for total, g in zip(grads, layer_grads)]
  return outputs, grads


@functools.cache
def _loss_grad():
  return jax.jit(jax.value_and_grad(loss_fn))


_jit_vjp = jax.jit(jax.vjp, static_argnums=0)
_jit_pull = jax.jit(lambda pull, ct: pull(ct))


def flat(chunked: Sequence[Sequence[Any]]) -> list[Any]:
  return [item for chunk in chunked for item in chunk]


def split(items: Sequence[Any], sizes: Sequence[int]) -> list[list[Any]]:
  return [list(items[sum(sizes[:c]):sum(sizes[:c + 1])]) for c in range(len(sizes))]


def assert_trees_equal(a: Any, b: Any) -> None:
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert leaves_a and len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    assert np.array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------ TE's interleaved test


def test_te_interleaved_order_bitwise_and_one_compile():
  """TE test_make_graphed_callables_with_interleaved_pipeline_parallelism, ported: 2
  single-layer chunks, 3 microbatches, 3 SGD steps; outputs and weights bitwise equal to the
  same model without a schedule, and to `jax.vjp` under `jax.jit`, layer by layer."""
  params, microbatches = make_params(2), 3
  inputs, targets = make_batches(microbatches)
  # Transformer Engine's form: one sample per (chunk, microbatch, layer).
  samples = [(params[c], inputs[m]) for c in range(2) for m in range(microbatches)]
  layers = jg.make_graphed([block, block], sample_args=samples, order=TE_ORDER)
  plain = jg.make_graphed([block, block], sample_args=[(p, inputs[0]) for p in params])
  pipeline = schedule.Pipeline([[layers[0]], [layers[1]]], TE_ORDER, loss_fn=loss_fn)
  # Step 0 against `jax.vjp` under `jax.jit`, layer by layer.
  result = pipeline([[params[0]], [params[1]]], inputs, targets)
  eager_grads: list[Any] = [None, None]
  for m in range(microbatches):
    h, pull0 = _jit_vjp(block, params[0], inputs[m])
    y, pull1 = _jit_vjp(block, params[1], h)
    assert_trees_equal(result.outputs[m], y)
    g1, ct = _jit_pull(pull1, _loss_grad()(y, targets[m])[1])
    g0, _ = _jit_pull(pull0, ct)
    eager_grads = [add(eager_grads[0], g0), add(eager_grads[1], g1)]
  assert_trees_equal(flat(result.grads), eager_grads)
  # 3 SGD steps against the same graphed model without a schedule.
  ours, theirs = list(params), list(params)
  for _ in range(3):
    result = pipeline([[ours[0]], [ours[1]]], inputs, targets)
    outputs, grads = reference_step(plain, theirs, inputs, targets)
    assert_trees_equal(result.outputs, outputs)
    ours = [sgd(p, g) for p, g in zip(ours, flat(result.grads))]
    theirs = [sgd(p, g) for p, g in zip(theirs, grads)]
  assert_trees_equal(ours, theirs)
  # One compile per function x signature: the second layer and every microbatch reuse it.
  assert layers[0].stats.captures == 1 and layers[1].stats.captures == 0
  assert layers[1].stats.cache_hits == 1 and layers[1].stats.compiles == 0
  assert layers[0].stats.replays == 12 and layers[1].stats.backward_replays == 12


def test_uneven_chunks_and_per_layer_samples():
  """`num_layers_per_chunk=[2, 1]`, one sample per layer: chunks of 2 and 1 layers."""
  params = make_params(3)
  inputs, targets = make_batches(2)
  order = schedule.interleaved_1f1b(2, 2)
  layers = jg.make_graphed([block, mlp, block], sample_args=[(p, inputs[0]) for p in params],
                           order=order, num_layers_per_chunk=[2, 1])
  plain = jg.make_graphed([block, mlp, block], sample_args=[(p, inputs[0]) for p in params])
  pipeline = schedule.Pipeline(split(layers, [2, 1]), order, loss_fn=loss_fn)
  result = pipeline(split(params, [2, 1]), inputs, targets)
  outputs, grads = reference_step(plain, params, inputs, targets)
  assert_trees_equal(result.outputs, outputs)
  assert_trees_equal(flat(result.grads), grads)
  assert [layer.stats.captures for layer in layers] == [1, 1, 0]


def test_te_form_samples_with_per_microbatch_shapes():
  """TE-form sample_args whose microbatches differ in batch size: one compile per signature,
  each warmed up with its own microbatch's sample."""
  params = make_params(2)
  inputs = [jnp.ones((BATCH, WIDTH)), jnp.ones((BATCH // 2, WIDTH))]
  targets = [jnp.zeros_like(x) for x in inputs]
  shapes: list[tuple[int, tuple[int, ...]]] = []
  hooks = jg.Hooks(pre_forward=[lambda e: shapes.append((e.microbatch, e.args[1].shape))])
  order = [1, 2, -2, -1, 1, 2, -2, -1]
  layers = jg.make_graphed([block, block], hooks=hooks, order=order, num_warmup_iters=1,
                           sample_args=[(params[c], x) for c in range(2) for x in inputs])
  assert set(shapes) == {(0, (BATCH, WIDTH)), (1, (BATCH // 2, WIDTH))}
  assert layers[0].stats.captures == 2 and layers[1].stats.cache_hits == 2
  result = schedule.Pipeline([[layers[0]], [layers[1]]], order, loss_fn=loss_fn)(
      [[params[0]], [params[1]]], inputs, targets)
  plain = jg.make_graphed([block, block], sample_args=[(p, inputs[0]) for p in params])
  outputs, grads = reference_step(plain, params, inputs, targets)
  assert_trees_equal(result.outputs, outputs)
  assert_trees_equal(flat(result.grads), grads)
  assert [layer.stats.fallbacks for layer in layers] == [0, 0]


# ------------------------------------------------------------ warmup, capture and hooks


def _recording_hooks(log: list[tuple[Any, ...]]) -> jg.Hooks:
  def record(kind: str):
    return lambda event: log.append((event.phase, kind, event.index, event.microbatch))
  return jg.Hooks(pre_forward=[record("fpre")], forward=[record("fwd")],
                  pre_backward=[record("bpre")], backward=[record("bwd")])


def test_capture_and_warmup_follow_order_and_report_microbatch():
  params = make_params(2)
  inputs, targets = make_batches(3)
  log: list[tuple[Any, ...]] = []
  layers = jg.make_graphed([block, block], hooks=_recording_hooks(log),
                           sample_args=[(p, inputs[0]) for p in params], order=TE_ORDER,
                           num_warmup_iters=2)
  # (index, microbatch) per order entry, written out by hand from TE's semantics.
  forward = lambda i, m: [("fpre", i, m), ("fwd", i, m)]
  backward = lambda i, m: [("bpre", i, m), ("bwd", i, m)]
  one_pass = (forward(0, 0) + forward(1, 0) + forward(0, 1) + forward(1, 1) + backward(1, 0)
              + backward(0, 0) + forward(0, 2) + forward(1, 2) + backward(1, 1)
              + backward(0, 1) + backward(1, 2) + backward(0, 2))
  assert [e[1:] for e in log if e[0] == "capture"] == one_pass
  assert [e[1:] for e in log if e[0] == "warmup"] == one_pass * 2
  log.clear()
  pipeline = schedule.Pipeline([[layers[0]], [layers[1]]], TE_ORDER, loss_fn=loss_fn)
  pipeline([[params[0]], [params[1]]], inputs, targets)
  assert [e[1:] for e in log] == one_pass and {e[0] for e in log} == {"replay"}


def test_te_capture_time_hooks_order_with_two_chunk_order():
  """TE's capture-time hooks test with `_order=[1, 2, -2, -1]`: the same global order."""
  params = make_params(2)
  log: list[tuple[Any, ...]] = []
  layers = jg.make_graphed([block, block], capture_time_hooks=_recording_hooks(log),
                           sample_args=[(p, jnp.ones((BATCH, WIDTH))) for p in params],
                           order=[1, 2, -2, -1], num_warmup_iters=1)
  iteration = [("fpre", 0), ("fwd", 0), ("fpre", 1), ("fwd", 1), ("bpre", 1), ("bwd", 1),
               ("bpre", 0), ("bwd", 0)]
  assert [(kind, i) for _, kind, i, _ in log] == iteration * 2
  log.clear()
  layers[0](params[0], jnp.ones((BATCH, WIDTH)))
  assert log == []


def test_warmup_with_wgrad_entries_runs_them_in_order(monkeypatch):
  params = make_params(2)
  seen: list[tuple[str, int, int]] = []
  original = jg.Pullback.wgrad

  def spy(self):
    seen.append(("wgrad", self._owner.index, self._event.microbatch))
    return original(self)

  order = [1, 2, -2, -1, -2.5, 1, 2, -1.5, -2, -2.5, -1, -1.5]
  monkeypatch.setattr(jg.Pullback, "wgrad", spy)
  jg.make_graphed([block, block], sample_args=[(p, jnp.ones((BATCH, WIDTH))) for p in params],
                  order=order, delay_wgrad=True, num_warmup_iters=1)
  assert seen == [("wgrad", 1, 0), ("wgrad", 0, 0), ("wgrad", 1, 1), ("wgrad", 0, 1)]


def test_warmup_keeps_no_result_across_steps():
  """Warmup drops each step's outputs and grads once it finished: the live bytes at an
  iteration's first forward stay the same (kept, each iteration added M copies)."""
  params = make_params(1)
  live: dict[int, int] = {}

  def measure(event: jg.HookEvent) -> None:
    if event.phase == "warmup" and event.microbatch == 0:
      live[event.iteration] = sum(array.nbytes for array in jax.live_arrays())

  jg.make_graphed([block], sample_args=[(params[0], jnp.ones((BATCH, WIDTH)))],
                  order=schedule.one_f_one_b(4), num_warmup_iters=3,
                  capture_time_hooks=jg.Hooks(pre_forward=[measure]))
  assert sorted(live) == [0, 1, 2]
  assert live[2] == live[1]  # iteration 0 starts with no earlier step's result held


# ------------------------------------------------------------------------------ validation


def _graph(order: Any, count: int = 2, **kwargs: Any) -> Any:
  params = make_params(count)
  samples = kwargs.pop("sample_args", [(p, jnp.ones((BATCH, WIDTH))) for p in params])
  return jg.make_graphed([block] * count, sample_args=samples, order=order,
                         num_warmup_iters=0, **kwargs)


@pytest.mark.parametrize("order, error, match", [
    ([1, 2, -2], ValueError, "dimension mismatch"),
    ([1, 2, 2, -2, -1], ValueError, "dimension mismatch"),
    ([1, 1.0, -1, -1], TypeError, "forward entries must be ints"),
    ([1, "2", -2, -1], TypeError, "chunk ids"),
    ([1, 0, -1], ValueError, "start at 1"),
    ([1, 2, -2, -1, -1.5], ValueError, "delay_wgrad=True"),
    ([2, 1, -2, -1], ValueError, "before the forward of chunk 1"),
    ([1, -1, 2, -2], ValueError, "before the backward of chunk 2"),
    ([-1, 1, 2, -2], ValueError, "before its forward"),
])
def test_invalid_orders(order, error, match):
  with pytest.raises(error, match=match):
    _graph(order)


@pytest.mark.parametrize("order, match", [
    ([1, 2, -2, -1, -1.5], "wgrad entries \\(0\\) doesn't match number of dgrad entries \\(1\\) "
     "for chunk 2"),
    ([1, 2, -2, -2.5, -1, -1.3], "must be 0.5"),
    ([1, 2, -2, -1.5, -1, -2.5], "before its backward"),
    ([1, 2, -2, -1, -0.5, -2.5], "chunk 0"),
])
def test_invalid_wgrad_entries(order, match):
  with pytest.raises(ValueError, match=match):
    _graph(order, delay_wgrad=True)


def test_sample_args_and_layer_validation():
  params = make_params(3)
  x = jnp.ones((BATCH, WIDTH))
  with pytest.raises(ValueError, match=r"one tuple per layer \(2\).*\(2 \* 2 = 4\), but got 3"):
    _graph([1, 2, 1, 2, -2, -1, -2, -1], sample_args=[(p, x) for p in params])
  with pytest.raises(ValueError, match="do not split evenly"):
    _graph([1, 2, -2, -1], count=3)
  with pytest.raises(ValueError, match="gives 4 layers but there are 3"):
    _graph([1, 2, -2, -1], count=3, num_layers_per_chunk=2)
  with pytest.raises(ValueError, match="a list of 2 ints"):
    _graph([1, 2, -2, -1], count=3, num_layers_per_chunk=[1, 1, 1])
  with pytest.raises(TypeError, match="an int or a list of 2 ints"):
    _graph([1, 2, -2, -1], count=3, num_layers_per_chunk=[2, 1.0])
  with pytest.raises(TypeError, match="an int or a list of 2 ints"):
    _graph([1, 2, -2, -1], count=3, num_layers_per_chunk="21")
  with pytest.raises(ValueError, match="must hold ints >= 1"):
    _graph([1, 2, -2, -1], count=3, num_layers_per_chunk=[3, 0])
  with pytest.raises(ValueError, match="3 chunks but there are only 2 callables"):
    _graph([1, 2, 3, -3, -2, -1])
  with pytest.raises(ValueError, match="only applies with order"):
    jg.make_graphed([block], sample_args=[(params[0], x)], num_layers_per_chunk=1)


def test_pipeline_validation():
  layers = _graph([1, 2, -2, -1])
  with pytest.raises(ValueError, match="the order has 3 chunks but Pipeline got 2"):
    schedule.Pipeline([[layers[0]], [layers[1]]], [1, 2, 3, -3, -2, -1], loss_fn=loss_fn)
  with pytest.raises(ValueError, match="1 devices for 2 chunks"):
    schedule.Pipeline([[layers[0]], [layers[1]]], [1, 2, -2, -1], loss_fn=loss_fn,
                      devices=jax.devices()[:1])
  with pytest.raises(TypeError, match="GraphedCallables"):
    schedule.Pipeline([[block]], [1, -1], loss_fn=loss_fn)
  with pytest.raises(ValueError, match="threads=True.*needs devices="):
    schedule.Pipeline([[layers[0]], [layers[1]]], [1, 2, -2, -1], loss_fn=loss_fn, threads=True)
  pipeline = schedule.Pipeline([[layers[0]], [layers[1]]], [1, 2, -2, -1], loss_fn=loss_fn)
  with pytest.raises(ValueError, match="runs 1 microbatches but Pipeline got 2 inputs"):
    inputs, targets = make_batches(2)
    pipeline([[p] for p in make_params(2)], inputs, targets)
  inputs, targets = make_batches(1)
  with pytest.raises(ValueError, match=r"one tuple per microbatch \(1\).*got 1 of \["):
    pipeline([[p] for p in make_params(2)], inputs, targets, consts=[targets[0]])


def ride(params: dict[str, jax.Array], carry: tuple[jax.Array, jax.Array]) -> Any:
  """`with_const`'s block with its side input riding in the activation (and returned)."""
  x, scale = carry
  return with_const(params, x, scale), scale


def with_const(params: dict[str, jax.Array], x: jax.Array, scale: jax.Array) -> jax.Array:
  return block(params, x) * scale


@pytest.mark.parametrize("builder, delay_wgrad", [(schedule.one_f_one_b, False),
                                                   (schedule.zero_bubble, True)])
def test_consts_match_the_side_input_riding_in_x_bitwise(builder, delay_wgrad):
  """Per-microbatch `consts=` give bitwise the outputs, losses, grads and input grads of the
  same side input riding through every layer in the activation."""
  params, microbatches = make_params(2), 4
  inputs, targets = make_batches(microbatches)
  scales = [jnp.full((BATCH, 1), 1.0 + 0.25 * m) for m in range(microbatches)]
  order = schedule.merge_ranks([builder(microbatches, pipeline_parallel_size=2, rank=r)
                                for r in range(2)])
  options = dict(order=order, delay_wgrad=delay_wgrad, num_warmup_iters=1)
  riding = jg.make_graphed([ride, ride], sample_args=[(p, (inputs[0], scales[0]))
                                                      for p in params], **options)
  taking = jg.make_graphed([with_const] * 2, sample_args=[(p, inputs[0], scales[0])
                                                          for p in params], **options)
  chunked = [[p] for p in params]
  rode = schedule.Pipeline([[layer] for layer in riding], order,
                           loss_fn=lambda out, target: loss_fn(out[0], target))(
      chunked, list(zip(inputs, scales)), targets)
  took = schedule.Pipeline([[layer] for layer in taking], order, loss_fn=loss_fn)(
      chunked, inputs, targets, consts=[(scale,) for scale in scales])
  assert_trees_equal([y for y, _ in rode.outputs], took.outputs)
  assert_trees_equal(rode.losses, took.losses)
  assert_trees_equal(rode.grads, took.grads)
  assert_trees_equal([g for g, _ in rode.input_grads], took.input_grads)


# -------------------------------------------------------------------------------- builders


def test_builders_reproduce_megatron_and_are_valid():
  # Megatron's convert_schedule_table_to_order docstring example (PP2, VP2, 5 microbatches).
  assert schedule.interleaved_1f1b(5, 2, pipeline_parallel_size=2, rank=0,
                                   microbatch_group_size=3) == [
      1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1]
  assert schedule.one_f_one_b(4, pipeline_parallel_size=3, rank=0) == [
      1, 1, 1, -1, 1, -1, -1, -1]
  for microbatches in range(1, 6):
    for ranks in range(1, 4):
      for chunks in range(1, 4):
        orders = [schedule.interleaved_1f1b(microbatches, chunks, pipeline_parallel_size=ranks,
                                            rank=r) for r in range(ranks)]
        plan = schedule.parse_order(schedule.merge_ranks(orders))
        assert (plan.num_chunks, plan.num_microbatches) == (chunks * ranks, microbatches)
      zb = [schedule.zero_bubble(microbatches, pipeline_parallel_size=ranks, rank=r)
            for r in range(ranks)]
      plan = schedule.parse_order(schedule.merge_ranks(zb), delay_wgrad=True)
      assert plan.has_wgrad and plan.num_chunks == ranks


@pytest.mark.parametrize("ranks, microbatches", [(2, 4), (2, 8), (3, 5), (4, 16)])
def test_zero_bubble_fills_what_1f1b_leaves_idle(ranks, microbatches):
  """At unit costs ZB-H1 idles p - 1 units of 3M + p - 1 (1F1B: 3(p - 1) of 3(M + p - 1)),
  and no rank holds more microbatches (activations or wgrad inputs) than 1F1B's first."""
  orders = [schedule.zero_bubble(microbatches, pipeline_parallel_size=ranks, rank=r)
            for r in range(ranks)]
  one_f = [schedule.one_f_one_b(microbatches, pipeline_parallel_size=ranks, rank=r)
           for r in range(ranks)]
  assert schedule.bubble_fraction(schedule.merge_ranks(orders), stages=ranks) == pytest.approx(
      (ranks - 1) / (3 * microbatches + ranks - 1))
  assert schedule.bubble_fraction(schedule.merge_ranks(one_f), stages=ranks) == pytest.approx(
      (ranks - 1) / (microbatches + ranks - 1))
  for order in orders:
    held = np.cumsum([1 if e > 0 else -1 if e == -1.5 else 0 for e in order])
    assert held.max() <= ranks and held[-1] == 0
    assert order.count(-1) == order.count(-1.5) == microbatches


def test_merge_ranks_reports_deadlock():
  with pytest.raises(ValueError, match="deadlock"):
    schedule.merge_ranks([[1, -1, 1, -1], [1, 1, -1, -1]])


# ----------------------------------------------------------------- delay_wgrad and devices


def test_zero_bubble_order_with_delay_wgrad_bitwise():
  """ZB order over 3 stages (wgrad entries) with split backwards == fused, unscheduled."""
  stages, microbatches = 3, 4
  params = make_params(stages)
  inputs, targets = make_batches(microbatches)
  order = schedule.merge_ranks([schedule.zero_bubble(microbatches, pipeline_parallel_size=stages,
                                                     rank=r) for r in range(stages)])
  samples = [(p, inputs[0]) for p in params]
  split_layers = jg.make_graphed([block] * stages, sample_args=samples, order=order,
                                 delay_wgrad=True, num_warmup_iters=1)
  fused = jg.make_graphed([block] * stages, sample_args=samples)
  pipeline = schedule.Pipeline([[layer] for layer in split_layers], order, loss_fn=loss_fn)
  result = pipeline([[p] for p in params], inputs, targets)
  outputs, grads = reference_step(fused, params, inputs, targets)
  assert_trees_equal(result.outputs, outputs)
  assert_trees_equal(flat(result.grads), grads)
  # dgrad and wgrad are separate executables, compiled once for the three layers.
  assert set(split_layers[0].executables.entries[next(iter(split_layers[0].executables.entries))].backward) == {
      "dgrad", "wgrad"}
  assert split_layers[0].stats.captures == 1 and split_layers[2].stats.compiles == 0


@pytest.mark.devices(2)
def test_two_devices_match_one_device():
  devices = devices_for(2)[:2]
  params, microbatches = make_params(4), 4
  inputs, targets = make_batches(microbatches)
  sizes = [2, 2]
  order = schedule.merge_ranks([schedule.one_f_one_b(microbatches, pipeline_parallel_size=2,
                                                     rank=r) for r in range(2)])
  placed = [jax.device_put(p, devices[i // 2]) for i, p in enumerate(params)]
  samples = [(p, jax.device_put(inputs[0], devices[i // 2])) for i, p in enumerate(placed)]
  two = jg.make_graphed([block] * 4, sample_args=samples, order=order, num_warmup_iters=1)
  one = jg.make_graphed([block] * 4, sample_args=[(p, inputs[0]) for p in params], order=order,
                        num_warmup_iters=1)
  across = schedule.Pipeline(split(two, sizes), order, loss_fn=loss_fn, devices=devices)
  single = schedule.Pipeline(split(one, sizes), order, loss_fn=loss_fn)
  weights_two, weights_one = split(placed, sizes), split(params, sizes)
  for _ in range(2):
    result_two = across(weights_two, inputs, targets)
    result_one = single(weights_one, inputs, targets)
    weights_two = [[sgd(p, g) for p, g in zip(ps, gs)]
                   for ps, gs in zip(weights_two, result_two.grads)]
    weights_one = [[sgd(p, g) for p, g in zip(ps, gs)]
                   for ps, gs in zip(weights_one, result_one.grads)]
  assert_trees_equal(weights_two, weights_one)
  for c, chunk in enumerate(weights_two):
    for p in chunk:
      assert p["w"].devices() == {devices[c]}
  # One compile per function x signature: a signature includes the device.
  assert [layer.stats.captures for layer in two] == [1, 0, 1, 0]
  assert [layer.stats.fallbacks for layer in two] == [0] * 4


def test_pipeline_host_work_a_step(monkeypatch):
  """The driving thread's work: placed params are not put again, and a chunk's gradients
  accumulate in one call a backward (not one add a leaf), an integer leaf's float0 gradient
  kept out of it (a NumPy float0 argument sends every call down jax's Python dispatch path)."""
  devices = devices_for(2)[:2]
  params, microbatches = make_params(4), 3
  params = [{**p, "steps": jnp.arange(3)} for p in params]  # unused by `block`: float0 grads
  inputs, targets = make_batches(microbatches)
  order = schedule.merge_ranks([schedule.one_f_one_b(microbatches, pipeline_parallel_size=2,
                                                     rank=r) for r in range(2)])
  placed = [jax.device_put(p, devices[i // 2]) for i, p in enumerate(params)]
  samples = [(p, jax.device_put(inputs[0], devices[i // 2])) for i, p in enumerate(placed)]
  layers = jg.make_graphed([block] * 4, sample_args=samples, order=order, num_warmup_iters=0)
  pipeline = schedule.Pipeline(split(layers, [2, 2]), order, loss_fn=loss_fn, devices=devices)
  put, sums = [], []
  original_put = jax.device_put
  monkeypatch.setattr(jax, "device_put",
                      lambda tree, *a, **k: put.extend(jax.tree.leaves(tree))
                      or original_put(tree, *a, **k))
  summed_dtypes = set()
  for name in ("_sum", "_sum_into"):
    jitted = getattr(schedule, name)

    def counted(*args: Any, f: Any = jitted, n: str = name) -> Any:
      sums.append(n)
      summed_dtypes.update(leaf.dtype for leaf in jax.tree.leaves(args))
      return f(*args)

    monkeypatch.setattr(schedule, name, counted)
  result = pipeline(split(placed, [2, 2]), inputs, targets)
  weights = {id(leaf) for leaf in jax.tree.leaves(placed)}
  assert put and not weights & {id(leaf) for leaf in put}
  # per chunk: the first microbatch's grads kept, then one sum each, into its own after one
  assert sums == ["_sum", "_sum"] + ["_sum_into"] * 2 * (microbatches - 2)
  assert summed_dtypes == {jnp.dtype(jnp.float32)}
  for c, chunk in enumerate(result.grads):
    for g in chunk:
      assert g["w"].devices() == {devices[c]}
      assert g["steps"].dtype == jax.dtypes.float0 and g["steps"].shape == (3,)


@pytest.mark.devices(2)
@pytest.mark.parametrize("zero_bubble", [False, True], ids=["1f1b", "zero_bubble"])
def test_fused_chunks_match_unfused_bitwise_in_fewer_calls(monkeypatch, zero_bubble):
  """`fuse=True`: each chunk's hook-free runs replay as one segment (chunk 1 whole; chunk 2's
  first two layers, its hooked last layer alone, its hooks told the microbatch): bitwise the
  unfused outputs, losses, grads, input grads and key counters over 2 SGD steps, with
  dropout; one per-layer replay a microbatch left (the hooked layer's), no recompile. Zero
  bubble: split backwards, a fused run's one dgrad and one deferred wgrad executable."""
  devices, sizes, microbatches = devices_for(2)[:2], [2, 3], 2
  params = [jax.device_put(init_mlp(k, WIDTH, 2 * WIDTH), devices[i >= 2])
            for i, k in enumerate(jax.random.split(jax.random.key(0), 5))]
  inputs, targets = make_batches(microbatches)
  make_order = schedule.zero_bubble if zero_bubble else schedule.one_f_one_b
  order = schedule.merge_ranks([make_order(microbatches, pipeline_parallel_size=2, rank=r)
                                for r in range(2)])
  logs: dict[bool, list[tuple[Any, ...]]] = {True: [], False: []}
  per_layer: dict[bool, int] = {True: 0, False: 0}
  original_vjp = schedule._vjp

  def counted_vjp(layer, args, microbatch):
    per_layer[fused] += 1
    return original_vjp(layer, args, microbatch)

  monkeypatch.setattr(schedule, "_vjp", counted_vjp)
  runs, layers = {}, {}
  for fused in (True, False):
    layers[fused] = jg.make_graphed(
        [dropout_mlp] * 5, [None] * 4 + [_recording_hooks(logs[fused])], rng=True,
        sample_args=[(p, jax.device_put(inputs[0], p["w1"].sharding)) for p in params],
        num_warmup_iters=0, delay_wgrad=zero_bubble)
    logs[fused].clear()  # replay hooks fire at capture too
    pipeline = schedule.Pipeline(split(layers[fused], sizes), order, loss_fn=loss_fn,
                                 devices=devices, fuse=fused)
    weights, results, compiles = split(params, sizes), [], []
    for _ in range(2):
      results.append(pipeline(weights, inputs, targets))
      weights = [[sgd(p, g) for p, g in zip(ps, gs)]
                 for ps, gs in zip(weights, results[-1].grads)]
      compiles.append(sum(layer.stats.compiles for layer in layers[fused]))
    runs[fused] = results, weights, compiles
  for fused_result, plain_result in zip(runs[True][0], runs[False][0]):
    assert_trees_equal(fused_result.outputs, plain_result.outputs)
    assert_trees_equal(fused_result.losses, plain_result.losses)
    assert_trees_equal(fused_result.grads, plain_result.grads)
    assert_trees_equal(fused_result.input_grads, plain_result.input_grads)
  assert_trees_equal(runs[True][1], runs[False][1])
  assert ([layer.rng_counter for layer in layers[True]]
          == [layer.rng_counter for layer in layers[False]] == [2 * microbatches] * 5)
  assert logs[True] == logs[False]
  assert sorted({e[3] for e in logs[True]}) == list(range(microbatches))
  assert {e[2] for e in logs[True]} == {4}
  # Two segments, each one forward and one backward call a microbatch; the hooked layer alone.
  segments = list(layers[True][0].config.segments.values())
  assert [len(s._layers) for s in segments] == [2, 2]
  assert all(s.stats.replays == s.stats.backward_replays == 2 * microbatches
             for s in segments)
  assert per_layer == {True: 2 * microbatches, False: 5 * 2 * microbatches}
  assert runs[True][2][0] == runs[True][2][1]  # no recompile on the second step
  assert all(layer.stats.fallbacks == 0 for layer in layers[True])
  # Per segment: one forward and one backward executable, or forward, dgrad and wgrad.
  assert [s.stats.compiles for s in segments] == [3 if zero_bubble else 2] * 2
  assert all(set(entry.backward) == ({"dgrad", "wgrad"} if zero_bubble else {"full"})
             for s in segments for entry in s.executables.entries.values())


# Per case: the order builder, chunks a device, fuse, delay_wgrad.
THREAD_CASES = {
    "1f1b_fused": (schedule.one_f_one_b, 1, True, False),
    "interleaved": (functools.partial(schedule.interleaved_1f1b, num_model_chunks=2), 2,
                    False, False),
    "zero_bubble": (schedule.zero_bubble, 1, False, True),
    "zero_bubble_fused": (schedule.zero_bubble, 1, True, True),
}


@pytest.mark.devices(2)
@pytest.mark.parametrize("case", sorted(THREAD_CASES))
def test_threads_match_one_thread_bitwise(case):
  """`threads=True` (a dispatch thread per device; interleaved: 2 chunks a device): bitwise
  the one-thread outputs, losses, grads, input grads and params over 2 SGD steps with
  dropout, the same key counters, each hooked layer's events in the same order (run on its
  device's thread)."""
  make_order, per_rank, fuse, delay_wgrad = THREAD_CASES[case]
  devices, microbatches = devices_for(2)[:2], 4
  sizes = [3, 3] if per_rank == 1 else [2, 1, 1, 2]
  chunk_devices = [devices[c % 2] for c in range(len(sizes))]
  layer_devices = [d for d, size in zip(chunk_devices, sizes) for _ in range(size)]
  params = [jax.device_put(init_mlp(k, WIDTH, 2 * WIDTH), d)
            for k, d in zip(jax.random.split(jax.random.key(0), 6), layer_devices)]
  inputs, targets = make_batches(microbatches)
  order = schedule.merge_ranks([make_order(microbatches, pipeline_parallel_size=2, rank=r)
                                for r in range(2)])
  log: list[tuple[Any, ...]] = []

  def record(kind: str):
    return lambda event: log.append((event.index, kind, event.microbatch,
                                     threading.current_thread().name))

  hooks = jg.Hooks(pre_forward=[record("fpre")], forward=[record("fwd")],
                   pre_backward=[record("bpre")], backward=[record("bwd")])
  layers = jg.make_graphed(
      [dropout_mlp] * 6, [hooks, None, None, None, None, hooks], rng=True,
      sample_args=[(p, jax.device_put(inputs[0], d)) for p, d in zip(params, layer_devices)],
      num_warmup_iters=0, delay_wgrad=delay_wgrad)

  def train(threads: bool) -> tuple[Any, ...]:
    for layer in layers:
      layer.seed(jax.random.key(7))
    log.clear()
    pipeline = schedule.Pipeline(split(layers, sizes), order, loss_fn=loss_fn,
                                 devices=chunk_devices, fuse=fuse, threads=threads)
    weights, results = split(params, sizes), []
    for _ in range(2):
      results.append(pipeline(weights, inputs, targets))
      weights = [[sgd(p, g) for p, g in zip(ps, gs)]
                 for ps, gs in zip(weights, results[-1].grads)]
    per_layer = {i: [e[1:3] for e in log if e[0] == i] for i in (0, 5)}
    return (results, weights, [layer.rng_counter for layer in layers], per_layer,
            {e[3] for e in log})

  threaded, single = train(True), train(False)
  for a, b in zip(threaded[0], single[0]):
    for field in ("outputs", "losses", "grads", "input_grads"):
      assert_trees_equal(getattr(a, field), getattr(b, field))
  assert_trees_equal(threaded[1], single[1])
  assert threaded[2] == single[2] == [2 * microbatches] * 6
  assert threaded[3] == single[3] and len(threaded[3][5]) == 2 * 4 * microbatches
  assert single[4] == {threading.current_thread().name}
  # The hooked layers' chunks: the first on devices[0]'s thread, the last on devices[1]'s.
  assert threaded[4] == {f"jaxgraph Pipeline {d}" for d in devices}


@pytest.mark.devices(2)
def test_threads_stop_on_a_worker_error_and_recover():
  """A hook raising in one device's thread mid-step (the other thread waiting on it): the
  error reaches the caller with its note, every worker is joined, no layer is left busy, and
  the next call runs (bitwise the one-thread call)."""
  devices, microbatches = devices_for(2)[:2], 4
  params = [jax.device_put(p, d) for p, d in zip(make_params(2), devices)]
  inputs, targets = make_batches(microbatches)
  order = schedule.merge_ranks([schedule.one_f_one_b(microbatches, pipeline_parallel_size=2,
                                                     rank=r) for r in range(2)])
  armed = [False]

  def fail(event: jg.HookEvent) -> None:
    if armed[0] and event.microbatch == 2:
      raise RuntimeError("hook failed on purpose")

  layers = jg.make_graphed(
      [block, block], [None, jg.Hooks(forward=[fail])], num_warmup_iters=0,
      sample_args=[(p, jax.device_put(inputs[0], d)) for p, d in zip(params, devices)])
  chunks, weights = [[layer] for layer in layers], [[p] for p in params]
  threaded = schedule.Pipeline(chunks, order, loss_fn=loss_fn, devices=devices, threads=True)
  single = schedule.Pipeline(chunks, order, loss_fn=loss_fn, devices=devices)
  threaded(weights, inputs, targets)
  assert len(threaded.thread_seconds) == 2 and all(s > 0 for s in threaded.thread_seconds)
  before = threading.active_count()
  armed[0] = True
  with pytest.raises(RuntimeError, match="hook failed on purpose") as info:
    threaded(weights, inputs, targets)
  assert any("dispatch thread" in note for note in info.value.__notes__)
  assert threading.active_count() == before
  assert not any(layer._busy.locked() for layer in layers)
  armed[0] = False
  after, reference = threaded(weights, inputs, targets), single(weights, inputs, targets)
  assert_trees_equal(after.grads, reference.grads)
  assert_trees_equal(after.losses, reference.losses)


@pytest.mark.devices(2)
def test_threads_refuse_a_layer_on_two_devices():
  """A layer in chunks on two devices would be called by two dispatch threads at once; on
  one device its thread calls it in order, as without threads."""
  layers, devices = _graph([1, 2, -2, -1]), devices_for(2)[:2]
  with pytest.raises(ValueError, match=r"is in chunk 1 on .* and in chunk 2 on .* threads=False"):
    schedule.Pipeline([[layers[0]], [layers[0]]], [1, 2, -2, -1], loss_fn=loss_fn,
                      devices=devices, threads=True)
  schedule.Pipeline([[layers[0]], [layers[0]]], [1, 2, -2, -1], loss_fn=loss_fn,
                    devices=[devices[0]] * 2, threads=True)


def test_fuse_refuses_bad_values():
  layers = _graphed_chunks(2, False)
  for bad in (0, 1.5, "2"):
    with pytest.raises(TypeError, match="fuse= a bool, or an int >= 1"):
      schedule.Pipeline([[layer] for layer in layers], [1, 2, -2, -1], loss_fn=loss_fn,
                        fuse=bad)


# ------------------------------------------------------------------------ property tests


@st.composite
def valid_orders(draw: Any, wgrad: bool) -> list[float]:
  """A random topological order of the forward/backward(/wgrad) dependency graph."""
  chunks = draw(st.integers(1, 3))
  microbatches = draw(st.integers(1, 3))
  done = {kind: [0] * chunks for kind in ("f", "b", "w")}
  order: list[float] = []
  while True:
    ready: list[float] = []
    for c in range(chunks):
      if done["f"][c] < microbatches and (c == 0 or done["f"][c - 1] > done["f"][c]):
        ready.append(c + 1)
      if done["b"][c] < done["f"][c] and (c == chunks - 1 or done["b"][c + 1] > done["b"][c]):
        ready.append(-(c + 1))
      if wgrad and done["w"][c] < done["b"][c]:
        ready.append(-(c + 1) - 0.5)
    if not ready:
      return order
    entry = draw(st.sampled_from(ready))
    kind = "f" if entry > 0 else "b" if float(entry).is_integer() else "w"
    done[kind][int(abs(entry) - (0.5 if kind == "w" else 0)) - 1] += 1
    order.append(entry)


@functools.cache
def _graphed_chunks(chunks: int, delay_wgrad: bool) -> tuple[jg.GraphedCallable, ...]:
  return jg.make_graphed([block] * chunks, delay_wgrad=delay_wgrad, num_warmup_iters=0,
                         sample_args=[(p, jnp.ones((BATCH, WIDTH))) for p in make_params(chunks)])


@settings(max_examples=12, derandomize=True, deadline=None)
@given(order=st.booleans().flatmap(lambda w: valid_orders(w).map(lambda o: (w, o))))
def test_random_valid_orders_match_unscheduled(order):
  wgrad, order = order
  plan = schedule.parse_order(order, delay_wgrad=True)
  chunks, microbatches = plan.num_chunks, plan.num_microbatches
  params = make_params(chunks)
  inputs, targets = make_batches(microbatches)
  layers = _graphed_chunks(chunks, wgrad)
  result = schedule.Pipeline([[layer] for layer in layers], order, loss_fn=loss_fn)(
      [[p] for p in params], inputs, targets)
  outputs, grads = reference_step(_graphed_chunks(chunks, False), params, inputs, targets)
  assert_trees_equal(result.outputs, outputs)
  assert_trees_equal(flat(result.grads), grads)


@settings(max_examples=4, derandomize=True, deadline=None)
@given(order=valid_orders(wgrad=True))
def test_random_valid_orders_capture_once(order):
  plan = schedule.parse_order(order, delay_wgrad=True)
  layers = jg.make_graphed([block] * plan.num_chunks, order=order, delay_wgrad=True,
                           num_warmup_iters=1,
                           sample_args=[(p, jnp.ones((BATCH, WIDTH)))
                                        for p in make_params(plan.num_chunks)])
  assert sum(layer.stats.captures for layer in layers) == 1
  assert sum(layer.stats.cache_hits for layer in layers) == plan.num_chunks - 1


_ERRORS = {
    "drop": (ValueError, "dimension mismatch|doesn't match number of dgrad"),
    "float_forward": (TypeError, "forward entries must be ints"),
    "off_by_third": (ValueError, "must be 0.5"),
    "swap": (ValueError, "runs before"),
    "wgrad_without_delay": (ValueError, "delay_wgrad=True"),
}


@settings(max_examples=30, derandomize=True, deadline=None)
@given(data=st.data(), mutation=st.sampled_from(sorted(_ERRORS)))
def test_random_invalid_orders_raise_documented_errors(data, mutation):
  order = data.draw(valid_orders(wgrad=mutation != "wgrad_without_delay"))
  delay = mutation != "wgrad_without_delay"
  if mutation == "drop":
    del order[data.draw(st.integers(0, len(order) - 1))]
  elif mutation == "float_forward":
    forwards = [i for i, e in enumerate(order) if e > 0]
    order[data.draw(st.sampled_from(forwards))] += 0.0
  elif mutation == "off_by_third":
    backwards = [i for i, e in enumerate(order) if e < 0]
    order[data.draw(st.sampled_from(backwards))] -= 1 / 3
  elif mutation == "swap":
    # Move a backward or wgrad entry before its own forward: first entry of its chunk's kind.
    i = data.draw(st.sampled_from([i for i, e in enumerate(order) if e < 0]))
    entry = order.pop(i)
    chunk = int(abs(entry) - (0 if float(entry).is_integer() else 0.5))
    first_forward = order.index(chunk)
    order.insert(first_forward, entry)
  else:
    order.insert(data.draw(st.integers(0, len(order))), -1.5)
  error, match = _ERRORS[mutation]
  with pytest.raises(error, match=match):
    schedule.parse_order(order, delay_wgrad=delay)
