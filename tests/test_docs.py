"""The docs stay true: api.md is generated from the docstrings, links resolve, the README's
example stays short. (The python blocks of README.md and docs/ run as tests: conftest.py.)"""

from __future__ import annotations

import importlib.util
import pathlib
import re

from sybil import Document
from sybil.parsers.markdown import CodeBlockParser

import jaxgraph

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_generator():
  spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


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
