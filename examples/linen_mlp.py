"""A Flax Linen MLP graphed per layer and trained with Optax on a synthetic spiral.

  python -m examples.linen_mlp                 # a few seconds on a CPU
  python -m examples.linen_mlp --steps 50

Each layer (input projection, residual dropout blocks, classifier + loss) is turned into a
pure function by `jaxgraph.flax.linen_layer` and captured by one `jaxgraph.make_graphed`
call; the blocks share one set of executables. Evaluation uses the same Linen modules with
`train=False`, under one plain `jax.jit`. Ctrl-C ends it in one line: what it finished and
the command that runs it again (`examples/interrupt.py`; it saves nothing).
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxgraph as jg
import jaxgraph.flax as jgf
from examples import interrupt
from examples.options import given_command

CLASSES, WIDTH, DEPTH, BATCH = 3, 64, 4, 256


class Stem(nn.Module):
  @nn.compact
  def __call__(self, points: jax.Array) -> jax.Array:
    return nn.Dense(WIDTH)(points)


class Block(nn.Module):
  rate: float = 0.1

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    h = nn.Dense(WIDTH)(jax.nn.gelu(nn.LayerNorm()(x)))
    return x + nn.Dropout(self.rate, deterministic=not train)(h)


class Classifier(nn.Module):
  @nn.compact
  def __call__(self, x: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    logits = nn.Dense(CLASSES)(nn.LayerNorm()(x))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == labels)


def spiral(count: int, seed: int) -> tuple[jax.Array, jax.Array]:
  """Three interleaved noisy spiral arms in the plane."""
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, CLASSES, count)
  radius = rng.uniform(0.1, 1.0, count)
  angle = 10.0 * radius + 2 * np.pi * labels / CLASSES + rng.normal(0, 0.3, count)
  points = np.stack([radius * np.cos(angle), radius * np.sin(angle)], -1)
  return jnp.asarray(points, jnp.float32), jnp.asarray(labels, jnp.int32)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  points, labels = spiral(BATCH, args.seed)
  x = jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32)
  keys = jax.random.split(jax.random.key(args.seed), DEPTH + 2)
  stem, block, head = Stem(), Block(), Classifier()
  variables = ([stem.init(keys[0], points)]
               + [block.init(k, jnp.zeros(x.shape), train=False) for k in keys[1:-1]]
               + [head.init(keys[-1], jnp.zeros(x.shape), labels)])
  modules = [stem] + [block] * DEPTH + [head]
  fns, params = zip(*(jgf.linen_layer(m, v, train=True) if m is block
                      else jgf.linen_layer(m, v) for m, v in zip(modules, variables)))
  params = list(params)
  sample_args = ([(params[0], points)] + [(p, x) for p in params[1:-1]]
                 + [(params[-1], x, labels)])
  interrupt.point("capture")
  layers = jg.make_graphed(list(fns), sample_args=sample_args, rng=jax.random.key(args.seed))
  for i, layer in enumerate(layers):
    s = layer.stats
    print(f"{layer.name:<14} captures {s.captures} cache hits {s.cache_hits} "
          f"compile {s.compile_seconds:.2f} s")

  tx = optax.adamw(3e-3, weight_decay=1e-4)
  opt_state = tx.init(params)

  @functools.partial(jax.jit, donate_argnums=(1, 2))
  def update(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  losses = []
  for step in range(1, args.steps + 1):
    interrupt.point("training", step)
    points, labels = spiral(BATCH, args.seed + step)
    h, stem_pullback = layers[0].vjp(params[0], points)
    h, blocks_pullback = jg.sequential_vjp(layers[1:-1], params[1:-1], h)
    (loss, accuracy), head_pullback = layers[-1].vjp(params[-1], h, labels)
    head_grads, h_grads, _ = head_pullback((jnp.ones_like(loss), jnp.zeros_like(accuracy)))
    block_grads, h_grads = blocks_pullback(h_grads)
    stem_grads, _ = stem_pullback(h_grads)
    params, opt_state = update([stem_grads, *block_grads, head_grads], opt_state, params)
    losses.append(loss)
    if step % max(1, args.steps // 10) == 0 or step == args.steps:
      print(f"step {step:>4}/{args.steps} loss {float(loss):.4f} batch accuracy "
            f"{float(accuracy):.3f}", flush=True)

  interrupt.finished(f"the {args.steps} training steps")
  interrupt.point("evaluation")
  # Evaluation: the same Linen modules with train=False, composed under one jax.jit.
  eval_fns = [jgf.linen_layer(m, v)[0] if m is not block
              else jgf.linen_layer(m, v, train=False)[0] for m, v in zip(modules, variables)]

  @jax.jit
  def evaluate(params, points, labels):
    h = eval_fns[0](params[0], points)
    for fn, p in zip(eval_fns[1:-1], params[1:-1]):
      h = fn(p, h)
    return eval_fns[-1](params[-1], h, labels)

  test_points, test_labels = spiral(4096, 10**6 + args.seed)
  test_loss, test_accuracy = evaluate(params, test_points, test_labels)
  print(f"held-out loss {float(test_loss):.4f}, accuracy {float(test_accuracy):.3f}")
  return {"losses": [float(l) for l in losses], "test_loss": float(test_loss),
          "test_accuracy": float(test_accuracy)}


if __name__ == "__main__":
  interrupt.run(main, sys.argv[1:], rerun=given_command("examples.linen_mlp", sys.argv[1:]))
