"""The Llama example's tiny preset as a run recorded earlier computed it: the golden numbers
tests/test_examples_training.py compares every later version of the example with.

tests/data/llama/golden.json holds, per machine key (`key`: the platform and device, jax and
jaxlib, the CPU's vector extensions, the precision settings), the losses, held-out losses,
params digest and generated text of `python -m examples.llama.train --preset tiny`; and
tests/data/llama/checkpoints/10 is the step-10 checkpoint of the same run (Orbax, 0.3 MB),
which a later version must resume. How they were made, and how to record this machine's
entry: the file's "made" and "record" lines.

  python tests/llama_golden.py RUN_DIR   # adds (or replaces) this machine's entry from the
                                         # metrics.json of a run in RUN_DIR
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import sys
from typing import Any

import jax
import jaxlib

DATA = pathlib.Path(__file__).resolve().parent / "data" / "llama"
GOLDEN = DATA / "golden.json"
CHECKPOINT = DATA / "checkpoints"
RECORDED = ("losses", "eval_losses", "params_sha256", "continuation")


def _vector_extensions() -> str:
  """The widest x86 vector extension this CPU has (XLA:CPU compiles for the host's, which can
  change how a reduction is split), or the machine's name elsewhere."""
  try:
    flags = pathlib.Path("/proc/cpuinfo").read_text().split()
  except OSError:
    return platform.machine()
  return next((f for f in ("avx512f", "avx2", "avx") if f in flags), platform.machine())


def key() -> dict[str, Any]:
  """What the numbers depend on, besides the code: the backend and its device, jax and jaxlib,
  the CPU's vector extensions (on the CPU backend), and the precision settings (XLA flags about
  precision or determinism, jax's default matmul precision)."""
  backend = jax.default_backend()
  flags = sorted(f for f in os.environ.get("XLA_FLAGS", "").split()
                 if "precision" in f or "deterministic" in f)
  return {"platform": backend, "device": jax.devices()[0].device_kind,
          "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "cpu": _vector_extensions() if backend == "cpu" else None,
          "xla_flags": flags,
          "matmul_precision": str(jax.config.jax_default_matmul_precision)}


def expected() -> dict[str, Any] | str:
  """This machine's golden numbers, or why there are none (to skip with)."""
  golden = json.loads(GOLDEN.read_text())
  ours = key()
  for entry in golden["runs"]:
    if entry["key"] == ours:
      return entry
  return (f"no golden run of the Llama tiny preset recorded for this machine ({ours}; "
          f"recorded: {[entry['key'] for entry in golden['runs']]}). To add one: "
          + " ".join(line.strip() for line in golden["record"]))


def record(run: pathlib.Path) -> dict[str, Any]:
  """Adds this machine's entry to the golden file from `run`'s metrics.json (replacing one
  of the same key); returns it."""
  metrics = json.loads((run / "metrics.json").read_text())
  entry = {"key": key(), **{name: metrics[name] for name in RECORDED[:-1]},
           "continuation": metrics["generation"]["continuation"]}
  golden = json.loads(GOLDEN.read_text())
  golden["runs"] = [e for e in golden["runs"] if e["key"] != entry["key"]] + [entry]
  GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
  return entry


if __name__ == "__main__":
  print(record(pathlib.Path(sys.argv[1])))
