"""_capture.py: residual packing (kept residuals of at most `PACK_MAX_BYTES` travel as one
flat buffer per dtype, on the platforms where that is exact: `PACK_PLATFORMS`), and the
warning for closed-over weights (`_constants.constant_weights`)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import pytest

import jaxgraph as jg
from jaxgraph import _capture as capture_lib
from jaxgraph import _constants as constants_lib
from models import causal_mask, trees_equal

B, D = 8, 32


def layer(p, x, *, key):
  """Keeps several small residuals besides its inputs: a tanh, a dropout mask, a product."""
  h = jnp.tanh(x @ p["w1"])
  keep = jax.random.bernoulli(key, 0.9, h.shape)
  return x + (jnp.where(keep, h / 0.9, 0.0) * jnp.sin(x)) @ p["w2"]


def _params(seed):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w1": jax.random.normal(k1, (D, D)) / D, "w2": jax.random.normal(k2, (D, D)) / D}


def _layout(graphed):
  (entry,) = graphed.executables.entries.values()
  return entry.layout


def test_residuals_are_packed_by_default_on_gpu_only():
  assert capture_lib.PACK_PLATFORMS == {"gpu"}


def test_residuals_are_packed_only_on_pack_platforms(packing):
  """Both sides of the gate, forced on the backend the tests run on (conftest.py)."""
  x = jnp.ones((B, D))
  graphed = jg.make_graphed(layer, sample_args=(_params(0), x), rng=True, num_warmup_iters=0)
  layout = _layout(graphed)
  kept = len(layout.packing.shapes)
  assert kept > 2
  assert (layout.n_kept < kept) == packing


@pytest.mark.parametrize("packing", [True], indirect=True)
def test_placed_arguments_keep_residuals_unpacked(packing):
  """Even where residuals pack: a flat buffer needs one layout on one device."""
  placed = NamedSharding(Mesh(jax.devices()[:1], ("d",)), P())
  params, x = jax.device_put((_params(0), jnp.ones((B, D))), placed)
  graphed = jg.make_graphed(layer, sample_args=(params, x), rng=True, num_warmup_iters=0)
  assert _layout(graphed).packing.groups == ()


def test_residuals_give_the_grads_of_jax_vjp_packed_or_not(packing):
  params = [_params(i) for i in range(3)]
  x = jax.random.normal(jax.random.key(7), (B, D))
  layers = jg.make_graphed([layer] * 3, sample_args=[(p, x) for p in params], rng=True,
                           num_warmup_iters=1)
  layout = _layout(layers[0])
  assert bool(layout.packing.groups) == packing
  forward = jax.jit(lambda p, x, k: jax.vjp(lambda p, x: layer(p, x, key=k), p, x))
  backward = jax.jit(lambda vjp_fn, ct: vjp_fn(ct))
  for step in range(3):
    keys = [jax.random.fold_in(jax.random.key(step), i) for i in range(3)]
    y, pullback = jg.sequential_vjp(layers, params, x, keys=keys)
    grads, g_x = pullback(jnp.cos(y))
    h, vjps = x, []
    for p, k in zip(params, keys):
      h, vjp_fn = forward(p, h, k)
      vjps.append(vjp_fn)
    assert trees_equal(y, h)
    ct, want = jnp.cos(h), []
    for vjp_fn in reversed(vjps):
      g_p, ct = backward(vjp_fn, ct)
      want.insert(0, g_p)
    assert trees_equal((grads, g_x), (want, ct))
    params = [jax.tree.map(lambda a, g: a - 0.1 * g, p, g) for p, g in zip(params, grads)]


def named_layer(p, x):
  h = checkpoint_name(jnp.tanh(x @ p["w1"]), "hidden")
  return x + jnp.sin(h) @ p["w2"]


@pytest.mark.parametrize("offload_names", [None, ["hidden"]])
def test_named_residuals_stay_loose_only_for_offload_names(packing, offload_names):
  """With offload_names a named residual is a buffer of its own, so a name selects exactly
  it; without, names do not matter: where residuals are packed it packs like the others,
  elsewhere every residual is a buffer of its own anyway."""
  x = jnp.ones((B, D))
  # The policy saves named values: `hidden` is a kept residual.
  graphed = jg.make_graphed(named_layer, sample_args=(_params(0), x), num_warmup_iters=0,
                            remat_policy=jg.residuals.recompute_elementwise,
                            offload_residuals=offload_names is not None,
                            offload_names=offload_names)
  layout = _layout(graphed)
  names = [b.name for b in layout.buffers]
  assert len(layout.packing.shapes) == 2  # `hidden` and the first matmul's output
  if packing and offload_names is None:
    assert names == [None]  # one packed buffer
  else:
    assert sorted(names, key=str) == [None, "hidden"]


# ------------------------------------------------------------------- closed-over weights

W = jax.random.normal(jax.random.key(1), (D, D)) / D
X = jnp.ones((B, D))


def _closes_over_w(x):
  return jnp.tanh(x @ W)


def _bf16_einsum(x):
  return jnp.einsum("bd,ed->be", x.astype(jnp.bfloat16), W.astype(jnp.bfloat16))


def _inside_a_jit(x):
  return jax.jit(lambda x: x @ W.T)(x)


STACK = jnp.stack([W, W])


def _stacked_slice(x):  # one layer's weight sliced out of a closed-over stack
  return x @ STACK[1]


KERNEL = jax.random.normal(jax.random.key(2), (1, 1, 1024))


def _conv_closure(x):
  return jax.lax.conv_general_dilated(x[:, None, :], KERNEL, (1,), "SAME")[:, 0]


SMALL = jax.random.normal(jax.random.key(3), (16, 16))  # 256 elements: a weight all the same


def _small_weight(x):
  return x[:, :16] @ SMALL


ALARMS = {"matmul": _closes_over_w, "bf16_einsum": _bf16_einsum, "nested_jit": _inside_a_jit,
          "slice_of_a_stack": _stacked_slice, "conv": _conv_closure,
          "small_weight": _small_weight}

ROTARY = jnp.stack([jnp.sin(jnp.arange(B * D) / 7.0), jnp.cos(jnp.arange(B * D) / 7.0)])
FLOAT_MASK = causal_mask(B)  # 0 / -1e9
BOOL_MASK = jnp.tril(jnp.ones((B, B), bool))


def _masks_and_tables(p, x):
  """What a real block closes over without it being a weight: a bool mask, an int table, a
  precomputed rotary table applied elementwise, a float mask added to scores; the weight
  itself is an argument."""
  rot = x * ROTARY[0].reshape(B, D) + x[:, ::-1] * ROTARY[1].reshape(B, D)
  scores = (rot @ p) @ rot.T + FLOAT_MASK
  scores = jnp.where(BOOL_MASK, scores, -jnp.inf)
  positions = jnp.arange(B * D, dtype=jnp.int32).reshape(B, D)
  return jax.nn.softmax(scores) @ x + positions


def _constant_weight_warnings(fn, args):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jg.make_graphed(fn, sample_args=args, num_warmup_iters=0)
  return [w for w in caught if issubclass(w.category, jg.ConstantWeightWarning)]


@pytest.mark.parametrize("fn", ALARMS.values(), ids=ALARMS.keys())
def test_a_closed_over_weight_warns_with_the_fix(fn):
  (found,) = _constant_weight_warnings(fn, (X,))
  message = str(found.message)
  assert f"{fn.__name__}[0]: the traced function closes over 1 float array(s)" in message
  assert "pass them as arguments" in message and "grad_mask" in message
  assert "category=jaxgraph.ConstantWeightWarning" in message
  assert issubclass(jg.ConstantWeightWarning, UserWarning)


def _scaled(s, x):
  return _closes_over_w(x) * s


def test_a_weight_is_named_once_per_make_graphed_call():
  """The first capture names the closed-over weight; another signature and a fused chain of
  the same functions trace the same array again and say nothing new."""
  scales = [jnp.float32(1.0), jnp.float32(2.0)]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    layers = jg.make_graphed([_scaled, _scaled], sample_args=[(s, X) for s in scales],
                             num_warmup_iters=0)
    assert layers[0].stats.captures == 1  # the identical second layer shares the capture
    layers[0](scales[0], jnp.ones((2 * B, D)))  # a new batch: a capture of its own
    y, pullback = jg.sequential_vjp(layers, scales, X, fuse=True)
    pullback(jnp.ones_like(y))
  assert layers[0].stats.captures == 3  # and the fused chain's
  assert [str(w.message).split(":")[0] for w in caught] == ["_scaled[0]"]


def test_a_fused_chain_names_a_weight_its_layers_never_traced():
  """A function that projects only inputs wider than 16 closes over a weight only at such
  widths: a fused chain at one, the first capture to see it, warns."""
  def projects(s, x):
    if x.shape[-1] <= 16:
      return jnp.tanh(x) * s
    w = np.full((x.shape[-1], x.shape[-1]), 0.5, np.float32)  # built at trace time
    return jnp.tanh(x @ w) * s

  scales = [jnp.float32(1.0), jnp.float32(2.0)]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    layers = jg.make_graphed([projects, projects], num_warmup_iters=0,
                             sample_args=[(s, jnp.ones((B, 16))) for s in scales])
    assert caught == []
    jg.sequential_vjp(layers, scales, jnp.ones((B, 64)), fuse=True)
  (found,) = caught
  assert issubclass(found.category, jg.ConstantWeightWarning)
  assert str(found.message).startswith(  # one matrix built by each layer's trace
      "fused(projects[0]..projects[1]): the traced function closes over 2 float array(s) that "
      "feed a matmul or a convolution (float32[64, 64], float32[64, 64])")


def test_a_module_closed_over_by_a_partial_warns():
  """A Flax module handed over inside a partial is not refused (make_graphed sees a
  partial), but its kernel feeds a matmul as a constant: the warning names it."""
  from flax import nnx

  module = nnx.Linear(D, D, rngs=nnx.Rngs(0))
  (found,) = _constant_weight_warnings(functools.partial(lambda m, x: m(x), module), (X,))
  assert f"float32[{D}, {D}]" in str(found.message)


def test_masks_tables_and_weights_as_arguments_do_not_warn():
  assert _constant_weight_warnings(_masks_and_tables, (W, X)) == []
  assert constants_lib.constant_weights(jax.make_jaxpr(_masks_and_tables)(W, X)) == []
  assert constants_lib.constant_weights(jax.make_jaxpr(_closes_over_w)(X)) == [
      f"float32[{D}, {D}]"]


def test_the_warning_is_silenced_by_its_category():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=jg.ConstantWeightWarning)
    layer = jg.make_graphed(_closes_over_w, sample_args=(X,), num_warmup_iters=0)
  assert trees_equal(layer(X), jax.jit(_closes_over_w)(X))



def test_compiler_options_reach_every_executable_of_the_callables(tmp_path):
  """make_graphed(..., compiler_options=...): XLA dumps (`xla_dump_to`, a per-executable
  option) the forward and backward compiled at capture and the outputs-only forward
  compiled on the first plain call; callables of another make_graphed call, without the
  option, dump nothing and replay executables of their own."""
  def dumped():
    return [f.name for f in tmp_path.iterdir() if f.name.endswith(".before_optimizations.txt")]

  fn = lambda p, x: jnp.tanh(x @ p)  # noqa: E731
  p, x = jnp.full((4, 4), 0.5), jnp.ones((2, 4))
  g = jg.make_graphed(fn, sample_args=(p, x), num_warmup_iters=0,
                      compiler_options={"xla_dump_to": str(tmp_path)})
  captured = dumped()
  assert any(".jit_backward." in name for name in captured)
  g(p, x)  # the outputs-only forward, compiled now from the entry
  assert len(dumped()) == len(captured) + 1
  plain = jg.make_graphed(fn, sample_args=(p, x), num_warmup_iters=0)
  before = dumped()
  np.testing.assert_array_equal(plain(p, x), g(p, x))
  assert dumped() == before
  (entry,), (plain_entry,) = g.executables.entries.values(), plain.executables.entries.values()
  assert entry is not plain_entry and plain_entry.compiler_options == ()
  assert entry.compiler_options == (("xla_dump_to", str(tmp_path)),)
