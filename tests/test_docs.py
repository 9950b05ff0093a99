"""The docs stay true: api.md is generated from the docstrings, links resolve, the README's
example stays short, and a page's python blocks run as its reader runs them. (The python
blocks of README.md and docs/ run as tests: conftest.py.)"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import textwrap
import types

import pytest
from sybil import Document
from sybil.example import SybilFailure
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


def _run_page(text: str, directory: pathlib.Path, root_conftest=None) -> list[BaseException | None]:
  """Runs a markdown page's blocks as the docs run does; per block, what it raised."""
  root_conftest = root_conftest or _load_root_conftest()
  page = directory / "page.md"
  page.write_text(textwrap.dedent(text))
  document = root_conftest.SYBIL.parse(page)
  outcomes: list[BaseException | None] = []
  try:
    for example in document.examples():
      try:
        example.evaluate()
        outcomes.append(None)
      except BaseException as e:  # noqa: BLE001 - SybilFailure, or pytest's skip
        outcomes.append(e)
  finally:
    root_conftest.SYBIL.teardown(document.namespace)
  return outcomes


def test_a_page_runs_in_a_fresh_interpreter_and_hidden_blocks_only_check(tmp_path):
  """Visible blocks run in one new `python` per page, in the repository's root; a hidden
  block sees what the block above made (and `printed`) but defines nothing a later block can
  read."""
  outcomes = _run_page(f"""
      ```python
      import os, sys
      print("made", 1)
      shown = 1
      ```

      <!-- invisible-code-block: python
      assert printed == "made 1\\n" and shown == 1
      assert os.getpid() != {os.getpid()} and os.getcwd() == {str(ROOT)!r}
      assert "jax" not in sys.modules and "models" not in sys.modules   # nothing of the suite's
      import json
      secret = shown + 1
      -->

      ```python
      # continues the block above
      print(shown)
      ```

      ```python
      # continues the block above
      json
      ```

      ```python
      # continues the block above: the hidden block's names reach no block
      secret
      ```
      """, tmp_path)
  assert outcomes[:3] == [None, None, None], outcomes
  for outcome, name in zip(outcomes[3:], ["json", "secret"]):
    assert isinstance(outcome, SybilFailure)
    assert f"NameError: name '{name}' is not defined" in str(outcome)
    assert "page.md\", line" in str(outcome)   # the traceback names the page's line


def test_a_block_runs_as_if_copied_alone_and_prints(tmp_path):
  """A visible block gets a fresh namespace unless its first line says it continues the block
  above (a chain of them shares one), and fails if it prints nothing."""
  outcomes = _run_page("""
      ```python
      a = 1
      print(a)
      ```

      ```python
      # continues the block above
      b = a + 1
      print(b)
      ```

      ```python
      # continues the block above (and so the one before it)
      print(a + b)
      ```

      <!-- invisible-code-block: python
      assert printed == "3\\n", printed
      -->

      ```python
      print(a)               # copied alone: no `a`
      ```

      ```python
      import math            # runs, and says nothing
      ```
      """, tmp_path)
  assert outcomes[:4] == [None] * 4, outcomes
  alone, silent = outcomes[4:]
  assert isinstance(alone, SybilFailure) and "NameError: name 'a' is not defined" in str(alone)
  assert "start it with `# continues the block above`" in str(alone)
  assert isinstance(silent, SybilFailure) and "the block printed nothing" in str(silent)


def test_skip_conditions_read_the_page_names(tmp_path):
  outcomes = _run_page("""
      ```python
      devices = 1
      print(devices)
      ```

      <!-- skip: next if(devices < 2, reason="needs 2 devices") -->

      ```python
      raise AssertionError("skipped")
      ```

      <!-- skip: next if(devices > 2) -->

      ```python
      print("ran")
      ```

      <!-- skip: next if(undefined_name) -->
      """, tmp_path)
  assert outcomes[0] is None
  assert isinstance(outcomes[2], pytest.skip.Exception) and "needs 2 devices" in str(outcomes[2])
  assert outcomes[3:5] == [None, None]
  assert "NameError: name 'undefined_name'" in str(outcomes[5])


def test_a_page_interpreter_that_dies_or_hangs_fails_its_block(tmp_path):
  root_conftest = _load_root_conftest()
  died, = _run_page("""
      ```python
      import os
      os._exit(3)
      ```
      """, tmp_path, root_conftest)
  assert isinstance(died, RuntimeError) and "exited with 3" in str(died)
  root_conftest.BLOCK_SECONDS = 1   # the block sleeps for 60
  hung, = _run_page("""
      ```python
      import time
      time.sleep(60)
      ```
      """, tmp_path, root_conftest)
  assert isinstance(hung, RuntimeError) and "no answer in 1 s (stopped)" in str(hung)


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


def test_readme_set_up_comes_first_and_names_files_that_exist():
  """The README's first command block sets up and runs: the main example, the whole suite,
  and a quick check (one test file), before any measurement; what they name exists."""
  text = (ROOT / "README.md").read_text()
  first = re.search(r"```bash\n(.*?)```", text, re.S)
  commands = [line.partition("  #")[0].split("&&")[-1].strip()
              for line in first.group(1).splitlines()]
  assert "python -m pytest" in commands  # the whole suite, as CI runs it
  quick = [c for c in commands if c.startswith("python -m pytest tests/")]
  example = [c for c in commands if c.startswith("python -m examples.")]
  assert quick and example, commands
  for command in quick:
    assert (ROOT / command.split()[-1]).is_file(), command
  for command in example:  # a module of the repository's root
    assert (ROOT / (command.split()[-1].replace(".", "/") + ".py")).is_file(), command
  assert first.start() < text.index("## The examples, measured") < text.index("1.194×")


def test_readme_usage_example_is_short():
  """The README's usage block (conftest.py runs it, with the docs) fits on one screen."""
  document = Document.parse(str(ROOT / "README.md"), CodeBlockParser("python"))
  usage = next(document.examples()).parsed
  assert len(usage.strip().splitlines()) <= 20
