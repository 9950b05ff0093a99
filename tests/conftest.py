"""Test setup: the platform, 8 virtual CPU devices, the `gpu` / `devices` markers, and the
fixtures that force a platform gate either way (`platform_gate`, `packing`).

One command runs the suite on any machine: `python -m pytest`. Before jax is imported
(after that its platform and XLA_FLAGS are fixed) this file decides where the tests run:

* A CUDA GPU is usable (a jax CUDA plugin is installed and an NVIDIA device is present):
  the tests run on the GPU (JAX's default backend), with deterministic GPU reductions, which
  the bitwise comparisons need. `gpu` tests run; `cpu_only` tests (their JAX work runs on
  the CPU on any machine) are deselected, the CPU run covers them (`-m cpu_only` runs them).
* Otherwise JAX_PLATFORMS=cpu, as CI runs; `gpu` tests are skipped, saying why.

A JAX_PLATFORMS or an XLA flag the user set is kept (`JAX_PLATFORMS=cpu` runs the CPU suite
on a GPU machine; `XLA_FLAGS=--xla_force_host_platform_device_count=1` gives one CPU device).
The CPU backend gets 8 virtual devices either way: `@pytest.mark.devices(n)` tests run on the
default backend when it has `n` devices, else on the CPU backend's (they test plumbing, not
GPU kernels), else they are skipped with a reason naming the count (`models.devices_for`).

On CPU the run shares one persistent XLA compilation cache (`_compilation_cache`), also with
the scripts the tests start (`compilation_cache_env`), and pyproject.toml runs it on two
xdist workers (`-n 2`).
"""

import atexit
import glob
import importlib.util
import os
import shutil
import tempfile
from typing import Any


def _cuda_usable() -> bool:
  """Whether a CUDA GPU looks usable, judged without importing jax: a jax CUDA plugin is
  installed and the machine has an NVIDIA device. jax itself decides in the end (it falls
  back to CPU if the GPU fails to start); the markers read `jax.devices()`."""
  def installed(name: str) -> bool:
    try:
      return importlib.util.find_spec(name) is not None
    except ImportError:  # no jax_plugins namespace at all
      return False

  plugin = any(installed(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
  return plugin and bool(glob.glob("/dev/nvidia[0-9]*") or shutil.which("nvidia-smi"))


CUDA = _cuda_usable()
_flags = ["--xla_force_host_platform_device_count=8"]
if CUDA:
  # Bitwise comparisons between two executables need deterministic GPU reductions.
  _flags.append("--xla_gpu_deterministic_ops=true")
  # JAX_PLATFORMS stays unset: jax starts the GPU and, next to it, the CPU backend with its
  # virtual devices (for `devices`-marked tests).
  # Tests start subprocesses (examples, workers) that need the GPU too: no process may
  # reserve most of its memory up front.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
else:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_given, *(f for f in _flags if f.split("=")[0] not in _given)]).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxgraph import _capture as capture_lib  # noqa: E402
from models import devices_for  # noqa: E402

_CACHE_ENV = "JAXGRAPH_TEST_COMPILATION_CACHE"


def _compilation_cache() -> str | None:
  """One persistent compilation cache for the whole CPU run, shared by the xdist workers:
  the suite compiles the same small layers in many tests, and XLA compiles each once (the
  CPU suite takes half the time). A new empty folder per run, removed at its end.

  CPU only: on GPU every multi-layer capture makes per-layer loaded copies of its
  executables (`per_layer_executables`), which a cache would serve to every test; the GPU
  suite runs without it, and tests/test_per_layer_executables.py checks a copy of a
  cache-served executable on either platform. JAXGRAPH_TEST_COMPILATION_CACHE=off: no shared
  cache (the scripts the tests start then share one per worker, `compilation_cache_env`).
  """
  if jax.default_backend() != "cpu":
    return None
  path = os.environ.get(_CACHE_ENV)
  if path is None and "PYTEST_XDIST_WORKER" not in os.environ:  # the first process: make it
    path = os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="jaxgraph-tests-xla-cache-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
  return None if path in (None, "off") else path


if (_cache := _compilation_cache()) is not None:
  jax.config.update("jax_compilation_cache_dir", _cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def compilation_cache_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
  """The environment variables that give a process a test starts (an example, a benchmark)
  a persistent compilation cache: on the CPU the run's (`_compilation_cache`), shared with
  every process of the run; elsewhere, or with it off, one of this worker's own."""
  path = _cache or str(tmp_path_factory.mktemp("jax-cache"))
  return {"JAX_COMPILATION_CACHE_DIR": path, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _count(platform: str | None) -> str:
  try:
    devices = jax.devices(platform)
  except RuntimeError:  # that backend is not started (JAX_PLATFORMS)
    return f"0 ({platform})"
  return f"{len(devices)} ({devices[0].platform})"


def pytest_report_header(config):
  return (f"jax {jax.__version__}, default backend {jax.default_backend()}: "
          f"{_count(None)} devices; cpu backend: {_count('cpu')} devices")


def pytest_collection_modifyitems(config, items):
  on_gpu = jax.default_backend() == "gpu"
  # The CPU CI runs these as they would run here (docs/reliability.md); `-m cpu_only` asks
  # for them.
  if on_gpu and "cpu_only" not in (config.getoption("markexpr") or ""):
    cpu_only = [item for item in items if "cpu_only" in item.keywords]
    if cpu_only:
      config.hook.pytest_deselected(items=cpu_only)
      items[:] = [item for item in items if "cpu_only" not in item.keywords]
  gpu_skip = pytest.mark.skip(
      reason=f"needs a CUDA GPU; the default backend is {jax.default_backend()}")
  for item in items:
    if "gpu" in item.keywords and not on_gpu:
      item.add_marker(gpu_skip)
    marker = item.get_closest_marker("devices")
    if marker is not None and not devices_for(*marker.args, **marker.kwargs):
      n = marker.args[0]
      platform = marker.kwargs.get("platform")
      found = (_count(platform) if platform else
               " and ".join(dict.fromkeys([_count(None), _count("cpu")])))
      item.add_marker(pytest.mark.skip(reason=f"needs {n} devices, found {found}"))


@pytest.fixture(autouse=True)
def _on_marked_devices(request):
  """Runs a `devices`-marked test with its devices' first as JAX's default device, so the
  arrays it creates without a placement land on the same platform as its mesh."""
  marker = request.node.get_closest_marker("devices")
  devices = devices_for(*marker.args, **marker.kwargs) if marker else []
  if not devices or devices[0].platform == jax.default_backend():
    yield
    return
  with jax.default_device(devices[0]):
    yield


@pytest.fixture
def platform_gate(monkeypatch):
  """Forces a platform gate either way on the backend the tests run on, so both sides of a
  behaviour that depends on the platform run in the CPU suite (docs/reliability.md,
  "Platform gates"). A gate is a module's frozenset of the platforms where the behaviour is
  on: `platform_gate(capture_lib, "PACK_PLATFORMS", True)` packs residuals here too."""
  def force(module: Any, name: str, on: bool) -> None:
    platforms, here = getattr(module, name), jax.default_backend()
    monkeypatch.setattr(module, name, platforms | {here} if on else platforms - {here})
  return force


@pytest.fixture(params=[False, True], ids=["unpacked", "packed"])
def packing(request, platform_gate) -> bool:
  """Both sides of the residual packing gate (`_capture.PACK_PLATFORMS`, read by
  `_capture._packs`); the test gets the side it runs on. A test of one side takes
  `@pytest.mark.parametrize("packing", [True], indirect=True)`."""
  platform_gate(capture_lib, "PACK_PLATFORMS", request.param)
  return request.param
