"""The command line the training examples share: their run options, the checks of `--out`,
`--steps` and `--resume` before anything is built, and the commands that start and continue
a run (`python -m examples.NAME`, from the repository root).
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import sys
import tempfile
from typing import Any, Callable, Sequence

import jax

from examples.checkpoints import KEEP, Checkpoints, aside, earlier_run
from examples.records import restore_metrics


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
