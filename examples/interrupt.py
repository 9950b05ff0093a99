"""Ctrl-C in the examples: the run ends with one line that says what was kept and the command
that continues, exit status 130, and no half-written file. An example that saves no
checkpoints (fsdp_train, pipeline_1f1b, linen_mlp) says what it finished and the command that
runs it again.

`run` calls an example's `main` with a SIGINT handler installed. The handler raises
`KeyboardInterrupt` where the run is (capture, a step, evaluation, generation: nothing there
is written), except inside `held()`, around every write (a checkpoint save, metrics.json,
loss.png, a step moved aside): there the first Ctrl-C waits for the write to finish, so a
checkpoint step is complete or absent and Orbax's threads are not cut off mid-save; a second
one stops at once (Orbax leaves the step's temporary folder, which the next run's checkpoints
remove when they open). The run's `point`s name where it is, for that line; in an example
that saves nothing, `finished` names what of the run is done (printed above).

The process then ends by `os._exit(130)`, after flushing its output: the interpreter's own
exit runs with XLA compiles or Orbax's writer threads still going when Ctrl-C lands in them,
and crashed there (a segfault after a capture was interrupted; "cannot schedule new futures
after shutdown" from an Orbax thread). Nothing is lost by skipping it: every file the run
writes is finished (`held`) or written atomically before the handler can raise.

For tests: EXAMPLES_INTERRUPT_AT=NAME (or NAME@STEP) sends the process a SIGINT at that
`point`; NAME "compile" sends it while the main thread is inside an XLA compile (or its
load from JAX's persistent compilation cache).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator

from examples.progress import close_bars

# What each `point` is called in the last line.
PHASES = {
    "start": "start-up", "capture": "capture", "restore": "the resume's restore",
    "training": "training", "evaluation": "evaluation", "save": "a checkpoint save",
    "check": "--check", "outputs": "writing loss.png and metrics.json",
    "generation": "generation", "summary": "the summary of its executables",
    "compare": "--compare's training on one device",
}
# The phases whose line names the step.
STEPPED = ("training", "evaluation", "save", "compare")
TEST_ENV = "EXAMPLES_INTERRUPT_AT"


class _Run:
  """Where the run is, and what it has kept."""

  phase = "start"
  step: int | None = None
  command: str | None = ""  # continues the run (--resume); None: the example saves nothing
  rerun = ""  # the command as given: starts it again where --fresh has not moved a run yet
  directory: pathlib.Path | None = None  # its checkpoints' folder, before they are opened
  fresh = False
  checkpoints: Any = None  # the run's Checkpoints (checkpoints.py): its `saved` step, `directory`
  last_step: int | None = None  # the run's last step: a checkpoint there leaves nothing to train
  holding = 0  # depth of `held()`
  pending = False  # a Ctrl-C arrived inside `held()`
  finished: list[str] = []  # what a run that saves nothing has done, for its last line


RUN = _Run()


def point(phase: str, step: int | None = None) -> None:
  """The run is at `phase` (a key of PHASES), at `step` where it trains."""
  RUN.phase, RUN.step = phase, step
  wanted = os.environ.get(TEST_ENV)
  if wanted and wanted in (phase, f"{phase}@{step}"):
    os.kill(os.getpid(), signal.SIGINT)
  elif wanted == "compile" and phase == "capture":
    threading.Thread(target=_interrupt_a_compile, daemon=True).start()


def finished(what: str) -> None:
  """The run (of an example that saves nothing) has done `what`: "the 30 training steps"."""
  RUN.finished.append(what)


def _interrupt_a_compile() -> None:
  """Sends SIGINT once the main thread is inside an XLA compile or a load of one from the
  compilation cache (the test hook; `compile_or_get_cached` is JAX's, around both)."""
  main = threading.main_thread().ident
  for _ in range(60_000):  # at most a minute
    frame = sys._current_frames().get(main)
    if frame is not None and any(f.name == "compile_or_get_cached"
                                 for f in traceback.extract_stack(frame)):
      os.kill(os.getpid(), signal.SIGINT)
      return
    time.sleep(0.001)


def starting(directory: pathlib.Path, *, fresh: bool) -> None:
  """The run's checkpoints will be in `directory` (their steps on disk are what it keeps
  until they are opened); `fresh`: an earlier run there is still to be moved aside."""
  RUN.directory, RUN.fresh = directory.absolute(), fresh


def watch(checkpoints: Any, *, command: str, last_step: int) -> None:
  """The run's checkpoints (what the last line reports as kept) and its last step."""
  RUN.checkpoints, RUN.command, RUN.last_step = checkpoints, command, last_step


@contextlib.contextmanager
def held() -> Iterator[None]:
  """A write that Ctrl-C must not cut: the first Ctrl-C inside waits for it to finish."""
  RUN.holding += 1
  try:
    yield
  finally:
    RUN.holding -= 1
  if RUN.pending and not RUN.holding:
    RUN.pending = False
    raise KeyboardInterrupt


def _handler(signum: int, frame: Any) -> None:
  if not RUN.holding:
    raise KeyboardInterrupt
  if RUN.pending:  # the second Ctrl-C inside a write
    _stop(_line(twice=True))
  RUN.pending = True


def _line(twice: bool = False) -> str:
  """The last line: where the run was, what it kept, the command that continues."""
  where = PHASES.get(RUN.phase, RUN.phase)
  if RUN.phase in STEPPED and RUN.step is not None:
    where += f" (step {RUN.step})"
  stopped = "Ctrl-C twice: stopped" if twice else "interrupted (Ctrl-C)"
  if twice:
    where += ", without finishing it"
  if RUN.command is None:  # nothing is saved: what finished, and the command again
    kept = (f"it finished {' and '.join(RUN.finished)} (printed above) and saves no "
            "checkpoints" if RUN.finished else "this example saves no checkpoints, so nothing "
            "is kept")
    return f"{stopped} during {where}: {kept}; run it again with: {RUN.rerun}"
  command = RUN.command or "the same command with --resume"
  if RUN.checkpoints is None and RUN.fresh:  # the earlier run is where it was
    return (f"{stopped} during {where}: nothing of this run is saved yet (--fresh has not "
            f"moved the earlier run aside); start it again with: {RUN.rerun}")
  if RUN.checkpoints is not None:
    saved, directory = RUN.checkpoints.saved, pathlib.Path(RUN.checkpoints.directory)
  else:  # not opened yet: a resumed run's steps on disk
    directory = RUN.directory
    steps = [] if directory is None else [int(p.name) for p in directory.glob("*")
                                          if p.name.isdigit() and p.is_dir()]
    saved = max(steps, default=None)
  kept = ("no checkpoint step saved yet" if saved is None
          else f"checkpoint step {saved} kept ({directory / str(saved)})")
  if saved is not None and saved == RUN.last_step:
    return (f"{stopped} during {where}: every step is trained, {kept}; nothing is left to "
            f"train (`{command}` says so, and writes metrics.json from it if missing)")
  return f"{stopped} during {where}: {kept}; continue with: {command}"


def _stop(line: str) -> None:
  """Ends the process with `line` and status 130, skipping the interpreter's exit (above)."""
  close_bars()
  sys.stdout.flush()
  print(line, file=sys.stderr, flush=True)
  os._exit(130)


def run(main: Callable[[list[str]], Any], argv: list[str], *, rerun: str,
        command: str | None = None) -> None:
  """Runs `main(argv)`, Ctrl-C ending it in one line (`rerun`: `argv`'s command; `command`:
  the one that continues from the run's checkpoints, None for an example that saves none).
  An inherited SIGINT that is ignored (a background job, nohup) stays ignored."""
  RUN.command, RUN.rerun = command, rerun
  if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _handler)
  try:
    main(argv)
  except KeyboardInterrupt:
    _stop(_line())
