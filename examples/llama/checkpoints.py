"""What the run's checkpoints hold beside the state (examples/checkpoints.py's
`Checkpoints`): the run's config and vocabulary (`metadata`), which --resume compares with
this run's (`run_config`, `check_vocabulary`), and the loss history; `resume` restores a
run."""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

from examples import vocabulary as vocab_lib
from examples.checkpoints import Checkpoints

from .data import describe_vocabulary, load_vocabulary, vocabulary_record
from .layers import Params
from .presets import PRESETS, Preset
from .trainer import Stepper


# How --fsdp lays out the flat buffers (jg.fsdp.shard: jg.flat.split, a piece of every
# weight in each device's part), saved with the run's config.
FSDP_LAYOUT = "split"


def run_config(args: argparse.Namespace, preset: Preset) -> dict[str, Any]:
  """What makes two runs the same run, by flag name: saved with every checkpoint, and
  compared by --resume (how tokens/s is measured, --check, --offload and generation are left
  out: they change no result). `fsdp`, `batch`, `context`, `text` and `vocab` are None where
  not given (or given as the preset's), as in checkpoints written before those flags, which
  therefore still resume; so are `init_from` and `lora` (lora.py). With --fsdp the flat
  buffers' layout is saved beside N: a checkpoint of buffers in another layout holds the same
  shapes in another order, and must not resume. The vocabulary itself is compared by its
  digest (`check_vocabulary`)."""
  return {"preset": args.preset, "steps": preset.steps, "seed": args.seed,
          "dropout": preset.dropout, "microbatches": preset.microbatches,
          "attention": preset.attention, "dtype": args.dtype, "untied": args.untied,
          "plain_ends": args.plain_ends, "flat": args.flat, "residuals": args.residuals,
          "whole_step": args.whole_step,
          "fsdp": {"devices": args.fsdp, "layout": FSDP_LAYOUT} if args.fsdp else None,
          "batch": args.batch,
          "fuse": args.fuse,  # None when off, True for whole runs, K for segments
          "context": args.context, "text": args.text, "vocab": args.vocab,
          # None without them, as in checkpoints written before these flags (lora.py)
          "init_from": None if args.init_from is None else str(args.init_from.absolute()),
          "lora": args.lora}


def shown_config(config: dict[str, Any]) -> dict[str, Any]:
  """What a `run_config` stands for, as --resume's refusal shows it: the preset's batch
  where none was given, "off" for --fsdp and --fuse not given, N for --fsdp N (and the
  layout where it is not this one's)."""
  preset = PRESETS.get(config.get("preset"))
  fsdp = config.get("fsdp") or "off"
  if isinstance(fsdp, int):  # saved before the layout was: the buffers padded at their ends
    fsdp = f"{fsdp}, its flat buffers in the layout before jg.flat.split's"
  elif isinstance(fsdp, dict):
    fsdp = (f"{fsdp['devices']}" if fsdp.get("layout") == FSDP_LAYOUT
            else f"{fsdp['devices']}, its flat buffers in the layout {fsdp.get('layout')!r}")
  return {**config, "batch": config.get("batch") or (preset.batch if preset else None),
          "fsdp": fsdp, "fuse": config.get("fuse") or "off"}


def check_vocabulary(parser: argparse.ArgumentParser, out: pathlib.Path, preset: Preset,
                     cache: pathlib.Path, flag: str = "--resume",
                     legacy_metadata: bool = False) -> None:
  """With --resume (or --init-from: `flag`, and the run it names as `out`): refuses
  (`parser.error`) a checkpoint trained with another vocabulary (tokenizer digest) than
  this run's, naming both. Checkpoints written before vocabularies were recorded used the
  fables' characters."""
  directory = out / "checkpoints"
  latest = (Checkpoints(directory, legacy_metadata=legacy_metadata).latest_meta()
            if directory.is_dir() else None)
  if latest is None:
    return
  saved = latest[1].get("vocabulary") or vocabulary_record(
      vocab_lib.fables(), vocab_lib.Characters(vocab_lib.fables()))
  ours = vocabulary_record(*load_vocabulary(preset, cache))
  if saved["digest"] != ours["digest"]:
    parser.error(f"{flag}: the checkpoint in {directory} was trained with "
                 f"{describe_vocabulary(saved)}; this run's vocabulary is "
                 f"{describe_vocabulary(ours)}. Token ids mean other things under another "
                 "vocabulary: resume where the checkpoint's text and tokenizer are (the same "
                 f"Python for the standard library; its tokenizer file: "
                 f"{saved.get('file', 'none, characters')}), or start a new run with another "
                 f"--out (or without {flag})")



def metadata(args: argparse.Namespace, preset: Preset, vocabulary: dict[str, Any],
             fine_tuning: dict[str, Any] | None = None) -> dict[str, Any]:
  """What every checkpoint of the run saves beside its state and loss history: the run's
  config and its vocabulary (`vocabulary_record`), which --resume compares; a fine-tuning
  run's start (lora.py: the run it loaded, its step and digests)."""
  return {"config": run_config(args, preset), "vocabulary": vocabulary,
          **({"fine_tuning": fine_tuning} if fine_tuning else {})}


def resume(checkpoints: Checkpoints, trainer: Stepper, params: Params, opt_state: Any
           ) -> tuple[int, Params, Any, list[float], list[tuple[int, float]]]:
  """--resume: the step, params, optimizer state, losses and (step, held-out loss) history
  of the newest checkpoint that passes its digests, the trainer's key streams set to its;
  step 0, the state given and no history when there is no checkpoint yet."""
  first, losses, eval_losses = 0, [], []
  restored = checkpoints.resume(params, opt_state, trainer.streams())
  if restored is not None:
    first, params, opt_state = restored.step, restored.params, restored.opt_state
    trainer.seed(restored.streams)
    losses = list(restored.meta["losses"])  # one per step: `Checkpoints` checked it
    eval_losses = [(step, loss) for step, loss in restored.meta["eval_losses"]]
    print(f"resumed from step {first} ({checkpoints.directory}, digests verified)")
  return first, params, opt_state, losses, eval_losses
