"""The examples' vocabularies: byte-level BPE round-trips and is trained once (cached), and
the Python standard library's text."""

from __future__ import annotations


import numpy as np
import pytest

from examples import vocabulary


def test_subword_vocabulary_round_trips_and_is_trained_once(monkeypatch, tmp_path):
  documents = [vocabulary.FABLES.read_text()[:20_000],
               "def f(x):\n\treturn x ** 2  # naïve — 東京 ✓\n"]
  text = vocabulary.Text.of("test", documents)
  bpe = vocabulary.subwords(text, 400, tmp_path)
  assert bpe.trained and bpe.size == 400 and list(tmp_path.glob("bpe-400-*.json")) == [bpe.path]
  for document in documents:
    assert bpe.decode(bpe.encode([document])) == document
  ids = vocabulary.encoded(bpe, text, tmp_path)
  assert list(ids).count(bpe.end_of_text) == 1  # between the two documents
  assert bpe.decode(ids) == vocabulary.END_OF_TEXT.join(documents)
  assert len(ids) < text.characters / 2  # subwords: fewer tokens than characters
  # Cached: the same tokenizer read back, not trained again; the ids read, not encoded.
  again = vocabulary.subwords(text, 400, tmp_path)
  assert not again.trained and again.digest == bpe.digest
  monkeypatch.setattr(vocabulary.Subwords, "encode", lambda *_: pytest.fail("encoded again"))
  assert np.array_equal(vocabulary.encoded(again, text, tmp_path), ids)
  assert len(list(tmp_path.iterdir())) == 2  # the tokenizer and the ids, no temporaries
  # Another size or another text: another tokenizer.
  monkeypatch.undo()
  assert vocabulary.subwords(text, 300, tmp_path).digest != bpe.digest
  other = vocabulary.Text.of("test", documents[::-1])
  assert other.digest != text.digest
  assert vocabulary.subwords(other, 400, tmp_path).path != bpe.path
  with pytest.raises(ValueError, match="pass a size above 257"):
    vocabulary.subwords(text, 257, tmp_path)


def test_python_stdlib_text_is_the_standard_librarys_sources():
  text = vocabulary.python_stdlib()
  assert len(text.documents) > 300 and text.characters > 5_000_000
  assert any("class OrderedDict" in d for d in text.documents)  # collections/__init__.py
  assert vocabulary.python_stdlib().digest == text.digest  # the same text, the same digest
