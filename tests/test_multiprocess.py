"""FSDP over the devices of 2 processes under `jax.distributed.initialize` (JAX's runtime).

Two CPU processes on 127.0.0.1 with 4 virtual devices each train the graphed FSDP stack of
tests/fsdp_worker.py over all 8 devices; cross-process collectives go through gloo (the
default `jax_cpu_collectives_implementation` on CPU in jax 0.10). The reference is the same
worker alone over 8 devices under `jax.distributed`, whose collectives go through gloo too.
"""

from __future__ import annotations

import os
import pathlib
import sys

import numpy as np

import fsdp_worker
from processes import free_port, run_processes

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = pathlib.Path(fsdp_worker.__file__).resolve()
PROCESSES, LOCAL_DEVICES = 2, 4
TIMEOUT_S = 240


def _run_workers(tmp_path: pathlib.Path, processes: int,
                 local_devices: int) -> list[dict[str, np.ndarray]]:
  """Starts `processes` workers of `local_devices` CPU devices each, waits for all of them
  (bounded), returns what each one saved."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={local_devices}",
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  port = free_port()
  outs = [tmp_path / f"{processes}x{local_devices}-process{i}.npz" for i in range(processes)]
  run_processes([[sys.executable, str(WORKER), "--process-id", str(i), "--num-processes",
                  str(processes), "--port", str(port), "--out", str(outs[i])]
                 for i in range(processes)], env, TIMEOUT_S)
  return [dict(np.load(out)) for out in outs]


def test_two_processes_train_fsdp_over_all_devices(tmp_path):
  results = _run_workers(tmp_path, PROCESSES, LOCAL_DEVICES)
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
  # The same program on the 8 devices of one process under jax.distributed: its collectives
  # go through gloo too, which sums in the same order, so every step is bitwise the two
  # processes' (the in-process CPU collectives sum in another order: up to 4e-7 apart after
  # these 3 Adam steps when measured; such a gap reached 1.7e-4 on another machine).
  (one,) = _run_workers(tmp_path, 1, PROCESSES * LOCAL_DEVICES)
  assert int(one["devices"]) == int(one["local_devices"]) == PROCESSES * LOCAL_DEVICES
  for name in first.keys() - {"local_devices"}:
    assert np.array_equal(first[name], one[name]), name
