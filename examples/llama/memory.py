"""Device memory: the peak so far, the training state's bytes, and what a preset needs
(`memory_estimate`, on any machine: nothing allocated). docs/llama.md."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jaxgraph as jg

from .model import Llama
from .presets import Preset, model_config


def peak_bytes() -> int | None:
  """The largest `peak_bytes_in_use` over this process's devices; None where devices keep no
  memory statistics (CPU)."""
  peaks = [stats.get("peak_bytes_in_use") for device in jax.local_devices()
           if (stats := device.memory_stats())]
  return max((peak for peak in peaks if peak is not None), default=None)


def state_bytes(count: int) -> int:
  """Device bytes of the training state of `count` float32 params: the params, AdamW's two
  moments, the summed grads and one microbatch's grads (5 x 4 bytes a param)."""
  return 5 * 4 * count


def memory_estimate(preset: Preset, vocab: int) -> dict[str, int]:
  """What a training step of `preset` needs on the device, estimated on any machine.

  The params are counted on the abstract model (`nnx.eval_shape`: nothing allocated). The
  residuals are those `jax.vjp` of one block keeps for its backward, traced abstractly for
  one microbatch, times the depth; with cuDNN attention without the (batch, heads, length,
  length) arrays of XLA's attention, which flash attention does not keep (it keeps
  (batch, heads, length) softmax statistics). jaxgraph's own count after capture is
  `Stats.residual_bytes` (train.py prints it after capture).
  """
  config = model_config(dataclasses.replace(preset, attention="xla"), vocab)
  model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
  count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  fn, params = jg.flax.nnx_layer(model.blocks[0], rngs_argument="rngs")
  x = jax.ShapeDtypeStruct((preset.batch, preset.context, config.width), config.compute_dtype)
  positions = jax.ShapeDtypeStruct((preset.context,), jnp.int32)

  def residuals(params: Any, x: jax.Array, positions: jax.Array) -> Any:
    return jax.vjp(lambda p, x: fn(p, x, positions, key=jax.random.key(0)), params, x)[1]

  flash = preset.attention == "cudnn"
  leaves = jax.tree.leaves(jax.eval_shape(residuals, params, x, positions))
  block = sum(math.prod(s.shape) * s.dtype.itemsize for s in leaves
              if not (flash and len(s.shape) >= 4
                      and s.shape[-2:] == (preset.context, preset.context)))
  if flash:
    block += preset.batch * preset.heads * preset.context * 4
  return {"params": count, "state_bytes": state_bytes(count),
          "residual_bytes": block * preset.depth}

