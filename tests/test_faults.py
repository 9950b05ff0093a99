"""Fault injection: exceptions and KeyboardInterrupt in the function during capture, in every
hook kind at every phase, in the compiler, and in the middle of `sequential_vjp`.

After each fault: `is_capturing()` is False, no half-built executable is cached (the
callable's signatures, the shared cache and the stats are what they were), and the next call,
or a retried `make_graphed`, works and is bitwise-correct.
"""

from __future__ import annotations

import gc
import threading

import jax
import jax.numpy as jnp
import pytest

import jaxgraph as jg
from test_bad_input import CT, P, X, assert_good_call, bitwise, layer, snapshot

FAULTS = [RuntimeError, KeyboardInterrupt]
HOOK_KINDS = ["pre_forward", "forward", "pre_backward", "backward"]


class Boom(RuntimeError):
  pass


def _raise(exc: type[BaseException], where: str):
  raise (Boom if exc is RuntimeError else exc)(f"injected fault in {where}")


def _caught(exc: type[BaseException]) -> type[BaseException]:
  return Boom if exc is RuntimeError else exc


class Trigger:
  """Raises `exc` the first `times` times it is armed and called; counts every call."""

  def __init__(self, exc: type[BaseException], times: int = 1):
    self.exc, self.times, self.calls, self.fired = exc, times, 0, 0

  def __call__(self, where: str) -> None:
    self.calls += 1
    if self.fired < self.times:
      self.fired += 1
      _raise(self.exc, where)


# ------------------------------------------------------------------- the function, capture

@pytest.mark.parametrize("exc", FAULTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("failing", [0, 2], ids=["first_layer", "last_layer"])
def test_fault_in_function_during_make_graphed(exc, failing):
  trigger = Trigger(exc)
  traces = [0, 0, 0]

  def make(i):
    def fn(p, x):
      traces[i] += 1
      if i == failing:
        trigger(f"fn{i}")
      return layer(p, x)
    fn.__name__ = f"fn{i}"
    return fn

  fns = [make(i) for i in range(3)]
  hook_phases = []
  hooks = jg.Hooks(pre_forward=[lambda e: hook_phases.append((e.index, e.phase,
                                                             jg.is_capturing()))])
  with pytest.raises(_caught(exc)) as info:
    jg.make_graphed(fns, hooks, sample_args=[(P, X)] * 3, num_warmup_iters=1)
  assert not jg.is_capturing()
  if exc is RuntimeError:
    assert f"while capturing fn{failing}[{failing}]" in "\n".join(info.value.__notes__)
  assert traces == [1] * (failing + 1) + [0] * (2 - failing)
  assert all(capturing for _, _, capturing in hook_phases)
  # A retry works: every function traced once more, then replays are bitwise.
  layers = jg.make_graphed(fns, hooks, sample_args=[(P, X)] * 3, num_warmup_iters=1)
  assert not jg.is_capturing()
  assert traces == [2] * (failing + 1) + [1] * (2 - failing)
  for g in layers:
    assert_good_call(g)
    assert g.stats.captures == 1


@pytest.mark.parametrize("exc", FAULTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("call", ["call", "vjp"])
def test_fault_in_function_capturing_a_new_signature(exc, call):
  trigger = Trigger(exc, times=0)

  def fn(p, x):
    if x.shape[0] == 3:
      trigger("fn")
    return layer(p, x)

  g = jg.make_graphed(fn, sample_args=(P, X), num_warmup_iters=1)
  trigger.times = 1
  x3 = jnp.ones((3, 4))
  before = snapshot(g)
  with pytest.raises(_caught(exc)):
    getattr(g, "__call__" if call == "call" else "vjp")(P, x3)
  assert snapshot(g) == before
  assert len(g.executables.entries) == 1 and len(g.config.cache) == 1
  assert_good_call(g)
  # The signature that failed is captured cleanly when tried again.
  y = g(P, x3)
  assert bitwise(y, jax.jit(layer)(P, x3))
  assert g.stats.captures == 2 and len(g.executables.entries) == 2 and len(g.config.cache) == 2


@pytest.mark.parametrize("exc", FAULTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("nth", [1, 2], ids=["first_compile", "second_compile"])
def test_fault_in_the_compiler_leaves_no_half_built_entry(monkeypatch, exc, nth):
  g = jg.make_graphed(layer, sample_args=(P, X), num_warmup_iters=0)
  real = jax.stages.Lowered.compile
  trigger, lock, count = Trigger(exc), threading.Lock(), [0]

  def flaky(self, *args, **kwargs):
    with lock:   # capture may compile its executables concurrently
      count[0] += 1
      fire = count[0] == nth
    if fire:
      trigger("compile")
    return real(self, *args, **kwargs)

  monkeypatch.setattr(jax.stages.Lowered, "compile", flaky)
  x3 = jnp.ones((3, 4))
  before = snapshot(g)
  with pytest.raises(_caught(exc)):
    g.vjp(P, x3)
  assert snapshot(g) == before          # the forward compiled, but nothing was cached
  y, pull = g.vjp(P, x3)
  y_ref, v = jax.jit(lambda p, x: jax.vjp(layer, p, x))(P, x3)
  assert bitwise(y, y_ref)
  assert bitwise(pull(jnp.ones((3, 4))), jax.jit(lambda v, c: v(c))(v, jnp.ones((3, 4))))
  assert g.stats.captures == 2


def _fail_next_compile(monkeypatch, exc, where: str) -> None:
  """Makes the next XLA compile raise `exc` (the `Trigger`'s), later ones succeed."""
  real = jax.stages.Lowered.compile
  trigger = Trigger(exc)

  def flaky(self, *args, **kwargs):
    trigger(where)
    return real(self, *args, **kwargs)

  monkeypatch.setattr(jax.stages.Lowered, "compile", flaky)


@pytest.mark.parametrize("exc", FAULTS, ids=lambda e: e.__name__)
def test_fault_compiling_the_inference_forward(monkeypatch, exc):
  g = jg.make_graphed(layer, sample_args=(P, X), num_warmup_iters=0)
  _fail_next_compile(monkeypatch, exc, "inference compile")
  before = snapshot(g)
  with pytest.raises(_caught(exc)):
    g(P, X)
  assert snapshot(g) == before
  assert ("explicit", False) not in g.executables.entries[next(iter(g.executables.entries))].forward
  assert_good_call(g)
  assert g.stats.compiles == before[0].compiles + 1


@pytest.mark.parametrize("exc", FAULTS, ids=lambda e: e.__name__)
def test_fault_in_an_inference_only_capture_leaves_no_half_built_entry(monkeypatch, exc):
  g = jg.make_graphed(layer, sample_args=(P, X), num_warmup_iters=0, inference_only=True)
  _fail_next_compile(monkeypatch, exc, "inference-only compile")
  x3 = jnp.ones((3, 4))
  before = snapshot(g)
  with pytest.raises(_caught(exc)):
    g(P, x3)
  assert snapshot(g) == before
  assert bitwise(g(P, x3), jax.jit(layer)(P, x3))  # the retry captures it cleanly
  assert g.stats.captures == 2 and g.stats.compiles == 2


# -------------------------------------------------------------------------------- hooks

def _hooks_raising(kind: str, phase: str, trigger: Trigger, seen: list) -> jg.Hooks:
  def hook(event):
    seen.append((kind, event.phase, jg.is_capturing()))
    if event.phase == phase:
      trigger(f"{kind} hook")

  return jg.Hooks(**{kind: [hook]})


@pytest.mark.parametrize("exc", FAULTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("phase", ["capture", "warmup"])
@pytest.mark.parametrize("kind", HOOK_KINDS)
@pytest.mark.parametrize("argument", ["hooks", "capture_time_hooks"])
def test_fault_in_a_hook_during_make_graphed(exc, phase, kind, argument):
  trigger, seen = Trigger(exc), []
  hooks = _hooks_raising(kind, phase, trigger, seen)
  with pytest.raises(_caught(exc)) as info:
    jg.make_graphed([layer, layer], sample_args=[(P, X)] * 2, num_warmup_iters=2,
                    **{argument: hooks})
  assert not jg.is_capturing()
  assert trigger.fired == 1
  assert seen and all(capturing for _, _, capturing in seen)
  if exc is RuntimeError:
    assert f"raised by {kind} hook" in "\n".join(info.value.__notes__)
  layers = jg.make_graphed([layer, layer], sample_args=[(P, X)] * 2, num_warmup_iters=2,
                           **{argument: hooks})
  assert not jg.is_capturing()
  # Capture fires each kind once per callable, warmup once per callable and iteration.
  assert sum(1 for _, p, _ in seen if p in ("capture", "warmup")) >= 6
  for g in layers:
    assert_good_call(g)


@pytest.mark.parametrize("exc", FAULTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("which", ["pre_warmup_hook", "post_warmup_hook"])
def test_fault_in_warmup_hook(exc, which):
  trigger = Trigger(exc)
  with pytest.raises(_caught(exc)):
    jg.make_graphed(layer, sample_args=(P, X), num_warmup_iters=1,
                    **{which: lambda: trigger(which)})
  assert not jg.is_capturing()
  g = jg.make_graphed(layer, sample_args=(P, X), num_warmup_iters=1,
                      **{which: lambda: trigger(which)})
  assert trigger.calls == 2
  assert_good_call(g)


@pytest.mark.parametrize("exc", FAULTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("kind", HOOK_KINDS)
def test_fault_in_a_hook_during_replay(exc, kind):
  trigger, seen = Trigger(exc, times=0), []
  g = jg.make_graphed(layer, _hooks_raising(kind, "replay", trigger, seen), sample_args=(P, X),
                      num_warmup_iters=1)
  trigger.times = 1
  before = snapshot(g)
  pull = None
  with pytest.raises(_caught(exc)):
    _, pull = g.vjp(P, X)
    pull(CT)
  assert not jg.is_capturing()
  stats = g.stats
  if kind == "pre_forward":      # refused before the forward: nothing happened
    assert snapshot(g) == before and pull is None
  elif kind == "forward":        # the forward ran (and is counted); its pullback is lost
    assert stats.replays == before[0].replays + 1 and pull is None
  elif kind == "pre_backward":   # refused before the backward: the pullback is still usable
    assert stats.backward_replays == before[0].backward_replays
    _, v = jax.jit(lambda p, x: jax.vjp(layer, p, x))(P, X)
    assert bitwise(pull(CT), jax.jit(lambda v, c: v(c))(v, CT))
  else:                          # the backward ran; its grads went to the failing hook
    assert stats.backward_replays == before[0].backward_replays + 1
    with pytest.raises(RuntimeError, match="already called"):
      pull(CT)
  assert g.stats.captures == 1 and g.stats.fallbacks == 0
  assert g._busy.acquire(blocking=False)   # the non-reentrancy lock was released
  g._busy.release()
  assert_good_call(g)


# -------------------------------------------------------------------------- sequential_vjp

def _stack(depth, hooks):
  return jg.make_graphed([layer] * depth, hooks, sample_args=[(P, X)] * depth,
                         num_warmup_iters=0)


def _reference(depth):
  push = jax.jit(lambda p, x: jax.vjp(layer, p, x))
  pull = jax.jit(lambda v, c: v(c))
  x, vs = X, []
  for _ in range(depth):
    x, v = push(P, x)
    vs.append(v)
  ct, grads = CT, [None] * depth
  for i in reversed(range(depth)):
    grads[i], ct = pull(vs[i], ct)
  return x, grads, ct


@pytest.mark.parametrize("exc", FAULTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("at", [0, 2, 3])
def test_fault_in_the_middle_of_sequential_vjp_forward(exc, at):
  depth, trigger = 4, Trigger(exc, times=0)

  def hook(event):
    if event.index == at and event.phase == "replay":
      trigger("layer forward")

  layers = _stack(depth, jg.Hooks(pre_forward=[hook]))
  params = [P] * depth
  jax.block_until_ready(jg.sequential_vjp(layers, params, X)[0])  # not armed yet
  gc.collect()
  live = len(jax.live_arrays())
  trigger.times = 1
  with pytest.raises(_caught(exc)):
    jg.sequential_vjp(layers, params, X)
  gc.collect()
  assert len(jax.live_arrays()) <= live   # the dropped pullbacks kept nothing alive
  assert not jg.is_capturing()
  # Layers before the fault replayed twice, the failing one and those after it once.
  assert [l.stats.replays for l in layers] == [2] * at + [1] * (depth - at)
  y, pull = jg.sequential_vjp(layers, params, X)
  grads, g_x = pull(CT)
  y_ref, grads_ref, g_x_ref = _reference(depth)
  assert bitwise(y, y_ref) and bitwise(grads, grads_ref) and bitwise(g_x, g_x_ref)


@pytest.mark.parametrize("exc", FAULTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("at", [0, 1, 3])
def test_fault_in_the_middle_of_sequential_vjp_backward(exc, at):
  depth, trigger = 4, Trigger(exc, times=0)

  def hook(event):
    if event.index == at and event.phase == "replay":
      trigger("layer backward")

  layers = _stack(depth, jg.Hooks(pre_backward=[hook]))
  trigger.times = 1
  y, pull = jg.sequential_vjp(layers, [P] * depth, X)
  with pytest.raises(_caught(exc)):
    pull(CT)
  assert not jg.is_capturing()
  assert [l.stats.backward_replays for l in layers] == [0] * (at + 1) + [1] * (depth - at - 1)
  if at == depth - 1:  # nothing ran yet: the same pullback can be retried
    grads, g_x = pull(CT)
    _, grads_ref, g_x_ref = _reference(depth)
    assert bitwise(grads, grads_ref) and bitwise(g_x, g_x_ref)
  else:                # part of the stack ran: refused with a clear error
    with pytest.raises(RuntimeError, match=rf"failed part-way.*layers\[{at}\]"):
      pull(CT)
  y, pull = jg.sequential_vjp(layers, [P] * depth, X)
  grads, g_x = pull(CT)
  y_ref, grads_ref, g_x_ref = _reference(depth)
  assert bitwise(y, y_ref) and bitwise(grads, grads_ref) and bitwise(g_x, g_x_ref)
  with pytest.raises(RuntimeError, match=r"already called"):
    pull(CT)


def test_is_capturing_is_true_only_inside_make_graphed():
  seen = []
  hooks = jg.Hooks(pre_forward=[lambda e: seen.append((e.phase, jg.is_capturing()))])
  assert not jg.is_capturing()
  g = jg.make_graphed(layer, hooks, sample_args=(P, X), num_warmup_iters=1)
  g(P, X)
  assert seen == [("capture", True), ("warmup", True), ("replay", False)]
