"""Memory-kind placement of residuals: forward writes them to pinned host memory."""

from __future__ import annotations

import jax


def to_host(x: jax.Array) -> jax.Array:
  """Inside a forward executable: place a residual in host memory."""
  return jax.device_put(x, jax.memory.Space.Host)


def to_device(x: jax.Array) -> jax.Array:
  """Inside a backward executable: bring a residual back before any compute reads it.

  Without this XLA compiles the backward's reads of a host buffer into host compute.
  """
  return jax.device_put(x, jax.memory.Space.Device)


def check_backend_supports_offload() -> None:
  """Raises a clear error when the default backend has no pinned host memory."""
  device = jax.devices()[0]
  kinds = {m.kind for m in device.addressable_memories()}
  if "pinned_host" not in kinds:
    raise ValueError(
        f"offload_residuals=True needs a 'pinned_host' memory kind, but {device.platform} "
        f"device {device} has only {sorted(kinds)}. Use offload_residuals=False on this "
        "backend.")
