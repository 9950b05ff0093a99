"""Bad input at every public entry point: a clear error, no state change, the next call works.

"No state change" means: for `make_graphed`, argument errors come before anything is traced
or any hook fires, and `is_capturing()` is False afterwards; for a GraphedCallable, its
stats, its captured signatures, the shared executable cache, its fallback and its key
stream are what they were, and the next good call is bitwise-correct; for a pullback, it is
still usable.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgraph as jg


def layer(p, x):
  return jnp.tanh(x @ p["w"]) + p["b"]


def keyed_layer(p, x, *, key):
  return layer(p, x) * jax.random.uniform(key, x.shape[:1] + p["b"].shape)


P = {"w": jnp.arange(16.0, dtype=jnp.float32).reshape(4, 4) / 16, "b": jnp.ones((4,))}
X = jnp.linspace(-1, 1, 8, dtype=jnp.float32).reshape(2, 4)
CT = jnp.full((2, 4), 0.5, jnp.float32)

_ref_push = jax.jit(lambda p, x: jax.vjp(layer, p, x))
_ref_pull = jax.jit(lambda v, ct: v(ct))


def _same_bits(x: Any, y: Any) -> bool:
  x, y = np.asarray(x), np.asarray(y)
  if (x.dtype, x.shape) != (y.dtype, y.shape):
    return False
  if jnp.issubdtype(x.dtype, jnp.inexact):  # NaNs: same positions; sign/payload unspecified
    nan = np.isnan(x.astype(np.float32))
    if not np.array_equal(nan, np.isnan(y.astype(np.float32))):
      return False
    x, y = x[~nan], y[~nan]
  return x.tobytes() == y.tobytes()


def bitwise(a: Any, b: Any) -> bool:
  """Same pytree, dtypes, shapes and bytes (NaNs compared by position)."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  return ta == tb and all(_same_bits(x, y) for x, y in zip(la, lb))


def snapshot(g: jg.GraphedCallable) -> tuple[Any, ...]:
  counter = g.rng_counter if g.config.rng else None
  return (g.stats, tuple(g.executables.entries), tuple(g.config.cache), g.executables.fallback, counter,
          jg.is_capturing())


def assert_good_call(g: jg.GraphedCallable, p=P, x=X) -> None:
  y, pull = g.vjp(p, x)
  y_ref, v = _ref_push(p, x)
  assert bitwise(y, y_ref)
  assert bitwise(pull(CT), _ref_pull(v, CT))
  assert bitwise(g(p, x), y_ref)


def message(e: BaseException) -> str:
  return "\n".join([str(e), *getattr(e, "__notes__", [])])


@pytest.fixture
def graphed():
  return jg.make_graphed(layer, sample_args=(P, X), num_warmup_iters=1)


@pytest.fixture
def strict():
  return jg.make_graphed(layer, sample_args=(P, X), num_warmup_iters=1,
                         on_new_signature="error")


# ----------------------------------------------------------------------- replay entry points

# (id, call(g), exception, a regex the message (with notes) must match)
CALL_CASES: list[tuple[str, Callable[[Any], Any], type[BaseException], str]] = [
    ("too_few_args", lambda g: g(P), TypeError,
     r"missing 1 required positional argument[\s\S]*while capturing layer\[0\] for a new "
     r"input signature: args\[0\]\['b'\]: float32\[4\], args\[0\]\['w'\]: float32\[4,4\]$"),
    ("too_many_args", lambda g: g(P, X, X), TypeError,
     r"3 were given[\s\S]*layer\[0\].*args\[2\]: float32\[2,4\]"),
    ("kwargs", lambda g: g(P, x=X), TypeError, r"keyword arguments \['x'\].*positional"),
    ("kwargs_vjp", lambda g: g.vjp(p=P, x=X), TypeError, r"keyword arguments \['p', 'x'\]"),
    ("key_without_rng", lambda g: g(P, X, key=jax.random.key(0)), TypeError, r"rng=False"),
    ("str_leaf", lambda g: g(P, "x"), TypeError, r"args\[1\] is a str, not an array"),
    ("object_leaf", lambda g: g({"w": object(), "b": P["b"]}, X), TypeError,
     r"args\[0\]\['w'\] is a object, not an array"),
    ("none_for_array", lambda g: g(P, None), TypeError, r"layer\[0\].*args\[0\]\['w'\]"),
    ("vjp_str_leaf", lambda g: g.vjp(P, "x"), TypeError, r"args\[1\] is a str"),
    ("scalar_for_matrix", lambda g: g(P, 1.0), (TypeError, ValueError),
     r"layer\[0\].*args\[1\]: float32\[\] \(weakly typed"),
]


@pytest.mark.parametrize("case", CALL_CASES, ids=[c[0] for c in CALL_CASES])
def test_bad_call_raises_clearly_and_changes_nothing(graphed, case):
  _, call, exc, pattern = case
  before = snapshot(graphed)
  with pytest.raises(exc) as info:
    call(graphed)
  assert re.search(pattern, message(info.value)), message(info.value)
  assert snapshot(graphed) == before
  assert_good_call(graphed)


STRICT_CASES = [
    ("shape", lambda g: g(P, jnp.ones((3, 4))), r"args\[1\]: expected float32\[2,4\], got float32\[3,4\]"),
    ("dtype", lambda g: g(P, X.astype(jnp.bfloat16)), r"args\[1\]: expected float32\[2,4\], got bfloat16\[2,4\]"),
    ("structure", lambda g: g((P["w"], P["b"]), X), r"different pytree structure"),
    ("arity", lambda g: g(P), r"different pytree structure"),
    ("weak_scalar", lambda g: g({"w": P["w"], "b": 1.0}, X),
     r"args\[0\]\['b'\]: expected float32\[4\], got float32\[\] \(weakly typed"),
    ("vjp_shape", lambda g: g.vjp(P, jnp.ones((3, 4))), r"expected float32\[2,4\], got float32\[3,4\]"),
]


@pytest.mark.parametrize("case", STRICT_CASES, ids=[c[0] for c in STRICT_CASES])
def test_new_signature_with_on_new_signature_error(strict, case):
  _, call, pattern = case
  before = snapshot(strict)
  with pytest.raises(TypeError, match=pattern) as info:
    call(strict)
  assert "layer[0]" in str(info.value) and "on_new_signature" in str(info.value)
  assert snapshot(strict) == before
  assert_good_call(strict)


def test_python_scalar_is_a_new_weakly_typed_signature():
  def scale(x, s):
    return x * s

  x = jnp.ones((3,), jnp.float32)
  g = jg.make_graphed(scale, sample_args=(x, jnp.float32(2.0)), num_warmup_iters=0)
  assert g.stats.captures == 1
  y = g(x, 2.0)                            # a Python float is weakly typed: a new signature
  assert g.stats.captures == 2
  assert bitwise(y, jax.jit(scale)(x, 2.0))
  assert [s.leaves[1].weak_type for s in g.executables.entries] == [False, True]
  g(x, 3.0)                                # same weak signature: replayed, not recaptured
  g(x, jnp.float32(3.0))
  assert g.stats.captures == 2 and g.stats.replays == 3
  with pytest.raises(TypeError, match=r"weakly typed: a Python scalar"):
    jg.make_graphed(scale, sample_args=(x, jnp.float32(2.0)), num_warmup_iters=0,
                    on_new_signature="error")(x, 2.0)


def test_max_captures_falls_back_once_with_a_warning():
  g = jg.make_graphed(layer, sample_args=(P, X), num_warmup_iters=0, max_captures=1)
  x3 = jnp.ones((3, 4))
  with pytest.warns(UserWarning, match="max_captures=1"):
    y = g(P, x3)
  assert bitwise(y, jax.jit(layer)(P, x3))
  assert g.stats.fallbacks == 1 and g.stats.captures == 1
  # A fallback call that fails counts nothing.
  before = snapshot(g)
  with pytest.raises(TypeError):
    g(P, jnp.ones((3, 5)))
  assert snapshot(g) == before
  assert_good_call(g)


def test_nan_and_inf_pass_through_unchanged(graphed):
  x = X.at[0, 0].set(jnp.nan).at[0, 1].set(jnp.inf).at[1, 2].set(-jnp.inf)
  p = {"w": P["w"].at[3, 3].set(jnp.nan), "b": P["b"]}
  ct = CT.at[1, 3].set(jnp.inf)
  y, pull = graphed.vjp(p, x)
  y_ref, v = _ref_push(p, x)
  assert bitwise(y, y_ref) and not np.isfinite(np.asarray(y)).all()
  grads = pull(ct)
  assert bitwise(grads, _ref_pull(v, ct)) and not np.isfinite(np.asarray(grads[1])).all()
  assert bitwise(graphed(p, x), y_ref)
  assert graphed.stats.captures == 1 and graphed.stats.fallbacks == 0
  assert_good_call(graphed)


# ------------------------------------------------------------------------------- pullbacks

PULLBACK_CASES = [
    ("shape", lambda: jnp.ones((3, 4)), r"cotangents: expected float32\[2, 4\], got float32\[3, 4\]"),
    ("dtype", lambda: CT.astype(jnp.bfloat16), r"expected float32\[2, 4\], got bfloat16\[2, 4\]"),
    ("structure", lambda: (CT,), r"has structure PyTreeDef\(\(\*,\)\), but the outputs have"),
    ("none", lambda: None, r"has structure PyTreeDef\(None\)"),
    ("string", lambda: "ct", r"expected float32\[2, 4\], got <class 'str'>"),
]


@pytest.mark.parametrize("case", PULLBACK_CASES, ids=[c[0] for c in PULLBACK_CASES])
def test_bad_cotangent_raises_clearly_and_pullback_stays_usable(graphed, case):
  _, make_ct, pattern = case
  y, pull = graphed.vjp(P, X)
  before = snapshot(graphed)
  with pytest.raises(TypeError, match=pattern) as info:
    pull(make_ct())
  assert info.value.__cause__ is None  # stands alone: not under XLA's own message
  assert snapshot(graphed) == before
  _, v = _ref_push(P, X)
  assert bitwise(pull(CT), _ref_pull(v, CT))       # the same pullback still works
  assert graphed.stats.backward_replays == before[0].backward_replays + 1


def test_pullback_is_one_shot(graphed):
  y, pull = graphed.vjp(P, X)
  pull(CT)
  before = snapshot(graphed)
  with pytest.raises(RuntimeError, match=r"already called.*once"):
    pull(CT)
  assert snapshot(graphed) == before
  assert_good_call(graphed)


def test_wgrad_misuse():
  g = jg.make_graphed(layer, sample_args=(P, X), num_warmup_iters=0, delay_wgrad=True)
  y, pull = g.vjp(P, X)
  with pytest.raises(RuntimeError, match=r"before its pullback"):
    pull.wgrad()
  g_p, g_x = pull(CT)
  assert g_p is None
  w = pull.wgrad()
  _, v = _ref_push(P, X)
  ref = _ref_pull(v, CT)
  assert bitwise((w[0], g_x), ref)
  with pytest.raises(RuntimeError, match=r"already called"):
    pull.wgrad()
  y, pull = jg.make_graphed(layer, sample_args=(P, X), num_warmup_iters=0).vjp(P, X)
  pull(CT)
  with pytest.raises(RuntimeError, match=r"without delay_wgrad=True"):
    pull.wgrad()


# ------------------------------------------------------------------- sequential_vjp, seed

def test_sequential_vjp_bad_input():
  layers = jg.make_graphed([layer, layer], sample_args=[(P, X)] * 2, num_warmup_iters=0)
  before = [snapshot(l) for l in layers]
  cases = [
      (lambda: jg.sequential_vjp(layers, [P], X), ValueError, r"2 layers but 1 params"),
      (lambda: jg.sequential_vjp(layers, [P, P], X, keys=[jax.random.key(0)]), ValueError,
       r"2 layers but 1 keys"),
      (lambda: jg.sequential_vjp(layers, [P, P], X, keys=list(jax.random.split(
          jax.random.key(0), 2))), TypeError, r"rng=False"),
      (lambda: jg.sequential_vjp([layer, layer], [P, P], X), TypeError,
       r"GraphedCallable"),
      (lambda: jg.sequential_vjp(layers, [P, P], "x"), TypeError, r"args\[1\] is a str"),
  ]
  for call, exc, pattern in cases:
    with pytest.raises(exc, match=pattern):
      call()
    assert [snapshot(l) for l in layers] == before
  y, pull = jg.sequential_vjp(layers, [P, P], X)
  ref = jax.jit(lambda x: layer(P, layer(P, x)))(X)
  assert bitwise(y, ref)
  grads, g_x = pull(CT)
  assert len(grads) == 2 and g_x.shape == X.shape


def test_seed_and_key_bad_input():
  g = jg.make_graphed(keyed_layer, sample_args=(P, X), num_warmup_iters=0, rng=True)
  before = snapshot(g)
  cases = [
      (lambda: g.seed("seed"), TypeError, r"typed PRNG key"),
      (lambda: g.seed(jax.random.PRNGKey(0)), TypeError, r"raw uint32\[2\] key"),
      (lambda: g(P, X, key=jax.random.PRNGKey(0)), TypeError, r"wrap_key_data"),
      (lambda: g(P, X, key=jax.random.split(jax.random.key(0))), TypeError, r"shape \(2,\)"),
      (lambda: g(P, X, key=3), TypeError, r"typed PRNG key"),
      (lambda: g.vjp(P, X, key="k"), TypeError, r"typed PRNG key"),
  ]
  for call, exc, pattern in cases:
    with pytest.raises(exc, match=pattern):
      call()
    assert snapshot(g) == before
  key = jax.random.key(7)
  assert bitwise(g(P, X, key=key), jax.jit(functools.partial(keyed_layer, key=key))(P, X))
  plain = jg.make_graphed(layer, sample_args=(P, X), num_warmup_iters=0)
  with pytest.raises(ValueError, match=r"rng=False"):
    plain.seed(0)
  with pytest.raises(ValueError, match=r"rng=False"):
    plain.rng_counter


# -------------------------------------------------------------------------------- hooks

def test_hooks_constructor_rejects_bad_hooks():
  with pytest.raises(TypeError, match=r"unknown hook kind 'pre_foward'.*'pre_forward'"):
    jg.Hooks(pre_foward=[print])
  # torch's names for the hooks after the forward and the backward
  with pytest.raises(TypeError, match=r"'post_forward'.*Did you mean 'forward'\?"):
    jg.Hooks(post_forward=[print])
  with pytest.raises(TypeError, match=r"'post_backward'.*Did you mean 'backward'\?"):
    jg.Hooks(post_backward=[print])
  with pytest.raises(TypeError, match=r"takes a list of hooks, got a dict"):
    jg.Hooks(forward={"a": print})
  with pytest.raises(TypeError, match=r"must hold callables, got 3"):
    jg.Hooks(backward=[3])
  h = jg.Hooks(forward=print)
  with pytest.raises(AttributeError, match="immutable"):
    h.forward = ()


@pytest.mark.parametrize("kind", ["pre_forward", "forward", "pre_backward", "backward"])
def test_hook_returning_a_value_raises_and_names_the_hook(kind):
  calls = 0

  def returns_something(event):
    nonlocal calls
    calls += 1
    return event.phase if event.phase == "replay" else None

  g = jg.make_graphed(layer, jg.Hooks(**{kind: [returns_something]}), sample_args=(P, X),
                      num_warmup_iters=1)
  assert calls == 2  # capture + one warmup iteration
  y, pull = None, None
  before = snapshot(g)
  with pytest.raises(TypeError, match=rf"{kind} hook .*returns_something of layer\[0\] "
                                      r"returned str; hooks must return None"):
    y, pull = g.vjp(P, X)
    pull(CT)
  if kind == "pre_forward":   # refused before the forward ran: nothing counted
    assert snapshot(g) == before
  if kind == "pre_backward":  # refused before the backward ran: the pullback is still usable
    assert g.stats.backward_replays == before[0].backward_replays
  assert calls == 3


# --------------------------------------------------------------------- make_graphed

def _traced_layer():
  traces = 0

  def fn(p, x):
    nonlocal traces
    traces += 1
    return layer(p, x)

  return fn, lambda: traces


HOOK_FIRED: list[str] = []
SPY = jg.Hooks(pre_forward=[lambda e: HOOK_FIRED.append("pre_forward")])

# (id, kwargs for make_graphed (fns replaced by the spy function where "fn"), exception,
#  regex). Every case must be rejected before anything is traced or a hook fires.
MAKE_CASES: list[tuple[str, dict[str, Any], type[BaseException], str]] = [
    ("empty_sequence", dict(fns=[], sample_args=[]), ValueError, r"empty sequence"),
    ("non_callable", dict(fns=3, sample_args=(P, X)), TypeError,
     r"a callable or a sequence of callables, got int"),
    ("non_callable_element", dict(fns=["fn", 3], sample_args=[(P, X)] * 2), TypeError,
     r"fns\[1\] is a int, not a callable"),
    ("string", dict(fns="layer", sample_args=(P, X)), TypeError, r"got str"),
    ("dict_of_fns", dict(fns={"a": "fn"}, sample_args=[(P, X)]), TypeError, r"got dict"),
    ("generator", dict(fns=("fn" for _ in range(1)), sample_args=[(P, X)]), TypeError,
     r"got generator"),
    ("no_sample_args", dict(fns="fn", sample_args=None), TypeError, r"needs sample_args"),
    ("too_few_sample_args", dict(fns=["fn", "fn"], sample_args=[(P, X)]), ValueError,
     r"2 callables but sample_args has 1 entries"),
    ("too_many_sample_args", dict(fns=["fn"], sample_args=[(P, X)] * 3), ValueError,
     r"1 callables but sample_args has 3 entries"),
    ("sample_args_dict", dict(fns="fn", sample_args={"p": P}), TypeError,
     r"sample_args\[0\] must be a tuple"),
    ("sample_args_bare_array", dict(fns="fn", sample_args=X), TypeError,
     r"for one argument write \(x,\)"),
    ("sample_args_not_a_sequence", dict(fns=["fn"], sample_args=3), TypeError,
     r"sample_args takes one tuple of positional arguments per callable \(1\), got int"),
    ("sample_args_str_leaf", dict(fns="fn", sample_args=(P, "x")), TypeError,
     r"sample_args\[0\]: argument args\[1\] is a str, not an array"),
    ("sample_args_object_leaf", dict(fns=["fn", "fn"], sample_args=[(P, X), (P, object())]),
     TypeError, r"sample_args\[1\]: argument args\[1\] is a object"),
    ("num_warmup_iters_negative", dict(fns="fn", sample_args=(P, X), num_warmup_iters=-1),
     ValueError, r"num_warmup_iters must be an int >= 0, got -1"),
    ("num_warmup_iters_str", dict(fns="fn", sample_args=(P, X), num_warmup_iters="3"),
     TypeError, r"num_warmup_iters must be an int"),
    ("num_warmup_iters_bool", dict(fns="fn", sample_args=(P, X), num_warmup_iters=True),
     TypeError, r"num_warmup_iters must be an int >= 0, got True"),
    ("max_captures_zero", dict(fns="fn", sample_args=(P, X), max_captures=0), ValueError,
     r"max_captures must be an int >= 1"),
    ("max_captures_bool", dict(fns="fn", sample_args=(P, X), max_captures=True), TypeError,
     r"max_captures must be an int >= 1, got True"),
    ("max_captures_float", dict(fns="fn", sample_args=(P, X), max_captures=2.0), TypeError,
     r"max_captures must be an int >= 1, got 2.0"),
    ("on_new_signature", dict(fns="fn", sample_args=(P, X), on_new_signature="recapture"),
     ValueError, r"on_new_signature must be one of \('capture', 'error'\)"),
    ("on_new_signature_bool", dict(fns="fn", sample_args=(P, X), on_new_signature=True),
     TypeError, r"on_new_signature must be one of \('capture', 'error'\), got True"),
    ("pre_warmup_hook", dict(fns="fn", sample_args=(P, X), pre_warmup_hook=3), TypeError,
     r"pre_warmup_hook must be a callable"),
    ("post_warmup_hook", dict(fns="fn", sample_args=(P, X), post_warmup_hook="x"), TypeError,
     r"post_warmup_hook must be a callable"),
    ("rng_str", dict(fns="fn", sample_args=(P, X), rng="yes"), TypeError, r"typed PRNG key"),
    ("rng_int", dict(fns="fn", sample_args=(P, X), rng=1), TypeError, r"typed PRNG key"),
    ("rng_legacy_key", dict(fns="fn", sample_args=(P, X), rng=jax.random.PRNGKey(0)),
     TypeError, r"raw uint32\[2\] key"),
    ("delay_wgrad_str", dict(fns="fn", sample_args=(P, X), delay_wgrad="yes"), TypeError,
     r"delay_wgrad must be a bool"),
    ("wgrad_argnums_int", dict(fns="fn", sample_args=(P, X), wgrad_argnums=0), TypeError,
     r"wgrad_argnums must be a sequence of ints"),
    ("wgrad_argnums_negative", dict(fns="fn", sample_args=(P, X), wgrad_argnums=(-1,)),
     ValueError, r"wgrad_argnums must be non-negative ints"),
    ("wgrad_argnums_str_entry", dict(fns="fn", sample_args=(P, X), wgrad_argnums=("0",)),
     TypeError, r"wgrad_argnums must hold ints \(positional argument indices\), got '0'"),
    ("wgrad_argnums_bool_entry", dict(fns="fn", sample_args=(P, X), wgrad_argnums=(True,)),
     TypeError, r"wgrad_argnums must hold ints"),
    ("wgrad_argnums_too_large", dict(fns="fn", sample_args=(P, X), delay_wgrad=True,
                                     wgrad_argnums=(2,)), ValueError,
     r"sample_args\[0\] has only 2 positional arguments"),
    ("offload_wrong_length", dict(fns="fn", sample_args=(P, X), offload_residuals=[True, False]),
     ValueError, r"offload_residuals takes a bool or one bool per callable \(1\)"),
    ("offload_not_bools", dict(fns=["fn"], sample_args=[(P, X)], offload_residuals=["yes"]),
     TypeError, r"offload_residuals takes a bool"),
    ("offload_int", dict(fns="fn", sample_args=(P, X), offload_residuals=1), TypeError,
     r"offload_residuals takes a bool or one bool per callable \(1\), got 1"),
    ("per_layer_executables_str", dict(fns="fn", sample_args=(P, X),
                                       per_layer_executables="yes"), TypeError,
     r"per_layer_executables must be a bool, got 'yes'"),
    ("compiler_options_list", dict(fns="fn", sample_args=(P, X),
                                   compiler_options=["xla_dump_to"]), TypeError,
     r"compiler_options takes a dict of XLA option names"),
    ("compiler_options_unknown", dict(fns="fn", sample_args=(P, X),
                                      compiler_options={"xla_no_such_option": True}), ValueError,
     r"XLA refuses xla_no_such_option=True \(.*No such compile option"),
    ("compiler_options_bad_value", dict(fns="fn", sample_args=(P, X),
                                        compiler_options={"xla_cpu_enable_fast_math": "maybe"}),
     ValueError, r"XLA refuses xla_cpu_enable_fast_math='maybe' \(.*not a valid bool"),
    ("hooks_int", dict(fns="fn", hooks=3, sample_args=(P, X)), TypeError,
     r"hooks takes jaxgraph.Hooks"),
    ("hooks_function", dict(fns="fn", hooks=print, sample_args=(P, X)), TypeError,
     r"hooks takes jaxgraph.Hooks"),
    ("hooks_dict", dict(fns="fn", hooks={"forward": [print]}, sample_args=(P, X)), TypeError,
     r"not a dict"),
    ("hooks_wrong_length", dict(fns=["fn"], hooks=[SPY, SPY], sample_args=[(P, X)]),
     ValueError, r"hooks has 2 entries but there are 1 callables"),
    ("hooks_element", dict(fns=["fn", "fn"], hooks=[SPY, print], sample_args=[(P, X)] * 2),
     TypeError, r"hooks\[1\] must be jaxgraph.Hooks or None"),
    ("capture_time_hooks_wrong_length", dict(fns="fn", capture_time_hooks=[SPY, SPY],
                                             sample_args=(P, X)),
     ValueError, r"capture_time_hooks has 2 entries"),
    ("capture_time_hooks_int", dict(fns="fn", capture_time_hooks=1, sample_args=(P, X)),
     TypeError, r"capture_time_hooks takes jaxgraph.Hooks"),
    ("rng_without_key_parameter", dict(fns="fn", sample_args=(P, X), rng=True), TypeError,
     r"rng=True, which calls every function with key=\.\.\., but fn \(fns\[0\]\) has no "
     r"key parameter\. Add one \(def fn\(params, x, \*, key\)\), or drop rng=True"),
    ("grad_mask_int_leaf", dict(fns="fn", sample_args=(P, X), grad_mask=({"w": 0, "b": True},
                                                                        True)),
     TypeError, r"grad_mask, for sample_args\[0\]: grad_mask must hold bools \(True: "
     r"gradient\), got 0"),
    ("grad_mask_structure", dict(fns="fn", sample_args=(P, X), grad_mask=({"w": False}, True)),
     ValueError, r"grad_mask, for sample_args\[0\]: grad_mask does not fit the positional "
     r"arguments: it must be a pytree prefix"),
    ("grad_mask_arity", dict(fns="fn", sample_args=(P, X), grad_mask=(False,)), ValueError,
     r"does not fit the positional arguments"),
    ("grad_mask_inference_only", dict(fns="fn", sample_args=(P, X), grad_mask=(False, True),
                                      inference_only=True), ValueError,
     r"inference_only=True together with grad_mask"),
]


@pytest.mark.parametrize("case", MAKE_CASES, ids=[c[0] for c in MAKE_CASES])
def test_make_graphed_rejects_bad_arguments_before_capture(case):
  _, kwargs, exc, pattern = case
  fn, traces = _traced_layer()

  def sub(v):
    if v == "fn":
      return fn
    if isinstance(v, list):
      return [sub(e) for e in v]
    if isinstance(v, dict) and v and all(e == "fn" for e in v.values()):
      return {k: fn for k in v}
    if hasattr(v, "__next__"):
      return (fn for _ in v)
    return v

  kwargs = {k: sub(v) for k, v in kwargs.items()}
  if "hooks" not in kwargs:
    kwargs["hooks"] = SPY
  HOOK_FIRED.clear()
  with pytest.raises(exc, match=pattern):
    jg.make_graphed(kwargs.pop("fns"), kwargs.pop("hooks"), **kwargs)
  assert traces() == 0 and HOOK_FIRED == [] and not jg.is_capturing()
  g = jg.make_graphed(fn, SPY, sample_args=(P, X), num_warmup_iters=1)
  assert traces() == 1 and HOOK_FIRED == ["pre_forward"] * 2
  assert_good_call(g)


@pytest.mark.parametrize("returns", ["abc", object(), [1, "x"]], ids=["str", "object", "list"])
def test_function_returning_non_arrays_is_rejected_at_capture(returns):
  def bad(p, x):
    return returns

  with pytest.raises(TypeError, match=r"not a valid JAX type[\s\S]*while capturing bad\[0\]"):
    jg.make_graphed(bad, sample_args=(P, X))
  assert not jg.is_capturing()
  assert_good_call(jg.make_graphed(layer, sample_args=(P, X), num_warmup_iters=0))


@pytest.mark.parametrize("returns", ["abc", None], ids=["str", "none_ok"])
def test_function_returning_non_arrays_on_a_new_signature(graphed, returns):
  """A new signature whose trace returns a string is refused without caching anything."""
  def sometimes(p, x):
    return returns if x.shape[0] == 3 else layer(p, x)

  g = jg.make_graphed(sometimes, sample_args=(P, X), num_warmup_iters=0)
  before = snapshot(g)
  if returns is None:  # None is an empty pytree: allowed, the output has no leaves
    assert g(P, jnp.ones((3, 4))) is None
    assert g.stats.captures == 2
    return
  with pytest.raises(TypeError, match=r"not a valid JAX type[\s\S]*sometimes\[0\]"):
    g(P, jnp.ones((3, 4)))
  assert snapshot(g) == before
  y_ref, _ = _ref_push(P, X)
  assert bitwise(g(P, X), y_ref)



def test_sample_args_that_do_not_fit_the_function():
  """sample_args of the wrong arity or shape for the function: the trace error, with notes
  naming the callable, its sample_args entry and the signature."""
  fn, traces = _traced_layer()
  # (sample_args[1], message, traces so far: layer 0 traces each time; layer 1's body runs
  # only when the arity fits)
  cases = [((P,), r"missing 1 required positional argument", 1),
           ((P, X, X), r"takes 2 positional arguments but 3 were given", 2),
           ((P, jnp.ones((2, 5))), r"dot_general requires contracting dimensions", 4)]
  for args, pattern, expected_traces in cases:
    with pytest.raises(TypeError, match=pattern) as info:
      jg.make_graphed([fn, fn], sample_args=[(P, X), args], num_warmup_iters=0)
    notes = "\n".join(info.value.__notes__)
    assert "while capturing fn[1] from sample_args[1]" in notes
    assert "for a new input signature: args[0]['b']: float32[4]" in notes
    assert not jg.is_capturing()
    assert traces() == expected_traces
  assert_good_call(jg.make_graphed(fn, sample_args=(P, X), num_warmup_iters=0))


def test_numpy_counts_and_bools_are_taken_like_python_ones():
  """A count or a flag read from a config as a numpy scalar is an int or a bool."""
  g = jg.make_graphed(layer, sample_args=(P, X), num_warmup_iters=np.int64(1),
                      max_captures=np.int32(2), per_layer_executables=np.bool_(False))
  assert g.stats.captures == 1
  assert jnp.array_equal(g(P, X), layer(P, X))


# -------------------------------------------------------- a new user's first mistakes


def test_make_graphed_under_jit_says_to_call_it_outside():
  def step(p, x):
    return jg.make_graphed(layer, sample_args=(p, x), num_warmup_iters=0)(p, x)

  with pytest.raises(TypeError) as info:
    jax.jit(step)(P, X)
  assert str(info.value).startswith(
      "sample_args[0]: argument args[0]['b'] is a tracer: make_graphed was called inside "
      "jax.jit, jax.grad or jax.vmap")
  assert "make_graphed runs outside JAX transformations, on concrete sample_args" in str(
      info.value)
  assert not jg.is_capturing()


def test_a_closed_over_leaked_tracer_is_named_as_one():
  leaked = []
  jax.jit(lambda a: leaked.append(a) or a)(jnp.ones(3))

  def leaky(p, x):
    return layer(p, x) + leaked[0].sum()

  with pytest.raises(jax.errors.UnexpectedTracerError) as info:
    jg.make_graphed(leaky, sample_args=(P, X), num_warmup_iters=0)
  assert str(info.value).startswith(
      "leaky[0] closes over a JAX tracer (float32[3]), not an array: a value of a jax.jit, "
      "jax.grad or jax.vmap trace, leaked from a trace that has ended")
  assert "pass the value as an argument" in str(info.value)
  assert "while capturing leaky[0] from sample_args[0]" in message(info.value)
  assert not jg.is_capturing()


def test_a_key_parameter_without_rng_names_rng_true():
  fn, traces = _traced_layer()

  def block_key(p, x, *, key):
    return fn(p, x)

  with pytest.raises(TypeError, match=r"block_key \(fns\[0\]\) takes a key= parameter, but "
                                      r"make_graphed was called without rng=True[\s\S]*"
                                      r"Pass make_graphed\(\.\.\., rng=True\)"):
    jg.make_graphed(block_key, sample_args=(P, X))
  assert traces() == 0
  # A key with a default, or one given positionally, is not asked for.
  jg.make_graphed(lambda p, x, key=None: fn(p, x), sample_args=(P, X), num_warmup_iters=0)
  jg.make_graphed(lambda p, x, key: fn(p, x), sample_args=(P, X, jnp.ones(())),
                  num_warmup_iters=0)
  assert traces() == 2


def _flax_modules():
  from flax import linen as nn
  from flax import nnx

  x = jnp.ones((2, 4))
  linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  dense = nn.Dense(4)
  variables = dense.init(jax.random.key(0), x)
  return x, [("nnx", linear, "fns", "nnx_layer(module)"),
             ("nnx_list", [linear, linear], "fns[0]", "nnx_layer(module)"),
             ("nnx_method", linear.__call__, "fns", "nnx_layer(module)"),
             ("linen", dense, "fns", "linen_layer(module, variables)"),
             ("linen_bound", dense.bind(variables), "fns", "linen_layer(module, variables)")]


@pytest.mark.parametrize("case", range(5), ids=["nnx", "nnx_list", "nnx_method", "linen",
                                                 "linen_bound"])
def test_a_flax_module_is_refused_with_its_adapter(case):
  """A module's weights would be constants of the executables (no gradient, updates
  unseen): refused before anything is traced, naming the adapter that splits it."""
  x, cases = _flax_modules()
  _, fns, where, split = cases[case]
  samples = [(x,)] * len(fns) if isinstance(fns, list) else (x,)
  with pytest.raises(TypeError) as info:
    jg.make_graphed(fns, sample_args=samples)
  text = str(info.value)
  assert re.match(rf"make_graphed got (a|a method of a) Flax (NNX|Linen) module .* as "
                  rf"{re.escape(where)}\.", text), text
  assert f"jaxgraph.flax.{split}" in text and "no gradient" in text
  assert not jg.is_capturing()
  # Linen's own apply takes the variables as an argument: it is a pure function, accepted.
  if cases[case][0] == "linen":
    variables = fns.init(jax.random.key(0), x)
    g = jg.make_graphed(fns.apply, sample_args=(variables, x), num_warmup_iters=0)
    assert bitwise(g(variables, x), fns.apply(variables, x))
