"""What a run records beside its checkpoints: JSON written atomically (metrics.json, a
benchmark's results), a finished run's metrics.json restored from its last checkpoint, and
one digest of a tree's arrays.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Any

import jax
import numpy as np


def write_json(path: pathlib.Path, value: Any, **options: Any) -> None:
  """Writes `value` as JSON to `path` (its folder created where missing) atomically: a
  temporary file renamed over it, so a kill or a full disk leaves the old file or the new
  one, never a partial one. `options`: `json.dump`'s (`indent=1`)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  temporary = path.with_name(f".{path.name}.tmp")
  try:
    with open(temporary, "w") as f:
      json.dump(value, f, **options)
      f.flush()
      os.fsync(f.fileno())
    os.replace(temporary, path)
  except BaseException:
    temporary.unlink(missing_ok=True)
    raise


def restore_metrics(path: pathlib.Path, meta: dict[str, Any]) -> str | None:
  """A finished run's metrics.json, when missing or damaged (unreadable, or a history other
  than its last checkpoint's), written again from that checkpoint's `meta` (its step and
  loss history: what a checkpoint holds of it); what was done, or None if it was whole."""
  history = {key: meta[key] for key in ("losses", "eval_losses") if key in meta}
  missing = not path.exists()
  try:
    found = json.loads(path.read_text())
    whole = all(found.get(key) == value for key, value in history.items())
  except (OSError, ValueError, AttributeError):  # missing, truncated, not an object
    found, whole = None, False
  if whole:
    return None
  write_json(path, {"step": meta["step"], **history}, indent=1)
  return (f"{path} was {'missing' if missing else 'damaged'}: "
          f"written again from step {meta['step']}'s checkpoint (its step and "
          f"{' and '.join(history) or 'nothing else'}; the run's other records, such as "
          "tokens/s, are not in checkpoints)")


def arrays_sha256(tree: Any) -> str:
  """The sha256 of a tree's arrays: every leaf's bytes, in `jax.tree.leaves` order (equal
  digests: bitwise equal values, as far as sha256 tells)."""
  found = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    found.update(np.asarray(leaf).tobytes())
  return found.hexdigest()
