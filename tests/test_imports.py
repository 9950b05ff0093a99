"""The package's import graph, read from the source: one way, as DESIGN.md's module table.

Every `import` counts, also one inside a function (no import moved into a function to dodge a
cycle). Order: explicit -> capture -> pullback -> graphed -> fusion -> prefetch -> chain (each
imports only modules before it);
api builds on graphed and nothing but `__init__` imports it; hooks, rng, signature,
residuals and flat import no other jaxgraph module.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jaxgraph"
LAYERS = ("explicit", "capture", "pullback", "graphed", "fusion", "prefetch", "chain")
LEAVES = ("hooks", "rng", "signature", "residuals", "flat")


def _imported(path: pathlib.Path) -> set[str]:
  """The jaxgraph modules `path` imports (`from jaxgraph import x`, `import jaxgraph.x`,
  `from jaxgraph.x import y`), anywhere in the file."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      if node.module == "jaxgraph":
        found.update(alias.name for alias in node.names)
      elif node.module.startswith("jaxgraph."):
        found.add(node.module.split(".")[1])
    elif isinstance(node, ast.ImportFrom) and node.level > 0:
      found.update([node.module.split(".")[0]] if node.module
                   else [alias.name for alias in node.names])
    elif isinstance(node, ast.Import):
      found.update(alias.name.split(".")[1] for alias in node.names
                   if alias.name.startswith("jaxgraph."))
  return found


def _graph() -> dict[str, set[str]]:
  modules = {path.stem: path for path in PACKAGE.glob("*.py")}
  return {name: _imported(path) & set(modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle of `graph` as a path, or None (depth-first search)."""
  state: dict[str, str] = {}
  path: list[str] = []

  def visit(name: str) -> list[str] | None:
    state[name] = "open"
    path.append(name)
    for dep in sorted(graph[name]):
      if state.get(dep) == "open":
        return path[path.index(dep):] + [dep]
      if dep not in state and (found := visit(dep)) is not None:
        return found
    state[name] = "done"
    path.pop()
    return None

  for name in sorted(graph):
    if name not in state and (found := visit(name)) is not None:
      return found
  return None


def test_the_graph_is_read():
  graph = _graph()
  assert set(LAYERS) | set(LEAVES) | {"api", "__init__"} <= set(graph)
  assert {"capture", "flat", "signature"} <= graph["graphed"]
  assert {"graphed", "fusion", "prefetch"} <= graph["chain"]
  assert {"explicit", "graphed"} <= graph["prefetch"]


def test_no_import_cycle():
  cycle = _cycle(_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imports_follow_the_module_order():
  graph = _graph()
  for position, name in enumerate(LAYERS):
    later = graph[name] & set(LAYERS[position + 1:])
    assert not later, f"{name}.py imports {sorted(later)}, which come after it ({LAYERS})"
  assert "graphed" in graph["api"] and not graph["api"] & {"fusion", "prefetch", "chain"}
  importers = sorted(name for name, deps in graph.items() if "api" in deps)
  assert importers == ["__init__"], f"only __init__ imports api.py, not {importers}"


def test_leaves_import_no_other_module():
  graph = _graph()
  for name in LEAVES:
    assert not graph[name], f"{name}.py is a leaf but imports {sorted(graph[name])}"
