"""Several processes of one `jax.distributed` run on this machine, started by a test.

Used by tests/test_multiprocess.py (tests/fsdp_worker.py) and tests/test_examples_fsdp.py (the
Llama example with --coordinator): every process gets the same coordinator address,
127.0.0.1 and a free port, and the test waits for all of them, bounded.
"""

from __future__ import annotations

import socket
import subprocess
from typing import Sequence

import pytest


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now (for the coordinator)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(commands: Sequence[Sequence[str]],
                  env: dict[str, str] | Sequence[dict[str, str]], timeout: float) -> list[str]:
  """Starts every command at once and waits for all of them, `timeout` seconds at most.

  `env`: every process's environment, or one per command (one GPU visible to each).

  Returns each process's output (stdout and stderr together). Fails the test, showing every
  output, when the processes do not finish in time (they are killed) or one exits with an
  error.
  """
  envs = [env] * len(commands) if isinstance(env, dict) else list(env)
  procs = [subprocess.Popen(list(command), env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
           for command, e in zip(commands, envs, strict=True)]
  logs = []
  try:
    for proc in procs:
      logs.append(proc.communicate(timeout=timeout)[0])
  except subprocess.TimeoutExpired:
    for proc in procs:
      proc.kill()
    logs = [proc.communicate()[0] for proc in procs]
    pytest.fail(f"the processes did not finish in {timeout} s:\n" + "\n".join(logs))
  for i, (proc, log) in enumerate(zip(procs, logs)):
    assert proc.returncode == 0, f"process {i} exited with {proc.returncode}:\n{log}"
  return logs
