"""Writes corpus.txt: self-written short fables from a small grammar (no download, no licence).

The text is what `examples/train_gpt.py` trains on. It is regular enough for a tiny
character-level model to learn spelling, punctuation and sentence shape in a few minutes,
and varied enough that the loss keeps falling for a while. Run it again to reproduce the
file byte for byte: `python -m examples.data.make_corpus`.
"""

from __future__ import annotations

import pathlib
import random

NAMES = ["Ada", "Bram", "Cleo", "Dov", "Elin", "Finn", "Greta", "Hugo", "Iris", "Jonas",
         "Kira", "Lev", "Mira", "Nils", "Olga", "Pim", "Quin", "Rosa", "Sven", "Tova"]
ANIMALS = ["fox", "heron", "badger", "otter", "crow", "hare", "owl", "wolf", "mole", "wren",
           "toad", "stag", "lynx", "goose", "beetle", "salmon"]
PLACES = ["the mill", "the old bridge", "the river", "the pine wood", "the market",
          "the lighthouse", "the orchard", "the hill", "the harbour", "the quarry",
          "the meadow", "the well", "the bakery", "the library", "the marsh"]
THINGS = ["a lantern", "a copper key", "a loaf of bread", "a map", "a fishing net",
          "a blue stone", "a letter", "a clock", "a bell", "a kettle", "a rope",
          "a basket of apples", "a feather", "a compass", "a wooden box"]
ADJECTIVES = ["clever", "tired", "patient", "proud", "quiet", "hungry", "brave", "careful",
              "curious", "greedy", "gentle", "stubborn", "cheerful", "honest", "restless"]
WEATHER = ["It was raining.", "The wind was cold.", "The sun was low.", "Snow lay on the roofs.",
           "Fog hid the fields.", "The night was clear.", "It was the first warm day."]
VERBS = ["found", "lost", "carried", "mended", "hid", "traded", "painted", "buried", "opened",
         "counted", "shared", "polished"]
SAYINGS = ["Slow work is still work.", "A shared loaf is never small.",
           "The river keeps what you do not watch.", "Ask before you take.",
           "Every key was made for a door.", "Pride is a heavy coat.",
           "The quiet ones hear the most.", "What you mend, you keep.",
           "Count twice, carry once.", "A good map is worth a long walk."]
ENDINGS = ["And so", "That is why", "Since that day", "Even now"]


def _sentence_case(text: str) -> str:
  return text[0].upper() + text[1:]


def fable(rng: random.Random, number: int) -> str:
  """One fable: a title, four to seven sentences of story, a line of dialogue, a moral."""
  name, other = rng.sample(NAMES, 2)
  animal = rng.choice(ANIMALS)
  adjective, adjective2 = rng.sample(ADJECTIVES, 2)
  place, place2 = rng.sample(PLACES, 2)
  thing = rng.choice(THINGS)
  bare = thing.split(" ", 1)[1]
  verb = rng.choice(VERBS)
  lines = [f"{number}. The {adjective.title()} {animal.title()} of {place[4:].title()}", ""]
  story = [
      rng.choice(WEATHER),
      f"{name} the {animal} lived near {place} and was known to be {adjective}.",
      f"One morning {name} {verb} {thing} by {place2}.",
      f"{other}, who was {adjective2}, saw it and came closer.",
  ]
  if rng.random() < 0.6:
    story.append(f"\"Is that {bare} yours?\" asked {other}.")
    story.append(rng.choice([
        f"\"It is mine now,\" said {name}, and held it tight.",
        f"\"I do not know,\" said {name}. \"Let us find out together.\"",
        f"\"No,\" said {name}, \"but someone at {place2} will miss it.\"",
    ]))
  steps = rng.randint(1, 3)
  for _ in range(steps):
    story.append(rng.choice([
        f"They walked to {rng.choice(PLACES)} and asked everyone they met.",
        f"The {rng.choice(ANIMALS)} there had seen nothing at all.",
        f"{_sentence_case(rng.choice(THINGS))} lay in the grass, but it was not the same.",
        f"By evening {name} was {rng.choice(ADJECTIVES)} and {other} was "
        f"{rng.choice(ADJECTIVES)}.",
        f"{rng.choice(WEATHER)} Still they went on.",
    ]))
  story.append(rng.choice([
      f"At last the owner came, thanked them both, and gave {name} a warm supper.",
      f"Nobody came for the {bare}, so {name} and {other} kept it at {place}.",
      f"{name} put the {bare} back where it was, and nobody ever knew.",
      f"In the end {other} took the {bare} home, and {name} did not mind.",
  ]))
  lines.append(" ".join(story))
  lines.append("")
  lines.append(f"{rng.choice(ENDINGS)} they say at {place}: {rng.choice(SAYINGS)}")
  return "\n".join(lines) + "\n\n"


def main(target_bytes: int = 320_000, seed: int = 0) -> None:
  rng = random.Random(seed)
  parts, size, number = [], 0, 1
  while size < target_bytes:
    text = fable(rng, number)
    parts.append(text)
    size += len(text.encode())
    number += 1
  path = pathlib.Path(__file__).with_name("corpus.txt")
  path.write_text("".join(parts), encoding="ascii")
  print(f"wrote {path} ({size:,} bytes, {number - 1} fables)")


if __name__ == "__main__":
  main()
