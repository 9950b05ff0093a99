"""Writes docs/api.md from the docstrings of every public name: `python docs/gen_api.py`.

tests/test_docs.py checks that the committed page is what this script writes.
"""

from __future__ import annotations

import inspect
import pathlib
import sys
import types

# The jaxgraph of this checkout, wherever the script is run from.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jaxgraph  # noqa: E402

PAGE = pathlib.Path(__file__).with_name("api.md")
SUBMODULES = ("flat", "fsdp", "offload", "prefetch", "schedule", "flax", "residuals", "rng")


def _signature(obj: object) -> str:
  try:
    return str(inspect.signature(obj)).replace("'", "")  # type: ignore[arg-type]
  except (TypeError, ValueError):
    return ""


def _section(name: str, obj: object, level: str = "##") -> list[str]:
  doc = inspect.getdoc(obj) or "(no docstring)"
  kind = "class" if inspect.isclass(obj) else "function"
  lines = [f"{level} `{name}`", "", f"```python\n{kind} {name}{_signature(obj)}\n```", "", doc, ""]
  if inspect.isclass(obj):
    for attr, member in vars(obj).items():
      if attr.startswith("_") and attr != "__call__":
        continue
      if isinstance(member, property):
        lines += [f"* `{name}.{attr}` (property): " + (inspect.getdoc(member) or "").split("\n")[0]]
      elif callable(member):
        first = (inspect.getdoc(member) or "").split("\n\n")[0].replace("\n", " ")
        lines += [f"* `{name}.{attr}{_signature(member)}`: {first}"]
    lines.append("")
  return lines


def _public(module: types.ModuleType) -> list[str]:
  names = getattr(module, "__all__", None)
  if names is None:
    names = [n for n, v in vars(module).items() if not n.startswith("_")
             and getattr(v, "__module__", None) == module.__name__
             and (inspect.isfunction(v) or inspect.isclass(v))]
  return list(names)


def render() -> str:
  lines = ["# API reference", "",
           "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand.", ""]
  for name in jaxgraph.__all__:
    obj = getattr(jaxgraph, name)
    if isinstance(obj, types.ModuleType):
      continue
    lines += _section(f"jaxgraph.{name}", obj)
  for sub in SUBMODULES:
    try:
      module = __import__(f"jaxgraph.{sub}", fromlist=["_"])
    except ImportError:
      continue
    lines += [f"## Module `jaxgraph.{sub}`", "", (inspect.getdoc(module) or "").split("\n")[0], ""]
    for name in _public(module):
      lines += _section(f"jaxgraph.{sub}.{name}", getattr(module, name), level="###")
  return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
  PAGE.write_text(render())
  print(f"wrote {PAGE}")
