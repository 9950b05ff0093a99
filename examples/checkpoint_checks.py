"""What the examples' checkpoints (examples/checkpoints.py) check, and the noise of a failed
Orbax read or write they keep quiet: the digests of the arrays and of the metadata, the
saved arrays' shapes against a run's, the reason of a failure in one line, and Orbax's
stray tracebacks and log records after it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import sys
import traceback
from typing import Any, Iterator

import jax
import numpy as np


def _digest(array: Any) -> str:
  """sha256 of an array's bytes, hashed in place (a byte view, no copy)."""
  return hashlib.sha256(np.ascontiguousarray(array).reshape(-1).view(np.uint8)).hexdigest()


def tree_digests(tree: Any) -> dict[str, str]:
  """sha256 of every leaf of `tree`, by its path. Hashed on host threads (hashlib releases
  the GIL), about 1.5 GB/s per core."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  with concurrent.futures.ThreadPoolExecutor() as pool:
    digests = pool.map(_digest, [leaf for _, leaf in leaves])
    return {jax.tree_util.keystr(path): d for (path, _), d in zip(leaves, digests)}


def reason(error: BaseException) -> str:
  """The first line of the innermost cause of `error`, with its type: Orbax wraps
  tensorstore's errors (the reason) in its own, whose text holds a `<bound method ...>`."""
  while error.__cause__ is not None:
    error = error.__cause__
  first = (str(error).strip().splitlines() or [""])[0]
  return f"{type(error).__name__}: {first}"


# The key of a step's metadata that holds the sha256 of the rest of it (`meta_digest`).
META_DIGEST = "meta_sha256"


def meta_digest(meta: dict[str, Any]) -> str:
  """sha256 of a step's metadata without its own digest, as JSON with sorted keys: what it
  reads back as (tuples become lists; floats round-trip exactly through JSON)."""
  rest = {key: value for key, value in meta.items() if key != META_DIGEST}
  return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def _shapes(tree: Any) -> dict[tuple[str, ...], tuple[tuple[int, ...], str]]:
  """(shape, dtype) of every array of `tree` by its path, each key by its name: Orbax's
  metadata holds a named tuple's fields and a Variable's value as dict entries."""
  def name(key: Any) -> str:
    for attribute in ("key", "name", "idx"):
      if hasattr(key, attribute):
        return str(getattr(key, attribute))
    return str(key)

  found = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      found[tuple(name(key) for key in path)] = (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
  return found


def _show_path(path: tuple[str, ...]) -> str:
  return "".join(f"[{part}]" if part.isdigit() else f"['{part}']" for part in path)


def _show_shape(found: tuple[tuple[int, ...], str]) -> str:
  shape, dtype = found
  return f"{dtype}{list(shape)}"


def other_shapes(saved: Any, target: Any) -> str | None:
  """What differs between the arrays of a saved tree (Orbax's metadata of a step's state)
  and `target`'s, where both hold the same arrays (by path) of other shapes or dtypes: a
  model of another shape (width, hidden, heads) than the one that saved them. None where
  they agree, or where the paths differ (a read of the step then says what is wrong)."""
  saved, ours = _shapes(saved), _shapes(target)
  if saved.keys() != ours.keys():
    return None
  differ = [path for path in sorted(ours, key=lambda path: (path[0] != "params", path))
            if saved[path] != ours[path]]
  if not differ:
    return None
  shown = "; ".join(f"{_show_path(path)} is {_show_shape(saved[path])} there, "
                    f"{_show_shape(ours[path])} here" for path in differ[:2])
  more = f" (and {len(differ) - 2} more)" if len(differ) > 2 else ""
  return (f"holds arrays of other shapes than this run's model: {shown}{more}; it was saved "
          "by a model of another shape (width, hidden, heads or vocabulary)")


def quiet_closed_loops() -> None:
  """After an Orbax read or write failed part-way: its other tensorstore reads and writes
  finish later and call back into the event loop Orbax ran them in, closed by then, and
  each prints a "RuntimeError: Event loop is closed" traceback (through
  `sys.unraisablehook`), as do its coroutines never awaited when the interpreter exits,
  and asyncio logs the futures of its failed writes ("Future exception was never
  retrieved") when they are collected. Drops those (the failure's own message names the
  reason); any other unraisable exception or log record goes on as before."""
  previous = sys.unraisablehook
  if getattr(previous, "quiets_closed_loops", False):
    return

  def hook(unraisable: Any) -> None:
    value = unraisable.exc_value
    if (isinstance(value, RuntimeError) and str(value) == "Event loop is closed") or (
        isinstance(value, ImportError) and "Python is likely shutting down" in str(value)) or (
        _from_orbax(getattr(getattr(unraisable.object, "cr_code", None), "co_filename", ""))):
      return
    previous(unraisable)

  hook.quiets_closed_loops = True
  sys.unraisablehook = hook
  logging.getLogger("asyncio").addFilter(_orbax_future_records)


def quiet_late_orbax_errors() -> None:
  """Once a save has failed and been reported: drops the errors Orbax's writer threads log
  after it (absl, with tracebacks; the failure's own message names the reason). Only then:
  before, `orbax_errors_held` lets out those of a save that did not fail."""
  logging.getLogger("absl").addFilter(_orbax_late_errors)  # added once however often called


def _from_orbax(filename: str) -> bool:
  return f"{os.sep}orbax{os.sep}" in filename


def _orbax_late_errors(record: logging.LogRecord) -> bool:
  """False (dropped) for an error Orbax's code logs (a writer thread failing after the save
  it served has failed and been reported)."""
  return record.levelno < logging.ERROR or not _from_orbax(record.pathname)


# the suffix of the folder Orbax writes a step into before renaming it (its
# `atomicity_types.TMP_DIR_SUFFIX`): named in each error of a write into it
ORBAX_TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _orbax_future_records(record: logging.LogRecord) -> bool:
  """False (dropped) for asyncio's record of a never-retrieved exception of Orbax's writes
  (reported by the save that failed): raised in Orbax's code, or by tensorstore (no Orbax
  frame in its traceback) about a file in Orbax's temporary step folder."""
  first = str(record.msg).split("\n", 1)[0]  # "Task exception was never retrieved", ...
  if not first.endswith("exception was never retrieved") or not record.exc_info:
    return True
  error = record.exc_info[1]
  while error is not None:
    if ORBAX_TMP_SUFFIX in str(error):
      return False
    for frame, _ in traceback.walk_tb(error.__traceback__):
      if _from_orbax(frame.f_code.co_filename):
        return False
    error = error.__cause__ or error.__context__
  return True


@contextlib.contextmanager
def orbax_errors_held() -> Iterator[None]:
  """Holds Orbax's error log records (absl, with tracebacks: logged by its writer threads
  before the failure reaches the caller) while inside; they go out only if no exception
  does, which names the reason itself."""
  logger, held = logging.getLogger("absl"), []

  def hold(record: logging.LogRecord) -> bool:
    if record.levelno >= logging.ERROR:
      held.append(record)
      return False
    return True

  logger.addFilter(hold)
  try:
    yield
  except BaseException:
    held.clear()
    raise
  finally:
    logger.removeFilter(hold)
    for record in held:
      logger.handle(record)
