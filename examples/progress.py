"""The examples' progress bar: tqdm counting each step as it starts, or log lines without
tqdm; the bars open, closed before a run ends on a failed write."""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Iterator


class LogLines:
  """The part of tqdm's interface the examples use, without a bar: log lines only (when
  tqdm, in the "examples" extra, is not installed)."""

  def __init__(self, iterable: Iterable[int], **_: Any):
    self._iterable = iterable

  def __iter__(self) -> Iterator[int]:
    return iter(self._iterable)

  def set_postfix(self, **_: Any) -> None:
    pass

  def write(self, line: str) -> None:
    print(line, flush=True)

  def close(self) -> None:
    pass


def progress_bar(steps: range, *, total: int) -> Any:
  """A tqdm bar over `steps` (of `total`; `steps` may start later, on a resume), or
  `LogLines` without tqdm. The bar shows no rate of its own: its wall time includes
  evaluation and checkpoints, so the examples put their measured tok/s in the postfix."""
  try:
    from tqdm import tqdm
  except ImportError:
    return LogLines(steps)

  class StepBar(tqdm):
    """Counts each step as it starts. tqdm's own iteration counts only when it redraws (at
    most once a second), so a postfix set between redraws showed the count of the last one
    (0/12 through a whole tiny Llama run)."""

    def __iter__(self) -> Iterator[int]:
      for step in self.iterable:
        self.update()
        yield step

  bar = StepBar(steps, initial=steps.start - 1, total=total, desc="train", unit="step",
                mininterval=1.0, bar_format="{desc}: {percentage:3.0f}%|{bar}| "
                "{n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")
  _OPEN.add(bar)
  return bar


# The bars open: a run that ends on a failed write closes them before its message.
_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()


def close_bars() -> None:
  """Closes every bar open (before a message that ends the run)."""
  for bar in list(_OPEN):
    bar.close()
