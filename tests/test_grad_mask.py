"""`make_graphed(..., grad_mask=...)`: gradients only where asked.

A LoRA-style block (a frozen base weight `w`, low-rank adapters `a`, `b`) with `w` left out:
the trainable leaves' gradients are bitwise those of the full backward and of `jax.vjp` under
`jax.jit`, over several steps; the backward executable has no matmul for `w`'s gradient; `w`
gets a float0 zero. Then the mask with every feature it meets: delay_wgrad, rng, offload,
sequential_vjp (fused or not), a pipeline order, flat buffers, the NNX adapter, the jax.jit
fallback and a user's transformation.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgraph as jg
from jaxgraph import _capture as capture_lib
from jaxgraph import offload as offload_lib
from jaxgraph import _pullback as pullback_lib
from jaxgraph import _constants as constants_lib
from jaxgraph import schedule
from models import assert_equal_or_close, trees_equal

D, R, T = 16, 4, 8


def lora_linear(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  return x @ p["w"] + (x @ p["a"]) @ p["b"]


def lora_block(p: dict[str, Any], x: jax.Array) -> jax.Array:
  return x + lora_linear(p["down"], jax.nn.gelu(lora_linear(p["up"], x)))


def dropout_lora_block(p: dict[str, Any], x: jax.Array, *, key: jax.Array) -> jax.Array:
  keep = jax.random.bernoulli(key, 0.9, x.shape)
  return lora_block(p, jnp.where(keep, x / 0.9, 0.0))


FROZEN = {"w": False, "a": True, "b": True}
PARAMS_MASK = {"up": FROZEN, "down": FROZEN}
MASK = (PARAMS_MASK, True)


def init(seed: int = 0) -> dict[str, Any]:
  k = jax.random.split(jax.random.key(seed), 6)

  def linear(kw, ka, kb, d_in, d_out):
    return {"w": jax.random.normal(kw, (d_in, d_out)) / np.sqrt(d_in),
            "a": jax.random.normal(ka, (d_in, R)) / np.sqrt(d_in),
            "b": jax.random.normal(kb, (R, d_out)) / np.sqrt(R)}

  return {"up": linear(*k[:3], D, 2 * D), "down": linear(*k[3:], 2 * D, D)}


X = jax.random.normal(jax.random.key(9), (T, D))
CT = jnp.cos(jnp.arange(T * D, dtype=jnp.float32)).reshape(T, D)


def trainable(grads: Any) -> list[Any]:
  """The leaves of the adapters (`a`, `b`) of a params tree, in order."""
  return [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(grads)
          if path[-1].key != "w"]


def is_float0(leaf: Any, shape: tuple[int, ...]) -> bool:
  return leaf.dtype == jax.dtypes.float0 and leaf.shape == shape


def sgd(p: Any, g: Any) -> Any:
  """One step on the adapters only (the frozen weights' gradients are float0, or unused)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, p, g: p if path[-1].key == "w" else p - 0.01 * g, p, g)


def _dot_generals(jaxpr: Any) -> int:
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  return sum((eqn.primitive.name == "dot_general")
             + sum(_dot_generals(sub) for sub in constants_lib.subjaxprs(eqn))
             for eqn in jaxpr.eqns)


def dots(layer: jg.GraphedCallable, kind: str = "full") -> int:
  """The matmuls of the backward executable `layer` replays, as handed to XLA (its jaxpr,
  traced again from the inputs the executable was compiled for): backend-independent,
  where the GPU's compiled HLO calls cuBLAS instead of `dot`."""
  (entry,) = layer.executables.entries.values()
  compiled, select = entry.backward["full" if kind == "full" else "dgrad"]
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
           for a in compiled.in_avals[0]]
  if kind == "full":
    return _dot_generals(jax.make_jaxpr(capture_lib._backward_fn(entry.layout, select,
                                                                 entry.moved))(*specs))
  dgrad, wgrad, reads, stash = capture_lib.split_backward(
      entry.layout, select, entry.backward["wgrad"][1], entry.moved, specs)
  if kind == "wgrad":
    dgrad, specs = wgrad, [specs[i] for i in reads] + [v.aval for v in stash]
  return _dot_generals(jax.make_jaxpr(dgrad)(*specs))


@pytest.fixture(autouse=True)
def float32_matmuls():
  """Every capture and reference here under float32 matmuls: on the GPU (TF32 by default) a
  masked and a full backward, two programs, would each round their matmuls to TF32 in their
  own kernels (2 of 64 elements 0.4% apart, measured on an H100). The CPU's are float32."""
  with jax.default_matmul_precision("highest"):
    yield


def close(a: Any, b: Any) -> None:
  """Bitwise on CPU. On GPU up to float32 rounding: a masked backward is another program than
  the full one (no dW matmul), autotuned and fused on its own."""
  assert_equal_or_close(a, b, gpu_rtol=1e-4, gpu_atol=1e-6,
                        why="the masked and the full backward are different programs, "
                            "fused and autotuned each on its own")


_ref_vjp = jax.jit(lambda p, x, ct: jax.vjp(lora_block, p, x)[1](ct))


def test_lora_block_trains_the_adapters_bitwise_over_steps():
  """Three SGD steps on the adapters: the masked backward's gradients of `a`, `b` and `x` are
  bitwise those of the full backward and of `jax.vjp` under `jax.jit`; `w` gets float0."""
  p = init()
  masked = jg.make_graphed(lora_block, sample_args=(p, X), grad_mask=MASK, num_warmup_iters=1)
  full = jg.make_graphed(lora_block, sample_args=(p, X), num_warmup_iters=1)
  for _ in range(3):
    y, pullback = masked.vjp(p, X)
    g_p, g_x = pullback(CT)
    y_full, pullback_full = full.vjp(p, X)
    g_full = pullback_full(CT)
    g_ref = _ref_vjp(p, X, CT)
    close(y, y_full)
    for name, shape in (("up", (D, 2 * D)), ("down", (2 * D, D))):
      assert is_float0(g_p[name]["w"], shape)
    close(trainable(g_p), trainable(g_full[0]))
    close(trainable(g_p), trainable(g_ref[0]))
    close(g_x, g_full[1])
    close(g_x, g_ref[1])
    p = sgd(p, g_p)
  assert masked.stats.captures == 1 and masked.stats.backward_replays == 3


def test_masked_backward_has_no_weight_gradient_matmul():
  """The backward executable computes nothing for a masked leaf: one matmul fewer per
  frozen weight (its dW), and no more residuals than the full backward keeps."""
  p = init()
  masked = jg.make_graphed(lora_block, sample_args=(p, X), grad_mask=MASK, num_warmup_iters=0)
  full = jg.make_graphed(lora_block, sample_args=(p, X), num_warmup_iters=0)
  # per LoRA linear, the full backward's matmuls: dW, dx through w, d(xa) through b, db,
  # da, dx through a
  assert dots(full) == 12
  assert dots(masked) == 10
  if jax.default_backend() == "cpu":  # the compiled HLO too (a GPU's calls cuBLAS instead)
    hlo = [next(iter(g.executables.entries.values())).backward["full"][0].as_text() for g in (full, masked)]
    assert [text.count(" dot(") for text in hlo] == [12, 10]
  assert masked.stats.residual_bytes <= full.stats.residual_bytes
  # Only x: the params' 8 matmuls of the full backward are gone (dx through w and through
  # the adapters are left, 2 per linear).
  x_only = jg.make_graphed(lora_block, sample_args=(p, X), grad_mask=(False, True),
                           num_warmup_iters=0)
  assert dots(x_only) == 6


def test_whole_arguments_and_a_function_of_the_arguments():
  """`(False, True)` masks a whole argument (argnums style); a callable mask gives what the
  tree it returns gives."""
  p = init()
  g_full = _ref_vjp(p, X, CT)
  whole = jg.make_graphed(lora_block, sample_args=(p, X), grad_mask=(False, True),
                          num_warmup_iters=0)
  g_p, g_x = whole.vjp(p, X)[1](CT)
  assert all(leaf.dtype == jax.dtypes.float0 for leaf in jax.tree.leaves(g_p))
  assert jax.tree.structure(g_p) == jax.tree.structure(p)
  close(g_x, g_full[1])
  seen = []

  def by_name(params, x):
    seen.append(type(x))
    return (jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key != "w", params),
            True)

  called = jg.make_graphed(lora_block, sample_args=(p, X), grad_mask=by_name,
                           num_warmup_iters=0)
  g_p, g_x = called.vjp(p, X)[1](CT)
  close(trainable(g_p), trainable(g_full[0]))
  close(g_x, g_full[1])
  assert dots(called) == 10
  assert set(seen) == {jax.ShapeDtypeStruct}  # checked and captured from abstract args


def test_delay_wgrad_defers_only_the_trainable_weights():
  p = init()
  g_ref = _ref_vjp(p, X, CT)
  layer = jg.make_graphed(lora_block, sample_args=(p, X), grad_mask=MASK, delay_wgrad=True,
                          num_warmup_iters=1)
  y, pullback = layer.vjp(p, X)
  g_p, g_x = pullback(CT)
  assert g_p is None
  close(g_x, g_ref[1])
  w_p, w_x = pullback.wgrad()
  assert w_x is None and is_float0(w_p["up"]["w"], (D, 2 * D))
  close(trainable(w_p), trainable(g_ref[0]))
  unmasked = jg.make_graphed(lora_block, sample_args=(p, X), delay_wgrad=True,
                            num_warmup_iters=0)
  # the wgrad (the weight products) lacks the two frozen weights' dW matmuls; the dgrad has
  # the same matmuls with and without the mask
  assert dots(unmasked, "wgrad") - dots(layer, "wgrad") == 2
  assert dots(unmasked, "dgrad") == dots(layer, "dgrad")


def test_rng_keys_thread_through_a_masked_backward():
  p = init()
  key = jax.random.key(3)
  layer = jg.make_graphed(dropout_lora_block, sample_args=(p, X), grad_mask=MASK, rng=True,
                          num_warmup_iters=1)
  g_p, g_x = layer.vjp(p, X, key=key)[1](CT)
  ref = jax.jit(lambda p, x, ct: jax.vjp(lambda p, x: dropout_lora_block(p, x, key=key),
                                         p, x)[1](ct))(p, X, CT)
  close(trainable(g_p), trainable(ref[0]))
  close(g_x, ref[1])
  assert is_float0(g_p["down"]["w"], (2 * D, D))


def _stack(depth: int = 3) -> tuple[list[Any], list[dict[str, Any]]]:
  return [lora_block] * depth, [init(seed) for seed in range(depth)]


def _train(layers, params, steps=2, fuse=False):
  """SGD on the adapters through `sequential_vjp`; every step's (y, grads, g_x)."""
  history = []
  for _ in range(steps):
    y, pullback = jg.sequential_vjp(layers, params, X, fuse=fuse)
    grads, g_x = pullback(CT)
    history.append((y, grads, g_x))
    params = [sgd(p, g) for p, g in zip(params, grads)]
  return history


@pytest.mark.parametrize("fuse", [False, True], ids=["per_layer", "fused"])
def test_sequential_vjp_with_a_mask_matches_the_full_backward(fuse):
  fns, params = _stack()
  samples = [(p, X) for p in params]
  masked = jg.make_graphed(fns, sample_args=samples, grad_mask=MASK, num_warmup_iters=0)
  full = jg.make_graphed(fns, sample_args=samples, num_warmup_iters=0)
  got, want = _train(masked, params, fuse=fuse), _train(full, params)
  for (y, grads, g_x), (y_ref, grads_ref, g_x_ref) in zip(got, want):
    close(y, y_ref)
    close(g_x, g_x_ref)
    close([trainable(g) for g in grads], [trainable(g) for g in grads_ref])
    assert all(is_float0(g["up"]["w"], (D, 2 * D)) for g in grads)
  if fuse:  # one fused backward for the stack, without the frozen weights' matmuls
    (segment,) = masked[0].config.segments.values()
    assert dots(segment) == 3 * 10


def test_a_mask_on_the_carried_input_is_refused_before_anything_runs():
  fns, params = _stack(2)
  layers = jg.make_graphed(fns, sample_args=[(p, X) for p in params],
                           grad_mask=(PARAMS_MASK, False), num_warmup_iters=0)
  before = [layer.stats for layer in layers]
  with pytest.raises(ValueError, match=r"sequential_vjp: the grad_mask of lora_block\[1\] "
                                       r"leaves out \(part of\) its input x[\s\S]*"
                                       r"grad_mask=\(params_mask, True, \.\.\.\)"):
    jg.sequential_vjp(layers, params, X)
  assert [layer.stats for layer in layers] == before
  # The first layer alone may leave its input out: it has no layer below.
  g_p, g_x = layers[0].vjp(params[0], X)[1](CT)
  assert is_float0(g_x, (T, D))


@pytest.mark.parametrize("mode", offload_lib.MODES)
def test_offload_with_a_mask_is_bitwise_the_mask_without_offload(mode):
  fns, params = _stack()
  samples = [(p, X) for p in params]
  plain = jg.make_graphed(fns, sample_args=samples, grad_mask=MASK, num_warmup_iters=0)
  offloaded = jg.make_graphed(fns, sample_args=samples, grad_mask=MASK, num_warmup_iters=0,
                              offload_residuals=True, offload_mode=mode)
  assert trees_equal(_train(offloaded, params), _train(plain, params))


def test_pipeline_order_with_a_mask():
  """Two chunks, two microbatches: the pipeline sums float0 gradients as float0 and the
  adapters' as the unscheduled stack does."""
  order = [1, 1, 2, -2, 2, -2, -1, -1]
  fns, params = _stack(2)
  inputs = [X, X * 0.5]
  targets = [jnp.zeros_like(X), jnp.ones_like(X)]
  layers = jg.make_graphed(fns, sample_args=[(p, X) for p in params], grad_mask=MASK,
                           order=order, num_warmup_iters=1)
  plain = jg.make_graphed(fns, sample_args=[(p, X) for p in params], grad_mask=MASK,
                          num_warmup_iters=0)
  loss = lambda y, t: jnp.mean((y - t) ** 2)
  pipeline = schedule.Pipeline([[layers[0]], [layers[1]]], order, loss_fn=loss)
  result = pipeline([[params[0]], [params[1]]], inputs, targets)
  totals: list[Any] = [None, None]
  for x, t in zip(inputs, targets):
    y, pullback = jg.sequential_vjp(plain, params, x)
    grads, _ = pullback(jax.grad(loss)(y, t))
    totals = [g if s is None else jax.tree.map(
        lambda a, b: a if a.dtype == jax.dtypes.float0 else a + b, s, g)
        for s, g in zip(totals, grads)]
  got = [result.grads[0][0], result.grads[1][0]]
  assert trees_equal([trainable(g) for g in got], [trainable(g) for g in totals])
  assert all(is_float0(g["down"]["w"], (2 * D, D)) for g in got)
  # The second chunk's input is the first chunk's output: it must keep its gradient.
  no_x = jg.make_graphed(fns, sample_args=[(p, X) for p in params], order=order,
                         grad_mask=(PARAMS_MASK, False), num_warmup_iters=0)
  with pytest.raises(ValueError, match=r"Pipeline: the grad_mask of lora_block\[1\] leaves "
                                       r"out \(part of\) its input x"):
    schedule.Pipeline([[no_x[0]], [no_x[1]]], order, loss_fn=loss)(
        [[params[0]], [params[1]]], inputs, targets)
  assert no_x[0].stats.replays == 0


def test_flat_buffers_masked_by_group():
  """A FlatTree raveled into a "frozen" and a "lora" buffer, masked with `jg.flat.mask`."""
  p = init()
  group = lambda path, leaf: "frozen" if path[-1].key == "w" else "lora"
  flat = jg.flat.ravel(p, group=group)
  mask = (jg.flat.mask(flat, lambda g: g == "lora"), True)
  masked = jg.make_graphed(lora_block, sample_args=(flat, X), grad_mask=mask,
                           num_warmup_iters=0)
  full = jg.make_graphed(lora_block, sample_args=(flat, X), num_warmup_iters=0)
  g_flat, g_x = masked.vjp(flat, X)[1](CT)
  g_ref, g_x_ref = full.vjp(flat, X)[1](CT)
  names = [spec.name for spec in flat.layout.buffers]
  frozen, lora = names.index("frozen.float32"), names.index("lora.float32")
  assert g_flat.buffers[frozen].dtype == jax.dtypes.float0
  close(g_flat.buffers[lora], g_ref.buffers[lora])
  close(g_x, g_x_ref)
  assert dots(masked) == 10


def test_nnx_lora_layer_masked_by_variable_type():
  """`nnx.LoRALinear` through `nnx_layer`, its base kernel and bias frozen with a mask built
  by `nnx.map_state`: the LoRA params' gradients are those of the full backward."""
  from flax import nnx

  module = nnx.LoRALinear(D, D, lora_rank=R, rngs=nnx.Rngs(0))
  fn, params = jg.flax.nnx_layer(module)
  mask = (nnx.map_state(lambda path, v: isinstance(v, nnx.LoRAParam), params), True)
  masked = jg.make_graphed(fn, sample_args=(params, X), grad_mask=mask, num_warmup_iters=0)
  full = jg.make_graphed(fn, sample_args=(params, X), num_warmup_iters=0)
  g, g_x = masked.vjp(params, X)[1](CT)
  g_ref, g_x_ref = full.vjp(params, X)[1](CT)
  assert g["kernel"][...].dtype == jax.dtypes.float0
  assert g["bias"][...].dtype == jax.dtypes.float0
  close(g["lora"], g_ref["lora"])
  close(g_x, g_x_ref)
  assert dots(masked) < dots(full)


def test_fallback_and_transformations_follow_the_mask():
  """Past max_captures (the jax.jit fallback) and under a user's jax.jit the mask holds
  too: float0 from `vjp`, and no gradient through a plain call under `jax.grad`."""
  p = init()
  layer = jg.make_graphed(lora_block, sample_args=(p, X), grad_mask=MASK, max_captures=1,
                          num_warmup_iters=0)
  x3 = X[:3]
  g_ref = _ref_vjp(p, x3, CT[:3])
  with pytest.warns(UserWarning, match="max_captures=1"):
    g_p, g_x = layer.vjp(p, x3)[1](CT[:3])
  assert layer.stats.fallbacks == 1
  assert is_float0(g_p["up"]["w"], (D, 2 * D))
  close(trainable(g_p), trainable(g_ref[0]))
  close(g_x, g_ref[1])
  traced = jax.jit(lambda p, x, ct: layer.vjp(p, x)[1](ct))(p, X, CT)
  assert is_float0(traced[0]["up"]["w"], (D, 2 * D))
  grads = jax.jit(jax.grad(lambda p: jnp.sum(layer(p, X) * CT)))(p)
  assert not np.any(grads["up"]["w"]) and not np.any(grads["down"]["w"])
  close(trainable(grads), trainable(_ref_vjp(p, X, CT)[0]))


# ------------------------------------------- the optimizer over the trainable part: partition


def adapters_only(tree: Any) -> dict[str, Any]:
  """The adapters of a params tree (or of its grads) as a tree of their own, without `w`."""
  return {name: {"a": part["a"], "b": part["b"]} for name, part in tree.items()}


def test_optax_adamw_trains_the_trainable_part_and_never_touches_the_frozen_one(
    caplog, monkeypatch):
  """`jg.partition` by the params' mask: AdamW (with weight decay and a global-norm clip)
  over the trainable part keeps moments for the adapters only, the float0 grads go with
  the frozen part, and `jg.combine` puts the params back together. Over three steps the
  base weights stay bitwise what they were (decay never reaches them) and the adapters
  are those of the same optimizer run on a tree of the adapters alone, with `jax.vjp`'s
  gradients. Before: the whole grads handed to `optax.adamw` fail inside Optax, after the
  first pullback said on the `jaxgraph` logger how to split them (once per process, and
  not after `jg.partition` ran)."""
  import optax

  monkeypatch.setattr(pullback_lib, "FROZEN_GRADS_KNOWN", threading.Event())  # unsaid yet
  caplog.set_level(logging.WARNING, logger="jaxgraph")
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.5))
  p = base = init()
  layer = jg.make_graphed(lora_block, sample_args=(p, X), grad_mask=MASK, num_warmup_iters=1)
  assert caplog.records == []  # the warmup's pullback says nothing
  g_p, _ = layer.vjp(p, X)[1](CT)
  (note,) = caplog.records
  assert note.getMessage().startswith(
      "lora_block[0]: its pullback returns float0 gradients (no values) for the 2 float "
      "leaf(s) grad_mask leaves out.")
  assert "grads, _ = jaxgraph.partition(grads, mask)" in note.getMessage()
  with pytest.raises(TypeError):  # Optax's own error, after the note
    optax.adamw(1e-2).update(g_p, optax.adamw(1e-2).init(p), p)
  trainable_part, frozen = jg.partition(p, PARAMS_MASK)
  opt_state = tx.init(trainable_part)
  assert len(jax.tree.leaves(opt_state)) == 1 + 2 * 4  # the count, mu and nu of a and b
  ref = adapters_only(p)
  ref_state = tx.init(ref)
  for step in range(3):
    if step:
      g_p, _ = layer.vjp(p, X)[1](CT)
    g_trainable, g_frozen = jg.partition(g_p, PARAMS_MASK)
    assert all(leaf.dtype == jax.dtypes.float0 for leaf in jax.tree.leaves(g_frozen))
    updates, opt_state = tx.update(g_trainable, opt_state, trainable_part)
    trainable_part = optax.apply_updates(trainable_part, updates)
    p = jg.combine(trainable_part, frozen)
    ref_params = {name: {**ref[name], "w": base[name]["w"]} for name in ref}
    ref_grads = adapters_only(_ref_vjp(ref_params, X, CT)[0])
    ref_updates, ref_state = tx.update(ref_grads, ref_state, ref)
    ref = optax.apply_updates(ref, ref_updates)
  assert jax.tree.structure(p) == jax.tree.structure(init())
  for name in ("up", "down"):
    assert np.array_equal(p[name]["w"], base[name]["w"])  # bitwise: never updated
  close(adapters_only(p), ref)
  assert not trees_equal(adapters_only(p), adapters_only(base))  # they trained
  assert caplog.records == [note]  # said once


def test_a_traced_or_fallback_masked_pullback_names_partition_and_an_unmasked_one_does_not(
    caplog, monkeypatch):
  """`masked_vjp` (a pullback under a user's transformation or through the jax.jit fallback)
  says the same once, for float leaves the mask leaves out; integer leaves (float0 under
  `jax.vjp` too), a mask that freezes nothing, and any pullback once `jg.partition` ran say
  nothing."""
  monkeypatch.setattr(pullback_lib, "FROZEN_GRADS_KNOWN", threading.Event())
  caplog.set_level(logging.WARNING, logger="jaxgraph")
  fn = lambda p, n, x: lora_linear(p, x) * n
  args = (init()["up"], jnp.int32(2), X)
  for grad_mask in ((True, True, True), ({"w": False, "a": True, "b": True}, True, True)):
    g_p, g_n, _ = pullback_lib.masked_vjp(fn, args, grad_mask, name="f")[1](
        jnp.ones((T, 2 * D)))
    assert g_n.dtype == jax.dtypes.float0
  assert g_p["w"].dtype == jax.dtypes.float0
  (note,) = caplog.records
  assert note.getMessage().startswith("f: its pullback returns float0 gradients (no values) "
                                      "for the 1 float leaf(s) grad_mask leaves out.")
  pullback_lib.masked_vjp(fn, args, grad_mask, name="g")[1](jnp.ones((T, 2 * D)))
  assert caplog.records == [note]
  monkeypatch.setattr(pullback_lib, "FROZEN_GRADS_KNOWN", threading.Event())
  jg.partition(args[0], grad_mask[0])
  pullback_lib.masked_vjp(fn, args, grad_mask, name="h")[1](jnp.ones((T, 2 * D)))
  assert caplog.records == [note]


def test_partition_splits_flat_buffers_and_states_and_takes_a_mask_function():
  """A FlatTree splits by buffer (`jg.flat.mask`), also under `jax.jit` and with the mask
  given as a function of the tree; a prefix bool covers a whole subtree; `combine` gives
  the tree back."""
  p = init()
  flat = jg.flat.ravel(p, group=lambda path, leaf: "frozen" if path[-1].key == "w" else "lora")
  by_group = lambda tree: jg.flat.mask(tree, lambda group: group == "lora")
  trainable_part, frozen = jax.jit(lambda t: jg.partition(t, by_group))(flat)
  names = [spec.name for spec in flat.layout.buffers]
  assert [b is None for b in trainable_part.buffers] == [n == "frozen.float32" for n in names]
  assert [b is None for b in frozen.buffers] == [n == "lora.float32" for n in names]
  assert trees_equal(jg.combine(trainable_part, frozen), flat)
  up_only, rest = jg.partition(p, {"up": True, "down": False})
  assert up_only["down"] == {"a": None, "b": None, "w": None}
  assert trees_equal(jg.combine(up_only, rest), p)


def test_partition_and_combine_name_a_mask_or_parts_that_do_not_fit():
  p = init()
  with pytest.raises(TypeError, match=r"partition: the mask must hold bools .* got 1"):
    jg.partition(p, {"up": 1, "down": True})
  with pytest.raises(ValueError, match="partition: the mask does not fit the tree: it must be "
                                       "a pytree prefix of it"):
    jg.partition(p, {"up": True})
  with pytest.raises(ValueError, match="combine: the parts do not share one structure"):
    jg.combine(jg.partition(p, PARAMS_MASK)[0], {"up": None})
