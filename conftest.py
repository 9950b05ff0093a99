"""The docs run: every python block of README.md and docs/*.md (api.md aside) is a test (Sybil).

A page runs as its reader would run it: its blocks, in page order, in one fresh Python
interpreter started for the page in the repository's root (tests/docs_page.py). Each visible
block runs as if copied alone, in a fresh namespace, unless its first line is a comment saying
it `continues the block above` (then it runs in the namespace that block left), and must
print something; no block sees the suite's imports, fixtures or `sys.path`. pyproject.toml's
testpaths put README.md and docs/ next to tests/, so `python -m pytest` runs them with the
suite; the page's interpreter inherits the environment tests/conftest.py sets up (on CPU 8
virtual devices, which the FSDP pages state they use) and shares the run's compilation cache.
`python -m pytest -k quickstart.md` runs one page so; a page named alone (`python -m pytest
docs/quickstart.md`) runs without tests/conftest.py, on JAX's defaults. Markdown comments
steer a block:

* `<!-- skip: next "reason" -->` skips the next block (or `skip: next if(cond, reason="...")`,
  evaluated in the page's interpreter, so `cond` reads the names the block above defined);
* `<!-- invisible-code-block: python ... -->` runs code the rendered page does not show, in a
  copy of the namespace the visible block above it left: it checks what that block did
  (`printed` holds what it printed), but what it defines or imports reaches no later block,
  so the setup a page needs is on the page.

A page's blocks share one interpreter (a chain of continued blocks, one namespace), so one
xdist worker runs all of them (`xdist_group` per page; pyproject.toml's `--dist loadgroup`), in
page order also when the suite is shuffled (`--random-order`: the `random_order(disabled=True)`
mark). Where xdist's grouping does not take (pytest-xdist 3.8 under pytest 9.2), the run stops
at collection with the fix rather than failing the pages' blocks one by one.
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import subprocess
import sys
import tempfile
from typing import Any

import pytest
from sybil import Sybil
from sybil.evaluators.skip import Skipper
from sybil.example import Example, SybilFailure
from sybil.parsers.markdown import CodeBlockParser, SkipParser

ROOT = pathlib.Path(__file__).resolve().parent
PAGE_INTERPRETER = ROOT / "tests" / "docs_page.py"
BLOCK_SECONDS = 600  # a block that runs longer is stopped and fails (a hang, not a slow page)


def _page_environment() -> dict[str, str]:
  """This process's environment, with the run's persistent compilation cache where it has one
  (tests/conftest.py sets it on CPU): the pages compile what the tests compiled."""
  env = dict(os.environ)
  jax = sys.modules.get("jax")
  cache = jax.config.jax_compilation_cache_dir if jax is not None else None
  if cache:
    env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return env


class PageInterpreter:
  """The fresh `python` one page's blocks run in (tests/docs_page.py), its stderr in a file."""

  def __init__(self) -> None:
    self._stderr = tempfile.TemporaryFile()
    self._process = subprocess.Popen(
        [sys.executable, "-c", PAGE_INTERPRETER.read_text()], cwd=ROOT, env=_page_environment(),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True)

  def ask(self, request: dict[str, Any]) -> dict[str, Any]:
    """Sends one request, returns its answer; raises if the interpreter died or hung."""
    process = self._process
    try:
      process.stdin.write(json.dumps(request) + "\n")
      process.stdin.flush()
    except OSError:  # it died before: the next check says how
      pass
    ready, _, _ = select.select([process.stdout], [], [], BLOCK_SECONDS)
    if not ready:
      process.kill()
      process.wait()
      raise RuntimeError(f"the page's interpreter gave no answer in {BLOCK_SECONDS} s (stopped)."
                         f"{self._stderr_tail()}")
    answer = process.stdout.readline()
    if answer:
      return json.loads(answer)
    try:  # its stdout closed: it is exiting
      process.wait(timeout=60)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
    raise RuntimeError(f"the page's interpreter exited with {process.returncode}."
                       f"{self._stderr_tail()}")

  def _stderr_tail(self, chars: int = 4000) -> str:
    self._stderr.seek(0)
    tail = self._stderr.read().decode(errors="replace")[-chars:]
    return f" Its stderr ends:\n{tail}" if tail else ""

  def close(self) -> None:
    process = self._process
    if process.poll() is None:
      process.stdin.close()
      try:
        process.wait(timeout=60)
      except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    process.stdout.close()
    self._stderr.close()


def _interpreter(example: Example) -> PageInterpreter:
  namespace = example.namespace
  if "interpreter" not in namespace:
    namespace["interpreter"] = PageInterpreter()
  return namespace["interpreter"]


def _close_interpreter(namespace: dict[str, Any]) -> None:
  interpreter = namespace.pop("interpreter", None)
  if interpreter is not None:
    interpreter.close()


def _run_block(example: Example) -> None:
  """Runs one python block in its page's interpreter (hidden ones in a copy of its namespace)."""
  __tracebackhide__ = True
  answer = _interpreter(example).ask({
      "source": example.parsed, "path": example.path,
      "line": example.line + example.parsed.line_offset,
      "hidden": example.region.lexemes.get("directive", "").startswith("invisible")})
  if answer["error"]:
    raise SybilFailure(example, answer["error"])


class _PageSkipper(Skipper):
  """Sybil's skip directive with its condition evaluated in the page's interpreter, where the
  names it reads (`jax`, ...) are the page's own. (Overrides `Skipper.install`, sybil 10.)"""

  def install(self, example: Example, state: Any, reason: str | None) -> None:
    example.document.push_evaluator(self)
    if reason:
      answer = _interpreter(example).ask({"skip": reason})
      if "error" in answer:
        raise SybilFailure(example, answer["error"])
      if answer["skip"]:
        state.exception = pytest.skip.Exception(answer["skip"])
      else:
        state.active = False


def _skip_parser() -> SkipParser:
  parser = SkipParser()
  parser.skipper = _PageSkipper(parser.directive)
  return parser


SYBIL = Sybil(
    parsers=[CodeBlockParser("python", _run_block), _skip_parser()],
    patterns=["README.md", "docs/*.md"],
    excludes=["docs/api.md"],  # generated from the docstrings; tests/test_docs.py checks it
    teardown=_close_interpreter,
)
_collect = SYBIL.pytest()


def xdist_marks_groups_in_node_ids() -> bool:
  """Whether the installed pytest-xdist carries a test's `xdist_group` as a `@group` suffix of
  the node id it reports: up to 3.8 it does (the versions this check knows; a later one may
  pass groups another way, pytest-xdist issue 1386)."""
  import xdist

  major, minor = (int(part) for part in xdist.__version__.split(".")[:2])
  return (major, minor) <= (3, 8)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: the controller, once per worker
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
  """Stops the run where `--dist loadgroup` would not keep a docs page's blocks together."""
  if node.config.getoption("dist", None) != "loadgroup" or not xdist_marks_groups_in_node_ids():
    return
  ungrouped = [nodeid for nodeid in ids if nodeid.partition("::")[0].endswith(".md")
               and "@" not in nodeid]
  if ungrouped:
    pytest.exit(
        f"--dist loadgroup did not group {ungrouped[0]} (pytest {pytest.__version__}): "
        "pytest-xdist marks a group by rewriting the test's node id, which pytest 9.2 no "
        "longer reads (pytest-xdist issue 1386), so a docs page's blocks would run on "
        "different workers and fail. Install the test extra's pytest "
        "(pip install -e '.[test]' gives pytest<9.2), or run with -n 0.",
        returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_collect_file(file_path: pathlib.Path, parent: pytest.Collector):
  page = _collect(file_path, parent)
  if page is not None:
    page.add_marker(pytest.mark.xdist_group(file_path.name))
    # The blocks build on each other: an order shuffle (pytest-random-order) keeps a page's.
    page.add_marker(pytest.mark.random_order(disabled=True))
  return page
