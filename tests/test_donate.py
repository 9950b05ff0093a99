"""`make_graphed(..., inference_only=True, donate_argnums=...)`: a KV cache donated to the
forward executable, as `jax.jit(..., donate_argnums=...)` (on CPU too: XLA aliases it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxgraph as jg
from jaxgraph import rng as rng_lib
from models import trees_equal

D, S = 8, 16  # model width, cache length


def decode(p, x, cache, pos):
  """One decode step: writes `x @ w` into the cache at `pos`, attends over the cache."""
  cache = jax.lax.dynamic_update_slice(cache, (x @ p["w"])[None], (pos, 0))
  return jnp.tanh(x + jax.nn.softmax(cache @ x) @ cache), cache


def dropout_decode(p, x, cache, pos, *, key):
  y, cache = decode(p, x, cache, pos)
  return jnp.where(jax.random.bernoulli(key, 0.9, y.shape), y / 0.9, 0.0), cache


def flat_decode(p, x, cache, pos):
  """`decode` over a cache held as a FlatTree {"k", "v"}: returns it raveled again."""
  k = jax.lax.dynamic_update_slice(cache["k"], (x @ p["w"])[None], (pos, 0))
  v = jax.lax.dynamic_update_slice(cache["v"], x[None], (pos, 0))
  return jnp.tanh(x + jax.nn.softmax(k @ x) @ v), jg.flat.ravel({"k": k, "v": v})


def _inputs():
  params = {"w": jax.random.normal(jax.random.key(0), (D, D))}
  x = jax.random.normal(jax.random.key(1), (D,))
  return params, x, jnp.zeros((S, D)), jnp.int32(0)


def test_donated_cache_is_deleted_outputs_match_jit_and_sample_args_stay_alive():
  params, x, cache, pos = _inputs()
  g = jg.make_graphed(decode, sample_args=(params, x, cache, pos), inference_only=True,
                      donate_argnums=(2,))
  assert not any(a.is_deleted() for a in jax.tree.leaves((params, x, cache, pos)))  # (c)
  expected = jax.jit(decode)(params, x, cache, pos)
  mine = jnp.copy(cache)
  got = g(params, x, mine, pos)
  assert trees_equal(got, expected)
  assert mine.is_deleted()
  assert not any(a.is_deleted() for a in jax.tree.leaves((params, x, cache, pos)))
  with pytest.raises(RuntimeError, match="deleted"):
    g(params, x, mine, pos)


def test_decode_loop_passes_the_returned_cache_back_without_compiling():
  params, x, cache, pos = _inputs()
  g = jg.make_graphed(decode, sample_args=(params, x, jax.ShapeDtypeStruct(cache.shape,
                                                                            cache.dtype), pos),
                      inference_only=True, donate_argnums=(2,))
  compiles = g.stats.compiles
  assert compiles == 1
  step = jax.jit(decode)
  mine, theirs, y_mine, y_theirs = jnp.copy(cache), cache, x, x
  for t in range(20):
    previous = mine
    y_mine, mine = g(params, y_mine[:D], mine, jnp.int32(t % S))
    y_theirs, theirs = step(params, y_theirs[:D], theirs, jnp.int32(t % S))
    assert previous.is_deleted()
    assert trees_equal((y_mine, mine), (y_theirs, theirs))
  assert (g.stats.compiles, g.stats.replays) == (compiles, 20)


def test_donation_with_the_rng_stream_and_an_explicit_key():
  params, x, cache, pos = _inputs()
  g = jg.make_graphed(dropout_decode, sample_args=(params, x, cache, pos),
                      rng=jax.random.key(7), inference_only=True, donate_argnums=(2,))
  reference = jax.jit(dropout_decode)
  for n in range(2):  # the stream forward: (base, index, counter) come before the args
    mine = jnp.copy(cache)
    key = rng_lib.stream_key(0, n, g.rng_base_key)
    assert trees_equal(g(params, x, mine, pos), reference(params, x, cache, pos, key=key))
    assert mine.is_deleted() and not x.is_deleted() and not params["w"].is_deleted()
  key = jax.random.key(3)  # the explicit-key forward, compiled now, donates the same leaf
  mine = jnp.copy(cache)
  assert trees_equal(g(params, x, mine, pos, key=key), reference(params, x, cache, pos, key=key))
  assert mine.is_deleted() and not key.is_deleted() and not x.is_deleted()
  assert g.stats.compiles == 2 and g.rng_counter == 2


def test_a_donated_flat_tree_donates_its_buffers():
  params, x, _, pos = _inputs()
  cache = jg.flat.ravel({"k": jnp.zeros((S, D)), "v": jnp.ones((S, D))})
  g = jg.make_graphed(flat_decode, sample_args=(params, x, cache, pos), inference_only=True,
                      donate_argnums=(2,))
  assert not any(b.is_deleted() for b in jax.tree.leaves(cache))
  mine = jax.tree.map(jnp.copy, cache)
  y, out = g(params, x, mine, pos)
  assert all(b.is_deleted() for b in jax.tree.leaves(mine))
  assert trees_equal((y, out), jax.jit(jg.flat.unravelling(flat_decode))(params, x, cache, pos))


def test_the_jit_fallback_after_max_captures_donates_too():
  params, x, cache, pos = _inputs()
  g = jg.make_graphed(decode, sample_args=(params, x, cache, pos), inference_only=True,
                      donate_argnums=(2,), max_captures=1)
  longer = jnp.zeros((2 * S, D))
  expected = jax.jit(decode)(params, x, longer, pos)
  mine = jnp.copy(longer)
  with pytest.warns(UserWarning, match="max_captures=1"):
    got = g(params, x, mine, pos)
  assert trees_equal(got, expected) and g.stats.fallbacks == 1
  assert mine.is_deleted() and not params["w"].is_deleted()
  traced = jax.jit(g)(params, x, cache, pos)  # under a user's jit: the function just runs
  assert trees_equal(traced, jax.jit(decode)(params, x, cache, pos))
  assert not cache.is_deleted()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"donate_argnums": (2,)}, ValueError,
     r"donate_argnums=\(2,\) without inference_only=True: a training forward's inputs are "
     r"needed again by its backward"),
    ({"donate_argnums": (4,), "inference_only": True}, ValueError,
     r"donate_argnums=\(4,\) has 4, but sample_args\[0\] has 4 positional arguments: each "
     r"index must be in range\(0, 4\)"),
    ({"donate_argnums": (-1,), "inference_only": True}, ValueError, r"range\(0, 4\)"),
    ({"donate_argnums": (2, 2), "inference_only": True}, ValueError, "more than once"),
    ({"donate_argnums": ("2",), "inference_only": True}, TypeError, "must hold ints"),
    ({"donate_argnums": (True,), "inference_only": True}, TypeError, "must hold ints"),
    ({"donate_argnums": 2, "inference_only": True}, TypeError, "sequence of ints"),
])
def test_bad_donate_argnums_raise_and_leave_no_state_behind(kwargs, error, match):
  params, x, cache, pos = _inputs()
  with pytest.raises(error, match=match):
    jg.make_graphed(decode, sample_args=(params, x, cache, pos), **kwargs)
  assert not jg.is_capturing()
  assert not any(a.is_deleted() for a in jax.tree.leaves((params, x, cache, pos)))
  g = jg.make_graphed(decode, sample_args=(params, x, cache, pos), inference_only=True)
  assert g.stats.compiles == 1 and trees_equal(g(params, x, cache, pos),
                                               jax.jit(decode)(params, x, cache, pos))
