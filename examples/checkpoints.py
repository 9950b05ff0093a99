"""Verified Orbax checkpoints of a training example: each step holds the state, each layer's
key-stream position, the run's config and loss history, and digests that a restore checks;
what a run leaves in `--out` and how `--fresh` moves it aside.

What a checkpoint is checked for, and the noise of a failed Orbax read or write kept quiet,
are in checkpoint_checks.py; what a Ctrl-C does, interrupt.py's (the writes here are held
across one).
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import sys
import warnings
from typing import Any, Callable, Iterator, NamedTuple, NoReturn, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

import jaxgraph as jg
import jaxgraph.rng
from examples import interrupt
from examples.checkpoint_checks import (META_DIGEST, meta_digest, orbax_errors_held,
                                        other_shapes, quiet_closed_loops, quiet_late_orbax_errors,
                                        reason, tree_digests)
from examples.progress import close_bars


# The checkpoint steps a run keeps by default (--keep-checkpoints).
KEEP = 2


# What a run writes in --out, each moved aside together by --fresh.
OUTPUTS = ("checkpoints", "checkpoints-rejected", "metrics.json", "loss.png")


def earlier_run(out: pathlib.Path) -> list[str]:
  """What an earlier run left in `out`: its checkpoint steps, the steps a resume rejected,
  metrics.json, loss.png (an empty `checkpoints/`, or one holding only a step Orbax never
  finished, is nothing to keep)."""
  steps = sorted(int(p.name) for p in (out / "checkpoints").glob("*")
                 if p.name.isdigit() and p.is_dir())
  found = [name for name in OUTPUTS[1:] if (out / name).exists()]
  if steps:
    found.insert(0, f"checkpoints of step{'s' * (len(steps) > 1)} {', '.join(map(str, steps))}")
  return found


def aside(out: pathlib.Path) -> pathlib.Path:
  """Where `--fresh` moves an earlier run: the first `out/earlier-N` that does not exist."""
  n = 1
  while (out / f"earlier-{n}").exists():
    n += 1
  return out / f"earlier-{n}"


def move_aside(out: pathlib.Path) -> pathlib.Path | None:
  """`--fresh`: moves an earlier run's outputs in `out` (`OUTPUTS`) to `aside(out)`, which
  `--out` can resume; returns it, or None if there was nothing to move."""
  if not earlier_run(out):
    return None
  found = [out / name for name in OUTPUTS if (out / name).exists()]
  destination = aside(out)
  destination.mkdir()
  for path in found:
    path.rename(destination / path.name)
  return destination


Streams = list[tuple[jax.Array, int]]


def stream_positions(layers: Sequence[jg.GraphedCallable]) -> Streams:
  """Each layer's key stream: (base key, keys drawn so far)."""
  return [(layer.rng_base_key, layer.rng_counter) for layer in layers]


def stream_keys(streams: Streams, offset: int) -> list[jax.Array]:
  """The keys the streams of layers 0, 1, ... of one `make_graphed` call draw `offset`
  draws after `streams`."""
  return [jaxgraph.rng.stream_key(i, counter + offset, base)
          for i, (base, counter) in enumerate(streams)]


# How a step saved by another model's arrays is described (`other_shapes` too): not damage.
OTHER_MODEL = "holds arrays of other"


class CheckpointWarning(UserWarning):
  """A checkpoint could not be restored or failed its digest; an earlier one is tried."""


class NoCheckpoint(RuntimeError):
  """Checkpoints were found, but none that restores and passes its digests (the message
  lists each step and its problem; what to do depends on the caller: `Checkpoints.resume`).

  Attributes:
    other_model: every step was saved by a model of other shapes or layout (not damage).
  """

  def __init__(self, message: str, *, other_model: bool = False):
    super().__init__(message)
    self.other_model = other_model


class Restored(NamedTuple):
  """A verified checkpoint: its step, state, key-stream positions and saved metadata."""

  step: int
  params: Any
  opt_state: Any
  streams: Streams
  meta: dict[str, Any]  # what `Checkpoints.save` was given, plus "step" and "digests"


class Checkpoints:
  """Orbax checkpoints: each step holds the state (params, optimizer state, each layer's
  key-stream position) and, in the same step, its metadata (the run's config and loss
  history, a sha256 of every array of the state, and one of the rest of the metadata).

  Orbax writes a step into a temporary directory and renames it when complete, so the state
  and the history of a step are there together or not at all. `restore` checks the metadata
  against its digest and every array against the step's digests, and falls back to the
  previous step when the latest cannot be read or fails a check. A step it skipped is moved
  out of the way (into `checkpoints-rejected/`): Orbax silently skips saving a step at or
  below one it holds.

  Sharded arrays (FSDP) save and restore as Orbax does them: each process writes its own
  shards, and a restore places every array with the sharding of its target. The digests are
  of whole arrays: `host` gives them to the hashing (`jax.device_get` where every shard is
  local; with several processes, a gather of every process's shards).
  """

  @classmethod
  def for_run(cls, out: pathlib.Path, *, fresh: bool, command: str,
              host: Callable[[Any], Any] | None = None, keep: int = KEEP,
              legacy_metadata: bool = False) -> "Checkpoints":
    """The checkpoints of a run writing to `out` (`check_out` checked it), the newest `keep`
    steps kept; with `fresh`, an earlier run's outputs are moved aside first (by process 0,
    the others wait for it). `command` continues the run: messages about a failed write
    name it; `legacy_metadata`: as `__init__`'s."""
    if fresh and jax.process_index() == 0:
      with interrupt.held():
        moved = move_aside(out)
        interrupt.starting(out / "checkpoints", fresh=False)  # moved: --resume continues
      if moved is not None:
        print(f"--fresh: the earlier run in {out} moved to {moved} (kept: --out {moved} "
              "--resume continues it; delete it when you no longer need it)")
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("examples.checkpoints.Checkpoints.for_run")
    return cls(out / "checkpoints", host=host, command=command, keep=keep, own=True,
               legacy_metadata=legacy_metadata)

  def __init__(self, directory: pathlib.Path, *, host: Callable[[Any], Any] | None = None,
               command: str | None = None, keep: int = KEEP, own: bool = False,
               legacy_metadata: bool = False):
    self.directory = directory.absolute()
    # --legacy-metadata: a step whose metadata has no digest is read unchecked, not refused.
    self.legacy_metadata = legacy_metadata
    self._host = host or (lambda tree: tree)
    self.command = command
    self.keep = keep
    # The run's own checkpoints: Orbax removes the temporary folder of a save that a kill (or
    # a second Ctrl-C) cut short. Not in another run's (--init-from: it may be saving now).
    self.own = own
    self.rejected = self.directory.parent / "checkpoints-rejected"
    quiet_closed_loops()  # before the first read or write: a failure's stragglers print late
    self._open()

  def _open(self) -> None:
    # The item handlers named: `item_metadata` then reads the saved arrays' shapes.
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=self.keep, enable_async_checkpointing=False,
            cleanup_tmp_directories=self.own),
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})
    self.saved = self.manager.latest_step()  # the newest step on disk

  def kept(self) -> str:
    """What the run keeps, for its last line (`the newest 2 steps kept: ...`)."""
    return (f"the newest {self.keep} step{'s' * (self.keep > 1)} kept: --keep-checkpoints N "
            "keeps more")

  def _stop(self, failed: str, error: BaseException) -> NoReturn:
    """Ends the run with one message (below the progress bar, closed first): what could not
    be written and why, the last step saved, and the command that continues from it."""
    why = reason(error)
    if self.saved is None:
      where = "No step is saved yet"
    else:
      where = f"The last step saved is {self.saved} ({self.directory / str(self.saved)})"
    fix = ("free space on its disk" if "No space left on device" in why
           else "when that is fixed")
    close_bars()
    sys.exit(f"{failed}: {why}. {where}; {fix}, continue with: "
             f"{self.command or 'the same command and --resume'}")

  @contextlib.contextmanager
  def writing(self, path: pathlib.Path) -> Iterator[None]:
    """Around writing an output beside the checkpoints (metrics.json, loss.png): a failure
    (a full disk) ends the run with one message that names `path` and the last step saved."""
    try:
      with interrupt.held():  # Ctrl-C waits for the file (loss.png is not written atomically)
        yield
    except OSError as e:
      self._stop(f"could not write {path}", e)

  @staticmethod
  def _tree(params: Any, opt_state: Any, streams: Streams) -> dict[str, Any]:
    # The keys as NumPy arrays: a key on one local device is no array Orbax can save with
    # several processes (it saves NumPy arrays from process 0).
    return {"params": params, "opt_state": opt_state,
            "streams": [{"key": np.asarray(jax.random.key_data(base)),
                         "counter": np.asarray(counter, np.uint32)} for base, counter in streams]}

  def save(self, step: int, params: Any, opt_state: Any, streams: Streams,
           meta: dict[str, Any]) -> None:
    """Saves step `step`: the state, and `meta` (JSON: config, loss history) with the
    state's digests, in one Orbax step. A Ctrl-C waits for the step to be written
    (`interrupt.held`)."""
    with interrupt.held():
      interrupt.point("save", step)
      tree = self._tree(params, opt_state, streams)
      meta = {**meta, "step": step, "digests": tree_digests(self._host(tree))}
      meta[META_DIGEST] = meta_digest(meta)
      try:
        with orbax_errors_held():
          try:
            saved = self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)))
          except Exception:
            quiet_late_orbax_errors()  # while those logged so far are held: none goes out
            raise
      except Exception as e:  # a full disk (tensorstore's ValueError), OSError, ...
        quiet_closed_loops()
        self._stop(f"could not save checkpoint step {step} in {self.directory}", e)
      if saved:
        self.saved = step
    if not saved:
      raise RuntimeError(f"Orbax skipped saving step {step}: {self.directory} already holds "
                         f"step {self.manager.latest_step()}. Continue it with --resume, or "
                         "start afresh with --fresh (it is moved aside, not deleted).")

  def meta_problems(self) -> list[tuple[int, str]]:
    """Each step whose metadata does not read or pass its digest, and what is wrong."""
    found = [(step, self._meta(step)) for step in sorted(self.manager.all_steps())]
    return [(step, meta) for step, meta in found if isinstance(meta, str)]

  def latest_meta(self) -> tuple[int, dict[str, Any]] | None:
    """The newest step whose metadata reads and matches its digest, and that metadata
    (arrays not read or checked: `restore` does that); None if there is none."""
    for step in sorted(self.manager.all_steps(), reverse=True):
      meta = self._meta(step)
      if isinstance(meta, dict):
        return step, meta
    return None  # unreadable or damaged: `restore` names each and falls back

  def _meta(self, step: int) -> dict[str, Any] | str:
    """Step `step`'s metadata, checked against its digest; or what is wrong with it."""
    try:
      with orbax_errors_held():
        restored = self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))
      meta = dict(restored["meta"])
    except Exception as e:  # JSON, a missing item: one line is enough
      return f"cannot be read ({reason(e)})"
    saved = meta.get(META_DIGEST)
    if saved is None and not self.legacy_metadata:  # never taken on trust unasked
      return (f"has metadata without its digest ({META_DIGEST}: written before metadata "
              "digests, or the digest removed), so its config and loss history cannot be "
              "checked; pass --legacy-metadata to read such a step unchecked (its arrays are "
              "checked as always)")
    if saved is not None and saved != meta_digest(meta):
      return ("has metadata that does not match its digest (its config, loss history or "
              "array digests were changed after the save)")
    return meta

  def intact(self, step: int) -> bool:
    """Whether step `step` reads and matches its digests, without a target of its structure
    (the arrays' digests compared as a set): for a look before the model is built. Only
    for a run of one process."""
    meta = self._meta(step)
    if not isinstance(meta, dict) or not isinstance(meta.get("digests"), dict):
      return False
    try:
      with orbax_errors_held():
        saved = self.manager.item_metadata(step)["state"]
        host = jax.tree.map(lambda leaf: np.empty(leaf.shape, np.dtype(leaf.dtype)), saved)
        state = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(host)))["state"]
    except Exception:
      return False
    return sorted(tree_digests(state).values()) == sorted(meta["digests"].values())

  def resume(self, params: Any, opt_state: Any, streams: Streams) -> Restored | None:
    """`--resume`: `restore`, saying so when there is nothing to resume from; exits with one
    line when checkpoints exist and none of them passes."""
    try:
      restored = self.restore(params, opt_state, streams)
    except NoCheckpoint as e:
      sys.exit(f"--resume: {e}. The steps are left in place: "
               + ("resume with the model (code, preset and flags) that saved them, or "
                  if e.other_model else "")
               + "start afresh with --fresh instead of --resume (they are moved aside, not "
               "deleted)")
    if restored is None:
      print("no checkpoint to resume from; starting at step 0")
    return restored

  def restore(self, params: Any, opt_state: Any, streams: Streams, *,
              move_rejected: bool = True) -> Restored | None:
    """The newest checkpoint that restores and matches its digests; None if there is none.

    `params`, `opt_state` and `streams` give the structure (the values are replaced). Each
    newer step that failed is named in a `CheckpointWarning` and moved to
    `checkpoints-rejected/`, so that the resumed run can save that step again (left in
    place without `move_rejected`: another run's checkpoints, read only).

    Raises:
      NoCheckpoint: there were checkpoints, and none of them passed (all left in place).
    """
    target = self._tree(params, opt_state, streams)
    failures: list[tuple[int, str]] = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      found = self._check(step, target)
      if isinstance(found, Restored):
        for bad, problem in failures:
          where = (f"moved to {self._reject(bad)}" if move_rejected else "left in place")
          warnings.warn(f"checkpoint step {bad} in {self.directory} {problem}; resuming from "
                        f"step {step} instead (step {bad} {where})",
                        CheckpointWarning, stacklevel=2)
        return found
      failures.append((step, found))
    if failures:
      raise NoCheckpoint(f"no checkpoint in {self.directory} restores intact: "
                         + "; ".join(f"step {step} {problem}" for step, problem in failures),
                         other_model=all(problem.startswith(OTHER_MODEL)
                                         for _, problem in failures))
    return None

  def _check(self, step: int, target: dict[str, Any]) -> Restored | str:
    """Step `step` restored and verified, or what is wrong with it: its metadata first (its
    digest, the history it holds), the arrays' shapes against `target`'s, then the arrays
    read and hashed."""
    meta = self._meta(step)
    if isinstance(meta, str):
      return meta
    expected = meta.get("digests")
    if not isinstance(expected, dict):
      return "has no digests (written by an older version of this example?)"
    losses = meta.get("losses")
    if isinstance(losses, list) and len(losses) != step:
      return f"has metadata holding {len(losses)} training losses for its {step} steps"
    other = self._other_shapes(step, target)
    if other is not None:
      return other
    try:
      with orbax_errors_held():
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target)))
    except Exception as e:  # tensorstore, missing items: one line is enough
      if _says(e, "tree structures do not match"):  # healthy, of another model's layout
        return (f"{OTHER_MODEL} parts or buffers than this run's model (Orbax: the tree "
                "structures do not match); it was saved by a model of other flags or code")
      return f"cannot be read ({reason(e)})"
    state = restored["state"]
    found = tree_digests(self._host(state))
    bad = sorted(path for path in expected.keys() | found.keys()
                 if expected.get(path) != found.get(path))
    if bad:
      return (f"does not match its digests ({len(bad)} of {len(expected)} arrays differ: "
              f"{', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
    streams = [(jax.random.wrap_key_data(s["key"]), int(s["counter"]))
               for s in state["streams"]]
    return Restored(step, state["params"], state["opt_state"], streams, meta)

  def _other_shapes(self, step: int, target: dict[str, Any]) -> str | None:
    """`other_shapes` of step `step`'s saved arrays and `target`'s (None where the saved
    shapes cannot be read: the read then says what is wrong)."""
    try:
      with orbax_errors_held():
        return other_shapes(self.manager.item_metadata(step)["state"], target)
    except Exception:
      return None

  def _reject(self, step: int) -> pathlib.Path:
    """Moves step `step` out of the checkpoint directory; returns where to."""
    self.rejected.mkdir(parents=True, exist_ok=True)
    destination = self.rejected / str(step)
    suffix = 1
    while destination.exists():
      destination, suffix = self.rejected / f"{step}.{suffix}", suffix + 1
    with interrupt.held():
      shutil.move(str(self.directory / str(step)), destination)
    self._open()  # the manager caches the steps it found
    return destination


def _says(error: BaseException | None, text: str) -> bool:
  """Whether `error` or an error it was raised from holds `text`."""
  while error is not None:
    if text in str(error):
      return True
    error = error.__cause__ or error.__context__
  return False
