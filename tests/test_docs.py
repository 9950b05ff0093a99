"""The docs stay true: api.md is generated from the docstrings, links resolve, the README's
example stays short. (The python blocks of README.md and docs/ run as tests: conftest.py.)"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import types

import pytest
from sybil import Document
from sybil.parsers.markdown import CodeBlockParser

import jaxgraph

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_generator():
  spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _load_root_conftest():
  spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_docs_run_stops_where_xdist_would_not_keep_a_page_together(monkeypatch):
  """pytest-xdist 3.8 under pytest 9.2 drops the `@group` of the node ids it reports: the run
  stops at collection with the fix instead of failing a page's blocks on two workers."""
  root_conftest = _load_root_conftest()
  check = root_conftest.pytest_xdist_node_collection_finished
  # The check knows xdist <= 3.8's node ids (`@group`), whatever xdist is installed here.
  monkeypatch.setattr(root_conftest, "xdist_marks_groups_in_node_ids", lambda: True)
  node = lambda dist: types.SimpleNamespace(
      config=types.SimpleNamespace(getoption=lambda name, default=None: dist))
  grouped = ["README.md::line:67,column:1@README.md", "tests/test_api.py::test_vjp"]
  check(node("loadgroup"), grouped)
  check(node("load"), ["README.md::line:67,column:1"])  # no grouping asked for
  with pytest.raises(pytest.exit.Exception, match=r"pytest<9\.2.*or run with -n 0"):
    check(node("loadgroup"), ["tests/test_api.py::test_vjp", "docs/fsdp.md::line:9,column:1"])
  # An xdist past 3.8 may pass groups without the suffix: no check, no false alarm.
  monkeypatch.setattr(root_conftest, "xdist_marks_groups_in_node_ids", lambda: False)
  check(node("loadgroup"), ["docs/fsdp.md::line:9,column:1"])


def test_api_page_is_generated_from_the_docstrings():
  page = (ROOT / "docs" / "api.md").read_text()
  assert page == _load_generator().render(), "run: python docs/gen_api.py"
  for name in jaxgraph.__all__:
    assert f"jaxgraph.{name}" in page


def test_markdown_links_resolve():
  for md in [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
             *sorted((ROOT / "docs").glob("*.md"))]:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", md.read_text()):
      if target.startswith(("http://", "https://")):
        continue
      assert (md.parent / target).exists(), f"{md.name} links to missing {target}"


def test_readme_usage_example_is_short():
  """The README's usage block (conftest.py runs it, with the docs) fits on one screen."""
  document = Document.parse(str(ROOT / "README.md"), CodeBlockParser("python"))
  usage = next(document.examples()).parsed
  assert len(usage.strip().splitlines()) <= 20
