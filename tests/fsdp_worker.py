"""A small FSDP training run: the model of tests/test_fsdp.py and the 2-process test's worker.

Imported by the tests (8 virtual devices in one process), and run as a script by
tests/test_multiprocess.py, once per process, under `jax.distributed.initialize`:

  python tests/fsdp_worker.py --process-id 0 --num-processes 2 --port 12345 --out r0.npz

The worker writes its losses and the final (gathered) params to `--out`, its shard of a
typed PRNG key placed over every device (`key_data`), and (unless `--no-flat`) the same
stack trained over flat FSDP buffers without and with prefetch across the layers'
executables (`flat/`, `prefetch/`).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxgraph as jg
from jaxgraph import fsdp

LAYERS, D, H, BATCH, STEPS = 3, 32, 128, 32, 3
KEY_SEED = 7  # of the typed key the worker places replicated over every device
Params = dict[str, Any]


def block(p: Params, x: jax.Array) -> jax.Array:
  """The layer's math (an MLP with a residual), the same with and without FSDP."""
  return x + jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def fsdp_block(mesh: Mesh) -> Callable[[Params, jax.Array], jax.Array]:
  """`block` over sharded weights: gather inside, batch-sharded output, remat policy."""
  batch = fsdp.batch_sharding(mesh)

  def layer(p: Params, x: jax.Array) -> jax.Array:
    return jax.lax.with_sharding_constraint(block(fsdp.gather(p, mesh), x), batch)

  return fsdp.remat(layer)


def host_data(layers: int = LAYERS, seed: int = 0
              ) -> tuple[list[dict[str, np.ndarray]], np.ndarray, np.ndarray]:
  """Params, inputs and targets as NumPy arrays: the same values in every process."""
  rng = np.random.default_rng(seed)
  params = [dict(w1=(rng.standard_normal((D, H)) / D ** 0.5).astype(np.float32),
                 b1=np.zeros((H,), np.float32),
                 w2=(rng.standard_normal((H, D)) / H ** 0.5).astype(np.float32))
            for _ in range(layers)]
  x = rng.standard_normal((BATCH, D)).astype(np.float32)
  t = rng.standard_normal((BATCH, D)).astype(np.float32)
  return params, x, t


def loss_fn(y: jax.Array, t: jax.Array) -> jax.Array:
  return jnp.mean((y - t) ** 2)


def train_graphed(mesh: Mesh | None, steps: int = STEPS, layers: int = LAYERS
                  ) -> tuple[np.ndarray, list[dict[str, np.ndarray]],
                             tuple[jg.GraphedCallable, ...]]:
  """Trains the stack graphed with jaxgraph: FSDP over `mesh`, or unsharded when None.

  Returns the losses, the final params (gathered to host) and the graphed layers.
  """
  host_params, x, t = host_data(layers)
  if mesh is None:
    params, layer_fn, specs = jax.tree.map(jnp.asarray, host_params), block, None
    x, t = jnp.asarray(x), jnp.asarray(t)
  else:
    # From arrays on this process's device, as a program that initializes with jax.random
    # has them (jg.fsdp.shard places those across processes through the host).
    params = fsdp.shard(jax.tree.map(jnp.asarray, host_params), mesh)
    layer_fn = fsdp_block(mesh)
    specs = fsdp.shardings(host_params, mesh)
    x, t = jax.device_put((x, t), fsdp.batch_sharding(mesh))
  # Abstract sample params: the warmup makes its zeros with their shardings (across
  # processes too), as for a program that captures before it initializes.
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          params)
  graphed = jg.make_graphed([layer_fn] * layers, sample_args=[(p, x) for p in abstract],
                            num_warmup_iters=1, on_new_signature="error")
  optimizer = optax.adam(1e-2)
  opt_state = jax.jit(optimizer.init)(params)

  def apply(grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  # Keep the params' shardings across steps: a new sharding would be a new signature.
  update = jax.jit(apply, out_shardings=(specs, None))
  loss_and_ct = jax.jit(jax.value_and_grad(loss_fn))
  losses = []
  for _ in range(steps):
    y, pullback = jg.sequential_vjp(graphed, params, x)
    loss, ct = loss_and_ct(y, t)
    grads, _ = pullback(ct)
    # One step in flight: XLA:CPU's collectives can hang under more (reliability.md).
    params, opt_state = jax.block_until_ready(update(grads, opt_state, params))
    losses.append(loss)
  gathered = multihost_utils.process_allgather(params, tiled=True)
  return np.asarray(jax.device_get(losses)), gathered, graphed


def train_flat(mesh: Mesh, *, prefetch: bool, steps: int = STEPS, layers: int = LAYERS
               ) -> tuple[np.ndarray, list[np.ndarray]]:
  """The stack's params as flat FSDP buffers (`jg.fsdp.shard` of `jg.flat.ravel` trees),
  trained with or without prefetch across the layers' executables (`sequential_vjp(...,
  prefetch=)`). Returns the losses and the final buffers (gathered to host)."""
  host_params, x, t = host_data(layers)
  params = fsdp.shard([jg.flat.ravel(jax.tree.map(jnp.asarray, p)) for p in host_params], mesh)
  x, t = jax.device_put((x, t), fsdp.batch_sharding(mesh))
  graphed = jg.make_graphed([block] * layers, sample_args=[(p, x) for p in params],
                            num_warmup_iters=0)
  optimizer = optax.adam(1e-2)
  opt_state = jax.jit(optimizer.init)(params)

  def apply(grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  update = jax.jit(apply, out_shardings=(fsdp.shardings(params, mesh), None))
  loss_and_ct = jax.jit(jax.value_and_grad(loss_fn))
  losses = []
  for _ in range(steps):
    y, pullback = jg.sequential_vjp(graphed, params, x, prefetch=prefetch)
    loss, ct = loss_and_ct(y, t)
    grads, _ = pullback(ct)
    params, opt_state = jax.block_until_ready(update(grads, opt_state, params))
    losses.append(loss)
  buffers = [b for p in params for b in p.buffers]
  return (np.asarray(jax.device_get(losses)),
          multihost_utils.process_allgather(buffers, tiled=True))


def train_jit(mesh: Mesh, steps: int = STEPS, layers: int = LAYERS
              ) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
  """The same training as one whole-step `jax.jit` (FSDP layers, same optimizer)."""
  host_params, x, t = host_data(layers)
  params = fsdp.shard(host_params, mesh)
  x, t = jax.device_put((x, t), fsdp.batch_sharding(mesh))
  layer_fn = fsdp_block(mesh)
  optimizer = optax.adam(1e-2)
  opt_state = jax.jit(optimizer.init)(params)

  def loss_of(params: Sequence[Params], x: jax.Array, t: jax.Array) -> jax.Array:
    for p in params:
      x = layer_fn(p, x)
    return loss_fn(x, t)

  @jax.jit
  def step(params: Any, opt_state: Any, x: jax.Array, t: jax.Array):
    loss, grads = jax.value_and_grad(loss_of)(params, x, t)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(steps):
    params, opt_state, loss = jax.block_until_ready(step(params, opt_state, x, t))
    losses.append(loss)
  return np.asarray(jax.device_get(losses)), multihost_utils.process_allgather(params, tiled=True)


def first_shards(params: Sequence[Params]) -> dict[str, np.ndarray]:
  """Per leaf of the placed `params`, this process's first shard (`shard/i/k`) and where it
  lies in the whole array (`index/i/k`: a start and stop per dimension)."""
  out = {}
  for i, p in enumerate(params):
    for k, leaf in p.items():
      shard = leaf.addressable_shards[0]
      out[f"shard/{i}/{k}"] = np.asarray(shard.data)
      out[f"index/{i}/{k}"] = np.array([s.indices(n)[:2] for s, n in zip(shard.index, leaf.shape)])
  return out


def flat_results(mesh: Mesh, steps: int) -> dict[str, np.ndarray]:
  """The flat-buffer training unprefetched (`flat/...`) and prefetched (`prefetch/...`)."""
  out = {}
  for name, prefetch in (("flat", False), ("prefetch", True)):
    losses, buffers = train_flat(mesh, prefetch=prefetch, steps=steps)
    out[f"{name}/losses"] = losses
    out.update({f"{name}/buffer{i}": b for i, b in enumerate(buffers)})
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--steps", type=int, default=STEPS)
  parser.add_argument("--flat", action=argparse.BooleanOptionalAction, default=True,
                      help="also train over flat buffers without and with prefetch")
  args = parser.parse_args()
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                             num_processes=args.num_processes, process_id=args.process_id,
                             initialization_timeout=60)
  mesh = fsdp.make_mesh()
  losses, params, graphed = train_graphed(mesh, args.steps)
  key = fsdp.place(jax.random.key(KEY_SEED), NamedSharding(mesh, PartitionSpec()))
  np.savez(args.out, losses=losses, devices=len(mesh.devices.flat),
           key_data=jax.random.key_data(key.addressable_shards[0].data),
           **first_shards(fsdp.shard(jax.tree.map(jnp.asarray, host_data()[0]), mesh)),
           local_devices=jax.local_device_count(), captures=graphed[0].stats.captures,
           **{f"{i}/{k}": v for i, p in enumerate(params) for k, v in p.items()},
           **(flat_results(mesh, args.steps) if args.flat else {}))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
