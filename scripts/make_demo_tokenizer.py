"""Train krait's bundled demo tokenizer and write it to krait/data/demo_tokenizer.json.

A byte-level BPE tokenizer (vocab size 512) trained on a fixed English text held in this file,
so any unicode string round-trips and the output is the same on every run:

    python scripts/make_demo_tokenizer.py [--check]

`--check` compares a fresh build with the committed file instead of writing it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]  # ids 0, 1, 2
OUTPUT = Path(__file__).resolve().parent.parent / "krait" / "data" / "demo_tokenizer.json"

TRAINING_TEXT = """\
The river town woke slowly in the autumn. Fog lay on the water until the sun climbed over the
eastern hills, and then the boats came out one by one, their engines coughing in the cold air.
Fishermen called to each other across the harbor, and the gulls answered them with long, thin
cries. On the hill above the docks, the baker opened her shutters and set the first loaves of the
day on the wooden shelf by the window, where the smell of warm bread drifted down the street.

Every morning the same people walked past the bakery in the same order. First came the
schoolteacher, who carried a leather bag full of papers and always stopped to buy two rolls.
Then came the old clockmaker, who lived alone above his shop and spoke to nobody until he had
finished his coffee. After him came the twins from the farm at the edge of the valley, pulling a
cart of apples, pears and pumpkins to the market square. The baker knew them all by name, and she
knew what each of them would ask for before they opened their mouths.

A good machine is much like that bakery. It does the same small things again and again, quietly
and well, and nobody notices it until it stops. The engineers who build such machines learn to
value patience over speed at first, because a system that is correct can always be made faster,
while a fast system that gives the wrong answer is worth nothing at all. They measure before they
change anything, they write down what they measured, and they keep the notes where others can
read them. When a test fails, they do not guess; they read the error, form a small idea of what
went wrong, and check that idea against the facts.

In the winter the river froze along its banks, and the children of the town skated on the still
water behind the old mill. Their parents stood on the shore with cups of tea and talked about the
price of wood, the weather in the mountains, and the new road that the council had promised for
many years but never built. Some said the road would bring visitors and money; others said it
would bring noise and strangers, and that the town was better as it was. Nobody could say for
certain, and so the argument went on from one winter to the next, as comfortable as an old coat.

The library stood at the corner of the square, a narrow building of grey stone with tall windows.
Inside, the shelves reached up to the ceiling, and a rolling ladder let the librarian climb to the
highest books. She had read most of them, or said she had, and she could find any title in a
moment without looking at the catalogue. Students came in the afternoons to study history,
mathematics and languages. They learned that a word can carry a long story inside it, that
numbers can describe the path of a planet or the growth of a tree, and that a careful question is
often more useful than a quick answer.

Language itself is a kind of machine. Letters join into words, words into sentences, and
sentences into ideas that travel from one mind to another. A reader does not see every letter;
the eye jumps along the line and the mind fills in what it expects. That is why a small spelling
mistake can pass unnoticed, and why a surprising word can stop a reader in the middle of a page.
Writers learn to use this, placing the important word where the eye will land and the ear will
hear it. Good sentences are short when the thought is simple and long when the thought must turn
and gather its parts before it can rest.

In spring the town held a festival by the water. There were boats painted in bright colors,
music from the bandstand, and tables covered with food: fresh fish, cheese, honey, cakes and
strawberries from the southern fields. The clockmaker repaired the great clock on the tower each
year just before the festival, and each year the whole town gathered at noon to hear it strike
twelve. When the last bell faded, the children ran to the river, the musicians began to play, and
for one afternoon everyone forgot about the road, the weather and the price of wood.

Travelers who passed through the town often wrote about it in their letters. They described the
quiet streets, the friendly shopkeepers and the light on the water in the evening. One of them, a
painter from the capital, stayed for a whole summer and filled three notebooks with drawings of
the harbor. Years later, when she was famous, she said that the small river town had taught her
to look slowly, to wait for the light, and to paint only what she had truly seen. Her pictures of
the boats and the mill still hang in the museum, and visitors stand in front of them for a long
time without speaking.

Numbers and names appear everywhere in such a place: the year 1887 carved above the door of the
mill, the twelve steps up to the church, the 42 boats in the harbor on a busy day, the three
bridges and the seven streets that meet at the square. A careful visitor can read the history of
the town in these details, the way a doctor reads the health of a patient in small signs that
others overlook. Questions lead to answers, and answers lead to better questions; that is how
knowledge grows, slowly and steadily, like the rings of a tree or the layers of stone in a cliff.
"""


def build_tokenizer() -> Tokenizer:
    """Train the demo tokenizer from TRAINING_TEXT; the result does not depend on the run."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.split("\n\n"), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"trained vocab has {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}"
        )
    for i, tok in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(tok) != i:
            raise RuntimeError(f"special token {tok} did not get id {i}")
    return tokenizer


def to_json(tokenizer: Tokenizer) -> str:
    """The tokenizer as stable, human-diffable JSON text."""
    return json.dumps(json.loads(tokenizer.to_str()), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed file")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = to_json(build_tokenizer())
    if args.check:
        same = args.output.exists() and args.output.read_text(encoding="utf-8") == text
        print(f"{args.output}: {'up to date' if same else 'differs from a fresh build'}")
        return 0 if same else 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output} ({VOCAB_SIZE} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
