#!/usr/bin/env python3
"""Runs README's GPU test command and records the run in docs/results/gpu-suite.txt.

    python3 .ci/gpu_suite.py                                    # a git checkout: HEAD
    python3 .ci/gpu_suite.py --commit SHA --record DIR/gpu-suite.txt   # a copy without .git
    python3 .ci/gpu_suite.py --check       # does the committed record cover HEAD?

It runs `python -m pytest -n 4` (README.md, "Run the tests") in the repository root with the
tree on PYTHONPATH (nothing installed), streams pytest's output, writes the record and exits
with pytest's status. The record names the commit whose tree was tested, the device, the jax
version, the date (UTC), the command and pytest's summary line. Arguments after `--` are
added to pytest's and appear in the record's command, so such a record is not one of the
whole suite (`--check` refuses it).

Where git is at hand the commit is HEAD, and a tree that differs from it (uncommitted or
untracked files; the record itself aside) is refused: the record would name a commit that
is not what ran. A copy without .git (the GPU machine) takes `--commit SHA`, the
`git rev-parse HEAD` of the checkout it was copied from, clean.

`--check` is the landing rule of docs/reliability.md ("Running the tests on a GPU"): the
record is of README's command, it passed, and no commit after its commit changes
jaxgraph/, tests/, examples/, pyproject.toml or the root conftest.py (the docs' run), nor
does the working tree.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORD = pathlib.Path("docs/results/gpu-suite.txt")  # relative to the repository root
COMMAND = ("python", "-m", "pytest", "-n", "4")  # README's GPU test command
GUARDED = ("jaxgraph", "tests", "examples", "pyproject.toml", "conftest.py")  # need a new run
_PROBE = ("import json, jax, jaxlib; d = jax.devices(); print(json.dumps(dict("
          "jax=jax.__version__, jaxlib=jaxlib.__version__, platform=d[0].platform, "
          "kinds=[x.device_kind for x in d])))")
# pytest's last line: "==== 1 failed, 523 passed, 5 skipped in 310.12s (0:05:10) ====".
_SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+|no tests ran)(?:, \d+ \w+)* in [\d.]+s\b.*?)\s*=*$")


def _git(root: pathlib.Path, *args: str) -> str | None:
  """git's stdout in `root`, or None where git fails or `root` is not a repository's top
  (a copy of the tree inside some other repository is no checkout of this one)."""
  if shutil.which("git") is None:
    return None
  def run(*command: str) -> str | None:
    done = subprocess.run(["git", "-C", str(root), *command], capture_output=True, text=True,
                          check=False)
    return done.stdout if done.returncode == 0 else None
  top = run("rev-parse", "--show-toplevel")
  if top is None or pathlib.Path(top.strip()).resolve() != root.resolve():
    return None
  return run(*args)


def tested_commit(root: pathlib.Path, given: str | None) -> str:
  """The commit whose tree `root` is: git's HEAD on a clean tree, else `given`.

  Raises:
    SystemExit: the tree differs from HEAD, `given` is not HEAD, or there is no git and
      no `given` (each message names the fix).
  """
  head = _git(root, "rev-parse", "HEAD")
  if head is None:
    if given is None or not re.fullmatch(r"[0-9a-f]{40}", given):
      raise SystemExit(
          f"no git repository at {root}: pass --commit with the 40-hex `git rev-parse HEAD` "
          f"of the clean checkout this tree was copied from (got {given!r}).")
    return given
  head = head.strip()
  if given is not None and given != head:
    raise SystemExit(f"--commit {given} is not HEAD ({head}) of {root}: check out that "
                     "commit, or leave --commit out where git is at hand.")
  status = _git(root, "status", "--porcelain", "--untracked-files=all")
  changed = [line for line in status.splitlines() if line[3:] != RECORD.as_posix()]
  if changed:
    raise SystemExit("the tree differs from HEAD, so a record would name a commit that is "
                     "not what ran:\n  " + "\n  ".join(changed) +
                     "\nCommit or stash these first.")
  return head


def device_line(platform: str, kinds: Sequence[str]) -> str:
  """The record's device: the platform and how many devices of each kind, in jax's order
  ("gpu: 4 x NVIDIA H200", "gpu: 2 x NVIDIA H100 80GB HBM3, 1 x NVIDIA A100-SXM4-80GB")."""
  counts = {kind: kinds.count(kind) for kind in kinds}
  return f"{platform}: " + ", ".join(f"{n} x {kind}" for kind, n in counts.items())


def device_and_jax(env: dict[str, str]) -> tuple[str, str]:
  """("gpu: 4 x NVIDIA H100 80GB HBM3", "0.11.2 (jaxlib 0.11.2)"): every device of jax's
  default backend, asked of jax in a process of its own that ends before the suite starts
  (it holds no device memory)."""
  run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                       env={**env, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, check=False)
  if run.returncode != 0:
    failed = f"unknown (jax failed to start: {run.stderr.strip().splitlines()[-1:]})"
    return failed, failed
  found = json.loads(run.stdout.strip().splitlines()[-1])
  return (device_line(found["platform"], found["kinds"]),
          f"{found['jax']} (jaxlib {found['jaxlib']})")


def summary_line(lines: Sequence[str]) -> str | None:
  """pytest's summary line ("1 failed, 523 passed in 310.12s (0:05:10)"), the last one
  found, or None (pytest stopped before it)."""
  for line in reversed(lines):
    found = _SUMMARY.match(line.strip())
    if found:
      return found.group(1)
  return None


def record_text(*, commit: str, device: str, jax_version: str, date: datetime.datetime,
                command: Sequence[str], summary: str | None, status: int) -> str:
  """The record: one `key value` line each."""
  return "".join(f"{key} {value}\n" for key, value in [
      ("commit", commit), ("device", device), ("jax", jax_version),
      ("date", date.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")),
      ("command", "PYTHONPATH=. " + " ".join(command)),
      ("summary", summary or "none (pytest stopped before its summary line)"),
      ("exit", status)])


def read_record(path: pathlib.Path) -> dict[str, str]:
  return dict(line.split(" ", 1) for line in path.read_text().splitlines() if line)


def check(root: pathlib.Path, record: pathlib.Path) -> list[str]:
  """What keeps `record` from covering HEAD of `root`; empty where it does."""
  if not record.exists():
    return [f"no record at {record}: run .ci/gpu_suite.py on the GPU machine"]
  found = read_record(record)
  problems = []
  want = "PYTHONPATH=. " + " ".join(COMMAND)
  if found.get("command") != want:
    problems.append(f"the record is of `{found.get('command')}`, not README's `{want}`")
  if found.get("exit") != "0":
    problems.append(f"the recorded run failed: {found.get('summary')}")
  commit = found.get("commit", "")
  if _git(root, "merge-base", "--is-ancestor", commit, "HEAD") is None:
    problems.append(f"the recorded commit {commit!r} is not an ancestor of HEAD")
    return problems
  later = _git(root, "log", "--format=%h %s", f"{commit}..HEAD", "--", *GUARDED).strip()
  if later:
    problems.append(f"commits after the record change {', '.join(GUARDED)}:\n  "
                    + later.replace("\n", "\n  "))
  if _git(root, "status", "--porcelain", "--", *GUARDED):
    problems.append(f"the working tree changes {', '.join(GUARDED)}")
  return problems


def run_suite(root: pathlib.Path, commit: str, record: pathlib.Path,
              pytest_args: Sequence[str]) -> int:
  """Runs the suite in `root`, writes `record`, returns pytest's exit status."""
  env = {**os.environ, "PYTHONUNBUFFERED": "1",
         "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
  device, jax_version = device_and_jax(env)
  command = [*COMMAND, *pytest_args]
  tail: list[str] = []
  with subprocess.Popen([sys.executable, *command[1:]], cwd=root, env=env, text=True,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as pytest:
    for line in pytest.stdout:
      sys.stdout.write(line)
      tail = [*tail[-49:], line]
  record.parent.mkdir(parents=True, exist_ok=True)
  record.write_text(record_text(
      commit=commit, device=device, jax_version=jax_version,
      date=datetime.datetime.now(datetime.timezone.utc), command=command,
      summary=summary_line(tail), status=pytest.returncode))
  print(f"\nrecord: {record}\n{record.read_text()}", end="")
  return pytest.returncode


def main(argv: Sequence[str]) -> int:
  argv = list(argv)
  pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
  ours = argv[:argv.index("--")] if "--" in argv else argv
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--commit", help="the commit whose tree this is (where there is no git)")
  parser.add_argument("--record", type=pathlib.Path, default=ROOT / RECORD,
                      help=f"where the record goes (default: {RECORD})")
  parser.add_argument("--check", action="store_true",
                      help="say whether the record covers HEAD; run nothing")
  args = parser.parse_args(ours)
  if args.check:
    problems = check(ROOT, args.record)
    print("\n".join(problems) if problems else f"{args.record} covers HEAD")
    return 1 if problems else 0
  return run_suite(ROOT, tested_commit(ROOT, args.commit), args.record, pytest_args)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
