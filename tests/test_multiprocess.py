"""FSDP over the devices of several processes under `jax.distributed.initialize` (JAX's runtime).

CPU processes on 127.0.0.1 (2 of 4 virtual devices each; 4 of one device each, as one process
per GPU runs) train the graphed FSDP stack of tests/fsdp_worker.py over all their devices;
cross-process collectives go through gloo (the default `jax_cpu_collectives_implementation`
on CPU in jax 0.10). The reference is the same worker alone over 8 devices under
`jax.distributed`, whose collectives go through gloo too.

On a machine with 2 GPUs or more the same test runs 2 processes of one GPU each
(`CUDA_VISIBLE_DEVICES`), collectives through NCCL, against the worker alone over those 2
GPUs: the worker, its launch and the checks are the CPU cases', the one-device-per-process
layout is the (4, 1) case's.
"""

from __future__ import annotations

import os
import pathlib
import sys

import jax
import numpy as np
import pytest

import fsdp_worker
from processes import free_port, run_processes

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = pathlib.Path(fsdp_worker.__file__).resolve()
TIMEOUT_S = 240


def _env(platform: str, local_devices: int, process: int) -> dict[str, str]:
  """Worker `process`'s environment: `local_devices` virtual CPU devices, or on "gpu"
  `local_devices` GPUs of its own (process i sees the i-th `local_devices` of them)."""
  env = dict(os.environ,
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  if platform == "cpu":
    return dict(env, JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"--xla_force_host_platform_device_count={local_devices}")
  first = process * local_devices
  # XLA_FLAGS as tests/conftest.py set them (deterministic GPU reductions); no process may
  # reserve most of a GPU's memory, which the suite's other workers share.
  return dict(env, JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false",
              CUDA_VISIBLE_DEVICES=",".join(map(str, range(first, first + local_devices))))


def _run_workers(tmp_path: pathlib.Path, processes: int, local_devices: int,
                 platform: str = "cpu", *, flat: bool = True) -> list[dict[str, np.ndarray]]:
  """Starts `processes` workers of `local_devices` devices each (virtual CPU devices, or
  GPUs of their own), waits for all of them (bounded), returns what each one saved (`flat`:
  also the flat buffers trained without and with prefetch)."""
  port = free_port()
  outs = [tmp_path / f"{platform}-{processes}x{local_devices}-process{i}.npz"
          for i in range(processes)]
  run_processes([[sys.executable, str(WORKER), "--process-id", str(i), "--num-processes",
                  str(processes), "--port", str(port), "--out", str(outs[i]),
                  "--flat" if flat else "--no-flat"]
                 for i in range(processes)],
                [_env(platform, local_devices, i) for i in range(processes)],
                TIMEOUT_S)
  return [dict(np.load(out)) for out in outs]


@pytest.mark.parametrize("platform, processes, local_devices", [
    pytest.param("cpu", 2, 4, marks=pytest.mark.cpu_only),
    pytest.param("cpu", 4, 1, marks=pytest.mark.cpu_only),
    pytest.param("gpu", 2, 1, marks=[pytest.mark.gpu, pytest.mark.devices(2, platform="gpu")]),
])
def test_processes_train_fsdp_over_all_devices(tmp_path, platform, processes, local_devices):
  """2 processes of 4 devices, and 4 of one device each (JAX's usual one process per GPU);
  on GPUs 2 processes of one GPU each."""
  # The flat buffers with and without prefetch: where each process drives several devices,
  # and on GPUs. On the CPU 4 x 1 would repeat 2 x 4's check: both reduce through gloo.
  flat = (platform, local_devices) != ("cpu", 1)
  results = _run_workers(tmp_path, processes, local_devices, platform, flat=flat)
  devices = processes * local_devices
  for r in results:
    assert int(r["devices"]) == devices
    assert int(r["local_devices"]) == local_devices
    assert int(r["captures"]) == 1          # no recapture across steps
    assert len(r["losses"]) == fsdp_worker.STEPS
    assert r["losses"][-1] < r["losses"][0]
    # The placed params are well formed in every process: each holds its own shards of
    # the full values (a replicated leaf whole), as jg.fsdp.shard placed them.
    host_params = fsdp_worker.host_data()[0]
    for name in (n for n in r if n.startswith("shard/")):
      _, i, k = name.split("/")
      index = tuple(slice(*bounds) for bounds in r[f"index/{i}/{k}"])
      assert np.array_equal(r[name], host_params[int(i)][k][index]), name
    # A typed key placed over every process's devices (jg.fsdp.place: its data through the
    # host) is the key in each of them.
    assert np.array_equal(r["key_data"], jax.random.key_data(jax.random.key(fsdp_worker.KEY_SEED)))
  # The flat FSDP buffers trained with prefetch across the layers' executables: on the CPU
  # the losses bitwise those trained without, the buffers to float32 rounding (a layer's
  # gradient is reduced as one buffer-sized collective there, leaf by leaf here, and gloo
  # adds a message in chunks whose order follows its size; in one process the two are
  # bitwise, tests/test_prefetch.py). On GPUs the prefetching executables are other
  # programs, autotuned on their own (see below): to a tolerance.
  loss_rtol, buffer_rtol, buffer_atol = (1e-4, 1e-3, 1e-5) if platform == "gpu" else (0, 1e-5, 1e-7)
  for r in results if flat else ():
    np.testing.assert_allclose(r["prefetch/losses"], r["flat/losses"], rtol=loss_rtol)
    for name in (n for n in r if n.startswith("flat/buffer")):
      np.testing.assert_allclose(r[name.replace("flat/", "prefetch/")], r[name],
                                 rtol=buffer_rtol, atol=buffer_atol, err_msg=name)
  first, *others = [{name: value for name, value in r.items()
                     if not name.startswith(("shard/", "index/"))} for r in results]
  for other in others:
    assert first.keys() == other.keys()
    for name in first:
      # Every process holds the same global values (the losses are replicated arrays, the
      # params were gathered with process_allgather).
      assert np.array_equal(first[name], other[name]), name
  # The same program on as many devices of one process under jax.distributed.
  (one,) = _run_workers(tmp_path, 1, devices, platform, flat=flat)
  assert int(one["devices"]) == int(one["local_devices"]) == devices
  if platform == "gpu":
    # Two compilations, each in its own process and autotuned there (a GEMM's algorithm is
    # picked by timing it, on a GPU the suite's other workers share), and NCCL communicators
    # of another shape (one process driving both GPUs, or one each): nothing promises the
    # same kernels, so the losses are compared to a tolerance. A plumbing fault (a wrong
    # shard, a missing reduction) moves them far more.
    np.testing.assert_allclose(first["losses"], one["losses"], rtol=1e-4)
    return
  # On CPU its collectives go through gloo too, which sums in the same order, so every step
  # is bitwise the processes' (the in-process CPU collectives sum in another order: up to
  # 4e-7 apart after these 3 Adam steps when measured, and such a gap reached 1.7e-4 on
  # another machine).
  for name in first.keys() - {"local_devices"}:  # the losses and the final params
    assert np.array_equal(first[name], one[name]), name
