"""A run's --out and its faults: an earlier run is never deleted, --out is checked first, a
failed write or a full disk ends in one message that says how to continue, Ctrl-C waits for
a write; the printed and documented commands; the shared progress bar."""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from typing import Any

import pytest

import llama_golden
from examples import checkpoint_checks, interrupt, options, progress, records
from examples import checkpoints as checkpoints_lib
from examples_support import EXAMPLES, ROOT, checkpoint_state, unoptimized
from examples_support import env, example, gpt, llama  # noqa: F401 (pytest fixtures)


# ------------------------------------------------------------ --out: nothing deleted, faults


def _refused(example: Any, capsys: pytest.CaptureFixture, *flags: str) -> str:
  """The one-line argparse error `example` exits with for `flags` (tiny preset)."""
  with pytest.raises(SystemExit) as exit:
    example.parse(["--preset", "tiny", *flags])
  assert exit.value.code == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err
  return err


def test_an_earlier_run_is_refused_and_fresh_moves_it_aside(example, capsys, tmp_path):
  out = tmp_path / "run"
  example.parse(["--preset", "tiny", "--out", str(out)])  # nothing there yet
  checkpoints = checkpoints_lib.Checkpoints(out / "checkpoints")
  for step in (10, 20):
    checkpoints.save(step, *checkpoint_state(float(step)), {"losses": [1.0] * step})
  records.write_json(out / "metrics.json", {"step": 20})
  # The same command again: refused, naming both ways on (it used to delete the checkpoints).
  assert (f"--out {out} holds an earlier run (checkpoints of steps 10, 20; metrics.json): pass "
          f"--resume to continue it, --fresh to start afresh (it is moved to "
          f"{out / 'earlier-1'}, not deleted), or another --out") in _refused(
              example, capsys, "--out", str(out))
  assert "pass one of them" in _refused(example, capsys, "--out", str(out), "--resume",
                                        "--fresh")
  assert {p.name for p in out.iterdir()} == {"checkpoints", "metrics.json"}
  args = example.parse(["--preset", "tiny", "--out", str(out), "--fresh"])
  checkpoints_lib.Checkpoints.for_run(args.out, fresh=args.fresh, command="")
  assert f"the earlier run in {out} moved to {out / 'earlier-1'}" in capsys.readouterr().out
  kept = out / "earlier-1"
  assert {p.name for p in kept.iterdir()} == {"checkpoints", "metrics.json"}
  restored = checkpoints_lib.Checkpoints(kept / "checkpoints").restore(*checkpoint_state(0.0))
  assert restored.step == 20 and len(restored.meta["losses"]) == 20  # intact
  assert checkpoints_lib.earlier_run(out) == []
  example.parse(["--preset", "tiny", "--out", str(out)])  # a new run goes on without a flag
  records.write_json(out / "metrics.json", {"step": 1})
  checkpoints_lib.Checkpoints.for_run(out, fresh=True, command="")
  assert (out / "earlier-2" / "metrics.json").is_file()  # the next --fresh: the next folder


@pytest.mark.parametrize("case", ["out_is_a_file", "out_under_a_file", "checkpoints_is_a_file",
                                  "out_read_only", "checkpoints_read_only"])
def test_out_is_checked_before_anything_is_built(example, capsys, monkeypatch, tmp_path, case):
  out = tmp_path / "run"
  if case == "out_is_a_file":
    out.write_text("")
    expected = f"--out: {out} is a file, not a directory: pass an --out that is a directory"
  elif case == "out_under_a_file":
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "run"
    expected = f"--out: cannot write to {out} (Not a directory): pass an --out you can write to"
  elif case == "checkpoints_is_a_file":
    out.mkdir()
    (out / "checkpoints").write_text("")
    expected = f"--out: {out / 'checkpoints'} is a file, not a directory"
  else:
    # The tests run as root, for whom no directory is read-only: the probe fails as it does
    # on a read-only filesystem (a read-only checkpoints/ failed only at the first save).
    where = out if case == "out_read_only" else out / "checkpoints"
    real = tempfile.TemporaryFile

    def read_only(*args: Any, dir: str, **kwargs: Any) -> Any:
      if pathlib.Path(dir) == where:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), dir)
      return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(options.tempfile, "TemporaryFile", read_only)
    expected = f"--out: cannot write to {where} (Read-only file system)"
  assert expected in _refused(example, capsys, "--out", str(out))


def test_a_failed_save_ends_in_one_message_naming_the_last_step_saved(tmp_path,
                                                                      monkeypatch, caplog):
  checkpoints = checkpoints_lib.Checkpoints(tmp_path / "checkpoints",
                                            command="python train.py --resume")
  checkpoints.save(10, *checkpoint_state(1.0), {"losses": []})

  def full_disk(step: int, args: Any) -> bool:
    # As Orbax fails on a full disk: its writer threads log an error with a traceback, then
    # the save raises its wrapper of tensorstore's error.
    logging.getLogger("absl").error("_SignalingThread.run() raised an exception: ...")
    try:
      raise ValueError("RESOURCE_EXHAUSTED: Error writing ...: No space left on device "
                       "[os_error_code='28']")
    except ValueError as e:
      raise Exception("Encountered error while writing: <bound method ...>") from e

  monkeypatch.setattr(checkpoints.manager, "save", full_disk)
  with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit:
    checkpoints.save(20, *checkpoint_state(2.0), {"losses": []})
  assert exit.value.code == (
      f"could not save checkpoint step 20 in {tmp_path / 'checkpoints'}: ValueError: "
      "RESOURCE_EXHAUSTED: Error writing ...: No space left on device [os_error_code='28']. "
      f"The last step saved is 10 ({tmp_path / 'checkpoints' / '10'}); free space on its "
      "disk, continue with: python train.py --resume")
  assert not caplog.records  # Orbax's error log held: the message says it


def test_a_full_disk_writing_metrics_ends_in_one_message(tmp_path, monkeypatch):
  path = tmp_path / "metrics.json"
  checkpoints = checkpoints_lib.Checkpoints(tmp_path / "checkpoints",
                                            command="python train.py --resume")
  with pytest.raises(SystemExit) as exit, checkpoints.writing(path):
    records.write_json(path, {"step": 1})  # fine
    assert json.loads(path.read_text()) == {"step": 1}

    def full_disk(*args: Any, **kwargs: Any) -> None:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(records.json, "dump", full_disk)
    records.write_json(path, {"step": 2})
  assert exit.value.code == (f"could not write {path}: OSError: [Errno 28] No space left on "
                             "device. No step is saved yet; free space on its disk, continue "
                             "with: python train.py --resume")
  assert json.loads(path.read_text()) == {"step": 1}  # the old file, whole
  assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["metrics.json"]  # no .tmp


def _small_disk(path: pathlib.Path, size: str) -> None:
  """Mounts a tmpfs of `size` at `path` (root on Linux), or skips the test."""
  path.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, text=True)
  if mounted.returncode:
    pytest.skip(f"cannot mount a small filesystem here: {mounted.stderr.strip()}")


FILL_THE_DISK = """
import pathlib, sys
import jax, numpy as np
from examples.checkpoints import Checkpoints
out = pathlib.Path(sys.argv[1])
checkpoints = Checkpoints(out / "checkpoints", command="python train.py --resume")
key = [(jax.random.key(0), 4)]
checkpoints.save(10, {"w": np.ones((64, 64), np.float32)}, {}, key, {"losses": []})
noise = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)  # 4 MB
checkpoints.save(20, {"w": noise}, {}, key, {"losses": []})
"""


def test_a_full_disk_during_a_save_prints_one_message_and_nothing_else(tmp_path):
  disk = tmp_path / "disk"
  _small_disk(disk, "1m")
  try:
    result = subprocess.run([sys.executable, "-c", FILL_THE_DISK, str(disk)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert (disk / "checkpoints" / "10").is_dir()  # the step before is intact
  finally:
    subprocess.run(["umount", str(disk)], check=True)
  # Was: the error's traceback, Orbax's logged tracebacks, "Event loop is closed" and
  # "sys.meta_path is None" at exit.
  assert result.returncode == 1 and result.stdout == ""
  (line,) = result.stderr.strip().splitlines()
  assert line.startswith(f"could not save checkpoint step 20 in {disk / 'checkpoints'}: "
                         "ValueError: RESOURCE_EXHAUSTED: ")
  # tensorstore's own words between the two differ by version (the GPU machine's added to them).
  assert "No space left on device" in line
  assert line.endswith(f". The last step saved is 10 ({disk / 'checkpoints' / '10'}); free space "
                       "on its disk, continue with: python train.py --resume")


@pytest.mark.cpu_only
def test_llama_on_a_full_disk_ends_in_one_message(tmp_path, env):
  """The tiny Llama run on a disk with room for one and a half checkpoints: step 10 saves,
  step 12 fails part-way. One message, no traceback (it was 87 lines with 11 tracebacks:
  Orbax's writes still in flight calling into its closed event loop, and asyncio's log of
  their futures at exit). On the CPU on any machine (`cpu_only`): the messages are Orbax's and
  the example's, not the device's; compiled `unoptimized` (its numbers are not checked)."""
  page = 4096  # tmpfs holds whole pages
  step_bytes = sum(-(-f.stat().st_size // page) * page
                   for f in (llama_golden.CHECKPOINT / "10").rglob("*") if f.is_file())
  disk = tmp_path / "disk"
  _small_disk(disk, f"{step_bytes * 3 // 2 // 1024}k")
  try:
    result = subprocess.run([sys.executable, "-m", "examples.llama.train", "--preset",
                             "tiny", "--generate", "0", "--out", str(disk / "run")],
                            env=unoptimized({**env, "JAX_PLATFORMS": "cpu"}),
                            capture_output=True, text=True, timeout=600)
    assert (disk / "run" / "checkpoints" / "10").is_dir()
  finally:
    subprocess.run(["umount", str(disk)], check=True)
  out = result.stdout + result.stderr
  assert result.returncode == 1, out
  for noise in ("Traceback", "Event loop is closed", "never retrieved", "Exception ignored"):
    assert noise not in out, out
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith(f"could not save checkpoint step 12 in {disk / 'run' / 'checkpoints'}"
                         ": ValueError: RESOURCE_EXHAUSTED: ") and "No space left on device" in last
  assert re.search(re.escape(f"The last step saved is 10 ({disk / 'run' / 'checkpoints' / '10'}"
                             "); free space on its disk, continue with: python -m examples.")
                   + re.escape(f"llama.train --preset tiny --generate 0 --out {disk / 'run'} "
                               "--resume") + "$", last), last


def test_closed_event_loop_callbacks_are_dropped_and_other_unraisables_kept(monkeypatch):
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  checkpoint_checks.quiet_closed_loops()
  checkpoint_checks.quiet_closed_loops()  # once is enough: not wrapped twice
  hook = sys.unraisablehook
  assert hook.__closure__[0].cell_contents == seen.append

  def unraisable(error: BaseException) -> Any:
    return type("Unraisable", (), {"exc_type": type(error), "exc_value": error,
                                   "exc_traceback": None, "err_msg": None, "object": None})

  for error in (RuntimeError("Event loop is closed"),
                ImportError("sys.meta_path is None, Python is likely shutting down")):
    hook(unraisable(error))  # Orbax's callbacks after a failed read or write
  assert seen == []
  other = unraisable(RuntimeError("something else"))
  hook(other)
  assert seen == [other]


def test_orbax_errors_logged_after_a_failed_save_are_dropped_and_others_kept(monkeypatch):
  """A writer thread of Orbax's that fails after the save it served has failed and been
  reported logs its error through absl, traceback and all (seen once in the full-disk run
  above): dropped once the failure is reported, not before (an Orbax error of a save that
  did not fail, held while it ran, goes out after it); other code's errors and Orbax's
  warnings go on."""
  monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
  for name in ("absl", "asyncio"):  # as a process that never failed a save has them
    monkeypatch.setattr(logging.getLogger(name), "filters",
                        [f for f in logging.getLogger(name).filters
                         if f is not checkpoint_checks._orbax_late_errors])
  absl_logger, handled = logging.getLogger("absl"), []
  monkeypatch.setattr(absl_logger, "callHandlers", handled.append)
  orbax = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "_src", "futures",
                       "future.py")

  def record(level: int, path: str) -> logging.LogRecord:
    return logging.LogRecord("absl", level, path, 1, "raised an exception", None, None)

  def logged(level: int, path: str) -> bool:
    return bool(absl_logger.filter(record(level, path)))

  checkpoint_checks.quiet_closed_loops()  # as every `Checkpoints` does before its first save
  error = record(logging.ERROR, orbax)
  with checkpoint_checks.orbax_errors_held():  # a save that does not fail
    absl_logger.handle(error)
    assert handled == []
  assert handled == [error]
  checkpoint_checks.quiet_late_orbax_errors()  # a save failed
  assert not logged(logging.ERROR, orbax)
  assert logged(logging.WARNING, orbax)
  assert logged(logging.ERROR, os.path.join(os.sep, "work", "examples", "checkpoints.py"))


def test_never_retrieved_errors_of_orbax_writes_are_dropped_and_others_kept():
  """asyncio logs each failed write's future when it is collected ("Future exception was
  never retrieved"): dropped where Orbax's code raised it, or tensorstore (no Orbax frame)
  about a file in Orbax's temporary step folder, as in the full-disk run above once; kept
  for any other error, and for every other record."""
  def never_retrieved(error: BaseException) -> logging.LogRecord:
    return logging.LogRecord("asyncio", logging.ERROR, "asyncio/base_events.py", 1,
                             "Future exception was never retrieved\nfuture: <Future ...>",
                             None, (type(error), error, None))

  tensorstore = ValueError("RESOURCE_EXHAUSTED: Error writing local file "
                           "\"/disk/checkpoints/20.orbax-checkpoint-tmp-17/default/d/0\": "
                           "[OS error: No space left on device]")
  assert not checkpoint_checks._orbax_future_records(never_retrieved(tensorstore))
  wrapped = RuntimeError("the write failed")
  wrapped.__cause__ = tensorstore
  assert not checkpoint_checks._orbax_future_records(never_retrieved(wrapped))
  other = ValueError("RESOURCE_EXHAUSTED: Error writing local file \"/data/shard-3\"")
  assert checkpoint_checks._orbax_future_records(never_retrieved(other))
  plain = logging.LogRecord("asyncio", logging.ERROR, "x.py", 1, str(tensorstore), None, None)
  assert checkpoint_checks._orbax_future_records(plain)


def test_ctrl_c_inside_a_write_waits_for_it():
  """examples/interrupt.py's handler: Ctrl-C inside `held()` (a save, metrics.json) is raised
  when the write is done; elsewhere at once (the runs above: `_interrupted`)."""
  written = []
  with pytest.raises(KeyboardInterrupt):
    with interrupt.held():
      with interrupt.held():  # nested: the outermost write ends first
        interrupt._handler(signal.SIGINT, None)
        written.append("inner")
      written.append("outer")
  assert written == ["inner", "outer"] and not interrupt.RUN.pending
  with pytest.raises(KeyboardInterrupt):
    interrupt._handler(signal.SIGINT, None)


def test_resume_command_continues_the_run():
  module = "examples.llama.train"
  assert options.resume_command(module, [
      "--preset", "tiny", "--stop-after", "5", "--out", "a b", "--fresh"]) == (
          "python -m examples.llama.train --preset tiny --out 'a b' --resume")
  assert options.resume_command(module, ["--stop-after=5", "--resume"]) == (
      "python -m examples.llama.train --resume")


def _documented_runs(page: pathlib.Path, module: str) -> list[list[str]]:
  """The flags of every command of `page`'s shell blocks that runs `module`, in order."""
  runs, fence = [], None
  for line in page.read_text().replace("\\\n", " ").splitlines():
    if line.startswith("```"):
      fence = None if fence is not None else line[3:] or "text"
    elif fence in ("bash", "sh"):
      words = shlex.split(line, comments=True)
      runs += [words[i + 1:] for i, word in enumerate(words) if word == module]
  return runs


@pytest.mark.parametrize("page, module, default", [
    ("docs/quickstart.md", "examples.train_gpt", "runs/gpt"),
    ("docs/llama.md", "examples.llama.train", "runs/llama"),
    ("README.md", "examples.train_gpt", "runs/gpt")])
def test_documented_commands_run_in_order_meet_no_earlier_run(page, module, default):
  # Each command that starts a run (no --resume, no --fresh) needs an --out no command
  # before it wrote: else it is refused (it used to delete the earlier run's checkpoints).
  used = set()
  runs = _documented_runs(ROOT / page, module)
  assert runs, page
  for flags in runs:
    out = flags[flags.index("--out") + 1] if "--out" in flags else default
    if not {"--resume", "--fresh"} & set(flags):
      assert out not in used, (page, flags)
    used.add(out)


def test_examples_share_one_progress_bar(monkeypatch, capsys):
  for script in (EXAMPLES / "train_gpt.py", EXAMPLES / "llama" / "train.py"):
    source = script.read_text()
    assert "progress_bar(" in source and "class tqdm" not in source, script
    assert "def progress(" not in source, script
  import tqdm

  bar = progress.progress_bar(range(3, 6), total=5)  # a resumed run: steps 1 and 2 were done
  assert isinstance(bar, tqdm.tqdm) and bar.n == 2
  for step in bar:  # the count moves with the steps, not only when the bar redraws
    assert bar.n == step
  bar.close()
  monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed: log lines only
  bar = progress.progress_bar(range(3, 6), total=5)
  assert isinstance(bar, progress.LogLines) and list(bar) == [3, 4, 5]
  bar.set_postfix(loss="1.0")
  bar.write("step 5: loss 1.0")
  assert capsys.readouterr().out == "step 5: loss 1.0\n"
