"""Hooks: TE's capture-time hook order and counts, replay hooks, warmup hooks, failures."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax._src import core as jax_core

import jaxgraph as jg
from models import init_mlp, mlp, trees_equal

D, H, T = 8, 16, 4
KINDS = ("pre_forward", "forward", "pre_backward", "backward")
ONE_ITERATION = [(0, "pre_forward"), (0, "forward"), (1, "pre_forward"), (1, "forward"),
                 (1, "pre_backward"), (1, "backward"), (0, "pre_backward"), (0, "backward")]


def _recorder(log, tag=None):
  def make(kind):
    def hook(event):
      assert jax_core.trace_state_clean(), "hooks must run outside any trace"
      assert isinstance(event, jg.HookEvent)
      log.append((event.index, kind) if tag is None else (tag, event.index, kind, event.phase))
    return hook
  return jg.Hooks(**{kind: [make(kind)] for kind in KINDS})


def _two_layers(**kwargs):
  params = [init_mlp(k, D, H) for k in jax.random.split(jax.random.key(0), 2)]
  x = jnp.ones((T, D))
  layers = jg.make_graphed([mlp, mlp], sample_args=[(p, x) for p in params], **kwargs)
  return layers, params, x


def _step(layers, params, x):
  y, pullback = jg.sequential_vjp(layers, params, x)
  return pullback(jnp.ones_like(y))


@pytest.mark.parametrize("num_warmup_iters", [0, 1, 3])
def test_capture_time_hooks_te_order_and_counts(num_warmup_iters):
  log = []
  warm = []
  layers, params, x = _two_layers(
      capture_time_hooks=[_recorder(log), _recorder(log)], num_warmup_iters=num_warmup_iters,
      pre_warmup_hook=lambda: warm.append("pre"), post_warmup_hook=lambda: warm.append("post"))
  assert log == ONE_ITERATION * (num_warmup_iters + 1)
  assert warm == ["pre", "post"]  # once each around the whole warmup, not per callable
  log.clear()
  for _ in range(3):
    _step(layers, params, x)
  assert log == [], "capture-time hooks never fire on replay"


def test_replay_hooks_fire_in_every_phase():
  log = []
  layers, params, x = _two_layers(hooks=_recorder(log, tag="r"), num_warmup_iters=2)
  phases = [entry[3] for entry in log]
  assert phases == ["capture"] * 8 + ["warmup"] * 16
  log.clear()
  _step(layers, params, x)
  _step(layers, params, x)
  assert [(i, k) for _, i, k, _ in log] == ONE_ITERATION * 2
  assert {p for *_, p in log} == {"replay"}


def test_capture_time_hooks_run_before_replay_hooks():
  log = []
  _two_layers(hooks=_recorder(log, tag="replay"), capture_time_hooks=_recorder(log, tag="ct"),
              num_warmup_iters=0)
  assert [t for t, *_ in log[:2]] == ["ct", "replay"]


def test_events_carry_the_callables_own_pytrees():
  events = []
  record = lambda e: events.append(e)
  hooks = jg.Hooks(pre_forward=[record], forward=[record], pre_backward=[record],
                   backward=[record])

  def f(p, x):
    return {"y": mlp(p, x), "aux": (x.sum(), None)}

  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  g = jg.make_graphed(f, hooks, sample_args=(params, x), num_warmup_iters=1)
  by_phase = {}
  for e in events:
    by_phase.setdefault(e.phase, []).append(e)
  events.clear()
  out, pullback = g.vjp(params, x)
  ct = jax.tree.map(jnp.ones_like, out)
  grads = pullback(ct)
  by_phase["replay"] = events
  structure = jax.tree.structure(out)
  for phase in ("capture", "warmup", "replay"):
    pre_f, fwd, pre_b, bwd = by_phase[phase]
    assert pre_f.outputs is None and pre_f.args is not None
    assert jax.tree.structure(fwd.outputs) == structure, phase
    assert jax.tree.structure(pre_b.cotangents) == structure, phase
    assert bwd.grads is not None and len(bwd.grads) == 2
  capture_out = by_phase["capture"][1].outputs
  assert isinstance(capture_out["y"], jax.ShapeDtypeStruct)
  assert trees_equal(by_phase["replay"][1].outputs, out)
  assert trees_equal(by_phase["replay"][3].grads, grads)
  assert by_phase["replay"][0].args[1] is x
  assert by_phase["replay"][0].iteration == 0 and by_phase["replay"][0].microbatch == 0


def test_python_side_effects_run_at_capture_only():
  calls = []

  def f(p, x):
    calls.append("traced")
    return mlp(p, x)

  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  g = jg.make_graphed(f, sample_args=(params, x), num_warmup_iters=3)
  assert calls == ["traced"]
  for _ in range(3):
    y, pullback = g.vjp(params, x)
    pullback(y)
  assert calls == ["traced"]


def test_is_capturing_only_during_warmup_and_capture():
  seen = []
  hook = lambda e: seen.append((e.phase, jg.is_capturing()))
  layers, params, x = _two_layers(hooks=jg.Hooks(pre_forward=[hook]), num_warmup_iters=1)
  assert not jg.is_capturing()
  _step(layers, params, x)
  assert {phase: flag for phase, flag in seen} == {"capture": True, "warmup": True,
                                                   "replay": False}


class Boom(Exception):
  pass


def _raise_in(phase, kind):
  def hook(event):
    if event.phase == phase:
      raise Boom(f"{phase} {kind}")
  return jg.Hooks(**{kind: [hook]})


@pytest.mark.parametrize("phase", ["capture", "warmup"])
@pytest.mark.parametrize("kind", KINDS)
def test_hook_raising_during_make_graphed(phase, kind):
  with pytest.raises(Boom) as info:
    _two_layers(hooks=_raise_in(phase, kind), num_warmup_iters=1)
  assert any(f"{kind} hook" in note and phase in note for note in info.value.__notes__)
  assert not jg.is_capturing()
  # Retrying works and gives correct results.
  layers, params, x = _two_layers(num_warmup_iters=1)
  grads, _ = _step(layers, params, x)
  assert grads[0]["w1"].shape == (D, H)


@pytest.mark.parametrize("phase", ["capture", "warmup"])
def test_post_warmup_hook_undoes_pre_warmup_hook_when_make_graphed_raises(phase):
  """A pair of warmup hooks that turns something off and back on (docs/migration.md) leaves
  it on however make_graphed ends: post_warmup_hook runs when the warmup raises, and
  neither runs when the capture before them raises."""
  switched = []
  with pytest.raises(Boom):
    _two_layers(hooks=_raise_in(phase, "backward"), num_warmup_iters=1,
                pre_warmup_hook=lambda: switched.append("off"),
                post_warmup_hook=lambda: switched.append("on"))
  assert switched == ([] if phase == "capture" else ["off", "on"])
  assert not jg.is_capturing()


def test_post_warmup_hook_does_not_run_when_pre_warmup_hook_raises():
  calls = []

  def pre():
    calls.append("pre")
    raise Boom("pre")

  with pytest.raises(Boom):
    _two_layers(num_warmup_iters=1, pre_warmup_hook=pre,
                post_warmup_hook=lambda: calls.append("post"))
  assert calls == ["pre"]


def test_a_raising_post_warmup_hook_does_not_hide_the_warmup_error():
  """The warmup's own error is the one raised; the hook's is a note on it."""

  def post():
    raise ValueError("post")

  with pytest.raises(Boom) as info:
    _two_layers(hooks=_raise_in("warmup", "backward"), num_warmup_iters=1,
                post_warmup_hook=post)
  assert any("post_warmup_hook raised too" in note for note in info.value.__notes__)
  assert not jg.is_capturing()


@pytest.mark.parametrize("kind", KINDS)
def test_hook_raising_during_replay_leaves_callable_usable(kind):
  fail = [True]

  def hook(event):
    if event.phase == "replay" and fail[0]:
      raise Boom(kind)

  layers, params, x = _two_layers(hooks=jg.Hooks(**{kind: [hook]}), num_warmup_iters=0)
  with pytest.raises(Boom) as info:
    _step(layers, params, x)
  assert any(f"{kind} hook" in note for note in info.value.__notes__)
  assert not jg.is_capturing()
  fail[0] = False
  stats = [l.stats.captures for l in layers]
  reference = jg.make_graphed([mlp, mlp], sample_args=[(p, x) for p in params],
                              num_warmup_iters=0)
  assert trees_equal(_step(layers, params, x), _step(reference, params, x))
  assert [l.stats.captures for l in layers] == stats  # no recapture was needed


def test_function_raising_during_capture_keeps_no_entry():
  calls = []

  def flaky(p, x):
    calls.append(1)
    if len(calls) == 1:
      raise Boom("first trace fails")
    return mlp(p, x)

  params = init_mlp(jax.random.key(0), D, H)
  x = jnp.ones((T, D))
  with pytest.raises(Boom) as info:
    jg.make_graphed(flaky, sample_args=(params, x))
  assert any("while capturing flaky[0]" in note for note in info.value.__notes__)
  assert not jg.is_capturing()
  g = jg.make_graphed(flaky, sample_args=(params, x), num_warmup_iters=1)
  assert trees_equal(g(params, x), jax.jit(mlp)(params, x))


def test_hook_returning_a_value_is_an_error_naming_it():
  def sneaky(event):
    return event.args

  with pytest.raises(TypeError, match=r"forward hook .*sneaky.* returned tuple; hooks must "
                                      r"return None"):
    _two_layers(hooks=jg.Hooks(forward=[sneaky]))
  assert not jg.is_capturing()


def test_hooks_validation():
  with pytest.raises(TypeError, match=r"unknown hook kind 'forward_pre'.*Did you mean"):
    jg.Hooks(forward_pre=[print])
  with pytest.raises(TypeError, match="takes a list of hooks, got a dict"):
    jg.Hooks(forward={"id": print})
  with pytest.raises(TypeError, match="must hold callables"):
    jg.Hooks(forward=[1])
  with pytest.raises(ValueError, match="hooks has 3 entries but there are 2 callables"):
    _two_layers(hooks=[jg.Hooks(), jg.Hooks(), jg.Hooks()])
  with pytest.raises(TypeError, match="not a dict"):
    _two_layers(capture_time_hooks={"forward_hooks": {}})
  with pytest.raises(TypeError, match="pre_warmup_hook must be a callable"):
    _two_layers(pre_warmup_hook=3)
