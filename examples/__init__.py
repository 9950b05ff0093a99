"""The examples, a package of the repository (not installed): each runs from the repository
root as a module, `python -m examples.train_gpt`, `python -m examples.llama.train`, and
imports what the training examples share from its neighbours:

  options.py           the run options; the checks of --out, --steps, --resume; the commands
  checkpoints.py       verified Orbax checkpoints, key-stream positions, an earlier run's outputs
  checkpoint_checks.py what a checkpoint is checked for; a failed Orbax write kept quiet
  corpus.py            a text as batches of token ids, a function of (seed, step)
  vocabulary.py        characters or byte-level BPE; the fables and the standard library's text
  records.py           atomic JSON writes, metrics.json restored, one digest of a tree's arrays
  plotting.py          loss.png
  progress.py          the progress bar (tqdm, else log lines)
  interrupt.py         Ctrl-C: one line, the step kept and the command that continues
  llama/               the Llama example (its own __init__.py says which file holds what)

benchmarks/ imports them the same way (`from examples.llama.presets import PRESETS`).
"""
