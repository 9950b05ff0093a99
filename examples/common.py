"""What the training examples share: their run options and the checks of `--out`, the corpus,
key-stream positions, verified Orbax checkpoints that hold them with the run's config and
loss history, atomic JSON writes, the progress bar, a params digest, the loss plot.

Used by examples/train_gpt.py and the Llama example (examples/llama/). What a checkpoint is
checked for, and the noise of a failed Orbax read or write kept quiet, are in
checkpoint_checks.py; the progress bar is progress.py's (both imported here); what a
Ctrl-C does, interrupt.py's (its writes here are held across one).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pathlib
import shlex
import shutil
import sys
import tempfile
import warnings
from typing import Any, Callable, Iterator, NamedTuple, NoReturn, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Sharding

import jaxgraph as jg
import jaxgraph.rng
from examples import interrupt
from examples.checkpoint_checks import (META_DIGEST, meta_digest, orbax_errors_held, other_shapes,
                               quiet_closed_loops, reason, tree_digests)
from examples.progress import LogLines, close_bars, progress_bar  # noqa: F401 (LogLines: for users)
from examples.vocabulary import Vocabulary


def run_parser(description: str, presets: Sequence[str]) -> argparse.ArgumentParser:
  """The options every training example takes: a preset, the steps, and stop / resume /
  start afresh."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--preset", choices=sorted(presets), default="cpu")
  parser.add_argument("--steps", type=int, help="total steps (default: the preset's)")
  parser.add_argument("--stop-after", type=int, help="stop after this step, as if interrupted")
  parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  parser.add_argument("--fresh", action="store_true",
                      help="start a new run in an --out that holds an earlier one: its "
                           "checkpoints and outputs are moved to OUT/earlier-N/ (kept)")
  parser.add_argument("--legacy-metadata", action="store_true",
                      help="read checkpoint steps whose metadata has no digest (written before "
                           "metadata digests) as they are: their config and loss history "
                           "unchecked (their arrays are checked as always); without it such a "
                           "step is refused")
  parser.add_argument("--keep-checkpoints", type=int, default=KEEP, metavar="N",
                      help=f"how many of the newest checkpoint steps to keep (default: {KEEP}; "
                           "an older step is deleted when a newer one is saved)")
  return parser


# The checkpoint steps a run keeps by default (--keep-checkpoints).
KEEP = 2


def check_steps(parser: argparse.ArgumentParser, args: argparse.Namespace, steps: int) -> None:
  """--stop-after and --keep-checkpoints against the run's `steps` (argparse errors): a
  --stop-after past the last step would stop nowhere."""
  if args.stop_after is not None and args.stop_after > steps:
    parser.error(f"--stop-after {args.stop_after} is past the run's last step (--steps "
                 f"{steps}): pass a --stop-after of at most {steps}, or leave it out to train "
                 "every step")
  if args.keep_checkpoints < 1:
    parser.error(f"--keep-checkpoints takes a number >= 1 (a resume needs a step to resume "
                 f"from), got {args.keep_checkpoints}")


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


def check_out(parser: argparse.ArgumentParser, out: pathlib.Path, *, resume: bool,
              fresh: bool) -> None:
  """`--out` before anything is built (argparse errors): it and its `checkpoints/` are
  directories that can be created and written to (so that the first save cannot fail on
  them after the steps were trained), and one holding an earlier run is refused unless
  `--resume` continues it or `--fresh` moves it aside. Creates both directories."""
  if resume and fresh:
    parser.error("--resume continues the run in --out and --fresh starts a new one: pass one "
                 "of them")
  for path in (out, out / "checkpoints"):
    if path.exists() and not path.is_dir():
      parser.error(f"--out: {path} is a file, not a directory: pass an --out that is a "
                   "directory or does not exist yet")
    try:
      path.mkdir(parents=True, exist_ok=True)
      with tempfile.TemporaryFile(dir=path):
        pass
    except OSError as e:
      parser.error(f"--out: cannot write to {path} ({e.strerror or e}): pass an --out you "
                   "can write to")
  found = earlier_run(out)
  if found and not (resume or fresh):
    parser.error(f"--out {out} holds an earlier run ({'; '.join(found)}): pass --resume to "
                 f"continue it, --fresh to start afresh (it is moved to {aside(out)}, not "
                 "deleted), or another --out")


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


def resume_command(module: str, argv: Sequence[str]) -> str:
  """The command that continues the run `python -m module` started with `argv`: the same
  flags without --stop-after and --fresh, with --resume (`given_command`: as given)."""
  flags, skip = [], False
  for arg in argv:
    if skip:
      skip = False
    elif arg == "--stop-after":
      skip = True
    elif not (arg.startswith("--stop-after=") or arg in ("--fresh", "--resume")):
      flags.append(arg)
  return given_command(module, [*flags, "--resume"])


def given_command(module: str, argv: Sequence[str]) -> str:
  """`python -m module argv...`: the command as run from the repository root (where the
  examples run, `python -m examples.NAME`)."""
  return shlex.join(["python", "-m", module, *argv])


class Corpus:
  """A text as token ids; batch `step` is a function of (seed, step) only.

  With `held_out` > 0, that fraction at the end of the ids is kept out of training and
  read by `eval_batch`. With a `sharding` (data parallel: the batch dimension split over a
  mesh) every batch is placed with it; with several processes each one makes the same whole
  batch and keeps its own devices' rows.
  """

  def __init__(self, ids: np.ndarray, vocabulary: Vocabulary, context: int, batch: int,
               seed: int, held_out: float = 0.0, sharding: Sharding | None = None):
    split = len(ids) - int(held_out * len(ids))
    self.ids, self.held_out_ids = ids[:split], ids[split:]
    shortest = min(len(self.ids), len(self.held_out_ids) if held_out else len(self.ids))
    if shortest <= context + 1:
      raise ValueError(f"a text of {len(ids):,} tokens ({shortest:,} in its shorter part) "
                       f"has no window of {context + 1} tokens: pass a shorter context or a "
                       "longer text")
    self.vocabulary = vocabulary
    self.context, self.batch, self.seed = context, batch, seed
    self.sharding = sharding

  def _windows(self, ids: np.ndarray, seed: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    starts = np.random.default_rng(seed).integers(0, len(ids) - self.context - 1, self.batch)
    window = np.stack([ids[s:s + self.context + 1] for s in starts])
    tokens, targets = window[:, :-1], window[:, 1:]
    if self.sharding is None:
      return jnp.asarray(tokens), jnp.asarray(targets)
    # From the host copy each process holds: no cross-process check of equal values, which
    # `jax.device_put` to a global sharding runs (a collective per call).
    def place(part: np.ndarray) -> jax.Array:
      return jax.make_array_from_callback(part.shape, self.sharding, lambda index: part[index])

    return place(tokens), place(targets)

  def batch_at(self, step: int) -> tuple[jax.Array, jax.Array]:
    """Training batch `step`: (tokens, next tokens), each (batch, context)."""
    return self._windows(self.ids, [self.seed, step])

  def eval_batch(self, index: int) -> tuple[jax.Array, jax.Array]:
    """Held-out batch `index` (the same on every call)."""
    return self._windows(self.held_out_ids, [self.seed, index, 1])

  def decode(self, ids: Any) -> str:
    return self.vocabulary.decode(ids)


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
  previous step when the latest cannot be read or fails a check. A step it skipped is moved out of the way (into
  `checkpoints-rejected/`): Orbax silently skips saving a step at or below one it holds.

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
      multihost_utils.sync_global_devices("examples.common.Checkpoints.for_run")
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
          saved = self.manager.save(step, args=ocp.args.Composite(
              state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)))
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


def write_json(path: pathlib.Path, value: Any, **options: Any) -> None:
  """Writes `value` as JSON to `path` atomically: a temporary file renamed over it, so a
  kill or a full disk leaves the old file or the new one, never a partial one."""
  temporary = path.with_name(f".{path.name}.tmp")
  try:
    with open(temporary, "w") as f:
      json.dump(value, f, **options)
      f.flush()
      os.fsync(f.fileno())
    os.replace(temporary, path)
  except BaseException:
    temporary.unlink(missing_ok=True)
    raise


def check_resume(parser: argparse.ArgumentParser, out: pathlib.Path, config: dict[str, Any],
                 steps: int, stop: int,
                 shown: Callable[[dict[str, Any]], dict[str, Any]] = dict,
                 finished: str = "", legacy_metadata: bool = False) -> None:
  """With --resume: refuses (`parser.error`) a checkpoint past `steps`, or one saved by a
  run whose config differs from `config` (names the flags that differ), or steps whose
  metadata has no digest (without `legacy_metadata`: --legacy-metadata); for an intact
  checkpoint at `steps`, says that nothing is left to train and exits (status 0), before
  anything is built (`finished`: what to do instead), writing nothing but a missing or
  damaged metrics.json (`restore_metrics`).

  `config` maps flag names (`dropout`, `plain_ends`, ...) to values; it is what `save`'s
  metadata holds under "config". `shown` gives the values a config stands for, as the
  message shows them (a None saved for the preset's batch: that batch). Reads the newest
  verified metadata; the arrays only of a finished run's last step (their digests).
  """
  directory = out / "checkpoints"
  if not directory.is_dir():
    return
  checkpoints = Checkpoints(directory, legacy_metadata=legacy_metadata)
  latest = checkpoints.latest_meta()
  if latest is None:
    undigested = [f"step {step} {problem}" for step, problem in checkpoints.meta_problems()
                  if "without its digest" in problem]
    if undigested:
      parser.error(f"--resume: no checkpoint in {directory} has metadata that can be checked: "
                   + "; ".join(undigested))
    return
  step, meta = latest
  if step > steps:
    parser.error(f"the checkpoint in {directory} is at step {step}, past --steps {steps}: "
                 f"pass --steps {step} or more to continue it, or --fresh instead of --resume "
                 "to start afresh (the checkpoints are moved aside, not deleted)")
  if step >= stop and stop < steps:
    parser.error(f"--stop-after {stop} is not after the checkpoint's step {step} in "
                 f"{directory}: pass a later --stop-after")
  saved = meta.get("config", {})
  ours, theirs = shown(config), shown(saved)

  def show(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)

  differ = [f"--{name.replace('_', '-')} {show(ours.get(name))} (the checkpoint's run: "
            f"{show(theirs.get(name))})" for name in sorted(config.keys() | saved.keys())
            if config.get(name) != saved.get(name)]
  if differ:
    parser.error(f"--resume with a config other than that of the checkpoint in {directory}: "
                 + ", ".join(differ) + ". Pass the checkpoint's flags to continue it, or "
                 "another --out for a new run")
  # A damaged last step is rejected by the resume, which then trains from the one before.
  if step == steps and jax.process_count() == 1 and checkpoints.intact(step):
    restored = restore_metrics(out / "metrics.json", meta)
    print(f"--resume: the checkpoint in {directory} is at step {step}, the run's last "
          f"(--steps {steps}): nothing left to train; nothing was built"
          + (f", and {restored}." if restored else " or written.")
          + (f" {finished}" if finished else ""))
    sys.exit(0)


def restore_metrics(path: pathlib.Path, meta: dict[str, Any]) -> str | None:
  """A finished run's metrics.json, when missing or damaged (unreadable, or a history other
  than its last checkpoint's), written again from that checkpoint's `meta` (its step and
  loss history: what a checkpoint holds of it); what was done, or None if it was whole."""
  history = {key: meta[key] for key in ("losses", "eval_losses") if key in meta}
  missing = not path.exists()
  try:
    found = json.loads(path.read_text())
    whole = all(found.get(key) == value for key, value in history.items())
  except (OSError, ValueError, AttributeError):  # missing, truncated, not an object
    found, whole = None, False
  if whole:
    return None
  write_json(path, {"step": meta["step"], **history}, indent=1)
  return (f"{path} was {'missing' if missing else 'damaged'}: "
          f"written again from step {meta['step']}'s checkpoint (its step and "
          f"{' and '.join(history) or 'nothing else'}; the run's other records, such as "
          "tokens/s, are not in checkpoints)")


def params_digest(params: Any) -> str:
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    digest.update(np.asarray(leaf).tobytes())
  return digest.hexdigest()


def plot(losses: list[float], path: pathlib.Path, title: str,
         eval_losses: Sequence[tuple[int, float]] = ()) -> None:
  """Training loss per step (raw and smoothed) and, if given, (step, held-out loss) points."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = np.arange(1, len(losses) + 1)
  window = max(1, len(losses) // 25)
  smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(steps, losses, alpha=0.35, label="loss")
  ax.plot(steps[window - 1:], smooth, label=f"mean of {window}")
  if eval_losses:
    ax.plot(*zip(*eval_losses), "o-", label="held-out loss")
  ax.set(xlabel="step", ylabel="cross-entropy (nats/char)", title=title)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
