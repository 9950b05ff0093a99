"""The package's house, read from the source: floors, one way up, the public line.

Every `import` counts, also one inside a function (no import moved into a function to dodge a
cycle). Each module imports only modules on floors below its own (`FLOORS`, the table of
docs/design.md, which must say the same); `flax` stands apart and imports no other module.
Internal modules are named with a leading `_`; every public submodule has an `__all__`.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import types

import jaxgraph

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxgraph"

# floor -> its modules; each imports only modules on lower floors.
FLOORS: dict[int, tuple[str, ...]] = {
    0: ("_hooks", "_signature", "flat", "offload", "residuals", "rng"),
    1: ("_constants", "_explicit", "fsdp"),
    2: ("_capture",),
    3: ("_pullback",),
    4: ("_cache",),
    5: ("_graphed",),
    6: ("_fusion",),
    7: ("prefetch", "schedule"),
    8: ("_chain", "_checks"),
    9: ("_api",),
    10: ("__init__",),
}
APART = ("flax",)


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


def _floor_of() -> dict[str, int]:
  return {name: floor for floor, names in FLOORS.items() for name in names}


def test_every_module_has_a_floor():
  placed = [*_floor_of(), *APART]
  assert sorted(placed) == sorted(_graph()), "add the new module to FLOORS and docs/design.md"
  assert len(placed) == len(set(placed))


def test_imports_go_down_only():
  graph, floor_of = _graph(), _floor_of()
  for name, deps in graph.items():
    if name in APART:
      assert not deps, f"{name}.py stands apart but imports {sorted(deps)}"
      continue
    up = sorted(dep for dep in deps if dep in APART or floor_of[dep] >= floor_of[name])
    assert not up, (f"{name}.py (floor {floor_of[name]}) imports {up}, not on a lower floor; "
                    "move the shared code down, or the module up (FLOORS, docs/design.md)")


def test_the_graph_is_read():
  graph = _graph()
  assert {"_cache", "_capture", "_signature"} <= graph["_graphed"]
  assert {"_graphed", "_fusion", "prefetch"} <= graph["_chain"]
  assert graph["_api"] >= {"_checks", "_graphed"}


def test_design_page_shows_the_floors():
  """docs/design.md's floors table lists the same modules on the same floors."""
  text = (ROOT / "docs" / "design.md").read_text()
  rows = re.findall(r"^\| (\d+|apart) \| ([^|]+) \|", text, re.MULTILINE)
  shown = {floor: tuple(sorted(re.findall(r"`([\w]+)`", modules))) for floor, modules in rows}
  expected = {str(floor): tuple(sorted(names)) for floor, names in FLOORS.items()}
  assert shown == {**expected, "apart": APART}


def test_internal_modules_are_marked_and_public_ones_list_their_names():
  public = [name for name in jaxgraph.__all__
            if isinstance(getattr(jaxgraph, name), types.ModuleType)]
  files = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
  assert sorted(public) == sorted(name for name in files if not name.startswith("_")), (
      "a module without a leading _ is public: list it in jaxgraph.__all__")
  for name in public:
    module = importlib.import_module(f"jaxgraph.{name}")
    assert isinstance(getattr(module, "__all__", None), list), f"jaxgraph.{name}: no __all__"
    for item in module.__all__:
      assert hasattr(module, item), f"jaxgraph.{name}.__all__ names {item!r}, not defined"
