"""The docs and code comments state what is true now, and their links land.

A reader cannot look up this project's working sessions or its issue numbers, so README,
CHANGELOG, docs/, benchmarks/, examples/, jaxgraph/ and tests/ name neither ("session 7",
"issue 37", "issues 33-37", "#37"): a page says what holds, and CHANGELOG.md says what
changed when, by date and commit. Another project's issue stays citable with its project
named ("pytest-xdist issue 1386", "jax#23543", "NVIDIA/TransformerEngine#2831").

And every markdown link to a heading (`performance.md#one-gpu`, also written in a
docstring as `docs/llama.md#numbers`) points at a heading that exists.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCANNED = ["README.md", "CHANGELOG.md", "conftest.py", "pyproject.toml", "docs", "benchmarks",
           "examples", "jaxgraph", "tests"]
SUFFIXES = {".md", ".py", ".toml", ".txt", ".cfg", ".sh"}
SKIPPED_DIRS = {"results", "__pycache__", ".pytest_cache", "runs"}  # docs/results: raw records

# Projects whose issues a page may cite by number ("xdist issue 1386").
EXTERNAL = {"xdist", "pytest-xdist", "pytest", "jax", "jaxlib", "xla", "openxla", "flax",
            "optax", "orbax", "torch", "pytorch", "te", "transformerengine", "megatron",
            "megatron-lm", "cuda", "nccl", "tensorstore", "hypothesis", "sybil", "github"}

SESSION = re.compile(r"\bsessions?\s+#?\d+", re.IGNORECASE)
ISSUE = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)
# A bare `#37`. `jax#23543` (a project right before it) and the profiler's `Stream #20` pass.
BARE_NUMBER = re.compile(r"(?<![\w/#&-])#\d+\b")
WORD_BEFORE = re.compile(r"([\w.+-]+)(?:'s|’s)?\s*$")


def _scanned_files():
  for name in SCANNED:
    path = ROOT / name
    if path.is_file():
      yield path
    elif path.is_dir():
      for file in sorted(path.rglob("*")):
        if (file.is_file() and file.suffix in SUFFIXES
            and not SKIPPED_DIRS & set(file.relative_to(ROOT).parts)
            and file != pathlib.Path(__file__).resolve()):
          yield file


def history_words(line: str) -> list[str]:
  """The session and issue numbers of this project that `line` names."""
  found = [m.group(0) for m in SESSION.finditer(line)]
  issues = list(ISSUE.finditer(line))
  for m in issues:
    before = WORD_BEFORE.search(line[:m.start()])
    if not (before and before.group(1).lower() in EXTERNAL):
      found.append(m.group(0))
  for m in BARE_NUMBER.finditer(line):
    in_issue = any(i.start() <= m.start() < i.end() for i in issues)
    if not in_issue and not re.search(r"\bStream\s*$", line[:m.start()]):
      found.append(m.group(0))
  return found


@pytest.mark.parametrize("line, words", [
    ("on a fresh clone in session 9, where Session 8's tree took", ["session 9", "Session 8"]),
    ("the gap issue 37 saw; issues 33-37; Issue #15", ["issue 37", "issues 33", "Issue #15"]),
    ("fixed in #37 (see #12)", ["#37", "#12"]),
    ("pytest-xdist issue 1386, xdist issue 1386, jax#23543, pytorch#84614", []),
    ("NVIDIA/TransformerEngine#2831; `Stream #20(MemcpyD2H)`; the issue's budget", []),
])
def test_history_words_are_found_and_other_projects_issues_pass(line, words):
  assert history_words(line) == words


def test_no_session_or_issue_numbers_in_docs_and_code():
  hits = []
  for file in _scanned_files():
    for number, line in enumerate(file.read_text(errors="replace").splitlines(), 1):
      for word in history_words(line):
        hits.append(f"{file.relative_to(ROOT)}:{number}: {word!r} in {line.strip()[:100]}")
  assert not hits, ("name what holds now, and put what changed when in CHANGELOG.md "
                    "(by date and commit):\n" + "\n".join(hits))


FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
MD_LINK = re.compile(r"\]\(([^)\s]*?)#([^)\s]+)\)")
PLAIN_LINK = re.compile(r"((?:[\w.-]+/)*[\w.-]+\.md)#([\w-]+)")


def anchors(md: pathlib.Path) -> set[str]:
  """GitHub's heading anchors of a page: lower case, punctuation dropped, spaces to hyphens,
  `-1`, `-2` after repeats; headings inside code fences are not headings."""
  found, seen, fenced = set(), {}, False
  for line in md.read_text().splitlines():
    if FENCE.match(line):
      fenced = not fenced
      continue
    heading = None if fenced else HEADING.match(line)
    if heading:
      slug = re.sub(r"[^\w\- ]", "", heading.group(2).lower()).replace(" ", "-")
      count = seen.get(slug, 0)
      seen[slug] = count + 1
      found.add(slug if count == 0 else f"{slug}-{count}")
  return found


def test_anchors_of_a_heading_follow_github():
  md = ROOT / "docs" / "performance.md"
  assert {"one-gpu", "several-gpus"} <= anchors(md)
  assert "the-suites-time" in anchors(ROOT / "docs" / "reliability.md")


def test_links_to_headings_land():
  pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md",
           *sorted((ROOT / "docs").glob("*.md"))]
  bad = []
  for file in _scanned_files():
    text = file.read_text(errors="replace")
    if file.suffix == ".md":
      links = [(file.parent / target if target else file, anchor)
               for target, anchor in MD_LINK.findall(text)
               if not target.startswith(("http://", "https://"))]
    else:  # a docstring or comment names a page from the repository root
      links = [(ROOT / target, anchor) for target, anchor in PLAIN_LINK.findall(text)]
    for target, anchor in links:
      target = target.resolve()
      if not target.exists():
        bad.append(f"{file.relative_to(ROOT)}: {target} does not exist")
      elif anchor not in anchors(target):
        bad.append(f"{file.relative_to(ROOT)}: no heading #{anchor} in "
                   f"{target.relative_to(ROOT)}")
  assert pages and not bad, "\n".join(bad)
