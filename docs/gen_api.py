"""Writes docs/api.md from the docstrings of every public name: `python docs/gen_api.py`.

The public names are `jaxgraph.__all__`, and, for each public submodule in it, that module's
`__all__`; a `GraphedCallable`'s members that only the package uses (`_pullback.Owner`) are
left out. tests/test_docs.py checks that the committed page is what this script writes.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import sys
import types

# The jaxgraph of this checkout, wherever the script is run from.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jaxgraph  # noqa: E402
from jaxgraph import _pullback  # noqa: E402

PAGE = pathlib.Path(__file__).with_name("api.md")
# Members of the package's interface to a GraphedCallable: plain names, not public API.
INTERNAL_MEMBERS = frozenset(
    name for name in (*vars(_pullback.Owner), *_pullback.Owner.__annotations__)
    if not name.startswith("_"))


def _signature(obj: object) -> str:
  try:
    return str(inspect.signature(obj)).replace("'", "")  # type: ignore[arg-type]
  except (TypeError, ValueError):
    return ""


def _section(name: str, obj: object, level: str = "##") -> list[str]:
  if _is_constant(obj):  # its value is its doc
    return [f"{level} `{name}`", "", f"```python\n{name} = {_value(obj)}\n```", ""]
  doc = inspect.getdoc(obj) or "(no docstring)"
  kind = "class" if inspect.isclass(obj) else "function"
  lines = [f"{level} `{name}`", "", f"```python\n{kind} {name}{_signature(obj)}\n```", "", doc, ""]
  if inspect.isclass(obj):
    for attr, member in vars(obj).items():
      if (attr.startswith("_") and attr != "__call__") or attr in INTERNAL_MEMBERS:
        continue
      if isinstance(member, property):
        lines += [f"* `{name}.{attr}` (property): " + (inspect.getdoc(member) or "").split("\n")[0]]
      elif callable(member):
        first = (inspect.getdoc(member) or "").split("\n\n")[0].replace("\n", " ")
        lines += [f"* `{name}.{attr}{_signature(member)}`: {first}"]
    lines.append("")
  return lines


def _value(obj: object) -> str:
  """A constant as it reads in the source (a set sorted, so the page is stable)."""
  if isinstance(obj, frozenset):
    return "frozenset({" + ", ".join(repr(item) for item in sorted(obj)) + "})"
  return repr(obj)


def _is_constant(obj: object) -> bool:
  return not (inspect.isclass(obj) or inspect.ismodule(obj) or callable(obj))


def _first_sentence(obj: object) -> str:
  if _is_constant(obj):
    value = _value(obj)
    return f"`{value}`" if len(value) < 60 else "a constant"
  doc = (inspect.getdoc(obj) or "").split("\n\n")[0].replace("\n", " ")
  end = doc.find(". ")
  return (doc if end < 0 else doc[:end + 1]).replace("|", "\\|")


def _anchor(title: str, seen: dict[str, int]) -> str:
  """GitHub's anchor of the next heading `title` (backticks and dots dropped; a repeated
  anchor gets -1, -2, ...: `offload.Plan` and `offload.plan`)."""
  anchor = "".join(c for c in title.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")
  seen[anchor] = seen.get(anchor, -1) + 1
  return anchor if not seen[anchor] else f"{anchor}-{seen[anchor]}"


def _public_modules() -> list[tuple[str, types.ModuleType]]:
  """The public submodules: the modules in `jaxgraph.__all__` (`flax` imported here)."""
  return [(name, importlib.import_module(f"jaxgraph.{name}")) for name in jaxgraph.__all__
          if isinstance(getattr(jaxgraph, name), types.ModuleType)]


def _summary(modules: list[tuple[str, types.ModuleType]]) -> list[str]:
  """One table row per public name: where it is documented below, and its first sentence."""
  rows = ["| name | what it is |", "| --- | --- |"]
  seen: dict[str, int] = {}  # in the order of the sections below
  for name in jaxgraph.__all__:
    obj = getattr(jaxgraph, name)
    if not isinstance(obj, types.ModuleType):
      title = f"jaxgraph.{name}"
      rows.append(f"| [`{title}`](#{_anchor(title, seen)}) | {_first_sentence(obj)} |")
  for sub, module in modules:
    title = f"Module jaxgraph.{sub}"
    rows.append(f"| [`jaxgraph.{sub}`](#{_anchor(title, seen)}) | {_first_sentence(module)} |")
    for name in module.__all__:
      title = f"jaxgraph.{sub}.{name}"
      rows.append(f"| &nbsp;&nbsp;[`{title}`](#{_anchor(title, seen)}) | "
                  f"{_first_sentence(getattr(module, name))} |")
  return rows + [""]


def render() -> str:
  modules = _public_modules()
  lines = ["# API reference", "",
           "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand. "
           "Everything public is listed here; modules whose names start with `_` are internal "
           "and change without notice.", ""]
  lines += _summary(modules)
  for name in jaxgraph.__all__:
    obj = getattr(jaxgraph, name)
    if not isinstance(obj, types.ModuleType):
      lines += _section(f"jaxgraph.{name}", obj)
  for sub, module in modules:
    lines += [f"## Module `jaxgraph.{sub}`", "", (inspect.getdoc(module) or "").split("\n")[0], ""]
    for name in module.__all__:
      lines += _section(f"jaxgraph.{sub}.{name}", getattr(module, name), level="###")
  return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
  PAGE.write_text(render())
  print(f"wrote {PAGE}")
