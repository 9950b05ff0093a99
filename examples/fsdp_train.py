"""Train an MLP stack with FSDP (jg.fsdp) over all devices, every layer graphed.

  python -m examples.fsdp_train                    # CPU: 8 virtual devices, a few seconds
  python -m examples.fsdp_train --steps 50 --check # also trains with one whole-step jax.jit
  python -m examples.fsdp_train --layers 8 --d 256 # on GPUs the mesh spans jax.devices()

Weights are sharded along the mesh axis "fsdp" (largest divisible dimension; biases and
norm scales stay replicated), the batch is split over the same axis. Each layer gathers its
weights inside its own executables (forward, and again in the backward: the remat policy
keeps gathered weights out of the residuals), and its weight gradients come back sharded
like the weights, so the optimizer update runs on shards. The script prints the losses, the
collectives of one layer's executables and their per-device memory (`memory_analysis()`).
Ctrl-C ends it in one line: what it finished and the command that runs it again
(`examples/interrupt.py`; it saves nothing).
"""

from __future__ import annotations

import os

# 8 virtual devices when running on CPU; no effect on GPU backends. Set before importing jax.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxgraph as jg  # noqa: E402
from jaxgraph import _capture as capture_lib  # noqa: E402
from jaxgraph import fsdp  # noqa: E402
from examples import interrupt  # noqa: E402
from examples.options import given_command  # noqa: E402

Params = dict[str, jax.Array]


def init(key: jax.Array, layers: int, d: int, h: int) -> list[Params]:
  def one(k: jax.Array) -> Params:
    k1, k2 = jax.random.split(k)
    return dict(scale=jnp.ones((d,)), w1=jax.random.normal(k1, (d, h)) / d ** 0.5,
                b1=jnp.zeros((h,)), w2=jax.random.normal(k2, (h, d)) / h ** 0.5)
  return [one(k) for k in jax.random.split(key, layers)]


def block(p: Params, x: jax.Array) -> jax.Array:
  """Pre-norm MLP block with a residual."""
  y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * p["scale"]
  return x + jax.nn.gelu(y @ p["w1"] + p["b1"]) @ p["w2"]


def collectives(compiled: Any) -> dict[str, int]:
  hlo = compiled.as_text()
  return {op: len(re.findall(rf"\b{op}(-start)?\(", hlo))
          for op in ("all-gather", "reduce-scatter", "all-reduce") if re.search(op, hlo)}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--d", type=int, default=64)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--check", action="store_true",
                      help="train the same steps under one jax.jit and compare the params")
  args = parser.parse_args(argv)

  mesh = fsdp.make_mesh()                                    # axis "fsdp" over all devices
  batch = fsdp.batch_sharding(mesh)

  def layer(p: Params, x: jax.Array) -> jax.Array:
    return jax.lax.with_sharding_constraint(block(fsdp.gather(p, mesh), x), batch)

  layer = fsdp.remat(layer)                                  # one function for every layer
  k_params, k_x, k_w = jax.random.split(jax.random.key(0), 3)
  host_params = init(k_params, args.layers, args.d, 4 * args.d)
  params = fsdp.shard(host_params, mesh)
  x = jax.device_put(jax.random.normal(k_x, (args.batch, args.d)), batch)
  target = jax.device_put(jnp.sin(x @ jax.random.normal(k_w, (args.d, args.d))), batch)

  start = time.perf_counter()
  interrupt.point("capture")
  layers = jg.make_graphed([layer] * args.layers, sample_args=[(p, x) for p in params],
                           on_new_signature="error")
  print(f"{len(mesh.devices.flat)} x {mesh.devices.flat[0].device_kind}: captured "
        f"{args.layers} layers in {time.perf_counter() - start:.1f} s, "
        f"captures {[g.stats.captures for g in layers]}")

  optimizer = optax.adamw(3e-3)
  specs = fsdp.shardings(host_params, mesh)
  loss_and_ct = jax.jit(jax.value_and_grad(lambda y, t: jnp.mean((y - t) ** 2)))

  @jax.jit
  def update(grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return jax.lax.with_sharding_constraint(optax.apply_updates(params, updates), specs), opt_state

  def train(params: list[Params]) -> tuple[list[Params], list[float]]:
    opt_state, losses = optimizer.init(params), []
    for step in range(args.steps):
      interrupt.point("training", step)
      y, pullback = jg.sequential_vjp(layers, params, x)
      loss, ct = loss_and_ct(y, target)
      grads, _ = pullback(ct)                                # sharded like params
      params, opt_state = update(grads, opt_state, params)
      losses.append(float(loss))
      if step % 10 == 0 or step == args.steps - 1:
        print(f"step {step:3d}  loss {losses[-1]:.5f}")
    return params, losses

  trained, losses = train(params)
  interrupt.finished(f"the {args.steps} training steps")
  interrupt.point("summary")
  kept = all(a.sharding == b.sharding
             for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(params)))
  print(f"param shardings kept through training: {kept}")

  (entry,) = layers[0].executables.entries.values()
  forward, _ = capture_lib.forward_executable(entry, "explicit", residuals=True)
  backward = entry.backward["full"][0]
  gathered = sum(np.dtype(leaf.dtype).itemsize * leaf.size for leaf in host_params[0].values())
  print(f"one layer: forward {collectives(forward)}, backward {collectives(backward)}")
  print(f"bytes per device (one gathered layer: {gathered:,}):")
  for name, compiled in (("forward", forward), ("backward", backward)):
    m = compiled.memory_analysis()
    print(f"  {name:<8} arguments {m.argument_size_in_bytes:>9,}  outputs "
          f"{m.output_size_in_bytes:>9,}  temp {m.temp_size_in_bytes:>9,}")

  if args.check:
    interrupt.finished("the summary")
    interrupt.point("check")

    def loss_of(params: list[Params]) -> jax.Array:
      y = x
      for p in params:
        y = layer(p, y)
      return jnp.mean((y - target) ** 2)

    @jax.jit
    def whole_step(params: Any, opt_state: Any) -> tuple[Any, Any, jax.Array]:
      loss, grads = jax.value_and_grad(loss_of)(params)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    p, opt_state = params, optimizer.init(params)
    jit_losses = []
    for _ in range(args.steps):
      p, opt_state, loss = whole_step(p, opt_state)
      jit_losses.append(float(loss))
    diff = max(float(jnp.max(jnp.abs(a - b)))
               for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(p)))
    print(f"check vs whole-step jax.jit: losses equal {losses == jit_losses}, "
          f"max |param diff| {diff:.3g}")


if __name__ == "__main__":
  interrupt.run(main, sys.argv[1:], rerun=given_command("examples.fsdp_train", sys.argv[1:]))
