"""The presets: the model's shape, the batch, the schedule, the text, how tokens/s is
measured; and the flags that override them (`resolve`)."""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp

from .model import Config


@dataclasses.dataclass(frozen=True)
class Preset:
  context: int
  width: int
  depth: int
  heads: int
  kv_heads: int
  hidden: int
  batch: int          # sequences per microbatch
  microbatches: int   # accumulated per optimizer step
  steps: int
  learning_rate: float
  dropout: float
  eval_every: int
  eval_batches: int
  checkpoint_every: int
  attention: str | None = None  # jax.nn.dot_product_attention implementation (training)
  check: bool = False           # run --check by default (the GPU presets: both throughputs)
  # The training text (vocabulary.TEXTS) and its vocabulary: a byte-level BPE of `vocab`
  # tokens trained on it, or None: its characters. docs/llama.md says why these.
  text: str = "fables"
  vocab: int | None = None
  # Tokens/s: after a warm-up of `round_steps` untimed steps, rounds of `round_steps` steps
  # between device syncs; --check times `rounds` rounds of each step, alternating.
  rounds: int = 3
  round_steps: int = 10


PRESETS = {
    "tiny": Preset(context=32, width=32, depth=2, heads=4, kv_heads=2, hidden=64, batch=8,
                   microbatches=2, steps=12, learning_rate=3e-3, dropout=0.1, eval_every=6,
                   eval_batches=2, checkpoint_every=10, rounds=2, round_steps=3),
    "cpu": Preset(context=64, width=128, depth=4, heads=4, kv_heads=2, hidden=352, batch=16,
                  microbatches=2, steps=250, learning_rate=3e-3, dropout=0.1, eval_every=50,
                  eval_batches=4, checkpoint_every=100, rounds=3, round_steps=10),
    "gpu": Preset(context=512, width=768, depth=12, heads=12, kv_heads=4, hidden=2048,
                  batch=16, microbatches=2, steps=300, learning_rate=6e-4, dropout=0.1,
                  eval_every=100, eval_batches=8, checkpoint_every=150, attention="cudnn",
                  check=True, rounds=5, round_steps=40, text="stdlib", vocab=8192),
    # ~1.06B params (TinyLlama's shape, 22 blocks of 47.2M, with an 8,192-token embedding),
    # 16,384 tokens a step as `gpu`; memory in docs/llama.md.
    "gpu-1b": Preset(context=2048, width=2048, depth=22, heads=16, kv_heads=8, hidden=5632,
                     batch=4, microbatches=2, steps=200, learning_rate=3e-4, dropout=0.0,
                     eval_every=100, eval_batches=4, checkpoint_every=200, attention="cudnn",
                     check=True, rounds=5, round_steps=40, text="stdlib", vocab=8192),
}


def model_config(preset: Preset, vocab: int, *, untied: bool = False,
                 dtype: str = "bfloat16") -> Config:
  """The model's `Config` for `preset` (and the --untied, --dtype flags)."""
  return Config(vocab=vocab, width=preset.width, depth=preset.depth, heads=preset.heads,
                kv_heads=preset.kv_heads, hidden=preset.hidden, dropout=preset.dropout,
                tie_embeddings=not untied, compute_dtype=jnp.dtype(dtype),
                attention=None if preset.attention == "xla" else preset.attention)


def resolve(args: argparse.Namespace) -> Preset:
  """The preset with the flags that override it."""
  return dataclasses.replace(PRESETS[args.preset], **{
      name: value for name, value in (("steps", args.steps),
                                       ("dropout", args.dropout),
                                       ("microbatches", args.microbatches),
                                       ("batch", args.batch),
                                       ("attention", args.attention),
                                       ("rounds", args.rounds),
                                       ("round_steps", args.round_steps),
                                       ("context", args.context),
                                       ("text", args.text)) if value is not None},
      # --vocab 0 (chars): characters, the preset's vocab None
      **({} if args.vocab is None else {"vocab": args.vocab or None}))

