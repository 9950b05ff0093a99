"""What the benchmark scripts share: device memory readings and one-process-per-measurement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import jax


def device_memory() -> dict[str, int] | None:
  """`bytes_in_use` and `peak_bytes_in_use`, the largest over the local devices; None on
  backends without memory stats (CPU)."""
  stats = [d.memory_stats() for d in jax.local_devices()]
  if not all(stats):
    return None
  return {k: max(int(s[k]) for s in stats) for k in ("bytes_in_use", "peak_bytes_in_use")}


def run_child(script: str, args: list[str], timeout: float) -> dict[str, Any]:
  """Runs `script` with `args` in a fresh process (fresh peak memory); returns the last JSON
  line it printed, or the error."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  out = subprocess.run([sys.executable, os.path.abspath(script), *args], capture_output=True,
                       text=True, env=env, timeout=timeout)
  lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
  if out.returncode != 0 or not lines:
    return dict(args=args, error=out.stderr[-4000:], returncode=out.returncode)
  return json.loads(lines[-1])
