"""The loss plot a training example writes (`loss.png`).
"""

from __future__ import annotations

import pathlib
from typing import Sequence

import numpy as np


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
