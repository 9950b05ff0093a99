"""Tokens/s: the training loop's rounds of steps between device syncs (`RoundTimer`), and
--check's alternating rounds of the graphed and the whole step (`throughput_rounds`)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import jax

from examples.corpus import Corpus

from .data import step_batches
from .layers import Params
from .trainer import Stepper


class RoundTimer:
  """The training loop's tokens/s, measured as `throughput_rounds` measures: rounds of
  `round_steps` steps between device syncs; the first round (the warm-up after capture or
  resume) not counted; evaluation and checkpoints paused out of the clock. With each rate,
  the driving thread's host time of the round: its CPU time (`time.thread_time`) and its
  wall time up to the wait for the device that ends the round, both per step, against the
  round's wall time per step (`host_summary`). `threads`: the CPU seconds other threads
  that dispatch the step have taken so far, one count each (--pipeline-threads: the
  `Pipeline`'s `thread_seconds`), timed per step as the driving thread's.

  Call `start()` before the loop, `step_done(loss)` after every step (True: a round ended
  and the clock is stopped), `stop(loss)` before other work, `start()` after it.
  """

  def __init__(self, round_steps: int, tokens_per_step: int, *,
               threads: Callable[[], Sequence[float]] | None = None):
    self.round_steps, self.tokens_per_step = round_steps, tokens_per_step
    self.rates: list[float] = []  # tokens/s of each steady-state round
    # per steady-state round, seconds per step: the thread's CPU time, its wall time before
    # the round's wait for the device, the round's wall time
    self.host: list[tuple[float, float, float]] = []
    self.seconds = 0.0            # all training time (warm-up and the last partial round too)
    self._steps, self._elapsed, self._since = 0, 0.0, None
    self._cpu, self._dispatch, self._cpu_since = 0.0, 0.0, 0.0
    self._threads = threads
    # per steady-state round, per dispatch thread (`threads`): its CPU seconds per step
    self.thread_host: list[list[float]] = []
    self._thread_cpu: list[float] = []
    self._thread_since: list[float] = []

  def start(self) -> None:
    self._since = time.perf_counter()
    self._cpu_since = time.thread_time()
    if self._threads is not None:
      self._thread_since = list(self._threads())

  def stop(self, ready: Any) -> None:
    if self._since is None:
      return
    self._cpu += time.thread_time() - self._cpu_since  # before the wait: no waiting counted
    if self._threads is not None:  # each call's threads are joined when it returns
      spent = [now - since for now, since in zip(self._threads(), self._thread_since)]
      self._thread_cpu = (spent if not self._thread_cpu else
                          [a + b for a, b in zip(self._thread_cpu, spent)])
    self._dispatch += time.perf_counter() - self._since
    jax.block_until_ready(ready)
    elapsed = time.perf_counter() - self._since
    self._elapsed += elapsed
    self.seconds += elapsed
    self._since = None

  def step_done(self, ready: Any) -> bool:
    self._steps += 1
    if self._steps % self.round_steps:
      return False
    self.stop(ready)
    if self._steps > self.round_steps:  # the first round is the warm-up
      self.rates.append(round(self.round_steps * self.tokens_per_step / self._elapsed, 1))
      self.host.append(tuple(t / self.round_steps
                             for t in (self._cpu, self._dispatch, self._elapsed)))
      if self._threads is not None:
        self.thread_host.append([t / self.round_steps for t in self._thread_cpu])
    self._elapsed, self._cpu, self._dispatch, self._thread_cpu = 0.0, 0.0, 0.0, []
    return True

  def host_summary(self) -> dict[str, Any]:
    """Medians over the steady-state rounds, seconds per step: `host_seconds_per_step` (the
    driving thread's CPU time), `dispatch_seconds_per_step` (its wall time outside the
    rounds' waits for the device) and `step_seconds` (the rounds' wall time); None before a
    round is timed. With `threads`, also `thread_seconds_per_step`: per dispatch thread, the
    median of its CPU time a step."""
    names = ("host_seconds_per_step", "dispatch_seconds_per_step", "step_seconds")
    threads = {} if self._threads is None else {"thread_seconds_per_step": None}
    if not self.host:
      return {**dict.fromkeys(names), **threads}
    if threads:
      threads["thread_seconds_per_step"] = [round(statistics.median(column), 6)
                                            for column in zip(*self.thread_host)]
    return {**{name: round(statistics.median(column), 6)
               for name, column in zip(names, zip(*self.host))}, **threads}


def rate_summary(rates: Sequence[float], round_steps: int) -> dict[str, Any]:
  """Median and spread ((max - min) / median, %) of per-round tokens/s."""
  median = statistics.median(rates) if rates else None
  return {"rounds": list(rates), "round_steps": round_steps, "warmup_steps": round_steps,
          "median": median,
          "spread_percent": round(100 * (max(rates) - min(rates)) / median, 1) if rates else None}


def describe_rates(summary: dict[str, Any]) -> str:
  if not summary["rounds"]:
    return "not measured"
  count = len(summary["rounds"])
  return (f"{summary['median']:,.0f} tok/s (median of {count} round{'s' * (count != 1)} of "
          f"{summary['round_steps']} steps, spread {summary['spread_percent']:.0f}%)")


def throughput_rounds(runs: dict[str, tuple[Stepper, tuple[Params, Any]]], corpus: Corpus,
                      positions: jax.Array, microbatches: int, rounds: int, round_steps: int
                      ) -> dict[str, list[float]]:
  """Tokens/s of each run's step, timed as the training loop times itself: `round_steps`
  untimed steps each (warm-up), then `rounds` rounds of `round_steps` steps between device
  syncs, alternating (in order in even rounds, reversed in odd ones). Each run continues from
  its own (params, opt_state), which it consumes; batches are made inside the timed loop, as
  in training."""
  tokens_per_step = microbatches * corpus.batch * corpus.context
  states = {name: state for name, (_, state) in runs.items()}
  done = dict.fromkeys(runs, 0)

  def advance(name: str) -> None:
    stepper, (params, opt_state) = runs[name][0], states[name]
    for _ in range(round_steps):
      done[name] += 1
      params, opt_state, loss = stepper.step(
          params, opt_state, step_batches(corpus, done[name], microbatches), positions)
    states[name] = params, opt_state
    jax.block_until_ready(loss)

  for name in runs:
    advance(name)  # warm-up, not timed
  rates: dict[str, list[float]] = {name: [] for name in runs}
  for index in range(rounds):
    for name in (list(runs) if index % 2 == 0 else list(runs)[::-1]):
      begin = time.perf_counter()
      advance(name)
      rates[name].append(round(round_steps * tokens_per_step / (time.perf_counter() - begin), 1))
  return rates

