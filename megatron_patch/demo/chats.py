"""A small chat set built offline for supervised fine-tuning demos and tests: conversations whose answers follow
from the question (arithmetic, word facts, list operations), so a fine-tuned model's validation loss on the
answers can fall. Single- and multi-turn, `messages` and `prompt`/`response` records, lengths from a few tokens to a
few hundred (a chat-like spread), deterministic for a seed.

    python -m megatron_patch.demo.chats --output chats.jsonl [--count 2000] [--seed 0]
    python -m megatron_patch.demo.chats --texts chats.jsonl --output texts.jsonl   (their text, to train a tokenizer)
"""
from __future__ import annotations

import argparse
import json
import random
from typing import Dict, List

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
ANIMALS = {"cat": "meows", "dog": "barks", "cow": "moos", "duck": "quacks", "lion": "roars", "owl": "hoots"}
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _turn(rng: random.Random) -> tuple:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        animal = rng.choice(sorted(ANIMALS))
        return f"What sound does a {animal} make?", f"A {animal} {ANIMALS[animal]}."
    if kind == 2:
        n = rng.randrange(10)
        return f"Write the digit {n} as a word.", f"The digit {n} is written {NUMBERS[n]}."
    if kind == 3:
        items = rng.sample(COLOURS, rng.randint(2, 6))
        return (f"Sort these colours alphabetically: {', '.join(items)}.",
                f"In alphabetical order: {', '.join(sorted(items))}.")
    words = rng.sample(COLOURS + sorted(ANIMALS), rng.randint(3, 12))
    return f"Repeat these words in reverse order: {' '.join(words)}", " ".join(reversed(words))


def conversation(rng: random.Random) -> Dict:
    """One record: a prompt/response pair, or `messages` with 1-4 exchanges and sometimes a system turn."""
    if rng.random() < 0.3:
        prompt, response = _turn(rng)
        return {"prompt": prompt, "response": response}
    messages: List[Dict[str, str]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "You answer briefly and exactly."})
    for _ in range(rng.choice([1, 1, 2, 3, 4])):
        prompt, response = _turn(rng)
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return {"messages": messages}


def write(path: str, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps(conversation(rng)) + "\n")


def write_texts(chats: str, path: str) -> None:
    """The contents of a chat JSONL as {"text": ...} documents, one per conversation (a tokenizer's training text)."""
    with open(chats) as f, open(path, "w") as g:
        for line in f:
            r = json.loads(line)
            parts = [m["content"] for m in r["messages"]] if "messages" in r else [r["prompt"], r["response"]]
            g.write(json.dumps({"text": " ".join(parts)}) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True)
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--texts", default=None, help="write the text of this chat JSONL instead of a new chat set")
    a = p.parse_args(argv)
    if a.texts:
        write_texts(a.texts, a.output)
        print(f"wrote the text of {a.texts} to {a.output}")
        return
    write(a.output, a.count, a.seed)
    print(f"wrote {a.count} conversations to {a.output}")


if __name__ == "__main__":
    main()
