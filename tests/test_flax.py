"""Flax adapters: NNX and Linen layers graphed per block train like the Flax model itself."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import flax
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


# Named and bound Linen blocks, mutable collections (KV cache, batch_stats), NNX state.


class LinenStack(nn.Module):
  """Blocks as submodules of a parent, as a Linen model holds them."""

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    for i in range(DEPTH):
      x = LinenBlock(H, name=f"block_{i}")(x, train)
    return x


class LinenSetupStack(nn.Module):
  """The same with the blocks made in `setup`, so a bound model exposes them."""

  def setup(self):
    self.blocks = [LinenBlock(H) for _ in range(DEPTH)]

  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    for block in self.blocks:
      x = block(x, train)
    return x


def _named_blocks(x: jax.Array) -> tuple[list[nn.Module], list[dict]]:
  blocks = [LinenBlock(H, name=f"block_{i}") for i in range(DEPTH + 1)]
  return blocks, [b.init(jax.random.key(i), x, train=False) for i, b in enumerate(blocks)]


def _bound_blocks(x: jax.Array) -> tuple[list[nn.Module], list[dict]]:
  variables = LinenSetupStack().init(jax.random.key(0), x, train=False)
  bound = LinenSetupStack().bind(variables)
  return list(bound.blocks), [{"params": variables["params"][f"blocks_{i}"]}
                              for i in range(DEPTH)]


@pytest.mark.parametrize("make", [_named_blocks, _bound_blocks], ids=["named", "bound"])
def test_linen_named_or_bound_blocks_share_one_capture(make):
  x, _ = _data()
  blocks, variables = make(x)
  fns, params = zip(*(jgf.linen_layer(b, v, train=True) for b, v in zip(blocks, variables)))
  assert all(fn == fns[0] and hash(fn) == hash(fns[0]) for fn in fns)
  layers = jg.make_graphed(list(fns), sample_args=[(p, x) for p in params], rng=True,
                           num_warmup_iters=1)
  stats = [layer.stats for layer in layers]
  assert (stats[0].captures, stats[0].compiles) == (1, 2), stats[0]  # forward + backward
  assert all((s.captures, s.cache_hits, s.compiles) == (0, 1, 0) for s in stats[1:]), stats
  # The reference applies each block as the user holds it (named, or bound to its parent):
  # the name changes neither the math nor the dropout masks of a top-level apply.
  reference = [jax.jit(lambda p, x, k, b=b: jax.vjp(
      lambda p, x: b.apply({"params": p}, x, train=True, rngs={"dropout": k}), p, x))
               for b in blocks]
  backward = jax.jit(lambda vjp_fn, ct: vjp_fn(ct))
  for layer, p, ref, key in zip(layers, params, reference, _keys(0) + [jax.random.key(9)]):
    y, pullback = layer.vjp(p, x, key=key)
    ref_y, ref_vjp = ref(p, x, key)
    ct = jnp.cos(y)
    assert trees_equal(y, ref_y)
    assert trees_equal(pullback(ct), backward(ref_vjp, ct))
  # Replays with a given key compile that forward variant once, on the shared entry.
  assert [(s.captures, s.compiles) for s in (l.stats for l in layers[1:])] == [(0, 0)] * (len(layers) - 1)


def test_linen_graphed_block_dropout_differs_from_the_whole_model_at_one_key():
  # Documented: Linen folds the module path (block_0/...) into a submodule's dropout key.
  x, _ = _data()
  variables = LinenStack().init(jax.random.key(0), x, train=False)
  key = jax.random.key(5)
  whole = LinenStack().apply(variables, x, train=True, rngs={"dropout": key})
  h = x
  for i in range(DEPTH):
    h = LinenBlock(H).apply({"params": variables["params"][f"block_{i}"]}, h, train=True,
                            rngs={"dropout": key})
  assert not np.array_equal(whole, h)
  fn, params = jgf.linen_layer(LinenBlock(H), {"params": variables["params"]["block_0"]},
                               train=True)
  assert np.array_equal(fn(params, x, key=key), LinenBlock(H, name="block_0").apply(
      {"params": variables["params"]["block_0"]}, x, train=True, rngs={"dropout": key}))


def test_linen_unhashable_module_field_is_named():

  class Widths(nn.Module):
    widths: list

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
      for w in self.widths:
        x = nn.Dense(w)(x)
      return x

  x, _ = _data()
  variables = Widths([H, D]).init(jax.random.key(0), x)
  # A list field is applied as the tuple Flax's clone makes of it: the layers share.
  listed, _ = jgf.linen_layer(Widths([H, D]), variables)
  assert listed == jgf.linen_layer(Widths((H, D)), variables)[0]

  class Scaled(nn.Module):
    scale: np.ndarray

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
      return nn.Dense(D)(x) * self.scale

  scaled = Scaled(np.ones(D))
  with pytest.raises(TypeError, match=r"the field Scaled\.scale \(ndarray\) of the module is "
                                      r"not hashable.*arrays go in as params or inputs"):
    jgf.linen_layer(scaled, scaled.init(jax.random.key(0), x))
  dense = nn.Dense(D)
  with pytest.raises(TypeError, match=r"apply_kwargs must be hashable.*scale \(ArrayImpl\)"):
    jgf.linen_layer(dense, dense.init(jax.random.key(0), x), scale=jnp.ones(3))


class CachedAttention(nn.Module):
  """Causal self-attention with an lm1b-style KV cache: with `decode`, each call writes its
  keys and values at `cache_index` and attends to every position written so far. A call
  holds several tokens (the prompt: prefill) or one. `init` creates the cache at the
  length of its input, without writing it (as flax's attention does)."""
  heads: int = 2

  @nn.compact
  def __call__(self, x: jax.Array, decode: bool) -> jax.Array:
    _, t, d = x.shape
    q, k, v = (nn.DenseGeneral((self.heads, d // self.heads), name=n)(x) for n in "qkv")
    q_pos = k_pos = jnp.arange(t)
    if decode:
      initialized = self.has_variable("cache", "cached_key")
      cached_k = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
      cached_v = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
      index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
      if initialized:
        i = index.value
        cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k, (0, i, 0, 0))
        cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v, (0, i, 0, 0))
        index.value = i + t
        k, v = cached_k.value, cached_v.value
        q_pos, k_pos = i + jnp.arange(t), jnp.arange(k.shape[1])
    mask = k_pos[None, :] <= q_pos[:, None]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
    weights = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    return nn.DenseGeneral(d, axis=(-2, -1), name="out")(
        jnp.einsum("bhqk,bkhd->bqhd", weights, v))


class DecoderBlock(nn.Module):
  @nn.compact
  def __call__(self, x: jax.Array, decode: bool = False) -> jax.Array:
    x = x + CachedAttention()(nn.LayerNorm()(x), decode)
    return x + nn.Dense(D)(jax.nn.gelu(nn.Dense(H)(nn.LayerNorm()(x))))


def test_linen_kv_cache_decode_loop_donates_the_cache_and_never_recompiles():
  batch, prompt_len, max_len, vocab, new_tokens = 2, 3, 8, 11, 4
  embed = jax.random.normal(jax.random.key(1), (vocab, D))
  blocks = [DecoderBlock(name=f"block_{i}") for i in range(DEPTH)]
  variables = [b.init(jax.random.key(i), jnp.ones((batch, max_len, D)), decode=True)
               for i, b in enumerate(blocks)]
  fns, params, caches = zip(*(jgf.linen_layer(b, v, mutable=("cache",), decode=True)
                              for b, v in zip(blocks, variables)))
  assert list(caches[0]) == ["cache"] and fns[0] == fns[1] and fns[0].mutable == ("cache",)
  prompt = jax.random.randint(jax.random.key(2), (batch, prompt_len), 0, vocab)
  layers = jg.make_graphed(list(fns), sample_args=[(p, c, embed[prompt])
                                                   for p, c in zip(params, caches)],
                           inference_only=True, donate_argnums=(1,))
  next_token = jax.jit(lambda h: jnp.argmax(h[:, -1] @ embed.T, axis=-1)[:, None])
  reference = [jax.jit(lambda p, c, x, b=b: b.apply({"params": p, **c}, x, decode=True,
                                                     mutable=["cache"])) for b in blocks]

  def decode(steps, caches):
    tokens, caches, compiles = prompt, list(caches), []
    for n in range(new_tokens):  # the prompt (prefill), then one token at a time
      h = embed[tokens if n == 0 else tokens[:, -1:]]
      for i, step in enumerate(steps):
        donated = caches[i]
        h, caches[i] = step(params[i], caches[i], h)
        if steps is layers:
          assert all(leaf.is_deleted() for leaf in jax.tree.leaves(donated))
      tokens = jnp.concatenate([tokens, next_token(h)], axis=1)
      compiles.append([layer.stats.compiles for layer in layers])
    return tokens, caches, compiles

  copy = lambda caches: jax.tree.map(jnp.copy, caches)
  tokens, final_caches, compiles = decode(layers, copy(caches))
  ref_tokens, ref_caches, _ = decode(reference, copy(caches))
  assert trees_equal(tokens, ref_tokens) and tokens.shape == (batch, prompt_len + new_tokens)
  assert trees_equal(final_caches, ref_caches)
  assert int(final_caches[0]["cache"]["CachedAttention_0"]["cache_index"]) == (
      prompt_len + new_tokens - 1)
  # One capture for the prefill, one for a token; the other blocks reuse them.
  assert [layer.stats.captures for layer in layers] == [2] + [0] * (DEPTH - 1)
  assert compiles[1] == compiles[-1], compiles  # the decode loop does not compile
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(caches))  # sample_args live


def test_linen_mutable_accepts_a_string_or_list_and_rejects_what_does_not_fit():
  x, _ = _data()
  block = DecoderBlock()
  variables = block.init(jax.random.key(0), x[None], decode=True)
  by_string, _, state = jgf.linen_layer(block, variables, mutable="cache", decode=True)
  by_list, _, _ = jgf.linen_layer(block, variables, mutable=["cache"], decode=True)
  assert by_string == by_list and by_string.mutable == ("cache",) and list(state) == ["cache"]
  with pytest.raises(TypeError, match=r"mutable=True.*mutable=\('cache',\)"):
    jgf.linen_layer(block, variables, mutable=True)
  with pytest.raises(ValueError, match=r"\['cache'\] besides 'params'.*mutable=\('cache',\)"):
    jgf.linen_layer(block, variables, decode=True)  # used to pass apply a kwarg
  no_cache = block.init(jax.random.key(0), x[None])  # decode off: no cache created
  with pytest.raises(ValueError, match=r"no \['cache'\] collection.*decode flag"):
    jgf.linen_layer(block, no_cache, mutable=("cache",), decode=True)
  with pytest.raises(ValueError, match="params are the layer's first argument"):
    jgf.linen_layer(block, variables, mutable=("params", "cache"))
  with pytest.raises(TypeError, match="collection name or a sequence"):
    jgf.linen_layer(block, variables, mutable=(nn.Module,))


class BatchNormBlock(nn.Module):
  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    h = nn.BatchNorm(use_running_average=not train, momentum=0.5)(nn.Dense(H)(x))
    return x + nn.Dense(D)(jax.nn.relu(h))


def test_linen_batch_stats_train_like_linen():
  x, target = _data()
  blocks = [BatchNormBlock(name=f"block_{i}") for i in range(DEPTH)]
  variables = [b.init(jax.random.key(i), x, train=False) for i, b in enumerate(blocks)]
  fns, params, stats = map(list, zip(*(
      jgf.linen_layer(b, v, mutable=["batch_stats"], train=True)
      for b, v in zip(blocks, variables))))
  layers = jg.make_graphed(fns, sample_args=[(p, s, x) for p, s in zip(params, stats)],
                           num_warmup_iters=1)
  linen = jax.jit(lambda p, s, x: BatchNormBlock().apply({"params": p, **s}, x, train=True,
                                                         mutable=["batch_stats"]))
  forward = jax.jit(lambda p, s, x: jax.vjp(fns[0], p, s, x))
  backward = jax.jit(lambda vjp_fn, ct: vjp_fn(ct))
  tx = optax.sgd(0.1)
  update = optax_update(tx)
  opt_state = tx.init(params)
  losses = []
  for _ in range(STEPS):
    h, pullbacks, references = x, [], []
    for i, layer in enumerate(layers):
      (y, new_stats), pullback = layer.vjp(params[i], stats[i], h)
      assert trees_equal((y, new_stats), linen(params[i], stats[i], h))  # Linen's own update
      references.append(forward(params[i], stats[i], h)[1])
      h, stats[i] = y, new_stats
      pullbacks.append(pullback)
    loss, ct = _loss_and_ct(h, target)
    grads = [None] * DEPTH
    for i in reversed(range(DEPTH)):
      ignored = jax.tree.map(jnp.ones_like, stats[i])  # the state output has no gradient
      grads[i], stats_grads, next_ct = pullbacks[i]((ct, ignored))
      ref = backward(references[i], (ct, jax.tree.map(jnp.zeros_like, stats[i])))
      assert trees_equal((grads[i], stats_grads, next_ct), ref)
      ct = next_ct
    params, opt_state = update(grads, opt_state, params)
    losses.append(loss)
  assert losses[-1] < losses[0]
  assert [layer.stats.captures for layer in layers] == [1] + [0] * (DEPTH - 1)
  assert sum(layer.stats.compiles for layer in layers) == 2  # forward + backward, once


class NnxBatchNormBlock(nnx.Module):

  def __init__(self, *, rngs: nnx.Rngs):
    self.up = nnx.Linear(D, H, rngs=rngs)
    self.norm = nnx.BatchNorm(H, momentum=0.5, rngs=rngs)
    self.down = nnx.Linear(H, D, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return x + self.down(jax.nn.relu(self.norm(self.up(x))))


def test_nnx_batch_stats_as_mutable_state_update_like_nnx():
  x, target = _data()
  blocks = [NnxBatchNormBlock(rngs=nnx.Rngs(i)) for i in range(DEPTH)]
  fns, params, stats = map(list, zip(*(jgf.nnx_layer(b, mutable=nnx.BatchStat)
                                       for b in blocks)))
  assert fns[0] == fns[1] and fns[0].mutable is nnx.BatchStat
  assert fns[0] != jgf.nnx_layer(blocks[0], wrt=(nnx.Param, nnx.BatchStat))[0]
  layers = jg.make_graphed(fns, sample_args=[(p, s, x) for p, s in zip(params, stats)],
                           num_warmup_iters=1)
  reference = nnx.jit(lambda block, x: block(x))  # updates the block's own BatchStats
  forward = jax.jit(lambda p, s, x: jax.vjp(fns[0], p, s, x))
  backward = jax.jit(lambda vjp_fn, ct: vjp_fn(ct))
  for _ in range(2):
    h = x
    for i, layer in enumerate(layers):
      (y, stats[i]), pullback = layer.vjp(params[i], stats[i], h)
      assert trees_equal(y, reference(blocks[i], h))
      assert trees_equal(stats[i], nnx.state(blocks[i], nnx.BatchStat))
      ref_vjp = forward(params[i], nnx.state(blocks[i], nnx.BatchStat), h)[1]
      got = pullback((jnp.cos(y), jax.tree.map(jnp.ones_like, stats[i])))  # ignored: no grad
      want = backward(ref_vjp, (jnp.cos(y), jax.tree.map(jnp.zeros_like, stats[i])))
      assert trees_equal(got, want)
      h = y
  assert [layer.stats.captures for layer in layers] == [1] + [0] * (DEPTH - 1)


def test_nnx_kv_cache_decode_loop_donates_the_cache():
  batch, max_len, steps = 2, 6, 4

  class NnxDecoderBlock(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
      self.norm = nnx.LayerNorm(D, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(2, D, decode=True, deterministic=True, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
      return x + self.attn(self.norm(x))

  def make_blocks() -> list[NnxDecoderBlock]:
    blocks = [NnxDecoderBlock(rngs=nnx.Rngs(i)) for i in range(DEPTH)]
    for block in blocks:
      block.attn.init_cache((batch, max_len, D))
    return blocks

  # The state shares its arrays with the module, and the donated cache is deleted: the
  # reference decodes with blocks of its own.
  blocks = make_blocks()
  fns, params, caches = map(list, zip(*(jgf.nnx_layer(b, mutable=nnx.Cache)
                                        for b in make_blocks())))
  x = jax.random.normal(jax.random.key(3), (batch, 1, D))
  layers = jg.make_graphed(fns, sample_args=[(p, c, x) for p, c in zip(params, caches)],
                           inference_only=True, donate_argnums=(1,))
  reference = nnx.jit(lambda block, x: block(x))
  compiles = None
  for _ in range(steps):  # one token at a time
    h = ref_h = x
    for i, layer in enumerate(layers):
      donated = caches[i]
      h, caches[i] = layer(params[i], caches[i], h)
      assert all(leaf.is_deleted() for leaf in jax.tree.leaves(donated))
      ref_h = reference(blocks[i], ref_h)
      assert trees_equal(h, ref_h)
      assert trees_equal(caches[i], nnx.state(blocks[i], nnx.Cache))
    x = jnp.tanh(h)
    compiles = compiles or [layer.stats.compiles for layer in layers]
  assert [layer.stats.compiles for layer in layers] == compiles  # no compile after the first
  assert [layer.stats.captures for layer in layers] == [1] + [0] * (DEPTH - 1)
  assert int(caches[0]["attn"]["cache_index"][...]) == steps


def test_nnx_filters_given_as_lists_and_overlapping_filters():
  """List filters work like tuples (they used to be blamed on mutable as unhashable), and a
  mutable filter that wrt already selects is refused instead of returning empty state."""
  block = NnxBatchNormBlock(rngs=nnx.Rngs(0))
  fn, params, state = jgf.nnx_layer(block, wrt=[nnx.Param], mutable=[nnx.BatchStat])
  listed, _, _ = jgf.nnx_layer(block, wrt=(nnx.Param,), mutable=(nnx.BatchStat,))
  assert fn == listed and hash(fn) == hash(listed)
  assert jax.tree.leaves(state)
  with pytest.raises(ValueError, match="wrt=.* selects them first"):
    jgf.nnx_layer(block, wrt=(nnx.Param, nnx.BatchStat), mutable=nnx.BatchStat)


class InnerDense(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(D)(x)


class WithSubmoduleField(nn.Module):
  inner: nn.Module

  @nn.compact
  def __call__(self, x):
    return self.inner(x) + 1


class ParentOfFieldBlocks(nn.Module):

  def setup(self):
    self.blocks = [WithSubmoduleField(InnerDense()) for _ in range(2)]

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def test_linen_block_of_a_bound_parent_with_a_submodule_field():
  """A bound block whose field is a module (bound too, through the parent) is applied
  unbound: its function hashes and computes what the unbound block computes."""
  x, _ = _data()
  variables = ParentOfFieldBlocks().init(jax.random.key(0), x)
  bound = ParentOfFieldBlocks().bind(variables).blocks[1]
  block_variables = {"params": variables["params"]["blocks_1"]}
  fn, params = jgf.linen_layer(bound, block_variables)
  hash(fn)
  want = WithSubmoduleField(InnerDense()).apply(block_variables, x)
  assert trees_equal(jax.jit(fn)(params, x), want)


@pytest.fixture
def frozendict_results():
  """Flax's `flax_return_frozendict=True`, restored after the test."""
  before = flax.config.flax_return_frozendict
  flax.config.update("flax_return_frozendict", True)
  yield
  flax.config.update("flax_return_frozendict", before)


def test_linen_mutable_state_under_flax_return_frozendict(frozendict_results):
  """apply then returns a FrozenDict: the state still goes in and comes back as one dict."""
  x, _ = _data()
  block = BatchNormBlock()
  variables = block.init(jax.random.key(0), x, train=False)
  fn, params, state = jgf.linen_layer(block, variables, mutable=["batch_stats"], train=True)
  _, new_state = fn(params, state, x)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  _, newer = fn(params, new_state, x)  # passed back as it came
  assert jax.tree.structure(newer) == jax.tree.structure(state)


def test_nnx_mutable_state_missing_from_the_call_is_named():
  fn, params, stats = jgf.nnx_layer(NnxBatchNormBlock(rngs=nnx.Rngs(0)), mutable=nnx.BatchStat)
  with pytest.raises(ValueError, match=r"mutable=nnx\.BatchStat"):
    jgf.nnx_layer(NnxBatchNormBlock(rngs=nnx.Rngs(0)))
  with pytest.raises(TypeError, match=r"takes \(params, state, \*inputs\)"):
    fn(params)
