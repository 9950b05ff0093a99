"""jg.flat: layer params as one buffer per (group, dtype), bitwise equal to the pytree path."""

from __future__ import annotations

import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxgraph as jg
import jaxgraph.flax as jgf
from jaxgraph import flat, fsdp
from models import (counting, devices_for, init_mlp, mlp, optax_update, reference_stack,
                    trees_equal)

D, H, T, DEPTH, STEPS = 16, 32, 8, 4, 3
F32, BF16 = jnp.float32, jnp.bfloat16


def mixed_dropout_mlp(p: dict[str, jax.Array], x: jax.Array, *, key: jax.Array) -> jax.Array:
  """float32 and bfloat16 weights in one layer (two buffers), dropout from the key."""
  h = jnp.tanh(x @ p["w1"] + p["b1"].astype(F32))
  keep = jax.random.bernoulli(key, 0.8, h.shape)
  h = jnp.where(keep, h / 0.8, 0).astype(BF16)
  return x + (h @ p["w2"]).astype(F32) * p["scale"]


def _params(depth: int = DEPTH) -> list[dict[str, jax.Array]]:
  params = []
  for k in jax.random.split(jax.random.key(0), depth):
    k1, k2 = jax.random.split(k)
    params.append(dict(w1=jax.random.normal(k1, (D, H)) / D ** 0.5,
                       b1=jnp.full((H,), 0.1, BF16),
                       w2=(jax.random.normal(k2, (H, D)) / H ** 0.5).astype(BF16),
                       scale=jnp.ones((D,), F32)))
  return params


def _decay(path: tuple, leaf: jax.Array) -> str:
  return "decay" if leaf.ndim > 1 else "no_decay"


def _x() -> jax.Array:
  return jax.random.normal(jax.random.key(1), (T, D))


def _keys(step: int) -> list[jax.Array]:
  return [jax.random.fold_in(jax.random.key(10 + step), i) for i in range(DEPTH)]



def test_ravel_splits_by_dtype_and_group_and_unravels():
  p = _params(1)[0]
  tree = flat.ravel(p)
  assert [b.name for b in tree.layout.buffers] == ["bfloat16", "float32"]  # b1 comes first
  assert [b.shape for b in tree.buffers] == [(H + H * D,), (D * H + D,)]
  assert [leaf.dtype for leaf in jax.tree.leaves(tree)] == [BF16, F32]
  assert trees_equal(tree.unravel(), p)
  grouped = flat.ravel(p, group=_decay)
  assert [b.name for b in grouped.layout.buffers] == [
      "no_decay.bfloat16", "no_decay.float32", "decay.float32", "decay.bfloat16"]
  assert trees_equal(grouped.unravel(), p)
  assert [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]] \
      == ["['bfloat16']", "['float32']"]
  # The layout is static and compared by value: equal trees give equal structures.
  other = flat.ravel(_params(2)[1])
  assert jax.tree.structure(other) == jax.tree.structure(tree)
  assert hash(other.layout) == hash(tree.layout)
  assert jax.tree.structure(grouped) != jax.tree.structure(tree)
  abstract = jax.eval_shape(flat.ravel, p)
  assert jax.tree.structure(abstract) == jax.tree.structure(tree)
  assert [b.shape for b in abstract.buffers] == [b.shape for b in tree.buffers]
  masked = flat.mask([grouped], lambda group: group == "decay")
  assert jax.tree.leaves(masked) == [False, False, True, True]


def test_split_puts_a_piece_of_every_leaf_in_each_chunk_and_round_trips():
  tree = {"a": jnp.arange(10.0).reshape(2, 5), "b": jnp.arange(3.0) + 100, "c": jnp.ones(9)}
  raveled = flat.ravel(tree)
  parts = flat.split(raveled, 4)
  (spec,) = parts.layout.buffers
  # pieces of ceil(size / 4): a 3, b 1, c 3; chunks of 7, the last piece of each leaf padded
  assert (spec.size, spec.length, spec.parts) == (22, 28, 4)
  chunks = np.asarray(parts.buffers[0]).reshape(4, 7)
  for key, slot in zip(sorted(tree), parts.layout.slots):
    piece = spec.piece(slot)
    padded = np.zeros(4 * piece)
    padded[:slot.size] = np.asarray(tree[key]).reshape(-1)
    assert np.array_equal(chunks[:, slot.offset:slot.offset + piece], padded.reshape(4, piece))
  assert trees_equal(parts.unravel(), tree)
  assert trees_equal(jax.jit(flat.FlatTree.unravel)(parts), tree)
  back = flat.split(parts, 1)  # one part again: ravel's layout and buffer
  assert back.layout == raveled.layout
  assert np.array_equal(back.buffers[0], raveled.buffers[0])
  assert flat.split(raveled, 4, min_size=23).layout == raveled.layout  # too small: as it was
  with pytest.raises(TypeError, match="flat.split takes a FlatTree"):
    flat.split(tree, 4)
  with pytest.raises(ValueError, match="parts must be >= 1"):
    flat.split(raveled, 0)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("fuse", [False, True])
def test_training_matches_pytree_path_and_jit_vjp_bitwise(optimizer, fuse):
  fn, traces = counting(mixed_dropout_mlp)
  params, x = _params(), _x()
  flat_params = [flat.ravel(p, group=_decay) for p in params]
  assert len(flat_params[0].buffers) == 4  # (decay | no_decay) x (float32 | bfloat16)
  if optimizer == "sgd":
    tx = flat_tx = optax.sgd(0.05)
  else:  # weight decay on matrices only: one mask per leaf, or one per flat buffer
    tx = optax.adamw(1e-2, weight_decay=0.5,
                     mask=lambda ps: jax.tree.map(lambda leaf: leaf.ndim > 1, ps))
    flat_tx = optax.adamw(1e-2, weight_decay=0.5,
                          mask=lambda ps: flat.mask(ps, lambda group: group == "decay"))
  flat_layers = jg.make_graphed([fn] * DEPTH, sample_args=[(p, x) for p in flat_params],
                                rng=True, num_warmup_iters=1)
  assert traces() == 1  # N identical layers: one trace, one compile
  assert [l.stats.captures for l in flat_layers] == [1, 0, 0, 0]
  tree_layers = jg.make_graphed([mixed_dropout_mlp] * DEPTH,
                                sample_args=[(p, x) for p in params], rng=True,
                                num_warmup_iters=1)
  update, flat_update = optax_update(tx), optax_update(flat_tx)
  ref_params, opt_state, ref_state = params, tx.init(params), tx.init(params)
  flat_state = flat_tx.init(flat_params)
  for step in range(STEPS):
    keys = _keys(step)
    y, pullback = jg.sequential_vjp(flat_layers, flat_params, x, keys=keys, fuse=fuse)
    ct = y / y.size
    flat_grads, g_x = pullback(ct)
    assert all(isinstance(g, flat.FlatTree) and g.layout == p.layout
               for g, p in zip(flat_grads, flat_params))
    y_tree, pullback = jg.sequential_vjp(tree_layers, params, x, keys=keys, fuse=fuse)
    grads, g_x_tree = pullback(ct)
    assert trees_equal(y, y_tree) and trees_equal(g_x, g_x_tree)
    assert trees_equal(flat.unravel(flat_grads), grads)
    if not fuse:  # fused: one executable per run of layers, XLA may round across layers
      y_ref, grads_ref, g_x_ref = reference_stack([mixed_dropout_mlp] * DEPTH, ref_params, x,
                                                  ct, keys)
      assert trees_equal(y, y_ref) and trees_equal(g_x, g_x_ref)
      assert trees_equal(grads, grads_ref)
      ref_params, ref_state = update(grads_ref, ref_state, ref_params)
    flat_params, flat_state = flat_update(flat_grads, flat_state, flat_params)
    params, opt_state = update(grads, opt_state, params)
    assert trees_equal(flat.unravel(flat_params), params)
  if not fuse:
    assert trees_equal(params, ref_params)
  # Replays never retrace; the fused run of DEPTH layers is traced once (fn DEPTH times).
  assert traces() == 1 + (DEPTH if fuse else 0)
  assert [l.stats.captures for l in flat_layers][1:] == [0] * (DEPTH - 1)


def test_slices_are_recomputed_not_kept_as_residuals(packing):
  params, x = _params(1)[0], _x()
  key = jax.random.key(0)
  tree_layer = jg.make_graphed(mixed_dropout_mlp, sample_args=(params, x), rng=True,
                               num_warmup_iters=0)
  flat_layer = jg.make_graphed(mixed_dropout_mlp, sample_args=(flat.ravel(params), x),
                               rng=True, num_warmup_iters=0)
  (tree_entry,), (flat_entry,) = tree_layer.executables.entries.values(), flat_layer.executables.entries.values()
  tree_layout, flat_layout = tree_entry.layout, flat_entry.layout
  # The backward reads the weights as slices of the flat inputs it already receives...
  assert {kind for kind, _ in flat_layout.sources} >= {"slice", "in"}
  assert set(flat_layout.needed_inputs) >= {0, 1}  # both buffers
  # ...so the forward keeps exactly what the pytree path keeps: no copy of a weight.
  assert flat_layout.packing.shapes == tree_layout.packing.shapes
  assert flat_layout.n_kept == tree_layout.n_kept
  weight_shapes = {leaf.shape for leaf in jax.tree.leaves(params)}
  assert not weight_shapes & set(flat_layout.packing.shapes)
  tree_fwd = tree_entry.forward["stream", True]
  flat_fwd = flat_entry.forward["stream", True]
  kept = lambda fwd, layout: fwd.out_info[layout.n_out:layout.n_out + layout.n_kept]
  assert ([(o.shape, o.dtype) for o in kept(flat_fwd, flat_layout)]
          == [(o.shape, o.dtype) for o in kept(tree_fwd, tree_layout)])
  # Memory: what a forward returns for its backward is the same number of bytes.
  assert (flat_fwd.memory_analysis().output_size_in_bytes
          == tree_fwd.memory_analysis().output_size_in_bytes)
  y, pullback = flat_layer.vjp(flat.ravel(params), x, key=key)
  y_tree, pullback_tree = tree_layer.vjp(params, x, key=key)
  assert trees_equal(y, y_tree)
  grads, g_x = pullback(jnp.ones_like(y))
  assert trees_equal((grads.unravel(), g_x), pullback_tree(jnp.ones_like(y)))


def test_delayed_wgrad_returns_flat_weight_grads():
  params, x = _params(1)[0], _x()
  key = jax.random.key(0)
  whole = jg.make_graphed(mixed_dropout_mlp, sample_args=(params, x), rng=True,
                          num_warmup_iters=0)
  split = jg.make_graphed(mixed_dropout_mlp, sample_args=(flat.ravel(params), x), rng=True,
                          num_warmup_iters=1, delay_wgrad=True)
  y, pullback = split.vjp(flat.ravel(params), x, key=key)
  none, g_x = pullback(jnp.ones_like(y))
  grads, _ = pullback.wgrad()
  y_ref, pullback_ref = whole.vjp(params, x, key=key)
  grads_ref, g_x_ref = pullback_ref(jnp.ones_like(y))
  assert none is None and isinstance(grads, flat.FlatTree)
  assert trees_equal((y, g_x, grads.unravel()), (y_ref, g_x_ref, grads_ref))


def test_traced_and_fallback_paths_unravel_too():
  params, x = _params(1)[0], _x()
  flat_params = flat.ravel(params)
  key = jax.random.key(0)
  layer = jg.make_graphed(mixed_dropout_mlp, sample_args=(flat_params, x), rng=True,
                          num_warmup_iters=0, max_captures=1)
  y, pullback = layer.vjp(flat_params, x, key=key)
  grads, _ = pullback(jnp.ones_like(y))
  # Under a user's jax.jit + jax.grad the original function runs on the unraveled params.
  traced = jax.jit(jax.grad(lambda p: jnp.sum(layer(p, x, key=key))))(flat_params)
  assert isinstance(traced, flat.FlatTree) and traced.layout == flat_params.layout
  for a, b in zip(traced.buffers, grads.buffers):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=1e-2, atol=1e-6)
  # Past max_captures: the jax.jit fallback, on the unraveled params as well.
  x2 = jnp.ones((T + 1, D))
  with pytest.warns(UserWarning, match="max_captures=1"):
    y2, pullback2 = layer.vjp(flat_params, x2, key=key)
  y2_ref, vjp_ref = jax.vjp(jax.jit(lambda p, x: mixed_dropout_mlp(p, x, key=key)), params, x2)
  assert trees_equal(y2, y2_ref) and layer.stats.fallbacks == 1
  grads2, _ = pullback2(jnp.ones_like(y2))
  assert isinstance(grads2, flat.FlatTree)
  assert trees_equal(grads2.unravel(), vjp_ref(jnp.ones_like(y2))[0])


def test_bad_input_errors():
  p = _params(1)[0]
  tree, other = flat.ravel(p), flat.ravel(p, group=_decay)
  with pytest.raises(ValueError, match=r"got 2 buffers for a layout of 4"):
    flat.FlatTree(tree.buffers, other.layout)
  with pytest.raises(ValueError, match=r"buffer 'float32' .* must be a float32\[528\] array, "
                                       r"got float32\[529\]"):
    flat.FlatTree((tree.buffers[0], jnp.zeros(529)), tree.layout)
  with pytest.raises(ValueError, match=r"must be a bfloat16\[544\] array, got bool"):
    flat.mask(tree, lambda group: True).unravel()
  with pytest.raises(TypeError, match=r"leaf \['n'\] is a str, not an array"):
    flat.ravel({"n": "name"})
  with pytest.raises(TypeError, match=r"PRNG key"):
    flat.ravel({"k": jax.random.key(0)})
  with pytest.raises(TypeError, match=r"group returned 1 for leaf \['b1'\]"):
    flat.ravel(p, group=lambda path, leaf: 1)
  with pytest.raises(TypeError, match=r"outside any FlatTree"):
    flat.mask(p, lambda group: True)
  # Two layouts do not mix: a layer captured for one rejects the other by name.
  layer = jg.make_graphed(mixed_dropout_mlp, sample_args=(tree, _x()), rng=True,
                          num_warmup_iters=0, on_new_signature="error")
  with pytest.raises(TypeError, match=r"different pytree structure.*FlatLayout\(4 leaves in "
                                      r"no_decay.bfloat16\[32\]"):
    layer(other, _x(), key=jax.random.key(0))
  with pytest.raises(ValueError, match="FlatTree"):  # JAX names the buffers that differ
    jax.tree.map(jnp.add, tree, other)


# --------------------------------------------------------------------------------- FSDP


def fsdp_block(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return x + (h @ p["w2"]) * (1 + p["s"].sum())


def fsdp_mixed(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  """`fsdp_block` with a bfloat16 weight: two dtype buffers."""
  h = jnp.tanh(x @ p["w1"] + p["b1"]).astype(BF16)
  return x + (h @ p["w2"]).astype(F32) * (1 + p["s"].sum())


def _fsdp_data(layers: int, w2_dtype: Any = np.float32):
  rng = np.random.default_rng(0)
  host = [dict(w1=(rng.standard_normal((32, 128)) / 32 ** 0.5).astype(np.float32),
               b1=np.full((128,), 0.1, np.float32),
               w2=(rng.standard_normal((128, 32)) / 128 ** 0.5).astype(w2_dtype),
               s=np.zeros((3,), np.float32)) for _ in range(layers)]
  mesh = fsdp.make_mesh(devices=devices_for(8)[:8])
  x, t = jax.device_put(tuple(rng.standard_normal((2, 32, 32)).astype(np.float32)),
                        fsdp.batch_sharding(mesh))
  return mesh, host, x, t


def _count(hlo: str, op: str) -> int:
  return len(re.findall(rf"\b{op}(-start)?\(", hlo))


def _padding(layout: flat.FlatLayout, buffer: int) -> np.ndarray:
  """Where buffer `buffer` of `layout` holds no leaf element (True): the zero padding."""
  spec = layout.buffers[buffer]
  padding = np.ones(spec.length, bool)
  chunk = spec.length // spec.parts
  for slot in (s for s in layout.slots if s.buffer == buffer):
    part, within = np.divmod(np.arange(slot.size), spec.piece(slot))
    padding[part * chunk + slot.offset + within] = False
  return padding


def _train_fsdp(mesh, params, layer_fn, x, t):
  layers = jg.make_graphed([layer_fn] * len(params), sample_args=[(p, x) for p in params],
                           num_warmup_iters=1, on_new_signature="error")
  tx = optax.adam(1e-2)
  update = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)), out_shardings=(fsdp.shardings(params, mesh, min_size=1), None))
  opt_state = jax.jit(tx.init)(params)
  loss_and_ct = jax.jit(jax.value_and_grad(lambda y: jnp.mean((y - t) ** 2)))
  losses = []
  for _ in range(STEPS):
    y, pullback = jg.sequential_vjp(layers, params, x)
    loss, ct = loss_and_ct(y)
    grads, _ = pullback(ct)
    for g, p in zip(grads, params):  # gradients come back sharded like their buffers
      assert [b.sharding for b in jax.tree.leaves(g)] == [b.sharding for b in jax.tree.leaves(p)]
    # One step in flight: XLA:CPU's collectives can hang under more (reliability.md).
    params, opt_state = jax.block_until_ready(update(grads, opt_state, params))
    losses.append(loss)
  return np.asarray(losses), params, layers


@pytest.mark.devices(8)
def test_fsdp_flat_buffers_train_like_the_pytree_fsdp_path_bitwise():
  mesh, host, x, t = _fsdp_data(2)
  batch = fsdp.batch_sharding(mesh)
  flat_params = fsdp.shard([flat.ravel(p, group=_decay) for p in host], mesh, min_size=1)
  # decay: w1 + w2 = 8192 elements; no_decay: b1 + s = 131 in 8 parts of 16 + 1 (s's
  # last piece padded): 136.
  assert [(b.name, b.size, b.length) for b in flat_params[0].layout.buffers] == [
      ("no_decay.float32", 131, 136), ("decay.float32", 8192, 8192)]
  assert all(b.sharding.spec == P("fsdp") for b in flat_params[0].buffers)
  assert trees_equal(jax.device_get(flat_params[0].unravel()), host[0])
  # The flat layer needs neither gather nor remat: the unravel gathers each buffer once and
  # the backward re-gathers and re-slices instead of keeping gathered weights.
  flat_fn = lambda p, x: jax.lax.with_sharding_constraint(fsdp_block(p, x), batch)
  tree_fn = fsdp.remat(lambda p, x: flat_fn(fsdp.gather(p, mesh), x))
  losses, params, layers = _train_fsdp(mesh, flat_params, flat_fn, x, t)
  tree_losses, tree_params, _ = _train_fsdp(mesh, fsdp.shard(host, mesh, min_size=1), tree_fn,
                                            x, t)
  assert losses[-1] < losses[0]
  assert np.array_equal(losses, tree_losses)
  for p, q in zip(params, tree_params):
    assert trees_equal(jax.device_get(p.unravel()), jax.device_get(q))
    assert not np.any(np.asarray(p.buffers[0])[_padding(p.layout, 0)])  # stays zero
  assert [g.stats.captures for g in layers] == [1, 0]
  (entry,) = layers[0].executables.entries.values()
  forward = entry.forward["explicit", True].as_text()
  backward = entry.backward["full"][0].as_text()
  assert _count(forward, "all-gather") == 2   # one per buffer, not one per weight
  # The backward re-gathers the buffer it reads (the matrices), not a kept copy; it needs no
  # bias, so the no_decay buffer is not even passed to it.
  assert _count(backward, "all-gather") == 1
  assert entry.layout.needed_inputs == (1, 2)  # the decay buffer and x
  kept = entry.forward["explicit", True].out_info[entry.layout.n_out:]
  weight_shapes = {w.shape for w in jax.tree.leaves(host[0])}
  assert not [o for o in kept if o.shape in weight_shapes and o.sharding.is_fully_replicated]


@pytest.mark.devices(8)
def test_fsdp_flat_mixed_dtypes_gather_one_buffer_per_dtype():
  mesh, host, x, _ = _fsdp_data(1, BF16)
  batch = fsdp.batch_sharding(mesh)
  params = fsdp.shard(flat.ravel(host[0]), mesh)
  # float32: b1 + s + w1 = 4227 elements in 8 parts of 16 + 1 + 512: 4232; bfloat16: w2 = 4096.
  assert [(b.name, b.size, b.length) for b in params.layout.buffers] == [
      ("float32", 4227, 4232), ("bfloat16", 4096, 4096)]
  layer = jg.make_graphed(lambda p, x: jax.lax.with_sharding_constraint(fsdp_mixed(p, x), batch),
                          sample_args=(params, x), num_warmup_iters=0)
  (entry,) = layer.executables.entries.values()
  assert _count(entry.forward["explicit", True].as_text(), "all-gather") == 2
  assert _count(entry.backward["full"][0].as_text(), "all-gather") == 2
  y, pullback = layer.vjp(params, x)
  grads, _ = pullback(jnp.ones_like(y))
  assert [g.sharding for g in grads.buffers] == [b.sharding for b in params.buffers]
  assert not np.any(np.asarray(grads.buffers[0])[_padding(params.layout, 0)])  # zero gradient
  y_ref, vjp_ref = jax.vjp(fsdp_mixed, host[0], np.asarray(x))
  # Op-by-op vs compiled bfloat16 (XLA may skip a rounding to bfloat16), and the batch sum
  # over 8 shards (all-reduce) vs one local sum: rounding only.
  np.testing.assert_allclose(y, y_ref, rtol=2e-2, atol=1e-2)
  for g, g_ref in zip(jax.tree.leaves(grads.unravel()),
                      jax.tree.leaves(vjp_ref(np.ones(y.shape, np.float32))[0])):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref, np.float32),
                               rtol=2e-2, atol=1e-5)


def bf16_block(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  """`fsdp_block` computing in bfloat16 (the weights cast to it), float32 params."""
  h = jnp.tanh(x.astype(BF16) @ p["w1"].astype(BF16) + p["b1"].astype(BF16))
  return x + (h @ p["w2"].astype(BF16)).astype(F32) * (1 + p["s"].sum())


def _whole_step_losses(params, layer_fn, x, t):
  """`_train_fsdp`'s training as one jax.jit of the step (FlatTree.unravel differentiated)."""
  tx = optax.adam(1e-2)
  opt_state = jax.jit(tx.init)(params)

  @jax.jit
  def step(params, opt_state):
    def loss(params):
      y = x
      for p in params:
        y = layer_fn(p.unravel(), y)
      return jnp.mean((y - t) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  losses = []
  for _ in range(STEPS):
    params, opt_state, value = jax.block_until_ready(step(params, opt_state))
    losses.append(value)
  return np.asarray(losses), params


@pytest.mark.devices(8)
def test_fsdp_gather_dtype_gathers_bf16_and_trains_as_the_whole_step():
  mesh, host, x, t = _fsdp_data(2)
  batch = fsdp.batch_sharding(mesh)
  layer_fn = lambda p, x: jax.lax.with_sharding_constraint(bf16_block(p, x), batch)
  raveled = [flat.ravel(p, group=_decay) for p in host]
  flat_params = fsdp.shard(raveled, mesh, min_size=1, gather_dtype=jnp.bfloat16)
  assert flat_params[0].layout.gather == flat.Gather(mesh, "fsdp", np.dtype(BF16))
  # The shard is cast before the collective: the program all-gathers bfloat16 (XLA:CPU then
  # runs its collectives in float32; on GPUs the all-gather moves bfloat16).
  lowered = jax.jit(lambda p: p.unravel()).lower(flat_params[0]).as_text()
  gathers = re.findall(r"all_gather.*\n?.*-> tensor<(\d+)x(\w+)>", lowered)
  assert sorted(gathers) == [("136", "bf16"), ("8192", "bf16")], gathers
  assert [leaf.dtype for leaf in jax.tree.leaves(flat_params[0].unravel())] == [BF16] * 4
  losses, params, layers = _train_fsdp(mesh, flat_params, layer_fn, x, t)
  assert losses[-1] < losses[0]
  assert [b.dtype for b in params[0].buffers] == [F32, F32]  # gradients in the params' dtype
  # The whole step, one jax.jit of the same layer functions (FlatTree.unravel differentiated
  # through the same gather and gradient): one program fuses across the layers and rounds
  # elsewhere, so it agrees to float32 rounding (6e-8 apart when measured, as with the
  # float32 gather and as before the split layout), not bitwise.
  whole_losses, whole_params = _whole_step_losses(flat_params, layer_fn, x, t)
  np.testing.assert_allclose(losses, whole_losses, rtol=1e-6)
  for p, q in zip(params, whole_params):
    for a, b in zip(p.buffers, q.buffers):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # Gathering in float32 computes the same layer (it casts to bfloat16 itself): the first
  # step's loss is bitwise; after that the programs differ where the bfloat16 casts sit
  # (XLA:CPU computes bfloat16 in float32 and rounds back at other points of the two
  # backwards: 9e-5 apart after 3 Adam steps when measured), bfloat16 rounding.
  f32_losses, _, _ = _train_fsdp(mesh, fsdp.shard(raveled, mesh, min_size=1), layer_fn, x, t)
  assert losses[0] == f32_losses[0]
  np.testing.assert_allclose(losses, f32_losses, rtol=1e-3)


@pytest.mark.devices(8)
def test_sharding_again_keeps_the_stored_float32_values_bitwise():
  """`split` re-lays a sharded tree from its buffers as stored, not from the bfloat16 leaves
  its gather hands out: sharding twice is sharding once."""
  mesh, host, _, _ = _fsdp_data(1)
  once = fsdp.shard(flat.ravel(host[0]), mesh, min_size=1, gather_dtype=BF16)
  twice = fsdp.shard(once, mesh, min_size=1, gather_dtype=BF16)
  assert twice.layout == once.layout
  for again, first in zip(twice.buffers, once.buffers):
    np.testing.assert_array_equal(again.view(np.uint32), first.view(np.uint32))
    assert again.sharding == first.sharding
  assert trees_equal(jax.device_get(flat.with_gather(twice, None).unravel()), host[0])
  assert flat.split(once, 8) is once  # already in 8 parts: nothing to re-lay
  # Into another number of parts (another mesh): the float32 values still.
  assert trees_equal(jax.device_get(flat.with_gather(flat.split(once, 4), None).unravel()),
                     host[0])


@pytest.mark.devices(8)
def test_gather_dtype_leaves_integer_buffers_exact():
  """`gather_dtype` casts the floating buffers only: an int32 leaf is gathered as int32."""
  mesh = fsdp.make_mesh(devices=devices_for(8)[:8])
  ints = jnp.arange(-1000, 1000, dtype=jnp.int32) * 4099  # more bits than bfloat16 holds
  tree = fsdp.shard(flat.ravel({"w": jnp.ones((32, 64)), "i": ints}), mesh,
                    gather_dtype=jnp.bfloat16)
  assert [(b.name, b.parts) for b in tree.layout.buffers] == [("int32", 8), ("float32", 8)]
  lowered = jax.jit(flat.FlatTree.unravel).lower(tree).as_text()
  gathers = re.findall(r"all_gather.*\n?.*-> tensor<(\d+)x(\w+)>", lowered)
  assert sorted(gathers) == [("2000", "i32"), ("2048", "bf16")], gathers
  out = jax.jit(flat.FlatTree.unravel)(tree)
  assert (out["i"].dtype, out["w"].dtype) == (jnp.int32, BF16)
  np.testing.assert_array_equal(out["i"], ints)


@pytest.mark.devices(8)
def test_forward_mode_autodiff_passes_the_gather():
  """jax.jvp, jax.jacfwd and Hessian-vector products through the gather of split buffers
  give what they give on the same buffers unraveled without it, bitwise; reverse mode
  still gathers each buffer once and reduces each leaf's gradient on its own."""
  mesh, host, x, _ = _fsdp_data(1)
  raveled = flat.ravel(host[0], group=_decay)
  sharded = fsdp.shard(raveled, mesh, min_size=1)
  local = flat.with_gather(sharded, None)  # the same buffers, unraveled by slicing
  tangent = jax.tree.map(lambda b: jnp.cos(b) + 0.5, sharded)
  unravel = jax.jit(lambda tree, t: jax.jvp(flat.FlatTree.unravel, (tree,), (t,)))
  values, tangents = unravel(sharded, tangent)
  assert trees_equal(values, local.unravel())
  assert trees_equal(tangents, flat.with_gather(tangent, None).unravel())
  bf16 = fsdp.shard(raveled, mesh, min_size=1, gather_dtype=BF16)
  _, bf16_tangents = unravel(bf16, flat.FlatTree(tangent.buffers, bf16.layout))
  assert trees_equal(bf16_tangents, jax.tree.map(lambda t: t.astype(BF16), tangents))

  def loss(tree: flat.FlatTree) -> jax.Array:
    return sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(tree.unravel()))

  hvp = jax.jit(lambda tree, t: jax.jvp(jax.grad(loss), (tree,), (t,))[1])
  product = hvp(sharded, tangent)
  assert trees_equal(product.buffers, hvp(local, flat.with_gather(tangent, None)).buffers)
  assert [b.sharding for b in product.buffers] == [b.sharding for b in sharded.buffers]
  scale = lambda tree: lambda b: flat.FlatTree([b, tree.buffers[1]], tree.layout).unravel()["s"]
  jacobian = jax.jacfwd(scale(sharded))(sharded.buffers[0])
  assert jacobian.shape == (3, 136)
  assert trees_equal(jacobian, jax.jacfwd(scale(local))(sharded.buffers[0]))
  # Reverse mode transposes the same derivative: the forward's one all-gather per buffer,
  # and the leaves' gradients reduced each on its own (reduce-scatters on GPUs; on CPU one
  # combined all-reduce of the leaves and slices), never the whole buffer.
  step = jax.jit(jax.grad(lambda tree, x: jnp.mean(fsdp_block(tree.unravel(), x) ** 2)))
  hlo = step.lower(sharded, x).compile().as_text()
  assert _count(hlo, "all-gather") == 2
  reductions = [line for line in hlo.splitlines()
                if re.search(r"\b(all-reduce|reduce-scatter)(-start)?\(", line)]
  assert reductions and not [line for line in reductions
                             if re.search(r"f32\[(136|8192)\]", line)], reductions
  grads = step(sharded, x)
  assert [g.sharding for g in grads.buffers] == [b.sharding for b in sharded.buffers]


@pytest.mark.devices(8)
def test_unravelling_buffers_moved_off_the_mesh_names_the_fix():
  mesh, host, _, _ = _fsdp_data(1)
  sharded = fsdp.shard(flat.ravel(host[0]), mesh, min_size=1)
  moved = jax.device_put(sharded, jax.devices()[0])  # e.g. gathered for generation
  with pytest.raises(ValueError, match=r"lies on 1 device\(s\), not on the 8 devices of the "
                                       r"mesh.*jg\.flat\.with_gather\(tree, None\)"):
    moved.unravel()
  assert trees_equal(jax.device_get(flat.with_gather(moved, None).unravel()), host[0])


# --------------------------------------------------------------------------------- Flax, Orbax


class Block(nnx.Module):

  def __init__(self, *, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.up = nnx.Linear(D, H, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.down = nnx.Linear(H, D, param_dtype=BF16, dtype=F32, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return x + self.down(self.drop(jax.nn.gelu(self.up(self.norm(x)))))


def test_nnx_block_through_flat_buffers_matches_the_state_path_bitwise():
  blocks = [Block(rngs=nnx.Rngs(params=i, dropout=1)) for i in range(2)]
  fns, states = zip(*(jgf.nnx_layer(block) for block in blocks))
  x = _x()
  flats = [flat.ravel(s, group=_decay) for s in states]
  flat_layers = jg.make_graphed(list(fns), sample_args=[(p, x) for p in flats], rng=True,
                                num_warmup_iters=1)
  state_layers = jg.make_graphed(list(fns), sample_args=[(p, x) for p in states], rng=True,
                                 num_warmup_iters=1)
  assert [l.stats.captures for l in flat_layers] == [1, 0]
  tx = optax.adamw(1e-2, mask=lambda ps: jax.tree.map(lambda leaf: leaf.ndim > 1, ps))
  flat_tx = optax.adamw(1e-2, mask=lambda ps: flat.mask(ps, lambda group: group == "decay"))
  update, flat_update = optax_update(tx), optax_update(flat_tx)
  states, opt_state, flat_state = list(states), tx.init(list(states)), flat_tx.init(flats)
  for step in range(STEPS):
    keys = _keys(step)[:2]
    y, pullback = jg.sequential_vjp(flat_layers, flats, x, keys=keys)
    flat_grads, _ = pullback(y)
    y_state, pullback = jg.sequential_vjp(state_layers, states, x, keys=keys)
    grads, _ = pullback(y_state)
    assert trees_equal(y, y_state)
    assert trees_equal(flat.unravel(flat_grads), grads)
    flats, flat_state = flat_update(flat_grads, flat_state, flats)
    states, opt_state = update(grads, opt_state, states)
  for block, p, s in zip(blocks, flats, states):
    nnx.update(block, p.unravel())  # write the trained params back into the module
    assert trees_equal(nnx.state(block, nnx.Param), s)


def test_orbax_saves_and_restores_flat_buffers(tmp_path):
  tree = flat.ravel(_params(1)[0], group=_decay)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "flat", tree)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / "flat", jax.eval_shape(lambda: tree))
  assert isinstance(restored, flat.FlatTree) and restored.layout == tree.layout
  assert trees_equal(restored, tree)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # orbax may warn about the missing target structure
    with ocp.StandardCheckpointer() as checkpointer:
      raw = checkpointer.restore(tmp_path / "flat")
  # Without a target the buffers come back by name: pair them with the layout again.
  again = flat.FlatTree([raw[b.name] for b in tree.layout.buffers], tree.layout)
  assert trees_equal(again.unravel(), tree.unravel())


def test_inference_only_unravels_flat_params():
  """A forward-only capture hands the layer its own pytree too, bitwise `jax.jit(fn)`."""
  params = init_mlp(jax.random.key(0), 16, 32)
  flat_params = jg.flat.ravel(params)
  x = jnp.ones((8, 16))
  layer = jg.make_graphed(mlp, sample_args=(flat_params, x), inference_only=True)
  assert trees_equal(layer(flat_params, x), jax.jit(mlp)(params, x))
  assert layer.stats.compiles == 1


def test_unravelling_a_float0_gradient_buffer_says_why():
  """An integer buffer's gradient is float0 (as jax.vjp gives): unravelling the gradient
  tree names that, not a layout mismatch."""
  tree = flat.ravel({"w": jnp.ones((3,)), "i": jnp.arange(2)})
  _, vjp = jax.vjp(lambda t: t.unravel()["w"] * 2, tree)
  (grads,) = vjp(jnp.ones((3,)))
  with pytest.raises(ValueError, match="float0 gradient"):
    grads.unravel()
