"""What the training examples share: their run options, the corpus, key-stream positions,
Orbax checkpoints that hold them, a params digest, the loss plot.

Used by examples/train_gpt.py and examples/llama/train.py.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import shutil
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import jaxgraph as jg
import jaxgraph.rng


def run_parser(description: str, presets: Sequence[str]) -> argparse.ArgumentParser:
  """The options every training example takes: a preset, the steps, and stop / resume."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--preset", choices=sorted(presets), default="cpu")
  parser.add_argument("--steps", type=int, help="total steps (default: the preset's)")
  parser.add_argument("--stop-after", type=int, help="stop after this step, as if interrupted")
  parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  return parser


CORPUS = pathlib.Path(__file__).parent / "data" / "corpus.txt"


class Corpus:
  """The text as character ids; batch `step` is a function of (seed, step) only.

  With `held_out` > 0, that fraction at the end of the text is kept out of training and
  read by `eval_batch`.
  """

  def __init__(self, path: pathlib.Path, context: int, batch: int, seed: int,
               held_out: float = 0.0):
    text = path.read_text(encoding="ascii")
    self.chars = sorted(set(text))
    self.index = {c: i for i, c in enumerate(self.chars)}
    ids = np.array([self.index[c] for c in text], np.int32)
    split = len(ids) - int(held_out * len(ids))
    self.ids, self.held_out_ids = ids[:split], ids[split:]
    self.context, self.batch, self.seed = context, batch, seed

  def _windows(self, ids: np.ndarray, seed: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    starts = np.random.default_rng(seed).integers(0, len(ids) - self.context - 1, self.batch)
    window = np.stack([ids[s:s + self.context + 1] for s in starts])
    return jnp.asarray(window[:, :-1]), jnp.asarray(window[:, 1:])

  def batch_at(self, step: int) -> tuple[jax.Array, jax.Array]:
    """Training batch `step`: (tokens, next tokens), each (batch, context)."""
    return self._windows(self.ids, [self.seed, step])

  def eval_batch(self, index: int) -> tuple[jax.Array, jax.Array]:
    """Held-out batch `index` (the same on every call)."""
    return self._windows(self.held_out_ids, [self.seed, index, 1])

  def decode(self, ids: Any) -> str:
    return "".join(self.chars[int(i)] for i in ids)


Streams = list[tuple[jax.Array, int]]


def stream_positions(layers: Sequence[jg.GraphedCallable]) -> Streams:
  """Each layer's key stream: (base key, keys drawn so far)."""
  return [(layer.rng_base_key, layer.rng_counter) for layer in layers]


def stream_keys(streams: Streams, offset: int) -> list[jax.Array]:
  """The keys the streams of layers 0, 1, ... of one `make_graphed` call draw `offset`
  draws after `streams`."""
  return [jaxgraph.rng.stream_key(i, counter + offset, base)
          for i, (base, counter) in enumerate(streams)]


class Checkpoints:
  """Orbax checkpoints of the params, the optimizer state and each layer's stream position."""

  @classmethod
  def for_run(cls, out: pathlib.Path, *, resume: bool) -> "Checkpoints":
    """The checkpoints of a run writing to `out`; without `resume`, an earlier run's are
    removed first (the run starts afresh)."""
    directory = out / "checkpoints"
    if not resume and directory.exists():
      print(f"starting afresh: removing the checkpoints of an earlier run in {out} "
            "(pass --resume to continue it)")
      shutil.rmtree(directory)
    return cls(directory)

  def __init__(self, directory: pathlib.Path):
    self.directory = directory.absolute()
    self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=2, enable_async_checkpointing=False))

  @staticmethod
  def _tree(params: Any, opt_state: Any, streams: Streams) -> dict[str, Any]:
    return {"params": params, "opt_state": opt_state,
            "streams": [{"key": jax.random.key_data(base),
                         "counter": np.asarray(counter, np.uint32)} for base, counter in streams]}

  def save(self, step: int, params: Any, opt_state: Any,
           layers: Sequence[jg.GraphedCallable]) -> None:
    self.manager.save(step, args=ocp.args.StandardSave(
        self._tree(params, opt_state, stream_positions(layers))))

  def restore(self, params: Any, opt_state: Any, layers: Sequence[jg.GraphedCallable]
              ) -> tuple[int, Any, Any] | None:
    """Restores the latest checkpoint into the layers' streams; None if there is none.

    `params` and `opt_state` give the structure (the values are replaced)."""
    step = self.manager.latest_step()
    if step is None:
      return None
    target = self._tree(params, opt_state, stream_positions(layers))
    restored = self.manager.restore(step, args=ocp.args.StandardRestore(target))
    for layer, stream in zip(layers, restored["streams"]):
      layer.seed(jax.random.wrap_key_data(stream["key"]), counter=int(stream["counter"]))
    return step, restored["params"], restored["opt_state"]


def params_digest(params: Any) -> str:
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    digest.update(np.asarray(leaf).tobytes())
  return digest.hexdigest()


def plot(losses: list[float], path: pathlib.Path, title: str,
         eval_losses: Sequence[tuple[int, float]] = ()) -> None:
  """Training loss per step (raw and smoothed) and, if given, (step, held-out loss) points."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = np.arange(1, len(losses) + 1)
  window = max(1, len(losses) // 25)
  smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(steps, losses, alpha=0.35, label="loss")
  ax.plot(steps[window - 1:], smooth, label=f"mean of {window}")
  if eval_losses:
    ax.plot(*zip(*eval_losses), "o-", label="held-out loss")
  ax.set(xlabel="step", ylabel="cross-entropy (nats/char)", title=title)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
