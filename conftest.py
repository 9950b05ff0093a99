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
(`--random-order`: the `random_order(disabled=True)` mark).
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


def pytest_collect_file(file_path: pathlib.Path, parent: pytest.Collector):
  page = _collect(file_path, parent)
  if page is not None:
    page.add_marker(pytest.mark.xdist_group(file_path.name))
    # The blocks build on each other: an order shuffle (pytest-random-order) keeps a page's.
    page.add_marker(pytest.mark.random_order(disabled=True))
  return page
