"""Flax adapters: NNX and Linen layers graphed per block train like the Flax model itself."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxgraph as jg
import jaxgraph.flax as jgf
from models import optax_update, trees_equal

D, H, T, DEPTH, STEPS = 8, 16, 6, 3, 3
ROOT = pathlib.Path(__file__).resolve().parents[1]


class Block(nnx.Module):
  """A pre-norm residual MLP block with a stored dropout stream."""

  def __init__(self, d: int, h: int, *, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, h, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.down = nnx.Linear(h, d, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return x + self.down(self.drop(jax.nn.gelu(self.up(self.norm(x)))))


class Model(nnx.Module):

  def __init__(self, *, rngs: nnx.Rngs):
    self.blocks = nnx.List([Block(D, H, rngs=rngs) for _ in range(DEPTH)])

  def __call__(self, x: jax.Array) -> jax.Array:
    for block in self.blocks:
      x = block(x)
    return x


def _loss(y: jax.Array, target: jax.Array) -> jax.Array:
  return jnp.mean((y - target) ** 2)


_loss_and_ct = jax.jit(jax.value_and_grad(_loss))


def _data() -> tuple[jax.Array, jax.Array]:
  kx, kt = jax.random.split(jax.random.key(7))
  return jax.random.normal(kx, (T, D)), jax.random.normal(kt, (T, D))


def _keys(step: int) -> list[jax.Array]:
  return [jax.random.fold_in(jax.random.key(step), i) for i in range(DEPTH)]


def _model() -> Model:
  return Model(rngs=nnx.Rngs(params=0, dropout=1))


@nnx.jit
def _nnx_update(model: nnx.Module, optimizer: nnx.Optimizer, grads: nnx.State) -> None:
  # Jitted like the optax update it is compared with: eager op-by-op Adam rounds differently.
  optimizer.update(model, grads)


def _reference_losses(tx: optax.GradientTransformation) -> tuple[list[jax.Array], nnx.State]:
  """Plain Flax with the per-layer structure: `nnx.jit` per block forward and backward
  (the backward recomputes the forward under `nnx.grad`), blocks reseeded with the same keys.

  A whole-step `nnx.jit` is not the reference: XLA fuses the loss into the last block and
  may round a reduction differently (1 ulp), while each layer's own math is the same.
  """
  model = _model()
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x, target = _data()

  @nnx.jit
  def forward(block, x, key):
    nnx.reseed(block, dropout=key)
    return block(x)

  @nnx.jit
  def backward(block, x, key, ct):
    nnx.reseed(block, dropout=key)
    return nnx.grad(lambda block, x: jnp.vdot(block(x), ct), argnums=(0, 1))(block, x)

  losses = []
  for step in range(STEPS):
    inputs, h = [], x
    for block, key in zip(model.blocks, _keys(step)):
      inputs.append(h)
      h = forward(block, h, key)
    loss, ct = _loss_and_ct(h, target)
    grads = [None] * DEPTH
    for i in reversed(range(DEPTH)):
      grads[i], ct = backward(model.blocks[i], inputs[i], _keys(step)[i], ct)
    _nnx_update(model, optimizer, jgf.join_states(model, list(model.blocks), grads))
    losses.append(loss)
  return losses, nnx.state(model, nnx.Param)



def test_nnx_blocks_train_like_nnx_bitwise():
  tx = optax.adamw(1e-2)
  x, target = _data()
  ref_losses, ref_params = _reference_losses(tx)
  models = {"optax": _model(), "nnx.Optimizer": _model()}
  fns, params = zip(*(jgf.nnx_layer(block) for block in models["optax"].blocks))
  layers = jg.make_graphed(list(fns), sample_args=[(p, x) for p in params], rng=True,
                           num_warmup_iters=1)
  assert layers[0].stats.captures == 1 and layers[1].stats.cache_hits == 1  # compiled once
  for optimizer, model in models.items():
    blocks = list(model.blocks)
    params = [jgf.nnx_layer(block)[1] for block in blocks]
    if optimizer == "optax":    # optax on the list of per-layer states, written back at the end
      update, opt_state = optax_update(tx), tx.init(params)
    else:                       # one nnx.Optimizer of the whole model, fed joined grads
      nnx_optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    losses = []
    for step in range(STEPS):
      y, pullback = jg.sequential_vjp(layers, params, x, keys=_keys(step))
      loss, ct = _loss_and_ct(y, target)
      grads, _ = pullback(ct)
      if optimizer == "optax":
        params, opt_state = update(grads, opt_state, params)
      else:
        _nnx_update(model, nnx_optimizer, jgf.join_states(model, blocks, grads))
        params = [nnx.state(block, nnx.Param) for block in blocks]
      losses.append(loss)
    if optimizer == "optax":
      nnx.update(model, jgf.join_states(model, blocks, params))
    assert losses[-1] < losses[0]
    assert trees_equal(losses, ref_losses), optimizer
    assert trees_equal(nnx.state(model, nnx.Param), ref_params), optimizer


def test_nnx_key_reseeds_like_nnx_and_changes_the_mask():
  block = Block(D, H, rngs=nnx.Rngs(params=0, dropout=1))
  fn, params = jgf.nnx_layer(block)
  assert fn.stream_tags == ("dropout",)
  x, _ = _data()
  layer = jg.make_graphed(fn, sample_args=(params, x), rng=True, num_warmup_iters=0)
  key = jax.random.key(3)
  nnx.reseed(block, dropout=key)
  assert np.array_equal(layer(params, x, key=key), nnx.jit(lambda block, x: block(x))(block, x))
  assert not np.array_equal(layer(params, x, key=key), layer(params, x, key=jax.random.key(4)))
  stream = [layer(params, x) for _ in range(2)]  # the layer's own stream: fresh masks
  assert not np.array_equal(*stream)
  with pytest.warns(UserWarning, match="same dropout mask"):  # no key: a frozen stored key
    jg.make_graphed(fn, sample_args=(params, x), num_warmup_iters=0)


def test_nnx_call_time_rngs_argument():

  class CallTimeBlock(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
      self.lin = nnx.Linear(D, D, rngs=rngs)
      self.drop = nnx.Dropout(0.5)  # no stored stream

    def __call__(self, x: jax.Array, *, rngs: nnx.Rngs | None = None) -> jax.Array:
      return self.drop(self.lin(x), rngs=rngs)

  block = CallTimeBlock(rngs=nnx.Rngs(0))
  fn, params = jgf.nnx_layer(block, rngs_argument="rngs")
  assert fn.stream_tags == ()
  x, _ = _data()
  layer = jg.make_graphed(fn, sample_args=(params, x), rng=True, num_warmup_iters=0)
  key = jax.random.key(5)
  assert np.array_equal(layer(params, x, key=key), nnx.jit(
      lambda block, x, key: block(x, rngs=nnx.Rngs(key)))(block, x, key))


class TwoSiteBlock(nnx.Module):
  """Two dropout sites of one shape fed one input, as attention and MLP dropout of a block;
  `rngs` given at call time (`stored=False`) or held as streams (`stored=True`)."""

  def __init__(self, *, stored: bool, rngs: nnx.Rngs):
    self.lin = nnx.Linear(D, D, rngs=rngs)
    self.attn_drop = nnx.Dropout(0.5, rngs=rngs if stored else None)
    self.mlp_drop = nnx.Dropout(0.5, rngs=rngs if stored else None)

  def __call__(self, x: jax.Array, *,
               rngs: nnx.Rngs | None = None) -> tuple[jax.Array, jax.Array]:
    h = self.lin(x)
    return self.attn_drop(h, rngs=rngs), self.mlp_drop(h, rngs=rngs)


@pytest.mark.parametrize("stored", [False, True], ids=["rngs_argument", "stream_tags"])
def test_nnx_dropout_sites_sharing_rngs_get_independent_masks(stored):
  block = TwoSiteBlock(stored=stored, rngs=nnx.Rngs(params=0, dropout=1))
  fn, params = jgf.nnx_layer(block, rngs_argument=None if stored else "rngs")
  x, _ = _data()
  layer = jg.make_graphed(fn, sample_args=(params, x), rng=True, num_warmup_iters=1)
  reference_vjp = jax.jit(lambda p, x, k: jax.vjp(lambda p, x: fn(p, x, key=k), p, x))
  reference_pullback = jax.jit(lambda vjp_fn, ct: vjp_fn(ct))
  ref_params = params
  for step in range(STEPS):
    key = jax.random.key(10 + step)
    (attn, mlp), pullback = layer.vjp(params, x, key=key)
    assert not np.array_equal(attn == 0, mlp == 0), "the two sites drew the same mask"
    ref_out, ref_vjp_fn = reference_vjp(ref_params, x, key)
    ct = (jnp.ones_like(attn), 2 * jnp.ones_like(mlp))
    grads = pullback(ct)
    ref_grads = reference_pullback(ref_vjp_fn, ct)
    assert trees_equal((attn, mlp), ref_out)
    assert trees_equal(grads, ref_grads)  # the backward used the forward's masks
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads[0])
    ref_params = jax.tree.map(lambda p, g: p - 0.1 * g, ref_params, ref_grads[0])


def test_flax_is_an_attribute_after_import_jaxgraph():
  # A fresh interpreter: in this one, `import jaxgraph.flax` above already set the attribute.
  code = ("import sys, jaxgraph as jg\n"
          "assert 'flax' not in sys.modules, 'Flax is imported on first use only'\n"
          "assert jg.flax.nnx_layer is __import__('jaxgraph.flax').flax.nnx_layer\n"
          "assert 'flax' in jg.__all__ and 'flax' in dir(jg)\n")
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr


def test_nnx_identical_blocks_give_equal_functions_and_eval_differs():
  model = _model()
  fns = [jgf.nnx_layer(block)[0] for block in model.blocks]
  assert fns[0] == fns[1] and hash(fns[0]) == hash(fns[1])
  assert fns[0].__name__ == "Block"
  model.eval()
  assert jgf.nnx_layer(model.blocks[0])[0] != fns[0]  # deterministic is part of the structure


def test_nnx_non_param_state_is_rejected():
  bn = nnx.BatchNorm(D, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"mean \(BatchStat\).*wrt="):
    jgf.nnx_layer(bn)


def test_join_states_rejects_foreign_parts():
  model = _model()
  stranger = Block(D, H, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"parts\[0\] \(Block\) is not a submodule"):
    jgf.join_states(model, [stranger], [nnx.state(stranger, nnx.Param)])


class LinenBlock(nn.Module):
  h: int

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    y = jax.nn.gelu(nn.Dense(self.h)(nn.LayerNorm()(x)))
    return x + nn.Dense(x.shape[-1])(nn.Dropout(0.25, deterministic=not train)(y))


def test_linen_blocks_train_like_linen_bitwise():
  module = LinenBlock(H)
  x, target = _data()
  variables = [module.init(jax.random.key(i), x, train=False) for i in range(DEPTH)]
  fns, params = zip(*(jgf.linen_layer(module, v, train=True) for v in variables))
  assert fns[0] == fns[1]
  layers = jg.make_graphed(list(fns), sample_args=[(p, x) for p in params], rng=True,
                           num_warmup_iters=1)
  assert layers[0].stats.captures == 1 and layers[2].stats.cache_hits == 1
  tx = optax.adamw(1e-2)
  update = optax_update(tx)
  forward = jax.jit(lambda p, x, k: jax.vjp(
      lambda p, x: module.apply({"params": p}, x, train=True, rngs={"dropout": k}), p, x))
  backward = jax.jit(lambda vjp_fn, ct: vjp_fn(ct))
  params, ref_params = list(params), list(params)
  opt_state = ref_state = tx.init(params)
  losses, ref_losses = [], []
  for step in range(STEPS):
    y, pullback = jg.sequential_vjp(layers, params, x, keys=_keys(step))
    loss, ct = _loss_and_ct(y, target)
    grads, _ = pullback(ct)
    params, opt_state = update(grads, opt_state, params)
    losses.append(loss)
    h, pullbacks = x, []
    for p, key in zip(ref_params, _keys(step)):
      h, vjp_fn = forward(p, h, key)
      pullbacks.append(vjp_fn)
    ref_loss, ct = _loss_and_ct(h, target)
    ref_grads = [None] * DEPTH
    for i in reversed(range(DEPTH)):
      ref_grads[i], ct = backward(pullbacks[i], ct)
    ref_params, ref_state = update(ref_grads, ref_state, ref_params)
    ref_losses.append(ref_loss)
  assert losses[-1] < losses[0]
  assert trees_equal(losses, ref_losses)
  assert trees_equal(params, ref_params)


def test_linen_rejects_mutable_collections_and_unhashable_kwargs():
  module = nn.BatchNorm(use_running_average=False)
  x, _ = _data()
  variables = module.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"\['batch_stats'\]"):
    jgf.linen_layer(module, variables)
  dense = nn.Dense(D)
  with pytest.raises(TypeError, match="hashable"):
    jgf.linen_layer(dense, dense.init(jax.random.key(0), x), scale=jnp.ones(3))
