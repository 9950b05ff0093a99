"""The examples' texts and token vocabularies: characters, or a byte-level BPE trained once.

Two texts: `fables` (examples/data/corpus.txt, 320 KB of generated fables, the same on every
machine) and `python_stdlib` (this Python's standard library: its sources, their comments
and docstrings, and pydoc's topic pages; about 10.7 MB on CPython 3.11). Each `Text` carries
a sha256 of the documents it holds, so a digest names the text actually used (the standard
library differs between Python versions and installations).

Two vocabularies: `Characters` (one id per character, in sorted order) and `Subwords`, a
Hugging Face `tokenizers` byte-level BPE of a given size, trained once per (text, size) and
cached as its JSON file in a cache directory; its ids of a text are cached beside it. A
vocabulary's `digest` names it (checkpoints record it). docs/llama.md says which text and
size each Llama preset uses, and why.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import sys
import sysconfig
from typing import Any, Protocol, Sequence

import numpy as np

FABLES = pathlib.Path(__file__).parent / "data" / "corpus.txt"
END_OF_TEXT = "<|endoftext|>"  # between documents (`Subwords` only); id 0
# Directories of the standard library left out: installed packages (not the standard
# library), test suites (not installed by every distribution; much of them test data) and
# codec tables (machine-made mappings, not text).
SKIPPED_DIRECTORIES = frozenset({"site-packages", "dist-packages", "test", "tests",
                                 "idle_test", "encodings", "__pycache__"})


@dataclasses.dataclass(frozen=True)
class Text:
  """A training text.

  Attributes:
    name: what it is, for reports ("fables", "Python 3.11.7 standard library").
    documents: its documents in order (files: held-out text is the end of the last ones).
    digest: sha256 over the documents, each length-prefixed.
  """

  name: str
  documents: tuple[str, ...]
  digest: str

  @classmethod
  def of(cls, name: str, documents: Sequence[str]) -> "Text":
    digest = hashlib.sha256()
    for document in documents:
      data = document.encode()
      digest.update(len(data).to_bytes(8, "little") + data)
    return cls(name, tuple(documents), digest.hexdigest())

  @property
  def characters(self) -> int:
    return sum(map(len, self.documents))


def fables() -> Text:
  """examples/data/corpus.txt as one document."""
  return Text.of("fables", [FABLES.read_text(encoding="ascii")])


def python_stdlib(root: pathlib.Path | None = None) -> Text:
  """The `.py` files of this Python's standard library (`sysconfig`'s "stdlib" path, or
  `root`), in sorted order, without `SKIPPED_DIRECTORIES` and files that are not UTF-8."""
  root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
  documents = []
  for path in sorted(root.rglob("*.py")):
    if SKIPPED_DIRECTORIES.intersection(path.relative_to(root).parts[:-1]):
      continue
    try:
      documents.append(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
      continue
  if not documents:
    raise FileNotFoundError(f"no Python sources under {root}: the standard library text needs "
                            "a Python installed with its library sources (.py files)")
  version = ".".join(map(str, sys.version_info[:3]))
  return Text.of(f"Python {version} standard library ({len(documents)} files)", documents)


TEXTS = {"fables": fables, "stdlib": python_stdlib}


class Vocabulary(Protocol):
  """Token ids of text and back."""

  size: int
  digest: str

  def encode(self, documents: Sequence[str]) -> np.ndarray: ...

  def decode(self, ids: Any) -> str: ...

  def record(self) -> dict[str, Any]: ...


class Characters:
  """One id per character of a text, in sorted order; documents are concatenated."""

  def __init__(self, text: Text):
    self.chars = sorted(set("".join(text.documents)))
    self.index = {c: i for i, c in enumerate(self.chars)}
    self.size = len(self.chars)
    self.digest = hashlib.sha256(("characters\0" + "".join(self.chars)).encode()).hexdigest()

  def encode(self, documents: Sequence[str]) -> np.ndarray:
    return np.array([self.index[c] for d in documents for c in d], np.int32)

  def decode(self, ids: Any) -> str:
    return "".join(self.chars[int(i)] for i in ids)

  def record(self) -> dict[str, Any]:
    return {"kind": "characters", "size": self.size, "digest": self.digest}

  def __str__(self) -> str:
    return f"{self.size} characters"


class Subwords:
  """A byte-level BPE (`tokenizers`): any text encodes and decodes back exactly.

  Made by `subwords` (trained, or read from the cache). `digest` is the sha256 of its JSON
  file (vocabulary, merges and settings), `trained` whether this process trained it.
  """

  def __init__(self, tokenizer: Any, path: pathlib.Path, *, trained: bool):
    self.tokenizer, self.path, self.trained = tokenizer, path, trained
    self.size = tokenizer.get_vocab_size()
    self.digest = hashlib.sha256(path.read_bytes()).hexdigest()
    self.end_of_text = tokenizer.token_to_id(END_OF_TEXT)

  def encode(self, documents: Sequence[str]) -> np.ndarray:
    """The documents' ids (encoded in parallel), `END_OF_TEXT` between them."""
    parts: list[Any] = []
    for encoding in self.tokenizer.encode_batch(list(documents), add_special_tokens=False):
      if parts:
        parts.append([self.end_of_text])
      parts.append(encoding.ids)
    return np.concatenate([np.asarray(p, np.int32) for p in parts]) if parts else np.zeros(
        0, np.int32)

  def decode(self, ids: Any) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

  def record(self) -> dict[str, Any]:
    return {"kind": "byte-level BPE", "size": self.size, "digest": self.digest,
            "file": str(self.path)}

  def __str__(self) -> str:
    return f"a byte-level BPE of {self.size:,} tokens ({self.path.name})"


def _atomic_write(path: pathlib.Path, write: Any) -> None:
  """`write(temporary path)`, then the file renamed to `path`: a cache entry is whole or
  absent, also when two processes make it at once."""
  temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  try:
    write(temporary)
    os.replace(temporary, path)
  finally:
    temporary.unlink(missing_ok=True)


def subwords(text: Text, size: int, cache: pathlib.Path) -> Subwords:
  """The byte-level BPE of `size` tokens for `text` (fewer where the text has too few pairs
  to merge): read from `cache`, else trained on it and saved there (once per text digest and
  size).

  Raises:
    ValueError: `size` does not exceed the 256 byte tokens and `END_OF_TEXT`.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  alphabet = pre_tokenizers.ByteLevel.alphabet()
  if size <= len(alphabet) + 1:
    raise ValueError(f"a byte-level BPE of {size} tokens has no merges: it starts from "
                     f"{len(alphabet)} byte tokens and {END_OF_TEXT}; pass a size above "
                     f"{len(alphabet) + 1}, or characters")
  settings = {"model": "byte-level BPE", "size": size, "text": text.digest,
              "special": [END_OF_TEXT]}
  key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
  path = cache / f"bpe-{size}-{key}.json"
  if path.exists():
    return Subwords(Tokenizer.from_file(str(path)), path, trained=False)
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=[END_OF_TEXT],
                                initial_alphabet=alphabet, show_progress=False)
  tokenizer.train_from_iterator(text.documents, trainer, length=len(text.documents))
  cache.mkdir(parents=True, exist_ok=True)
  _atomic_write(path, lambda temporary: tokenizer.save(str(temporary)))
  return Subwords(tokenizer, path, trained=True)


def encoded(vocabulary: Vocabulary, text: Text, cache: pathlib.Path | None = None
            ) -> np.ndarray:
  """The ids of `text`; for `Subwords` with a `cache`, encoded once per (vocabulary, text)
  and kept there as .npy."""
  if not isinstance(vocabulary, Subwords) or cache is None:
    return vocabulary.encode(text.documents)
  path = cache / f"ids-{vocabulary.digest[:16]}-{text.digest[:16]}.npy"
  if path.exists():
    return np.load(path)
  ids = vocabulary.encode(text.documents)
  cache.mkdir(parents=True, exist_ok=True)

  def save(temporary: pathlib.Path) -> None:
    with open(temporary, "wb") as f:  # a file object: np.save adds no ".npy" to the name
      np.save(f, ids)

  _atomic_write(path, save)
  return ids
