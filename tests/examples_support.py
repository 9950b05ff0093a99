"""What the example tests share: the examples run as `python -m examples.NAME` in a child
process (with the run's compilation cache) or imported in this one, and Orbax steps damaged
on purpose."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys
from typing import Any

import jax
import numpy as np
import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def env(compilation_cache_env: dict[str, str]) -> dict[str, str]:
  """The environment of the runs: a persistent compilation cache the later ones (and other
  processes of the test run) share, so that they skip XLA compiles.

  The scripts run where the tests run: the environment tests/conftest.py set up (CPU, or the
  GPU with deterministic reductions, which the bitwise resume check needs), and with this
  checkout's jaxgraph, whatever else is installed.
  """
  path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  return {**os.environ, "PYTHONPATH": path, **compilation_cache_env}


# XLA:CPU without LLVM's optimizations compiles the tiny presets in about 40% less CPU time
# (the Llama tiny --check run: 24 s instead of 41 s when measured), and rounds otherwise (its
# --check's loss gap over 12 steps: 3e-4 instead of 2e-7). For runs whose test checks what
# they print and write, and for runs compared with each other where every side compiles with
# the same flags (a bitwise resume, --check's graphed step against its whole-step jit): the
# comparison is then between programs of one compiler setting, as at XLA's defaults. Never
# for numbers compared with recorded ones (the golden numbers) or with a run compiled at
# other flags. XLA's default setting stays tested: in this process (tests/test_*.py compare
# the library's executables bitwise at the defaults), by the golden and LoRA runs of the Llama
# example, and on GPUs, where `unoptimized` changes nothing.
UNOPTIMIZED = "--xla_backend_optimization_level=0"


def unoptimized(env: dict[str, str]) -> dict[str, str]:
  """`env` with `UNOPTIMIZED` added to XLA_FLAGS where the runs are on the CPU (JAX_PLATFORMS
  cpu); elsewhere `env` as it is (the GPU's compiles are the point of the GPU run)."""
  if env.get("JAX_PLATFORMS") != "cpu":
    return env
  return {**env, "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} {UNOPTIMIZED}".strip()}


def run_example(module: str, env: dict[str, str], *args: str) -> str:
  """Runs an example, `python -m module`; its stdout and stderr (warnings, the bar)
  together."""
  result = subprocess.run([sys.executable, "-m", module, *args], env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout + result.stderr


def continue_run(out: str, env: dict[str, str]) -> str:
  """Runs the command a run stopped by --stop-after printed to continue it."""
  command = re.search(r"continue with: (.*)", out).group(1)
  python, m, module, *args = shlex.split(command)
  assert [python, m] == ["python", "-m"] and "--resume" in args and "--stop-after" not in args
  return run_example(module, env, *args)


# Runs a script with SIGINT handled as in a terminal (a test runner's child may inherit it
# ignored, which the examples leave ignored).
_SIGINT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def interrupted(module: str, env: dict[str, str], at: str, *args: str) -> str:
  """Runs an example that gets Ctrl-C (SIGINT) at `at`: a point of examples/interrupt.py
  (NAME or NAME@STEP), or "compile" (inside an XLA compile). Checks that it ends with one
  line, status 130, no traceback or crash, and no temporary checkpoint folder left in its
  --out (where it has one); returns that line."""
  result = subprocess.run([sys.executable, "-c", _SIGINT_DEFAULT, "-m", module, *args],
                          env={**env, "EXAMPLES_INTERRUPT_AT": at},
                          capture_output=True, text=True, timeout=600)
  out = result.stdout + result.stderr
  assert result.returncode == 130, out
  assert "Traceback" not in out and "Segmentation" not in out and "Error" not in out, out
  line = result.stderr.strip().splitlines()[-1]
  assert sum("Ctrl-C" in l for l in out.splitlines()) == 1 and "Ctrl-C" in line, out
  if "--out" in args:
    checkpoints = pathlib.Path(args[args.index("--out") + 1]) / "checkpoints"
    assert not [p.name for p in checkpoints.glob("*") if not p.name.isdigit()]
  return line


def data_files(step: pathlib.Path) -> list[pathlib.Path]:
  """The array data files of an Orbax step (tensorstore's `d/` chunks), largest first."""
  return sorted((p for p in (step / "state").rglob("d/*") if p.is_file()),
                key=lambda p: -p.stat().st_size)


def flip_bytes(step: pathlib.Path, count: int = 8) -> None:
  """Flips `count` bytes in the middle of the largest array file of an Orbax step (the
  files stay readable: only a digest can tell)."""
  largest = data_files(step)[0]
  data = bytearray(largest.read_bytes())
  for i in range(count):
    data[len(data) // 2 + i] ^= 0xFF
  largest.write_bytes(bytes(data))


def final_params(out: pathlib.Path, step: int) -> dict[str, np.ndarray]:
  """The params of a run's checkpoint `step`, read by Orbax as NumPy arrays, by path."""
  import orbax.checkpoint as ocp

  path = out / "checkpoints" / str(step) / "state"
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(path).item_metadata.tree
  restored = checkpointer.restore(path, restore_args=jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
  return {jax.tree_util.keystr(k): v
          for k, v in jax.tree_util.tree_flatten_with_path(restored["params"])[0]}


def load_script(monkeypatch: pytest.MonkeyPatch, name: str, path: pathlib.Path) -> Any:
  """The example script `path` run again in this process, as a module named `name`."""
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, name, module)  # it defines dataclasses
  spec.loader.exec_module(module)
  return module


MEMORY_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"


@pytest.fixture
def llama(monkeypatch: pytest.MonkeyPatch) -> Any:
  """The Llama example's package, examples/llama/, imported in this process with its train.py
  (`examples.llama.train`, which imports every module): `llama.cli.parse`,
  `llama.layers.split`, `llama.model.Llama`, ... Imported afresh by each test."""
  # The example sets the variable where it is unset: put back as it was after the test.
  monkeypatch.setenv(MEMORY_FRACTION, os.environ.get(MEMORY_FRACTION, ""))
  monkeypatch.delenv(MEMORY_FRACTION)
  _forget_llama()  # imported before (a benchmark imports it too): run its import again
  importlib.import_module("examples.llama.train")
  yield sys.modules["examples.llama"]
  _forget_llama()


def _forget_llama() -> None:
  for name in [name for name in sys.modules if name.startswith("examples.llama")]:
    sys.modules.pop(name)


@pytest.fixture
def gpt() -> Any:
  """examples/train_gpt.py imported in this process."""
  return importlib.import_module("examples.train_gpt")


@pytest.fixture(params=["gpt", "llama"])
def example(request: pytest.FixtureRequest) -> Any:
  """Each training example's command line (`parse`), imported in this process (train_gpt.py;
  the Llama example's cli.py)."""
  module = request.getfixturevalue(request.param)
  return module.cli if request.param == "llama" else module


def checkpoint_state(value: float) -> tuple[Any, Any, list[tuple[jax.Array, int]]]:
  params = {"w": np.full((64, 64), value, np.float32), "b": np.arange(64, dtype=np.float32)}
  return params, {"count": np.asarray(3, np.int32)}, [(jax.random.key(0), 4)]
