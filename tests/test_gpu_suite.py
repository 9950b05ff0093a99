""".ci/gpu_suite.py: README's GPU command, run and recorded (docs/reliability.md, "Running the
tests on a GPU"). Here on trivial suites of its own, in trees without and with git."""

from __future__ import annotations

import datetime
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "gpu_suite.py"
_spec = importlib.util.spec_from_file_location("gpu_suite", SCRIPT)
gpu_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_suite)

TWO_TESTS = "def test_passes():\n  pass\n\n\ndef test_fails():\n  assert False\n"


def _tree(root: pathlib.Path) -> pathlib.Path:
  """A repository tree of its own: the script and a suite of one passing, one failing test."""
  (root / ".ci").mkdir(parents=True)
  shutil.copy(SCRIPT, root / ".ci" / SCRIPT.name)
  (root / "tests").mkdir()
  (root / "tests" / "test_two.py").write_text(TWO_TESTS)
  return root


def _run(root: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
  """The script of `root`, with one pytest process (`-n 0` after README's `-n 4`)."""
  return subprocess.run([sys.executable, str(root / ".ci" / SCRIPT.name), *args, "--", "-n", "0",
                         "-p", "no:cacheprovider"],
                        cwd=root, capture_output=True, text=True, timeout=300, check=False)


def _git(root: pathlib.Path, *args: str) -> str:
  return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t",
                         *args], capture_output=True, text=True, check=True).stdout.strip()


def _repository(root: pathlib.Path) -> pathlib.Path:
  _tree(root)
  _git(root, "init", "-q")
  _git(root, "add", "-A")
  _git(root, "commit", "-qm", "the suite")
  return root


def test_readme_gpu_command_is_the_scripts():
  command = " ".join(gpu_suite.COMMAND)
  for page in ("README.md", "docs/reliability.md"):
    found = re.findall(r'pip install -e "\.\[cuda,test\]" && (python -m pytest[^\n`]*)',
                       (ROOT / page).read_text())
    assert found and set(found) == {command}, page


def test_summary_line_is_pytests_last():
  lines = ["tests/test_two.py .F", "FAILED tests/test_two.py::test_fails - assert False",
           "=================== 1 failed, 1 passed in 0.12s ===================", ""]
  assert gpu_suite.summary_line(lines) == "1 failed, 1 passed in 0.12s"
  assert gpu_suite.summary_line(["523 passed, 5 skipped in 310.12s (0:05:10)"]) == (
      "523 passed, 5 skipped in 310.12s (0:05:10)")
  assert gpu_suite.summary_line(["==== no tests ran in 0.01s ===="]) == "no tests ran in 0.01s"
  assert gpu_suite.summary_line(["Traceback (most recent call last):"]) is None


@pytest.mark.cpu_only
def test_device_line_counts_every_device():
  """The record's device line names how many devices the suite saw: all of the default
  backend's, by kind (the probe in a process of its own, here given 4 CPU devices)."""
  assert gpu_suite.device_line("gpu", ["NVIDIA H200"] * 4) == "gpu: 4 x NVIDIA H200"
  assert gpu_suite.device_line("gpu", ["H100", "A100", "H100"]) == "gpu: 2 x H100, 1 x A100"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  device, version = gpu_suite.device_and_jax(env)
  assert device == f"cpu: 4 x {jax.devices('cpu')[0].device_kind}"
  assert version.startswith(f"{jax.__version__} (jaxlib ")


def test_a_copy_without_git_is_recorded_under_the_given_commit(tmp_path):
  root = _tree(tmp_path / "tree")
  refused = _run(root)
  assert refused.returncode != 0 and "pass --commit" in refused.stderr
  assert not (root / gpu_suite.RECORD).exists()

  sha, record = "0123456789abcdef0123456789abcdef01234567", tmp_path / "out" / "gpu-suite.txt"
  before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
  done = _run(root, "--commit", sha, "--record", str(record))
  assert done.returncode == 1, done.stdout + done.stderr  # pytest's status: a test failed
  assert "test_fails" in done.stdout  # pytest's output is passed through
  found = gpu_suite.read_record(record)
  assert list(found) == ["commit", "device", "jax", "date", "command", "summary", "exit"]
  assert found["commit"] == sha
  devices = jax.devices()  # the probe inherits this process's JAX_PLATFORMS and XLA_FLAGS
  assert found["device"] == f"{devices[0].platform}: {len(devices)} x {devices[0].device_kind}"
  assert found["jax"].startswith(f"{jax.__version__} (jaxlib ")
  date = datetime.datetime.strptime(found["date"], "%Y-%m-%d %H:%M:%S UTC")
  assert before <= date.replace(tzinfo=datetime.timezone.utc)
  assert found["command"] == "PYTHONPATH=. python -m pytest -n 4 -n 0 -p no:cacheprovider"
  assert re.fullmatch(r"1 failed, 1 passed in [\d.]+s", found["summary"]), found["summary"]
  assert found["exit"] == "1"


def test_a_git_checkout_is_recorded_at_head_and_only_when_clean(tmp_path):
  root = _repository(tmp_path / "repo")
  (root / "tests" / "test_two.py").write_text("def test_passes():\n  pass\n")
  refused = _run(root)
  assert refused.returncode != 0 and "the tree differs from HEAD" in refused.stderr
  assert "tests/test_two.py" in refused.stderr and not (root / gpu_suite.RECORD).exists()
  _git(root, "commit", "-qam", "one test")
  head = _git(root, "rev-parse", "HEAD")
  wrong = _run(root, "--commit", "f" * 40)
  assert wrong.returncode != 0 and f"is not HEAD ({head})" in wrong.stderr

  done = _run(root)
  assert done.returncode == 0, done.stdout + done.stderr
  found = gpu_suite.read_record(root / gpu_suite.RECORD)
  assert found["commit"] == head and found["exit"] == "0"
  assert re.fullmatch(r"1 passed in [\d.]+s", found["summary"])
  assert gpu_suite.tested_commit(root, None) == head  # the record is no change to the tree


def test_check_holds_the_landing_rule(tmp_path):
  root = _repository(tmp_path / "repo")
  record = root / gpu_suite.RECORD

  def write(command=gpu_suite.COMMAND, status=0):
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(gpu_suite.record_text(
        commit=_git(root, "rev-parse", "HEAD"), device="gpu: 1 x H100", jax_version="0.11.2",
        date=datetime.datetime.now(datetime.timezone.utc), command=command,
        summary="2 passed in 1.00s", status=status))
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "the record")

  assert "no record" in gpu_suite.check(root, record)[0]
  write()
  assert gpu_suite.check(root, record) == []
  (root / "README.md").write_text("docs only\n")
  _git(root, "add", "-A")
  _git(root, "commit", "-qm", "docs")
  assert gpu_suite.check(root, record) == []
  changed = ["the working tree changes jaxgraph, tests, examples, pyproject.toml, conftest.py"]
  (root / "conftest.py").write_text("# the docs' run\n")  # the root conftest counts too
  assert gpu_suite.check(root, record) == changed
  (root / "conftest.py").unlink()
  (root / "tests" / "test_two.py").write_text("def test_passes():\n  pass\n")
  assert gpu_suite.check(root, record) == changed
  _git(root, "commit", "-qam", "a test changed")
  (problem,) = gpu_suite.check(root, record)
  assert problem.startswith("commits after the record change") and "a test changed" in problem

  write(command=[*gpu_suite.COMMAND, "tests/test_two.py"], status=1)
  problems = gpu_suite.check(root, record)
  assert len(problems) == 2
  assert "not README's `PYTHONPATH=. python -m pytest -n 4`" in problems[0]
  assert problems[1] == "the recorded run failed: 2 passed in 1.00s"
