"""Threads. The decision (_graphed.py, docs/reliability.md): different GraphedCallables may
replay from different threads at the same time; concurrent or reentrant use of one
GraphedCallable (a forward, or a backward of one of its pullbacks) is refused with a clear
RuntimeError, never silently raced. Contention is made deterministic with a hook that blocks
on an Event while the other thread calls."""

from __future__ import annotations

import threading
from typing import Any, Callable

import jax
import numpy as np
import pytest

import jaxgraph as jg
from test_bad_input import CT, P, X, bitwise, layer

TIMEOUT = 60.0


def keyed_layer(p, x, *, key):
  return layer(p, x) * jax.random.bernoulli(key, 0.5, x.shape)


class Worker(threading.Thread):
  """Runs `fn` in a thread, keeps its result or exception."""

  def __init__(self, fn: Callable[[], Any]):
    super().__init__(daemon=True)
    self.fn, self.result, self.error = fn, None, None

  def run(self) -> None:
    try:
      self.result = self.fn()
    except BaseException as e:  # noqa: BLE001 - reported by the test
      self.error = e

  def finish(self) -> Any:
    self.join(TIMEOUT)
    assert not self.is_alive(), "worker thread hung"
    if self.error is not None:
      raise self.error
    return self.result


_push = jax.jit(lambda p, x: jax.vjp(layer, p, x))
_pull = jax.jit(lambda v, c: v(c))


def _inputs(i: int) -> tuple[Any, Any]:
  return jax.tree.map(lambda a: a * (1 + i / 8), P), X + i / 16


# ------------------------------------------------------------ different callables: allowed

@pytest.mark.parametrize("shared_function", [True, False], ids=["shared_cache", "separate"])
def test_two_threads_replaying_different_callables(shared_function):
  fns = [layer, layer] if shared_function else [layer, lambda p, x: layer(p, x)]
  layers = jg.make_graphed(fns, sample_args=[(P, X)] * 2, num_warmup_iters=1)
  steps, barrier = 200, threading.Barrier(2)

  def loop(g):
    barrier.wait(TIMEOUT)
    out = []
    for i in range(steps):
      p, x = _inputs(i % 4)
      y, pull = g.vjp(p, x)
      out.append((y, pull(CT), g(p, x)))
    return out

  workers = [Worker(lambda g=g: loop(g)) for g in layers]
  for w in workers:
    w.start()
  results = [w.finish() for w in workers]
  refs = []
  for i in range(4):
    p, x = _inputs(i)
    y, v = _push(p, x)
    refs.append((y, _pull(v, CT), y))
  for out in results:
    for i, got in enumerate(out):
      assert bitwise(got, refs[i % 4])
  for g in layers:
    assert g.stats.replays == 2 * steps and g.stats.backward_replays == steps
  assert sum(g.stats.captures for g in layers) == (1 if shared_function else 2)


def test_threads_with_key_streams_match_a_serial_run():
  """Each callable's own key stream advances per callable: the interleaving of threads
  does not change which key a replay draws."""
  steps = 50

  def build():
    return jg.make_graphed([keyed_layer] * 3, sample_args=[(P, X)] * 3, num_warmup_iters=1,
                           rng=True)

  serial = build()
  want = [[np.asarray(g.vjp(P, X)[0]) for _ in range(steps)] for g in serial]
  threaded = build()
  barrier = threading.Barrier(3)

  def loop(g):
    barrier.wait(TIMEOUT)
    return [np.asarray(g.vjp(P, X)[0]) for _ in range(steps)]

  workers = [Worker(lambda g=g: loop(g)) for g in threaded]
  for w in workers:
    w.start()
  got = [w.finish() for w in workers]
  assert all(bitwise(a, b) for a, b in zip(got, want))
  assert [g.rng_counter for g in threaded] == [steps] * 3


# ------------------------------------------------------------------ one callable: refused

class Blocker:
  """A hook that, when armed, signals `entered` and waits for `release`."""

  def __init__(self):
    self.armed = False
    self.entered, self.release = threading.Event(), threading.Event()

  def __call__(self, event) -> None:
    if self.armed and event.phase == "replay":
      self.armed = False
      self.entered.set()
      assert self.release.wait(TIMEOUT), "never released"


CONTENDERS = {
    "call": lambda g, pull: g(P, X),
    "vjp": lambda g, pull: g.vjp(P, X),
    "pullback": lambda g, pull: pull(CT),
    "wgrad": lambda g, pull: pull.wgrad(),
}


@pytest.mark.parametrize("contender", sorted(CONTENDERS))
@pytest.mark.parametrize("blocked_in", ["pre_forward", "forward", "pre_backward", "backward"])
def test_concurrent_use_of_one_callable_is_refused(blocked_in, contender):
  blocker = Blocker()
  g = jg.make_graphed(layer, jg.Hooks(**{blocked_in: [blocker]}), sample_args=(P, X),
                      num_warmup_iters=1, delay_wgrad=contender == "wgrad")
  # A pullback the contender may use, from an earlier forward (its backward already run for
  # "wgrad", which needs it).
  _, spare = g.vjp(P, X)
  if contender == "wgrad":
    spare(CT)
  y, pull = g.vjp(P, X)
  blocker.armed = True
  if blocked_in in ("pre_forward", "forward"):
    worker = Worker(lambda: g.vjp(P, X)[0])
  else:
    worker = Worker(lambda: pull(CT))
  worker.start()
  assert blocker.entered.wait(TIMEOUT)
  before = g.stats
  try:
    with pytest.raises(RuntimeError, match=r"layer\[0\] is already running in another thread"
                                           r".*not reentrant"):
      CONTENDERS[contender](g, spare)
    assert g.stats == before   # the refused call counted nothing
  finally:
    blocker.release.set()
  result = worker.finish()
  y_ref, v = _push(P, X)
  if blocked_in in ("pre_forward", "forward"):
    assert bitwise(result, y_ref)
  else:
    want = _pull(v, CT)
    if contender == "wgrad":
      assert bitwise(result[1], want[1]) and result[0] is None
    else:
      assert bitwise(result, want)
  # After the contention: the refused spare pullback is still usable, the callable works.
  if contender != "wgrad":
    assert bitwise(spare(CT), _pull(v, CT))
  y, pull = g.vjp(P, X)
  assert bitwise(y, y_ref)


def test_reentrant_call_from_a_hook_is_refused():
  calls = []
  g = None

  def reenter(event):
    if event.phase == "replay":
      with pytest.raises(RuntimeError, match=r"already running"):
        g(P, X)
      calls.append(event.index)

  g = jg.make_graphed(layer, jg.Hooks(pre_forward=[reenter]), sample_args=(P, X),
                      num_warmup_iters=0)
  y = g(P, X)
  assert calls == [0]
  assert bitwise(y, _push(P, X)[0])
  assert g.stats.replays == 1


def test_is_capturing_is_per_thread():
  """A thread replaying while another thread runs make_graphed does not see a capture."""
  blocker = Blocker()
  seen = {}

  def capture_hook(event):
    seen.setdefault("capture_thread", jg.is_capturing())
    if event.phase == "capture":
      blocker.entered.set()
      assert blocker.release.wait(TIMEOUT)

  g = jg.make_graphed(layer, sample_args=(P, X), num_warmup_iters=0)
  worker = Worker(lambda: jg.make_graphed(layer, capture_time_hooks=jg.Hooks(
      pre_forward=[capture_hook]), sample_args=(P, X), num_warmup_iters=0))
  worker.start()
  assert blocker.entered.wait(TIMEOUT)
  try:
    observed = []
    g2 = jg.make_graphed(layer, jg.Hooks(pre_forward=[
        lambda e: observed.append((e.phase, jg.is_capturing()))]), sample_args=(P, X),
        num_warmup_iters=0)
    g2(P, X)
    assert not jg.is_capturing()
    assert observed == [("capture", True), ("replay", False)]
  finally:
    blocker.release.set()
  other = worker.finish()
  assert seen["capture_thread"] is True
  assert bitwise(other(P, X), _push(P, X)[0]) and bitwise(g(P, X), _push(P, X)[0])
