"""Test setup: 8 virtual CPU devices (set before jax is imported) and shared fixtures."""

import os

_flags = ["--xla_force_host_platform_device_count=8"]
if os.environ.get("JAXGRAPH_TEST_GPU"):
  # Bitwise comparisons between two executables need deterministic GPU reductions.
  _flags.append("--xla_gpu_deterministic_ops=true")
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_given, *(f for f in _flags if f.split("=")[0] not in _given)]).strip()
if "gpu" not in os.environ.get("PYTEST_ADDOPTS", "") and not os.environ.get("JAXGRAPH_TEST_GPU"):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
  has_gpu = any(d.platform == "gpu" for d in jax.devices()) if os.environ.get(
      "JAXGRAPH_TEST_GPU") else False
  skip = pytest.mark.skip(reason="needs a CUDA GPU (run with JAXGRAPH_TEST_GPU=1 -m gpu)")
  for item in items:
    if "gpu" in item.keywords and not has_gpu:
      item.add_marker(skip)
