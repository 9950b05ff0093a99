"""The training text, its vocabulary (its characters, or a byte-level BPE trained once and
cached) and the corpus of token ids: the batches of a step, the held-out tail."""

from __future__ import annotations

import pathlib
from typing import Any

import jax

from examples import vocabulary as vocab_lib
from examples.corpus import Corpus

from .presets import Preset


def load_vocabulary(preset: Preset, cache: pathlib.Path
                    ) -> tuple[vocab_lib.Text, vocab_lib.Vocabulary]:
  """The preset's text and its vocabulary: its characters, or a byte-level BPE of
  `preset.vocab` tokens read from `cache` (trained on the text and saved there the first
  time, keyed by a digest of the text and the size)."""
  text = vocab_lib.TEXTS[preset.text]()
  if preset.vocab is None:
    return text, vocab_lib.Characters(text)
  return text, vocab_lib.subwords(text, preset.vocab, cache)


def make_corpus(preset: Preset, seed: int, cache: pathlib.Path,
                sharding: Any = None) -> tuple[vocab_lib.Text, Corpus]:
  """The preset's text as token ids (encoded once per vocabulary and kept in `cache`), the
  last 10% held out."""
  text, vocabulary = load_vocabulary(preset, cache)
  return text, Corpus(vocab_lib.encoded(vocabulary, text, cache), vocabulary, preset.context,
                      preset.batch, seed, held_out=0.1, sharding=sharding)


def vocabulary_record(text: vocab_lib.Text, vocabulary: vocab_lib.Vocabulary
                      ) -> dict[str, Any]:
  """What a checkpoint records of its vocabulary (--resume compares the digest)."""
  return {**vocabulary.record(), "text": text.name, "text_digest": text.digest}


def describe_vocabulary(record: dict[str, Any]) -> str:
  return (f"{record['kind']} of {record['size']:,} tokens (digest {record['digest'][:12]}) "
          f"of the {record['text']}")


def step_batches(corpus: Corpus, step: int, microbatches: int
                 ) -> list[tuple[jax.Array, jax.Array]]:
  return [corpus.batch_at(step * microbatches + m) for m in range(microbatches)]

