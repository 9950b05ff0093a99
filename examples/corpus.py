"""The text a training example trains on, as batches of token ids that depend on (seed,
step) only: a resumed run reads the batches the uninterrupted one would.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from examples.vocabulary import Vocabulary


class Corpus:
  """A text as token ids; batch `step` is a function of (seed, step) only.

  With `held_out` > 0, that fraction at the end of the ids is kept out of training and
  read by `eval_batch`. With a `sharding` (data parallel: the batch dimension split over a
  mesh) every batch is placed with it; with several processes each one makes the same whole
  batch and keeps its own devices' rows.
  """

  def __init__(self, ids: np.ndarray, vocabulary: Vocabulary, context: int, batch: int,
               seed: int, held_out: float = 0.0, sharding: Sharding | None = None):
    split = len(ids) - int(held_out * len(ids))
    self.ids, self.held_out_ids = ids[:split], ids[split:]
    shortest = min(len(self.ids), len(self.held_out_ids) if held_out else len(self.ids))
    if shortest <= context + 1:
      raise ValueError(f"a text of {len(ids):,} tokens ({shortest:,} in its shorter part) "
                       f"has no window of {context + 1} tokens: pass a shorter context or a "
                       "longer text")
    self.vocabulary = vocabulary
    self.context, self.batch, self.seed = context, batch, seed
    self.sharding = sharding

  def _windows(self, ids: np.ndarray, seed: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    starts = np.random.default_rng(seed).integers(0, len(ids) - self.context - 1, self.batch)
    window = np.stack([ids[s:s + self.context + 1] for s in starts])
    tokens, targets = window[:, :-1], window[:, 1:]
    if self.sharding is None:
      return jnp.asarray(tokens), jnp.asarray(targets)
    # From the host copy each process holds: no cross-process check of equal values, which
    # `jax.device_put` to a global sharding runs (a collective per call).
    def place(part: np.ndarray) -> jax.Array:
      return jax.make_array_from_callback(part.shape, self.sharding, lambda index: part[index])

    return place(tokens), place(targets)

  def batch_at(self, step: int) -> tuple[jax.Array, jax.Array]:
    """Training batch `step`: (tokens, next tokens), each (batch, context)."""
    return self._windows(self.ids, [self.seed, step])

  def eval_batch(self, index: int) -> tuple[jax.Array, jax.Array]:
    """Held-out batch `index` (the same on every call)."""
    return self._windows(self.held_out_ids, [self.seed, index, 1])

  def decode(self, ids: Any) -> str:
    return self.vocabulary.decode(ids)
