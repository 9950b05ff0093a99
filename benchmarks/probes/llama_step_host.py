"""Where a training step of the Llama example spends the host's time, from one run of it.

Runs `examples/llama/train.py` with the flags given (after `--`; --check on, so that the run
ends with both steps' tokens/s, `check.time_both`) and, inside its training loop:

* a timeline of `--timeline-steps` steps from step `--first` (1-based, after the warm-up
  ones that compile): every `Compiled.__call__` with when it was dispatched and how long the
  dispatch held the host (named as `llama_step_calls.Counter` names them), whether the
  previous call's outputs were ready by then (`ready`: the devices had caught up with the
  host, so they waited for it), every wait (`jax.block_until_ready`, `jax.device_get`) and
  every transfer (`jax.device_put`, `jax.make_array_from_callback`), the making of the
  step's batches (`step_batches`) and the step itself (`Trainer.step`);
* then a burst of `--profile-steps` steps under py-spy `--native --idle`
  (`benchmarks/profiling.py`'s way: only the samples under the steps' `_sampled` frames
  count), its collapsed stacks written to OUT/native.txt with OUT/native.json (seconds,
  steps, calls) for `native_breakdown.py`;
* throughout, each step's host time (`Trainer.step` and `WholeStep.step`, dispatch only):
  the last ones are --check's timing rounds, to set against its tokens/s.

Writes OUT/timeline.json (the events, seconds from each step's start), OUT/summary.json and
prints the summary: calls per step by kind with their median and total host µs, the host's
time per step (in calls, waits, transfers, between them), how many calls found the devices
idle, the longest dispatches. benchmarks/probes/llama_step_gpu.sh runs it on the GPUs.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
      python3 -m benchmarks.probes.llama_step_host --out /tmp/step -- --preset tiny --fsdp 4 \\
      --steps 12 --round-steps 3 --rounds 2 --generate 0
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from typing import Any, Callable

import jax
from jax import stages

from benchmarks.probes.llama_step_calls import Counter, _module_name
from examples.llama import train as train_lib
from examples.llama import trainer as trainer_lib
from examples.llama import whole_step as whole_step_lib

# (module, name, kind) of the functions whose calls the timeline stamps besides the calls.
STAMPED = ((jax, "block_until_ready", "wait"), (jax, "device_get", "wait"),
           (jax, "device_put", "transfer"), (jax, "make_array_from_callback", "transfer"))


def _first_leaf(tree: Any) -> Any:
  leaves = jax.tree.leaves(tree)
  return leaves[0] if leaves else None


def _ready(array: Any) -> bool | None:
  """Whether `array` is computed (None: not a device array)."""
  is_ready = getattr(array, "is_ready", None)
  return None if is_ready is None else bool(is_ready())


class Probe:
  """The timeline, the profile and the steps' host times of one run (`patch` installs it)."""

  def __init__(self, first: int, timeline_steps: int, profile_steps: int, out: str):
    self.first, self.timeline_steps, self.profile_steps, self.out = (
        first, timeline_steps, profile_steps, out)
    self.names = Counter()  # only its executable labels
    self.module_names: dict[int, str] = {}
    self.steps = 0  # Trainer.step calls so far
    self.recording: list[tuple[Any, ...]] | None = None  # the current step's events
    self.timeline: list[dict[str, Any]] = []
    self.last_output: Any = None  # a leaf of the last call's outputs
    self.host_seconds: dict[str, list[float]] = {"graphed": [], "whole_step": []}
    self.profile: dict[str, Any] | None = None
    self.sampler: subprocess.Popen | None = None
    self.calls = 0  # calls while sampled
    self.sampling = False
    self.restore: list[Callable[[], None]] = []

  def label(self, compiled: Any) -> str:
    name = self.names.labels.get(id(compiled))
    if name is None:
      name = self.module_names.get(id(compiled))
      if name is None:
        name = self.module_names[id(compiled)] = _module_name(compiled)
    return name

  @property
  def profile_first(self) -> int:
    return self.first + self.timeline_steps

  def patch(self) -> None:
    """Wraps `Compiled.__call__`, the waits and transfers, `step_batches`, the steps."""
    probe, clock = self, time.perf_counter
    call = stages.Compiled.__call__

    def stamped_call(self: Any, *args: Any, **kwargs: Any) -> Any:
      if probe.sampling:
        probe.calls += 1
      if probe.recording is None:
        return call(self, *args, **kwargs)
      ready = _ready(probe.last_output)
      begin = clock()
      out = call(self, *args, **kwargs)
      end = clock()
      probe.last_output = _first_leaf(out)
      probe.recording.append(("call", probe.label(self), begin, end, ready))
      return out

    stages.Compiled.__call__ = stamped_call
    self.restore.append(lambda: setattr(stages.Compiled, "__call__", call))
    for module, name, kind in STAMPED:
      self._wrap(module, name, kind, f"jax.{name}")

    step, batches = trainer_lib.Trainer.step, train_lib.step_batches

    def probed_step(trainer: Any, *args: Any, **kwargs: Any) -> Any:
      return probe.step(step, trainer, *args, **kwargs)

    def probed_batches(*args: Any, **kwargs: Any) -> Any:
      index = probe.steps + 1  # the batches of the next step
      if probe.first <= index < probe.profile_first:
        return probe.stamp("batches", "step_batches", batches, *args, **kwargs)
      if probe.sampling:
        return _sampled(batches, *args, **kwargs)
      return batches(*args, **kwargs)

    trainer_lib.Trainer.step = probed_step  # stays: it times every step
    train_lib.step_batches = probed_batches
    self.restore.append(lambda: setattr(train_lib, "step_batches", batches))

    whole = whole_step_lib.WholeStep.step

    def timed_whole(stepper: Any, *args: Any, **kwargs: Any) -> Any:
      begin = clock()
      out = whole(stepper, *args, **kwargs)
      probe.host_seconds["whole_step"].append(clock() - begin)
      return out

    whole_step_lib.WholeStep.step = timed_whole

  def _wrap(self, module: Any, name: str, kind: str, label: str) -> None:
    original = getattr(module, name)

    def stamped(*args: Any, **kwargs: Any) -> Any:
      if self.recording is None:
        return original(*args, **kwargs)
      return self.stamp(kind, label, original, *args, **kwargs)

    setattr(module, name, stamped)
    self.restore.append(lambda: setattr(module, name, original))

  def stamp(self, kind: str, label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
            ) -> Any:
    """`fn(*args, **kwargs)`, its start and end appended to the step's events (or, before
    the step starts, to the events that precede it: its batches)."""
    events = self.recording if self.recording is not None else self._pending()
    begin = time.perf_counter()
    out = fn(*args, **kwargs)
    events.append((kind, label, begin, time.perf_counter(), None))
    return out

  def _pending(self) -> list[tuple[Any, ...]]:
    if not self.timeline or "start" in self.timeline[-1]:
      self.timeline.append({"events": []})
    return self.timeline[-1]["events"]

  def step(self, step: Callable[..., Any], trainer: Any, *args: Any, **kwargs: Any) -> Any:
    """One `Trainer.step`: timed, and in the timeline's or the profile's window as it falls."""
    self.steps += 1
    index, clock = self.steps, time.perf_counter
    if index == self.first:
      self.names.label(list(trainer.layers))
    if index == self.profile_first and self.profile_steps:
      self._start_sampler()
    begin = clock()
    if self.first <= index < self.profile_first:
      self.recording = self._pending()
      record = self.timeline[-1]
      record.update(step=index, start=begin)
      try:
        out = self.stamp("step", "Trainer.step", step, trainer, *args, **kwargs)
      finally:
        self.recording = None
      record["end"] = clock()
    elif self.sampling:
      out = _sampled(step, trainer, *args, **kwargs)
    else:
      out = step(trainer, *args, **kwargs)
    self.host_seconds["graphed"].append(clock() - begin)
    if self.sampling and index == self.profile_first + self.profile_steps - 1:
      self._stop_sampler(out)
    if index == self.profile_first + self.profile_steps - 1 or (
        not self.profile_steps and index == self.profile_first - 1):
      self.unpatch_calls()
    return out

  def unpatch_calls(self) -> None:
    """The wrappers of the calls, waits, transfers and batches off (the steps' timers
    stay): --check's rounds time the runtime as it is."""
    for undo in self.restore:
      undo()
    self.restore = []

  def _start_sampler(self) -> None:
    spy = shutil.which("py-spy")
    if spy is None:
      print("py-spy not found: no native profile", flush=True)
      return
    path = os.path.join(self.out, "native.txt")
    self.sampler = subprocess.Popen(
        [spy, "record", "--pid", str(os.getpid()), "--native", "--idle", "--rate", "1000",
         "--format", "raw", "--duration", "120", "--output", path], stdout=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches
    jax.block_until_ready(self.last_output)
    self.sampling, self.calls, self.sample_begin = True, 0, time.perf_counter()

  def _stop_sampler(self, out: Any) -> None:
    seconds = time.perf_counter() - self.sample_begin  # the host's, before the drain
    self.sampling = False
    jax.block_until_ready(out)
    drained = time.perf_counter() - self.sample_begin
    self.sampler.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
    self.sampler.wait()
    self.profile = dict(seconds=seconds, steps=self.profile_steps, calls=self.calls,
                        seconds_until_drained=drained)
    with open(os.path.join(self.out, "native.json"), "w") as f:
      json.dump(self.profile, f)


def _sampled(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
  """`fn(*args, **kwargs)` in a frame `native_breakdown.SAMPLED` finds."""
  return fn(*args, **kwargs)


def _median(values: list[float]) -> float:
  return statistics.median(values) if values else float("nan")


def summarize(probe: Probe, result: dict[str, Any], tokens_per_step: int) -> dict[str, Any]:
  """Calls per step by kind, the host's time per step by what it did, the devices' idle
  dispatches, the longest dispatches; both steps' host and wall time per step."""
  steps = [r for r in probe.timeline if "start" in r]
  kinds: dict[str, list[float]] = collections.defaultdict(list)
  parts: dict[str, list[float]] = collections.defaultdict(list)
  ready = collections.Counter()
  longest = []
  for record in steps:
    spent = collections.Counter()
    for kind, label, begin, end, was_ready in record["events"]:
      if kind == "step":
        continue
      name = f"{kind}: {label}"
      kinds[name].append(end - begin)
      spent[kind] += end - begin
      if kind == "call":
        longest.append((end - begin, label, record["step"]))
        ready[{True: "devices idle", False: "devices busy", None: "unknown"}[was_ready]] += 1
    host = record["end"] - record["start"]
    parts["step (Trainer.step)"].append(host)
    for kind in ("call", "wait", "transfer"):
      parts[f"  in {kind}s"].append(spent[kind])
    parts["  between them (Python)"].append(host - spent["call"] - spent["wait"]
                                            - spent["transfer"])
    parts["batches, before the step"].append(spent["batches"])
  n = max(1, len(steps))
  by_kind = {name: {"per_step": len(v) / n, "median_us": 1e6 * _median(v),
                    "us_per_step": 1e6 * sum(v) / n} for name, v in sorted(kinds.items())}
  check = result.get("throughput", {}).get("check", {})
  rates = {name: check[name]["median"] for name in ("graphed", "whole_step") if name in check}
  timed = {name: len(rounds["rounds"]) * rounds["round_steps"]
           for name, rounds in check.items() if "rounds" in rounds}
  per_step = {
      name: {"host_ms": 1e3 * _median(probe.host_seconds[name][-timed.get(name, 0):]),
             "wall_ms": 1e3 * tokens_per_step / rates[name] if rates.get(name) else None,
             "tokens_per_second": rates.get(name)}
      for name in ("graphed", "whole_step") if probe.host_seconds[name]}
  return {
      "timeline_steps": [r["step"] for r in steps],
      "calls_per_step": sum(v["per_step"] for k, v in by_kind.items() if k.startswith("call")),
      "by_kind": by_kind,
      "host_ms_per_step": {k: 1e3 * _median(v) for k, v in parts.items()},
      "dispatches": dict(ready),
      "longest_us": [(round(1e6 * s, 1), label, step)
                     for s, label, step in sorted(longest, reverse=True)[:8]],
      "check_steps": per_step,
      "ratio": (rates["graphed"] / rates["whole_step"]) if len(rates) == 2 else None,
      "profile": probe.profile,
  }


def report(summary: dict[str, Any]) -> str:
  """The summary as lines of text."""
  lines = [f"timeline of steps {summary['timeline_steps']}: "
           f"{summary['calls_per_step']:.1f} executable calls a step",
           f"{'kind':56s} {'a step':>7s} {'median µs':>10s} {'µs a step':>10s}"]
  for name, v in summary["by_kind"].items():
    lines.append(f"{name:56s} {v['per_step']:7.1f} {v['median_us']:10.1f} "
                 f"{v['us_per_step']:10.1f}")
  lines.append("host time per step (median, ms):")
  lines += [f"  {k:40s} {v:8.3f}" for k, v in summary["host_ms_per_step"].items()]
  lines.append(f"calls dispatched when the previous call was done (devices idle) or not: "
               f"{summary['dispatches']}")
  lines.append(f"longest dispatches (µs, kind, step): {summary['longest_us']}")
  for name, v in summary["check_steps"].items():
    wall = "?" if v["wall_ms"] is None else f"{v['wall_ms']:.3f}"
    lines.append(f"--check rounds, {name}: host {v['host_ms']:.3f} ms a step (dispatch), wall "
                 f"{wall} ms a step, {v['tokens_per_second']} tok/s")
  if summary["ratio"] is not None:
    lines.append(f"graphed / whole step: {summary['ratio']:.3f}")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="where the timeline, profile, summary go")
  parser.add_argument("--first", type=int, default=4, help="the timeline's first step")
  parser.add_argument("--timeline-steps", type=int, default=3)
  parser.add_argument("--profile-steps", type=int, default=5,
                      help="steps under py-spy after the timeline's (0: none)")
  parser.add_argument("train_args", nargs="*", help="after --: examples/llama/train.py's flags")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  probe = Probe(args.first, args.timeline_steps, args.profile_steps, args.out)
  with tempfile.TemporaryDirectory() as run:
    train_args = [*args.train_args, "--check", "--out", run, "--fresh"]
    preset = train_lib.resolve(train_lib.parse(train_args))
    probe.patch()
    result = train_lib.main(train_args)
  tokens_per_step = preset.microbatches * preset.batch * preset.context
  probe.unpatch_calls()
  summary = summarize(probe, result, tokens_per_step)
  summary["train_args"] = args.train_args
  summary["devices"] = jax.device_count()
  with open(os.path.join(args.out, "timeline.json"), "w") as f:
    json.dump([{**{k: v for k, v in r.items() if k != "events"},
                "events": [(kind, label, begin - r.get("start", begin), end - begin, ready)
                           for kind, label, begin, end, ready in r["events"]]}
               for r in probe.timeline], f)
  with open(os.path.join(args.out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  print(report(summary))


if __name__ == "__main__":
  main()
