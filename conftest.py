"""The docs run: every python block of README.md and docs/*.md (api.md aside) is a test (Sybil).

Blocks run in page order in one namespace per page, so a block may use what the blocks above
it on its page defined. pyproject.toml's testpaths put README.md and docs/ next to tests/, so
`python -m pytest` runs them with the suite, on the platform tests/conftest.py sets up (8
virtual CPU devices on CPU). `python -m pytest -k quickstart.md` runs one page so; a page
named alone (`python -m pytest docs/quickstart.md`) runs without tests/conftest.py, on JAX's
defaults. Markdown comments steer a block:

* `<!-- skip: next "reason" -->` skips the next block (or `skip: next if(cond, reason="...")`,
  evaluated in the page's namespace);
* `<!-- invisible-code-block: python ... -->` runs code the rendered page does not show: the
  setup a fragment assumes, or the checks on what a block did. `printed` holds what the
  block before it printed.

A page's blocks share one namespace, so one xdist worker runs all of them (`xdist_group`
per page; pyproject.toml's `--dist loadgroup`), in page order also when the suite is shuffled
(`--random-order`: the `random_order(disabled=True)` mark). Where xdist's grouping does not
take (pytest-xdist 3.8 under pytest 9.2), the run stops at collection with the fix rather than
failing the pages' blocks one by one.
"""

from __future__ import annotations

import pathlib

import pytest
from sybil import Sybil
from sybil.evaluators.python import PythonEvaluator
from sybil.example import Example
from sybil.parsers.markdown import CodeBlockParser, SkipParser


def _run_block(example: Example) -> None:
  """Sybil's Python evaluator, keeping what the block printed as `printed` for the checks
  that follow it (`capsys` is the block's own: Sybil requests it for each one)."""
  capsys = example.namespace["capsys"]
  try:
    PythonEvaluator()(example)
  finally:
    example.namespace["printed"] = capsys.readouterr().out


_collect = Sybil(
    parsers=[CodeBlockParser("python", _run_block), SkipParser()],
    patterns=["README.md", "docs/*.md"],
    excludes=["docs/api.md"],  # generated from the docstrings; tests/test_docs.py checks it
    fixtures=["capsys", "tmp_path_factory"],
).pytest()


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
