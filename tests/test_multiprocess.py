"""FSDP over the devices of 2 processes under `jax.distributed.initialize` (JAX's runtime).

Two CPU processes on 127.0.0.1 with 4 virtual devices each train the graphed FSDP stack of
tests/fsdp_worker.py over all 8 devices; cross-process collectives go through gloo (the
default `jax_cpu_collectives_implementation` on CPU in jax 0.10).
"""

from __future__ import annotations

import os
import pathlib
import sys

import numpy as np
import pytest

import fsdp_worker
from jaxgraph import fsdp
from models import devices_for
from processes import free_port, run_processes

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = pathlib.Path(fsdp_worker.__file__).resolve()
PROCESSES, LOCAL_DEVICES = 2, 4
TIMEOUT_S = 240


def _run_workers(tmp_path: pathlib.Path) -> list[dict[str, np.ndarray]]:
  """Starts the workers, waits for both (bounded), returns what each one saved."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES}",
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  port = free_port()
  outs = [tmp_path / f"process{i}.npz" for i in range(PROCESSES)]
  run_processes([[sys.executable, str(WORKER), "--process-id", str(i), "--num-processes",
                  str(PROCESSES), "--port", str(port), "--out", str(outs[i])]
                 for i in range(PROCESSES)], env, TIMEOUT_S)
  return [dict(np.load(out)) for out in outs]


@pytest.mark.devices(8, platform="cpu")  # the in-process reference: the workers' platform
def test_two_processes_train_fsdp_over_all_devices(tmp_path):
  results = _run_workers(tmp_path)
  for r in results:
    assert int(r["devices"]) == PROCESSES * LOCAL_DEVICES
    assert int(r["local_devices"]) == LOCAL_DEVICES
    assert int(r["captures"]) == 1          # no recapture across steps
    assert len(r["losses"]) == fsdp_worker.STEPS
    assert r["losses"][-1] < r["losses"][0]
  first, second = results
  assert first.keys() == second.keys()
  for name in first:
    # Both processes hold the same global values (the losses are replicated arrays, the
    # params were gathered with process_allgather).
    assert np.array_equal(first[name], second[name]), name
  mesh = fsdp.make_mesh(devices=devices_for(8, "cpu")[:8])
  losses, params, _ = fsdp_worker.train_graphed(mesh)
  # Same partitioned program on 8 devices in one process; the cross-process all-reduce runs
  # through gloo instead of the in-process CPU collectives and may sum in another order.
  np.testing.assert_allclose(first["losses"], losses, rtol=1e-5)
  for i, p in enumerate(params):
    for k, v in p.items():
      np.testing.assert_allclose(first[f"{i}/{k}"], v, rtol=1e-5, atol=1e-6)
