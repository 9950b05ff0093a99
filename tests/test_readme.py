"""The README's usage example runs as written and does what its comments say."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_example_runs(capsys):
  code = re.search(r"## Usage\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
  assert len(code.strip().splitlines()) <= 20
  namespace: dict = {}
  exec(compile(code, str(README), "exec"), namespace)
  layers = namespace["layers"]
  assert sum(layer.stats.captures for layer in layers) == 1
  assert [layer.stats.replays for layer in layers] == [1] * 4
  assert "layer 3 replay" in capsys.readouterr().out
